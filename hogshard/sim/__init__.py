"""A cluster simulator: lambda learners and S servers in one process on a discrete-event clock,
with the real policies, server stores and update rules and a real torch model.

Example::

    from hogshard.sim import SimConfig, Simulation
    report = Simulation(SimConfig(learners=30, policy="softsync:15+lr=mean")).run()
"""

from hogshard.sim.events import EventLoop
from hogshard.sim.host import Host
from hogshard.sim.simulation import SimConfig, Simulation
from hogshard.sim.timing import ComputeModel, NetworkModel

__all__ = ["ComputeModel", "EventLoop", "Host", "NetworkModel", "SimConfig", "Simulation"]
