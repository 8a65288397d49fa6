"""The vendor-neutral Device boundary (issue 40): NVML is named in code only by the NVIDIA package and the
simulator, no module reaches a GPU's handle, and discovery picks one vendor or refuses two."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import zeus_callbacks
from zeus_callbacks.core.device import backend as backends
from zeus_callbacks.core.device.device import Device
from zeus_callbacks.core.device.errors import MixedVendorError, NVMLUnavailableError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.nvidia import NVIDIABackend, NVIDIADevice
from zeus_callbacks.sim.backend import SimulatedBackend

PACKAGE = Path(zeus_callbacks.__file__).parent
# The NVIDIA package calls NVML; the simulator answers beneath nvidia-ml-py. Nothing else may.
ALLOWED = (PACKAGE / "core" / "device" / "nvidia", PACKAGE / "sim")
# A vendor module holds its library's handle of each GPU; nothing above the boundary reaches it.
VENDOR_MODULES = (
    PACKAGE / "core" / "device" / "nvidia",
    PACKAGE / "core" / "device" / "amd.py",
    PACKAGE / "sim",
)


def _nvml_name(name: str) -> bool:
    """NVML's names: the module (`nvml`, `pynvml`), its functions (`nvmlDeviceGet...`), its constants (`NVML_...`)."""
    return (
        name in ("nvml", "pynvml") or name.startswith("NVML_") or (name[:4] == "nvml" and name[4:5].isupper())
    )


def _offences(path: Path) -> list[str]:
    """Each NVML name used in code (not in strings or comments), and each `.handle` reached, in `path`."""
    out = []
    vendor = any(path.is_relative_to(v) for v in VENDOR_MODULES)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
            if node.attr == "handle" and not vendor:
                out.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: .handle")
        elif isinstance(node, ast.alias):
            names = [node.name.split(".")[0], node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        out += [f"{path.relative_to(PACKAGE)}:{node.lineno}: {n}" for n in names if n and _nvml_name(n)]
    return out


def test_nvml_is_named_in_code_only_by_the_nvidia_package_and_the_simulator() -> None:
    """Fails if a module outside core/device/nvidia/ and sim/ uses an NVML name in code (`nvml`, `pynvml`,
    `nvml*` functions, `NVML_*` constants), or a module above the vendor modules reaches a GPU's `.handle`
    (on the commit before issue 40: 11 modules, among them gpus.py, power.py, power_readings.py, uncertainty.py,
    zeusd.py)."""
    files = [p for p in PACKAGE.rglob("*.py") if not any(p.is_relative_to(a) for a in ALLOWED)]
    offences = [o for p in sorted(files) for o in _offences(p)]
    assert offences == [], "\n".join(offences)


def test_the_rule_sees_what_it_forbids() -> None:
    """The checker itself: names in code count, the same words in strings and comments do not."""
    assert _nvml_name("nvmlDeviceGetPowerUsage") and _nvml_name("NVML_FI_DEV_POWER_INSTANT")
    assert _nvml_name("pynvml") and _nvml_name("nvml")
    assert not _nvml_name("nvml_index") and not _nvml_name("nvmlish")


def test_gpus_hold_vendor_neutral_devices(sim_gpus) -> None:
    """Fails if a GPU does not wrap a `Device`, or the device's identity and units differ from the GPU's."""
    sim_gpus("2*a40", virtual_clock=True)
    gpus = get_gpus()
    assert type(gpus.backend) is SimulatedBackend and isinstance(gpus.backend, NVIDIABackend)
    for g in gpus:
        assert isinstance(g.device, Device) and isinstance(g.device, NVIDIADevice)
        assert (g.device.vendor, g.architecture, g.vendor_index) == ("nvidia", "ampere", g.index)
        assert g.device.label == g.label == f"GPU {g.index} (NVIDIA A40, simulated)"
        assert g.device.pci_bus_id().endswith(":00.0") and not g.device.mig_enabled()
        assert g.power_limit_constraints_mw() == (100_000, 300_000)  # mW
        assert (
            g.device.power_usage_domain == "device_average"
        )  # GA102: nvmlDeviceGetPowerUsage is the 1 s average


class _LabelledAMD(SimulatedBackend):
    """A simulated node labelled as another vendor, to drive discovery's vendor logic (HIP numbers its GPUs
    whatever CUDA_VISIBLE_DEVICES says)."""

    vendor = "amd"

    def gpu_count(self) -> int:
        return len(self.system.gpus)


def test_discovery_skips_an_absent_vendor_and_refuses_two_with_gpus(sim_gpus, monkeypatch) -> None:
    """Fails if a vendor whose module cannot be imported stops discovery, if a single vendor is not used as is,
    or if GPUs of two vendors are not refused with one line naming both and the variables that select one."""
    system = sim_gpus("2*a40", virtual_clock=True)
    monkeypatch.setattr(
        backends, "REAL_BACKENDS", ["no_such_vendor_module:real_backend", "sim_nvidia:factory"]
    )
    nvidia = SimulatedBackend(system)
    amd = _LabelledAMD(system)
    factories = {"sim_nvidia:factory": lambda: nvidia, "sim_amd:factory": lambda: amd}
    real_load = backends._load
    monkeypatch.setattr(backends, "_load", lambda ref: factories.get(ref) or real_load(ref))
    assert backends.real_backend() is nvidia
    with pytest.raises(MixedVendorError) as mixed:
        backends.real_backend(["sim_nvidia:factory", "sim_amd:factory"])
    (line,) = str(mixed.value).splitlines()
    assert "nvidia and amd" in line and "CUDA_VISIBLE_DEVICES" in line and "HIP_VISIBLE_DEVICES" in line
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the NVIDIA GPUs hidden: the other vendor's are used
    assert backends.real_backend(["sim_nvidia:factory", "sim_amd:factory"]) is amd
    with pytest.raises(NVMLUnavailableError, match="No GPU library"):
        backends.real_backend(["no_such_vendor_module:real_backend"])
