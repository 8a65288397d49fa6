"""Open a page in headless Chromium as a person would: the DOM after rendering, every console message, and
a screenshot. No network: every host name resolves to nothing."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SKIP_REASON = "headless Chromium not installed (Debian: apt-get install -y chromium; .ci/run installs it)"
_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--enable-logging=stderr",
    "--v=0",
)
_CONSOLE = re.compile(r":CONSOLE(?:\(\d+\))?:?\d*\]\s*(.*)")


@dataclass(frozen=True)
class Page:
    """What Chromium made of a page."""

    dom: str
    console: list[str]  # every console message (errors, warnings, logs, failed loads)
    screenshot: Path


def _chromium(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None, SKIP_REASON
    with tempfile.TemporaryDirectory(prefix="zeus-callbacks-chromium-") as profile:
        return subprocess.run(
            [CHROMIUM, *_FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )


def open_page(
    path: Path, screenshot: Path, width: int = 1000, height: int = 1400, timeout_s: float = 90
) -> Page:
    """Load `path` twice (Chromium dumps the DOM or screenshots per run): its rendered DOM, console
    messages of both loads, and a `width` x `height` screenshot written to `screenshot`."""
    url = path.resolve().as_uri()
    dom = _chromium(["--dump-dom", url], timeout_s)
    shot = _chromium([f"--window-size={width},{height}", f"--screenshot={screenshot}", url], timeout_s)
    console = [
        m.group(1) for p in (dom, shot) for line in p.stderr.splitlines() if (m := _CONSOLE.search(line))
    ]
    assert dom.returncode == 0 and dom.stdout.strip(), dom.stderr[-2000:]
    assert shot.returncode == 0 and screenshot.exists(), shot.stderr[-2000:]
    return Page(dom.stdout, console, screenshot)
