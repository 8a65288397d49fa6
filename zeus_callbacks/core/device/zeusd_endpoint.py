"""Where zeusd listens and how long to wait for it: the environment Zeus reads, and HTTP over a Unix socket."""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zeus_callbacks.core.device.errors import InvalidInputError

if TYPE_CHECKING:
    import http.client

__all__ = ["SOCK_ENV", "HOST_PORT_ENV", "TOKEN_ENV", "TIMEOUT_ENV", "TIMEOUT_S", "ZeusdEndpoint", "timeout_s"]

SOCK_ENV = "ZEUSD_SOCK_PATH"
HOST_PORT_ENV = "ZEUSD_HOST_PORT"
TOKEN_ENV = "ZEUSD_TOKEN"
TIMEOUT_ENV = "ZEUS_CALLBACKS_ZEUSD_TIMEOUT_S"
TIMEOUT_S = 10.0  # a blocking setter takes milliseconds; a daemon that hangs must not hang training for long


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
def _unix_connection_class() -> Callable[[str, float], http.client.HTTPConnection]:
    """The class of HTTP connections over a Unix socket, built as `(socket_path, timeout_s)`."""
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


def timeout_s() -> float:
    """How long a request waits for zeusd's answer: `ZEUS_CALLBACKS_ZEUSD_TIMEOUT_S`, else `TIMEOUT_S`.

    Raises:
        InvalidInputError: the variable is not a positive number of seconds.
    """
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise InvalidInputError(
            f"{TIMEOUT_ENV}={text!r} is not a positive number of seconds: e.g. 10, or unset it."
        )
    return value
