#!/usr/bin/env bash
# The GPU checks for CUDA workers, in one go (about 6-8 min on one GPU and 16 cores):
#   1. every device-parametrised test on cuda (mirror, buckets, prefetch, embeddings, the
#      exactness of one worker under ssp:0 against torch.optim, with and without overlap,
#      gradients copied from the device into the shared-memory push segment),
#      and the Fashion-MNIST example with --device cuda and 2 workers against the same job
#      on the CPU (test_two_cuda_workers_reach_the_accuracy_of_two_cpu_workers);
#   2. the example once more by hand, --device cuda, 2 workers, its report kept;
#   3. benchmarks/gpu_step.py --quick: 25 M and 100 M step time against torch.optim.
# Needs a Python with a CUDA build of torch and hogshard installed (PYTHON=..., default .venv
# or python3). Results go to $GPU_CHECK_OUT (default /tmp/hogshard-gpu-check). Without a CUDA
# device it says so and exits 0; otherwise it exits 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT="${GPU_CHECK_OUT:-/tmp/hogshard-gpu-check}"
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: $("$PYTHON" -c 'import torch; print("torch", torch.__version__, torch.version.cuda or "CPU-only")' 2>&1) sees no CUDA device; nothing checked" >&2
  exit 0
fi
mkdir -p "$OUT"
"$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())' | tee "$OUT/device.txt"
failed=0

"$PYTHON" -m pytest -q -p no:cacheprovider -rs -k cuda \
  tests/unit/test_device_mirror.py tests/unit/test_overlap.py \
  tests/integration/test_prefetch.py tests/integration/test_embedding_device.py \
  tests/integration/test_training.py tests/integration/test_shm.py 2>&1 | tee "$OUT/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

timeout 300 "$PYTHON" -m hogshard launch --servers 2 --workers 2 --no-progress -- \
  "$PYTHON" examples/fashion_mnist.py --device cuda --epochs 1 --rule adam --lr 0.003 \
  --batch 32 --limit 6000 --report "$OUT/fashion_cuda.json" > "$OUT/fashion_cuda.log" 2>&1 \
  || { failed=1; tail -40 "$OUT/fashion_cuda.log"; }
[ -f "$OUT/fashion_cuda.json" ] && "$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1])); print("fashion cuda:", r["device"], r["workers"], "workers, accuracy", r["test_accuracy"])' "$OUT/fashion_cuda.json"

timeout 300 "$PYTHON" benchmarks/gpu_step.py --quick --json "$OUT/gpu_step.json" || failed=1

echo "gpu_check: results in $OUT; $([ $failed -eq 0 ] && echo all passed || echo SOME FAILED)"
exit $failed
