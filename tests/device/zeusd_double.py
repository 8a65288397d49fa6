"""A test double of Zeus's daemon `zeusd`, rebuilt from zeusd's Rust source, one API generation at a time.

zeusd (Rust) cannot be built on these machines, so this stands in for it, behaviour by behaviour, as read
in ml-energy/zeus `zeusd/src/` at the tags `zeusd-v0.4.0`, `zeusd-v0.5.0` and master (`--generation 0.4 |
0.5 | master`); each rule cites the file it mirrors (the rules without a server are in
`zeusd_double_rules.py`). In short:
- `GET /discover` per generation (`routes/server.rs`), computed once at start as `main.rs` / `startup.rs` do;
  `GET /time`; `GET /auth/whoami`;
- the auth middleware (`auth.rs`): a path of a disabled API group is 404 before any token check; with a
  signing key every path but /discover and /time needs a valid bearer token (401) with the path's scope (403);
  without one, /auth/* is 404; all as `{"error": text}`;
- GPU writes (`routes/gpu.rs`): query structs with `deny_unknown_fields`, malformed queries answered by
  actix as 400 text/plain; every index checked before anything runs (400 text/plain
  `GPU index N does not exist.`); `block=true` waits for the commands, `block=false` answers once they are
  queued; per-GPU errors as `{"errors": {...}}` with 500 (0.4) or the worst status (0.5, `error.rs`);
- one FIFO command queue and worker per GPU (`devices/gpu/mod.rs`): a command runs even when its caller
  has gone. `--queue-delay S` makes each command wait S seconds in its queue (a slow daemon);
  `--hold-writes N` keeps the first N write commands queued until a later command for the same GPU
  arrives or the daemon stops (a slow daemon reduced to its ordering, the same on any host);
- reads: `get_cumulative_energy`, `get_power` (NVML's instant power field, as the poller in
  `devices/gpu/power.rs` and `nvml.rs` `get_instant_power_mw` read it) and `stream_power` (SSE) at every
  generation; `get_power_limit`, `get_power_limit_constraints`, `get_persistence_mode` from 0.5;
  `reset_locked_clocks` after 0.5; `/cpu/*` on a node with no RAPL package.

Changes are applied through the simulator's NVML (`zeus_callbacks.sim.fake_nvml`) to the simulated node
named by `ZEUS_CALLBACKS_SIMULATE` and `ZEUS_CALLBACKS_SIM_STATE_DIR`, whose state the client's NVML
reads see. On an AMD node (`2*mi300x`) master serves the GPUs through its AMD backend instead
(`zeusd_double_amd.py`: `devices/gpu/amdsmi/mod.rs` over the simulated `libamd_smi.so`, chosen as
`startup.rs` `resolve_gpu_backend` chooses it: the backend that reports GPUs); 0.4 and 0.5 have NVML only and
do not start there. The daemon runs as root: the client's permission faults are not its own; `--faults` gives it
faults of its own (e.g. `not_supported=clocks`, `lost_after=0`).

Run: `python zeusd_double.py (--socket PATH | --tcp HOST:PORT) [--generation G] [--signing-key KEY]
[--enable GROUPS] [--faults F] [--queue-delay S] [--hold-writes N] [--log FILE]`; prints `READY <address>`
once it listens (TCP port 0: the port it got). SIGTERM runs what is queued, then exits.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socketserver
import sys
import threading
import time
import urllib.parse
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zeusd_double_amd import AmdsmiGpu, AmdsmiLibrary, is_amd_node  # noqa: E402
from zeusd_double_rules import (  # noqa: E402
    GENERATIONS,
    GROUPS,
    Refusal,
    issue_token,
    nvml_answer,
    parse_ids,
    parse_query,
    required_scope,
    verify_token,
)

__all__ = ["issue_token", "main"]

_NVML_LOCK = threading.Lock()  # the simulator's module state is one per process


def _node(faults: str) -> Any:
    """A fresh view of the simulated node (its state lives in files the client sees too)."""
    from zeus_callbacks.sim import fake_nvml
    from zeus_callbacks.sim.system import SimulatedSystem

    refresh = os.environ.get("ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS")
    system = SimulatedSystem(
        os.environ["ZEUS_CALLBACKS_SIMULATE"],
        faults=faults,
        state_dir=os.environ.get("ZEUS_CALLBACKS_SIM_STATE_DIR") or None,
        energy_refresh_ms=float(refresh) if refresh else None,
    )
    fake_nvml.attach(system)
    fake_nvml.nvmlInit()
    return fake_nvml


class GpuCommand:
    """One queued command (`devices/gpu/mod.rs` `GpuCommand`): the route's `name` and query `q`; `future` is
    None when nobody waits (`block=false`)."""

    def __init__(self, name: str, q: dict[str, Any], write: bool, future: Future | None) -> None:
        self.name, self.q, self.write, self.future = name, q, write, future


class GpuWorker(threading.Thread):
    """`gpu_management_task`: one per GPU, commands run one at a time in arrival order."""

    def __init__(self, daemon: Daemon, gpu_id: int) -> None:
        super().__init__(daemon=True)
        self.owner, self.gpu_id = daemon, gpu_id
        self.commands: queue.Queue[GpuCommand | None] = queue.Queue()
        self.held: list[GpuCommand] = []

    def submit(self, command: GpuCommand) -> None:
        self.commands.put(command)

    def run(self) -> None:
        while True:
            command = self.commands.get()
            if command is None:  # stopping: what is held runs first (zeusd runs every queued command)
                for held in self.held:
                    self._execute(held)
                self.held.clear()
                return
            if command.write and self.owner.holds_left > 0:
                self.owner.holds_left -= 1
                self.held.append(command)
                continue
            for held in self.held:  # a later command arrived: the held ones run before it, in order
                self._execute(held)
            self.held.clear()
            self._execute(command)

    def _execute(self, command: GpuCommand) -> None:
        if self.owner.queue_delay_s:
            time.sleep(self.owner.queue_delay_s)
        try:
            result = self.owner.run(self.gpu_id, command.name, command.q)
        except Exception as e:  # noqa: BLE001 - a double must answer, as zeusd's task does
            result = Refusal(500, f"Management task for GPU {self.gpu_id} failed: {e!r}")
        self.owner.record(
            f"RAN gpu {self.gpu_id}: {'ok' if not isinstance(result, Refusal) else result.body}"
        )
        if command.future is not None:
            command.future.set_result(result)


class Daemon:
    """The daemon's options, its discovery document and its GPU workers."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.generation = args.generation
        # config.rs: `--enable` defaults to every group, in this order; /discover lists them in that order.
        self.groups = [g for g in GROUPS if g in args.enable.split(",")] if args.enable else list(GROUPS)
        self.key = args.signing_key.encode() if args.signing_key else None
        self.faults = args.faults
        self.queue_delay_s = args.queue_delay
        self.holds_left = args.hold_writes
        self.log = args.log
        self._log_lock = threading.Lock()
        self.amd: list[AmdsmiGpu] | None = None  # master's AMD backend (zeusd_double_amd.py): an AMD node
        with _NVML_LOCK:  # startup.rs reads names and addresses once, before any request
            if is_amd_node():
                if self.generation != "master":  # 0.4 and 0.5 start NVML alone (their startup.rs)
                    raise SystemExit(
                        f"zeusd {self.generation} has no AMD backend: NVML finds no GPU on this node"
                    )
                lib = AmdsmiLibrary("")
                self.amd = [AmdsmiGpu(i, lib) for i in range(len(lib.gpus()))]
                self.names, self.pci = [g.name for g in self.amd], [g.pci_address for g in self.amd]
                count = len(self.amd)
            else:
                nvml = _node("")
                handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
                count, self.names = len(handles), [nvml.nvmlDeviceGetName(h) for h in handles]
                self.pci = [_lspci(nvml.nvmlDeviceGetPciInfo_v3(h).busId) for h in handles]
        gpu_enabled = "gpu-control" in self.groups or "gpu-read" in self.groups
        self.workers = [GpuWorker(self, i) for i in range(count if gpu_enabled else 0)]
        for w in self.workers:
            w.start()

    def discovery(self) -> dict[str, Any]:
        """`routes/server.rs` `DiscoveryInfo` of this generation (no CPU package: no RAPL here)."""
        common = {"enabled_api_groups": self.groups, "auth_required": self.key is not None}
        ids = range(len(self.workers))
        if self.generation == "0.4":
            return {"gpu_ids": list(ids), "cpu_ids": [], "dram_available": [], **common}
        gpus: list[dict[str, Any]] = [{"id": i, "name": self.names[i]} for i in ids]
        if self.generation == "master":
            for g in gpus:
                # `cumulative_energy_available`: nvml.rs `validate_energy_counters` (NotSupported: false).
                energy = True if self.amd is None else self.amd[g["id"]].energy_available
                g.update(pci_address=self.pci[g["id"]], cumulative_energy_available=energy)
        return {"gpus": gpus, "cpus": [], **common}

    def run(self, gpu_id: int, name: str, q: dict[str, Any]) -> Any:
        """Command `name` on GPU `gpu_id`: its result, or a `Refusal` (`GpuCommand::execute`)."""
        with _NVML_LOCK:
            if self.amd is not None:
                return self.amd[gpu_id].run(self.faults, name, q)
            nvml = _node(self.faults)
            try:
                return _NVML_CALLS[name](nvml, nvml.nvmlDeviceGetHandleByIndex(gpu_id), q)
            except nvml.NVMLError as e:
                return Refusal(*nvml_answer(getattr(e, "value", None), self.generation))

    def record(self, line: str) -> None:
        if self.log:
            with self._log_lock, open(self.log, "a") as f:
                f.write(line + "\n")

    def stop(self) -> None:
        for w in self.workers:
            w.commands.put(None)
        for w in self.workers:
            w.join(timeout=60)


