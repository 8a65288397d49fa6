"""What the power-limit optimizer is asked to do: one frozen record, checked when it is built, whose field
names and defaults are the only ones written in the package; every adapter's signature is derived from it
(`takes_power_limit_options`)."""

from __future__ import annotations

import difflib
import functools
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, InitVar, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from zeus_callbacks.core.arguments import bad_argument, whole_number
from zeus_callbacks.core.power_limit.grid import raising_allowed
from zeus_callbacks.core.power_limit.search import SEARCHES
from zeus_callbacks.core.power_limit.selectors import OptimumSelector, ZeusCost

__all__ = ["PowerLimitOptions", "ZEUS_POSITIONAL", "option_names", "takes_power_limit_options"]

ZEUS_POSITIONAL = (
    "optimum_selector",
    "wait_steps",
    "warmup_steps",
    "profile_steps",
    "pl_step",
    "profile_path",
)
"""Zeus's arguments after the monitor, in Zeus's order (`zeus.optimizer.power_limit.GlobalPowerLimitOptimizer`,
zeus 0.10): positional only in the two classes Zeus has, `GlobalPowerLimitOptimizer` and
`HFGlobalPowerLimitOptimizer`; every other option and adapter takes them by keyword."""

_F = TypeVar("_F", bound=Callable[..., None])


@dataclass(frozen=True, kw_only=True)
class PowerLimitOptions:
    """The power-limit optimizer's options, checked and normalised when built (by keyword).

    Attributes:
        optimum_selector: The objective; default (None) `ZeusCost(eta_knob=0.5)`.
        wait_steps: Optimizer steps to let pass before profiling starts.
        warmup_steps: Optimizer steps run at a power limit before it is measured (the adaptive search: at
            the first limit only; later ones, in force at once, settle for a step or two).
        profile_steps: Optimizer steps measured at each power limit (the most, for the adaptive search).
        pl_step: Stride between profiled power limits (W).
        profile_path: JSON profile: loaded if it exists, written (by rank 0) as profiling goes.
        search: "adaptive" (default), "sweep" (every limit, as Zeus) or "zeus" (the sweep, and an epoch's
            end interrupts the limit being profiled, as Zeus).
        allow_raising_limit: Let the search go above the limit in force when training started (up to the
            GPUs' maximum, as Zeus); also `ZEUS_CALLBACKS_ALLOW_RAISING_POWER_LIMIT=1`. Default: never above it.
        report_path: Write the run's HTML report there at the end of training, the power-limit profile and
            the choice included (`zeus-callbacks report`'s); None: no report. The adapters' (the core
            optimizer writes no report).

    Args:
        owner: The class the user called, for error messages (not a field).

    Raises:
        InvalidInputError: (a ValueError) a bad option; the message quotes `owner(name=value)`.
    """

    owner: InitVar[str] = "GlobalPowerLimitOptimizer"
    optimum_selector: OptimumSelector | None = None
    wait_steps: int = 1
    warmup_steps: int = 10
    profile_steps: int = 40
    pl_step: int = 25
    profile_path: str | os.PathLike[str] | None = None
    search: str = "adaptive"
    allow_raising_limit: bool = False
    report_path: str | os.PathLike[str] | None = None

    def __post_init__(self, owner: str) -> None:
        checked: dict[str, Any] = {
            "wait_steps": whole_number(owner, "wait_steps", self.wait_steps, 0),
            "warmup_steps": whole_number(owner, "warmup_steps", self.warmup_steps, 0),
            "profile_steps": whole_number(owner, "profile_steps", self.profile_steps, 1),
            "pl_step": whole_number(owner, "pl_step", self.pl_step, 1),
        }
        if self.search not in SEARCHES:
            raise bad_argument(
                owner, "search", self.search, f"must be one of {SEARCHES}{_meant(self.search)}"
            )
        selector = self.optimum_selector
        if selector is not None and not isinstance(selector, OptimumSelector):
            raise bad_argument(owner, "optimum_selector", selector, _selector_hint(selector))
        for name in ("profile_path", "report_path"):
            path = getattr(self, name)
            if path is not None and not isinstance(path, (str, os.PathLike)):
                raise bad_argument(owner, name, path, "must be a path (str or pathlib.Path) or None")
            checked[name] = Path(path) if path is not None else None
        if not isinstance(self.allow_raising_limit, bool):
            raise bad_argument(
                owner, "allow_raising_limit", self.allow_raising_limit, "must be True or False"
            )
        checked["allow_raising_limit"] = self.allow_raising_limit or raising_allowed()
        checked["optimum_selector"] = selector or ZeusCost(eta_knob=0.5)
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def selector(self) -> OptimumSelector:
        """The objective in force (`optimum_selector`, defaulted)."""
        assert self.optimum_selector is not None  # set by `__post_init__`
        return self.optimum_selector

    @property
    def path(self) -> Path | None:
        """`profile_path` as a `Path`."""
        return Path(self.profile_path) if self.profile_path is not None else None

    def optimizer_arguments(self) -> dict[str, Any]:
        """The keyword arguments of `GlobalPowerLimitOptimizer` (every option but `report_path`)."""
        out = {
            f.name: getattr(self, f.name) for f in fields(self)
        }  # as held, not copied (`asdict` deep-copies)
        del out["report_path"]
        return out


