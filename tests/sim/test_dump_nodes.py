"""Simulated nodes built from real `nvidia-smi -q` dumps (`nvidia-smi:FILE`): NVML, through nvidia-ml-py as the
package calls it, answers each dump's values board by board; the package's commands and monitor run on each.

The expected values are read here from the dump's text with plain patterns, not with the simulator's parser."""

from __future__ import annotations

import ctypes
import json
import os
import re

import pynvml
import pytest

from zeus_callbacks import cli, sim
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.sim.dump_files import dump_dir
from zeus_callbacks.sim.dump_node import shipped_dumps

DUMPS = shipped_dumps()
NOT_SUPPORTED = "NotSupported"


def _text(name: str) -> str:
    return (dump_dir() / f"{name}.nvidia-smi-a.txt").read_text()


def _blocks(text: str) -> list[tuple[str, str]]:
    """(bus id, block text) per `GPU <bus id>` line."""
    parts = re.split(r"^GPU (\S+)\s*$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def _field(block: str, *keys: str) -> str:
    """The first value of any of `keys` in the block (the GPU scope comes before the module's)."""
    found = [m for k in keys if (m := re.search(rf"^\s+{k}\s*:\s*(.*?)\s*$", block, re.M))]
    return min(found, key=lambda m: m.start()).group(1)


def _section(block: str, title: str, key: str) -> str:
    return re.search(rf"^    {title}\s*\n(?:        .*\n)*?\s+{key}\s*:\s*(.*?)\s*$", block, re.M).group(1)


def _mw(value: str) -> int | str:
    return NOT_SUPPORTED if value == "N/A" else round(float(value.split()[0]) * 1000)


def _expected(block: str) -> dict:
    """What NVML answers for one board, from the dump's text."""
    mig = _section(block, "MIG Mode", "Current")
    return {
        "name": _field(block, "Product Name"),
        "uuid": _field(block, "GPU UUID"),
        "bus_id": _field(block, "Bus Id"),
        "constraints": [_mw(_field(block, "Min Power Limit")), _mw(_field(block, "Max Power Limit"))]
        if _field(block, "Min Power Limit") != "N/A"
        else NOT_SUPPORTED,
        "default": _mw(_field(block, "Default Power Limit")),
        "requested": _mw(_field(block, "Requested Power Limit", "Power Limit")),
        "enforced": _mw(_field(block, "Current Power Limit", "Enforced Power Limit")),
        "max_sm": NOT_SUPPORTED
        if (sm := _section(block, "Max Clocks", "SM")) == "N/A"
        else int(sm.split()[0]),
        "max_mem": NOT_SUPPORTED
        if (mem := _section(block, "Max Clocks", "Memory")) == "N/A"
        else int(mem.split()[0]),
        "memory": int(_section(block, "FB Memory Usage", "Total").split()[0]) * 2**20,
        "persistence": int(_field(block, "Persistence Mode") == "Enabled"),
        "mig": NOT_SUPPORTED if mig == "N/A" else [int(mig == "Enabled")] * 2,
        "idle_power": _mw(_field(block, "Power Draw", "Instantaneous Power Draw")),  # the boards were idle
    }


def _ask(fn, *args):
    try:
        value = fn(*args)
    except pynvml.NVMLError_NotSupported:
        return NOT_SUPPORTED
    return value if not isinstance(value, bytes) else value.decode()


def _answers(h) -> dict:
    mem = pynvml.NVML_CLOCK_MEM
    return {
        "name": _ask(pynvml.nvmlDeviceGetName, h),
        "uuid": _ask(pynvml.nvmlDeviceGetUUID, h),
        "bus_id": _ask(lambda h: pynvml.nvmlDeviceGetPciInfo(h).busId, h),
        "constraints": _ask(pynvml.nvmlDeviceGetPowerManagementLimitConstraints, h),
        "default": _ask(pynvml.nvmlDeviceGetPowerManagementDefaultLimit, h),
        "requested": _ask(pynvml.nvmlDeviceGetPowerManagementLimit, h),
        "enforced": _ask(pynvml.nvmlDeviceGetEnforcedPowerLimit, h),
        "max_sm": _ask(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM),
        "max_mem": _ask(pynvml.nvmlDeviceGetMaxClockInfo, h, mem),
        "memory": pynvml.nvmlDeviceGetMemoryInfo(h).total,
        "persistence": _ask(pynvml.nvmlDeviceGetPersistenceMode, h),
        "mig": _ask(pynvml.nvmlDeviceGetMigMode, h),
        "idle_power": _ask(pynvml.nvmlDeviceGetPowerUsage, h),
    }


@pytest.fixture
def node(sim_gpus):
    """`node(name)`: simulate the dump's node on a virtual clock, with pynvml initialised on it."""

    def make(name: str) -> sim.SimulatedSystem:
        system = sim_gpus(f"nvidia-smi:{name}", virtual_clock=True)
        pynvml.nvmlInit()  # the simulator's detach at the test's end gives pynvml back what it had
        return system

    return make


def test_every_shipped_dump_is_one_of_the_eighteen_node_types():
    assert len(DUMPS) == 18 and {"V100_x8", "GTX680", "GH200", "H100NVLx2", "RTX5090", "A10"} <= set(DUMPS)
    assert (dump_dir() / "LICENSE.Apache-2.0").is_file()


@pytest.mark.parametrize("name", DUMPS)
def test_nvml_answers_the_dumps_values_board_by_board(sim_gpus, name):
    text = _text(name)
    system = sim_gpus(f"nvidia-smi:{name}", virtual_clock=True)
    pynvml.nvmlInit()
    try:
        driver = re.search(r"Driver Version\s*:\s*(\S+)", text).group(1)
        cuda_major = re.search(r"CUDA Version\s*:\s*(\d+)", text).group(1)
        assert pynvml.nvmlSystemGetDriverVersion() == driver
        assert pynvml.nvmlSystemGetNVMLVersion() == f"{cuda_major}.{driver}"  # as a real library's reads
        blocks = _blocks(text)
        assert (
            pynvml.nvmlDeviceGetCount()
            == len(blocks)
            == int(re.search(r"Attached GPUs\s*:\s*(\d+)", text)[1])
        )
        for i, (_, block) in enumerate(blocks):
            assert _answers(pynvml.nvmlDeviceGetHandleByIndex(i)) == _expected(block), (name, i)
    finally:
        pynvml.nvmlShutdown()
    label = f"{_field(blocks[0][1], 'Product Name')} from an nvidia-smi dump; timing modelled from "
    assert all(g.provenance.startswith(label) and g.provenance.endswith(" traces") for g in system.gpus)


def test_boards_of_one_model_keep_their_own_ranges_and_share_one_curve(node):
    """V100_x8: 150-300 W on the boards at 00:04, 00:08, 00:0A and 00:0B, 100-300 W on the others."""
    system = node("V100_x8")
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(8)]
    mins = [pynvml.nvmlDeviceGetPowerManagementLimitConstraints(h)[0] // 1000 for h in handles]
    assert mins == [150, 100, 100, 100, 150, 100, 150, 150]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceSetPowerManagementLimit(handles[0], 120_000)
    pynvml.nvmlDeviceSetPowerManagementLimit(handles[1], 120_000)
    for h in handles[:2]:
        pynvml.nvmlDeviceSetPowerManagementLimit(h, 200_000)
    a, b = system.gpus[0], system.gpus[1]
    assert a.operating_point() == b.operating_point()  # one chip, one curve: 200 W behaves the same on both
    assert a.trace.source.endswith("summary_power_v100.csv, scaled to 100-300 W (modelled, not traced)")


@pytest.mark.parametrize(
    ("name", "requested_w", "in_force_w", "max_w"),
    [("GH200", 900, 700, 900), ("H100NVLx2", 310, 310, 400), ("RTX3070", 220, 220, 250)],
)
def test_the_limit_in_force_when_the_node_starts_is_the_dumps(sim_gpus, name, requested_w, in_force_w, max_w):
    """A step at the maximum's work takes what the dump's limit in force gives it, not the maximum's time."""
    system = sim_gpus(f"nvidia-smi:{name}", virtual_clock=True)
    gpu = system.gpus[0]
    assert (gpu.power_limit_mw, gpu.enforced_power_limit_mw) == (requested_w * 1000, in_force_w * 1000)
    assert gpu.max_power_limit_mw == max_w * 1000
    span = system.run_step(1.0)
    assert span == pytest.approx(gpu.trace.relative_time(in_force_w)) and (in_force_w == max_w or span > 1.0)


def test_gh200_module_scope_answers_and_is_set_as_nvml_h_says(node):
    """Module fields (nvmlDeviceGetFieldValues with scopeId NVML_POWER_SCOPE_MODULE) and the module limit
    (nvmlDeviceSetPowerManagementLimit_v2 with powerScope NVML_POWER_SCOPE_MODULE), from GH200's dump."""
    system = node("GH200")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    module = pynvml.NVML_POWER_SCOPE_MODULE
    fields = [pynvml.NVML_FI_DEV_POWER_MIN_LIMIT, pynvml.NVML_FI_DEV_POWER_MAX_LIMIT,
              pynvml.NVML_FI_DEV_POWER_DEFAULT_LIMIT, pynvml.NVML_FI_DEV_POWER_CURRENT_LIMIT,
              pynvml.NVML_FI_DEV_POWER_REQUESTED_LIMIT, pynvml.NVML_FI_DEV_POWER_INSTANT]  # fmt: skip

    def read(scope: int) -> list:
        values = pynvml.nvmlDeviceGetFieldValues(h, [(f, scope) for f in fields])
        return [v.value.uiVal if v.nvmlReturn == 0 else NOT_SUPPORTED for v in values]

    assert read(module) == [200_000, 1_000_000, 1_000_000, 1_000_000, 1_000_000, 169_770]  # 87.88 + 81.89 W
    assert read(pynvml.NVML_POWER_SCOPE_GPU)[:5] == [100_000, 900_000, 900_000, 700_000, 900_000]
    assert pynvml.nvmlDeviceSetPowerManagementLimit_v2(h, module, 600_000) == pynvml.NVML_SUCCESS
    assert read(module)[3:5] == [600_000, 600_000]
    # The module's other draw stays (ASSUMED), so the GPU is held to the rest: 600 - 81.89 W.
    assert (
        pynvml.nvmlDeviceGetEnforcedPowerLimit(h) == 518_110
        and pynvml.nvmlDeviceGetPowerManagementLimit(h) == 900_000
    )
    assert system.run_step(1.0) == pytest.approx(system.gpus[0].trace.relative_time(518.11))
    assert read(pynvml.NVML_POWER_SCOPE_MEMORY)[5] == NOT_SUPPORTED  # only the average is offered there


def _set_v2(h, scope: int, mw: int, version: int = pynvml.nvmlPowerValue_v2) -> int:
    """The C function's own return code (nvidia-ml-py 13.615's wrapper returns NVML_SUCCESS whatever it is)."""
    value = pynvml.c_nvmlPowerValue_v2_t(version=version, powerScope=scope, powerValueMw=mw)
    return pynvml.nvmlLib.nvmlDeviceSetPowerManagementLimit_v2(h, ctypes.byref(value))


def test_the_v2_setter_answers_each_scope_and_version_as_nvml_does(node):
    node("GH200")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    gpu_scope, module = pynvml.NVML_POWER_SCOPE_GPU, pynvml.NVML_POWER_SCOPE_MODULE
    assert _set_v2(h, module, 100_000) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # below the module's 200 W
    assert _set_v2(h, pynvml.NVML_POWER_SCOPE_MEMORY, 300_000) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert _set_v2(h, gpu_scope, 300_000, version=1) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    assert _set_v2(h, gpu_scope, 300_000) == pynvml.NVML_SUCCESS  # a drop-in for the v1 setter
    assert pynvml.nvmlDeviceGetPowerManagementLimit(h) == pynvml.nvmlDeviceGetEnforcedPowerLimit(h) == 300_000
    assert (
        pynvml.nvmlDeviceSetPowerManagementLimit_v2(h, module, 5) == pynvml.NVML_SUCCESS
    )  # the wrapper hides it
    node("A10")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert _set_v2(h, module, 150_000) == pynvml.NVML_ERROR_NOT_SUPPORTED  # no module scope on an A10
    values = pynvml.nvmlDeviceGetFieldValues(h, [(pynvml.NVML_FI_DEV_POWER_MAX_LIMIT, module)])
    assert values[0].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_a_module_scope_where_the_gpu_scope_is_not_available(node, tmp_path):
    """A dump whose GPU limits are N/A and whose module limits are not: the GPU scope's calls answer
    NOT_SUPPORTED, the module scope is set and holds the GPU."""
    head, rest = _text("GH200").split("    GPU Power Readings\n")
    gpu, tail = rest.split("    GPU Memory Power Readings")
    gpu = re.sub(r"(Power Limit\s*: )[\d.]+ W", r"\1N/A", gpu)
    text = f"{head}    GPU Power Readings\n{gpu}    GPU Memory Power Readings{tail}"
    dump = tmp_path / "gh200-module-only.txt"
    dump.write_text(text)
    system = node(str(dump))
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    for call in (
        pynvml.nvmlDeviceGetPowerManagementLimitConstraints,
        pynvml.nvmlDeviceGetPowerManagementLimit,
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(h)
    assert _set_v2(h, pynvml.NVML_POWER_SCOPE_GPU, 300_000) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert _set_v2(h, pynvml.NVML_POWER_SCOPE_MODULE, 500_000) == pynvml.NVML_SUCCESS
    assert system.gpus[0].enforced_power_limit_mw == 418_110


def test_a_board_without_power_management_answers_not_supported(node):
    """GTX680 (driver 470): `Power Readings` all N/A, so every power call answers NOT_SUPPORTED, as there."""
    node("GTX680")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    for call in (pynvml.nvmlDeviceGetPowerManagementLimitConstraints, pynvml.nvmlDeviceGetPowerManagementDefaultLimit,
                 pynvml.nvmlDeviceGetPowerManagementLimit, pynvml.nvmlDeviceGetEnforcedPowerLimit,
                 pynvml.nvmlDeviceGetPowerUsage, pynvml.nvmlDeviceGetTotalEnergyConsumption):  # fmt: skip
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(h)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceSetPowerManagementLimit(h, 150_000)
    assert (
        pynvml.nvmlDeviceGetArchitecture(h) == pynvml.NVML_DEVICE_ARCH_KEPLER
    )  # from its series: 470 prints none


@pytest.mark.parametrize("name", DUMPS)
def test_doctor_and_devices_run_on_each_dump_built_node(sim_gpus, capsys, monkeypatch, name):
    """`doctor` on a node from `simulate(...)`, `devices` on one from the environment variable."""
    sim_gpus(f"nvidia-smi:{name}", virtual_clock=True)
    code = cli.main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    blocks = _blocks(_text(name))
    assert report["simulated"] is True and len(report["gpus"]) == len(blocks)
    assert report["driver_version"] == re.search(r"Driver Version\s*:\s*(\S+)", _text(name)).group(1)
    mins = [_mw(_field(b, "Min Power Limit")) for _, b in blocks]
    assert [
        None if g["min_power_limit_w"] is None else g["min_power_limit_w"] * 1000 for g in report["gpus"]
    ] == [None if m == NOT_SUPPORTED else m for m in mins]
    assert (code, report["problems"] != []) == ((1, True) if name == "GTX680" else (0, False))
    sim.disable()
    monkeypatch.setenv("ZEUS_CALLBACKS_SIMULATE", f"nvidia-smi:{name}")
    assert cli.main(["devices"]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("SIMULATED GPUs")
        and f"SIMULATED ({_field(blocks[0][1], 'Product Name')} from an " in out
    )
    assert out.count(" from an nvidia-smi dump; timing modelled from ") == len(blocks)


@pytest.mark.parametrize("name", DUMPS)
def test_the_monitor_measures_a_window_on_each(sim_gpus, name):
    """20 steps of 0.1 s of work at the maximum: the window lasts what the limit in force gives (the slowest
    board), and each board's energy is what the simulator drew, to within one refresh of its counter (GTX680:
    none to read, so timed only)."""
    system = sim_gpus(f"nvidia-smi:{name}", virtual_clock=True)
    monitor = ZeusMonitor()
    before = [g.true_energy_mj() for g in system.gpus]
    monitor.begin_window("w")
    for _ in range(20):
        system.run_step(0.1)
    m = monitor.end_window("w")
    slowest = max(g.trace.relative_time(g.enforced_power_limit_mw / 1000) for g in system.gpus)
    assert m.time == pytest.approx(2.0 * slowest)
    if name == "GTX680":  # no energy counter and no power reading: timed, its energy missing (not 0 J)
        assert m.gpu_energy == {} and not monitor.lost_gpus
        return
    for g, e0 in zip(system.gpus, before, strict=True):
        drawn_j = (g.true_energy_mj() - e0) / 1000
        busy_w = g.trace.power(g.enforced_power_limit_mw / 1000)
        assert drawn_j == pytest.approx(2.0 * busy_w * g.trace.relative_time(g.enforced_power_limit_mw / 1000)
                                        + (m.time - 2.0 * g.trace.relative_time(g.enforced_power_limit_mw / 1000))
                                        * g.spec.idle_power_w)  # fmt: skip
        assert abs(m.gpu_energy[g.index] - drawn_j) <= 1.01 * busy_w * g.energy_refresh_s


def test_state_keys_on_the_dumps_text(sim_gpus, tmp_path):
    """Two dumps never share a node's state, even under one file name; the same dump finds its own again."""
    dump = tmp_path / "node.txt"
    dump.write_text(_text("A10"))
    first = sim_gpus(f"nvidia-smi:{dump}")
    first.gpus[0].set_power_limit_mw(120_000)
    again = sim_gpus(f"nvidia-smi:{dump}")
    assert again.state_path() == first.state_path() and again.gpus[0].power_limit_mw == 120_000
    dump.write_text(
        _text("A10").replace(
            "Requested Power Limit             : 150.00 W", "Requested Power Limit : 140.00 W"
        )
    )
    edited = sim_gpus(f"nvidia-smi:{dump}")
    assert edited.state_path() != first.state_path() and edited.gpus[0].power_limit_mw == 140_000


def test_a_workload_after_the_dump_selects_the_traced_gpus_workload(sim_gpus):
    system = sim_gpus("nvidia-smi:A10:imagenet/resnet50/128", virtual_clock=True)
    assert system.gpus[0].trace.workload.startswith("imagenet/resnet50/128")
    with pytest.raises(InvalidInputError, match="no/such/workload"):
        sim_gpus("nvidia-smi:A10:no/such/workload", virtual_clock=True)


_ROCM = """============================ ROCm System Management Interface ============================
============================== Version of System Component ===============================
Driver version: 6.7.0
GPU[0]		: Device ID: 0x74a1
"""
_TABLE = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.90.12              Driver Version: 550.90.12      CUDA Version: 12.4     |
"""


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("", ["is empty", "nvidia-smi -q > node.txt"]),
        (_ROCM, ["is a rocm-smi dump (AMD GPUs)", "NVIDIA nodes only", "ZEUS_CALLBACKS_SIMULATE=rocm-smi:"]),
        (_TABLE, ["summary table", "nvidia-smi -q > node.txt"]),
        ("hello\nworld\n", ["is not an nvidia-smi -q dump", "nvidia-smi -q > node.txt"]),
        (None, ["neither a file nor a shipped dump", "A10", "V100_x8"]),
    ],
)
def test_a_bad_file_says_what_it_is_and_what_to_give(tmp_path, content, words):
    path = tmp_path / "given.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InvalidInputError) as e:
        sim.simulate(f"nvidia-smi:{path}", virtual_clock=True)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_truncated_dump_is_refused(tmp_path):
    text = _text("H100NVLx2")
    path = tmp_path / "cut.txt"
    path.write_text(text[: text.index("GPU 00000000:AE:00.0")])
    with pytest.raises(InvalidInputError, match="Attached GPUs : 2` but 1 .* truncated"):
        sim.simulate(f"nvidia-smi:{path}", virtual_clock=True)


def test_a_relative_path_is_exported_absolute_for_processes_started_elsewhere(
    sim_gpus, tmp_path, monkeypatch
):
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "node.txt").write_text(_text("RTX3070"))
    monkeypatch.chdir(tmp_path / "here")
    node = sim_gpus("nvidia-smi:node.txt")
    exported = dict(os.environ)
    assert exported[sim.SIMULATE_ENV] == f"nvidia-smi:{tmp_path / 'here' / 'node.txt'}" and sim.exported(node)
    sim.disable()
    monkeypatch.chdir(tmp_path)
    for name in (sim.SIMULATE_ENV, "ZEUS_CALLBACKS_SIM_STATE_DIR"):
        monkeypatch.setenv(name, exported[name])
    child = sim.active()  # what a process started in another directory with that environment builds
    assert child.state_path() == node.state_path() and [g.uuid for g in child.gpus] == [
        g.uuid for g in node.gpus
    ]


@pytest.mark.parametrize("name", DUMPS)
def test_sm_clocks_lock_through_nvml_and_pace_the_work(node, name):
    """The pipeline-frequency optimizer's calls: supported clocks up to the dump's maximum, a lock at half of it
    slows a step to about twice the maximum's time; GTX680 (`Max Clocks : N/A`) answers NOT_SUPPORTED."""
    system = node(name)
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    if name == "GTX680":
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetSupportedMemoryClocks(h)
        return
    memory = pynvml.nvmlDeviceGetSupportedMemoryClocks(h)
    clocks = pynvml.nvmlDeviceGetSupportedGraphicsClocks(h, memory[0])
    top = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)
    assert max(clocks) == top and memory[0] == pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
    gpu = system.gpus[0]
    unlocked = gpu.busy_time(1.0)[0]  # at the limit in force, which may hold the board below its top clock
    half = min(clocks, key=lambda f: abs(f - top / 2))
    pynvml.nvmlDeviceSetGpuLockedClocks(h, half, half)
    assert gpu.busy_time(1.0)[0] == pytest.approx(top / half) and top / half > unlocked
    pynvml.nvmlDeviceResetGpuLockedClocks(h)
    assert gpu.busy_time(1.0)[0] == unlocked
