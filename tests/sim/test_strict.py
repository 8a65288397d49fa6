"""The simulator answers as real NVML does by default: counter refresh, averaged power, device order, faults."""

from __future__ import annotations

import signal
import threading
import time

import pynvml
import pynvml as nvml
import pytest

from zeus_callbacks import sim
from zeus_callbacks.sim import SimulatedSystem, parse_ideal


def _node(spec: str = "a40", **kw) -> sim.SimulatedSystem:
    system = sim.simulate(spec, virtual_clock=True, **kw)
    nvml.nvmlInit()
    return system


# -- energy counter granularity ------------------------------------------------------------------------
def test_energy_counter_moves_only_at_the_drivers_refreshes():
    """Fails if the energy counter is current at every read rather than moving only at the driver's refreshes."""
    system = _node("a40")
    gpu, h = system.gpus[0], nvml.nvmlDeviceGetHandleByIndex(0)
    assert gpu.energy_refresh_s == pytest.approx(0.1)
    changes, last = [], nvml.nvmlDeviceGetTotalEnergyConsumption(h)
    for _ in range(200):  # 1 s of 5 ms steps
        system.run_step(0.005)
        value = nvml.nvmlDeviceGetTotalEnergyConsumption(h)
        assert isinstance(value, int)
        if value != last:
            changes.append(system.clock.now())
        last = value
    assert 9 <= len(changes) <= 11  # about every 100 ms, not at every step
    gaps = [b - a for a, b in zip(changes, changes[1:], strict=False)]
    assert all(g == pytest.approx(0.1, abs=0.006) for g in gaps)
    # The value is the true energy at the last refresh, never more.
    assert last <= gpu.true_energy_mj() < last + 0.1 * 1000 * gpu.trace.power(300) + 1


def test_a_window_shorter_than_the_refresh_reads_zero_or_a_whole_refresh():
    """Fails if a read between two refreshes sees the energy drawn since the last one."""
    system = _node("a40")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    e0 = nvml.nvmlDeviceGetTotalEnergyConsumption(h)
    while nvml.nvmlDeviceGetTotalEnergyConsumption(h) == e0:  # to just after a refresh
        system.run_step(0.001)
    e1 = nvml.nvmlDeviceGetTotalEnergyConsumption(h)
    system.run_step(0.04)  # a 40 ms window right after a refresh
    assert nvml.nvmlDeviceGetTotalEnergyConsumption(h) == e1


def test_ideal_energy_counter_and_refresh_override():
    system = _node("a40", ideal="energy_counter")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    e0 = nvml.nvmlDeviceGetTotalEnergyConsumption(h)
    system.run_step(0.004)
    assert nvml.nvmlDeviceGetTotalEnergyConsumption(h) - e0 == pytest.approx(
        4 * system.gpus[0].trace.power(300), abs=1
    )
    assert SimulatedSystem("v100,t4", state_dir="", energy_refresh_ms=30).gpus[0].energy_refresh_s == 0.03
    assert [g.energy_refresh_s for g in SimulatedSystem("v100,t4", state_dir="").gpus] == [0.1, 0.02]


def test_counter_is_the_same_for_every_process(sim_gpus, burn_cpu):
    a = sim_gpus("a40")
    burn_cpu(0.05)
    a.gpus[0].synchronize()
    b = SimulatedSystem("a40", state_dir=a.state_dir)  # another process's view of the node
    for _ in range(5):  # two reads may straddle a refresh; they agree within one
        ea, eb = a.gpus[0].energy_mj(), b.gpus[0].energy_mj()
        if ea == eb:
            break
    assert ea == eb


# -- power readings ---------------------------------------------------------------------------------------
def _power(h) -> tuple[int, int, int | None]:
    """(nvmlDeviceGetPowerUsage, field POWER_INSTANT, field POWER_AVERAGE or None where NOT_SUPPORTED), read
    as Zeus reads them."""
    fields = nvml.nvmlDeviceGetFieldValues(
        h,
        [
            (pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_GPU),
            (pynvml.NVML_FI_DEV_POWER_AVERAGE, pynvml.NVML_POWER_SCOPE_GPU),
        ],
    )
    assert fields[0].nvmlReturn == pynvml.NVML_SUCCESS
    assert fields[1].nvmlReturn in (pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED)
    average = fields[1].value.uiVal if fields[1].nvmlReturn == pynvml.NVML_SUCCESS else None
    return nvml.nvmlDeviceGetPowerUsage(h), fields[0].value.uiVal, average