def _lspci(bus_id: str | bytes) -> str:
    """nvml.rs `pci_address`: `{domain:04x}:{bus:02x}:{device:02x}.0` from NVML's PCI info."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    domain, bus, rest = text.split(":")
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(rest.split('.')[0], 16):02x}.0"


# -- routes: (method, path) -> (group, generations, query fields, handler name) ---------------------------------
_IDS_REQUIRED = [("gpu_ids", "str", True)]
_WRITES: dict[str, list[tuple[str, str, bool]]] = {
    # routes/gpu.rs `impl_handler_for_gpu_command!` / `impl_write_handler_for_gpu_command!`: gpu_ids,
    # the command's fields, block; in this declaration order.
    "set_persistence_mode": [("enabled", "bool", True)],
    "set_power_limit": [("power_limit_mw", "u32", True)],
    "set_gpu_locked_clocks": [("min_clock_mhz", "u32", True), ("max_clock_mhz", "u32", True)],
    "reset_gpu_locked_clocks": [],
    "set_mem_locked_clocks": [("min_clock_mhz", "u32", True), ("max_clock_mhz", "u32", True)],
    "reset_mem_locked_clocks": [],
    "reset_locked_clocks": [],  # after 0.5 only
}
_READS_05 = ("get_power_limit", "get_power_limit_constraints", "get_persistence_mode")


def _reset_locked_clocks(nvml: Any, h: Any) -> None:
    """nvml.rs `reset_locked_clocks`: both resets run, the first error reported."""
    errors = []
    for fn in (nvml.nvmlDeviceResetGpuLockedClocks, nvml.nvmlDeviceResetMemoryLockedClocks):
        try:
            fn(h)
        except nvml.NVMLError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def _power_limit_constraints(nvml: Any, h: Any) -> dict[str, int]:
    lo, hi = nvml.nvmlDeviceGetPowerManagementLimitConstraints(h)
    return {"min_power_limit_mw": lo, "max_power_limit_mw": hi}


# command -> its NVML calls (`devices/gpu/nvml.rs`), given the module, the handle and the query fields.
_NVML_CALLS: dict[str, Any] = {
    "set_persistence_mode": lambda nvml, h, q: nvml.nvmlDeviceSetPersistenceMode(
        h, nvml.NVML_FEATURE_ENABLED if q["enabled"] else nvml.NVML_FEATURE_DISABLED
    ),
    "set_power_limit": lambda nvml, h, q: nvml.nvmlDeviceSetPowerManagementLimit(h, q["power_limit_mw"]),
    "set_gpu_locked_clocks": lambda nvml, h, q: nvml.nvmlDeviceSetGpuLockedClocks(
        h, q["min_clock_mhz"], q["max_clock_mhz"]
    ),
    "reset_gpu_locked_clocks": lambda nvml, h, q: nvml.nvmlDeviceResetGpuLockedClocks(h),
    "set_mem_locked_clocks": lambda nvml, h, q: nvml.nvmlDeviceSetMemoryLockedClocks(
        h, q["min_clock_mhz"], q["max_clock_mhz"]
    ),
    "reset_mem_locked_clocks": lambda nvml, h, q: nvml.nvmlDeviceResetMemoryLockedClocks(h),
    "reset_locked_clocks": lambda nvml, h, q: _reset_locked_clocks(nvml, h),
    "get_cumulative_energy": lambda nvml, h, q: {"energy_mj": nvml.nvmlDeviceGetTotalEnergyConsumption(h)},
    "get_power": lambda nvml, h, q: _instant_power_mw(nvml, h),
    "get_power_limit": lambda nvml, h, q: {"power_limit_mw": nvml.nvmlDeviceGetPowerManagementLimit(h)},
    "get_power_limit_constraints": lambda nvml, h, q: _power_limit_constraints(nvml, h),
    "get_persistence_mode": lambda nvml, h, q: {
        "enabled": nvml.nvmlDeviceGetPersistenceMode(h) == nvml.NVML_FEATURE_ENABLED
    },
}


def _instant_power_mw(nvml: Any, h: Any) -> int:
    """nvml.rs `get_instant_power_mw`: the field `NVML_FI_DEV_POWER_INSTANT`, never the 1 s average."""
    [value] = nvml.nvmlDeviceGetFieldValues(h, [nvml.NVML_FI_DEV_POWER_INSTANT])
    if value.nvmlReturn != nvml.NVML_SUCCESS:
        raise nvml.NVMLError(value.nvmlReturn)
    return int(value.value.uiVal)


class Handler(BaseHTTPRequestHandler):
    server: Any
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _send(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        if isinstance(body, str):  # actix's `ResponseError` default: the Display text as text/plain
            data, kind = body.encode(), "text/plain; charset=utf-8"
        else:
            data, kind = (b"", None) if body is None else (json.dumps(body).encode(), "application/json")
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if kind:
            self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def _handle(self, method: str) -> None:
        daemon: Daemon = self.server.zeusd
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        params = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        daemon.record(f"{method} {url.path} {json.dumps(params, sort_keys=True)}")
        try:
            claims = self._authorize(daemon, url.path)
            self._route(daemon, method, url.path, url.query, claims)
        except Refusal as r:
            headers = {"WWW-Authenticate": 'Bearer realm="zeusd"'} if r.status == 401 else None
            self._send(r.status, r.body, headers)

    def _authorize(self, daemon: Daemon, path: str) -> dict[str, Any] | None:
        """auth.rs `AuthMiddlewareService::call`, in its order."""
        group = required_scope(path)
        if group is not None and group not in daemon.groups:
            raise Refusal(404, {"error": f"API group '{group}' is not enabled on this server."})
        if daemon.key is None:
            if path.startswith("/auth/"):
                raise Refusal(404, {"error": "Authentication is not enabled on this server."})
            return None
        if path in ("/discover", "/time"):
            return None
        auth = self.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            message = "Authentication required. Provide an Authorization: Bearer <token> header."
            raise Refusal(401, {"error": message})
        claims = verify_token(daemon.key, auth[len("Bearer ") :])
        if group is not None and group not in claims["scopes"]:
            scopes = ", ".join(f"'{s}'" for s in claims["scopes"])
            message = (
                f"Token for user '{claims['sub']}' lacks required scope '{group}'. Token scopes: [{scopes}]"
            )
            raise Refusal(403, {"error": message})
        return claims

    def _route(
        self, daemon: Daemon, method: str, path: str, query: str, claims: dict[str, Any] | None
    ) -> None:
        g = daemon.generation
        if (method, path) == ("GET", "/discover"):
            return self._send(200, daemon.discovery())
        if (method, path) == ("GET", "/time"):
            return self._send(200, {"timestamp_ms": int(time.time() * 1000)})
        if (method, path) == ("GET", "/auth/whoami") and claims is not None:
            return self._send(
                200, {k: claims[k] for k in ("sub", "scopes", "exp") if claims.get(k) is not None}
            )
        name = path[len("/gpu/") :] if path.startswith("/gpu/") else None
        # startup.rs registers /gpu routes by group; an unregistered route is actix's empty 404.
        if method == "POST" and name in _WRITES and (name != "reset_locked_clocks" or g == "master"):
            return self._write(daemon, name, query)
        reads = ("get_cumulative_energy", "get_power", "stream_power") + (_READS_05 if g != "0.4" else ())
        if method == "GET" and name in reads:
            return self._read(daemon, name, query)
        if method == "GET" and path in ("/cpu/get_cumulative_energy", "/cpu/get_power", "/cpu/stream_power"):
            return self._cpu(path, query, g)
        self._send(404)

    def _write(self, daemon: Daemon, name: str, query: str) -> None:
        """routes/gpu.rs: parse, check every index (nothing runs on a bad one), queue, wait if `block`."""
        q = parse_query(query, _IDS_REQUIRED + _WRITES[name] + [("block", "bool", True)])
        ids = parse_ids(q["gpu_ids"], daemon.generation)
        for i in ids:
            if i >= len(daemon.workers):
                raise Refusal(400, f"GPU index {i} does not exist.")  # GpuNotFoundError, text/plain
        futures = {}
        for i in ids:
            future: Future | None = Future() if q["block"] else None
            daemon.workers[i].submit(GpuCommand(name, q, True, future))
            futures[i] = future
        if not q["block"]:
            return self._send(200)
        errors = {i: f.result() for i, f in futures.items() if isinstance(f.result(), Refusal)}
        if not errors:
            return self._send(200)
        # 0.4 answers any per-GPU failure 500; 0.5 `aggregate_error_response`: the worst status.
        status = 500 if daemon.generation == "0.4" else max(r.status for r in errors.values())
        self._send(status, {"errors": {str(i): r.body for i, r in errors.items()}})

    def _read(self, daemon: Daemon, name: str, query: str) -> None:
        q = parse_query(query, [("gpu_ids", "str", False)])
        count, g = len(daemon.workers), daemon.generation
        if "gpu_ids" in q:
            ids = parse_ids(q["gpu_ids"], g)
            unknown = [i for i in ids if i >= count]
            if unknown and (name in ("get_power", "stream_power") and g == "0.4" or name == "stream_power"):
                # 0.4 gpu.rs / 0.5 mod.rs `resolve_stream_device_ids`: validated against the poller's GPUs.
                raise Refusal(
                    400, {"error": f"Unknown GPU indices: {unknown}. Available: {list(range(count))}"}
                )
            if unknown and g == "0.4":
                raise Refusal(400, f"GPU index {unknown[0]} does not exist.")
            if unknown:
                raise Refusal(400, {"error": f"GPU {unknown[0]} not found"})  # resolve_read_device_ids
        else:
            ids = list(range(count))
        if name == "stream_power":
            return self._stream(daemon, ids)
        futures = {i: Future() for i in ids}
        for i in ids:
            daemon.workers[i].submit(GpuCommand(name, q, False, futures[i]))
        results = {i: f.result() for i, f in futures.items()}
        errors = {i: r for i, r in results.items() if isinstance(r, Refusal)}
        if errors:
            status = 500 if g == "0.4" else max(r.status for r in errors.values())
            return self._send(status, {"errors": {str(i): r.body for i, r in errors.items()}})
        if name == "get_power":  # power.rs `GpuPowerSnapshot`
            return self._send(200, {"timestamp_ms": int(time.time() * 1000), "power_mw": results})
        self._send(200, {str(i): r for i, r in results.items()})

    def _stream(self, daemon: Daemon, ids: list[int]) -> None:
        """SSE until the client leaves: 0.4 sends whole snapshots, 0.5 one `GpuPowerSample` per GPU (power.rs),
        at the default `--gpu-power-poll-hz` of 20."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while True:
                readings = {i: daemon.run(i, "get_power", {}) for i in ids}
                power = {i: p for i, p in readings.items() if not isinstance(p, Refusal)}
                now = int(time.time() * 1000)
                if daemon.generation == "0.4":
                    events = [{"timestamp_ms": now, "power_mw": power}]
                else:
                    events = [{"timestamp_ms": now, "gpu_id": i, "power_mw": p} for i, p in power.items()]
                for event in events:
                    data = f"data: {json.dumps(event)}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            self.close_connection = True

    def _cpu(self, path: str, query: str, g: str) -> None:
        """routes/cpu.rs on a node without RAPL packages: every index is unknown, none means an empty map."""
        if path.endswith("get_cumulative_energy"):
            fields = [("cpu_ids", "str", g == "0.4"), ("cpu", "bool", True), ("dram", "bool", True)]
        else:
            fields = [("cpu_ids", "str", False)]
        q = parse_query(query, fields)
        if "cpu_ids" in q:
            ids = parse_ids(q["cpu_ids"], g, "CPU")
            if path.endswith("get_cumulative_energy"):
                raise Refusal(
                    400,
                    f"CPU index {ids[0]} does not exist."
                    if g == "0.4"
                    else {"error": f"CPU {ids[0]} not found"},
                )
            raise Refusal(400, {"error": f"Unknown CPU indices: {ids}. Available: []"})
        if path.endswith("get_power"):
            return self._send(200, {"timestamp_ms": int(time.time() * 1000), "power_mw": {}})
        self._send(200, {})


