"""zeus_callbacks: cut the GPU energy of deep-learning training, as callbacks for the trainers you use.

The core (`zeus_callbacks.core`) is framework-free; the HuggingFace and Lightning adapters are exported
lazily so that `import zeus_callbacks` never imports transformers or lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zeus_callbacks.core.device.backend import register_backend
from zeus_callbacks.core.device.errors import (
    GPUError,
    GPULostError,
    GPUNoPermissionError,
    GPUNotSupportedError,
    MIGNotSupportedError,
    NVMLUnavailableError,
    ZeusCallbacksError,
)
from zeus_callbacks.core.monitor.monitor import Measurement, ZeusMonitor
from zeus_callbacks.core.power_limit.selectors import (
    Energy,
    MaxSlowdownConstraint,
    OptimumSelector,
    PowerLimitMeasurement,
    Time,
    ZeusCost,
)

__version__ = "0.1.0"

register_backend("zeus_callbacks.sim.backend:simulated_backend")  # the simulator, imported when asked

# name -> module that defines it; imported on first access (PEP 562).
_LAZY = {
    "GlobalPowerLimitOptimizer": "zeus_callbacks.core.power_limit.optimizer",
    "PipelineFrequencyOptimizer": "zeus_callbacks.core.pipeline_frequency.optimizer",
    "HFZeusMonitor": "zeus_callbacks.huggingface",
    "HFGlobalPowerLimitOptimizer": "zeus_callbacks.huggingface",
    "HFPipelineFrequencyOptimizer": "zeus_callbacks.huggingface_pipeline",
    "LightningZeusMonitor": "zeus_callbacks.lightning",
    "LightningGlobalPowerLimitOptimizer": "zeus_callbacks.lightning",
    "LightningPipelineFrequencyOptimizer": "zeus_callbacks.lightning_pipeline",
    "ProfileDataLoader": "zeus_callbacks.profiling",
    "HFEpochLog": "zeus_callbacks.profiling",
    "LightningEpochLog": "zeus_callbacks.profiling",
    "HeterogeneousTrainer": "zeus_callbacks.heterogeneous",
    "HFHeterogeneousCallback": "zeus_callbacks.heterogeneous",
    "LightningHeterogeneous": "zeus_callbacks.heterogeneous",
}

__all__ = [
    "ZeusMonitor",
    "Measurement",
    "OptimumSelector",
    "PowerLimitMeasurement",
    "Time",
    "Energy",
    "ZeusCost",
    "MaxSlowdownConstraint",
    "ZeusCallbacksError",
    "GPUError",
    "GPUNoPermissionError",
    "GPUNotSupportedError",
    "GPULostError",
    "NVMLUnavailableError",
    "MIGNotSupportedError",
    *_LAZY,
]

if TYPE_CHECKING:  # pragma: no cover
    from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer  # noqa: F401
    from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zeus_callbacks' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
