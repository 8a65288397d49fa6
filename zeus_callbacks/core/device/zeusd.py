"""Zeus's daemon `zeusd`: the HTTP client through which a process without CAP_SYS_ADMIN changes GPU settings.

`zeusd` runs as root on the node and changes power limits, locked clocks and persistence mode on behalf
of unprivileged processes. It is found as Zeus finds it: `ZEUSD_SOCK_PATH` (a Unix domain socket; tried
first) or `ZEUSD_HOST_PORT` (`host:port` over TCP), with an optional JWT in `ZEUSD_TOKEN` sent as a
bearer token. The API spoken is the one documented for zeusd 0.4 and newer (what Zeus 0.15+ speaks):
`POST /gpu/set_power_limit?gpu_ids=I&power_limit_mw=MW&block=true` and its siblings for clocks and
persistence, every parameter in the query string, `block=true` so that errors are reported; `GET /discover`
lists the daemon's GPUs (NVML's numbering on the daemon's side, with their PCI addresses) and its enabled
API groups; `GET /auth/whoami` the token's scopes. Reads stay on NVML: only the setters go through here.

Only the standard library is used (`http.client`, with a connection class for Unix sockets).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import threading
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zeus_callbacks.core.device.errors import (
    GPUError,
    GPULostError,
    GPUNoPermissionError,
    GPUNotSupportedError,
    InvalidInputError,
)

if TYPE_CHECKING:
    import http.client

    from zeus_callbacks.core.device.gpus import GPU

__all__ = [
    "SOCK_ENV",
    "HOST_PORT_ENV",
    "TOKEN_ENV",
    "ZeusdEndpoint",
    "ZeusdClient",
    "ZeusdGPU",
    "Discovery",
    "client_for",
    "forget_clients",
]

logger = logging.getLogger(__name__)

SOCK_ENV = "ZEUSD_SOCK_PATH"
HOST_PORT_ENV = "ZEUSD_HOST_PORT"
TOKEN_ENV = "ZEUSD_TOKEN"
TIMEOUT_S = 10.0  # a blocking setter takes milliseconds; a daemon that hangs must not hang training for long
_CONTROL = "gpu-control"


@dataclass(frozen=True)
class ZeusdEndpoint:
    """Where zeusd listens: a Unix domain socket or a TCP `host:port` (exactly one is set)."""

    socket_path: str | None = None
    host_port: str | None = None

    def __str__(self) -> str:
        """`unix:/run/zeusd/zeusd.sock` or `tcp:node1:4938`: how journals record it (`parse` reads it back)."""
        return f"unix:{self.socket_path}" if self.socket_path is not None else f"tcp:{self.host_port}"

    @classmethod
    def parse(cls, text: str) -> ZeusdEndpoint:
        """The endpoint `str(endpoint)` wrote.

        Raises:
            ValueError: `text` is not `unix:PATH` or `tcp:HOST:PORT`.
        """
        kind, _, rest = text.partition(":")
        if kind == "unix" and rest:
            return cls(socket_path=rest)
        if kind == "tcp" and _valid_host_port(rest):
            return cls(host_port=rest)
        raise ValueError(f"{text!r} is not a zeusd endpoint (unix:PATH or tcp:HOST:PORT)")

    @classmethod
    def from_env(cls) -> ZeusdEndpoint | None:
        """From `ZEUSD_SOCK_PATH` (first) or `ZEUSD_HOST_PORT`, as Zeus reads them; None when neither is set.

        Raises:
            InvalidInputError: `ZEUSD_HOST_PORT` is not `host:port`, or `ZEUSD_SOCK_PATH` is empty.
        """
        sock = os.environ.get(SOCK_ENV)
        if sock is not None:
            if not sock.strip():
                raise InvalidInputError(
                    f"{SOCK_ENV} is set but empty: set it to zeusd's socket (e.g. /run/zeusd/zeusd.sock), or unset it."
                )
            return cls(socket_path=os.path.abspath(sock))
        host_port = os.environ.get(HOST_PORT_ENV)
        if host_port is not None:
            if not _valid_host_port(host_port):
                raise InvalidInputError(
                    f"{HOST_PORT_ENV}={host_port!r} is not host:port: set it to zeusd's TCP address, e.g. "
                    "node1:4938, or unset it."
                )
            return cls(host_port=host_port)
        return None

    def connection(self, timeout_s: float = TIMEOUT_S) -> http.client.HTTPConnection:
        """A new HTTP connection to the daemon (not yet connected)."""
        import http.client  # here: importing the package must not pay for it (its email parsers)

        if self.socket_path is not None:
            return _unix_connection_class()(self.socket_path, timeout_s)
        assert self.host_port is not None
        return http.client.HTTPConnection(self.host_port, timeout=timeout_s)


def _valid_host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host.strip("[]")) and port.isdigit() and 0 < int(port) < 65536


@functools.cache
def _unix_connection_class() -> type[http.client.HTTPConnection]:
    import http.client

    class UnixHTTPConnection(http.client.HTTPConnection):
        """HTTP over a Unix domain socket (zeusd's default transport)."""

        def __init__(self, path: str, timeout_s: float) -> None:
            super().__init__("localhost", timeout=timeout_s)
            self._path = path

        def connect(self) -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self._path)
            except BaseException:
                sock.close()
                raise
            self.sock = sock

    return UnixHTTPConnection


