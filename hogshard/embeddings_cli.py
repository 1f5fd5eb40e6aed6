"""``hogshard embeddings``: move the embedding slots of a running job between servers (a job
whose scheduler runs with ``--embedding-slots N``; PROTOCOL.md section 13.4).

``add RANK`` puts a live server (e.g. one started after the job's ``--servers``) into the
placement: the slots it wins by rendezvous hashing move to it, about 1/(S+1) of them.
``drain RANK`` takes one out: its slots and the chunks of its dense tables (those without
replication) move to the others, after which it holds nothing and can be stopped (with
``--wait``, ``drain`` says so, or which dense tables still hold it). Training goes on
meanwhile. ``--wait SECONDS`` returns once nothing is moving (exit 1 if that takes longer);
``show`` prints the placement.

Example::

    hogshard embeddings add --scheduler tcp://sched:7000 --wait 60 2
    hogshard embeddings drain --scheduler tcp://sched:7000 --wait 60 0
    hogshard embeddings show --scheduler tcp://sched:7000
"""

from __future__ import annotations

import time
from typing import Any

import click

from hogshard.cli_options import address_option, call_scheduler, keys_option, option
from hogshard.proto.config import DEFAULT_SCHEDULER

#: Seconds between two looks at the job's status while waiting for the slots to move.
POLL_S = 0.2


def _common(command: Any) -> Any:
    for decorate in (keys_option,
                     option("timeout", default=5.0, type=click.FloatRange(min=0.1),
                            help="seconds to wait for the scheduler's reply"),
                     address_option("scheduler", default=DEFAULT_SCHEDULER,
                            help="the scheduler's address")):
        command = decorate(command)
    return command


def _wait_option(command: Any) -> Any:
    return option("wait", default=0.0, type=click.FloatRange(min=0.0),
                  help="seconds to wait until no slot or dense chunk is moving (0: return "
                  "at once)")(command)


def _per_server(counts: dict[str, int]) -> str:
    return ", ".join(f"server {rank}: {count}" for rank, count in
                     sorted(counts.items(), key=lambda kv: int(kv[0])))


def _line(placement: dict[str, Any]) -> str:
    chunks = placement.get("chunks_moving") or 0
    moving = placement["moving"] - chunks
    backups = placement.get("backups")  # --replication 2
    return (f"{placement['slots']} slots on members {placement['members']} "
            f"({_per_server(placement['owners'])})"
            + (f", backed up on ({_per_server(backups)})" if backups is not None else "")
            + f"; {moving} moving, {placement['moved']} moved so far"
            + (f"; {chunks} dense chunks moving" if chunks else ""))


def _placement(scheduler: str, timeout: float, keys: str | None) -> dict[str, Any]:
    placement = call_scheduler(scheduler, "status", None, timeout, keys).get("embedding_slots")
    if not isinstance(placement, dict):
        raise click.ClickException("this job places no embedding slots (start its scheduler "
                                   "with --embedding-slots N)")
    return placement


def _change(op: str, scheduler: str, timeout: float, keys: str | None, wait: float,
            rank: int) -> None:
    placement = call_scheduler(scheduler, op, {"rank": rank}, timeout, keys)
    click.echo(_line(placement))
    draining = "dense_tables" in placement
    if wait <= 0:
        if placement.get("dense_tables"):
            click.echo(f"the chunks of dense tables {placement['dense_tables']} move from "
                       f"server {rank} too; wait until nothing moves before stopping it")
        return
    deadline = time.monotonic() + wait
    while placement["moving"]:
        if time.monotonic() >= deadline:
            raise click.ClickException(f"{placement['moving']} slots and dense chunks still "
                                       f"moving after {wait:.1f} s")
        time.sleep(POLL_S)
        placement = _placement(scheduler, timeout, keys)
    click.echo(_line(placement))
    if not draining:
        return
    dense = (placement.get("dense") or {}).get(str(rank), [])
    if dense:
        click.echo(_still_holds(rank, dense))
    else:
        click.echo(f"server {rank} holds no embedding slot and no dense chunk: it can be "
                   "stopped")


def _still_holds(rank: int, dense: list[str]) -> str:
    return (f"server {rank} still holds chunks of dense tables {dense} (a move was called "
            "off, or they are replicated): do not stop it (a job without replication fails "
            "when a server holding chunks is gone)")


@click.group()
def embeddings() -> None:
    """Move the embedding slots of a running job between servers (--embedding-slots), and a
    drained server's dense chunks, so that it can then be stopped."""


@embeddings.command("add")
@_common
@_wait_option
@click.argument("rank", type=click.IntRange(min=0))
def add(scheduler: str, timeout: float, keys: str | None, wait: float, rank: int) -> None:
    """Add live server RANK to the embedding placement: the slots it wins move to it."""
    _change("add_embedding_server", scheduler, timeout, keys, wait, rank)


@embeddings.command("drain")
@_common
@_wait_option
@click.argument("rank", type=click.IntRange(min=0))
def drain(scheduler: str, timeout: float, keys: str | None, wait: float, rank: int) -> None:
    """Move every slot of server RANK, and the chunks it holds of dense tables without
    replication, to the others. With --wait, it says once they have moved that RANK can then
    be stopped (no slot and no dense chunk left), or which dense tables still hold it
    (stopping it would end the job)."""
    _change("drain_embedding_server", scheduler, timeout, keys, wait, rank)


@embeddings.command("show")
@_common
def show(scheduler: str, timeout: float, keys: str | None) -> None:
    """Print the slots, the placement's members, how many slots each server holds, and how
    many are moving."""
    click.echo(_line(_placement(scheduler, timeout, keys)))
