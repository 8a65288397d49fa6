"""Simulated GPUs driven by measured traces: the node (`SimulatedSystem`) and, re-exported, its parts."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from zeus_callbacks.core.device.amd import hip_visible_positions
from zeus_callbacks.core.device.backend import cuda_visible_uuids
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.sim.dump_node import NVIDIA_DUMPS, DumpBoardModel, DumpNode, dump_node
from zeus_callbacks.sim.gpu import SimulatedGPU
from zeus_callbacks.sim.host import VirtualClock
from zeus_callbacks.sim.node_spec import (
    IDEAL_BEHAVIOURS,
    Faults,
    parse_faults,
    parse_ideal,
    parse_spec,
)
from zeus_callbacks.sim.rocm_dump import ROCM_DUMPS, rocm_node
from zeus_callbacks.sim.specs import GPUSpec, sensor_gain, spec_for
from zeus_callbacks.sim.traces import Trace

__all__ = [
    "SimulatedGPU",
    "SimulatedSystem",
    "Faults",
    "VirtualClock",
    "parse_spec",
    "parse_faults",
    "parse_ideal",
    "IDEAL_BEHAVIOURS",
]
from zeus_callbacks.sim.node_spec import FAULTS_INPUT, SPEC_INPUT, merge_faults, pci_bus_id, uuid_for

# What CUDA's (HIP's, on an AMD node) numbering of the GPUs depends on.
_NUMBERING_ENV = ("CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


class _Board(NamedTuple):
    """One board of a node before it is built: its place in the spec, model, trace, identity and dump facts."""

    slot: int  # place in the spec string (its state file and, for a spec, its UUID)
    spec: GPUSpec
    trace: Trace
    uuid: str
    pci_bus_id: str
    board: DumpBoardModel | None
    faults: Faults  # what the dump says is N/A, as the faults NVML would answer it with

    @property
    def limits_w(self) -> tuple[float, float]:
        gpu = None if self.board is None else self.board.gpu_limits
        if gpu is None:
            return self.trace.min_power_limit_w, self.trace.max_power_limit_w
        return gpu.min_mw / 1000, gpu.max_mw / 1000


@dataclass
class SimulatedSystem:
    """A node of simulated GPUs built from a spec string, or from an `nvidia-smi -q` dump (`nvidia-smi:FILE`,
    `sim/dump_node.py`: its boards in the dump's order, with the dump's UUIDs and PCI bus ids).

    `gpus` lists them in NVML's order, by PCI bus. Unless `device_order` is ideal, the slower models sit
    on the lower buses, so that on a mixed node NVML's order differs from CUDA's default (fastest first)
    as it does on real ones; `cuda_gpus()` gives CUDA's. A GPU's UUID and persistent state follow its
    place in the spec string, whatever its bus.
    """

    spec: str
    noise: float = 0.0
    seed: int = 0
    faults: str = ""
    state_dir: str | None = None  # None: a per-user directory under the temp dir; "" : in memory only
    virtual_clock: bool = False
    ideal: str = ""  # comma-separated IDEAL_BEHAVIOURS to switch off
    energy_refresh_ms: float | None = None  # None: each model's own period
    bursts: bool = False  # stalls and bursts in steps (virtual clock), besides the Gaussian noise
    gpus: list[SimulatedGPU] = field(init=False)
    clock: VirtualClock | None = field(init=False)

    def __post_init__(self) -> None:
        faults = parse_faults(self.faults)
        self.ideal_behaviours = parse_ideal(self.ideal)
        self._check_numbers()
        self.clock = VirtualClock() if self.virtual_clock else None
        # A node from an nvidia-smi dump (`nvidia-smi:FILE`) answers with the dump's driver version.
        self.dump: DumpNode | None = None
        if NVIDIA_DUMPS.is_spec(self.spec):
            self.spec = NVIDIA_DUMPS.canonical(self.spec)
            self.dump = dump_node(self.spec)
        elif ROCM_DUMPS.is_spec(self.spec):  # an AMD node from a `rocm-smi -a` dump (`sim/rocm_dump.py`)
            self.spec = ROCM_DUMPS.canonical(self.spec)
            self.dump = rocm_node(self.spec)
        self.driver_version = "simulated" if self.dump is None else self.dump.dump.driver_version
        directory = self.state_path()
        boards = self._spec_boards(directory) if self.dump is None else self._dump_boards()
        self._check_faults(faults, [b.limits_w for b in boards])
        self.gpus = []
        for i, b in enumerate(boards):
            refresh_ms = (
                b.spec.energy_refresh_ms if self.energy_refresh_ms is None else self.energy_refresh_ms
            )
            update_s = b.spec.power_update_ms / 1000
            self.gpus.append(
                SimulatedGPU(
                    index=i,
                    spec=b.spec,
                    trace=b.trace,
                    uuid=b.uuid,
                    state_path=None if directory is None else directory / f"gpu{b.slot}.state",
                    clock=self.clock,
                    noise=self.noise,
                    seed=self.seed,
                    faults=merge_faults(merge_faults(b.faults, faults.get(None)), faults.get(i)),
                    energy_refresh_s=0.0 if "energy_counter" in self.ideal_behaviours else refresh_ms / 1000,
                    power_usage_averaged=b.spec.power_usage_averaged
                    and "power_average" not in self.ideal_behaviours,
                    blocking_sync="interruptible_sync" not in self.ideal_behaviours,
                    pci_bus_id=b.pci_bus_id,
                    bursts=self.bursts,
                    # Power update period and window per board: sim/specs.py (Yang et al., SC'24).
                    power_update_s=0.0 if "power_window" in self.ideal_behaviours else update_s,
                    power_window_s=b.spec.power_window_ms / 1000,
                    board=b.board,
                    sensor_gain=1.0 if "sensor_gain" in self.ideal_behaviours else sensor_gain(b.uuid),
                )
            )
        self._cuda_cache: tuple[tuple[str | None, ...], list[SimulatedGPU]] | None = None

    def _spec_boards(self, directory: Path | None) -> list[_Board]:
        """The boards of a `[COUNT*]KIND...` spec in NVML's order: unless `device_order` is ideal, slower models on
        the lower PCI buses (stable: the spec's order among equals)."""
        groups = parse_spec(self.spec)
        # A node's GPUs have UUIDs of their own: two simulated nodes (two state directories) never share one.
        node = "" if directory is None else str(directory.resolve())
        system_id = hashlib.sha1(f"{self.spec}|{node}".encode()).hexdigest()[:12]
        try:
            traces = [g.trace() for g in groups]
        except (OSError, ValueError) as e:
            raise InvalidInputError(f"{SPEC_INPUT} {self.spec!r}: {e}") from None
        models = [(spec_for(g.kind), t) for g, t in zip(groups, traces, strict=True) for _ in range(g.count)]
        slots = list(range(len(models)))  # place in the spec string
        if "device_order" not in self.ideal_behaviours:
            slots.sort(key=lambda s: models[s][0].fp32_tflops)
        uuids = [uuid_for(system_id, slot, models[slot][0].vendor) for slot in slots]
        return [
            _Board(slot, *models[slot], uuid, pci_bus_id(i), None, Faults())
            for i, (slot, uuid) in enumerate(zip(slots, uuids, strict=True))
        ]

    def _dump_boards(self) -> list[_Board]:
        """The boards of an `nvidia-smi:FILE` spec in the dump's order (nvidia-smi's: by PCI bus, as NVML's)."""
        assert self.dump is not None
        return [
            _Board(
                i,
                b.spec,
                b.trace,
                b.uuid,
                b.pci_bus_id,
                b,
                Faults(
                    not_supported=b.not_supported, no_energy_counter=not b.energy_counter, mig=bool(b.mig)
                ),
            )
            for i, b in enumerate(self.dump.boards)
        ]

    def _check_numbers(self) -> None:
        if (
            isinstance(self.noise, bool)
            or not isinstance(self.noise, (int, float))
            or not 0 <= self.noise <= 0.5
        ):
            raise InvalidInputError(
                f"Simulated noise {self.noise!r} (ZEUS_CALLBACKS_SIM_NOISE, or simulate(noise=...)) must be a "
                "number from 0 to 0.5: the relative run-to-run spread, e.g. 0.02."
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InvalidInputError(
                f"Simulation seed {self.seed!r} (ZEUS_CALLBACKS_SIM_SEED, or simulate(seed=...)) must be a "
                "whole number, e.g. 0."
            )
        refresh = self.energy_refresh_ms
        if refresh is not None and not (isinstance(refresh, (int, float)) and 0 <= refresh <= 10_000):
            raise InvalidInputError(
                f"Energy-counter refresh period {refresh!r} (ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS, or "
                "simulate(energy_refresh_ms=...)) must be a number of ms from 0 to 10000 (0: every read is "
                "exact); unset it for each model's own."
            )

    def _check_faults(self, faults: dict[int | None, Faults], ranges_w: list[tuple[float, float]]) -> None:
        """Faults must name GPUs of this node (`ranges_w`, their power-limit ranges, in NVML order) and limits
        within their range."""
        missing = sorted(i for i in faults if i is not None and i >= len(ranges_w))
        if missing:
            raise InvalidInputError(
                f"{FAULTS_INPUT} {self.faults!r} target GPU {missing[0]}, but {self.spec!r} has "
                f"{len(ranges_w)} GPU(s) (NVML indices 0-{len(ranges_w) - 1})."
            )
        for i, (lo, hi) in enumerate(ranges_w):
            w = merge_faults(faults.get(None), faults.get(i)).default_limit_w
            if w is not None and not lo <= w <= hi:
                raise InvalidInputError(
                    f"{FAULTS_INPUT} {self.faults!r}: default_limit_w={w:g} is outside GPU {i}'s power-limit "
                    f"range {lo:g}-{hi:g} W."
                )

    @property
    def vendor(self) -> str:
        """Whose library answers for the node's GPUs: "nvidia" (NVML) or "amd" (amdsmi); one per node."""
        return self.gpus[0].spec.vendor if self.gpus else "nvidia"

    def cuda_gpus(self) -> list[SimulatedGPU]:
        """The GPUs CUDA shows this process, in CUDA's numbering (element i is `cuda:i`).

        CUDA cannot open a GPU the job's cgroup hides. It numbers the rest fastest first, then by PCI
        bus, unless `CUDA_DEVICE_ORDER=PCI_BUS_ID` (NVML's order); `CUDA_VISIBLE_DEVICES` then selects
        and renumbers them by that numbering or by UUID prefix.
        """
        key = tuple(os.environ.get(v) for v in _NUMBERING_ENV)
        if self._cuda_cache is not None and self._cuda_cache[0] == key:
            return self._cuda_cache[1]
        order = [g for g in self.gpus if not g.faults.hidden]
        if self.vendor == "amd":  # HIP's numbering: the node's order, then ROCR_/HIP_VISIBLE_DEVICES (amd.py)
            gpus = [order[p] for p in hip_visible_positions([g.uuid for g in order])]
            self._cuda_cache = (key, gpus)
            return gpus
        if key[0] != "PCI_BUS_ID" and "device_order" not in self.ideal_behaviours:
            order.sort(key=lambda g: -g.spec.fp32_tflops)
        by_uuid = {g.uuid: g for g in order}
        gpus = [by_uuid[u] for u in cuda_visible_uuids(key[1], [g.uuid for g in order])]
        self._cuda_cache = (key, gpus)
        return gpus

    def state_path(self) -> Path | None:
        """Directory where this node's GPU state lives (None when kept in memory)."""
        if self.state_dir == "":
            return None
        base = (
            Path(self.state_dir)
            if self.state_dir
            else Path(tempfile.gettempdir()) / f"zeus_callbacks-sim-{os.getuid()}"
        )
        # A dump's node keys on the dump's text too: two dumps (or one edited) never share a state.
        key = self.spec if self.dump is None else f"{self.spec}|{self.dump.dump.digest}"
        return base / hashlib.sha1(key.encode()).hexdigest()[:12]

    def run_step(self, work_s: float | dict[int, float]) -> float:
        """Virtual clock only: run one synchronous step of work on every GPU; returns its duration (s).

        `work_s` is the work of each GPU in seconds at its maximum power limit (one value for all, or per
        GPU index). The step lasts as long as the slowest GPU; the others idle until it ends.
        """
        if self.clock is None:
            raise RuntimeError("run_step needs a virtual clock: SimulatedSystem(..., virtual_clock=True).")
        per = work_s if isinstance(work_s, dict) else {g.index: float(work_s) for g in self.gpus}
        start = self.clock.now()
        runs = {i: self.gpus[i].busy_time(w) for i, w in per.items()}
        span = max((t for t, _ in runs.values()), default=0.0)
        for i, (t, p) in runs.items():
            self.gpus[i].run_virtual(start, t, p, span)
        self.clock.advance(span)
        return span
