"""The project's synthetic Criteo data written as the Kaggle challenge's ``train.txt``.

facebookresearch/dlrm's ``dlrm_s_pytorch.py`` reads Criteo's Kaggle file
(``--data-generation=dataset --data-set=kaggle --raw-data-file=train.txt``): one sample a line,
tab-separated, the label, 13 integer features and 26 categorical features as hexadecimal
strings. This writes :func:`hogshard.recsys_data.synthetic_criteo` (labels from a hidden
model, so they can be learned; its ``oracle_auc`` is printed) in that format. A dense feature
``x`` is written as the integer ``round(expm1(clip(x, -4.5, 4.5) + 5))``, so the script's own
``log(1 + I)`` gives back ``x + 5`` to within rounding; an id is written as 8 hex digits.

    .venv/bin/python benchmarks/criteo_kaggle.py --samples 200000 --vocab 10000 --out /tmp/kaggle/train.txt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from hogshard.recsys_data import RecsysDataset, synthetic_criteo


def kaggle_lines(data: RecsysDataset) -> list[str]:
    """The samples of ``data`` (every one, in order) as Kaggle ``train.txt`` lines.

    Example::

        >>> lines = kaggle_lines(synthetic_criteo(3, seed=0, vocab=100))
        >>> len(lines), len(lines[0].rstrip("\\n").split("\\t"))
        (3, 40)
    """
    ints = np.rint(np.expm1(np.clip(data.dense, -4.5, 4.5) + 5.0)).astype(np.int64)
    lines = []
    for label, row, ids in zip(data.labels, ints, data.sparse, strict=True):
        fields = [str(int(label))] + [str(v) for v in row] + [f"{int(i):08x}" for i in ids]
        lines.append("\t".join(fields) + "\n")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--vocab", type=int, default=10_000, help="ids per categorical feature")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="the train.txt to write")
    args = parser.parse_args()
    if args.vocab >= 2**31:
        parser.error("--vocab must be below 2^31 (the script reads ids as int32)")
    data = synthetic_criteo(args.samples, seed=args.seed, vocab=args.vocab)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        f.writelines(kaggle_lines(data))
    print(f"wrote {args.samples} samples to {args.out}; positives {data.labels.mean():.3f}, "
          f"the hidden model's AUC on its own test split {data.oracle_auc:.4f}")


if __name__ == "__main__":
    main()
