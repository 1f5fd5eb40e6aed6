"""A torch recipe means with ``PSOptimizer`` what it means with ``torch.optim``: one worker under
``ssp:0`` (2 servers, real processes) ends with the weights ``torch.optim`` gives in the same
process, for every rule with parameter groups, lr schedulers (StepLR, a LinearLR warm-up into
CosineAnnealingLR, OneCycleLR moving momentum and betas, ReduceLROnPlateau), a user's own lr
change, ``clip_grad_norm_`` with overlap on and off on a model of several buckets, gradient
accumulation with overlap, a GradScaler with clipping whose first steps overflow (skipped
on both sides), and an optimizer and scheduler restored from their state dicts mid-run; and
(``contract``) that it is a ``torch.optim.Optimizer`` whose groups hold every hyperparameter,
with a ConfigError naming the group for a hyperparameter the rule lacks. tests/integration/recipe_worker.py runs every recipe in one job."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import PYTHON, REPO, ProcessManager

WORKER = REPO / "tests" / "integration" / "recipe_worker.py"
RECIPES = ["groups-sgd", "groups-momentum", "groups-adagrad", "groups-adam", "groups-adamw",
           "groups-rmsprop", "steplr", "warmup-cosine", "onecycle-momentum", "onecycle-sgd",
           "onecycle-adam",
           "plateau", "manual-lr", "clip-overlap", "clip-no-overlap", "accumulate-overlap",
           "scaler-clip", "resume", "contract"]
#: float32 rounding of the two implementations over 12 steps
TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    procs = ProcessManager(tmp_path_factory.mktemp("recipes"))
    try:
        job = procs.hogshard("launch", "launch", "--servers", "2", "--workers", "1",
                             "--policy", "ssp:0", "--no-progress", "--", PYTHON, str(WORKER),
                             *RECIPES)
        code = job.wait(180.0)
        assert code == 0, f"hogshard launch exited with {code}\n{job.tail(60)}"
        found = {}
        for line in job.output().splitlines():
            start = line.find('{"recipe"')
            if start >= 0:
                entry = json.loads(line[start:])
                found[entry["recipe"]] = entry
        yield found
    finally:
        procs.cleanup()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
@pytest.mark.parametrize("recipe", RECIPES)
def test_one_worker_under_ssp0_ends_with_torch_optims_weights(
        results: dict[str, dict[str, Any]], recipe: str) -> None:
    entry = results.get(recipe)
    assert entry is not None, f"no result for {recipe}: {sorted(results)}"
    assert "error" not in entry, entry["error"]
    assert entry["diff"] <= TOLERANCE, f"{recipe}: weights differ by {entry['diff']:.3g}"

