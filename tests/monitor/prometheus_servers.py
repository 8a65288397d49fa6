"""A real Prometheus server and Pushgateway (Debian's `prometheus`, `prometheus-pushgateway`) for the tests, each
started on a free loopback port in the test's directory and stopped after it."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

PROMETHEUS = shutil.which("prometheus")
PUSHGATEWAY = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")
_INSTALL = "install it with `apt-get install -y prometheus prometheus-pushgateway` (as .ci/run does)"
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason=f"no `prometheus` binary on PATH: {_INSTALL}"
)
needs_pushgateway = pytest.mark.skipif(
    PUSHGATEWAY is None, reason=f"no `prometheus-pushgateway` binary on PATH: {_INSTALL}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            get(url, timeout=1)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {deadline_s:.0f} s:\n{log.read_text()[-3000:]}")


class Server:
    """A started binary: its base URL; `stop()` ends it."""

    def __init__(self, args: list[str], port: int, ready_path: str, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._log = log
        self._proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT)
        try:
            _wait_ready(self.url + ready_path, self._proc, log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def log(self) -> str:
        return self._log.read_text()


class Prometheus(Server):
    """Prometheus scraping `targets` every `interval` (job `zeus`), with its HTTP API."""

    def __init__(self, directory: Path, targets: list[str], interval: str = "250ms") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.scraped = list(targets)
        config = directory / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {interval}\n"
            f"  scrape_timeout: {interval}\n"
            "scrape_configs:\n"
            "  - job_name: zeus\n"
            "    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n"
        )
        port = free_port()
        args = [
            str(PROMETHEUS),
            f"--config.file={config}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        super().__init__(args, port, "/-/ready", directory / "prometheus.log")

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """`/api/v1/query`: the instant vector's samples (each `{"metric": labels, "value": [t, "v"]}`)."""
        params = {"query": promql, **({} if at is None else {"time": f"{at:.3f}"})}
        body = json.loads(get(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"))
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, promql: str) -> float:
        """The one sample `promql` answers."""
        result = self.query(promql)
        assert len(result) == 1, (promql, result)
        return float(result[0]["value"][1])

    def wait_for_scrape(self, after: float, timeout_s: float = 60) -> None:
        """Wait until a scrape of every target began after the wall-clock time `after` (and succeeded).

        Every target: Prometheus may report the first target's `up` before it has discovered the others."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # `timestamp()` of a plain selector is the sample's (the scrape's) time; of an expression, now.
            samples = self.query('timestamp(up{job="zeus"})')
            if len(samples) == len(self.scraped) and all(float(s["value"][1]) > after for s in samples):
                if all(float(s["value"][1]) == 1 for s in self.query('up{job="zeus"}')):
                    return
            time.sleep(0.05)
        raise AssertionError(f"no scrape after {after} within {timeout_s} s; targets: {self.targets()}")

    def targets(self) -> Any:
        return json.loads(get(f"{self.url}/api/v1/targets"))["data"]["activeTargets"]


class Pushgateway(Server):
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        port = free_port()
        args = [str(PUSHGATEWAY), f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
        super().__init__(args, port, "/-/ready", directory / "pushgateway.log")

    def samples(self) -> list[Any]:
        """Every sample the gateway exposes, parsed by prometheus_client's own parser."""
        from prometheus_client.parser import text_string_to_metric_families

        text = get(f"{self.url}/metrics").decode()
        return [s for family in text_string_to_metric_families(text) for s in family.samples]
