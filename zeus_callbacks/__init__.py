"""zeus_callbacks: cut the GPU energy of deep-learning training, as callbacks for the trainers you use.

The package, by layer (data flows down: a trainer hook → an adapter → the core → the `Device` boundary → a
vendor module):

- `core/device/`: the `Device` boundary and one module per vendor (`nvidia/` over NVML, `amd.py` over amdsmi),
  the only code that calls a vendor's library; GPUs, errors, the GPU-state guard.
- `core/monitor/`: `ZeusMonitor` windows, energy reporting (every metric name), epoch logs, `ProfileDataLoader`.
- `core/power_limit/`: `GlobalPowerLimitOptimizer`, its search, selectors and profile file.
- `core/pipeline_frequency/`: `PipelineFrequencyOptimizer` (Perseus) and its planner, profile file, instrumentation.
- `core/heterogeneous/`: the heterogeneous planner, its profile file and profiler, uneven training.
- `core/distributed.py`: collectives, `local_rank()`, the one signal chain.
- Adapters, one module per framework: `huggingface`, `lightning` (`lightning.pytorch` and `.pl`), `accelerate`;
  per pipeline engine: `megatron` (Megatron-Core), `deepspeed`.
- `sim/`: simulated GPUs beneath each vendor's real bindings; `cli/`: the `zeus-callbacks` command.

Names of the core are importable from here; so are the adapters' classes, imported on first access so that
`import zeus_callbacks` (and `from zeus_callbacks import *`) never imports transformers, lightning or accelerate.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from zeus_callbacks.core.callback import Callback, CallbackSet
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
from zeus_callbacks.core.monitor.monitor import Measurement, MeasurementState, ZeusMonitor
from zeus_callbacks.core.power_limit.selectors import (
    Energy,
    MaxPowerConstraint,
    MaxSlowdownConstraint,
    OptimumSelector,
    PowerLimitMeasurement,
    Time,
    ZeusCost,
)
from zeus_callbacks.core.power_limit.states import Done, Inactive, Profiling, Ready, Warmup
from zeus_callbacks.lazy import lazy_exports
from zeus_callbacks.version import __version__ as __version__

_HETEROGENEOUS_TRAINING = "zeus_callbacks.core.heterogeneous.training"


def _simulation_requested() -> bool:
    """Whether a simulation may be selected: `ZEUS_CALLBACKS_SIMULATE` is set (`zeus_callbacks.sim`'s
    `SIMULATE_ENV`), or the simulator was imported (`simulate()` is called through it). Checked without
    importing it, so that a real discovery never imports the simulator."""
    return bool(os.environ.get("ZEUS_CALLBACKS_SIMULATE")) or "zeus_callbacks.sim" in sys.modules


# The composition point: the simulator offers itself as a device backend, imported only when a discovery
# may want it.
register_backend("zeus_callbacks.sim.backend:simulated_backend", when=_simulation_requested)

# Framework-free names, imported on first access: they pull in torch's heavier parts or the planners.
_CORE = {
    "GlobalPowerLimitOptimizer": "zeus_callbacks.core.power_limit.optimizer",
    "ReplayZeusMonitor": "zeus_callbacks.core.monitor.replay",
    "PipelineFrequencyOptimizer": "zeus_callbacks.core.pipeline_frequency.optimizer",
    "instrument": "zeus_callbacks.core.pipeline_frequency.pipelining",
    "ProfileDataLoader": "zeus_callbacks.core.monitor.dataloader",
    "get_gpus": "zeus_callbacks.core.device.gpus",
    "local_rank": "zeus_callbacks.core.distributed",
    "GPUProfile": "zeus_callbacks.core.heterogeneous.profile_file",
    "PowerLimitWindow": "zeus_callbacks.core.heterogeneous.profile_file",
    "load_profile": "zeus_callbacks.core.heterogeneous.profile_file",
    "HeteroPlan": "zeus_callbacks.core.heterogeneous.planner",
    "plan": "zeus_callbacks.core.heterogeneous.planner",
    "profile_power_limits": "zeus_callbacks.core.heterogeneous.profiler",
    "profile_batch_size": "zeus_callbacks.core.heterogeneous.profiler",
    "saving_text": "zeus_callbacks.core.report.saving",
    "RankPlan": _HETEROGENEOUS_TRAINING,
    "rank_plan": _HETEROGENEOUS_TRAINING,
    "rank_plans": _HETEROGENEOUS_TRAINING,
    "match_gpu_type": _HETEROGENEOUS_TRAINING,
    "loss_scale": _HETEROGENEOUS_TRAINING,
    "weight_gradients": _HETEROGENEOUS_TRAINING,
    "UnevenDistributedSampler": _HETEROGENEOUS_TRAINING,
    "uneven_dataloader": _HETEROGENEOUS_TRAINING,
    "apply_power_limit": _HETEROGENEOUS_TRAINING,
    "restore_power_limits": _HETEROGENEOUS_TRAINING,
    "steps_per_epoch": _HETEROGENEOUS_TRAINING,
    "get_env": "zeus_callbacks.core.zeus_utils",
    "zeus_cost": "zeus_callbacks.core.zeus_utils",
    # Zeus's `zeus.metric` (Pushgateway) and the Prometheus endpoint; prometheus_client is imported when used.
    "EnergyHistogram": "zeus_callbacks.core.observability.metric",
    "EnergyCumulativeCounter": "zeus_callbacks.core.observability.metric",
    "PowerGauge": "zeus_callbacks.core.observability.metric",
    "serve_metrics": "zeus_callbacks.core.observability.endpoint",
    "MetricsServer": "zeus_callbacks.core.observability.endpoint",
    # Zeus's monitors: `zeus.monitor.power`, `.temperature`, `.carbon`, `.price`.
    "PowerMonitor": "zeus_callbacks.core.monitor.power",
    "PowerDomain": "zeus_callbacks.core.monitor.power",
    "TemperatureMonitor": "zeus_callbacks.core.monitor.temperature",
    "CarbonEmissionMonitor": "zeus_callbacks.core.monitor.carbon",
    "CarbonEmissionMeasurement": "zeus_callbacks.core.monitor.carbon",
    "CarbonIntensityProvider": "zeus_callbacks.core.monitor.carbon",
    "FixedCarbonIntensity": "zeus_callbacks.core.monitor.carbon",
    "RegionCarbonIntensity": "zeus_callbacks.core.monitor.carbon",
    "ElectrictyMapsClient": "zeus_callbacks.core.monitor.carbon",
    "ElectricityMapsClient": "zeus_callbacks.core.monitor.carbon",
    "EnergyCostMonitor": "zeus_callbacks.core.monitor.price",
    "EnergyCostMeasurement": "zeus_callbacks.core.monitor.price",
    "ElectricityPriceProvider": "zeus_callbacks.core.monitor.price",
    "FixedElectricityPrice": "zeus_callbacks.core.monitor.price",
    "OpenEIClient": "zeus_callbacks.core.monitor.price",
    "RegionElectricityPrice": "zeus_callbacks.core.monitor.price",
}

# The adapters: importable by name, left out of `__all__` because they import their framework.
_ADAPTERS = {
    **dict.fromkeys(
        [
            "HFZeusMonitor",
            "HFGlobalPowerLimitOptimizer",
            "HFPipelineFrequencyOptimizer",
            "HFHeterogeneousCallback",
            "HeterogeneousTrainer",
            "HFEpochLog",
            "ZeusTrainerMixin",
        ],
        "zeus_callbacks.huggingface",
    ),
    **dict.fromkeys(
        [
            "LightningZeusMonitor",
            "LightningGlobalPowerLimitOptimizer",
            "LightningPipelineFrequencyOptimizer",
            "LightningHeterogeneous",
            "LightningEpochLog",
        ],
        "zeus_callbacks.lightning.pytorch",
    ),
    # The pipeline engines' adapters: their modules import Megatron-Core / DeepSpeed only when called.
    "instrument_megatron": "zeus_callbacks.megatron",
    "instrument_deepspeed": "zeus_callbacks.deepspeed",
}

__all__ = [
    "ZeusMonitor",
    "Measurement",
    "MeasurementState",
    "Callback",
    "CallbackSet",
    "Ready",
    "Warmup",
    "Profiling",
    "Done",
    "Inactive",
    "OptimumSelector",
    "PowerLimitMeasurement",
    "Time",
    "Energy",
    "ZeusCost",
    "MaxPowerConstraint",
    "MaxSlowdownConstraint",
    "ZeusCallbacksError",
    "GPUError",
    "GPUNoPermissionError",
    "GPUNotSupportedError",
    "GPULostError",
    "NVMLUnavailableError",
    "MIGNotSupportedError",
    *_CORE,
]

_lazy_getattr, __dir__ = lazy_exports(__name__, {**_CORE, **_ADAPTERS})
# Testing helpers that moved to `zeus_callbacks.sim` (the simulator is not part of the product surface).
_MOVED_TO_SIM = ("HFSimulatedGPUWork",)


def __getattr__(name: str) -> object:
    if name in _MOVED_TO_SIM:
        raise AttributeError(
            f"`zeus_callbacks.{name}` moved to the simulator's testing kit: `from zeus_callbacks.sim import {name}`."
        )
    return _lazy_getattr(name)


if TYPE_CHECKING:  # pragma: no cover
    from zeus_callbacks.core.device.gpus import get_gpus  # noqa: F401
    from zeus_callbacks.core.distributed import local_rank  # noqa: F401
    from zeus_callbacks.core.heterogeneous.planner import HeteroPlan, plan  # noqa: F401
    from zeus_callbacks.core.heterogeneous.profile_file import (  # noqa: F401
        GPUProfile,
        PowerLimitWindow,
        load_profile,
    )
    from zeus_callbacks.core.heterogeneous.profiler import profile_batch_size, profile_power_limits  # noqa: F401
    from zeus_callbacks.core.heterogeneous.training import (  # noqa: F401
        RankPlan,
        UnevenDistributedSampler,
        apply_power_limit,
        loss_scale,
        match_gpu_type,
        rank_plan,
        rank_plans,
        restore_power_limits,
        steps_per_epoch,
        uneven_dataloader,
        weight_gradients,
    )
    from zeus_callbacks.core.monitor.carbon import (  # noqa: F401
        CarbonEmissionMeasurement,
        CarbonEmissionMonitor,
        CarbonIntensityProvider,
        ElectricityMapsClient,
        ElectrictyMapsClient,
        FixedCarbonIntensity,
        RegionCarbonIntensity,
    )
    from zeus_callbacks.core.monitor.dataloader import ProfileDataLoader  # noqa: F401
    from zeus_callbacks.core.monitor.power import PowerDomain, PowerMonitor  # noqa: F401
    from zeus_callbacks.core.monitor.price import (  # noqa: F401
        ElectricityPriceProvider,
        EnergyCostMeasurement,
        EnergyCostMonitor,
        FixedElectricityPrice,
        OpenEIClient,
        RegionElectricityPrice,
    )
    from zeus_callbacks.core.monitor.replay import ReplayZeusMonitor  # noqa: F401
    from zeus_callbacks.core.monitor.temperature import TemperatureMonitor  # noqa: F401
    from zeus_callbacks.core.observability.endpoint import MetricsServer, serve_metrics  # noqa: F401
    from zeus_callbacks.core.observability.metric import (  # noqa: F401
        EnergyCumulativeCounter,
        EnergyHistogram,
        PowerGauge,
    )
    from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer  # noqa: F401
    from zeus_callbacks.core.pipeline_frequency.pipelining import instrument  # noqa: F401
    from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer  # noqa: F401
    from zeus_callbacks.core.report.saving import saving_text  # noqa: F401
    from zeus_callbacks.core.zeus_utils import get_env, zeus_cost  # noqa: F401
    from zeus_callbacks.huggingface import (  # noqa: F401
        HeterogeneousTrainer,
        HFEpochLog,
        HFGlobalPowerLimitOptimizer,
        HFHeterogeneousCallback,
        HFPipelineFrequencyOptimizer,
        HFZeusMonitor,
    )
    from zeus_callbacks.lightning.pytorch import (  # noqa: F401
        LightningEpochLog,
        LightningGlobalPowerLimitOptimizer,
        LightningHeterogeneous,
        LightningPipelineFrequencyOptimizer,
        LightningZeusMonitor,
    )
