"""Simulated boards built from an `nvidia-smi -q` dump (`ZEUS_CALLBACKS_SIMULATE=nvidia-smi:FILE`): each board's
identity and NVML facts from the dump, its timing from the nearest traced generation, scaled and labelled.

What comes from the dump, board by board: name, UUID, PCI bus id, the power-limit range, default, requested
and enforced limits (GPU and module scopes), idle power draw, maximum SM and memory clocks, memory,
persistence and MIG mode, architecture, and the driver version. What a dump cannot say is modelled and
labelled so: the time and power under a limit are a traced GPU's (`traces.scaled_trace`: the A40's for Ampere
and newer, the V100's for Volta and older, the T4's for Turing) stretched over the model's own range; the
lowest SM clock and the power update timing are the traced GPU's or its generation's (`specs.UPDATE_TIMING`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import pynvml

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.sim.dump import DumpBoard, NvidiaSmiDump, PowerReadings, read_nvidia_smi
from zeus_callbacks.sim.dump_files import DumpFiles
from zeus_callbacks.sim.node_spec import SPEC_INPUT
from zeus_callbacks.sim.specs import UPDATE_TIMING, GPUSpec, spec_for
from zeus_callbacks.sim.traces import Trace, scaled_trace, shipped_trace

__all__ = [
    "DUMP_PREFIX",
    "NVIDIA_DUMPS",
    "LimitScope",
    "DumpBoardModel",
    "DumpNode",
    "dump_node",
    "shipped_dumps",
]

DUMP_PREFIX = "nvidia-smi:"
ORIGIN = "an nvidia-smi dump"
_MiB = 1024**2
# nvidia-smi's `Product Architecture` (drivers 5xx and later) -> NVML's `nvmlDeviceArchitecture_t`.
_ARCHITECTURES = {
    "Kepler": pynvml.NVML_DEVICE_ARCH_KEPLER,
    "Maxwell": pynvml.NVML_DEVICE_ARCH_MAXWELL,
    "Pascal": pynvml.NVML_DEVICE_ARCH_PASCAL,
    "Volta": pynvml.NVML_DEVICE_ARCH_VOLTA,
    "Turing": pynvml.NVML_DEVICE_ARCH_TURING,
    "Ampere": pynvml.NVML_DEVICE_ARCH_AMPERE,
    "Ada Lovelace": pynvml.NVML_DEVICE_ARCH_ADA,
    "Hopper": pynvml.NVML_DEVICE_ARCH_HOPPER,
    "Blackwell": pynvml.NVML_DEVICE_ARCH_BLACKWELL,
}
# Older drivers print no architecture: the product series says it (NVIDIA's GeForce 600/700 series and Tesla K
# are Kepler, GeForce 900 and Tesla M Maxwell, GeForce 10 and Tesla P Pascal), e.g. `GTX680.nvidia-smi-a.txt`.
_SERIES = (
    (r"GTX 7[45]0|GTX 9\d\d|Tesla M", pynvml.NVML_DEVICE_ARCH_MAXWELL),
    (r"GTX [67]\d\d|Tesla K", pynvml.NVML_DEVICE_ARCH_KEPLER),
    (r"GTX 10\d\d|Tesla P|TITAN Xp", pynvml.NVML_DEVICE_ARCH_PASCAL),
)
_GA100 = re.compile(
    r"A100|A30\b"
)  # Ampere's GA100 boards: no 1-second power average (nvml.h, "except GA100")


@dataclass(frozen=True)
class LimitScope:
    """One board's settable power limit in one scope (GPU or module), in mW.

    `requested_mw` is what software set (`nvmlDeviceGetPowerManagementLimit`) when the node starts;
    `cap_mw` a limiter outside NVML's setter that holds the enforced limit lower, where the dump's limit in
    force is below the requested one (GH200: 700 W in force of 900 W requested); None where it is not.
    """

    min_mw: int
    max_mw: int
    default_mw: int
    requested_mw: int
    cap_mw: int | None = None


@dataclass(frozen=True)
class DumpBoardModel:
    """What a simulated board built from one `GPU <bus id>` block of a dump is and answers."""

    spec: GPUSpec
    trace: Trace
    uuid: str
    pci_bus_id: str
    gpu_limits: LimitScope | None  # None: N/A in the dump, so NVML answers NOT_SUPPORTED
    module_limits: LimitScope | None  # None: no module scope (every board but a GH200-like module)
    module_other_w: float  # the module's draw beside the GPU (Grace CPU, ...): ASSUMED constant
    persistence: bool
    mig: bool | None  # None: N/A (no MIG), NOT_SUPPORTED
    memory_power: bool  # whether NVML answers the memory power scope (`GPU Memory Power Readings`)
    energy_counter: bool  # Volta and newer (nvml.h, nvmlDeviceGetTotalEnergyConsumption)
    not_supported: frozenset[str]  # `Faults.not_supported` names of what the dump says is N/A

    def enforced_mw(self, requested_mw: int, module_limit_mw: int) -> int:
        """The limit the driver enforces (nvml.h, nvmlDeviceGetEnforcedPowerLimit: "after taking into account all
        limiters") when `requested_mw` is set: held lower by the dump's out-of-band cap, and by the share of the
        module limit left to the GPU."""
        limit = requested_mw
        if self.gpu_limits is not None and self.gpu_limits.cap_mw is not None:
            limit = min(limit, self.gpu_limits.cap_mw)
        if self.module_limits is not None:
            # ASSUMED: the module's draw beside the GPU (Grace CPU, memory) stays what the dump shows, so the
            # GPU gets the rest of the module limit, no less than its own lowest limit.
            lowest = self.gpu_limits.min_mw if self.gpu_limits else round(self.trace.min_power_limit_w * 1000)
            limit = min(limit, max(round(module_limit_mw - self.module_other_w * 1000), lowest))
        return limit


@dataclass(frozen=True)
class DumpNode:
    """The boards of one dump, in its (PCI bus) order, and the dump itself."""

    dump: NvidiaSmiDump
    boards: tuple[DumpBoardModel, ...]
    workload: str | None


NVIDIA_DUMPS = DumpFiles(DUMP_PREFIX, ".nvidia-smi-a.txt", "dump", "nvidia-smi -q", "A10")


def shipped_dumps() -> list[str]:
    """The names of the dumps shipped with the package (`nvidia-smi:NAME`), e.g. `A10`, `V100_x8`."""
    return NVIDIA_DUMPS.shipped()


def dump_node(spec: str) -> DumpNode:
    """The simulated boards of `nvidia-smi:FILE[:WORKLOAD]` (FILE a path or a shipped dump's name).

    Raises:
        InvalidInputError: the file is missing, is not an nvidia-smi -q dump, or holds inconsistent limits.
    """
    path, workload = NVIDIA_DUMPS.target(spec)
    dump = read_nvidia_smi(path)
    by_model: dict[str, list[DumpBoard]] = {}
    for board in dump.boards:
        by_model.setdefault(board.name, []).append(board)
    # Boards of one model share a chip, so one curve of time and power over the limits (scaled to the union of
    # their ranges); their settable ranges stay their own (V100_x8: 150-300 W on four boards, 100-300 W on four).
    try:
        traces = {name: _model_trace(boards, workload) for name, boards in by_model.items()}
    except InvalidInputError:
        raise
    except (OSError, ValueError) as e:  # a workload the traced GPU has no trace of
        raise InvalidInputError(f"{SPEC_INPUT} {spec!r}: {e}") from None
    return DumpNode(dump, tuple(_board_model(dump, b, traces[b.name]) for b in dump.boards), workload)


def architecture(board: DumpBoard) -> int:
    """NVML's architecture of the board: the dump's `Product Architecture`, else its product series."""
    if board.architecture is not None:
        return _ARCHITECTURES.get(board.architecture, pynvml.NVML_DEVICE_ARCH_UNKNOWN)
    found = (arch for pattern, arch in _SERIES if re.search(pattern, board.name))
    return next(found, pynvml.NVML_DEVICE_ARCH_UNKNOWN)


def _reference(arch: int) -> GPUSpec:
    """The traced GPU nearest the board's generation: the V100 up to Volta, the T4 for Turing, else the A40."""
    if arch <= pynvml.NVML_DEVICE_ARCH_VOLTA:
        return spec_for("v100")
    return spec_for("t4" if arch == pynvml.NVML_DEVICE_ARCH_TURING else "a40")


def _model_trace(boards: list[DumpBoard], workload: str | None) -> Trace:
    reference = _reference(architecture(boards[0]))
    traced = shipped_trace(reference.kind, workload)
    ranged = [b.gpu for b in boards if b.gpu.settable] or [b.module for b in boards if b.module.settable]
    lo = min((r.min_limit_w for r in ranged if r.min_limit_w), default=traced.min_power_limit_w)
    hi = max((r.max_limit_w for r in ranged if r.max_limit_w), default=traced.max_power_limit_w)
    return scaled_trace(traced, _kind(boards[0].name), lo, hi)


def _kind(name: str) -> str:
    """A short model name for labels: "NVIDIA GeForce RTX 3070" -> "rtx3070"."""
    return re.sub(r"[^a-z0-9]+", "", re.sub(r"nvidia|geforce|tesla", "", name.lower())) or "gpu"


def _spec(board: DumpBoard, arch: int, trace: Trace) -> GPUSpec:
    reference = _reference(arch)
    if arch == pynvml.NVML_DEVICE_ARCH_VOLTA:
        timing = UPDATE_TIMING["volta"]
    elif arch == pynvml.NVML_DEVICE_ARCH_HOPPER or _GA100.search(board.name):
        timing = UPDATE_TIMING["ga100_gh100"]
    else:  # measured on Turing and GA102; ASSUMED the same for Ada, Blackwell and what is older than Volta
        timing = UPDATE_TIMING["turing_ga102"]
    max_sm = board.max_sm_clock_mhz or reference.max_sm_clock_mhz
    # The dump's own idle draw (the boards were idle: `Utilization Gpu : 0 %`), else the traced GPU's.
    idle_w = board.gpu.draw_w if board.gpu.draw_w and not board.utilization_pct else reference.idle_power_w
    return dataclasses.replace(
        reference,
        kind=trace.gpu_model,
        name=board.name,
        architecture=arch,
        memory_bytes=(board.memory_mib or reference.memory_bytes // _MiB) * _MiB,
        max_sm_clock_mhz=max_sm,
        min_sm_clock_mhz=min(reference.min_sm_clock_mhz, max_sm),  # ASSUMED: the traced GPU's lowest clock
        memory_clocks_mhz=(board.max_memory_clock_mhz,)
        if board.max_memory_clock_mhz
        else reference.memory_clocks_mhz,
        idle_power_w=min(idle_w, trace.power(trace.min_power_limit_w)),
        # nvml.h: the 1-second average is "supported on Ampere (except GA100) or newer architectures".
        has_power_average_field=pynvml.NVML_DEVICE_ARCH_AMPERE <= arch < pynvml.NVML_DEVICE_ARCH_UNKNOWN
        and not _GA100.search(board.name),
        **timing,
        scaled_from=reference.kind,
        min_power_limit_w=trace.min_power_limit_w,
        max_power_limit_w=trace.max_power_limit_w,
        origin=ORIGIN,
    )


def _board_model(dump: NvidiaSmiDump, board: DumpBoard, trace: Trace) -> DumpBoardModel:
    arch = architecture(board)
    gpu = _scope(dump, board, board.gpu, "GPU Power Readings")
    module = _scope(dump, board, board.module, "Module Power Readings")
    unsupported = {
        "power": gpu is None,
        "power_draw": board.gpu.draw_w is None,
        "clocks": board.max_sm_clock_mhz is None,
        "clock_info": board.max_sm_clock_mhz is None,
        "persistence": board.persistence is None,
    }
    other_w = (board.module.draw_w or 0.0) - (board.gpu.draw_w or 0.0) if board.module.draw_w else 0.0
    return DumpBoardModel(
        spec=_spec(board, arch, trace),
        trace=trace,
        uuid=board.uuid,
        pci_bus_id=board.bus_id,
        gpu_limits=gpu,
        module_limits=module,
        module_other_w=max(0.0, other_w),
        persistence=bool(board.persistence),
        mig=board.mig,
        memory_power=board.memory_draw_w is not None,
        energy_counter=pynvml.NVML_DEVICE_ARCH_VOLTA <= arch < pynvml.NVML_DEVICE_ARCH_UNKNOWN,
        not_supported=frozenset(name for name, na in unsupported.items() if na),
    )


def _scope(dump: NvidiaSmiDump, board: DumpBoard, r: PowerReadings, section: str) -> LimitScope | None:
    """A scope's limits (mW), None where the dump gives it no settable range."""
    if r.min_limit_w is None or r.max_limit_w is None:
        return None
    default = r.default_limit_w if r.default_limit_w is not None else r.max_limit_w
    requested = next((w for w in (r.requested_limit_w, r.current_limit_w) if w is not None), default)
    current = r.current_limit_w if r.current_limit_w is not None else requested
    if not r.min_limit_w <= min(default, requested, current) <= max(default, requested) <= r.max_limit_w:
        raise InvalidInputError(
            f"{dump.source}, line {board.line} (GPU {board.bus_id}), {section}: the default, requested or current "
            f"limit lies outside {r.min_limit_w:g}-{r.max_limit_w:g} W. Save the dump again (`nvidia-smi -q`)."
        )
    return LimitScope(
        min_mw=round(r.min_limit_w * 1000),
        max_mw=round(r.max_limit_w * 1000),
        default_mw=round(default * 1000),
        requested_mw=round(requested * 1000),
        cap_mw=round(current * 1000) if current < requested else None,
    )
