"""NVML's edges as real drivers and bindings answer them: each a simulated fault (or a stand-in package), and
each one clear line from `zeus-callbacks devices` and `doctor`, never a traceback."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import assert_one_clear_line

from zeus_callbacks.core.device import backend as backends
from zeus_callbacks.core.device.backend import active_backend
from zeus_callbacks.core.device.errors import GPULostError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.nvidia import UNOFFICIAL_PYNVML_FIX, NVIDIABackend
from zeus_callbacks.core.device.power import instant_power_mw
from zeus_callbacks.core.pipeline_frequency.optimizer import PipelineFrequencyOptimizer
from zeus_callbacks.sim import parse_faults


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`zeus-callbacks ARGV` in a child process (its logging configured as the command does it)."""
    return subprocess.run(
        [sys.executable, "-m", "zeus_callbacks.cli", *argv],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _simulated(faults: str, spec: str = "2*a40", visible: str = "0") -> dict[str, str]:
    return {
        "ZEUS_CALLBACKS_SIMULATE": spec,
        "ZEUS_CALLBACKS_SIM_FAULTS": faults,
        "CUDA_VISIBLE_DEVICES": visible,
    }


def _no_traceback(proc: subprocess.CompletedProcess) -> list[str]:
    """The lines on stderr, after checking that none is a traceback's."""
    assert "Traceback" not in proc.stderr, proc.stderr
    return [line for line in proc.stderr.splitlines() if line.strip()]


def test_new_faults_parse_and_are_checked():
    faults = parse_faults(
        "empty_memory_clocks@1;missing=nvmlDeviceGetArchitecture;unknown=nvmlDeviceGetFieldValues"
    )
    assert faults[1].empty_memory_clocks
    assert faults[None].missing == {"nvmlDeviceGetArchitecture"}
    assert faults[None].unknown == {"nvmlDeviceGetFieldValues"}
    with pytest.raises(ValueError, match="missing takes one of nvmlDeviceGetArchitecture"):
        parse_faults("missing=nvmlDeviceGetNothing")


# -- 5: no supported memory clocks ----------------------------------------------------------------------------
def test_no_memory_clocks_means_clocks_cannot_be_locked(sim_gpus, caplog):
    sim_gpus("a40", faults="empty_memory_clocks")
    gpu = get_gpus()[0]
    assert gpu.supported_memory_clocks_mhz() == []
    assert gpu.supported_sm_clocks_mhz() == []
    pfo = PipelineFrequencyOptimizer(
        rank=0, pp_rank=0, pp_degree=1, world_size=1, wait_steps=1, warmup_steps=0
    )
    with caplog.at_level(logging.WARNING, logger="zeus_callbacks"):
        for _ in range(3):
            pfo.on_step_begin()
            pfo.on_instruction_begin("forward")
            pfo.on_instruction_end("forward")
            pfo.on_step_end()
        pfo.on_train_end()
    assert not pfo.may_set
    assert "lists no supported SM clocks" in caplog.text, caplog.text


@pytest.mark.system
def test_no_memory_clocks_in_devices_and_doctor():
    env = _simulated("empty_memory_clocks")
    devices = _cli("devices", env=env)
    assert devices.returncode == 0 and _no_traceback(devices) == []
    assert "GPU 0 (NVIDIA A40): no supported SM clocks are listed" in devices.stdout, devices.stdout
    doctor = _cli("doctor", env=env)
    assert doctor.returncode == 1 and _no_traceback(doctor) == []
    problems = [line for line in doctor.stdout.splitlines() if line.startswith("PROBLEM")]
    assert problems == [
        "PROBLEM: GPU 0 (NVIDIA A40): no supported SM clocks; the pipeline-frequency optimizer stands down."
    ], doctor.stdout


# -- 8: old drivers, a whole-call UNKNOWN, a lost GPU ---------------------------------------------------------
@pytest.mark.system
@pytest.mark.parametrize("faults", ["missing=nvmlDeviceGetFieldValues", "unknown=nvmlDeviceGetFieldValues"])
def test_instant_power_falls_back_to_power_usage(sim_gpus, faults):
    sim_gpus("v100", faults=faults, virtual_clock=True)
    gpu = get_gpus()[0]
    assert instant_power_mw(gpu) == gpu.power_mw()  # instantaneous on a V100; one virtual instant
    doctor = _cli("doctor", "--json", env=_simulated(faults, spec="v100"))
    assert _no_traceback(doctor) == []
    row = json.loads(doctor.stdout)["gpus"][0]
    assert row["power_instant_w"] is not None and row["power_instant_w"] > 0, row


@pytest.mark.system
def test_without_nvml_architecture_the_energy_counter_is_probed(sim_gpus):
    sim_gpus("a40,t4", faults="missing=nvmlDeviceGetArchitecture;no_energy_counter@0")
    by_name = {g.name: g for g in get_gpus()}
    assert by_name["NVIDIA A40"].architecture is None and by_name["NVIDIA A40"].supports_energy_counter
    assert not by_name["Tesla T4"].supports_energy_counter  # NVML index 0: its counter is not offered
    env = _simulated("missing=nvmlDeviceGetArchitecture", visible="0,1")
    devices = _cli("devices", "--json", env=env)
    assert devices.returncode == 0 and _no_traceback(devices) == [], devices.stderr
    assert [row["energy_counter"] for row in json.loads(devices.stdout)] == [True, True]
    doctor = _cli("doctor", "--json", env=env)
    assert doctor.returncode == 0 and _no_traceback(doctor) == [], doctor.stdout
    assert json.loads(doctor.stdout)["problems"] == []


@pytest.mark.system
@pytest.mark.parametrize("command", ["devices", "doctor"])
def test_a_lost_gpu_outside_the_jobs_view_is_skipped_with_one_line(command):
    proc = _cli(command, env=_simulated("lost_after=0@1", visible="0"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = _no_traceback(proc)
    assert len(lines) == 1 and "NVML GPU 1" in lines[0] and "skipped" in lines[0], lines
    assert "GPU is lost" in lines[0], lines


@pytest.mark.system
@pytest.mark.parametrize("command", ["devices", "doctor"])
def test_a_lost_gpu_of_the_job_is_one_clear_line(command):
    proc = _cli(command, env=_simulated("lost_after=0@0", visible="0"))
    assert_one_clear_line(proc.returncode, proc.stderr, command, "CUDA device 0", "the GPU is lost")


def test_real_backend_without_torch_keeps_a_lost_gpu_in_cudas_numbering(sim_gpus, monkeypatch):
    system = sim_gpus("3*a40", faults="lost_after=0@1")
    nvml = active_backend().nvml
    nvml.nvmlInit()
    monkeypatch.setitem(sys.modules, "torch", None)  # no torch: CUDA's numbering is assumed to be NVML's
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert NVIDIABackend(nvml).cuda_uuids() == [system.gpus[2].uuid]  # not shifted onto a missing index
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(GPULostError, match=r"CUDA device 1 \(NVML index 1\): the GPU is lost"):
        NVIDIABackend(nvml).cuda_uuids()


# -- 7: the simulator stays out of real runs; the unofficial pynvml ---------------------------------------------
_SIM_MODULES = "sorted(m for m in sys.modules if m.startswith('zeus_callbacks.sim'))"


@pytest.mark.system
def test_a_real_discovery_does_not_import_the_simulator(run_python):
    code = textwrap.dedent(
        f"""
        import sys
        from zeus_callbacks import cli
        from zeus_callbacks.core.device.errors import NVMLUnavailableError
        from zeus_callbacks.core.device.gpus import get_gpus
        try:
            get_gpus()
        except NVMLUnavailableError:
            pass  # no driver on this host: still a real discovery
        cli.main(["devices"])
        cli.main(["doctor"])
        print({_SIM_MODULES})
        """
    )
    proc = run_python(code)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr
    simulated = run_python(code, env={"ZEUS_CALLBACKS_SIMULATE": "a40"})
    assert "SIMULATED GPUs" in simulated.stdout and "zeus_callbacks.sim" in simulated.stdout.splitlines()[-1]


# A stand-in for the unofficial PyPI `pynvml` (before 12) as seen from Python: a package whose `__init__`
# re-exports its own `pynvml.nvml` with `import *` (so `_nvmlGetFunctionPointer`, which nvidia-ml-py's module
# defines, is missing from it), answering names and UUIDs as bytes. Two Volta GPUs; no C library beneath.
_UNOFFICIAL_NVML = '''
"""Stand-in for the unofficial pynvml's own bindings."""
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_UNKNOWN = 999
NVML_DEVICE_ARCH_VOLTA = 5
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
_UUIDS = [b"GPU-00000000-0000-0000-0000-00000000000a", b"GPU-00000000-0000-0000-0000-00000000000b"]


class NVMLError(Exception):
    def __init__(self, value):
        self.value = value


def _nvmlGetFunctionPointer(name):
    raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)


def nvmlInit():
    pass


def nvmlDeviceGetCount():
    return len(_UUIDS)


def nvmlDeviceGetHandleByIndex(index):
    return index


def nvmlDeviceGetHandleByUUID(uuid):
    return _UUIDS.index(uuid if isinstance(uuid, bytes) else uuid.encode())


def nvmlDeviceGetUUID(handle):
    return _UUIDS[handle]


def nvmlDeviceGetIndex(handle):
    return handle


def nvmlDeviceGetName(handle):
    return b"Tesla V100-SXM2-16GB"


def nvmlDeviceGetArchitecture(handle):
    return NVML_DEVICE_ARCH_VOLTA


def nvmlDeviceGetTotalEnergyConsumption(handle):
    return 1000


def nvmlDeviceGetMigMode(handle):
    raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
'''


@pytest.fixture
def unofficial_pynvml(tmp_path: Path) -> dict[str, str]:
    """The environment of a child process in which `import pynvml` finds the unofficial package first."""
    package = tmp_path / "shadow" / "pynvml"
    package.mkdir(parents=True)
    (package / "nvml.py").write_text(_UNOFFICIAL_NVML)
    (package / "__init__.py").write_text("from .nvml import *\n\n__version__ = '11.4.1'\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(package.parent), os.environ.get("PYTHONPATH")]))}


@pytest.mark.system
@pytest.mark.parametrize("simulate", ["", "a40"])  # the simulator, too, runs beneath nvidia-ml-py
@pytest.mark.parametrize("command", ["devices", "doctor"])
def test_the_unofficial_pynvml_is_named_with_its_fix(unofficial_pynvml, command, simulate):
    proc = _cli(command, env={**unofficial_pynvml, "ZEUS_CALLBACKS_SIMULATE": simulate})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = _no_traceback(proc)
    assert len(lines) == 1 and UNOFFICIAL_PYNVML_FIX in lines[0], lines
    assert UNOFFICIAL_PYNVML_FIX == "pip uninstall pynvml && pip install nvidia-ml-py"


@pytest.mark.system
def test_bindings_that_answer_bytes_give_text(unofficial_pynvml, run_python):
    code = textwrap.dedent(
        """
        import json, sys
        sys.modules["torch"] = None  # CUDA's numbering from NVML's, as without torch
        import pynvml
        from zeus_callbacks.core.device.nvidia import NVIDIABackend
        from zeus_callbacks.core.device.gpus import GPUs
        gpus = GPUs(NVIDIABackend(pynvml))  # the bindings as given, past the check that refuses them
        print(json.dumps([[g.uuid, g.name, g.supports_energy_counter] for g in gpus]))
        """
    )
    proc = run_python(code, env=unofficial_pynvml)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == [
        ["GPU-00000000-0000-0000-0000-00000000000a", "Tesla V100-SXM2-16GB", True],
        ["GPU-00000000-0000-0000-0000-00000000000b", "Tesla V100-SXM2-16GB", True],
    ]


def test_a_backend_factory_is_imported_only_when_its_condition_holds(monkeypatch):
    monkeypatch.setattr(backends, "_factories", [])
    monkeypatch.setattr(backends, "_conditions", {})
    backends.register_backend("no_such_module_anywhere:factory", when=lambda: False)
    backends.reset_backend()
    assert type(active_backend()) is NVIDIABackend  # the real driver's, and nothing imported
    backends.register_backend("no_such_module_anywhere:factory", when=lambda: True)
    backends.reset_backend()
    with pytest.raises(ModuleNotFoundError, match="no_such_module_anywhere"):
        active_backend()
    backends.reset_backend()


@pytest.mark.system
def test_simulate_called_directly_names_the_unofficial_pynvml(unofficial_pynvml, run_python):
    # Fails before the simulator refused the unofficial bindings first: importing it died on an unrelated error.
    code = "import zeus_callbacks.sim as sim\nsim.simulate('a40')\n"
    proc = run_python(code, env=unofficial_pynvml)
    assert proc.returncode == 1
    assert "UnofficialPynvmlError" in proc.stderr and UNOFFICIAL_PYNVML_FIX in proc.stderr, proc.stderr[
        -2000:
    ]
