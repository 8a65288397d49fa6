"""The simulated `libamd_smi.so` beneath the real `amdsmi` package (sim/amdsmi_library.py, sim/amd_backend.py):
its C prototypes are the wrapper's, every amdsmi call core/device/amd.py makes reaches a modelled C function, the
answers are in amdsmi's units, and nothing is left behind once the simulation ends."""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zeus_callbacks import sim
from zeus_callbacks.core.device import amd as amd_module
from zeus_callbacks.sim import amd_backend, amdsmi_library
from zeus_callbacks.sim.amd_specs import amd_facts

# Not importing it: without the simulation, amdsmi 7.0.2's import fails where libamd_smi.so is absent.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("amdsmi") is None, reason="the amd extra is not installed"
)

AMD_PY = Path(amd_module.__file__)


@pytest.fixture
def amdsmi():
    """The real amdsmi package over a simulated 2*mi300x node (virtual clock), initialised."""
    system = sim.simulate("2*mi300x", virtual_clock=True)
    module = amd_backend.ensure(system)
    module.amdsmi_init(module.AmdSmiInitFlags.INIT_AMD_GPUS)
    yield module
    sim.disable()


def _abi(t) -> str:
    """What a ctypes type is in the C calling convention: a pointer, or an integer/float of its size."""
    if t is None:
        return "void"
    if t in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(t, ctypes._Pointer):
        return "pointer"
    kind = "float" if t in (ctypes.c_float, ctypes.c_double) else "int"
    return f"{kind}{ctypes.sizeof(t)}"


def test_each_modelled_function_has_the_prototype_the_wrapper_declares(amdsmi):
    """amdsmi_wrapper.py sets `restype`/`argtypes` on each function it binds (lines 2438-3058); the simulated
    function's own prototype (what its callback reads) must have the same ABI, or arguments arrive garbled."""
    library = amd_backend.installed()
    wrapper = amdsmi.amdsmi_wrapper
    checked = 0
    for name in amdsmi_library.offered_functions():
        bound = getattr(wrapper, name)  # the wrapper's module-level name of the library's attribute
        assert bound is getattr(library, name), name
        prototype = amdsmi_library._FUNCTIONS.table[name][0]
        assert [_abi(t) for t in bound.argtypes] == [_abi(t) for t in prototype._argtypes_], name
        assert _abi(bound.restype) == _abi(prototype._restype_) == "int4", name
        checked += 1
    assert checked >= 20


def _amdsmi_calls_of_amd_py() -> set[str]:
    """Every `<amdsmi module>.amdsmi_*` attribute core/device/amd.py reads (whatever the module's local name)."""
    tree = ast.parse(AMD_PY.read_text())
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("amdsmi_")
        and node.attr != "amdsmi_wrapper"
    }


def test_amd_py_calls_only_what_the_installed_package_has_and_the_library_models(amdsmi):
    """Fails when amd.py names an amdsmi function the real package lacks, or one whose C functions the simulated
    library does not model (it would answer NOT_SUPPORTED, so no test would exercise the call)."""
    calls = _amdsmi_calls_of_amd_py()
    assert {"amdsmi_get_energy_count", "amdsmi_set_power_cap", "amdsmi_set_gpu_clk_range"} <= calls
    missing = sorted(name for name in calls if not hasattr(amdsmi, name))
    assert missing == [], f"amd.py calls functions the installed amdsmi does not have: {missing}"
    for name in sorted(calls):
        source = inspect.getsource(getattr(amdsmi.amdsmi_interface, name))
        named = set(re.findall(r"amdsmi_wrapper\.(amdsmi_\w+)\(", source))
        c_functions = {n for n in named if isinstance(getattr(amdsmi.amdsmi_wrapper, n), ctypes._CFuncPtr)}
        assert c_functions, name
        assert c_functions <= amdsmi_library.offered_functions(), (name, c_functions)


def test_a_function_not_modelled_answers_not_supported_through_the_package(amdsmi):
    handle = amdsmi.amdsmi_get_processor_handles()[0]
    with pytest.raises(amdsmi.AmdSmiLibraryException) as e:
        amdsmi.amdsmi_get_gpu_vbios_info(handle)
    assert e.value.get_error_code() == amdsmi.amdsmi_wrapper.AMDSMI_STATUS_NOT_SUPPORTED


