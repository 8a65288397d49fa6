"""The package's shape: classes of a size one can hold in mind (issue 39: instance attributes and public methods
per class, every attribute declared where the class starts), no function more complex than ruff's C901 allows
(issue 21), and modules of about 500 lines as a guide."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zeus_callbacks"
MAX_LINES = 500
# Module (relative to the package) -> why it may be longer.
LONGER_ALLOWED: dict[str, str] = {
    "core/power_limit/optimizer.py": "one class, the optimizer with what it shows (issue 39: the readout base "
    "class its one subclass filled in was a cut); the readout's logic is readout.py's functions, the "
    "profile's reuse profile_file.py's",
    "core/pipeline_frequency/optimizer.py": "one class, the optimizer with what it shows (issue 39: the readout "
    "base class was a cut); the readout's logic is readout.py's functions and RecentIterations",
}


# Per class (issue 39: what hurts a reader is a class's state and surface, not its module's length).
MAX_ATTRIBUTES = 20  # distinct `self.<name>` a class's methods set
MAX_PUBLIC_METHODS = 24  # methods and properties without a leading underscore (the `Device` interface's 24)
# To do, as pyproject's mypy overrides: class -> (attributes, public methods) today, a ceiling until it is cut.
OVER_THE_LIMITS: dict[str, tuple[int, int]] = {}
# Classes whose methods set an attribute `__init__` does not (mixins without an `__init__` of their own, and a
# subclass setting its stdlib base's attribute), with the attributes: to do, none may be added.
SET_LATE: dict[str, set[str]] = {
    "core/device/zeusd_endpoint.py:UnixHTTPConnection": {"sock"},  # http.client.HTTPConnection's own
    "huggingface/trainer.py:RestoresOnException": {"_in_run"},
    "ignite.py:IgniteAdapter": {"_handles", "_raised", "_running"},
    "lightning/hooks.py:GlobalPowerLimitOptimizerHooks": {"_ckpt_path"},
}
_STARTS = ("__init__", "__post_init__", "__new__")


def class_shape(cls: ast.ClassDef) -> tuple[set[str], list[str], set[str]]:
    """A class's instance attributes (set on `self` in its methods), public methods, and the attributes
    first set outside `__init__` (neither set there nor declared in the class body, as a dataclass's
    fields are)."""
    declared = {
        s.target.id
        for s in cls.body
        if isinstance(s, ast.AnnAssign)
        and isinstance(s.target, ast.Name)
        and "ClassVar" not in ast.unparse(s)
    }
    attributes: set[str] = set()
    started: set[str] = set(declared)
    methods = [f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for f in methods:
        if not f.args.args or f.args.args[0].arg != "self":
            continue
        for node in ast.walk(f):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    attributes.add(node.attr)
                    if f.name in _STARTS:
                        started.add(node.attr)
    public = [f.name for f in methods if not f.name.startswith("_")]
    return attributes, public, attributes - started


def package_classes() -> dict[str, ast.ClassDef]:
    """Every class of the package, as `module:Class` (module relative to the package)."""
    found = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                found[f"{p.relative_to(PACKAGE)}:{node.name}"] = node
    return found


def test_no_class_above_the_per_class_limits() -> None:
    """Issue 39: classes had been cut in two to meet a module's line count while `SimulatedGPU` and the
    pipeline optimizer each held 36 attributes. A class over the limits is refused unless it is on the
    to-do list, which holds each one's count today as its ceiling and drops it once it is under the limits."""
    over, grown, done = {}, {}, []
    classes = package_classes()
    for name, cls in classes.items():
        attributes, public, _ = class_shape(cls)
        shape = (len(attributes), len(public))
        if name in OVER_THE_LIMITS:
            ceiling = OVER_THE_LIMITS[name]
            if shape[0] > ceiling[0] or shape[1] > ceiling[1]:
                grown[name] = (shape, ceiling)
            if shape[0] <= MAX_ATTRIBUTES and shape[1] <= MAX_PUBLIC_METHODS:
                done.append(name)
        elif shape[0] > MAX_ATTRIBUTES or shape[1] > MAX_PUBLIC_METHODS:
            over[name] = shape
    assert not over, (
        f"(attributes, public methods) over ({MAX_ATTRIBUTES}, {MAX_PUBLIC_METHODS}): {over}; give the state a "
        "record of its own or split the class by job"
    )
    assert not grown, f"to-do classes grew past their ceiling ((now), (ceiling)): {grown}"
    assert not done, f"under the limits now: take {done} off OVER_THE_LIMITS"
    assert set(OVER_THE_LIMITS) <= set(classes), set(OVER_THE_LIMITS) - set(classes)


def test_every_attribute_is_set_in_init() -> None:
    """Issue 39: `PlanSearch` set 8 attributes in `optimize` that `__init__` never named; a reader of
    `__init__` (or the dataclass's fields) sees every attribute the instance will have."""
    late = {}
    for name, cls in package_classes().items():
        _, _, set_late = class_shape(cls)
        if extra := set_late - SET_LATE.get(name, set()):
            late[name] = sorted(extra)
    assert not late, f"attributes first set outside __init__: {late}; set them in __init__ (None or empty)"


# Modules whose public callables are not all annotated yet (to do): the fake NVML's opaque `handle`s,
# the demo's model factory, node_info's wrapper and power's clock.
UNANNOTATED_MODULES = {"sim/fake_nvml.py", "cli/demo.py", "core/device/node_info.py", "core/device/power.py"}


def _public_functions(body: list[ast.stmt], prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef]]:
    for node in body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from _public_functions(node.body, f"{prefix}{node.name}.")
        elif isinstance(node, ast.FunctionDef) and (not node.name.startswith("_") or node.name == "__init__"):
            yield prefix + node.name, node


def test_public_callables_are_annotated() -> None:
    """The package ships `py.typed`; issue 39 found the selectors' `score` overrides unannotated. Every public
    function and method of a public module has each parameter's type and (but `__init__`) its return's."""
    missing = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        module = str(p.relative_to(PACKAGE))
        if module in UNANNOTATED_MODULES or any(
            part.startswith("_") for part in p.relative_to(PACKAGE).parts[:-1]
        ):
            continue
        if p.name.startswith("_") and p.name != "__init__.py":
            continue
        for name, f in _public_functions(ast.parse(p.read_text()).body):
            a = f.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
            if params and params[0].arg in ("self", "cls"):
                params = params[1:]
            params += [v for v in (a.vararg, a.kwarg) if v is not None]
            names = [x.arg for x in params if x.annotation is None]
            names += ["return"] if f.returns is None and f.name != "__init__" else []
            if names:
                missing[f"{module}:{name}"] = names
    assert not missing, f"unannotated: {missing}"


def test_no_module_over_500_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    unexplained = {m: n for m, n in long.items() if m not in LONGER_ALLOWED}
    assert not unexplained, (
        f"modules over {MAX_LINES} lines: {unexplained}; split them by job (or say why in LONGER_ALLOWED)"
    )


def _tool_passes(*args: str, timeout_s: int = 300) -> None:
    """Run `python -m <args>` in the repository root and assert it exits 0, showing its output if not."""
    out = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


@pytest.mark.system
def test_lint_passes_with_the_complexity_limit() -> None:
    """`ruff check` with pyproject's rules, C901 at 12 among them, over the package, tests, examples and
    benchmarks."""
    _tool_passes("ruff", "check", "--output-format", "concise", ".")


@pytest.mark.system
def test_the_formatter_holds() -> None:
    """`ruff format --check` over the tree (issue 37: 27 files had drifted from it)."""
    _tool_passes("ruff", "format", "--check", ".")


@pytest.mark.system
def test_the_type_checker_passes() -> None:
    """`mypy` with pyproject's settings over the whole package, no module skipped (issue 37: `py.typed` was
    shipped while no type checker ran)."""
    _tool_passes("mypy", "zeus_callbacks", timeout_s=600)
