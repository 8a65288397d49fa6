"""Zeus's daemon `zeusd`: the HTTP client through which a process without CAP_SYS_ADMIN changes GPU settings.

`zeusd` runs as root on the node and changes power limits, locked clocks and persistence mode on behalf
of unprivileged processes. It is found as Zeus finds it: `ZEUSD_SOCK_PATH` (a Unix domain socket; tried
first) or `ZEUSD_HOST_PORT` (`host:port` over TCP), with an optional JWT in `ZEUSD_TOKEN` sent as a
bearer token. Every released API generation is spoken (zeusd 0.4, 0.5, and master after 0.5, as read from
zeusd's source; see `zeusd_api`): `POST /gpu/set_power_limit?gpu_ids=I&power_limit_mw=MW&block=true` and
its siblings for clocks and persistence, every parameter in the query string, `block=true` so that errors
are reported; `GET /discover` gives the generation, the daemon's GPUs and its enabled API groups;
`GET /auth/whoami` the token's scopes. Reads stay on the vendor library in this process: only the setters go
through here. AMD GPUs need zeusd master, whose AMD backend serves the same routes but unlocks clocks only
through `reset_locked_clocks` (`zeusd_api.reset_clocks_path`) and has no persistence mode.

zeusd queues each GPU's commands and runs every one, even after its caller has gone
(`zeusd/src/devices/gpu/mod.rs`): a change that got no answer in time may still be applied, so it is not
a refusal. Its journal entry stays, marked unconfirmed, and every restore sends the original back.

Only the standard library is used (`http.client`, with a connection class for Unix sockets).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import urllib.parse
from typing import TYPE_CHECKING, Any

from zeus_callbacks.core.device.errors import (
    GPUError,
    GPULostError,
    GPUNoPermissionError,
    GPUNotSupportedError,
    InvalidInputError,
)
from zeus_callbacks.core.device.zeusd_api import (
    Answer,
    Discovery,
    MappingRefused,
    Match,
    ZeusdGPU,
    classify,
    cuda_visible_devices,
    match_gpu,
    parse_discovery,
    pci_key,
    reset_clocks_path,
)
from zeus_callbacks.core.device.zeusd_endpoint import (
    HOST_PORT_ENV,
    SOCK_ENV,
    TIMEOUT_ENV,
    TOKEN_ENV,
    ZeusdEndpoint,
    timeout_s,
)

if TYPE_CHECKING:
    from zeus_callbacks.core.device.gpus import GPU

__all__ = [
    "SOCK_ENV",
    "HOST_PORT_ENV",
    "TOKEN_ENV",
    "ZeusdEndpoint",
    "ZeusdClient",
    "ZeusdGPU",
    "ZeusdNoAnswerError",
    "Discovery",
    "TIMEOUT_ENV",
    "timeout_s",
    "client_for",
    "forget_clients",
]

logger = logging.getLogger(__name__)

_CONTROL = "gpu-control"
NOT_ZEUSD = f"check that {SOCK_ENV} / {HOST_PORT_ENV} points at zeusd"


def _gpu_pci_key(gpu: GPU) -> tuple[int, int, int] | None:
    try:
        return pci_key(gpu.device.pci_bus_id())
    except GPUError:
        return None


def _node_names(gpu: GPU) -> list[str]:
    """The names of every GPU this job's vendor library sees, in its order (what zeusd's indices are compared
    with)."""
    return gpu.backend.node_gpu_names()


class ZeusdNoAnswerError(GPUError):
    """A change was sent to zeusd but no answer came in time: it may still be applied (zeusd runs every
    queued command), so it stays journaled and is undone by the restore."""


# What each write route changes: the journal entry a timed-out write marks unconfirmed.
_KNOB_OF = {
    "/gpu/set_power_limit": "power_limit",
    "/gpu/set_gpu_locked_clocks": "sm_clocks",
    "/gpu/reset_gpu_locked_clocks": "sm_clocks",
    "/gpu/reset_locked_clocks": "sm_clocks",
    "/gpu/set_persistence_mode": "persistence",
}


class _NoAnswer(OSError):
    """The request was sent, but the answer did not come (timeout, or the connection dropped)."""


def _checked_token(token: str | None) -> str | None:
    """`ZEUSD_TOKEN` without surrounding whitespace (a file's newline); None when empty.

    Raises:
        InvalidInputError: it holds a space, a line break or a character an HTTP header cannot carry.
    """
    text = (token or "").strip()
    if any(not 0x21 <= ord(c) <= 0x7E for c in text):
        raise InvalidInputError(
            f"{TOKEN_ENV} holds a space, line break or non-ASCII character: set it to the token alone (what "
            "`zeusd token issue` printed), or unset it."
        )
    return text or None


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
        self._token = _checked_token(token)
        self._discovery: Discovery | None = None
        self._ids: dict[str, Match] = {}  # GPU UUID -> zeusd's index and how it was found
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ZeusdClient({str(self.endpoint)!r}, token={'set' if self._token else 'none'})"

    @property
    def has_token(self) -> bool:
        """Whether a bearer token is sent."""
        return self._token is not None

    # -- HTTP ---------------------------------------------------------------------------------------
    def request(self, method: str, path: str, params: dict[str, Any] | None = None) -> tuple[int, Any]:
        """(HTTP status, decoded JSON body, or the text of a `text/plain` one, or None) of one request.

        Raises:
            OSError: the daemon cannot be reached (refused, no socket, ...); `_NoAnswer` (an OSError) when
                the request was sent but no answer came.
        """
        import http.client

        query = urllib.parse.urlencode(params or {})
        headers = {"Content-Length": "0"} if method == "POST" else {}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        conn = self.endpoint.connection(timeout_s())
        try:
            conn.connect()  # unreachable: nothing was sent
            try:
                conn.request(method, f"{path}?{query}" if query else path, headers=headers)
                response = conn.getresponse()
                raw = response.read().decode("utf-8", "replace")
            except (OSError, http.client.HTTPException) as e:
                if isinstance(e, http.client.RemoteDisconnected):
                    reason = "it closed the connection without answering"
                elif isinstance(e, http.client.BadStatusLine):
                    reason = f"not an HTTP answer: {ascii(str(e))[:60]}"
                else:
                    reason = str(e) or type(e).__name__
                raise _NoAnswer(getattr(e, "errno", None), reason) from None
        finally:
            conn.close()
        kind = (response.getheader("Content-Type") or "").split(";")[0].strip()
        if kind == "application/json" and raw.strip():
            try:
                return response.status, json.loads(raw)
            except ValueError:
                pass
        return response.status, raw.strip() or None

    def _where(self) -> str:
        return f"zeusd at {self.endpoint}"

    def _unreachable(self, what: str, gpu: str, error: OSError) -> GPUError:
        reason = error.strerror or str(error) or type(error).__name__
        if isinstance(error, _NoAnswer) and reason.startswith(("not an HTTP", "it closed")):
            return ZeusdNoAnswerError(
                f"{what} on {gpu}: {self._where()} gave no usable answer ({reason}); {NOT_ZEUSD}. If it is zeusd, "
                "the change may still be applied: it stays journaled and is undone at the end (or by "
                "`zeus-callbacks restore`)."
            )
        if isinstance(error, _NoAnswer):
            return ZeusdNoAnswerError(
                f"{what} on {gpu}: {self._where()} gave no answer within {timeout_s():g} s ({reason}); zeusd "
                "runs queued commands even after the caller left, so the change may still be applied: it stays "
                f"journaled and is undone at the end (or by `zeus-callbacks restore`). Set {TIMEOUT_ENV} higher "
                "for a slow daemon."
            )
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
        raise self._http_error(what, gpu, classify(status, body))

    def _http_error(self, what: str, gpu: str, answer: Answer) -> GPUError:
        import http.client

        detail = answer.text or http.client.responses.get(answer.status, "")
        head = f"{what} on {gpu} through {self._where()}: HTTP {answer.status} ({detail})"
        still = "Measuring still works."
        kind = answer.kind
        if kind == "auth":
            fix = (
                f"set {TOKEN_ENV} to a token zeusd issued with the gpu-control scope (`zeusd token issue --scope gpu-control`)"
                if not self._token
                else f"{TOKEN_ENV} was refused: ask for a valid token with the gpu-control scope"
            )
            return GPUNoPermissionError(f"{head}; {fix}. {still}")
        if kind == "scope":
            return GPUNoPermissionError(
                f"{head}; set {TOKEN_ENV} to a token with the gpu-control scope. {still}"
            )
        if kind == "no_permission":
            return GPUNoPermissionError(
                f"{head}; zeusd itself may not change the GPU: run it as root (with CAP_SYS_ADMIN). {still}"
            )
        if kind == "group_disabled":
            return GPUNoPermissionError(
                f"{head}; start zeusd with GPU control enabled (`zeusd serve --enable gpu-control,...`). {still}"
            )
        if kind == "no_endpoint":
            return GPUNoPermissionError(
                f"{head}; this zeusd lacks the endpoint (zeusd before 0.4 speaks another API): upgrade zeusd. {still}"
            )
        if kind == "not_supported":
            return GPUNotSupportedError(f"{head}: not supported on this GPU or driver.")
        if kind == "gpu_lost":
            return GPULostError(
                f"{head}: the GPU is lost; check `nvidia-smi` (AMD: `amd-smi list`) and the kernel log."
            )
        if kind == "invalid_arg":
            return GPUError(
                f"{head}; the GPU library on zeusd's side refused the value: check the GPU's supported range."
            )
        if kind == "unknown_gpu":
            return GPUError(
                f"{head}; zeusd does not have that GPU: point {SOCK_ENV} / {HOST_PORT_ENV} at this node's."
            )
        if kind == "bad_query":
            return GPUError(
                f"{head}; zeusd refused the request: this client and the daemon disagree on its API."
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
            found = parse_discovery(body)
        except ValueError:
            raise GPUError(
                f"{what}: {self._where()} answered /discover with {str(body)[:200]!r}, not the discovery "
                f"document of zeusd 0.4 or later; {NOT_ZEUSD}."
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

    def match(self, gpu: GPU, what: str = "Finding the GPU on zeusd") -> Match:
        """zeusd's index of `gpu` and how it was found (`zeusd_api.match_gpu`: by PCI address, else by the vendor
        library's index only where this job provably sees the node as zeusd does). AMD GPUs need master.

        Raises:
            GPUNoPermissionError: the daemon is unreachable, has no GPU control, or wants a token not given.
            GPUError: the GPU cannot be matched safely (the message says what to do).
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
        if gpu.vendor == "amd" and found.generation != "master":
            raise GPUNoPermissionError(
                f"{what} on {gpu.label} through {self._where()}: {found.describe} has no AMD backend (zeusd 0.4 "
                "and 0.5 drive NVML only): run zeusd master, built with its default `amdsmi` feature, or run as "
                "root with ZEUS_CALLBACKS_SETTERS=direct. Measuring still works."
            )
        library = gpu.backend.library
        try:
            hit = match_gpu(
                found,
                pci=_gpu_pci_key(gpu),
                nvml_index=gpu.vendor_index,
                node_names=_node_names(gpu),
                cuda_visible=cuda_visible_devices(),
                library=library,
            )
        except MappingRefused as e:
            raise GPUError(
                f"{what} on {gpu.label} ({library} index {gpu.vendor_index}) through {self._where()}: {e}."
            ) from None
        with self._lock:
            self._ids[gpu.uuid] = hit
        return hit

    def gpu_id(self, gpu: GPU, what: str = "Finding the GPU on zeusd") -> int:
        """zeusd's index of `gpu` (see `match`)."""
        return self.match(gpu, what).zeusd_id

    # -- setters (the device layer's route interface) -------------------------------------------------
    def may_change(self, gpu: GPU) -> bool:
        """True: zeusd changes settings for this process (a refusal is reported by the first change)."""
        return True

    def _post(self, gpu: GPU, what: str, path: str, **params: Any) -> None:
        index = self.gpu_id(gpu, what)
        # A backend that models work at synchronisation settles it first, as a change made in-process does.
        gpu.backend.settle(gpu.device)
        query = {"gpu_ids": str(index), **{k: _param(v) for k, v in params.items()}, "block": "true"}
        try:
            self._call(what, gpu.label, "POST", path, query)
        except ZeusdNoAnswerError:
            _mark_unconfirmed(gpu, _KNOB_OF[path])
            raise

    def set_power_limit_mw(self, gpu: GPU, value_mw: int, what: str = "Setting the power limit") -> None:
        """`POST /gpu/set_power_limit` (mW): the GPU's own limit (zeusd sets no module limit)."""
        if gpu.power_limit_scope == "module":
            raise GPUNotSupportedError(
                f"{what} on {gpu.label}: its power limit is its module's (the GPU's own is N/A), which zeusd "
                "cannot set; set ZEUS_CALLBACKS_SETTERS=direct to change it through NVML in this process."
            )
        self._post(gpu, what, "/gpu/set_power_limit", power_limit_mw=int(value_mw))

    def lock_sm_clocks(self, gpu: GPU, min_mhz: int, max_mhz: int, what: str = "Locking SM clocks") -> None:
        """`POST /gpu/set_gpu_locked_clocks` (MHz)."""
        self._post(
            gpu, what, "/gpu/set_gpu_locked_clocks", min_clock_mhz=int(min_mhz), max_clock_mhz=int(max_mhz)
        )

    def reset_sm_clocks(self, gpu: GPU, what: str = "Resetting SM clocks") -> None:
        """`POST /gpu/reset_gpu_locked_clocks`; on AMD `POST /gpu/reset_locked_clocks` (zeusd master refuses
        the other there: every AMD clock domain is reset at once, as the in-process reset does)."""
        self._post(gpu, what, reset_clocks_path(gpu.vendor))

    def set_persistence_mode(self, gpu: GPU, enabled: bool, what: str = "Setting persistence mode") -> None:
        """`POST /gpu/set_persistence_mode` (refused here for AMD GPUs, which have no such mode: zeusd master
        answers 400, `devices/gpu/amdsmi/mod.rs` 968-972)."""
        if gpu.vendor == "amd":
            raise GPUNotSupportedError(f"{what} on {gpu.label}: AMD GPUs have no persistence mode.")
        self._post(gpu, what, "/gpu/set_persistence_mode", enabled=bool(enabled))


def _mark_unconfirmed(gpu: GPU, knob: str) -> None:
    """Mark the journal entry of `knob` on `gpu` as possibly applied, so that every restore sends it back."""
    from zeus_callbacks.core.device import (
        state_guard,
    )  # here: the guard imports the setters, which import this

    state_guard.guard().mark_unconfirmed(gpu, knob)


def _param(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


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
    """A read-only report of the daemon for `zeus-callbacks doctor`: reachable, API generation, groups,
    token, and each GPU's zeusd index with how it was matched."""
    client = ZeusdClient(endpoint, token)
    out: dict[str, Any] = {
        "endpoint": str(endpoint),
        "reachable": False,
        "generation": None,
        "api": None,
        "gpu_control": None,
        "auth_required": None,
        "token": client.has_token,
        "scopes": None,
        "gpu_ids": {},
        "mapping": {},
        "problem": None,
    }
    try:
        found = client.discover()
    except ZeusdNoAnswerError as e:
        out.update(reachable=True, problem=str(e))
        return out
    except GPUNoPermissionError as e:
        out["problem"] = str(e)
        return out
    except GPUError as e:
        out.update(reachable=True, problem=str(e))
        return out
    out.update(
        reachable=True,
        generation=found.generation,
        api=found.describe,
        gpu_control=_CONTROL in found.enabled_api_groups,
        auth_required=found.auth_required,
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
                    f"the token was refused (HTTP {code}: {classify(code, body).text}); set a valid {TOKEN_ENV}"
                )
    for gpu in gpus:
        try:
            hit = client.match(gpu)
        except GPUError as e:
            problems.append(str(e))
            break
        out["gpu_ids"][gpu.index] = hit.zeusd_id
        out["mapping"][gpu.index] = hit.how
    out["problem"] = "; ".join(problems) or None
    return out
