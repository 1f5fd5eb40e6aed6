"""A worker that pushes a constant gradient twice and pulls after each push, with the host
identity the test gives it, then prints one JSON line: the weights it pulled (their distinct
values) and why shared memory was turned off, if it was::

    HOGSHARD_SCHEDULER=tcp://... HOGSHARD_HOST_ID=... python shm_fallback_worker.py TABLE
"""

from __future__ import annotations

import json
import sys

import numpy as np

from hogshard import PSClient

SIZE = 1 << 19  # two chunks of 1 MiB
CHUNK_ELEMS = 1 << 18


def main(table_name: str) -> int:
    client = PSClient.from_env()
    try:
        colocated = client.shm.colocated(client.channel.hosts.get(0))
        table = client.dense_table(table_name, SIZE, {"rule": "sgd", "lr": 0.5},
                                   init=np.ones(SIZE, np.float32), chunk_elems=CHUNK_ELEMS)
        out = np.empty(SIZE, np.float32)
        pulled = []
        for _ in range(2):
            client.push(table, np.ones(SIZE, np.float32)).result(30.0)
            client.pull(table, out).result(30.0)
            pulled.append(np.unique(out).tolist())
        print(json.dumps({"colocated": colocated, "pulled": pulled,
                          "turned_off": client.shm.turned_off}), flush=True)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
