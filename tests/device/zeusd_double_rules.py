"""The rules of the zeusd test double that need no server: query parsing, `gpu_ids`, JWT checks, NVML texts.

Each rule names the zeusd source it mirrors (ml-energy/zeus, `zeusd/src/...`, at the tags `zeusd-v0.4.0`,
`zeusd-v0.5.0` and master) or the crate zeusd builds on (versions from zeusd's Cargo.lock at 0.4.0:
actix-web 4.9, serde_urlencoded 0.7, jsonwebtoken 9.3, nvml-wrapper 0.12). Written from that source, not
copied from it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import urllib.parse
from typing import Any

GENERATIONS = ("0.4", "0.5", "master")
# config.rs `ApiGroup` (serde kebab-case); the order of `--enable`'s default.
GROUPS = ("gpu-control", "gpu-read", "cpu-read")
# jsonwebtoken 9 `Validation::default()`: 60 s leeway on `exp`.
LEEWAY_S = 60


class Refusal(Exception):
    """An answer other than 200: status, body (a dict is sent as JSON, a str as text/plain)."""

    def __init__(self, status: int, body: Any = None) -> None:
        super().__init__(status, body)
        self.status, self.body = status, body


# -- query strings: actix `web::Query<T>` = serde_urlencoded + serde derive (`deny_unknown_fields`) -------------
def _rust_uint(text: str, bits: int) -> int:
    """Rust's `u32`/`usize::from_str`: an optional `+`, ASCII digits only (core::num error texts)."""
    digits = text[1:] if text.startswith("+") else text
    if not text:
        raise ValueError("cannot parse integer from empty string")
    if not digits or not all("0" <= c <= "9" for c in digits):
        raise ValueError("invalid digit found in string")
    value = int(digits)
    if value >= 1 << bits:
        raise ValueError("number too large to fit in target type")
    return value


def _expected(names: list[str]) -> str:
    # serde's `de::Error::unknown_field` wording.
    quoted = [f"`{n}`" for n in names]
    if not quoted:
        return "there are no fields"
    if len(quoted) == 1:
        return f"expected {quoted[0]}"
    if len(quoted) == 2:
        return f"expected {quoted[0]} or {quoted[1]}"
    return f"expected one of {', '.join(quoted)}"


def parse_query(query: str, fields: list[tuple[str, str, bool]]) -> dict[str, Any]:
    """The query as a struct of `fields` (name, "str"|"bool"|"u32", required), or `Refusal(400, text)`.

    actix-web 4 `web::Query` answers a `QueryPayloadError::Deserialize` 400 text/plain
    "Query deserialize error: <serde's message>"; serde derive reports an unknown field (with
    `deny_unknown_fields`, as every zeusd query struct has: `routes/gpu.rs`, `routes/cpu.rs`) or a repeated
    one at its key, a bad value at its value, a missing one at the end (the first in declaration order).
    """
    kinds = {name: kind for name, kind, _ in fields}
    out: dict[str, Any] = {}
    try:
        for key, raw in urllib.parse.parse_qsl(query, keep_blank_values=True):
            if key not in kinds:
                raise ValueError(f"unknown field `{key}`, {_expected([n for n, _, _ in fields])}")
            if key in out:
                raise ValueError(f"duplicate field `{key}`")
            if kinds[key] == "bool":  # serde_urlencoded's Part: `str::parse::<bool>`
                if raw not in ("true", "false"):
                    raise ValueError("provided string was not `true` or `false`")
                out[key] = raw == "true"
            elif kinds[key] == "u32":
                out[key] = _rust_uint(raw, 32)
            else:
                out[key] = raw
        for name, _, required in fields:
            if required and name not in out:
                raise ValueError(f"missing field `{name}`")
    except ValueError as e:
        raise Refusal(400, f"Query deserialize error: {e}") from None
    return out


def parse_ids(raw: str, generation: str, device: str = "GPU") -> list[int]:
    """The device indices of `gpu_ids` / `cpu_ids`."""
    param = f"{device.lower()}_ids"
    if generation == "0.4":
        # 0.4 `routes/gpu.rs` `parse_gpu_ids`: parts that do not parse are dropped; none left is a 400.
        ids = []
        for part in raw.split(","):
            try:
                ids.append(_rust_uint(part.strip(), 64))
            except ValueError:
                continue
        if not ids:
            raise Refusal(400, {"error": f"{param} must contain at least one {device} index"})
        return ids
    # 0.5 `routes/mod.rs` `parse_device_ids`: every part must parse; sorted and deduplicated.
    if not raw.strip():
        raise Refusal(400, {"error": f"{param} must contain at least one {device} index"})
    ids = []
    for part in raw.split(","):
        trimmed = part.strip()
        if not trimmed:
            raise Refusal(400, {"error": f"{param} contains an empty {device} index"})
        try:
            ids.append(_rust_uint(trimmed, 64))
        except ValueError:
            raise Refusal(400, {"error": f"Invalid {device} index: {trimmed}"}) from None
    return sorted(set(ids))