def test_power_usage_is_a_one_second_average_on_ampere():
    """Fails if `nvmlDeviceGetPowerUsage` is the instant draw on a board that averages (Ampere)."""
    system = _node("a40")
    h, tr, idle = nvml.nvmlDeviceGetHandleByIndex(0), system.gpus[0].trace, system.gpus[0].spec.idle_power_w
    system.run_step(2.0)
    system.clock.advance(0.6)  # 0.6 s of idle after 2 s of work
    usage, instant, average = _power(h)
    assert instant == pytest.approx(idle * 1000, abs=1)  # the draw right now
    assert usage == average == pytest.approx((0.4 * tr.power(300) + 0.6 * idle) * 1000, rel=0.01)


def test_power_usage_is_instantaneous_on_volta_and_turing_and_when_ideal():
    """Fails if it averages on boards that do not (Volta, Turing), or where `power_average` is ideal."""
    for spec, ideal in (("t4", ""), ("v100", ""), ("a40", "power_average")):
        system = _node(spec, ideal=ideal)
        h = nvml.nvmlDeviceGetHandleByIndex(0)
        system.run_step(2.0)
        system.clock.advance(0.6)
        usage, instant, average = _power(h)
        assert usage == instant == pytest.approx(system.gpus[0].spec.idle_power_w * 1000, abs=1), spec
        assert average is None if spec != "a40" else average > instant  # no average field before Ampere
        sim.disable()


def test_field_values_answer_each_field_in_its_own_return():
    """Fails if a field or scope the board lacks (memory power before Hopper) answers, or fails the whole
    call."""
    _node("a40")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    energy, memory = nvml.nvmlDeviceGetFieldValues(
        h, [pynvml.NVML_FI_DEV_ENERGY, (pynvml.NVML_FI_DEV_POWER_AVERAGE, pynvml.NVML_POWER_SCOPE_MEMORY)]
    )
    assert energy.nvmlReturn == memory.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    (limit,) = nvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_POWER_CURRENT_LIMIT])
    assert (limit.nvmlReturn, limit.value.uiVal) == (pynvml.NVML_SUCCESS, 300_000)


# -- device order ---------------------------------------------------------------------------------------
def test_nvml_numbers_by_pci_bus_and_cuda_fastest_first(monkeypatch):
    """Fails if NVML does not number by PCI bus (slower models on lower buses) or CUDA not fastest first, or
    if `CUDA_DEVICE_ORDER` and `CUDA_VISIBLE_DEVICES` are not followed."""
    system = _node("a10g,t4")
    assert [g.spec.kind for g in system.gpus] == ["t4", "a10g"]
    buses = [nvml.nvmlDeviceGetPciInfo(nvml.nvmlDeviceGetHandleByIndex(i)).busId for i in range(2)]
    assert buses == sorted(buses)
    assert nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0)) == "Tesla T4"
    assert [g.spec.kind for g in system.cuda_gpus()] == ["a10g", "t4"]
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert [g.spec.kind for g in system.cuda_gpus()] == ["t4", "a10g"]
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # CUDA's index 1: the T4
    assert [g.spec.kind for g in system.cuda_gpus()] == ["t4"]


def test_ideal_device_order_keeps_the_specs_order():
    """Fails if the ideal order still puts the slower model on the lower bus (NVML's order, seen with the
    faster one first) or CUDA's fastest first (seen with the slower one first)."""
    for spec in ("a10g,t4", "t4,a10g"):
        system = _node(spec, ideal="device_order")
        kinds = spec.split(",")
        assert [g.spec.kind for g in system.gpus] == [g.spec.kind for g in system.cuda_gpus()] == kinds, spec
        sim.disable()


def test_enqueue_work_takes_the_cuda_index():
    system = _node("a10g,t4")
    sim.enqueue_work(0, 0.5)
    a10g = next(g for g in system.gpus if g.spec.kind == "a10g")
    assert a10g._work.queued_s == 0.5


def test_identity_follows_the_gpu_not_its_bus():
    strict = SimulatedSystem("a10g,t4", state_dir="")
    ideal = SimulatedSystem("a10g,t4", state_dir="", ideal="device_order")
    assert {g.spec.kind: g.uuid for g in strict.gpus} == {g.spec.kind: g.uuid for g in ideal.gpus}


