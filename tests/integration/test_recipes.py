"""A torch recipe means with ``PSOptimizer`` what it means with ``torch.optim``: one worker under
``ssp:0`` (2 servers, real processes) ends with the weights ``torch.optim`` gives in the same
process, bit for bit: every torch optimizer the servers run, handed over as a torch optimizer,
over 1,000 steps with parameter groups, StepLR and clipping; every rule with parameter groups, lr schedulers (StepLR, a LinearLR warm-up into
CosineAnnealingLR, OneCycleLR moving momentum and betas, ReduceLROnPlateau), a user's own lr
change, ``clip_grad_norm_`` with overlap on and off on a model of several buckets, gradient
accumulation with overlap, a GradScaler with clipping whose first steps overflow (skipped
on both sides), and an optimizer and scheduler restored from their state dicts mid-run; and
(``contract``) that it is a ``torch.optim.Optimizer`` whose groups hold every hyperparameter,
with a ConfigError naming the group for a hyperparameter the rule lacks. tests/integration/recipe_worker.py runs every recipe in one job."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import PYTHON, REPO, ProcessManager

WORKER = REPO / "tests" / "integration" / "recipe_worker.py"
LONG = ["sgd", "momentum", "adagrad", "adam", "adamw", "rmsprop", "adadelta", "adamax", "nadam",
        "radam", "rprop", "asgd", "adafactor", "muon"]
RECIPES = ["groups-sgd", "groups-momentum", "groups-adagrad", "groups-adam", "groups-adamw",
           "groups-rmsprop", "groups-adadelta", "steplr", "warmup-cosine", "onecycle-momentum", "onecycle-sgd",
           "onecycle-adam",
           "plateau", "manual-lr", "clip-overlap", "clip-no-overlap", "accumulate-overlap",
           "scaler-clip", "resume", "contract"]
#: the servers run torch's own optimizers: the same bits
TOLERANCE = 0.0


def _run(tmp: Any, servers: int, recipes: list[str], wait: float,
         jobs: int = 1) -> dict[str, dict[str, Any]]:
    """Run ``recipes`` split over ``jobs`` jobs at once (each a worker and its servers: one
    worker under ``ssp:0`` waits on its servers, so two jobs keep two cores busy)."""
    procs = ProcessManager(tmp)
    try:
        launched = [procs.hogshard(f"launch{i}", "launch", "--servers", str(servers),
                                   "--workers", "1", "--policy", "ssp:0", "--no-progress", "--",
                                   PYTHON, str(WORKER), *recipes[i::jobs])
                    for i in range(jobs)]
        found = {}
        for job in launched:
            code = job.wait(wait)
            assert code == 0, f"hogshard launch exited with {code}\n{job.tail(60)}"
            for line in job.output().splitlines():
                start = line.find('{"recipe"')
                if start >= 0:
                    entry = json.loads(line[start:])
                    found[entry["recipe"]] = entry
        return found
    finally:
        procs.cleanup()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("recipes"), 2, RECIPES, 180.0)


@pytest.fixture(scope="module")
def long_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("long-recipes"), 1, [f"long-{r}" for r in LONG], 420.0,
                jobs=2)


def _check(results: dict[str, dict[str, Any]], recipe: str) -> None:
    entry = results.get(recipe)
    assert entry is not None, f"no result for {recipe}: {sorted(results)}"
    assert "error" not in entry, entry["error"]
    assert entry["diff"] <= TOLERANCE, f"{recipe}: weights differ by {entry['diff']:.3g}"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
@pytest.mark.parametrize("recipe", RECIPES)
def test_one_worker_under_ssp0_ends_with_torch_optims_weights(
        results: dict[str, dict[str, Any]], recipe: str) -> None:
    _check(results, recipe)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(480, method="signal")
@pytest.mark.parametrize("rule", LONG)
def test_every_torch_optimizer_equals_torch_bit_for_bit_over_1000_steps(
        long_results: dict[str, dict[str, Any]], rule: str) -> None:
    _check(long_results, f"long-{rule}")
