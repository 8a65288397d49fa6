"""The pipeline-frequency optimizer (Perseus): per-instruction SM clocks for pipeline-parallel training.

- `optimizer`: `PipelineFrequencyOptimizer`, the phase machine (waiting, profiling, applying, ...).
- `recorder`: time and energy of each instruction of a step and of the gaps between instructions.
- `clock_sweep`: which clocks each stage profiles, when it stops, replicas merged, blocking power.
- `planning`: the schedule that ran, its DAG solved, each stage's clock per instruction.
- `dag` and `frontier`: pipeline schedules, their DAG, and the time-energy frontier solver.
- `controller`: sets the SM clock from a background thread.
- `profile_file`: the `stage,instruction,frequency,time,energy` CSV (row, reader, writer).
- `pipelining`: reports a `torch.distributed.pipelining` stage's instructions to the optimizer.
"""
