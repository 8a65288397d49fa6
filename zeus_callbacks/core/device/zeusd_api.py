"""zeusd's HTTP API as released: its generations, `/discover` per generation, the GPU mapping, its error answers.

Read from zeusd's Rust source (ml-energy/zeus, `zeusd/src/`) at the tags `zeusd-v0.4.0`, `zeusd-v0.5.0`
and at master (still `version = "0.5.0"` in its Cargo.toml, but with more fields), not from its documents:

- `routes/server.rs` `DiscoveryInfo`: 0.4 lists `gpu_ids` (numbers only), `cpu_ids`, `dram_available`; 0.5
  lists `gpus: [{id, name}]` and `cpus: [{id, dram_available}]`; master adds `pci_address`
  (`{:04x}:{:02x}:{:02x}.0`, `devices/gpu/nvml.rs`) and `cumulative_energy_available` to each GPU. Every
  generation has `enabled_api_groups` and `auth_required`.
- `error.rs`: an NVML failure is `NVML error: <nvml-wrapper's Display text>`. From 0.5 a write answers the
  worst per-GPU status (`aggregate_error_response`: 403 NoPermission, 400 InvalidArg and NotSupported, 500
  the rest); 0.4 answers every per-GPU failure with 500. Both as `{"errors": {"<id>": text}}` (JSON).
- `routes/gpu.rs`: an index the daemon does not have is `ZeusdError::GpuNotFoundError`, which actix answers
  400 `text/plain` ("GPU index 3 does not exist."), before any command runs; a malformed query is actix's
  `QueryPayloadError` (400 `text/plain`, "Query deserialize error: ...").
- `auth.rs`: 401 and 403 (a missing scope) and 404 (a disabled API group) as `{"error": text}`.

zeusd numbers GPUs as NVML does on the daemon's side: all of the node's, in PCI bus order. A job's NVML may
see fewer (a container, a cgroup), so an index is only meaningful where both provably see the same GPUs.

AMD GPUs: only master has an AMD backend (`devices/gpu/amdsmi/mod.rs`, "amdsmi" below; 0.4 and 0.5 hold
`nvml.rs` alone), behind the same routes; `startup.rs` `resolve_gpu_backend` (177-253) serves whichever
backend reports GPUs. It numbers them in amdsmi's order, every socket's processors in turn (`enumerate_gpus`,
amdsmi 567-574; `init`, 630-636), which is amdsmi's Python `amdsmi_get_processor_handles` order, not HIP's; its
`/discover` gives each `pci_address` as `{:04x}:{:02x}:{:02x}.{:x}` (`amdsmi/ffi.rs` 148-156, `startup.rs`
157-158), so GPUs are matched by PCI address. Its rules: `set_power_limit` takes mW and sets the socket's cap
(`amdsmi_set_power_cap(h, 0, mW * 1000)`, amdsmi 980-987); `set_gpu_locked_clocks` takes MHz and writes the
graphics clock's two ends (`amdsmi_set_gpu_clk_limit`, 1001-1007, 766-859); `reset_gpu_locked_clocks` is refused
("AMD GPUs cannot reset a single clock domain; use reset_locked_clocks", 1009-1014): `reset_locked_clocks`
(routes/gpu.rs 163) sets the performance level to AUTO for every domain (1034-1044), as the in-process reset
does; persistence mode is refused (968-978). Its errors (`error.rs` 30-40, 71, 80-86): `Invalid request: <text>`
(400) and `AMDSMI error <status>: <text>` (403 NO_PERM 10, 400 INVAL 1 and NOT_SUPPORTED 2, else 500).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GENERATIONS",
    "ZeusdGPU",
    "Discovery",
    "parse_discovery",
    "pci_key",
    "Match",
    "MappingRefused",
    "match_gpu",
    "Answer",
    "classify",
    "reset_clocks_path",
]

# "master" is zeusd after its 0.5.0 release (its Cargo.toml still says 0.5.0): the first with PCI addresses.
GENERATIONS = ("0.4", "0.5", "master")

# nvml-wrapper's `NvmlError` Display texts (Cldfire/nvml-wrapper, `nvml-wrapper/src/error.rs`), as zeusd
# sends them after "NVML error: " (sic "inacessible").
WRAPPER_NOT_SUPPORTED = "the requested operation is not available on the target device"
WRAPPER_INVALID_ARG = "a supplied argument was invalid"
WRAPPER_NO_PERMISSION = "the current user does not have permission to perform this operation"
WRAPPER_GPU_LOST = "device fell off the bus or has otherwise become inacessible"
WRAPPER_RESET_REQUIRED = "device requires a reset before it can be used again"
# `error.rs` from 0.5: what a platform without persistence mode answers (400).
PERSISTENCE_CANNOT_BE_DISABLED = "Persistence mode cannot be disabled on this platform."
# master's AMD errors (`error.rs` 36-37; statuses from `amdsmi/ffi.rs` 10-17 and amdsmi's `amdsmi_status_t`).
AMDSMI_ERROR = "amdsmi error "
AMDSMI_KINDS = {
    10: "no_permission",
    1: "invalid_arg",
    2: "not_supported",
    3: "not_supported",
    55: "not_supported",
}
AMDSMI_LOST = (31, 14, 54)  # NOT_FOUND, FILE_ERROR, AMDGPU_RESTART_ERR: the device does not answer
# master's AMD refusals (`Invalid request: ...`, amdsmi 968-978 and 1009-1029): the route does not apply to AMD.
AMD_REFUSALS = ("not supported on amd gpus", "cannot reset a single clock domain")


def reset_clocks_path(vendor: str) -> str:
    """The route that unlocks a GPU's clocks: `reset_gpu_locked_clocks` (NVML's graphics clock alone), but on AMD
    `reset_locked_clocks`, zeusd master's only clock reset for AMD (amdsmi 1009-1014 refuses the other)."""
    return "/gpu/reset_locked_clocks" if vendor == "amd" else "/gpu/reset_gpu_locked_clocks"


