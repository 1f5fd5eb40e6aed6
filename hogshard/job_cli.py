"""The commands that act on a running job through its scheduler: ``hogshard status``,
``policy set``/``policy show``, ``checkpoint``, ``stop`` and ``export`` (which may first
checkpoint one). ``cli.py`` adds them to the ``hogshard`` command.

Example::

    hogshard policy set ssp:2 --scheduler tcp://10.0.0.1:7000
    hogshard checkpoint /shared/ckpt && hogshard stop
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from hogshard.cli_options import (
    address_check,
    address_option,
    call_scheduler,
    check_policy,
    keys_option,
    option,
    or_exit,
)
from hogshard.proto.config import DEFAULT_SCHEDULER


@click.command()
@address_option("scheduler", default=DEFAULT_SCHEDULER, help="the scheduler's address")
@option("timeout", default=300.0, type=click.FloatRange(min=0.1),
        help="seconds to wait for the checkpoint round to end")
@keys_option
@click.argument("directory", type=click.Path(file_okay=False))
def checkpoint(scheduler: str, timeout: float, keys: str | None, directory: str) -> None:
    """Checkpoint every shard of a running job into DIRECTORY/ckpt-N (atomically; LATEST is
    moved once the manifest is written). DIRECTORY must be a folder the scheduler and every
    server share (docs/CHECKPOINTS.md); a relative one is resolved against this command's
    working folder. Prints the checkpoint's path; exits 1 when the round fails (a server's
    file not in that folder as the scheduler sees it included) or no reply comes within
    --timeout."""
    reply = call_scheduler(scheduler, "checkpoint", {"dir": str(Path(directory).resolve())},
                            timeout, keys)
    total = sum(f["bytes"] for f in reply["files"])
    click.echo(f"{reply['path']} ({len(reply['files'])} files, {total} bytes)")


@click.command()
@address_option("scheduler", default=DEFAULT_SCHEDULER, help="the scheduler's address")
@option("timeout", default=5.0, type=click.FloatRange(min=0.1),
        help="seconds to wait for the scheduler's reply")
@keys_option
def stop(scheduler: str, timeout: float, keys: str | None) -> None:
    """End the running job (admin role): the workers are told and exit 0 at their next
    request, the servers take a final checkpoint where the scheduler has --checkpoint-dir,
    then every server and the scheduler exit 0 (docs/LIFECYCLE.md). Returns once the
    scheduler has taken the request; exits 1 when it does not answer within --timeout."""
    reply = call_scheduler(scheduler, "shutdown", None, timeout, keys)
    checkpoint = ", then a final checkpoint" if reply.get("final_checkpoint") else ""
    workers = int(reply.get("workers", 0))
    click.echo(f"stopping the job at {scheduler}: {workers} live worker"
               f"{'' if workers == 1 else 's'} told to stop{checkpoint}, then the servers and "
               "the scheduler exit")


@click.command("export")
@option("out", required=True, type=click.Path(file_okay=False),
        help="directory to write the export into (created; an export already there is "
        "replaced)")
@option("since", default=None, type=click.Path(exists=True, file_okay=False),
        help="an older checkpoint of the same job: export only the embedding rows that "
        "appeared or changed after it (incremental; dense tables are always whole)")
@click.option("--scheduler", default=None, callback=address_check(),
              # no HOGSHARD_SCHEDULER: it changes what is read
              help="first checkpoint the running job at this scheduler address into SOURCE, "
              "then export that checkpoint")
@option("timeout", default=300.0, type=click.FloatRange(min=0.1),
        help="seconds to wait for the checkpoint round to end")
@keys_option
@click.argument("source", type=click.Path(file_okay=False))
def export(out: str, since: str | None, scheduler: str | None, timeout: float,
           keys: str | None, source: str) -> None:
    """Export a checkpoint for serving: the dense weights and every embedding row as plain
    .npz files with a manifest.json (format: hogshard.proto.export_format), loaded with no
    servers by hogshard.worker.export.load_exported. SOURCE is a checkpoint (ckpt-N) or the
    directory whose LATEST names one. Prints the export's path and what it holds; exits 1
    for a missing, partial or corrupt checkpoint."""
    from hogshard.ps.export import export_checkpoint

    if scheduler is not None:
        reply = call_scheduler(scheduler, "checkpoint", {"dir": str(Path(source).resolve())},
                                timeout, keys)
        source = reply["path"]
    manifest = or_exit(lambda: export_checkpoint(Path(source), Path(out),
                                                 Path(since) if since else None))
    rows = sum(t["rows"] for t in manifest["embeddings"].values())
    click.echo(f"{out} ({manifest['kind']} export of {manifest['checkpoint']}: "
               f"{len(manifest['dense'])} dense tables, {len(manifest['embeddings'])} "
               f"embedding tables, {rows} rows)")


@click.group()
def policy() -> None:
    """Inspect or change the consistency policy of a running job."""


@policy.command("set")
@address_option("scheduler", default=DEFAULT_SCHEDULER, help="the scheduler's address")
@option("timeout", default=5.0, type=click.FloatRange(min=0.1),
        help="seconds to wait for the scheduler's reply")
@keys_option
@click.argument("spec", callback=check_policy)
def policy_set(scheduler: str, timeout: float, keys: str | None, spec: str) -> None:
    """Switch the running job to policy SPEC; every server switches at the same clock.

    \b
    SPEC is one of:
      async          apply each gradient at once
      hardsync       one gradient from each live worker per step (BSP)
      softsync:N     apply the mean of every floor(workers/N) gradients
      ssp:S          a worker may run at most S clocks ahead of the slowest
    optionally followed by +lr=staleness, +lr=mean, +dc=LAMBDA or +maxstale=K
    (docs/POLICIES.md)."""
    reply = call_scheduler(scheduler, "set_policy", {"policy": spec}, timeout, keys)
    click.echo(f"policy {reply['policy']} from clock {reply['from_clock']}")


@policy.command("show")
@address_option("scheduler", default=DEFAULT_SCHEDULER, help="the scheduler's address")
@option("timeout", default=5.0, type=click.FloatRange(min=0.1),
        help="seconds to wait for the scheduler's reply")
@keys_option
def policy_show(scheduler: str, timeout: float, keys: str | None) -> None:
    """Print the job's current policy."""
    click.echo(call_scheduler(scheduler, "status", None, timeout, keys)["policy"])