# -- permissions and other answers ---------------------------------------------------------------------------
def test_hidden_gpu_is_counted_but_may_not_be_opened():
    """Fails if a hidden GPU can be opened (by index or UUID) or CUDA sees it."""
    system = _node("2*a40", faults="hidden@1")
    assert nvml.nvmlDeviceGetCount() == 2
    with pytest.raises(pynvml.NVMLError_NoPermission):
        nvml.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        nvml.nvmlDeviceGetHandleByUUID(system.gpus[1].uuid)
    assert system.cuda_gpus() == [system.gpus[0]]  # CUDA cannot open it either


def test_root_without_cap_sys_admin_may_read_but_not_set():
    """Fails if `no_cap_sys_admin` lets a setter through or refuses a read."""
    _node("a40", faults="no_cap_sys_admin")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetPowerManagementLimit(h) == 300_000
    for set_ in (
        lambda: nvml.nvmlDeviceSetPowerManagementLimit(h, 200_000),
        lambda: nvml.nvmlDeviceSetGpuLockedClocks(h, 210, 1200),
        lambda: nvml.nvmlDeviceSetPersistenceMode(h, pynvml.NVML_FEATURE_ENABLED),
    ):
        with pytest.raises(pynvml.NVMLError_NoPermission):
            set_()


def test_empty_supported_clocks_and_default_limit_below_the_maximum():
    """Fails if `empty_clocks` lists clocks, or `default_limit_w` is not the limit in force at boot."""
    _node("a40", faults="empty_clocks;default_limit_w=250")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetSupportedGraphicsClocks(h, nvml.nvmlDeviceGetSupportedMemoryClocks(h)[0]) == []
    assert nvml.nvmlDeviceGetPowerManagementDefaultLimit(h) == 250_000
    assert nvml.nvmlDeviceGetPowerManagementLimit(h) == 250_000  # in force at boot
    assert nvml.nvmlDeviceGetPowerManagementLimitConstraints(h) == [100_000, 300_000]
    nvml.nvmlDeviceSetPowerManagementLimit(h, 300_000)  # above the default is allowed
    assert nvml.nvmlDeviceGetPowerManagementLimit(h) == 300_000


def _signal_during_sync(system: sim.SimulatedSystem) -> tuple[float, float, float]:
    """(seconds into the sync when SIGUSR1 was sent, when its handler ran, the sync's duration)."""
    gpu = system.gpus[0]
    gpu.synchronize()
    gpu.lock_sm_clocks(210, 435)  # a quarter of the maximum clock: work takes 4x as long
    handled: list[float] = []
    sent: list[float] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: handled.append(time.time()))
    main = threading.main_thread().ident

    def send() -> None:
        sent.append(time.time())
        signal.pthread_kill(main, signal.SIGUSR1)

    try:
        # A kernel of 1 s at the quarter clock: the wait is its time on the wall clock less the host's lag
        # (sim/host.py's `HostClock`: at most 0.5 s on a loaded host), so it lasts over 0.2 s at any load.
        gpu.enqueue(0.25)
        start = time.time()
        threading.Timer(0.05, send).start()
        gpu.synchronize()
        duration = time.time() - start
        deadline = time.time() + 1
        while not handled and time.time() < deadline:
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGUSR1, old)
    return sent[0] - start, handled[0] - start, duration


@pytest.mark.system  # a signal sent on the real clock, during a wait on it
def test_a_signal_is_handled_only_after_the_synchronisation_returns(sim_gpus):
    """Fails if a Python signal handler runs during the synchronisation's wait (CUDA waits in native code,
    which defers it)."""
    _, handled_at, duration = _signal_during_sync(sim_gpus("a40"))
    assert duration > 0.2 and handled_at >= 0.9 * duration


@pytest.mark.system
def test_interruptible_sync_when_ideal(sim_gpus):
    """Fails if the ideal synchronisation defers the handler until it returns. The outcome only, and only for
    a signal sent during the wait: a loaded host may wake the timer that sends it late, after the wait (then
    the attempt is made again, at most 5 times)."""
    system = sim_gpus("a40", ideal="interruptible_sync")
    for _ in range(5):
        sent_at, handled_at, duration = _signal_during_sync(system)
        if sent_at < duration - 0.05:  # well within the wait
            break
    assert sent_at < duration - 0.05, (
        f"the timer never fired during the wait in 5 attempts (last: {sent_at:.2f} s)"
    )
    assert duration > 0.2 and handled_at < duration


def test_unknown_ideal_behaviour_is_refused():
    assert parse_ideal("energy_counter, device_order") == {"energy_counter", "device_order"}
    with pytest.raises(ValueError, match="Known: energy_counter, power_average"):
        parse_ideal("energy")
