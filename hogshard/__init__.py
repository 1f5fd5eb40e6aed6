"""hogshard: a parameter server for asynchronous SGD over ZeroMQ.

Example (inside a process started by ``hogshard worker`` or ``hogshard launch``)::

    from hogshard import PSClient, PSOptimizer
    client = PSClient.from_env()
    opt = PSOptimizer(client, model.named_parameters(), rule="sgd", lr=0.1)
    for x, y in client.shard((images, labels), batch_size=64, epochs=2):  # this rank's share
        ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hogshard.worker.client import PSClient
    from hogshard.worker.embedding import RemoteEmbeddingBag
    from hogshard.worker.optimizer import PSOptimizer
    from hogshard.worker.shard import Shard, ShardSampler

__all__ = ["PSClient", "PSOptimizer", "RemoteEmbeddingBag", "Shard", "ShardSampler",
           "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so that servers and the scheduler (which share this package) never import torch.
    if name == "PSClient":
        from hogshard.worker.client import PSClient

        return PSClient
    if name == "PSOptimizer":
        from hogshard.worker.optimizer import PSOptimizer

        return PSOptimizer
    if name == "RemoteEmbeddingBag":
        from hogshard.worker.embedding import RemoteEmbeddingBag

        return RemoteEmbeddingBag
    if name in ("Shard", "ShardSampler"):
        from hogshard.worker import shard

        return getattr(shard, name)
    raise AttributeError(f"module 'hogshard' has no attribute {name!r}")