@dataclass(frozen=True)
class ZeusdGPU:
    """A GPU as `GET /discover` lists it: zeusd's index (NVML's numbering on the daemon's side)."""

    id: int
    name: str
    pci_address: str | None  # `lspci -D` form; absent from older daemons


@dataclass(frozen=True)
class Discovery:
    """What `GET /discover` says (it never needs a token)."""

    gpus: tuple[ZeusdGPU, ...]
    enabled_api_groups: frozenset[str]
    auth_required: bool


def _pci_key(address: str) -> tuple[int, int, int, int] | None:
    """(domain, bus, device, function) of `0000:17:00.0` or NVML's `00000000:17:00.0`; None if malformed."""
    try:
        domain, bus, rest = address.strip().split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except ValueError:
        return None


def _gpu_pci_key(gpu: GPU) -> tuple[int, int, int, int] | None:
    nvml = gpu.nvml
    try:
        bus_id = nvml.nvmlDeviceGetPciInfo_v3(gpu.handle).busId
    except (AttributeError, nvml.NVMLError):
        return None
    return _pci_key(bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id))


class ZeusdClient:
    """The setters of one zeusd endpoint, in the shape of the device layer's NVML setters.

    Each request opens a connection of its own (thread-safe: the frequency controller's worker, a signal
    handler and the main thread may all change settings). Errors become the package's GPU errors, each one
    line that says what failed and what to do.

    Args:
        endpoint: Where the daemon listens.
        token: The bearer token (`ZEUSD_TOKEN`), or None.
    """

    name = "zeusd"

    def __init__(self, endpoint: ZeusdEndpoint, token: str | None = None) -> None:
        self.endpoint = endpoint
        self._token = token or None
        self._discovery: Discovery | None = None
        self._ids: dict[str, int] = {}  # GPU UUID -> zeusd's index
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ZeusdClient({str(self.endpoint)!r}, token={'set' if self._token else 'none'})"

    @property
    def has_token(self) -> bool:
        """Whether a bearer token is sent."""
        return self._token is not None

    # -- HTTP ---------------------------------------------------------------------------------------
    def request(self, method: str, path: str, params: dict[str, Any] | None = None) -> tuple[int, Any]:
        """(HTTP status, decoded JSON body or text or None) of one request.

        Raises:
            OSError: the daemon cannot be reached (refused, no socket, timeout, ...).
        """
        import http.client

        query = urllib.parse.urlencode(params or {})
        headers = {"Content-Length": "0"} if method == "POST" else {}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        conn = self.endpoint.connection()
        try:
            conn.request(method, f"{path}?{query}" if query else path, headers=headers)
            response = conn.getresponse()
            raw = response.read().decode("utf-8", "replace")
        except http.client.HTTPException as e:
            raise OSError(f"bad HTTP answer: {e!r}") from None
        finally:
            conn.close()
        try:
            body: Any = json.loads(raw) if raw.strip() else None
        except ValueError:
            body = raw.strip()
        return response.status, body

    def _where(self) -> str:
        return f"zeusd at {self.endpoint}"

    def _unreachable(self, what: str, gpu: str, error: OSError) -> GPUNoPermissionError:
        reason = error.strerror or str(error) or type(error).__name__
        if isinstance(error, PermissionError):
            fix = "ask for access to its socket (zeusd's --socket-permissions / --socket-gid)"
        else:
            fix = f"start zeusd, or point {SOCK_ENV} / {HOST_PORT_ENV} at it"
        return GPUNoPermissionError(
            f"{what} on {gpu}: cannot reach {self._where()} ({reason}); {fix}. Measuring still works."
        )

    def _call(self, what: str, gpu: str, method: str, path: str, params: dict[str, Any] | None = None) -> Any:
        try:
            status, body = self.request(method, path, params)
        except OSError as e:
            raise self._unreachable(what, gpu, e) from None
        if status == 200:
            return body
        raise self._http_error(what, gpu, status, body)

    def _http_error(self, what: str, gpu: str, status: int, body: Any) -> GPUError:
        import http.client

        detail = _message(body) or http.client.responses.get(status, "")
        head = f"{what} on {gpu} through {self._where()}: HTTP {status} ({detail})"
        if status == 401:
            fix = (
                f"set {TOKEN_ENV} to a token zeusd issued with the gpu-control scope (`zeusd token issue --scope gpu-control`)"
                if not self._token
                else f"{TOKEN_ENV} was refused: ask for a valid token with the gpu-control scope"
            )
            return GPUNoPermissionError(f"{head}; {fix}. Measuring still works.")
        if status == 403:
            fix = (
                f"set {TOKEN_ENV} to a token with the gpu-control scope"
                if "scope" in detail.lower()
                else "zeusd itself may not change the GPU: run it as root (with CAP_SYS_ADMIN)"
            )
            return GPUNoPermissionError(f"{head}; {fix}. Measuring still works.")
        if status == 404:
            fix = (
                "start zeusd with GPU control enabled (`zeusd serve --enable gpu-control,...`)"
                if "group" in detail.lower()
                else "this zeusd lacks the endpoint (zeusd before 0.4 speaks another API): upgrade zeusd"
            )
            return GPUNoPermissionError(f"{head}; {fix}. Measuring still works.")
        lowered = detail.lower().replace(" ", "")
        if "notsupported" in lowered:
            return GPUNotSupportedError(f"{head}: not supported on this GPU or driver.")
        if "gpuislost" in lowered or "gpulost" in lowered:
            return GPULostError(f"{head}: the GPU is lost; check `nvidia-smi` and the kernel log.")
        if status == 400:
            return GPUError(
                f"{head}; zeusd took the request as invalid: check that it serves this node's GPUs."
            )
        return GPUError(f"{head}; zeusd failed: see its log (e.g. `journalctl -u zeusd`).")

    # -- discovery ----------------------------------------------------------------------------------
    def discover(self, what: str = "Asking zeusd for its GPUs", gpu: str = "this node") -> Discovery:
        """`GET /discover`, asked once per client (a failure is not remembered: the daemon may come up)."""
        with self._lock:
            if self._discovery is not None:
                return self._discovery
        body = self._call(what, gpu, "GET", "/discover")
        try:
            gpus = tuple(
                ZeusdGPU(int(g["id"]), str(g.get("name", "")), g.get("pci_address")) for g in body["gpus"]
            )
            found = Discovery(
                gpus, frozenset(body.get("enabled_api_groups", ())), bool(body.get("auth_required"))
            )
        except (TypeError, KeyError, ValueError):
            raise GPUError(
                f"{what}: {self._where()} answered /discover with {str(body)[:200]!r}, not zeusd's discovery "
                f"document; check that {SOCK_ENV} / {HOST_PORT_ENV} points at zeusd."
            ) from None
        with self._lock:
            self._discovery = found
        return found

    def whoami(self) -> tuple[int, Any]:
        """(status, body) of `GET /auth/whoami`: 200 with the token's `sub` and `scopes`; 404 without auth.

        Raises:
            OSError: the daemon cannot be reached.
        """
        return self.request("GET", "/auth/whoami")

    def gpu_id(self, gpu: GPU, what: str = "Finding the GPU on zeusd") -> int:
        """zeusd's index of `gpu`: matched by PCI address (the daemon numbers every GPU of the node, which a
        container's NVML may not), else by NVML index with the same name (daemons that give no address).

        Raises:
            GPUNoPermissionError: the daemon is unreachable, has no GPU control, or wants a token not given.
            GPUError: the daemon does not serve this GPU.
        """
        with self._lock:
            if gpu.uuid in self._ids:
                return self._ids[gpu.uuid]
        found = self.discover(what, gpu.label)
        if _CONTROL not in found.enabled_api_groups:
            raise GPUNoPermissionError(
                f"{what} on {gpu.label}: {self._where()} does not enable GPU control (its groups: "
                f"{', '.join(sorted(found.enabled_api_groups)) or 'none'}); start it with `--enable gpu-control,...`. "
                "Measuring still works."
            )
        if found.auth_required and not self._token:
            raise GPUNoPermissionError(
                f"{what} on {gpu.label}: {self._where()} requires a token; set {TOKEN_ENV} to one issued with "
                "the gpu-control scope (`zeusd token issue --scope gpu-control`). Measuring still works."
            )
        key = _gpu_pci_key(gpu)
        addressed = [g for g in found.gpus if g.pci_address]
        if addressed and key is not None:
            match = [g for g in addressed if _pci_key(g.pci_address or "") == key]
        else:
            match = [g for g in found.gpus if g.id == gpu.nvml_index and g.name == gpu.name]
        if len(match) != 1:
            listed = (
                ", ".join(f"{g.id}: {g.name} {g.pci_address or ''}".strip() for g in found.gpus) or "none"
            )
            raise GPUError(
                f"{what}: {self._where()} does not serve {gpu.label} (NVML index {gpu.nvml_index}); it serves "
                f"[{listed}]. Point {SOCK_ENV} / {HOST_PORT_ENV} at the zeusd of this node."
            )
        with self._lock:
            self._ids[gpu.uuid] = match[0].id
        return match[0].id

    # -- setters (the device layer's route interface) -------------------------------------------------
    def may_change(self, gpu: GPU) -> bool:
        """True: zeusd changes settings for this process (a refusal is reported by the first change)."""
        return True

    def _post(self, gpu: GPU, what: str, path: str, **params: Any) -> None:
        index = self.gpu_id(gpu, what)
        # A backend that models work at synchronisation settles it first, as a change made in-process does.
        gpu.backend.settle(gpu.handle)
        query = {"gpu_ids": str(index), **{k: _param(v) for k, v in params.items()}, "block": "true"}
        self._call(what, gpu.label, "POST", path, query)

    def set_power_limit_mw(self, gpu: GPU, value_mw: int, what: str = "Setting the power limit") -> None:
        """`POST /gpu/set_power_limit` (mW)."""
        self._post(gpu, what, "/gpu/set_power_limit", power_limit_mw=int(value_mw))

    def lock_sm_clocks(self, gpu: GPU, min_mhz: int, max_mhz: int, what: str = "Locking SM clocks") -> None:
        """`POST /gpu/set_gpu_locked_clocks` (MHz)."""
        self._post(
            gpu, what, "/gpu/set_gpu_locked_clocks", min_clock_mhz=int(min_mhz), max_clock_mhz=int(max_mhz)
        )

    def reset_sm_clocks(self, gpu: GPU, what: str = "Resetting SM clocks") -> None:
        """`POST /gpu/reset_gpu_locked_clocks`."""
        self._post(gpu, what, "/gpu/reset_gpu_locked_clocks")

    def set_persistence_mode(self, gpu: GPU, enabled: bool, what: str = "Setting persistence mode") -> None:
        """`POST /gpu/set_persistence_mode`."""
        self._post(gpu, what, "/gpu/set_persistence_mode", enabled=bool(enabled))


