"""A test double of Zeus's daemon `zeusd`, written from zeusd's published HTTP API document, for the tests.

zeusd itself (Rust) cannot be built on these machines, so this stands in for it. It follows the API
reference of zeusd 0.4 and newer (Zeus's `docs/zeusd/index.md` and `api.md`), no more:
- transports: a Unix domain socket or TCP, the same HTTP API on both;
- `GET /discover` (never needs a token): `gpus` (`id` = NVML index on the daemon's side, `name`,
  `pci_address` as `lspci -D` writes it, `cumulative_energy_available`), `cpus`, `enabled_api_groups`,
  `auth_required`; `GET /time`; `GET /auth/whoami` (404 when auth is off);
- GPU writes, `POST` with every parameter in the query string: `gpu_ids` (comma-separated, required),
  `block` (bool, required), and `power_limit_mw` (`/gpu/set_power_limit`), `enabled`
  (`/gpu/set_persistence_mode`), `min_clock_mhz` and `max_clock_mhz` (`/gpu/set_gpu_locked_clocks`,
  `/gpu/set_mem_locked_clocks`), none (`/gpu/reset_gpu_locked_clocks`, `/gpu/reset_mem_locked_clocks`,
  `/gpu/reset_locked_clocks`); the reads `get_power_limit`, `get_power_limit_constraints`,
  `get_persistence_mode`, `get_cumulative_energy`, `get_power`;
- API groups `gpu-control` (`/gpu/set_*`, `/gpu/reset_*`), `gpu-read` (other `/gpu/*`), `cpu-read`: a path of
  a disabled group answers 404 before any token check;
- JWT auth (`--signing-key`): HS256 tokens with `sub`, `scopes`, optional `exp`; a missing or invalid token
  is 401, a token without the path's scope is 403; every error body is `{"error": msg}`;
- status codes: 200; 400 bad input (a missing or malformed parameter, an unknown GPU, NVML's InvalidArgument
  or NotSupported); 403 NVML's NoPermission; 500 other NVML errors. A write aggregates per-GPU errors into
  `{"errors": {"<id>": msg}}` with the worst status.

Changes are applied through the simulator's NVML (`fake_nvml`) to the simulated node named by
`ZEUS_CALLBACKS_SIMULATE` and `ZEUS_CALLBACKS_SIM_STATE_DIR`, whose state the client's NVML reads see. The
daemon runs as root: the client's permission faults (`no_cap_sys_admin`, `no_permission`) are not its own;
`--faults` gives it faults of its own (e.g. `not_supported=power`). Each request opens the node afresh, as a
process that only changes settings and runs no work on the GPU.

Run: `python zeusd_double.py (--socket PATH | --tcp HOST:PORT) [--signing-key KEY] [--enable GROUPS]
[--faults F] [--no-pci-address] [--log FILE]`; prints `READY <address>` once it listens (TCP port 0: the
port it got). `issue_token(key, sub, scopes, exp)` makes a token the way `zeusd token issue` does.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import os
import socketserver
import sys
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

GROUPS = ("gpu-control", "gpu-read", "cpu-read")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue_token(key: bytes, sub: str, scopes: list[str], exp: int | None = None) -> str:
    """An HS256 JWT with zeusd's claims (`sub`, `scopes`, `exp` omitted for a token that never expires)."""
    claims: dict[str, Any] = {"sub": sub, "scopes": scopes}
    if exp is not None:
        claims["exp"] = exp
    head = _b64(json.dumps({"typ": "JWT", "alg": "HS256"}).encode())
    body = _b64(json.dumps(claims).encode())
    sig = hmac.new(key, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(sig)}"


def _verify(key: bytes, token: str) -> dict[str, Any]:
    """The token's claims; ValueError("...") when invalid or expired."""
    try:
        head, body, sig = token.split(".")
        expected = hmac.new(key, f"{head}.{body}".encode(), hashlib.sha256).digest()
        if json.loads(_unb64(head)).get("alg") != "HS256" or not hmac.compare_digest(expected, _unb64(sig)):
            raise ValueError("InvalidSignature")
        claims = json.loads(_unb64(body))
    except (ValueError, TypeError) as e:
        raise ValueError(f"Invalid token: {e}") from None
    if claims.get("exp") is not None and claims["exp"] < time.time():
        raise ValueError("Token has expired.")
    return claims


def _required_group(path: str) -> str | None:
    if path in ("/discover", "/time"):
        return None
    if path.startswith(("/gpu/set_", "/gpu/reset_")):
        return "gpu-control"
    if path.startswith("/gpu/"):
        return "gpu-read"
    if path.startswith("/cpu/"):
        return "cpu-read"
    return None


class _BadRequest(Exception):
    pass


def _bool(params: dict[str, str], name: str) -> bool:
    value = params.get(name)
    if value not in ("true", "false"):
        raise _BadRequest(f"Query deserialize error: missing or invalid field `{name}`")
    return value == "true"


