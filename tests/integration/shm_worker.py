"""A worker that pushes and pulls one large table through shared memory until it is killed
(or a request fails: exit code 1), for the kill -9 tests::

    HOGSHARD_SCHEDULER=tcp://... python tests/integration/shm_worker.py TABLE

It prints ``shm ready`` once a push and a pull have gone through.
"""

from __future__ import annotations

import sys

import numpy as np

from hogshard import PSClient
from hogshard.proto.errors import HogshardError

SIZE = 1 << 19  # two chunks of 1 MiB
CHUNK_ELEMS = 1 << 18


def main(table_name: str) -> int:
    client = PSClient.from_env()
    table = client.dense_table(table_name, SIZE, {"rule": "sgd", "lr": 0.01},
                               init=np.zeros(SIZE, np.float32), chunk_elems=CHUNK_ELEMS)
    grads = client.gradient_buffer(table)
    grads[:] = 1.0
    out = np.empty(SIZE, np.float32)
    step = 0
    try:
        while True:
            client.push(table, grads).result(10.0)
            client.pull(table, out).result(10.0)
            if step == 0:
                print("shm ready", flush=True)
            step += 1
    except HogshardError as err:
        print(f"request failed: {err}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
