"""The ``hogshard`` command: start each role, launch a local job, inspect a running one.

Every flag can also be set by a ``HOGSHARD_<FLAG>`` environment variable, or in a TOML config
file (``hogshard --config job.toml ...``) with one table per command, e.g. ``[scheduler]
policy = "ssp:2"``.

Example::

    hogshard launch --servers 2 --workers 4 --policy async -- python examples/fashion_mnist.py
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

import click

from hogshard.cli_options import (
    address_option,
    check_command,
    checkpoint_options,
    codec_option,
    insecure_option,
    keys_option,
    metrics_options,
    option,
    or_exit,
    policy_option,
    process_security,
    restore_option,
    server_restore_option,
    start_metrics,
)
from hogshard.page_cli import page_options, start_page
from hogshard.proto.config import (
    DEFAULT_EMBEDDING_DISK_MIN_ROWS,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_SCHEDULER,
    env_name,
)
from hogshard.proto.errors import HogshardError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False),
              envvar=env_name("config"), show_envvar=True,
              help="TOML file with a table of defaults per command ([scheduler], [launch], "
              "[policy.set], ...), keys spelt as the flags (heartbeat-timeout = 10); a flag or "
              "HOGSHARD_<FLAG> overrides it; an unknown table or key is refused")
@option("log-level", default="INFO",
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@option("log-format", default="text", type=click.Choice(["text", "logfmt", "json"]),
        help="one line per event with role and rank: text, logfmt (key=value) or json")
@click.version_option(package_name="hogshard")
@click.pass_context
def main(ctx: click.Context, config_file: str | None, log_level: str, log_format: str) -> None:
    """hogshard: a parameter server for asynchronous SGD over ZeroMQ.

    A flag can also be set by the HOGSHARD_<FLAG> variable its --help shows as [env var], or
    in the --config file's table for its command; the command line wins, then the variable,
    then the file. Exit status: 0 on success, 1 on an error (one 'Error: ...' line), 2 on a
    bad flag or value. Options of hogshard itself (--config, --log-level, --log-format) go
    before the command."""
    from hogshard.logs import configure_logging

    ctx.meta["hogshard.log_context"] = configure_logging(
        log_level, log_format, role=ctx.invoked_subcommand or "cli")
    os.environ[env_name("log-format")] = log_format  # processes it starts log alike
    if config_file:
        from hogshard.config_file import config_defaults

        try:
            ctx.default_map = config_defaults(tomllib.loads(Path(config_file).read_text()), main)
        except tomllib.TOMLDecodeError as err:
            raise click.BadParameter(f"{config_file} is not valid TOML: {err}",
                                     param_hint="--config") from None
        except HogshardError as err:
            raise click.BadParameter(f"{config_file}: {err.message}",
                                     param_hint="--config") from None


@main.command()
@address_option("bind", bind=True, default=DEFAULT_SCHEDULER,
                help="address to bind (tcp://HOST:0 picks a port)")
@policy_option()
@option("servers", default=1, type=click.IntRange(min=1),
        help="servers to wait for before placing tables")
@option("heartbeat-interval", default=DEFAULT_HEARTBEAT_INTERVAL, type=click.FloatRange(min=0.01),
        help="seconds between the heartbeats of every member (sent to them at register)")
@option("heartbeat-timeout", default=DEFAULT_HEARTBEAT_TIMEOUT, type=click.FloatRange(min=0.05),
        help="seconds of silence after which a member is declared dead")
@option("replication", default=1, type=click.IntRange(min=1, max=2),
        help="copies of each dense chunk and embedding shard or slot: 2 keeps a backup on "
        "another server")
@option("embedding-slots", default=0, type=click.IntRange(min=0, max=1 << 16),
        help="place embedding rows in this many virtual slots (4096 is a good size), so that "
        "'hogshard embeddings add/drain' can move them between servers mid-job (under "
        "--replication 2 each slot has a backup too); 0: rows hashed over the --servers "
        "servers, fixed")
@option("num-workers", default=None, type=click.IntRange(min=1),
        help="workers in the job: worker ranks stay below it (a worker asking for a higher "
        "rank, or one more than it while every rank is held, is refused); unset: no limit")
@click.option("--exit-when-done/--no-exit-when-done", default=False, show_default=True,
              envvar=env_name("exit-when-done"), show_envvar=True,
              help="end the job (final checkpoint where --checkpoint-dir is set, servers "
              "stopped, scheduler exits 0) once a worker of every rank below --num-workers "
              "has finished; `hogshard launch` and the compose file turn it on")
@option("address-file", default=None, type=click.Path(dir_okay=False),
        help="write the bound address here once listening")
@metrics_options
@checkpoint_options
@restore_option
@keys_option
@insecure_option
@page_options
def scheduler(bind: str, policy: str, servers: int, heartbeat_interval: float,
              heartbeat_timeout: float, replication: int, embedding_slots: int,
              num_workers: int | None, exit_when_done: bool,
              address_file: str | None, metrics_port: int | None,
              metrics_host: str, checkpoint_every: float | None, checkpoint_dir: str | None,
              restore: str | None, keys: str | None, insecure: bool, http_port: int,
              http_host: str | None, http_token: str | None) -> None:
    """Run the scheduler: membership, heartbeats, shard map, consistency policy. Exits 0 when
    the job ends (`hogshard stop`, or --exit-when-done), 143 when stopped by SIGTERM (130:
    Ctrl-C; servers and workers go on and register again with a scheduler restarted at the
    same address); see docs/LIFECYCLE.md. With --http-port it serves a live status page
    (docs/DEPLOYMENT.md)."""
    from hogshard.scheduler.service import Scheduler

    security = process_security(keys, bind, insecure, role=None)
    service = or_exit(lambda: Scheduler(bind, policy, servers, heartbeat_interval,
                                        heartbeat_timeout, checkpoint_every=checkpoint_every,
                                        checkpoint_dir=checkpoint_dir, restore=restore,
                                        security=security, replication=replication,
                                        embedding_slots=embedding_slots,
                                        num_workers=num_workers,
                                        exit_when_done=exit_when_done))
    start_metrics(service, "scheduler", metrics_port, metrics_host)
    if address_file:
        tmp = Path(address_file + ".tmp")
        tmp.write_text(service.address)
        tmp.rename(address_file)
    click.echo(f"scheduler listening on {service.listening}", err=True)
    page = start_page(service, http_port, http_host, http_token, keys)
    _serve(service)
    if page is not None:
        page.finish()


@main.command()
@address_option("scheduler", default=DEFAULT_SCHEDULER, help="the scheduler's address")
@address_option("bind", bind=True, default="tcp://127.0.0.1:0",
                help="data-plane address to bind")
@address_option("advertise", default=None,
        help="address workers should use (default: the bound one, where a wildcard "
        "tcp://*:PORT or tcp://0.0.0.0:PORT becomes tcp://127.0.0.1:PORT: give it on a "
        "multi-host job)")
@option("rank", default=None, type=click.IntRange(min=0),
        help="rank to ask for (unset: the lowest free one); a server restarted under its "
        "rank takes its chunks back")
@option("max-message-bytes", default=1 << 31, type=click.IntRange(min=1024),
        help="largest frame a peer may send (ZMQ_MAXMSGSIZE); libzmq disconnects a peer "
        "that sends a larger one, with no reply")
@click.option("--check-finite/--no-check-finite", default=True, show_default=True,
              envvar=env_name("check-finite"), show_envvar=True,
              help="refuse pushes whose gradients hold NaN or Inf (one read of each gradient; "
                   "of a sparse codec's values only)")
@option("update-threads", default=None, type=click.IntRange(min=0),
        help="threads that apply update rules off the socket loop (0: on the loop); unset: "
              "0 below 8 usable cores, else one per 4 cores up to 4 (see docs/TUNING.md)")
@option("embedding-disk", default=None,
        type=click.Path(file_okay=False, dir_okay=True, writable=True, exists=True),
        help="keep every embedding table declaring num_embeddings >= --embedding-disk-min-rows "
        "in a sparse memory-mapped file in this folder (record id: row id and its optimizer "
        "state; the page cache holds the hot rows; max_rows, ttl and admit_after are "
        "refused; see docs/EMBEDDINGS.md); unset: every table in RAM")
@option("embedding-disk-min-rows", default=DEFAULT_EMBEDDING_DISK_MIN_ROWS,
        type=click.IntRange(min=1),
        help="with --embedding-disk: the smallest num_embeddings that goes to disk (smaller "
        "tables, and tables without num_embeddings, stay in RAM)")
@metrics_options
@server_restore_option
@keys_option
@insecure_option
def server(scheduler: str, bind: str, advertise: str | None, rank: int | None,
           max_message_bytes: int, check_finite: bool, update_threads: int | None,
           embedding_disk: str | None, embedding_disk_min_rows: int,
           metrics_port: int | None, metrics_host: str, restore: str | None, keys: str | None,
           insecure: bool) -> None:
    """Run one parameter-server shard. Exits 0 when the scheduler ends the job; 143 when
    stopped by SIGTERM (130: Ctrl-C), after telling the scheduler it leaves (its backups take
    over at once); 1 on an error, e.g. its --rank held by a live server (CONFLICT) or taken
    over by a newer process (fenced). See docs/LIFECYCLE.md."""
    from hogshard.tuning import default_update_threads, tune_server_process

    tune_server_process()
    from hogshard.ps.disk_table import DiskTier
    from hogshard.ps.server import ShardServer

    disk = DiskTier(embedding_disk, embedding_disk_min_rows) if embedding_disk else None
    if update_threads is None:
        update_threads = default_update_threads()
    security = process_security(keys, bind, insecure, role="server", rank=rank)
    service = or_exit(lambda: ShardServer(scheduler, bind, advertise, rank,
                                          max_message_bytes=max_message_bytes,
                                          restore=restore, security=security,
                                          check_finite=check_finite,
                                          update_threads=update_threads,
                                          embedding_disk=disk))
    start_metrics(service, "server", metrics_port, metrics_host)
    _serve(service)


@main.command(context_settings={"ignore_unknown_options": True})
@address_option("scheduler", default=DEFAULT_SCHEDULER, help="the scheduler's address")
@option("rank", default=None, type=click.IntRange(min=0),
        help="rank to claim: refused (CONFLICT, exit status 1) while a live worker holds it, "
        "taken over from one silent for a few seconds (a restart); unset: the lowest free one")
@option("num-workers", default=None, type=click.IntRange(min=1),
        help="workers in the job, for sharding data (unset: the client takes 1)")
@codec_option()
@keys_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def worker(scheduler: str, rank: int | None, num_workers: int | None, codec: str | None,
           keys: str | None, command: tuple[str, ...]) -> None:
    """Run COMMAND as a worker of the job (it calls PSClient.from_env()): COMMAND replaces
    this process with HOGSHARD_SCHEDULER, HOGSHARD_RANK, HOGSHARD_NUM_WORKERS, HOGSHARD_CODEC
    and HOGSHARD_KEYS set from the flags, and its exit status is the command's (a
    PSClient.from_env() worker stopped by SIGTERM leaves the job and exits 143)."""
    from hogshard.children import worker_environment

    check_command(command)

    process_security(keys, role="worker")  # a bad keys folder fails before the command starts
    env = worker_environment(scheduler, rank, num_workers, codec=codec, keys=keys)
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as err:
        raise click.ClickException(f"cannot run {command[0]!r}: {err.strerror}") from None


@main.command(context_settings={"ignore_unknown_options": True})
@option("servers", default=2, type=click.IntRange(min=1), help="server processes to start")
@option("workers", default=2, type=click.IntRange(min=1),
        help="copies of COMMAND to start (ranks 0..WORKERS-1)")
@policy_option()
@option("heartbeat-timeout", default=DEFAULT_HEARTBEAT_TIMEOUT, type=click.FloatRange(min=0.05),
        help="seconds of silence after which a member is declared dead")
@option("replication", default=1, type=click.IntRange(min=1, max=2),
        help="copies of each dense chunk and embedding shard or slot: 2 keeps a backup on "
        "another server")
@option("embedding-slots", default=0, type=click.IntRange(min=0, max=1 << 16),
        help="the scheduler's --embedding-slots: embedding rows in this many virtual slots, "
        "which 'hogshard embeddings add/drain' can move between servers mid-job (under "
        "--replication 2 each slot has a backup too); 0: rows hashed over the servers, fixed")
@codec_option()
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="show a progress bar")
@click.option("--verbose", is_flag=True, help="show the scheduler's and servers' INFO logs")
@option("respawn", is_flag=True, default=False,
        help="start again a worker (same rank) or the scheduler (same address) killed by a "
        "signal or stopped by SIGTERM, and replace killed servers without a cap: for fault drills (without it, a "
        "worker that exits non-zero or is killed ends the job at once: exit status 1)")
@option("scheduler-port", default=0, type=click.IntRange(min=0, max=65535),
        help="the scheduler's port on 127.0.0.1, for `hogshard status`/`stop` from another "
        "shell (0: any free port; the launcher prints the address)")
@checkpoint_options
@restore_option
@keys_option
@option("http-port", default=0, type=click.IntRange(0, 65535),
        help="the scheduler's live status page on http://127.0.0.1:PORT/ (printed at start); "
        "0: off")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def launch(servers: int, workers: int, policy: str, heartbeat_timeout: float, replication: int,
           embedding_slots: int, codec: str | None,
           progress: bool, verbose: bool, respawn: bool, scheduler_port: int,
           checkpoint_every: float | None,
           checkpoint_dir: str | None, restore: str | None, keys: str | None, http_port: int,
           command: tuple[str, ...]) -> None:
    """Run a whole job on this host: a scheduler, SERVERS servers and WORKERS copies of COMMAND.

    Binds 127.0.0.1 only. The scheduler runs with --num-workers WORKERS --exit-when-done: it
    ends the job (a final checkpoint with --checkpoint-dir) once every worker is done, or at
    `hogshard stop`.

    A worker that exits non-zero or is killed (without --respawn), the scheduler failing, or
    a server failing (with --replication 2 a failed server is replaced instead) ends the job
    at once: one '[launch] ERROR:' line names the process, its exit code and that the job
    stops; every other process is sent SIGTERM (SIGKILL after 5 s). Exits 0 when every
    worker exited 0, 1 when the job failed so, 130 on Ctrl-C or SIGTERM. Its children get
    SIGTERM if the launcher itself dies (even by SIGKILL, on Linux)."""
    from hogshard.launcher import LocalCluster

    check_command(command)
    cluster = or_exit(lambda: LocalCluster(servers, workers, policy, list(command),
                                           heartbeat_timeout=heartbeat_timeout,
                                           replication=replication,
                                           embedding_slots=embedding_slots,
                                           progress=progress, codec=codec,
                                           service_log_level="INFO" if verbose else "WARNING",
                                           checkpoint_every=checkpoint_every,
                                           checkpoint_dir=checkpoint_dir, restore=restore,
                                           keys=keys, respawn=respawn,
                                           http_port=http_port,
                                           scheduler_port=scheduler_port))
    code = or_exit(cluster.run)
    sys.exit(code)


#: Exit statuses of `scheduler` and `server` stopped by a signal (128 + its number, as a shell
#: reports it): a requested stop, told apart from a crash (1) and from the job's end (0).
SIGNAL_EXIT = {"SIGTERM": 143, "SIGINT": 130}


def _serve(service) -> None:
    """Run ``service`` until it stops. SIGTERM (and Ctrl-C) is a graceful leave: logged, a
    server tells the scheduler it leaves (its backups take over at once), and the process
    exits 143 (130 for Ctrl-C)."""
    import logging
    import signal

    context = click.get_current_context(silent=True)
    log_context = context.meta.get("hogshard.log_context") if context else None
    if log_context is not None and isinstance(getattr(service, "rank", None), int):
        log_context.rank = service.rank  # every line from now on names e.g. server-3
    stopped_by: list[str] = []
    log = logging.getLogger("hogshard.cli")

    def on_signal(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if stopped_by:
            return  # already stopping
        stopped_by.append(name)
        leave = getattr(service, "leave", None)
        if leave is not None:
            log.warning("%s: %s received; leaving the job (the scheduler is told) and "
                        "exiting %d", service.node_id, name, SIGNAL_EXIT[name])
            leave(f"stopped by {name}")
        else:
            log.warning("scheduler: %s received; stopping and exiting %d (servers and workers "
                        "go on and register again with a scheduler started at this address)",
                        name, SIGNAL_EXIT[name])
            service.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    service.serve_forever()
    if getattr(service, "fenced", None):
        raise SystemExit(f"hogshard: {service.node_id} stopped, fenced off: {service.fenced}")
    if stopped_by:
        sys.exit(SIGNAL_EXIT[stopped_by[0]])


def _add_deployment_commands() -> None:
    """The commands that act on a running job (``job_cli.py``), ``hogshard keys``
    (``keys_cli.py``), ``hogshard slurm``, ``hogshard report``, ``hogshard simulate`` and
    ``hogshard embeddings`` live in their own modules."""
    from hogshard.embeddings_cli import embeddings
    from hogshard.job_cli import checkpoint, export, policy, status, stop
    from hogshard.keys_cli import keys
    from hogshard.report import report
    from hogshard.simulate import simulate
    from hogshard.slurm import slurm

    for command in (checkpoint, stop, export, policy, status, keys, embeddings):
        main.add_command(command)
    main.add_command(slurm)
    main.add_command(report)
    main.add_command(simulate)


_add_deployment_commands()
