"""Report Megatron-Core's pipeline schedules (1F1B and interleaved) to a `PipelineFrequencyOptimizer`.

Megatron-Core runs every forward and backward of a pipeline iteration through two functions of
`megatron.core.pipeline_parallel.schedules`, `forward_step` and `backward_step`, which both its schedules
(`forward_backward_pipelining_without_interleaving`, 1F1B, and `..._with_interleaving`, virtual pipeline
stages) call by their module-global names; `get_forward_backward_func()` returns one of the schedules, also
read from the module's globals. `instrument_megatron` wraps these four globals (no source edits, no CUDA
patches) and `MegatronInstrumentation.remove()` puts the originals back. Supported and tested: megatron-core
0.16.1 (0.12's signatures are handled: without `vp_stage`, the chunk is found by the model it runs).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

from zeus_callbacks.core.pipeline_frequency.dag import Instruction
from zeus_callbacks.core.pipeline_frequency.engine_step import (
    EngineStep,
    check_engine_arguments,
    check_schedule_shape,
)
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer

__all__ = ["MegatronInstrumentation", "instrument_megatron", "megatron_schedule_order"]

logger = logging.getLogger(__name__)

_ONE_F_ONE_B = "forward_backward_pipelining_without_interleaving"
_INTERLEAVED = "forward_backward_pipelining_with_interleaving"
_STEPS = ("forward_step", "backward_step")

_active: MegatronInstrumentation | None = None  # the schedules' globals are the process's: one at a time


def _schedules() -> Any:
    try:
        from megatron.core.pipeline_parallel import schedules
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "zeus_callbacks.megatron needs Megatron-Core: pip install 'zeus-callbacks[megatron]'."
        ) from e
    return schedules


def megatron_schedule_order(
    num_stages: int, num_microbatches: int, num_chunks: int = 1, microbatch_group_size: int | None = None
) -> list[list[Instruction]]:
    """Every pipeline rank's forwards and backwards, in the order Megatron-Core's schedule runs them.

    Built from Megatron's own tables: the warm-up count of `schedules.get_pp_rank_microbatches` (where the
    version has it) and the interleaved `schedules.get_schedule_table` (virtual microbatch -> microbatch and
    model chunk; a backward runs the chunks in reverse). Each rank runs its warm-up forwards, then one
    forward and one backward at a time, then the remaining backwards. Chunk `c` of rank `r` is virtual stage
    `c * num_stages + r`; with one chunk, instructions carry no virtual stage.

    Args:
        num_stages: Pipeline-parallel size.
        num_microbatches: Microbatches per iteration.
        num_chunks: Model chunks per rank (virtual pipeline size; 1: the 1F1B schedule).
        microbatch_group_size: `TransformerConfig.microbatch_group_size_per_vp_stage` (default: `num_stages`).
    """
    check_schedule_shape(
        "megatron_schedule_order",
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
        microbatch_group_size=microbatch_group_size,
    )
    schedules = _schedules()
    group = microbatch_group_size or num_stages
    total = num_microbatches * num_chunks
    if num_chunks > 1:
        table = schedules.get_schedule_table(num_microbatches, num_chunks, group)
    else:
        table = [(m, 0) for m in range(num_microbatches)]
    order = []
    for rank in range(num_stages):
        warmup = _warmup(schedules, rank, num_stages, num_microbatches, num_chunks, group)

        def instruction(k: int, kind: str, rank: int = rank) -> Instruction:
            microbatch, chunk = table[k]
            if kind == "backward":
                chunk = num_chunks - chunk - 1
            virtual = chunk * num_stages + rank if num_chunks > 1 else None
            return Instruction(rank, kind, microbatch, virtual)  # type: ignore[arg-type]

        ops = [instruction(k, "forward") for k in range(warmup)]
        for k in range(total - warmup):
            ops += [instruction(k + warmup, "forward"), instruction(k, "backward")]
        ops += [instruction(k, "backward") for k in range(total - warmup, total)]
        order.append(ops)
    return order


def _warmup(
    schedules: Any, rank: int, num_stages: int, num_microbatches: int, chunks: int, group: int
) -> int:
    """The warm-up forwards of pipeline rank `rank`: Megatron's `get_pp_rank_microbatches` where it can be
    asked about any rank (0.13+: it takes the `p2p_communicator`), else its formula (0.12 reads this
    process's `parallel_state`: megatron/core/pipeline_parallel/schedules.py `get_pp_rank_microbatches`)."""
    get = getattr(schedules, "get_pp_rank_microbatches", None)
    if get is not None and "p2p_communicator" in inspect.signature(get).parameters:
        pp_group = _Group(rank, num_stages)
        comm = _Communicator(pp_group, chunks if chunks > 1 else None)
        return int(get(num_microbatches, chunks, group, p2p_communicator=comm)[2])
    if chunks == 1:
        warmup = num_stages - rank - 1
    else:
        warmup = (num_stages - rank - 1) * 2 + (chunks - 1) * group
    return min(warmup, num_microbatches * chunks)


class _Group:
    """The `rank()`/`size()` of a pipeline group, for asking Megatron about a rank other than this one."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Communicator:
    """What `get_pp_rank_microbatches` reads of a `P2PCommunicator`."""

    def __init__(self, pp_group: _Group, virtual_size: int | None) -> None:
        self.pp_group = pp_group
        self.virtual_pipeline_model_parallel_size = virtual_size


def _first_tensor(value: Any) -> Any:
    return value[0] if isinstance(value, list | tuple) and value else value


class MegatronInstrumentation(EngineStep):
    """Megatron-Core's schedules, reporting to a `PipelineFrequencyOptimizer`; made by `instrument_megatron`.

    Hooks, per training call of a schedule (`forward_only=False`; evaluation passes are not reported):

    - the schedule's start -> `on_step_begin` (with `mark_steps`); at the first one, the optimizer is given
      every rank's order (`megatron_schedule_order`) to plan on and to check each rank's against;
    - `schedules.forward_step` -> `on_instruction_begin/end("forward")`, `schedules.backward_step` ->
      `on_instruction_begin/end("backward")`, each with its chunk's virtual stage when interleaved;
    - the schedule's end -> `on_step_end` (with `mark_steps`).

    `last_step` lists what this rank ran in its last complete training call, microbatch ids included (a
    backward is matched to its forward through the output tensor it is given). Use as a context manager, or
    call `remove()`.
    """

    def __init__(self, optimizer: PipelineFrequencyOptimizer, mark_steps: bool) -> None:
        super().__init__(optimizer, mark_steps)
        self.schedule: str | None = None  # the schedule function given to the optimizer, by name
        self._originals: dict[str, Callable[..., Any]] = {}
        self._wrappers: dict[str, Callable[..., Any]] = {}
        self._chunks: Sequence[Any] = ()
        self._pp: tuple[int, int] = (1, 0)  # (pipeline size, this rank)
        self._interleaved = False
        self._pending: dict[int, tuple[int, int]] = {}  # id(output tensor) -> (microbatch, chunk)
        self._counts: dict[
            int, int
        ] = {}  # forwards per chunk this step (versions without current_microbatch)

    # -- installing ------------------------------------------------------------------------------
    def _install(self) -> None:
        schedules = _schedules()
        makers: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
            _ONE_F_ONE_B: functools.partial(self._schedule, interleaved=False),
            _INTERLEAVED: functools.partial(self._schedule, interleaved=True),
            "forward_step": self._forward,
            "backward_step": self._backward,
        }
        for name, make in makers.items():
            original = getattr(schedules, name)
            wrapper = functools.wraps(original)(make(original))
            self._originals[name], self._wrappers[name] = original, wrapper
            setattr(schedules, name, wrapper)

    def remove(self) -> None:
        """Put Megatron's functions back (idempotent). Clocks are the optimizer's: `on_train_end` resets them."""
        global _active
        if not self._originals:
            return
        schedules = _schedules()
        for name, original in self._originals.items():
            if getattr(schedules, name) is not self._wrappers[name]:
                logger.warning(
                    "zeus_callbacks.megatron: schedules.%s was replaced by someone else after instrument_megatron; "
                    "restoring Megatron's own function.",
                    name,
                )
            setattr(schedules, name, original)
        self._originals.clear()
        self._wrappers.clear()
        if _active is self:
            _active = None

    def __enter__(self) -> MegatronInstrumentation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # -- the schedule: one training step ----------------------------------------------------------
    def _schedule(self, original: Callable[..., Any], interleaved: bool) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("forward_only", False) or self._training:  # evaluation, or a nested call
                return original(*args, **kwargs)
            self._begin(original.__name__, interleaved, kwargs)
            return self._run_step(original, *args, **kwargs)

        return run

    def _begin(self, name: str, interleaved: bool, kwargs: dict[str, Any]) -> None:
        """Read the iteration's shape from the schedule's arguments; hand the optimizer its order once."""
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        model = kwargs["model"]
        self._chunks = list(model) if isinstance(model, list | tuple) else [model]
        config = get_model_config(self._chunks[0])
        if interleaved and getattr(config, "overlap_moe_expert_parallel_comm", False):
            raise ValueError(
                "zeus_callbacks.megatron: `TransformerConfig(overlap_moe_expert_parallel_comm=True)` runs "
                "forwards and backwards of different microbatches together (combined 1F1B); the frequency "
                "planner models them apart. Turn it off while the PipelineFrequencyOptimizer is used."
            )
        comm = kwargs.get("p2p_communicator")
        if comm is not None:
            self._pp = (comm.pp_group.size(), comm.pp_group.rank())
        else:
            self._pp = (
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_rank(),
            )
        self._interleaved = interleaved
        self._pending.clear()
        self._counts.clear()
        if self.schedule is None:
            group = getattr(config, "microbatch_group_size_per_vp_stage", None)
            order = megatron_schedule_order(self._pp[0], kwargs["num_microbatches"], len(self._chunks), group)
            self.optimizer.use_schedule(order, name=name)
            self.schedule = name

    # -- forward_step / backward_step: one instruction each ----------------------------------------
    def _virtual_stage(self, chunk: int) -> int | None:
        return chunk * self._pp[0] + self._pp[1] if self._interleaved else None

    def _chunk(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        if kwargs.get("vp_stage") is not None:  # megatron-core >= 0.13
            return int(kwargs["vp_stage"])
        model = kwargs.get("model", args[2] if len(args) > 2 else None)
        return next((i for i, c in enumerate(self._chunks) if c is model), 0)

    def _forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self._training:
                return original(*args, **kwargs)
            chunk = self._chunk(args, kwargs)
            microbatch = kwargs.get("current_microbatch")
            if microbatch is None:  # forwards of a chunk run in microbatch order
                microbatch = self._counts.get(chunk, 0)
            self._counts[chunk] = self._counts.get(chunk, 0) + 1
            virtual = self._virtual_stage(chunk)
            self.optimizer.on_instruction_begin("forward", virtual_stage=virtual)
            out = original(*args, **kwargs)
            self.optimizer.on_instruction_end("forward", virtual_stage=virtual)
            self._pending[id(_first_tensor(out[0]))] = (int(microbatch), chunk)
            self._running.append(Instruction(self._pp[1], "forward", int(microbatch), virtual))
            return out

        return run

    def _backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self._training:
                return original(*args, **kwargs)
            output = kwargs.get("output_tensor", args[1] if len(args) > 1 else None)
            microbatch, chunk = self._pending.pop(id(_first_tensor(output)), (-1, 0))
            virtual = self._virtual_stage(chunk)
            self.optimizer.on_instruction_begin("backward", virtual_stage=virtual)
            out = original(*args, **kwargs)
            self.optimizer.on_instruction_end("backward", virtual_stage=virtual)
            self._running.append(Instruction(self._pp[1], "backward", microbatch, virtual))
            return out

        return run


def instrument_megatron(
    optimizer: PipelineFrequencyOptimizer, *, mark_steps: bool = True
) -> MegatronInstrumentation:
    """Drive `optimizer` from Megatron-Core's pipeline schedules in this process; returns the hooks.

    Every training call of the function `get_forward_backward_func()` returns (1F1B, or interleaved with
    `virtual_pipeline_model_parallel_size`) becomes one step, and each `forward_step`/`backward_step` it runs
    one instruction (see `MegatronInstrumentation`). Call it before `get_forward_backward_func()`, which
    reads the schedules' (wrapped) globals; Megatron-LM's `train_step` calls it every iteration.

    Args:
        optimizer: The optimizer to drive; its `pp_rank` is this rank's pipeline rank.
        mark_steps: False when something else marks the steps (`on_step_begin/end`): the instructions and
            the schedule's order are still reported.

    Raises:
        RuntimeError: Megatron's schedules are already instrumented in this process.
        ImportError: Megatron-Core is not installed.

    Example::

        from zeus_callbacks import PipelineFrequencyOptimizer, ZeusMonitor
        from zeus_callbacks.megatron import instrument_megatron

        pfo = PipelineFrequencyOptimizer(monitor=ZeusMonitor(gpu_indices=[local_rank]),
                                         pp_rank=parallel_state.get_pipeline_model_parallel_rank())
        with instrument_megatron(pfo):
            for batch in loader:
                forward_backward_func = get_forward_backward_func()
                forward_backward_func(forward_step_func=step, data_iterator=..., model=chunks,
                                      num_microbatches=8, seq_length=s, micro_batch_size=b)
                optimizer.step(); optimizer.zero_grad()
        pfo.on_train_end()
    """
    global _active
    check_engine_arguments("instrument_megatron", optimizer, mark_steps)
    if _active is not None:
        raise RuntimeError(
            "`instrument_megatron(...)`: Megatron-Core's schedules are already instrumented in this process; "
            "call `.remove()` on the first instrumentation before instrumenting again."
        )
    hooks = MegatronInstrumentation(optimizer, mark_steps)
    hooks._install()
    _active = hooks
    return hooks