@dataclass(frozen=True)
class ZeusdGPU:
    """A GPU as `GET /discover` lists it; `name` from 0.5, `pci_address` and the energy flag after 0.5."""

    id: int
    name: str | None = None
    pci_address: str | None = None  # `0000:17:00.0`
    cumulative_energy_available: bool | None = None


@dataclass(frozen=True)
class Discovery:
    """What `GET /discover` says (it never needs a token) and which API generation says it."""

    generation: str  # one of GENERATIONS
    gpus: tuple[ZeusdGPU, ...]
    enabled_api_groups: frozenset[str]
    auth_required: bool

    @property
    def describe(self) -> str:
        """`zeusd 0.5 (GPU names, no PCI addresses)`: for messages and `doctor`."""
        return {
            "0.4": "zeusd 0.4 (GPU indices only)",
            "0.5": "zeusd 0.5 (GPU names, no PCI addresses)",
            "master": "zeusd after 0.5 (GPU PCI addresses; NVIDIA or AMD GPUs)",
        }[self.generation]


def parse_discovery(body: Any) -> Discovery:
    """The `Discovery` of a `/discover` body of any released generation.

    Raises:
        ValueError: not zeusd's discovery document.
    """
    if not isinstance(body, dict) or not isinstance(body.get("enabled_api_groups"), list):
        raise ValueError("no enabled_api_groups")
    groups = frozenset(str(g) for g in body["enabled_api_groups"])
    auth = body.get("auth_required")
    if not isinstance(auth, bool):
        raise ValueError("no auth_required")
    if "gpus" not in body and isinstance(body.get("gpu_ids"), list):  # 0.4
        ids = body["gpu_ids"]
        if not all(type(i) is int for i in ids):
            raise ValueError("gpu_ids are not numbers")
        return Discovery("0.4", tuple(ZeusdGPU(i) for i in ids), groups, auth)
    entries = body.get("gpus")
    if not isinstance(entries, list) or not all(
        isinstance(g, dict) and type(g.get("id")) is int for g in entries
    ):
        raise ValueError("no gpus list")
    gpus = tuple(
        ZeusdGPU(
            g["id"],
            str(g["name"]) if g.get("name") is not None else None,
            str(g["pci_address"]) if g.get("pci_address") else None,
            g.get("cumulative_energy_available"),
        )
        for g in entries
    )
    generation = "master" if any(g.pci_address for g in gpus) else "0.5"
    return Discovery(generation, gpus, groups, auth)