def _param(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _message(body: Any) -> str:
    """zeusd's error text: `{"error": msg}`, per-device `{"errors": {"0": msg}}`, or plain text."""
    if isinstance(body, dict):
        if isinstance(body.get("error"), str):
            return body["error"]
        errors = body.get("errors")
        if isinstance(errors, dict):
            return "; ".join(f"GPU {k}: {v}" for k, v in errors.items())
        return json.dumps(body)[:300]
    return "" if body is None else str(body)[:300]


_clients: dict[tuple[str, str | None], ZeusdClient] = {}
_clients_lock = threading.Lock()


def client_for(endpoint: ZeusdEndpoint, token: str | None = None) -> ZeusdClient:
    """The process's client of `endpoint` with `token` (one per pair, so discovery is asked once)."""
    key = (str(endpoint), token or None)
    with _clients_lock:
        if key not in _clients:
            _clients[key] = ZeusdClient(endpoint, token)
        return _clients[key]


def forget_clients() -> None:
    """Ask every daemon again (after the GPU set changed)."""
    with _clients_lock:
        _clients.clear()


def status(endpoint: ZeusdEndpoint, token: str | None, gpus: list[GPU]) -> dict[str, Any]:
    """A read-only report of the daemon for `zeus-callbacks doctor`: reachable, groups, token, GPU mapping."""
    client = ZeusdClient(endpoint, token)
    out: dict[str, Any] = {
        "endpoint": str(endpoint),
        "reachable": False,
        "gpu_control": None,
        "auth_required": None,
        "token": client.has_token,
        "scopes": None,
        "gpu_ids": {},
        "problem": None,
    }
    try:
        found = client.discover()
    except GPUError as e:
        out["problem"] = str(e)
        return out
    out.update(
        reachable=True, gpu_control=_CONTROL in found.enabled_api_groups, auth_required=found.auth_required
    )
    problems: list[str] = []
    if found.auth_required and client.has_token:
        with contextlib.suppress(OSError):
            code, body = client.whoami()
            if code == 200 and isinstance(body, dict):
                out["scopes"] = sorted(body.get("scopes", []))
                if _CONTROL not in out["scopes"]:
                    problems.append(f"the token's scopes {out['scopes']} lack gpu-control")
            else:
                problems.append(
                    f"the token was refused (HTTP {code}: {_message(body)}); set a valid {TOKEN_ENV}"
                )
    for gpu in gpus:
        try:
            out["gpu_ids"][gpu.index] = client.gpu_id(gpu)
        except GPUError as e:
            problems.append(str(e))
            break
    out["problem"] = "; ".join(problems) or None
    return out
