"""No cross-module private import in the package (issue 39): a module's `_name` is its own, and a private
module (`pkg/_mod.py`) is imported only from inside its own package."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zeus_callbacks"


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).parent.parts)


def private_imports(path: Path, source: str | None = None) -> list[str]:
    """The private imports of the package's module at `path` (its text, or `source`) that cross a module
    boundary, as 'module: what'."""
    here, package = _module_name(path), _package_of(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module] if node.module.startswith("zeus_callbacks") else []
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            modules, names = [a.name for a in node.names if a.name.startswith("zeus_callbacks")], []
        else:
            continue
        for module in modules:
            parts = module.split(".")
            for i, part in enumerate(parts):  # a private module, imported from outside its package
                if _private(part) and not package.startswith(".".join(parts[:i])):
                    found.append(f"{here}: {module}")
            for name in names:  # a private name of another module (a private submodule of this package: fine)
                if (
                    _private(name)
                    and module != here
                    and not (module == package and (PACKAGE.parent / Path(*parts) / f"{name}.py").exists())
                ):
                    found.append(f"{here}: {module}.{name}")
    return found


def test_no_cross_module_private_import() -> None:
    found = [f for p in sorted(PACKAGE.rglob("*.py")) for f in private_imports(p)]
    assert not found, f"private names imported across modules (make them public or move the code): {found}"


def test_the_rule_sees_a_private_name_and_a_private_module_from_outside() -> None:
    """The check itself, on a made-up module of the package (not written to disk)."""
    source = "from zeus_callbacks.core.monitor.reporting import _ids\nimport zeus_callbacks.sim._bindings\n"
    assert private_imports(PACKAGE / "core" / "probe.py", source) == [
        "zeus_callbacks.core.probe: zeus_callbacks.core.monitor.reporting._ids",
        "zeus_callbacks.core.probe: zeus_callbacks.sim._bindings",
    ]
    inside = "from zeus_callbacks.sim import _bindings\n"  # a package importing its own private module
    assert private_imports(PACKAGE / "sim" / "__init__.py", inside) == []
