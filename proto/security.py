"""CURVE authentication and encryption for every hogshard socket (ZeroMQ's CurveZMQ + ZAP),
and the role of each client key.

A cluster has one **server keypair**, shared by every socket that binds (the scheduler's and
the servers' ROUTERs), and one **client keypair per role** for the sockets that connect:
``worker`` (training processes), ``shard`` (the servers' links to the scheduler and to each
other) and ``admin`` (the CLI's status/policy/checkpoint calls, launchers). A binding
ROUTER is a CURVE server whose ZAP handler (a ``zmq.auth.thread.ThreadAuthenticator`` on its
context) admits only the public keys found in the keys folder's ``authorized/`` directory and
names each connection by its key's role (proto/roles.py), which every op checks; a peer
without such a key never completes the handshake, so it receives nothing at all.

Layout written by ``hogshard keys generate DIR`` (ZeroMQ certificate files, mode 0600)::

    DIR/server.key               server public key (every process)
    DIR/server.key_secret        server secret key (scheduler and servers only)
    DIR/worker.key_secret        the workers' keypair (and DIR/worker.key, its public key)
    DIR/shard.key_secret         the servers' client keypair (and DIR/shard.key)
    DIR/admin.key_secret         the CLI's and launchers' keypair (and DIR/admin.key)
    DIR/authorized/NAME.key      public keys allowed to connect; NAME gives the role

With ``hogshard keys generate --servers N DIR`` each server rank R gets its **own** keypair
``DIR/shard-R.key_secret`` (and ``authorized/shard-R.key``) in place of the shared
``shard.key_secret``: its connections are named ``server-R`` and may send only as ``server-R``
(``from``), and register only as rank R, so one server's key cannot speak for another. A server
loads ``shard-R.key_secret`` for its ``--rank R`` (a folder with per-rank keys and no shared one
refuses a server without ``--rank``).

Each process loads the keypair of its role; an older folder with one shared
``client.key_secret`` still works (that key may act in every role, with a warning), and
``hogshard keys generate --if-missing DIR`` adds the role keys to it. A folder without
``authorized/`` (e.g. a Kubernetes Secret made with ``--from-file=DIR``, which keeps only
top-level files) admits the public keys ``DIR/*.key`` instead.

Example::

    >>> import tempfile
    >>> keys = tempfile.mkdtemp()
    >>> _ = generate_keys(keys)
    >>> security = Security.from_dir(keys, role=Role.WORKER)
    >>> len(security.server_public), security.client_name
    (40, 'worker')
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from hogshard.proto.errors import ConfigError
from hogshard.proto.handshakes import DenialLog, HandshakeMonitor
from hogshard.proto.roles import (
    KEY_NAMES,
    LEGACY,
    LEGACY_KEY_NAME,
    Role,
    key_identity,
    rank_of,
    server_key_rank,
)

log = logging.getLogger(__name__)

SERVER = "server"
CLIENT = LEGACY_KEY_NAME  # the shared client key of older folders
AUTHORIZED = "authorized"
#: The client keypairs ``hogshard keys generate`` writes: one per role.
ROLE_CLIENTS = tuple(KEY_NAMES.values())
#: The name of the keypair every server shares when servers have no keys of their own.
SHARED_SHARD = KEY_NAMES[Role.SERVER]


def clients_for(servers: int = 0, clients: Sequence[str] = ROLE_CLIENTS) -> list[str]:
    """The client keypairs to write: ``clients``, with one ``shard-R`` per server rank in place
    of the shared ``shard`` when ``servers`` > 0.

    >>> clients_for(2)
    ['worker', 'admin', 'shard-0', 'shard-1']
    """
    if servers <= 0:
        return list(clients)
    return [c for c in clients if c != SHARED_SHARD] + [f"{SHARED_SHARD}-{r}"
                                                       for r in range(servers)]


def generate_keys(directory: str | os.PathLike[str],
                  clients: Sequence[str] = ROLE_CLIENTS) -> list[Path]:
    """Write a cluster's server keypair and one keypair per client name into ``directory``
    (created with mode 0700, every file 0600). Refuses to overwrite existing keys. A client
    name's role is its prefix up to the first ``-`` (``worker``, ``shard``, ``admin``;
    proto/roles.py).

    The files are written into a temporary folder inside ``directory`` and moved into place
    with ``server.key_secret`` last, so a folder that holds it holds every key (an interrupted
    run leaves no server secret and is simply generated again).

    Example: ``generate_keys("keys")`` -> ``[keys/server.key, keys/server.key_secret, ...]``
    """
    root = Path(directory)
    if (root / f"{SERVER}.key_secret").exists():
        raise ConfigError(f"{root} already holds a server key; expected an empty or new "
                          "folder (remove the old keys first, or pass --if-missing)")
    return _write_keys(root, clients, with_server=True)


def _write_keys(root: Path, clients: Sequence[str], with_server: bool) -> list[Path]:
    import tempfile

    import zmq.auth

    for name in clients:
        if not name or "/" in name or name == SERVER or name.startswith("."):
            raise ConfigError(f"client name {name!r}: expected a plain file name, not "
                              f"{SERVER!r}")
    old_umask = os.umask(0o077)  # no other user may read a key, not even briefly
    try:
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        staging = Path(tempfile.mkdtemp(prefix=".keys-", dir=root))
        try:
            (staging / AUTHORIZED).mkdir()
            staged = [Path(p) for p in zmq.auth.create_certificates(staging, SERVER)] \
                if with_server else []
            for name in clients:
                public, secret = (Path(p) for p in zmq.auth.create_certificates(staging, name))
                authorised = staging / AUTHORIZED / public.name
                shutil.copyfile(public, authorised)
                staged += [public, authorised, secret]
            for path in staged:
                os.chmod(path, 0o600)
            (root / AUTHORIZED).mkdir(exist_ok=True)
            marker = staging / f"{SERVER}.key_secret"
            for path in [p for p in staged if p != marker] + [marker] * with_server:
                os.replace(path, root / path.relative_to(staging))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as err:
        raise ConfigError(f"cannot write keys into {root}: {err}; expected a folder this "
                          "user can write") from None
    finally:
        os.umask(old_umask)
    return [root / path.relative_to(staging) for path in staged]


def ensure_keys(directory: str | os.PathLike[str],
                clients: Sequence[str] = ROLE_CLIENTS) -> list[Path]:
    """``generate_keys`` unless ``directory`` already holds a cluster's keys; then add the
    client keypairs it lacks altogether (an older folder gets its role keys), check that every
    one loads, and return the files written (``[]`` when none). Safe to run at every start
    (``hogshard keys generate --if-missing``, the compose ``keys`` service).

    Example: ``ensure_keys("keys")`` writes keys once; later calls return ``[]``.
    """
    root = Path(directory)
    if not (root / f"{SERVER}.key_secret").exists():
        return generate_keys(root, clients)
    absent = [name for name in clients if (root / AUTHORIZED).is_dir()  # not a flat copy
              and not (root / f"{name}.key_secret").exists()
              and not (root / AUTHORIZED / f"{name}.key").exists()]
    for name in clients:
        if name not in absent:
            security = Security.from_dir(root, client=name)
            if security.server_secret is None:
                raise ConfigError(f"{root / (SERVER + '.key_secret')} holds no secret key")
    return _write_keys(root, absent, with_server=False) if absent else []


def _server_client(root: Path, rank: int | None) -> str | None:
    """The client keypair a server of ``rank`` loads: its own ``shard-R`` where the folder
    has it, else None (the shared ``shard`` or an older folder's ``client``). A folder with
    per-rank keys and no shared one refuses a server without a rank, or without its key."""
    if rank is not None and (root / f"{SHARED_SHARD}-{rank}.key_secret").exists():
        return f"{SHARED_SHARD}-{rank}"
    own = sorted(p.name for p in root.glob(f"{SHARED_SHARD}-*.key_secret")
                 if server_key_rank(p.name.removesuffix(".key_secret")) is not None)
    if not own or (root / f"{SHARED_SHARD}.key_secret").exists():
        return None
    if rank is None:
        raise ConfigError(f"{root} holds one key per server rank ({', '.join(own[:3])}"
                          f"{', ...' if len(own) > 3 else ''}); start the server with --rank R "
                          "(HOGSHARD_RANK) to load its own shard-R.key_secret")
    raise ConfigError(f"{root} has no {SHARED_SHARD}-{rank}.key_secret for server rank {rank} "
                      f"(it holds {', '.join(own[:3])}{', ...' if len(own) > 3 else ''}); add "
                      f"it with `hogshard keys generate --if-missing --servers {rank + 1} "
                      f"{root}`")


def _load(path: Path, what: str) -> tuple[bytes, bytes | None]:
    import zmq.auth

    if not path.is_file():
        raise ConfigError(f"no {what} at {path}; expected the files of "
                          "`hogshard keys generate DIR` (see --keys)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as err:
        raise ConfigError(f"{path} is not a ZeroMQ certificate ({what}): {err}") from None
    if public is None or len(public) != 40:
        raise ConfigError(f"{path} holds no 40-character Z85 public key ({what})")
    return public, secret


class _RoleAuthenticator(ThreadAuthenticator):
    """A ZAP handler that names each CURVE connection by its key's role: the ``User-Id`` of
    every message it sends (read by proto/service.py)."""

    def __init__(self, context: zmq.Context, roles: dict[bytes, str],
                 denials: DenialLog | None = None) -> None:
        super().__init__(context, log=logging.getLogger(__name__ + ".zap"))
        self.roles = roles
        self.denials = denials or DenialLog()
        self._peer = "?"

    def curve_user_id(self, client_public_key: bytes) -> str:
        return str(self.roles.get(z85.encode(client_public_key), Role.WORKER))

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # one request at a time (the authenticator's thread): the peer of the reply below
        self._peer = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id: bytes, status_code: bytes,
                        status_text: bytes, user_id: str = "anonymous") -> None:
        if status_code != b"200":
            self.denials.denied(self._peer, "zap", status_text.decode("utf-8", "replace"))
        super()._send_zap_reply(request_id, status_code, status_text, user_id)


class Security:
    """The CURVE keys of one process and the ZAP authenticators it started (one per ZeroMQ
    context that has a binding socket). ``stop(context)`` before terminating a context.

    Example::

        security = Security.from_dir("keys", role=Role.SERVER)
        router, address = bind_router(ctx, "tcp://0.0.0.0:7000", security=security)
        dealer = connect_dealer(ctx, address, security=security)
    """

    def __init__(self, directory: Path, server_public: bytes, server_secret: bytes | None,
                 client_public: bytes | None, client_secret: bytes | None,
                 client_name: str | None = None) -> None:
        self.directory = directory
        self.server_public = server_public
        self.server_secret = server_secret
        self.client_public = client_public
        self.client_secret = client_secret
        self.client_name = client_name
        self.authorized = directory / AUTHORIZED
        if not self.authorized.is_dir():  # a flattened copy of the folder (k8s Secret)
            self.authorized = directory
        self._authenticators: dict[int, Any] = {}
        self._monitors: dict[int, list[HandshakeMonitor]] = {}
        #: Refused handshakes on this process's binding sockets (logged, rate-limited).
        self.denials = DenialLog()

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], client: str | None = None,
                 role: Role | None = Role.WORKER, rank: int | None = None) -> Security:
        """The keys in ``directory``: the server public key, the server secret if present
        (only binding roles need it) and the client keypair ``client`` or, by default, that
        of ``role`` (``worker.key_secret``, ``shard.key_secret`` or, for the server of
        ``rank``, its own ``shard-R.key_secret``, ``admin.key_secret``, or an older folder's
        shared ``client.key_secret``). ``role=None`` with no ``client``: no client keypair (a
        process that only binds, the scheduler)."""
        root = Path(directory)
        if not root.is_dir():
            raise ConfigError(f"keys folder {root} does not exist; create one with "
                              "`hogshard keys generate DIR`")
        server_public, _ = _load(root / f"{SERVER}.key", "server public key")
        server_secret = None
        if (root / f"{SERVER}.key_secret").exists():
            public, server_secret = _load(root / f"{SERVER}.key_secret", "server secret key")
            if public != server_public:
                raise ConfigError(f"{root}: server.key and server.key_secret do not match")
        if client is None and role is None:
            return cls(root, server_public, server_secret, None, None)
        if client is None and role == Role.SERVER:
            client = _server_client(root, rank)
        if client is None:
            assert role is not None
            name = KEY_NAMES.get(role, LEGACY_KEY_NAME)
            client = name if (root / f"{name}.key_secret").exists() or not \
                (root / f"{LEGACY_KEY_NAME}.key_secret").exists() else LEGACY_KEY_NAME
            if client == LEGACY_KEY_NAME:
                log.warning("%s has no %s.key_secret: using the shared client key, which may "
                            "act in every role; add role keys with `hogshard keys generate "
                            "--if-missing %s`", root, name, root)
        client_public, client_secret = _load(root / f"{client}.key_secret",
                                             f"client keypair {client!r}")
        if client_secret is None:
            raise ConfigError(f"{root / (client + '.key_secret')} holds no secret key")
        return cls(root, server_public, server_secret, client_public, client_secret, client)

    def secure_server(self, sock: zmq.Socket, context: zmq.Context) -> None:
        """Make ``sock`` (before it binds) a CURVE server admitting only authorised clients."""
        if self.server_secret is None:
            raise ConfigError(f"{self.directory} has no server.key_secret; a process that "
                              "binds (scheduler, server) needs the cluster's server secret key")
        if not self.authorized.is_dir() or not any(self.authorized.glob("*.key")):
            raise ConfigError(f"{self.authorized} lists no client public keys (*.key); no "
                              "one could connect")
        self._authenticator(context)
        self._monitors.setdefault(id(context), []).append(
            HandshakeMonitor(context, sock, self.denials))
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)

    def secure_client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it connects) a CURVE client of the cluster's server key."""
        if self.client_public is None or self.client_secret is None:
            raise ConfigError(f"no client keypair loaded from {self.directory}; a process "
                              "that connects needs one (worker/shard/admin.key_secret)")
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)

    def key_roles(self) -> dict[bytes, str]:
        """{authorised public key (Z85): its role, ``LEGACY``, or ``server-R`` for server R's
        own key} from the key file names (the ZAP ``User-Id`` of its connections)."""
        import zmq.auth

        names: dict[bytes, str] = {}
        for path in sorted(self.authorized.glob("*.key")):
            try:
                public, _ = zmq.auth.load_certificate(path)
            except (ValueError, OSError):
                continue  # the authenticator skips it too
            if public is not None:
                names[public] = path.stem
        own_keys = any(server_key_rank(stem) is not None for stem in names.values())
        roles: dict[bytes, str] = {}
        for public, stem in names.items():
            roles[public] = key_identity(stem)
            if own_keys and stem == SERVER:  # a flattened folder: the cluster's own key, which
                roles[public] = str(Role.SCHEDULER)  # every server holds, speaks for none
        return roles

    def _authenticator(self, context: zmq.Context) -> None:
        if id(context) in self._authenticators:
            return
        roles = self.key_roles()
        if any(rank_of(r) is not None for r in roles.values()) and \
                str(Role.SERVER) in roles.values():
            log.warning("%s admits a shared server key (shard.key) besides the servers' own "
                        "keys: a server holding it may speak for another rank; remove it once "
                        "every server has its shard-R.key_secret", self.authorized)
        if LEGACY in roles.values():
            log.warning("%s admits the shared client key (client.key), which may act in "
                        "every role; remove it once every process has its role key",
                        self.authorized)
        auth = _RoleAuthenticator(context, roles, self.denials)
        auth.start()
        auth.configure_curve(domain="*", location=str(self.authorized))
        self._authenticators[id(context)] = auth
        log.info("CURVE on: clients admitted from %s", self.authorized)

    def stop(self, context: zmq.Context) -> None:
        """Stop the authenticator of ``context`` (its sockets block ``context.term()``)."""
        for monitor in self._monitors.pop(id(context), []):
            monitor.stop()
        auth = self._authenticators.pop(id(context), None)
        if auth is not None:
            auth.stop()


