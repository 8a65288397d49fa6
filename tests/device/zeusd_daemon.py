"""The zeusd test double (`zeusd_double.py`) run as a daemon of its own, for tests: the `start_zeusd` fixture
and the `Daemon` it returns; `no_zeusd_from_the_shell`, an autouse fixture where imported."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from zeus_callbacks.core.device import setters, zeusd

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
DOUBLE = HERE / "zeusd_double.py"
GENERATIONS = ("0.4", "0.5", "master")
ZEUSD_ENV = (zeusd.SOCK_ENV, zeusd.HOST_PORT_ENV, zeusd.TOKEN_ENV, zeusd.TIMEOUT_ENV, setters.SETTERS_ENV)


@pytest.fixture(autouse=True)
def no_zeusd_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """No zeusd settings from the shell that runs the tests, and no route chosen by an earlier test."""
    for name in ZEUSD_ENV:
        monkeypatch.delenv(name, raising=False)
    setters.forget()


class Daemon:
    """A running test double: `env` points a client at it; `requests()` lists what it was asked."""

    def __init__(self, proc: subprocess.Popen, env: dict[str, str], log: Path) -> None:
        self.proc, self.env, self.log = proc, env, log

    def requests(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def writes(self) -> list[str]:
        return [r for r in self.requests() if r.startswith("POST")]


@pytest.fixture
def start_zeusd(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """`start_zeusd(transport="unix"|"tcp", *options)`: the double on this test's simulated node."""
    started: list[subprocess.Popen] = []

    def start(transport: str = "unix", *options: str, generation: str = "master") -> Daemon:
        log = tmp_path / f"zeusd-{len(started)}.log"
        where = (
            ["--socket", str(tmp_path / f"zeusd-{len(started)}.sock")]
            if transport == "unix"
            else ["--tcp", "127.0.0.1:0"]
        )
        env = {k: v for k, v in os.environ.items() if k != "ZEUS_CALLBACKS_SIM_FAULTS"}  # the daemon is root
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        proc = subprocess.Popen(
            [sys.executable, str(DOUBLE), *where, "--log", str(log), "--generation", generation, *options],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        started.append(proc)
        line = proc.stdout.readline().split()
        assert line[:1] == ["READY"], (line, proc.stderr.read() if proc.poll() is not None else "")
        name = zeusd.SOCK_ENV if transport == "unix" else zeusd.HOST_PORT_ENV
        return Daemon(proc, {name: line[1]}, log)

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