@click.command()
@address_option("scheduler", default=DEFAULT_SCHEDULER, help="the scheduler's address")
@click.option("--json", "as_json", is_flag=True, help="print the raw status as JSON")
@option("timeout", default=5.0, type=click.FloatRange(min=0.1),
        help="seconds to wait for the scheduler's reply")
@click.option("--watch", "watch_every", default=None, type=click.FloatRange(min=0.1),
              metavar="SECONDS", help="redraw the table every SECONDS until interrupted")
@click.option("--count", default=None, type=click.IntRange(min=1),
              help="with --watch: stop after this many redraws")
@keys_option
def status(scheduler: str, as_json: bool, timeout: float, watch_every: float | None,
           count: int | None, keys: str | None) -> None:
    """Show the job's phase (starting, running, degraded, failed, stopping, done: the first
    line, and an ERROR line naming the cause and next step when the job failed), members,
    clocks, the shard map, updates per second, bytes per second and staleness percentiles (a
    live table with --watch).

    \b
    Exit status (without --watch):
      0  the job is starting, running, degraded (it goes on with a part missing: a
         WARNING line says which), stopping or done
      1  no answer from the scheduler within --timeout (or another error)
      3  the job failed (the ERROR line, or job.cause in --json, says why)"""
    from hogshard.status import EXIT_STATUS, ClusterView

    if as_json:
        reply = call_scheduler(scheduler, "status", None, timeout, keys)
        click.echo(json.dumps(reply, indent=2, sort_keys=True))
        sys.exit(EXIT_STATUS.get(ClusterView(reply).phase()["phase"], 0))
    from hogshard.live_status import make_console, status_panel, watch

    console = make_console()
    if watch_every is None:
        reply = call_scheduler(scheduler, "status", None, timeout, keys)
        console.print(status_panel(reply))
        sys.exit(EXIT_STATUS.get(ClusterView(reply).phase()["phase"], 0))
    try:
        watch(lambda: call_scheduler(scheduler, "status", None, timeout, keys), watch_every,
              console, count)
    except KeyboardInterrupt:
        pass
