"""A simulated C library: C function pointers (ctypes callbacks) that answer from Python implementations.

`sim/nvml_library.py` (`libnvidia-ml.so.1`) and `sim/amdsmi_library.py` (`libamd_smi.so`) are two of them; each
registers its functions in a `CFunctions` table and builds a `CallbackLibrary` over it. The calling convention is
the C libraries': a status is the return value, success when the implementation returns None. A Python exception
other than the library's own status error raised inside a callback (a signal handler's `KeyboardInterrupt`, a
test's injected failure) cannot cross the C frame: the callback answers the library's unknown-error status and
the function pointer's `errcheck` re-raises the exception once the C call has returned, as a signal that arrives
during a real driver call is handled right after it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from ctypes import CFUNCTYPE
from typing import Any

__all__ = ["CFunctions", "CallbackLibrary"]

Implementation = Callable[..., int | None]


class CFunctions:
    """The functions of one simulated C library: each name's C prototype and implementation(library, *C args).

    Args:
        restype: the C type of every function's status return (`nvmlReturn_t`: `c_int`).
        success: the status of a call whose implementation returned None.
        unknown_error: the status of a call whose implementation raised something else than `error`.
        error: the exception an implementation raises to answer a status.
        status: the status an `error` stands for.
    """

    def __init__(
        self,
        restype: Any,
        success: int,
        unknown_error: int,
        error: type[Exception],
        status: Callable[[Any], int],
    ) -> None:
        self.restype, self.success, self.unknown_error = restype, success, unknown_error
        self.error, self.status = error, status
        self.table: dict[str, tuple[Any, Implementation]] = {}

    def register(self, name: str, *argtypes: Any) -> Callable[[Implementation], Implementation]:
        """A decorator that registers the implementation of the C function `restype name(argtypes...)`."""

        def register(impl: Implementation) -> Implementation:
            self.table[name] = (CFUNCTYPE(self.restype, *argtypes), impl)
            return impl

        return register


class CallbackLibrary:
    """A simulated C library: one C function pointer attribute per function of `functions` not `withheld`."""

    def __init__(self, functions: CFunctions, withheld: frozenset[str]) -> None:
        self.withheld = frozenset(withheld)
        # Exceptions raised inside a callback, by thread, to re-raise once the C call returned.
        self._raised: dict[int, BaseException] = {}
        for name, (prototype, impl) in functions.table.items():
            if name not in self.withheld:
                setattr(self, name, self.c_function(prototype, self._guarded(functions, impl)))

    def c_function(self, prototype: Any, call: Callable[..., int]) -> Any:
        """`call` as a C function pointer of `prototype` that re-raises what the call stored in `_raised`."""
        function = prototype(call)
        function.errcheck = self._reraise
        return function

    def _guarded(self, functions: CFunctions, impl: Implementation) -> Callable[..., int]:
        raised, error, status = self._raised, functions.error, functions.status
        success, unknown_error = functions.success, functions.unknown_error

        def call(*args: Any) -> int:
            try:
                ret = impl(self, *args)
            except error as e:
                return status(e)
            except BaseException as e:  # noqa: BLE001 - re-raised after the C call by `_reraise`
                raised[threading.get_ident()] = e
                return unknown_error
            return success if ret is None else ret

        return call

    def _reraise(self, result: int, function: Any, args: tuple) -> int:
        if self._raised:
            error = self._raised.pop(threading.get_ident(), None)
            if error is not None:
                raise error
        return result
