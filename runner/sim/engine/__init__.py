"""The SGLang-like engine simulator: radix cache (radix.py), roofline cost model (cost.py),
scheduler (scheduler.py), deployments (presets.py). See docs/simulator.md."""

from .cost import CostModel, Deployment, GpuSpec, IterationCost, ModelSpec
from .presets import DEPLOYMENTS, deployment, make_sim_engine
from .radix import RadixCache
from .scheduler import AgentStats, RequestRecord, SimEngine

__all__ = [
    "DEPLOYMENTS",
    "AgentStats",
    "CostModel",
    "Deployment",
    "GpuSpec",
    "IterationCost",
    "ModelSpec",
    "RadixCache",
    "RequestRecord",
    "SimEngine",
    "deployment",
    "make_sim_engine",
]
