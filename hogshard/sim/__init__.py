"""A cluster simulator: lambda learners and S servers in one process on a discrete-event clock,
with the real policies, server stores and update rules and a real torch model.

=================  ===============================================================================
``simulation.py``  :class:`SimConfig`, :class:`Simulation`: the cluster, run to a report
``events.py``      :class:`Event`, :class:`EventLoop`: the discrete-event clock
``host.py``        :class:`Host`: the cores the learners compute on
``servers.py``     :class:`VirtualServer`, :class:`QueueStats`: a shard server behind a FIFO queue
``timing.py``      :class:`ComputeModel`, :class:`NetworkModel`: how long steps and messages take
``workload.py``    :class:`Workload`, ``load_example``: the Fashion-MNIST example's model and data
``synthetic.py``   :class:`SyntheticWorkload`: a timing-only model whose gradients cost nothing
=================  ===============================================================================

Example::

    from hogshard.sim import SimConfig, Simulation
    report = Simulation(SimConfig(learners=30, policy="softsync:15+lr=mean")).run()
"""

from hogshard.sim.events import EventLoop
from hogshard.sim.host import Host
from hogshard.sim.simulation import SimConfig, Simulation
from hogshard.sim.timing import ComputeModel, NetworkModel

__all__ = ["ComputeModel", "EventLoop", "Host", "NetworkModel", "SimConfig", "Simulation"]
