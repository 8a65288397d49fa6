"""The framework-free core of zeus_callbacks, one package per feature.

- `device/`: the `Device` boundary (`device.py`) and one module per vendor, the only code that calls a
  vendor's library (`nvidia/`: NVML through nvidia-ml-py; `amd.py`: amdsmi); GPUs (by UUID) and their
  policy, errors, the state guard that journals and restores every change, and backend discovery (the
  simulator registers itself as a backend).
- `monitor/`: `ZeusMonitor` windows of time and energy, energy reporting and metric names, epoch logs.
- `power_limit/`: `GlobalPowerLimitOptimizer` (a phase machine), its search, selectors, its profile file.
- `pipeline_frequency/`: Perseus. Instruction recorder, clock sweep, planning, DAG, frontier, controller.
- `heterogeneous/`: the Zeus² planner, its profile file, uneven-batch training.
- `distributed.py`: collectives, `Group`, `local_rank()`, the one SIGINT/SIGTERM chain.
Adapters (`zeus_callbacks.huggingface`, `.lightning`, `.accelerate`) translate hooks into calls on these;
nothing here imports a framework, an adapter or the simulator.
"""
