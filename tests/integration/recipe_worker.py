"""Torch training recipes run twice in one worker process: with ``torch.optim`` locally, and
with ``PSOptimizer`` against the job's servers, from the same initial model on the same batches
of scikit-learn's digits. Prints one JSON line per recipe: ``{"recipe": NAME, "diff": D}``, the
largest absolute difference between the two final models' weights (or ``"error"``).

Run it as the only worker of a job under ``ssp:0`` (where one worker's steps are sequential)::

    hogshard launch --servers 2 --workers 1 --policy ssp:0 -- \\
        python tests/integration/recipe_worker.py [RECIPE ...]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hogshard import PSClient, PSOptimizer
from hogshard.datasets import load_digits

STEPS = 12
BATCH = 64
#: Small chunks and buckets, so that the model fills several buckets (overlap pushes early).
CHUNK_ELEMS, BUCKET_BYTES = 2048, 16384

#: Our rule name -> (the torch optimizer, its constructor's keyword arguments besides lr).
TORCH = {
    "sgd": (torch.optim.SGD, {}),
    "momentum": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    "adagrad": (torch.optim.Adagrad, {"lr_decay": 0.01}),
    "adam": (torch.optim.Adam, {"amsgrad": True}),
    "adamw": (torch.optim.AdamW, {"weight_decay": 0.05}),
    "rmsprop": (torch.optim.RMSprop, {"momentum": 0.5, "centered": True}),
    "adadelta": (torch.optim.Adadelta, {"rho": 0.95}),
    "adamax": (torch.optim.Adamax, {}),
    "nadam": (torch.optim.NAdam, {"decoupled_weight_decay": True, "weight_decay": 0.01}),
    "radam": (torch.optim.RAdam, {}),
    "rprop": (torch.optim.Rprop, {}),
    "asgd": (torch.optim.ASGD, {"t0": 200.0}),
    "adafactor": (torch.optim.Adafactor, {"weight_decay": 0.01}),
    "muon": (torch.optim.Muon, {"adjust_lr_fn": "match_rms_adamw"}),
}
#: Every torch optimizer the servers run, 1,000 steps each (handed over as a torch optimizer).
LONG = ["sgd", "momentum", "adagrad", "adam", "adamw", "rmsprop", "adadelta", "adamax", "nadam",
        "radam", "rprop", "asgd", "adafactor", "muon"]
LONG_STEPS = 1000


def model(rule: str = "") -> nn.Module:
    """The recipes' model; for Muon, which takes matrices only, without biases and norms."""
    torch.manual_seed(0)
    if rule == "muon":
        return nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(),
                             nn.Linear(128, 10, bias=False))
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.LayerNorm(128), nn.Linear(128, 10))


def groups(net: nn.Module, rule: str) -> list[dict[str, Any]]:
    """No weight decay on biases and norms, and a lower lr for the first layer."""
    first = list(net[0].parameters())
    rest = [p for p in net.parameters() if all(p is not q for q in first)]
    decay = [p for p in rest if p.ndim > 1]
    no_decay = [p for p in rest if p.ndim <= 1]
    return [group for group in ({"params": first, "lr": 0.5 * LR[rule]},
                                {"params": decay, "weight_decay": 0.01},
                                {"params": no_decay, "weight_decay": 0.0}) if group["params"]]


LR = {"sgd": 0.1, "momentum": 0.05, "adagrad": 0.05, "adam": 3e-3, "adamw": 3e-3,
      "rmsprop": 1e-3, "adadelta": 1.0, "adamax": 2e-3, "nadam": 2e-3, "radam": 1e-3,
      "rprop": 1e-3, "asgd": 0.05, "adafactor": 1e-2, "muon": 2e-2}


class Recipe:
    """One recipe: a rule, how to build groups and a scheduler, and what happens between
    backward and step."""

    def __init__(self, rule: str, grouped: bool = False, schedule: str | None = None,
                 clip: float | None = None, overlap: bool | None = None,
                 scaler: bool = False, manual_lr: bool = False,
                 accumulate: bool = False, resume: bool = False, steps: int = STEPS,
                 handed_over: bool = False) -> None:
        self.rule, self.grouped, self.schedule, self.clip = rule, grouped, schedule, clip
        self.overlap, self.scaler, self.manual_lr = overlap, scaler, manual_lr
        self.accumulate, self.resume, self.steps = accumulate, resume, steps
        self.handed_over = handed_over  # PSOptimizer(client, torch.optim.X(...))

    def optimizer(self, net: nn.Module, client: PSClient | None, table: str) -> Any:
        params: Any = groups(net, self.rule) if self.grouped else net.parameters()
        cls, kwargs = TORCH[self.rule]
        if client is None:
            return cls(params, lr=LR[self.rule], **kwargs)
        if self.handed_over:
            return PSOptimizer(client, cls(params, lr=LR[self.rule], **kwargs), table=table,
                               chunk_elems=CHUNK_ELEMS, bucket_bytes=BUCKET_BYTES,
                               overlap=self.overlap)
        return PSOptimizer(client, params, rule=self.rule, table=table, lr=LR[self.rule],
                           chunk_elems=CHUNK_ELEMS, bucket_bytes=BUCKET_BYTES,
                           overlap=self.overlap, **kwargs)

    def scheduler(self, opt: Any) -> Any:
        lr = torch.optim.lr_scheduler
        if self.schedule == "step":
            return lr.StepLR(opt, step_size=max(3, self.steps // 10), gamma=0.5)
        if self.schedule == "warmup-cosine":
            return lr.SequentialLR(opt, [lr.LinearLR(opt, start_factor=0.1, total_iters=4),
                                         lr.CosineAnnealingLR(opt, T_max=self.steps - 4)],
                                   milestones=[4])
        if self.schedule == "onecycle":
            return lr.OneCycleLR(opt, max_lr=2 * LR[self.rule], total_steps=self.steps)
        if self.schedule == "plateau":
            return lr.ReduceLROnPlateau(opt, factor=0.5, patience=1)
        return None

    def restarted(self, net: nn.Module, opt: Any, sched: Any, client: PSClient | None,
                  table: str) -> tuple[nn.Module, Any, Any]:
        """A new model, optimizer and scheduler that load the old ones' state dicts (with
        PSOptimizer the weights come from the servers, as a restarted worker's would)."""
        saved, saved_sched = opt.state_dict(), sched.state_dict()
        fresh = model(self.rule)
        if client is None:
            fresh.load_state_dict(net.state_dict())
        new_opt = self.optimizer(fresh, client, table)
        new_sched = self.scheduler(new_opt)
        new_sched.load_state_dict(saved_sched)
        new_opt.load_state_dict(saved)
        return fresh, new_opt, new_sched

    def train(self, client: PSClient | None, table: str) -> torch.Tensor:
        net = model(self.rule)
        opt = self.optimizer(net, client, table)
        sched = self.scheduler(opt)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=2.0**-40,
                                      growth_interval=3) \
            if self.scaler else None
        data = load_digits()
        x, y = torch.from_numpy(data.train_x).reshape(-1, 64), torch.from_numpy(data.train_y)
        generator = torch.Generator().manual_seed(1)
        for step in range(self.steps):
            index = torch.randint(0, len(y), (BATCH,), generator=generator)
            opt.zero_grad()
            passes = 2 if self.accumulate else 1
            for half in range(passes):
                part = index[half::passes]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is not None):
                    loss = F.cross_entropy(net(x[part]), y[part]) / passes
                (scaler.scale(loss) if scaler else loss).backward()
            if scaler is not None:
                scaler.unscale_(opt)
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), self.clip)
            if self.manual_lr and step == self.steps // 2:
                for group in opt.param_groups:
                    group["lr"] *= 0.3
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if sched is not None:
                sched.step(1.0) if self.schedule == "plateau" else sched.step()
            if self.resume and step == self.steps // 2:  # a new process would do the same
                net, opt, sched = self.restarted(net, opt, sched, client, table)
        if client is not None:
            opt.pull()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


RECIPES: dict[str, Callable[[], Recipe]] = {
    **{f"groups-{rule}": (lambda rule=rule: Recipe(rule, grouped=True)) for rule in TORCH},
    **{f"long-{rule}": (lambda rule=rule: Recipe(rule, grouped=True, schedule="step", clip=1.0,
                                                 steps=LONG_STEPS, handed_over=True))
       for rule in LONG},
    "steplr": lambda: Recipe("momentum", schedule="step"),
    "warmup-cosine": lambda: Recipe("adamw", grouped=True, schedule="warmup-cosine"),
    "onecycle-momentum": lambda: Recipe("momentum", schedule="onecycle"),
    "onecycle-sgd": lambda: Recipe("sgd", schedule="onecycle"),  # it sets SGD's momentum
    "onecycle-adam": lambda: Recipe("adam", schedule="onecycle"),
    "plateau": lambda: Recipe("adam", schedule="plateau"),
    "manual-lr": lambda: Recipe("sgd", grouped=True, manual_lr=True),
    "clip-overlap": lambda: Recipe("sgd", clip=0.5, overlap=True),
    "clip-no-overlap": lambda: Recipe("sgd", clip=0.5, overlap=False),
    "accumulate-overlap": lambda: Recipe("adam", overlap=True, accumulate=True),
    "scaler-clip": lambda: Recipe("adamw", clip=1.0, overlap=True, scaler=True),
    "resume": lambda: Recipe("adam", grouped=True, schedule="step", resume=True),
}


def contract(client: PSClient) -> float:
    """What a torch user may take for granted of an optimizer, and the errors for what a
    parameter server cannot do; 0.0 when all hold (AssertionError otherwise)."""
    from hogshard.proto.errors import ConfigError

    net = model()
    opt = PSOptimizer(client, groups(net, "adamw"), rule="adamw", table="contract", lr=1e-3)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.defaults["weight_decay"] == 0.01 and opt.defaults["betas"] == (0.9, 0.999)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.01, 0.0]
    assert {"lr", "betas", "eps", "weight_decay", "amsgrad"} <= set(opt.param_groups[2])
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
        raise AssertionError("add_param_group after creation was accepted")
    except ConfigError:
        pass
    for cls, words in [(torch.optim.LBFGS, "cannot run torch.optim.LBFGS"),
                       (torch.optim.SparseAdam, "sparse gradients"),
                       (torch.optim.Muon, "2-D parameters only")]:
        try:
            PSOptimizer(client, model().parameters(), cls, table="contract-refused")
            raise AssertionError(f"{cls.__name__} was accepted")
        except ConfigError as err:
            assert words in str(err), err
    handed = PSOptimizer(client, torch.optim.Adadelta(model().parameters(), lr=0.5),
                         table="contract-handed")
    assert handed.defaults["lr"] == 0.5 and handed.defaults["rho"] == 0.9
    assert handed.table.spec.rule["rule"] == "adadelta"
    for bad, words in [({"momentum": 0.9}, "parameter group 1"), ({"nesterov": True},
                                                                  "'nesterov'")]:
        net = model()
        params = groups(net, "adam")
        params[1].update(bad)
        try:
            PSOptimizer(client, params, rule="adam", table="contract-bad", lr=1e-3)
            raise AssertionError(f"{bad} was accepted")
        except ConfigError as err:
            assert words in str(err), err
    return 0.0


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    client = PSClient.from_env()
    for name in argv or [*RECIPES, "contract"]:
        try:
            if name == "contract":
                result: dict[str, Any] = {"recipe": name, "diff": contract(client)}
            else:
                recipe = RECIPES[name]()
                local = recipe.train(None, name)
                remote = recipe.train(client, name)
                result = {"recipe": name, "diff": float((local - remote).abs().max())}
        except Exception as err:  # reported per recipe; the others still run
            result = {"recipe": name, "error": f"{type(err).__name__}: {err}"}
        print(json.dumps(result), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
