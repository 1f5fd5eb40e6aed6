"""README.md's "Using it" script, as printed, trains through ``hogshard launch`` (2 servers, 2
workers): it reaches a sensible accuracy on every rank after ``client.finish()``, each worker
takes its share of the data from ``client.shard``, the launcher's progress shows the steps the
shards set as the total, and the export of the final checkpoint scores the same."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hogshard.datasets import load_image_dataset
from hogshard.worker.export import load_exported

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

#: The script's printed test accuracy must reach this, by data set (chance is 0.1). Measured
#: on the 2-core dev machine: fashion-mnist 0.87 (3 epochs), sklearn-digits 0.91.
MIN_ACCURACY = {"fashion-mnist": 0.8, "sklearn-digits": 0.6}


def readme_script() -> str:
    """The first ```python block under README.md's "## Using it"."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Using it\n"):]
    section = section[:section.index("\n## ", 1)]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md's Using it section has no python block"
    return match.group(1)


def steps_of(share: int, batch: int = 64, epochs: int = 3) -> int:
    return epochs * -(-share // batch)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
def test_the_readme_script_trains_under_launch(procs, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(readme_script())
    proc = procs.hogshard("launch", "launch", "--servers", "2", "--workers", "2",
                          "--checkpoint-dir", str(tmp_path / "ckpts"), "--",
                          PYTHON, str(script))
    code = proc.wait(200.0)
    output = proc.output()
    assert code == 0, f"hogshard launch exited with {code}\n{proc.tail(80)}"

    assert "registering with the scheduler at" in output, output[-4000:]  # logged as it joins
    # client.finish() gave every rank the job's final weights: the same accuracy on both
    found = dict(re.findall(r"rank (\d): test accuracy (\d\.\d+) on \S+", output))
    assert set(found) == {"0", "1"} and len(set(found.values())) == 1, output[-4000:]
    accuracy = float(found["0"])
    dataset = re.search(r"test accuracy \d\.\d+ on (\S+)", output).group(1)  # type: ignore[union-attr]
    assert accuracy >= MIN_ACCURACY[dataset], output[-4000:]

    # the final checkpoint, exported and loaded into the script's model (two parameter
    # groups: the table holds the weights first), scores what the live model scored
    code, out = procs.run("export", [PYTHON, "-m", "hogshard", "export", "--out",
                                     str(tmp_path / "export"), str(tmp_path / "ckpts")],
                          timeout=60.0)
    assert code == 0, out
    data = load_image_dataset(None)
    model = nn.Sequential(nn.Flatten(), nn.Linear(data.train_x[0].size, 128), nn.ReLU(),
                          nn.Linear(128, data.num_classes))
    load_exported(tmp_path / "export").load_dense(model)
    with torch.no_grad():
        predicted = model(torch.from_numpy(data.test_x)).argmax(1).numpy()
    assert f"{(predicted == data.test_y).mean():.4f}" == found["0"]

    # each rank took steps for its own half of the data (a shard each, not the whole set)
    n = len(load_image_dataset(None).train_y)
    expected = {0: steps_of(len(range(0, n, 2))), 1: steps_of(len(range(1, n, 2)))}
    steps = {int(r): int(s) for r, s in re.findall(r"rank (\d): (\d+) steps", output)}
    assert steps == expected, output[-4000:]
    # the launcher's progress total is what the shards set (no set_progress in the script)
    totals = {int(t) for t in re.findall(r"\[launch\] progress \d+/(\d+)", output)}
    # (how many lines the launcher prints, and at which point, depends on the machine's speed)
    assert totals <= {expected[0], expected[1], sum(expected.values())}, totals