def test_a_withheld_function_stops_the_import_as_an_older_library_does():
    library = amdsmi_library.SimulatedAMDSMILibrary(withheld=frozenset({"amdsmi_get_energy_count"}))
    with pytest.raises(AttributeError, match="undefined symbol: amdsmi_get_energy_count"):
        library.amdsmi_get_energy_count  # noqa: B018
    assert callable(library.amdsmi_get_power_info)


def test_energy_ticks_at_the_dumps_resolution_and_power_is_in_watts(amdsmi):
    system = sim.active()
    gpu = system.gpus[0]
    handle = amdsmi.amdsmi_get_processor_handles()[0]
    before, e0 = amdsmi.amdsmi_get_energy_count(handle), gpu.energy_mj()
    system.run_step(2.0)
    after, e1 = amdsmi.amdsmi_get_energy_count(handle), gpu.energy_mj()
    # MI300X_x4.rocm-smi-a.txt: 78098902297472.05 uJ / 5104503354501 ticks = 15.3 uJ (float32).
    assert after["counter_resolution"] == pytest.approx(15.3, abs=1e-6)
    assert after["counter_resolution"] == ctypes.c_float(amd_facts("mi300x").energy_resolution_uj).value
    ticks = after["energy_accumulator"] - before["energy_accumulator"]
    assert e1 - e0 > 100_000  # a busy step of 2 s
    assert ticks * after["counter_resolution"] / 1000 == pytest.approx(
        e1 - e0, abs=0.04
    )  # mJ; a tick is 0.0153
    assert after["timestamp"] - before["timestamp"] > 1.9e9  # ns
    power = amdsmi.amdsmi_get_power_info(handle)
    assert isinstance(power["current_socket_power"], int) and power["average_socket_power"] == "N/A"
    assert power["current_socket_power"] == round(gpu.power_mw() / 1000)  # W, not mW


def test_power_cap_round_trips_in_microwatts_and_refuses_out_of_range(amdsmi):
    handle = amdsmi.amdsmi_get_processor_handles()[1]
    info = amdsmi.amdsmi_get_power_cap_info(handle)
    assert (info["min_power_cap"], info["max_power_cap"], info["power_cap"]) == (
        250_000_000,
        750_000_000,
        750_000_000,
    )
    amdsmi.amdsmi_set_power_cap(handle, 0, 400_000_000)
    assert amdsmi.amdsmi_get_power_cap_info(handle)["power_cap"] == 400_000_000
    assert sim.active().gpus[1].power_limit_mw == 400_000
    with pytest.raises(amdsmi.AmdSmiLibraryException) as e:
        amdsmi.amdsmi_set_power_cap(handle, 0, 100_000_000)
    assert e.value.get_error_code() == amdsmi.amdsmi_wrapper.AMDSMI_STATUS_INVAL


def test_clock_range_locks_the_graphics_clock_and_auto_hands_it_back(amdsmi):
    gfx = amdsmi.AmdSmiClkType.GFX
    handle = amdsmi.amdsmi_get_processor_handles()[0]
    levels = amdsmi.amdsmi_get_clk_freq(handle, gfx)["frequency"]
    assert min(levels) == 500_000_000 and max(levels) == 2_100_000_000  # Hz; OD_SCLK 500-2100 MHz
    amdsmi.amdsmi_set_gpu_clk_range(handle, 500, 1200, gfx)
    info = amdsmi.amdsmi_get_clock_info(handle, gfx)
    assert (info["max_clk"], info["clk_locked"]) == (1200, True) and info["clk"] <= 1200
    assert amdsmi.amdsmi_get_gpu_perf_level(handle) == "AMDSMI_DEV_PERF_LEVEL_MANUAL"
    amdsmi.amdsmi_set_gpu_perf_level(handle, amdsmi.AmdSmiDevPerfLevel.AUTO)
    assert amdsmi.amdsmi_get_gpu_perf_level(handle) == "AMDSMI_DEV_PERF_LEVEL_AUTO"
    assert sim.active().gpus[0].locked_sm_clocks_mhz is None


def test_setters_without_permission_answer_no_perm():
    system = sim.simulate("mi300x", virtual_clock=True, faults="no_permission")
    amdsmi = amd_backend.ensure(system)
    try:
        amdsmi.amdsmi_init(amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
        handle = amdsmi.amdsmi_get_processor_handles()[0]
        with pytest.raises(amdsmi.AmdSmiLibraryException) as e:
            amdsmi.amdsmi_set_power_cap(handle, 0, 400_000_000)
        assert e.value.get_error_code() == amdsmi.amdsmi_wrapper.AMDSMI_STATUS_NO_PERM
        assert amdsmi.amdsmi_get_power_cap_info(handle)["power_cap"] == 750_000_000  # reading still works
    finally:
        sim.disable()


def test_nothing_is_left_behind_when_the_simulation_ends():
    real_cdll = ctypes.CDLL
    system = sim.simulate("mi300x", virtual_clock=True)
    module = amd_backend.ensure(system)
    assert sys.modules["amdsmi"] is module and ctypes.CDLL is real_cdll  # CDLL is put back right after import
    sim.disable()
    assert "amdsmi" not in sys.modules and "amdsmi.amdsmi_wrapper" not in sys.modules
    assert amd_backend.installed() is None


@pytest.mark.system
def test_neither_the_package_nor_an_nvidia_simulation_imports_amdsmi():
    code = (
        "import sys; import zeus_callbacks; assert 'amdsmi' not in sys.modules;"
        "from zeus_callbacks import sim; sim.simulate('a40', virtual_clock=True);"
        "from zeus_callbacks.core.device.gpus import get_gpus; get_gpus();"
        "print('amdsmi' in sys.modules, 'zeus_callbacks.sim.amd_backend' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]


def test_mixed_vendors_are_not_simulated_on_one_node():
    from zeus_callbacks.core.device.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="mixes NVIDIA and AMD GPUs"):
        sim.simulate("a40,mi300x", virtual_clock=True)


def test_a_rocm_smi_dump_builds_its_node_beneath_amdsmi():
    """rocm-smi:MI300X_x4 (MI300X_x4.rocm-smi-a.txt): amdsmi answers each board's unique id, PCI bus, cap in force,
    OD_SCLK range and the driver version as the dump gives them."""
    system = sim.simulate("rocm-smi:MI300X_x4", virtual_clock=True)
    try:
        amdsmi = amd_backend.ensure(system)
        amdsmi.amdsmi_init(amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
        handles = amdsmi.amdsmi_get_processor_handles()
        assert [amdsmi.amdsmi_get_gpu_device_bdf(h) for h in handles] == [
            "0000:26:00.0",
            "0000:46:00.0",
            "0000:65:00.0",
            "0000:85:00.0",
        ]
        info = [amdsmi.amdsmi_get_gpu_asic_info(h) for h in handles]
        assert (
            info[0]["asic_serial"] == "0x8D1457E2C20F59D2"
            and info[0]["market_name"] == "AMD Instinct MI300X OAM"
        )
        assert amdsmi.amdsmi_get_gpu_enumeration_info(handles[3])["hip_uuid"] == "GPU-eff71edc82169115"
        assert amdsmi.amdsmi_get_power_cap_info(handles[0])["power_cap"] == 750_000_000
        assert (
            amdsmi.amdsmi_get_clock_info(handles[1], amdsmi.AmdSmiClkType.GFX)["min_clk"] == 133
        )  # its OD_SCLK
        assert amdsmi.amdsmi_get_gpu_driver_info(handles[0])["driver_version"] == "6.7.0"
    finally:
        sim.disable()


def test_the_concise_rocm_smi_table_is_refused_with_what_to_save(tmp_path):
    from zeus_callbacks.core.device.errors import InvalidInputError

    table = Path(__file__).parents[2] / "zeus_callbacks/sim/data/gpu_dumps/MI300X_x4.rocm-smi-a.txt"
    concise = tmp_path / "concise.txt"
    concise.write_text(
        "=== ROCm System Management Interface ===\n=== Concise Info ===\n0  [0x74a1 : 0x00]  35.0°C  133.0W\n"
    )
    assert table.is_file()
    with pytest.raises(InvalidInputError, match=r"concise table.*rocm-smi -a > node.txt"):
        sim.simulate(f"rocm-smi:{concise}", virtual_clock=True)
    with pytest.raises(InvalidInputError, match="neither a file nor a shipped rocm-smi dump.*MI300X_x4"):
        sim.simulate("rocm-smi:nope", virtual_clock=True)