def _uint(params: dict[str, str], name: str) -> int:
    value = params.get(name, "")
    if not value.isdigit():
        raise _BadRequest(f"Query deserialize error: missing or invalid field `{name}`")
    return int(value)


class Daemon:
    """The daemon's state: its options and a fresh view of the simulated node per request."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.groups = set(args.enable.split(",")) if args.enable else set(GROUPS)
        self.key = args.signing_key.encode() if args.signing_key else None
        self.faults = args.faults
        self.pci = not args.no_pci_address
        self.log = args.log

    def node(self) -> Any:
        from zeus_callbacks.sim import fake_nvml
        from zeus_callbacks.sim.system import SimulatedSystem

        system = SimulatedSystem(
            os.environ["ZEUS_CALLBACKS_SIMULATE"],
            faults=self.faults,
            state_dir=os.environ.get("ZEUS_CALLBACKS_SIM_STATE_DIR") or None,
            energy_refresh_ms=float(os.environ["ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS"])
            if os.environ.get("ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS")
            else None,
        )
        fake_nvml.attach(system)
        fake_nvml.nvmlInit()
        return fake_nvml

    def record(self, line: str) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(line + "\n")


class Handler(BaseHTTPRequestHandler):
    server: Any

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _send(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def _handle(self, method: str) -> None:
        daemon: Daemon = self.server.daemon
        url = urllib.parse.urlsplit(self.path)
        path = url.path
        params = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        daemon.record(f"{method} {path} {json.dumps(params, sort_keys=True)}")
        group = _required_group(path)
        if group is not None and group not in daemon.groups:
            return self._send(404, {"error": f"API group '{group}' is not enabled on this server."})
        if daemon.key is None and path.startswith("/auth/"):
            return self._send(404, {"error": "Authentication is not enabled on this server."})
        if daemon.key is not None and path not in ("/discover", "/time"):
            auth = self.headers.get("Authorization", "")
            challenge = {"WWW-Authenticate": 'Bearer realm="zeusd"'}
            if not auth.startswith("Bearer "):
                message = "Authentication required. Provide an Authorization: Bearer <token> header."
                return self._send(401, {"error": message}, challenge)
            try:
                claims = _verify(daemon.key, auth[len("Bearer ") :])
            except ValueError as e:
                return self._send(401, {"error": str(e)}, challenge)
            if group is not None and group not in claims.get("scopes", []):
                scopes = ", ".join(f"'{s}'" for s in claims.get("scopes", []))
                message = f"Token for user '{claims.get('sub')}' lacks required scope '{group}'. Token scopes: [{scopes}]"
                return self._send(403, {"error": message})
            if path == "/auth/whoami":
                return self._send(200, {k: claims[k] for k in ("sub", "scopes", "exp") if k in claims})
        routes = {
            ("GET", "/discover"): self._discover,
            ("GET", "/time"): lambda nvml, p: self._send(200, {"timestamp_ms": int(time.time() * 1000)}),
        }
        try:
            nvml = daemon.node()
            if (method, path) in routes:
                return routes[(method, path)](nvml, params)
            if method == "POST" and path.startswith("/gpu/"):
                return self._write(nvml, path, params)
            if method == "GET" and path.startswith("/gpu/get_"):
                return self._read(nvml, path, params)
        except _BadRequest as e:
            return self._send(400, {"error": str(e)})
        self._send(404)

    def _discover(self, nvml: Any, params: dict[str, str]) -> None:
        daemon: Daemon = self.server.daemon
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            entry: dict[str, Any] = {"id": i, "name": nvml.nvmlDeviceGetName(handle)}
            if daemon.pci:
                bus = nvml.nvmlDeviceGetPciInfo_v3(handle).busId
                bus = bus.decode() if isinstance(bus, bytes) else bus
                entry["pci_address"] = bus[4:].lower()  # NVML's 8-digit domain, as `lspci -D` writes 4
                entry["cumulative_energy_available"] = True
            gpus.append(entry)
        self._send(
            200,
            {
                "gpus": gpus,
                "cpus": [],
                "enabled_api_groups": sorted(daemon.groups),
                "auth_required": daemon.key is not None,
            },
        )

    def _gpu_ids(self, nvml: Any, params: dict[str, str], required: bool) -> list[int]:
        text = params.get("gpu_ids")
        if text is None:
            if required:
                raise _BadRequest("Query deserialize error: missing field `gpu_ids`")
            return list(range(nvml.nvmlDeviceGetCount()))
        try:
            return [int(x) for x in text.split(",")]
        except ValueError:
            raise _BadRequest(f"Invalid gpu_ids: {text!r}") from None

    def _write(self, nvml: Any, path: str, params: dict[str, str]) -> None:
        ids = self._gpu_ids(nvml, params, required=True)
        _bool(params, "block")
        name = path[len("/gpu/") :]
        if name == "set_power_limit":
            limit = _uint(params, "power_limit_mw")
            op = lambda h: nvml.nvmlDeviceSetPowerManagementLimit(h, limit)  # noqa: E731
        elif name == "set_persistence_mode":
            mode = nvml.NVML_FEATURE_ENABLED if _bool(params, "enabled") else nvml.NVML_FEATURE_DISABLED
            op = lambda h: nvml.nvmlDeviceSetPersistenceMode(h, mode)  # noqa: E731
        elif name in ("set_gpu_locked_clocks", "set_mem_locked_clocks"):
            lo, hi = _uint(params, "min_clock_mhz"), _uint(params, "max_clock_mhz")
            fn = (
                nvml.nvmlDeviceSetGpuLockedClocks
                if name.startswith("set_gpu")
                else nvml.nvmlDeviceSetMemoryLockedClocks
            )
            op = lambda h: fn(h, lo, hi)  # noqa: E731
        elif name == "reset_gpu_locked_clocks":
            op = nvml.nvmlDeviceResetGpuLockedClocks
        elif name == "reset_mem_locked_clocks":
            op = nvml.nvmlDeviceResetMemoryLockedClocks
        elif name == "reset_locked_clocks":
            op = lambda h: (nvml.nvmlDeviceResetGpuLockedClocks(h), nvml.nvmlDeviceResetMemoryLockedClocks(h))  # noqa: E731
        else:
            return self._send(404)
        errors: dict[str, tuple[int, str]] = {}
        for i in ids:
            try:
                if not 0 <= i < nvml.nvmlDeviceGetCount():
                    errors[str(i)] = (400, f"GPU index {i} does not exist.")
                    continue
                op(nvml.nvmlDeviceGetHandleByIndex(i))
            except nvml.NVMLError as e:
                errors[str(i)] = (_nvml_status(nvml, e), f"NVML error: {_nvml_name(nvml, e)}")
        if errors:
            worst = max(status for status, _ in errors.values())
            return self._send(worst, {"errors": {k: msg for k, (_, msg) in errors.items()}})
        self._send(200)

    def _read(self, nvml: Any, path: str, params: dict[str, str]) -> None:
        ids = self._gpu_ids(nvml, params, required=False)
        name = path[len("/gpu/") :]
        out: dict[str, Any] = {}
        for i in ids:
            if not 0 <= i < nvml.nvmlDeviceGetCount():
                return self._send(400, {"error": f"GPU index {i} does not exist."})
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            if name == "get_power_limit":
                out[str(i)] = {"power_limit_mw": nvml.nvmlDeviceGetPowerManagementLimit(h)}
            elif name == "get_power_limit_constraints":
                lo, hi = nvml.nvmlDeviceGetPowerManagementLimitConstraints(h)
                out[str(i)] = {"min_power_limit_mw": lo, "max_power_limit_mw": hi}
            elif name == "get_persistence_mode":
                out[str(i)] = {"enabled": nvml.nvmlDeviceGetPersistenceMode(h) == nvml.NVML_FEATURE_ENABLED}
            elif name == "get_cumulative_energy":
                out[str(i)] = {"energy_mj": nvml.nvmlDeviceGetTotalEnergyConsumption(h)}
            elif name == "get_power":
                out[str(i)] = nvml.nvmlDeviceGetPowerUsage(h)
            else:
                return self._send(404)
        if name == "get_power":
            out = {"timestamp_ms": int(time.time() * 1000), "power_mw": out}
        self._send(200, out)


def _nvml_name(nvml: Any, error: Exception) -> str:
    names = {
        nvml.NVML_ERROR_NO_PERMISSION: "NoPermission",
        nvml.NVML_ERROR_INVALID_ARGUMENT: "InvalidArg",
        nvml.NVML_ERROR_NOT_SUPPORTED: "NotSupported",
        nvml.NVML_ERROR_GPU_IS_LOST: "GpuLost",
    }
    return names.get(getattr(error, "value", None), str(error))


def _nvml_status(nvml: Any, error: Exception) -> int:
    code = getattr(error, "value", None)
    if code == nvml.NVML_ERROR_NO_PERMISSION:
        return 403
    if code in (nvml.NVML_ERROR_INVALID_ARGUMENT, nvml.NVML_ERROR_NOT_SUPPORTED):
        return 400
    return 500


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self) -> tuple[Any, Any]:
        request, _ = super().get_request()
        return request, ("local", 0)  # BaseHTTPRequestHandler wants a (host, port) client address


class _TCPServer(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket")
    where.add_argument("--tcp")
    parser.add_argument("--signing-key")
    parser.add_argument("--enable", default="")
    parser.add_argument("--faults", default="")
    parser.add_argument("--no-pci-address", action="store_true")
    parser.add_argument("--log")
    args = parser.parse_args(argv)
    if args.socket:
        if os.path.exists(args.socket):
            os.unlink(args.socket)
        server: Any = _UnixServer(args.socket, Handler)
        address = args.socket
    else:
        host, _, port = args.tcp.rpartition(":")
        server = _TCPServer((host, int(port)), Handler)
        address = f"{host}:{server.server_address[1]}"
    server.daemon = Daemon(args)
    sys.stdout.write(f"READY {address}\n")
    sys.stdout.flush()
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