def _meant(search: object) -> str:
    """ ", did you mean 'sweep'?" for a near miss of a search's name, else ""."""
    close = difflib.get_close_matches(str(search).lower(), SEARCHES, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


# An objective's names as users write them (Zeus's class names, the CLI's choices) and the instance meant.
_SELECTOR_NAMES = {
    "time": "Time()",
    "energy": "Energy()",
    "zeuscost": "ZeusCost(eta_knob=0.5)",
    "zeus-cost": "ZeusCost(eta_knob=0.5)",
    "maxslowdownconstraint": "MaxSlowdownConstraint(factor=1.1)",
    "max-slowdown": "MaxSlowdownConstraint(factor=1.1)",
    "maxpowerconstraint": "MaxPowerConstraint(watts=250)",
}


def _selector_hint(selector: object) -> str:
    """What to pass instead of `selector`: an instance for a class, the objective a name or number means."""
    if isinstance(selector, type) and issubclass(selector, OptimumSelector):
        example = _SELECTOR_NAMES.get(selector.__name__.lower(), f"{selector.__name__}(...)")
        return f"is the class, not an objective: pass an instance, `{example}`"
    if isinstance(selector, str) and selector.strip().lower().replace("_", "") in _SELECTOR_NAMES:
        meant = _SELECTOR_NAMES[selector.strip().lower().replace("_", "")]
        return f"is a name, not an objective: pass `{meant}` (from zeus_callbacks)"
    if isinstance(selector, (int, float)) and not isinstance(selector, bool) and selector >= 1:
        return (
            "is a number, not an objective: for a slowdown bound pass "
            f"`MaxSlowdownConstraint(factor={selector!r})` (from zeus_callbacks)"
        )
    return (
        "must be an OptimumSelector instance: Time(), Energy(), ZeusCost(eta_knob=0.5), "
        "MaxSlowdownConstraint(factor=1.1) or MaxPowerConstraint(watts=...) (from zeus_callbacks)"
    )


def option_names() -> list[str]:
    """The options' names, in the record's order."""
    return [f.name for f in fields(PowerLimitOptions)]


def _defaults() -> Mapping[str, Any]:
    return {f.name: f.default for f in fields(PowerLimitOptions) if f.default is not MISSING}


def takes_power_limit_options(
    *, zeus_positional: bool = False, exclude: tuple[str, ...] = (), own: Mapping[str, Any] | None = None
) -> Callable[[_F], _F]:
    """Give an `__init__(self, monitor, optimum_selector=None, *, <own>, **options)` the options' signature.

    The signature (`inspect.signature`, `help()`, IDEs) is `(self, monitor, <options>, *, <own>)` (the
    `monitor` as the wrapped function names it: the Accelerate helper's `accelerator`): the
    record's names and defaults, `optimum_selector` and Zeus's `ZEUS_POSITIONAL` arguments positional with
    `zeus_positional`, every other option keyword-only; `exclude` drops options the class does not take.
    A call is bound to it (a wrong name or too many positional arguments: `TypeError` naming the class)
    and passed on by keyword.
    """
    own = dict(own or {})
    defaults = _defaults()
    positional = ZEUS_POSITIONAL if zeus_positional else ("optimum_selector",)
    keyword = [n for n in defaults if n not in positional and n not in exclude]
    P = inspect.Parameter

    def decorate(init: _F) -> _F:
        head = list(inspect.signature(init).parameters.values())[:2]  # self, and the monitor (or accelerator)
        params = [p.replace(kind=P.POSITIONAL_OR_KEYWORD) for p in head]
        params += [P(n, P.POSITIONAL_OR_KEYWORD, default=defaults[n]) for n in positional]
        params += [P(n, P.KEYWORD_ONLY, default=defaults[n]) for n in keyword]
        params += [P(n, P.KEYWORD_ONLY, default=d) for n, d in own.items()]
        signature = inspect.Signature(params, return_annotation=None)

        @functools.wraps(init)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                bound = signature.bind(self, *args, **kwargs)
            except TypeError as e:
                shown = str(signature).replace("(self, ", "(", 1)
                raise TypeError(f"`{type(self).__name__}(...)`: {e}; its arguments are {shown}.") from None
            given = dict(bound.arguments)
            del given["self"]
            init(self, **given)

        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate
