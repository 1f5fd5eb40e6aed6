"""``hogshard report RUN.json [RUN2.json ...] -o plot.png``: loss, accuracy and staleness over
time from the examples' reports (their ``history`` rows), one line per run.

Example::

    hogshard launch --workers 4 -- python examples/fashion_mnist.py --report async.json
    hogshard report async.json --output async.png
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from hogshard.proto.errors import ConfigError

COLUMNS = ["seconds", "step", "loss", "batch_accuracy", "staleness_mean", "staleness_p99"]


def load_run(path: Path) -> dict[str, Any]:
    """A report with its history as {column: [values]}; ConfigError when it has none."""
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: expected a JSON report ({err})") from None
    rows = report.get("history")
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{path}: no 'history' samples; expected a report written by "
                          "examples/fashion_mnist.py --report")
    columns = report.get("history_columns", COLUMNS)
    report["series"] = {name: [row[i] for row in rows] for i, name in enumerate(columns)}
    return report


def label_of(report: dict[str, Any], path: Path) -> str:
    parts = []
    for key in ("policy", "codec"):
        if report.get(key) not in (None, "none"):
            parts.append(str(report[key]))
    if report.get("workers"):
        parts.append(f"{report['workers']} workers")
    return " / ".join(parts)


def plot_runs(paths: list[Path], output: Path, title: str | None = None) -> Path:
    """Draw loss, batch accuracy (final test accuracy dashed) and staleness against seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(path, load_run(path)) for path in paths]
    labels = [label_of(run, path) for path, run in runs]
    if len(set(labels)) < len(labels):  # same settings: tell the runs apart by file name
        labels = [f"{p.stem}: {label}" for (p, _), label in zip(runs, labels, strict=True)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    for index, ((_, run), label) in enumerate(zip(runs, labels, strict=True)):
        color = f"C{index}"
        s = run["series"]
        axes[0].plot(s["seconds"], s["loss"], color=color, label=label)
        axes[1].plot(s["seconds"], s["batch_accuracy"], color=color, alpha=0.8, label=label)
        if isinstance(run.get("test_accuracy"), int | float):
            axes[1].axhline(run["test_accuracy"], color=color, linestyle="--", linewidth=1)
        axes[2].plot(s["seconds"], s["staleness_mean"], color=color, label=f"{label} mean")
        axes[2].plot(s["seconds"], s["staleness_p99"], color=color, linestyle=":",
                     label=f"{label} p99")
    for ax, name in zip(axes, ["training loss (EMA)",
                               "batch accuracy (dashed: final test accuracy)",
                               "staleness since the start (clocks)"], strict=True):
        ax.set_title(name)
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False,
                                                                 path_type=Path))
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG to write (default: the first RUN with .png)")
@click.option("--title", default=None, help="a title over the three panels")
def report(runs: tuple[Path, ...], output: Path | None, title: str | None) -> None:
    """Plot loss, accuracy and staleness over time from one or more RUN.json reports."""
    try:
        written = plot_runs(list(runs), output or runs[0].with_suffix(".png"), title)
    except ConfigError as err:
        raise click.ClickException(err.message) from None
    click.echo(str(written))
