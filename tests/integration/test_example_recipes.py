"""The Fashion-MNIST example's recipe options (``--schedule``, ``--warmup``,
``--weight-decay`` with no decay on biases, ``--clip``) mean through the servers what they mean
with torch.optim: one worker under ``ssp:0`` ends on the weights of the same recipe run
locally, and a job of 2 workers with them trains."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_recipes import TOLERANCE
from tests.integration.test_training import EXAMPLE, PYTHON, _launch

BASE = ["--lr", "0.05", "--limit", "2048", "--epochs", "2"]
RECIPE = ["--weight-decay", "0.01", "--clip", "0.5", "--warmup", "0.2"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180, method="signal")
@pytest.mark.parametrize(("schedule", "rule"), [("cosine", "momentum"), ("onecycle", "sgd")])
def test_one_worker_ssp0_recipe_is_the_local_recipe(procs, tmp_path: Path, schedule: str,
                                                    rule: str) -> None:
    """(onecycle, sgd): OneCycleLR must not cycle a momentum plain sgd does not have (torch's
    SGD groups hold momentum 0, which it would turn on in the local run only). The other
    schedules (step, onecycle with momentum) are torch's own schedulers over the same groups:
    tests/integration/test_recipes.py holds them equal to torch.optim."""
    flags = ["--rule", rule, *BASE, *RECIPE, "--schedule", schedule]
    cluster, local = tmp_path / "cluster.npy", tmp_path / "local.npy"
    report = tmp_path / "report.json"
    local_run = procs.spawn("local", [PYTHON, EXAMPLE, "--local", *flags,
                                      "--save-weights", str(local)])
    _launch(procs, f"launch-{schedule}", ["--servers", "2", "--workers", "1", "--policy",
                                          "ssp:0"],
            [*flags, "--save-weights", str(cluster), "--report", str(report)])
    assert local_run.wait(150.0) == 0, local_run.tail()
    a, b = np.load(cluster), np.load(local)
    assert a.shape == b.shape and np.all(np.isfinite(a))
    diff = float(np.max(np.abs(a - b)))
    # the tolerance of the recipe tests (tests/integration/test_recipes.py): the rules round
    # as torch does up to an ulp a step; (onecycle, momentum) measured 1.1e-6 to 1.6e-5 apart
    assert diff <= TOLERANCE, f"{schedule}: cluster and local weights differ by {diff:.3g}"
    # the recipe did something: without it the same run ends elsewhere
    plain = tmp_path / "plain.npy"
    code, out = procs.run("plain", [PYTHON, EXAMPLE, "--local", "--rule", rule, *BASE,
                                    "--save-weights", str(plain)], timeout=150.0)
    assert code == 0, out
    assert float(np.max(np.abs(np.load(plain) - b))) > 1e-3
    saved = json.loads(report.read_text())
    assert (saved["schedule"], saved["weight_decay"], saved["clip"]) == (schedule, 0.01, 0.5)