def pci_key(address: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of `0000:17:00.0` or NVML's `00000000:17:00.0`; None if malformed.

    The function is left out: zeusd writes `.0` for every NVIDIA GPU (`devices/gpu/nvml.rs`, `pci_address`), and
    amdsmi's own function for an AMD one (`devices/gpu/amdsmi/ffi.rs` 148-156).
    """
    try:
        domain, bus, rest = address.strip().split(":")
        device, _function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16)
    except ValueError:
        return None


@dataclass(frozen=True)
class Match:
    """zeusd's index of one GPU and how it was found (said by `doctor`)."""

    zeusd_id: int
    how: str  # "PCI address 0000:17:00.0" | "NVML index 1 (same N GPUs, same names)" | ...


class MappingRefused(Exception):  # noqa: N818 - a refusal, raised to be turned into a GPUError
    """The GPU cannot be matched to zeusd's safely; the message says why and what to do."""


def _visible_subset(cuda_visible: str | None, node_count: int) -> bool:
    if cuda_visible is None:
        return False
    entries = [e for e in cuda_visible.split(",") if e.strip()]
    return len(set(entries)) < node_count


def match_gpu(
    found: Discovery,
    *,
    pci: tuple[int, int, int] | None,
    nvml_index: int,
    node_names: list[str],
    cuda_visible: str | None = None,
    library: str = "NVML",
) -> Match:
    """zeusd's index of the GPU at index `nvml_index` of this job's `library` (NVML or amdsmi), which sees
    `node_names`.

    By PCI address where zeusd gives them. Otherwise by NVML index, only where this job provably sees the
    node as zeusd does: as many GPUs, with the same names in the same order (0.5; 0.4 gives no names), and
    no `CUDA_VISIBLE_DEVICES` naming a subset (a job given part of a node).

    Raises:
        MappingRefused: no safe match; the message ends with what to do.
    """
    addressed = [g for g in found.gpus if g.pci_address]
    if addressed:
        if pci is None:
            raise MappingRefused(f"this job's {library} gives no PCI address for it; check the driver")
        hits = [g for g in addressed if pci_key(g.pci_address or "") == pci]
        if len(hits) != 1:
            listed = ", ".join(f"{g.id}: {g.pci_address}" for g in addressed)
            raise MappingRefused(
                f"zeusd serves no GPU at PCI address {pci[0]:04x}:{pci[1]:02x}:{pci[2]:02x}.0 (it serves "
                f"{listed}): point ZEUSD_SOCK_PATH / ZEUSD_HOST_PORT at the zeusd of this node"
            )
        return Match(hits[0].id, f"PCI address {hits[0].pci_address}")
    upgrade = f"{found.describe} gives no PCI addresses to match GPUs by"
    fix = (
        "upgrade zeusd to a build that reports PCI addresses (after 0.5), or run the job with every GPU of "
        "the node visible in NVML order (CUDA_VISIBLE_DEVICES unset or 0,1,...,N-1) and choose GPUs with "
        "gpu_indices"
    )
    ids = sorted(g.id for g in found.gpus)
    if len(node_names) != len(found.gpus) or ids != list(range(len(ids))):
        raise MappingRefused(
            f"{upgrade}, and this job sees {len(node_names)} GPU(s) where zeusd serves {len(found.gpus)}, so "
            f"{library} index {nvml_index} may be another GPU on zeusd's side: {fix}"
        )
    if _visible_subset(cuda_visible, len(node_names)):
        raise MappingRefused(
            f"{upgrade}, and CUDA_VISIBLE_DEVICES={cuda_visible!r} gives this job part of the node, so its "
            f"{library} view cannot be proven to be zeusd's: {fix}"
        )
    theirs = {g.id: g.name for g in found.gpus}
    if any(theirs[i] is not None and theirs[i] != name for i, name in enumerate(node_names)):
        order = ", ".join(f"{g.id}: {g.name}" for g in sorted(found.gpus, key=lambda g: g.id))
        raise MappingRefused(
            f"{upgrade}, and its GPUs [{order}] are not this job's {library} GPUs {node_names} in the same order: "
            f"{fix}"
        )
    same = "same names" if found.generation != "0.4" else "zeusd 0.4 gives no names"
    return Match(nvml_index, f"{library} index {nvml_index} (the same {len(node_names)} GPU(s), {same})")


@dataclass(frozen=True)
class Answer:
    """One error answer of zeusd, classified: `kind` (below) and zeusd's own text."""

    status: int
    kind: str
    text: str


# Kinds: auth (401), scope (403 from auth.rs), group_disabled (404 from auth.rs), no_endpoint (404),
# bad_query (400 text/plain from actix), unknown_gpu (400 GpuNotFoundError), no_permission (NVML),
# not_supported (NVML, or persistence on a platform without it), invalid_arg (NVML), gpu_lost (NVML),
# failed (anything else).
def _texts(body: Any) -> str:
    """zeusd's error text: `{"error": msg}`, per-GPU `{"errors": {"0": msg}}`, or actix's plain text."""
    if isinstance(body, dict):
        if isinstance(body.get("error"), str):
            return body["error"]
        errors = body.get("errors")
        if isinstance(errors, dict):
            return "; ".join(f"GPU {k}: {v}" for k, v in sorted(errors.items()))
        return json.dumps(body)[:300]
    return "" if body is None else str(body).strip()[:300]


def _amd_kind(lowered: str) -> str | None:
    """The kind of master's AMD errors: `AMDSMI error <status>: ...` by status, `Invalid request: ...` refusals."""
    at = lowered.find(AMDSMI_ERROR)
    if at >= 0:
        digits = lowered[at + len(AMDSMI_ERROR) :].split(":", 1)[0].strip()
        status = int(digits) if digits.isdigit() else None
        return "gpu_lost" if status in AMDSMI_LOST else AMDSMI_KINDS.get(status or -1)
    if "invalid request: " in lowered and any(r in lowered for r in AMD_REFUSALS):
        return "not_supported"
    return None


def _wrapper_kind(text: str) -> str | None:
    lowered = text.lower()
    amd = _amd_kind(lowered)
    if amd is not None:
        return amd
    if WRAPPER_GPU_LOST in lowered or WRAPPER_RESET_REQUIRED in lowered:
        return "gpu_lost"
    if WRAPPER_NOT_SUPPORTED in lowered or PERSISTENCE_CANNOT_BE_DISABLED.lower() in lowered:
        return "not_supported"
    if WRAPPER_NO_PERMISSION in lowered:
        return "no_permission"
    if WRAPPER_INVALID_ARG in lowered:
        return "invalid_arg"
    return None


def classify(status: int, body: Any) -> Answer:
    """What an error answer means: by HTTP status first, by zeusd's texts second (see the module docstring).

    `body` is the decoded JSON or the plain text of the answer.
    """
    text = _texts(body)
    lowered = text.lower()
    library = _wrapper_kind(text)
    if status == 401:
        kind = "auth"
    elif status == 403:
        kind = "scope" if "lacks required scope" in lowered else "no_permission"
    elif status == 404:
        kind = "group_disabled" if "is not enabled on this server" in lowered else "no_endpoint"
    elif status == 400:
        if lowered.startswith("query deserialize error"):
            kind = "bad_query"
        elif "does not exist" in lowered or ("gpu" in lowered and "not found" in lowered):
            kind = "unknown_gpu"
        else:
            kind = library if library in ("not_supported", "invalid_arg") else "bad_query"
    elif status >= 500:
        # 0.4 answers every per-GPU failure with 500: its text says which.
        kind = library or "failed"
    else:
        kind = "failed"
    return Answer(status, kind, text)


def cuda_visible_devices() -> str | None:
    """`CUDA_VISIBLE_DEVICES` as this job has it (None: unset)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")
