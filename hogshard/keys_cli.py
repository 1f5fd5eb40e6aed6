"""``hogshard keys``: CURVE keypairs for a cluster, one per role (and per server rank with
``--servers N``). ``cli.py`` adds it to the ``hogshard`` command.

Example::

    hogshard keys generate --if-missing /shared/keys
"""

from __future__ import annotations

import click

from hogshard.cli_options import or_exit


@click.group()
def keys() -> None:
    """CURVE keys: encryption and authentication of every socket of a cluster."""


@keys.command("generate")
@click.option("--client", "clients", multiple=True, default=("worker", "shard", "admin"),
              show_default=True,
              help="client keypair name (repeat for several; each NAME.key is authorised). "
              "The name's prefix up to the first '-' gives its role: worker, shard (servers) "
              "or admin; any other name is a worker")
@click.option("--servers", type=click.IntRange(min=0), default=0, show_default=True,
              help="give each server rank 0..N-1 its own keypair shard-R.key_secret in place "
              "of the shared shard.key_secret: server R's key then registers only as rank R "
              "and sends server-to-server ops only as server-R (0: one shared server key)")
@click.option("--if-missing", is_flag=True, default=False,
              help="if DIRECTORY already holds keys, keep them (exit 0) instead of refusing: "
              "add the client keypairs it lacks altogether (an older folder with one shared "
              "client.key gets its role keys) and check that every one loads; safe to run "
              "at every start")
@click.argument("directory", type=click.Path(file_okay=False))
def keys_generate(clients: tuple[str, ...], servers: int, if_missing: bool,
                  directory: str) -> None:
    """Write a cluster's server keypair and one client keypair per role into DIRECTORY
    (mode 0600): worker.key_secret for workers, shard.key_secret for shard servers,
    admin.key_secret for the CLI (status, policy set, policy show, checkpoint, export) and
    launchers. Every op checks the role of the key that sent it: a worker's key cannot end the
    job, change the policy or act as a server. Exits 1, changing nothing, when DIRECTORY
    already holds a server key (unless --if-missing).

    With --servers N each server has its own identity: server R loads shard-R.key_secret
    (it needs --rank R), and its key cannot register as, or speak for, another rank
    (FORBIDDEN). --if-missing --servers N adds them to an older folder; then delete
    authorized/shard.key so the shared server key is no longer admitted.

    \b
    What each process needs (--keys DIR, HOGSHARD_KEYS):
      scheduler  server.key, server.key_secret, authorized/
      server     server.key, server.key_secret, authorized/, shard.key_secret
                 (with --servers N: shard-R.key_secret of its own rank R instead)
      worker     server.key, worker.key_secret
      CLI        server.key, admin.key_secret
    """
    from hogshard.proto.security import clients_for, ensure_keys, generate_keys

    make = ensure_keys if if_missing else generate_keys
    written = or_exit(lambda: make(directory, clients_for(servers, clients)))
    for path in written:
        click.echo(str(path))
    if not written:
        click.echo(f"{directory} already holds keys: kept", err=True)


@keys.command("page-token")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
def keys_page_token(directory: str) -> None:
    """Print the token of the scheduler's status page kept in DIRECTORY/page.token, making it
    (random, mode 0600) the first time. Pass it as the scheduler's --http-token and open
    http://HOST:PORT/?token=TOKEN; without a token a scheduler under --keys serves its page on
    127.0.0.1 only."""
    from hogshard.status_page import page_token

    click.echo(or_exit(lambda: page_token(directory)))
