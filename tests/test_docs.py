"""The documentation site (mkdocs.yml, docs/) builds with warnings as errors, its getting-started script chooses a
power limit as the page says, and what it documents stays complete: every CLI verb, the generated benchmarks
page, the licence files the packages carry."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _python_block_after(page: Path, marker: str) -> str:
    """The first ```python block after `marker` on `page`."""
    text = page.read_text()
    found = re.search(re.escape(marker) + r".*?```python\n(.*?)```", text, re.S)
    assert found, f"no python block after {marker!r} in {page}"
    return found.group(1)


@pytest.mark.system
def test_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    """`mkdocs build --strict`: every internal link, anchor and API cross-reference resolves, every docstring
    rendered parses. Skipped where the `docs` extra is not installed."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("the docs extra is not installed: pip install -e '.[docs]'")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    api = (site / "api" / "power-limit" / "index.html").read_text()
    assert "GlobalPowerLimitOptimizer" in api and "MaxSlowdownConstraint" in api
    assert (site / "getting-started" / "index.html").exists()
    assert (site / "report.png").exists()


@pytest.mark.slow
def test_getting_started_script_chooses_a_limit(tmp_path: Path) -> None:
    """The page's `first_run.py`, saved and run as it says, trains on a simulated A40 and chooses a limit."""
    script = tmp_path / "first_run.py"
    script.write_text(_python_block_after(DOCS / "getting-started.md", "Save this as `first_run.py`"))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    chosen = re.search(r"chose (\d+) W after (\d+) profiling steps \(SIMULATED\)", proc.stdout)
    assert chosen and 100 <= int(chosen.group(1)) <= 300, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_every_cli_verb_has_a_section() -> None:
    """A `zeus-callbacks` verb added without its section on the CLI page fails here."""
    from zeus_callbacks.cli import _COMMANDS

    page = (DOCS / "cli.md").read_text()
    missing = [verb for verb in _COMMANDS if f"\n## {verb}\n" not in page]
    assert not missing, f"docs/cli.md has no section for {missing}"


def test_benchmarks_page_is_the_generators_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/benchmarks.md is written by docs/gen_benchmarks.py from the kept runs, never edited by hand."""
    spec = importlib.util.spec_from_file_location("gen_benchmarks", DOCS / "gen_benchmarks.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gen)  # its dataclass looks its module up there
    spec.loader.exec_module(gen)
    assert (DOCS / "benchmarks.md").read_text() == gen.page(), "rerun: python docs/gen_benchmarks.py page"


def test_licence_files_go_into_the_sdist_and_the_wheel() -> None:
    """pyproject's `license-files` names the root LICENSE (the Apache-2.0 text the shipped data carries too)
    and NOTICE (which names every shipped data folder)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(project["license-files"]) >= {"LICENSE", "NOTICE"}
    data_licence = ROOT / "zeus_callbacks" / "sim" / "data" / "LICENSE.Apache-2.0"
    assert (ROOT / "LICENSE").read_text() == data_licence.read_text()
    notice = (ROOT / "NOTICE").read_text()
    for folder in [
        "sim/data/nsdi23",
        "sim/data/zeus_profiles",
        "sim/data/gpu_dumps",
        "core/heterogeneous/data/zeus2_aws",
    ]:
        assert f"zeus_callbacks/{folder}/" in notice, folder


def test_readme_is_short_and_points_to_the_docs() -> None:
    """The README stays a front page (at most 10 KB): the two commands, the tiers, where the docs are; every
    file it links to exists."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 10_000, f"README.md is {len(readme.encode())} bytes: move detail to docs/"
    for command in [
        'python3 -m venv .venv && . .venv/bin/activate && pip install "torch==2.13.0" -e ".[all]" && zeus-callbacks demo',
        '. .venv/bin/activate && DS_BUILD_OPS=0 pip install -e ".[dev,megatron,deepspeed]" && python -m pytest -q -n 4',
        'python -m pytest -q -m "not system"',
        "mkdocs serve",
    ]:
        assert command in readme, command
    links = re.findall(r"\]\(((?!https?://)[^)#]+)\)", readme)
    assert "docs/getting-started.md" in links
    assert not [link for link in links if not (ROOT / link).exists()]


def test_every_public_name_has_an_api_entry() -> None:
    """Each name the package root offers (`__all__` and the framework adapters it loads lazily) is rendered on
    an API page, so the strict build checks its docstring; a new public name without one fails here."""
    import zeus_callbacks

    api = "\n".join(page.read_text() for page in (DOCS / "api").glob("*.md"))
    names = set(zeus_callbacks.__all__) | set(zeus_callbacks._ADAPTERS)
    missing = [
        name
        for name in sorted(names)
        if not re.search(rf"(^::: zeus_callbacks(\.\w+)*\.{name}$|^\s+- {name}$)", api, re.M)
    ]
    assert not missing, f"no API entry in docs/api/ for {missing}"
