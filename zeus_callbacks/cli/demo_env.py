"""What `zeus-callbacks demo` needs around its run: the `[hf]` extra, and the package's log lines shown as
its progress."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator
from typing import TextIO

__all__ = ["require_hf_extra", "package_log"]


def require_hf_extra() -> None:
    """ValueError naming the extra to install when transformers or accelerate cannot be imported (a wheel
    installed without `[hf]`), instead of the ModuleNotFoundError of the first import."""
    missing = []
    for name in ("transformers", "accelerate"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package or a `sys.modules` entry that is not a module
            found = False
        if not found:
            missing.append(name)
    if missing:
        raise ValueError(
            f"the demo trains with the Hugging Face Trainer, and {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed: pip install 'zeus-callbacks[hf]'"
        )


# Whose INFO lines the demo shows: the power-limit optimizer's (each limit profiled, the choice). The monitor's
# and the device layer's (RAPL missing, a counter's refresh, a limit restored) stay at the root's WARNING.
_NEWS = "zeus_callbacks.core.power_limit"


class _PlainInfo(logging.Formatter):
    """INFO lines as they are (what the optimizer does and chooses is news, not a warning); WARNING and above
    with their level and logger, as the other commands print them."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno < logging.WARNING else f"{record.levelname} {record.name}: {text}"


def _shown(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or record.name.startswith(_NEWS)


@contextlib.contextmanager
def package_log(out: TextIO) -> Iterator[None]:
    """The package's log lines on `out` meanwhile, and only there: WARNING and above, and the power-limit
    optimizer's INFO lines without a level (`_PlainInfo`)."""
    logger = logging.getLogger("zeus_callbacks")
    if logger.getEffectiveLevel() <= logging.INFO:  # `-v`: every INFO line, as the root's handler prints it
        yield
        return
    handler = logging.StreamHandler(out)
    handler.setFormatter(_PlainInfo())
    handler.addFilter(_shown)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(min(logging.INFO, logger.getEffectiveLevel()))
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
