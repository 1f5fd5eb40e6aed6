"""The flags the ``hogshard`` commands share, and the checks that turn a bad value into a usage
error (exit 2) or a clear message (exit 1) instead of a traceback.

Every option made by :func:`option` also reads ``HOGSHARD_<NAME>``.

Example::

    @main.command()
    @option("bind", default="tcp://127.0.0.1:0", help="address to bind")
    @policy_option()
    def scheduler(bind: str, policy: str) -> None: ...
"""

from __future__ import annotations

import click

from hogshard.proto.config import env_name
from hogshard.proto.errors import HogshardError


def option(name: str, **kwargs):
    """A click option that also reads ``HOGSHARD_<NAME>``."""
    flag = "--" + name
    return click.option(flag, envvar=env_name(name), show_envvar=True, show_default=True,
                        **kwargs)


def address_option(name: str, bind: bool = False, **kwargs):
    """An address flag (``--scheduler``, ``--bind``, ``--advertise``) checked where it is read
    (flag, ``HOGSHARD_<NAME>`` or config file): a missing scheme, a bad host or port is a
    usage error naming the flag (exit 2), not a ZeroMQ traceback."""
    return option(name, callback=address_check(bind), **kwargs)


def address_check(bind: bool = False):
    """The click callback of :func:`address_option` (for a flag made without it)."""

    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        from hogshard.proto.config import check_address

        if value is None:
            return None
        try:
            return check_address(value, "", bind=bind)
        except HogshardError as err:
            raise click.BadParameter(err.message) from None

    return check


def check_codec(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if not value:
        return None
    from hogshard.worker.compression import CompressionPolicy

    try:
        CompressionPolicy.parse(value)
    except HogshardError as err:
        raise click.BadParameter(err.message) from None
    return value


def codec_option():
    return option("codec", default=None, callback=check_codec,
                  help="gradient compression, e.g. dgc, topk:0.01, topk:0.03:compact, sign:256, fp16, "
                  "powersgd:2, qsgd:16, randomk:0.1, or auto (chosen from the measured link); "
                  "options ,min_size=N ,ef=0 ,momentum=M ,clip=C ,warmup=STEPS|P% ,pull=fp16|bf16 "
                  "(weights pulled in half precision); per table: 'topk:0.01;emb=fp16'. "
                  "dgc is topk:0.005:compact,momentum=0.9,clip=2.0,warmup=4% (its warm-up 4% "
                  "of the run's steps). examples/fashion_mnist.py picks the codec's server "
                  "rule and lr when its --rule/--lr are not given")


def checkpoint_options(command):
    """``--checkpoint-every SECONDS`` with ``--checkpoint-dir DIR`` (both or neither)."""
    command = option("checkpoint-dir", default=None, type=click.Path(file_okay=False),
                     help="directory for checkpoints (ckpt-N folders, LATEST) that the "
                     "scheduler and every server share (docs/CHECKPOINTS.md); a relative path "
                     "is resolved against the scheduler's working folder; alone, without "
                     "--checkpoint-every, only the final checkpoint of a stop")(command)
    return option("checkpoint-every", default=None, type=click.FloatRange(min=0.1),
                  help="seconds between checkpoints of every shard (needs --checkpoint-dir)"
                  )(command)


def restore_option(command):
    return option("restore", default=None, type=click.Path(exists=True, file_okay=False),
                  help="resume from this checkpoint (a ckpt-N folder, or its parent: LATEST); "
                  "the number of servers must match and each server comes back under a rank "
                  "that wrote it (launch starts those ranks); the scheduler takes "
                  "the checkpoint's policy, not --policy (a WARNING says so when they "
                  "differ; docs/LIFECYCLE.md: ranks and data of a resumed job)")(command)


def server_restore_option(command):
    return option("restore", default=None, type=click.Path(exists=True, file_okay=False),
                  help="load this server's shard from this checkpoint (a ckpt-N folder, or "
                  "its parent: LATEST) before serving; the job's number of servers and this "
                  "server's rank must match the checkpoint's")(command)


def keys_option(command):
    """``--keys DIR``: CURVE-encrypt and authenticate every socket (PROTOCOL.md section 5)."""
    return option("keys", default=None, type=click.Path(exists=True, file_okay=False),
                  help="CURVE keys folder (`hogshard keys generate DIR`): every socket is "
                  "encrypted and only authorised clients connect")(command)


def insecure_option(command):
    return option("insecure", is_flag=True, default=False,
                  help="allow plain TCP (no --keys) on an address other hosts can reach")(command)


def process_security(keys: str | None, bind: str | None = None, insecure: bool = False,
                     role: str | None = "admin", rank: int | None = None):
    """The process's CURVE keys, with the client keypair of ``role`` (None: the process
    only binds; a server of ``rank`` loads its own key where the folder has one); None for
    plain TCP. Refuses a plain non-loopback bind."""
    from hogshard.proto.roles import Role
    from hogshard.proto.security import check_plain_bind, load_security

    security = or_exit(lambda: load_security(keys, Role(role) if role else None, rank))
    if bind is not None:
        or_exit(lambda: check_plain_bind(bind, security, insecure))
    return security


def check_policy(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from hogshard.proto.policy import parse_policy

    try:
        parse_policy(value)
    except HogshardError as err:
        raise click.BadParameter(err.message) from None
    return value


def policy_option(default: str = "async"):
    return option("policy", default=default, callback=check_policy,
                  help="consistency policy: async, hardsync, softsync:N or ssp:S, with optional "
                  "+lr=staleness or +lr=mean, +dc=LAMBDA, +maxstale=K")


def metrics_options(command):
    """``--metrics-port`` (off unless given; 0 picks a free port) and ``--metrics-host``."""
    command = option("metrics-host", default="0.0.0.0",
                     help="interface for the Prometheus /metrics endpoint")(command)
    return option("metrics-port", default=None, type=click.IntRange(0, 65535),
                  help="serve Prometheus metrics on this port (0: any free port; "
                  "off when unset)")(command)


def start_metrics(service, role: str, port: int | None, host: str) -> None:
    """Serve the service's metrics from a daemon thread when a port was given."""
    if port is None:
        return
    from hogshard.proto.metrics import MetricsServer

    if role == "scheduler":
        from hogshard.scheduler.metrics import SchedulerCollector as collector
    else:
        from hogshard.ps.metrics import ServerCollector as collector
    metrics = or_exit(lambda: MetricsServer(collector(service), port, host))
    click.echo(f"{role} metrics on {metrics.url}", err=True)


def check_command(command: tuple[str, ...]) -> None:
    """Refuse a COMMAND that is a misspelt flag or names no program, before anything starts."""
    import shutil

    if command[0].startswith("-"):
        raise click.UsageError(f"no such option: {command[0]} (the worker command goes after "
                               "'--', e.g. -- python train.py)")
    if shutil.which(command[0]) is None:
        raise click.UsageError(f"cannot run {command[0]!r}: no such program")


def or_exit(build):
    try:
        return build()
    except HogshardError as err:
        raise click.ClickException(err.message) from None


def call_scheduler(scheduler: str, op: str, fields: dict | None, timeout: float,
                   keys: str | None = None) -> dict:
    """Send one admin request to the scheduler; its reply's fields (exit 1 on an error)."""
    import zmq

    from hogshard.proto.transport import RpcChannel

    security = process_security(keys)
    context = zmq.Context()
    channel = RpcChannel(context, scheduler, sender=op, security=security)
    try:
        return or_exit(lambda: channel.call(op, fields, timeout=timeout)).header
    finally:
        channel.close()
        context.term()