# -- tokens: auth.rs with jsonwebtoken 9 ---------------------------------------------------------------------
def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    if "=" in text or not all(c.isalnum() or c in "-_" for c in text):
        raise ValueError("Invalid symbol")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue_token(key: bytes, sub: str, scopes: list[str], exp: int | None = None, **extra: Any) -> str:
    """An HS256 JWT as `zeusd token issue` makes it (auth.rs `issue_token`: `sub`, `scopes`, `exp` only when
    the token expires); `extra` adds other claims (e.g. `aud`) to test the checks."""
    claims: dict[str, Any] = {"sub": sub, "scopes": scopes, **extra}
    if exp is not None:
        claims["exp"] = exp
    head = _b64(json.dumps({"typ": "JWT", "alg": "HS256"}).encode())
    body = _b64(json.dumps(claims).encode())
    sig = hmac.new(key, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(sig)}"


def _claims_error(claims: Any) -> str | None:
    """auth.rs `Claims`: `sub: String`, `scopes: Vec<ApiGroup>`, `exp: Option<usize>` (serde, JSON errors)."""
    if not isinstance(claims, dict):
        return "JSON error: invalid type: expected struct Claims"
    if not isinstance(claims.get("sub"), str):
        return (
            "JSON error: missing field `sub`" if "sub" not in claims else "JSON error: invalid type for `sub`"
        )
    scopes = claims.get("scopes")
    if not isinstance(scopes, list):
        return "JSON error: missing field `scopes`" if "scopes" not in claims else "JSON error: invalid type"
    for s in scopes:
        if s not in GROUPS:
            return f"JSON error: unknown variant `{s}`, expected one of `gpu-control`, `gpu-read`, `cpu-read`"
    exp = claims.get("exp")
    if exp is not None and (type(exp) is not int or exp < 0):
        return f"JSON error: invalid type: {exp!r}, expected usize"
    return None


def verify_token(key: bytes, token: str, now: float | None = None) -> dict[str, Any]:
    """The claims of a valid token, or `Refusal(401, {"error": ...})` worded as auth.rs words it.

    jsonwebtoken 9.3 `decode`: three dot-separated parts (else InvalidToken); the header's `alg` must be
    HS256, the only algorithm in `Validation::new(HS256)` (InvalidAlgorithm); the HMAC (InvalidSignature);
    the claims must deserialize into `Claims`; an `aud` claim with no audience configured is
    InvalidAudience; `exp` (optional: auth.rs removes it from the required claims) must not be older than
    now minus the 60 s leeway (ExpiredSignature: "Token has expired.").
    """
    now = time.time() if now is None else now

    def invalid(kind: str) -> Refusal:
        return Refusal(401, {"error": f"Invalid token: {kind}"})

    parts = token.split(".")
    if len(parts) != 3:
        raise invalid("InvalidToken")
    head, body, sig = parts
    try:
        header = json.loads(_unb64(head))
    except ValueError:
        raise invalid("InvalidToken") from None
    if not isinstance(header, dict) or header.get("alg") != "HS256":
        raise invalid("InvalidAlgorithm")
    expected = hmac.new(key, f"{head}.{body}".encode(), hashlib.sha256).digest()
    try:
        good = hmac.compare_digest(expected, _unb64(sig))
    except ValueError:
        good = False
    if not good:
        raise invalid("InvalidSignature")
    try:
        claims = json.loads(_unb64(body))
    except ValueError:
        raise invalid("JSON error: expected value") from None
    problem = _claims_error(claims)
    if problem is not None:
        raise invalid(problem)
    if "aud" in claims:
        raise invalid("InvalidAudience")
    if claims.get("exp") is not None and claims["exp"] < now - LEEWAY_S:
        raise Refusal(401, {"error": "Token has expired."})
    return claims


def required_scope(path: str) -> str | None:
    """auth.rs `required_scope`: the API group a path belongs to (None: /discover, /time, unknown paths)."""
    if path in ("/discover", "/time"):
        return None
    if path.startswith(("/gpu/set_", "/gpu/reset_")):
        return "gpu-control"
    if path.startswith("/gpu/"):
        return "gpu-read"
    if path.startswith("/cpu/"):
        return "cpu-read"
    return None


# -- NVML errors: error.rs `ZeusdError::NvmlError` with nvml-wrapper's Display texts ----------------------------
# nvml-wrapper `src/error.rs` (Cldfire/nvml-wrapper), by NVML return code (nvml.h `nvmlReturn_t`).
NVML_TEXTS = {
    1: "NVML was not first initialized with `Nvml::init()`",
    2: "a supplied argument was invalid",
    3: "the requested operation is not available on the target device",
    4: "the current user does not have permission to perform this operation",
    6: "a query to find an object was unsuccessful",
    8: "device's external power cables are not properly attached",
    9: "NVIDIA driver is not loaded",
    10: "the provided timeout was reached",
    12: "a shared library couldn't be found or loaded",
    13: "a function couldn't be found in a shared library",
    15: "device fell off the bus or has otherwise become inacessible",
    16: "device requires a reset before it can be used again",
    17: "device control has been blocked by the operating system/cgroups",
    19: "operation cannot be performed because the GPU is currently in use",
    999: "an internal driver error occured",
}


def nvml_answer(code: int | None, generation: str) -> tuple[int, str]:
    """(status, text) of `ZeusdError::NvmlError` (error.rs `status_code`): 403 NoPermission, 400 InvalidArg,
    400 NotSupported from 0.5 (500 at 0.4), 500 anything else."""
    text = f"NVML error: {NVML_TEXTS.get(code or 999, NVML_TEXTS[999])}"
    if code == 4:
        return 403, text
    if code == 2 or (code == 3 and generation != "0.4"):
        return 400, text
    return 500, text
