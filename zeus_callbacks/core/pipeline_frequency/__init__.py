"""The pipeline-frequency optimizer (Perseus): per-instruction SM clocks for pipeline-parallel training.

- `optimizer`: `PipelineFrequencyOptimizer`, the hooks and the phase machine; `phases` its phases,
  `readout` what it shows (functions of its parts), `options` its argument checks and records, `clock_setup`
  what the ranks agree on at the first step, `stage_clocks` the clocks a rank sets, `profiling` the profile
  shared across ranks and solved.
- `recorder`: time and energy of each instruction of a step and of the gaps between instructions.
- `clock_sweep`: which clocks each stage profiles, when it stops, replicas merged, blocking power.
- `planning`: the schedule that ran, its DAG solved, each stage's clock per instruction.
- `dag` and `frontier`: pipeline schedules, their DAG, and the time-energy frontier solver (`energy_model`:
  the options, plans and their energy; `plan_search`: the tables built from the DAG and the greedy and local search over them).
- `controller`: sets the SM clock from a background thread.
- `profile_file`: the `stage,instruction,frequency,time,energy` CSV (row, reader, writer).
- `pipelining`: reports a `torch.distributed.pipelining` stage's instructions to the optimizer;
  `engine_step`: one training step of any engine's instrumentation (pipelining, Megatron-Core, DeepSpeed).
"""
