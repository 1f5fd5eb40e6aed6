"""The command line of ``pushpull.py`` (its docstring says what each mode measures): the flags,
their checks, and the hidden ones of its self-invocations (``--raw-server``, ``--netns-inner``).

Example::

    args = parse_args("Push and pull throughput", ["--quick", "--sizes", "4", "64k"])
    args.sizes  # [4, 65536]
"""

from __future__ import annotations

import argparse
import os

from pushpull_measure import KIB, MIB  # this script's folder


def _parse_size(text: str) -> int:
    text = text.strip().lower()
    for suffix, mult in (("kib", KIB), ("k", KIB), ("mib", MIB), ("m", MIB)):
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * mult
    return int(text)


def _parse_env(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed and checked flags (``parser.error`` exits on a bad combination); a
    ``--raw-server`` self-invocation is returned unchecked."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="few repeats (well under a minute)")
    parser.add_argument("--json", metavar="PATH", help="write one JSON row per measurement")
    parser.add_argument("--sizes", type=_parse_size, nargs="+", metavar="SIZE",
                        help="payload sizes, e.g. 4k 1m 64m (default: 4k 64k 1m 16m 64m)")
    parser.add_argument("--colocated", action="store_true",
                        help="measure the shared-memory path and the doorbell (sizes 4 bytes and "
                             "1m-256m unless --sizes); ratios still against raw pyzmq over TCP, "
                             "plus a memcpy column and a client with the doorbell off")
    parser.add_argument("--peer", nargs=2, metavar=("pslite", "PATH"),
                        help="also run this ps-lite benchmark binary (tests/test_benchmark of "
                             "ps-lite, built beforehand) per size and op; adds its MB/s and ratio")
    parser.add_argument("--pipeline", type=int, default=0, metavar="N",
                        help="also measure with N requests in flight (default: off)")
    parser.add_argument("--repeats", type=int, default=0,
                        help="exact repeats per measurement (default: time-bounded)")
    parser.add_argument("--server-blas-threads", type=int, default=0, metavar="N",
                        help="cap the server's BLAS threads (OPENBLAS/OMP/MKL_NUM_THREADS=N); "
                             "default: inherit this environment, as production does")
    parser.add_argument("--server-env", type=_parse_env, action="append", metavar="KEY=VALUE",
                        help="extra environment for the shard server only (repeatable), e.g. "
                             "MALLOC_TRIM_THRESHOLD_=1073741824")
    parser.add_argument("--workers", type=int, default=0, metavar="W",
                        help="scale mode (pushpull_scale.py): W worker processes push+pull one "
                             "shared table through --servers S at once, beside raw pyzmq with "
                             "W clients and S ROUTERs; replaces the single-server sweep")
    parser.add_argument("--servers", type=int, default=0, metavar="S",
                        help="servers (and raw ROUTERs) for --workers (default 1)")
    parser.add_argument("--table-size", type=_parse_size, default=16 * MIB, metavar="SIZE",
                        help="table size for --workers (default 16m)")
    parser.add_argument("--big", action="store_true",
                        help="scale mode: step time of a 100 M-parameter (400 MB) table, 1 worker "
                             "and 2 servers, against raw pyzmq (10 M with --quick)")
    parser.add_argument("--big-params", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--netns", action="store_true",
                        help="servers (hogshard's and raw's) in one network namespace, this "
                             "client in another, joined by a veth pair (root only; skipped with "
                             "the reason elsewhere); namespaces and processes are removed at exit")
    parser.add_argument("--netns-rate", metavar="RATE",
                        help="with --netns: shape both directions of the link to RATE with tc "
                             "(e.g. 10gbit; default: unshaped)")
    parser.add_argument("--netns-mtu", type=int, metavar="BYTES",
                        help="with --netns: the veth MTU (default: the kernel's, 1500)")
    parser.add_argument("--links", type=int, nargs="+", metavar="K",
                        help="also move tables of several chunks with raw pyzmq over K TCP "
                             "connections at once (io_threads=K on both sides; pulls include the "
                             "copy into out), e.g. --links 1 2 4: what K connections per server "
                             "could gain")
    parser.add_argument("--netns-inner", metavar="SERVER_NS", help=argparse.SUPPRESS)
    parser.add_argument("--raw-server", metavar="ADDRESS_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--raw-max-bytes", type=int, default=64 * MIB, help=argparse.SUPPRESS)
    parser.add_argument("--raw-bind", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--raw-io-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.raw_server:
        return args
    if any(k < 1 for k in args.links or ()):
        parser.error("--links: each K must be 1 or more")
    if (args.netns_rate or args.netns_mtu) and not args.netns:
        parser.error("--netns-rate and --netns-mtu need --netns")
    if args.netns and (args.colocated or args.workers or args.servers or args.big):
        parser.error("--netns measures the one-server TCP sweep: not with --colocated, "
                     "--workers, --servers or --big")
    if args.peer and (args.peer[0] != "pslite" or not os.access(args.peer[1], os.X_OK)):
        parser.error(f"--peer: expected 'pslite' and an executable; got {' '.join(args.peer)}")
    if any(s % 4 for s in args.sizes or ()):
        parser.error("sizes must be multiples of 4 bytes (float32 tables)")
    if args.table_size % 4 or min(args.workers, args.servers) < 0:
        parser.error("--table-size must be a multiple of 4 bytes; --workers/--servers >= 1")
    return args