def load_security(keys: str | os.PathLike[str] | None,
                  role: Role | None = Role.WORKER, rank: int | None = None) -> Security | None:
    """``Security.from_dir(keys, role=role, rank=rank)``, or None (plain TCP) when no keys
    folder is configured."""
    return Security.from_dir(keys, role=role, rank=rank) if keys else None
def is_local_endpoint(address: str) -> bool:
    """Whether ``address`` binds only this host: ipc://, inproc:// or a loopback tcp host."""
    if not address.startswith("tcp://"):
        return address.startswith(("ipc://", "inproc://"))
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name or a DNS name: reachable from elsewhere


def check_plain_bind(address: str, security: Security | None, insecure: bool) -> None:
    """Refuse plain TCP reachable from other hosts unless ``insecure`` was asked for.

    >>> check_plain_bind("tcp://127.0.0.1:7000", None, insecure=False)
    >>> check_plain_bind("tcp://0.0.0.0:7000", None, insecure=True)
    """
    if security is not None or insecure or is_local_endpoint(address):
        return
    raise ConfigError(
        f"refusing to bind {address} without CURVE keys: anyone who can reach it could read "
        "and change the model. Pass --keys DIR (HOGSHARD_KEYS; create them with `hogshard "
        "keys generate DIR`) or --insecure (HOGSHARD_INSECURE=1) to allow plain TCP")
