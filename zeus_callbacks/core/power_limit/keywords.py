"""The power-limit options as keyword arguments, for type checkers and IDEs: an optimizer's or adapter's
`**options: Unpack[PowerLimitArguments]` shows each option's name and type.

Names and types only: the defaults and the checks are `PowerLimitOptions`' (`options`), which the runtime
signatures come from (`takes_power_limit_options`); `tests/adapters/test_contract.py` checks that these
agree with the record.
"""

from __future__ import annotations

import os

from typing_extensions import TypedDict

__all__ = ["OptimizerArguments", "PowerLimitArguments"]


class OptimizerArguments(TypedDict, total=False):
    """`GlobalPowerLimitOptimizer`'s options after `optimum_selector` (see `PowerLimitOptions`)."""

    wait_steps: int
    warmup_steps: int
    profile_steps: int
    pl_step: int
    profile_path: str | os.PathLike[str] | None
    search: str
    allow_raising_limit: bool


class PowerLimitArguments(OptimizerArguments, total=False):
    """An adapter's options after `optimum_selector`: the optimizer's, and `report_path`."""

    report_path: str | os.PathLike[str] | None