class _Quiet:
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A caller that left before its answer (a client's timeout) is no error of the daemon's.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)  # type: ignore[misc]


class _UnixServer(_Quiet, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self) -> tuple[Any, Any]:
        request, _ = super().get_request()
        return request, ("local", 0)  # BaseHTTPRequestHandler wants a (host, port) client address


class _TCPServer(_Quiet, socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket")
    where.add_argument("--tcp")
    parser.add_argument("--generation", choices=GENERATIONS, default="master")
    parser.add_argument("--signing-key")
    parser.add_argument("--enable", default="")
    parser.add_argument("--faults", default="")
    parser.add_argument("--queue-delay", type=float, default=0.0)
    parser.add_argument("--hold-writes", type=int, default=0)
    parser.add_argument("--log")
    args = parser.parse_args(argv)
    daemon = Daemon(args)
    if args.socket:
        if os.path.exists(args.socket):
            os.unlink(args.socket)
        server: Any = _UnixServer(args.socket, Handler)
        address = args.socket
    else:
        host, _, port = args.tcp.rpartition(":")
        server = _TCPServer((host, int(port)), Handler)
        address = f"{host}:{server.server_address[1]}"
    server.zeusd = daemon

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    sys.stdout.write(f"READY {address}\n")
    sys.stdout.flush()
    try:
        server.serve_forever()
    finally:
        server.server_close()
        daemon.stop()  # zeusd's queued commands run even when their callers have gone
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
