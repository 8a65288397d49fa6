"""`zeus-callbacks doctor`: a read-only check of a node before training (real or simulated GPUs)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from zeus_callbacks.cli.devices import NO_VISIBLE_GPU, discover
from zeus_callbacks.core.device import global_lock, node_info, setters, zeusd
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.device.gpus import GPU, GPUs, get_gpus
from zeus_callbacks.core.device.power import energy_refresh_period_s, instant_power_mw
from zeus_callbacks.core.device.state_guard import journal_dir, leftover_entries


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `doctor` subcommand."""
    parser = subparsers.add_parser(
        "doctor",
        help="check this node before training: GPUs by UUID, energy counter, power, limits, permissions",
        description=(
            "Read-only check of this node: the GPU library (NVML, amdsmi) and driver, each visible GPU (CUDA index -> UUID), its "
            "energy counter and refresh period, power (average and instant), power limits, clocks, whether "
            "this process may change settings and why not, the route settings take (in this process, or Zeus's daemon "
            "zeusd: configured, reachable, GPU control, token), the journal directory, and settings left "
            "changed by dead runs. Changes nothing. Exits 1 when something would stop the optimizers."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _watts(mw: int | None) -> float | None:
    return None if mw is None else mw / 1000


def describe(gpu: GPU) -> dict[str, Any]:
    """What `doctor` reports about one GPU (W, MHz, ms)."""
    call = node_info.safe_call
    constraints = call(gpu.power_limit_constraints_mw)
    clocks = call(gpu.supported_sm_clocks_mhz)
    period = energy_refresh_period_s(gpu) if gpu.supports_energy_counter else None
    return {
        "cuda_index": gpu.index,
        "nvml_index": gpu.vendor_index,  # the vendor library's index (the key predates other vendors)
        "uuid": gpu.uuid,
        "name": gpu.name,
        "simulated": gpu.simulated,
        "energy_counter": gpu.supports_energy_counter,
        "energy_refresh_ms": None if period is None else round(period * 1000, 1),
        "power_average_w": _watts(call(gpu.power_mw)),
        "power_instant_w": _watts(call(instant_power_mw, gpu)),
        # In force (nvidia-smi's Current Power Limit) and set (its Requested Power Limit): another limiter
        # can hold a board below what was set (a real GH200: 700 W in force under 900 W set).
        "power_limit_w": _watts(call(gpu.enforced_power_limit_mw)),
        "requested_power_limit_w": _watts(call(gpu.power_limit_mw)),
        "min_power_limit_w": None if constraints is None else constraints[0] / 1000,
        "max_power_limit_w": None if constraints is None else constraints[1] / 1000,
        "default_power_limit_w": _watts(call(gpu.default_power_limit_mw)),
        "sm_clock_mhz": call(node_info.current_sm_clock_mhz, gpu),
        "supported_sm_clocks": len(clocks) if clocks else 0,
        "min_sm_clock_mhz": min(clocks) if clocks else None,
        "max_sm_clock_mhz": max(clocks) if clocks else None,
        "may_change_settings": gpu.may_change_settings(),
        # A modelled simulated board (not traced) says so; other GPUs' entries keep their keys.
        **({} if gpu.provenance is None else {"provenance": gpu.provenance}),
    }


def _gpu_findings(g: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(problems that stop an optimizer, warnings) for one GPU."""
    problems: list[str] = []
    warnings: list[str] = []
    label = f"GPU {g['cuda_index']} ({g['name']})"
    if g["max_power_limit_w"] is None:
        problems.append(f"{label}: power limits cannot be read; the power-limit optimizer stands down.")
    if not g["supported_sm_clocks"]:
        problems.append(f"{label}: no supported SM clocks; the pipeline-frequency optimizer stands down.")
    if not g["energy_counter"] and g["power_average_w"] is None and g["power_instant_w"] is None:
        warnings.append(
            f"{label}: no energy counter and no power reading; windows are timed, energy is not measured."
        )
    elif not g["energy_counter"]:
        warnings.append(f"{label}: no energy counter (pre-Volta); energy comes from sampled power.")
    elif g["energy_refresh_ms"] is None:
        warnings.append(f"{label}: the energy counter's refresh period could not be measured.")
    default, top = g["default_power_limit_w"], g["max_power_limit_w"]
    if default is not None and top is not None and default < top:
        warnings.append(f"{label}: default power limit {default:g} W is below the maximum {top:g} W.")
    in_force, requested = g["power_limit_w"], g["requested_power_limit_w"]
    if in_force is not None and requested is not None and in_force < requested:
        warnings.append(
            f"{label}: {in_force:g} W is in force under the {requested:g} W set: another limiter holds the board "
            "below it; the power-limit optimizer profiles from the limit in force."
        )
    if requested is not None and default is not None and requested != default:
        warnings.append(
            f"{label}: the power limit set ({requested:g} W) differs from the default "
            f"({default:g} W); if no job of yours set it, `zeus-callbacks restore` puts back what a dead run left."
        )
    return problems, warnings


def setter_report(gpus: GPUs) -> dict[str, Any]:
    """The route GPU settings take and, where zeusd is configured, what it says (read-only)."""
    report = setters.describe_choice()
    try:
        endpoint = zeusd.ZeusdEndpoint.from_env()
    except InvalidInputError:
        endpoint = None  # already reported as the route's error
    report["zeusd"] = (
        None if endpoint is None else zeusd.status(endpoint, os.environ.get(zeusd.TOKEN_ENV), list(gpus))
    )
    return report


def _setter_problems(report: dict[str, Any]) -> list[str]:
    if report["error"] is not None:
        return [report["error"]]
    daemon = report["zeusd"]
    if report["route"] != "zeusd" or daemon is None:
        return []
    if not daemon["reachable"]:
        return [f"Settings go through zeusd, which cannot be reached: {daemon['problem']}"]
    if daemon["generation"] is None:
        return [f"zeusd at {daemon['endpoint']}: {daemon['problem']}"]
    out = []
    if not daemon["gpu_control"]:
        out.append(
            f"zeusd at {daemon['endpoint']} does not enable gpu-control: start it with `--enable gpu-control`."
        )
    if daemon["problem"]:
        out.append(f"zeusd at {daemon['endpoint']}: {daemon['problem']}")
    return out


def check(gpus: GPUs | None = None) -> dict[str, Any]:
    """The whole report as plain data; raises `NVMLUnavailableError` without a vendor library or simulation."""
    gpus = get_gpus(repair=False) if gpus is None else gpus
    driver, library_version = node_info.driver_versions(gpus)
    perm = node_info.permission(gpus)
    journal = node_info.check_journal_dir(journal_dir())
    leftovers = [
        {"pid": pid, "uuid": e.uuid, "name": e.name, "knob": e.knob, "original": e.original, "route": e.route}
        for pid, e in leftover_entries()
    ]
    setter = setter_report(gpus)
    rows = [describe(g) for g in gpus]
    problems: list[str] = [] if rows else [NO_VISIBLE_GPU]
    warnings: list[str] = []
    for row in rows:
        p, w = _gpu_findings(row)
        problems += p
        warnings += w
    problems += _setter_problems(setter)
    if not perm.may_change and setter["error"] is None:
        problems.append(
            f"This process may not change power limits or clocks: {perm.reason}. The optimizers only measure."
        )
    if not journal.safe:
        problems.append(
            f"Journal directory {journal.path} {journal.problem}; no GPU setting will be changed."
        )
    cross_user = global_lock.status()
    if not cross_user.on:
        warnings.append(
            f"The cross-user GPU owner lock is off: {cross_user.problem}. Jobs of other users on these GPUs "
            "do not see which ones this job changes, nor it theirs. An administrator turns it on once: "
            f"`{cross_user.fix}` (or point {global_lock.LOCK_DIR_ENV} at such a directory in every job)."
        )
    if leftovers:
        warnings.append(
            f"{len(leftovers)} setting(s) left changed by dead runs; `zeus-callbacks restore` puts them back."
        )
    return {
        "simulated": gpus.simulated,
        "driver_version": driver,
        "library": gpus.backend.library,
        "nvml_version": library_version,  # the vendor library's version (the key predates other vendors)
        "permission": perm.__dict__,
        "setters": setter,
        "journal_dir": journal.__dict__,
        "cross_user_lock": cross_user.__dict__,
        "leftovers": leftovers,
        "gpus": rows,
        "problems": problems,
        "warnings": warnings,
    }


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}{unit}"
    return f"{value}{unit}"


def _print_report(r: dict[str, Any]) -> None:
    if r["simulated"]:
        print("SIMULATED GPUs (ZEUS_CALLBACKS_SIMULATE): every figure below is a simulation, not hardware.")
    library = r["library"]
    print(f"driver {_fmt(r['driver_version'])}, {library} {_fmt(r['nvml_version'])}")
    for g in r["gpus"]:
        print(f"\nGPU {g['cuda_index']} (CUDA) = {library} {g['nvml_index']}  {g['name']}  {g['uuid']}")
        if g.get("provenance"):
            print(f"  SIMULATED ({g['provenance']}): its power-limit behaviour is not traced on this board")
        print(
            f"  energy counter: {_fmt(g['energy_counter'])}, refreshes every {_fmt(g['energy_refresh_ms'], ' ms')}"
        )
        print(
            f"  power: {_fmt(g['power_average_w'], ' W')} average, {_fmt(g['power_instant_w'], ' W')} instant"
        )
        print(
            f"  power limit: {_fmt(g['power_limit_w'], ' W')} in force ({_fmt(g['requested_power_limit_w'], ' W')} "
            f"set), {_fmt(g['min_power_limit_w'])}-"
            f"{_fmt(g['max_power_limit_w'], ' W')} settable, default {_fmt(g['default_power_limit_w'], ' W')}"
        )
        print(
            f"  SM clock: {_fmt(g['sm_clock_mhz'], ' MHz')} now, {g['supported_sm_clocks']} supported "
            f"({_fmt(g['min_sm_clock_mhz'])}-{_fmt(g['max_sm_clock_mhz'], ' MHz')})"
        )
    p, j = r["permission"], r["journal_dir"]
    print(
        f"\nmay change settings: {_fmt(p['may_change'])} ({p['reason']}; euid {p['euid']}, "
        f"CAP_SYS_ADMIN {_fmt(p['cap_sys_admin'])}, container {_fmt(p['container'])})"
    )
    _print_setters(r["setters"])
    print(f"journal directory: {_fmt(j['path'])} ({'safe' if j['safe'] else j['problem']})")
    lock = r["cross_user_lock"]
    print(
        f"cross-user owner lock: {'on at ' + lock['path'] if lock['on'] else 'off (' + lock['problem'] + ')'}"
    )
    print(f"settings left by dead runs: {len(r['leftovers'])}")
    for w in r["warnings"]:
        print(f"warning: {w}")
    for problem in r["problems"]:
        print(f"PROBLEM: {problem}")
    if not r["problems"]:
        print("OK: nothing here stops the optimizers.")


def _print_setters(s: dict[str, Any]) -> None:
    if s["route"] is not None:
        print(
            f"settings go through: {s['route']}{'' if s['endpoint'] is None else ' at ' + s['endpoint']} ({s['why']})"
        )
    d = s["zeusd"]
    if d is None:
        print(f"zeusd: not configured ({zeusd.SOCK_ENV} / {zeusd.HOST_PORT_ENV} unset)")
        return
    if not d["reachable"]:
        print(f"zeusd: configured at {d['endpoint']}, NOT reachable")
        return
    if d["generation"] is None:
        print(f"zeusd: configured at {d['endpoint']}, reachable, API not recognised")
        return
    scopes = "" if d["scopes"] is None else f", token scopes {', '.join(d['scopes']) or 'none'}"
    print(
        f"zeusd: configured at {d['endpoint']}, reachable, API {d['api']}, gpu-control "
        f"{_fmt(d['gpu_control'])}, auth {'required' if d['auth_required'] else 'off'} "
        f"(token {'set' if d['token'] else 'unset'}{scopes})"
    )
    for i, z in d["gpu_ids"].items():
        print(f"  GPU {i} -> zeusd GPU {z} (by {d['mapping'][i]})")


def run(args: argparse.Namespace) -> int:
    """Print the report; 1 when something would stop the optimizers (or there is no GPU library)."""
    gpus = discover(repair=False)  # read-only: leftovers are reported, not repaired
    if gpus is None:
        return 1
    report = check(gpus)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 1 if report["problems"] else 0
