"""Trace-driven discrete-event simulator of a shared GPU pool, driving the pure policies of ``tidal.policy``.

    from tidal.sim import PolicySpec, SpotBacklog, make_config, simulate
    from tidal.sim.traffic import demand_gpus

    demand, step_s, _ = demand_gpus("servegen-language-m-large.csv", serving_gpus=128)
    cfg = make_config(serving_gpus=128, training_gpus=64, days=14, warmup_days=2)
    result = simulate(demand, step_s=step_s, policy=PolicySpec("tidal", 0.005), config=cfg,
                      backlog=SpotBacklog())
    result.metrics["harvest_ratio"], result.metrics["shortfall_ratio"]

See ``docs/simulator.md``. It imports ``tidal.model``, ``tidal.policy`` and ``tidal.serving``, never the
control plane.
"""

from tidal.sim.config import CheckpointModel, SimConfig, make_config
from tidal.sim.engine import SimResult, simulate
from tidal.sim.jobs import JobSpec, SpotBacklog, load_jobs, load_native, load_philly
from tidal.sim.policies import POLICIES, PolicySpec

__all__ = [
    "POLICIES", "CheckpointModel", "JobSpec", "PolicySpec", "SimConfig", "SimResult", "SpotBacklog",
    "load_jobs", "load_native", "load_philly", "make_config", "simulate",
]
