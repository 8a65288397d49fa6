"""Write docs/benchmarks.md from the benchmarks' own output, with the date, machine, commit and command of each run.

Run by hand (not in CI: the benchmarks take minutes to a quarter of an hour each on a 2-core machine):

    python docs/gen_benchmarks.py list                  # the benchmarks, and where each page section comes from
    python docs/gen_benchmarks.py run monitor-overhead  # run one (or several), keep its output, rewrite the page
    python docs/gen_benchmarks.py page                  # rewrite the page from the kept runs only

Each run is kept in docs/benchmark_runs/NAME.json: the command, its printed output (stdout and stderr, as
printed), the date, the machine (CPU model, cores, memory, load average before and after), the commit and
whether the tree had uncommitted changes. A section whose record says `"source": "readme"` holds figures that
were typed into README.md by hand before this page existed: the page says so, with the commit they were
carried over from, until a run replaces them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "benchmark_runs"
PAGE = ROOT / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: the page's section title, the command it is run with, and what it measures."""

    title: str
    command: tuple[str, ...]
    about: str


BENCHMARKS: dict[str, Benchmark] = {
    "monitor-overhead": Benchmark(
        "Monitor overhead",
        ("python", "benchmarks/monitor_overhead.py", "--pairs", "1000", "--repeat", "20"),
        "Cost of one `begin_window` + `end_window` pair, this package's `ZeusMonitor` against Zeus 0.16's, both "
        "reading the same SIMULATED A40s through the real nvidia-ml-py (best of 20 x 1000 pairs).",
    ),
    "observer-overhead": Benchmark(
        "What the background observers cost a step",
        ("python", "benchmarks/monitor_overhead.py", "--section", "step", "--rounds", "5"),
        "What the power timeline (`PowerMonitor`) and the Prometheus endpoint cost a 100 ms training step, beside "
        "Zeus's `PowerMonitor` (SIMULATED A40, real clock).",
    ),
    "power-limit-search": Benchmark(
        "Power-limit search",
        ("python", "benchmarks/power_limit_search.py", "--seeds", "4", "--jobs", "1"),
        "This package's `GlobalPowerLimitOptimizer` against Zeus 0.16's on every shipped trace, every selector and "
        "4 noise seeds (SIMULATED, virtual clock): how often each chooses within 1% of the trace's best, and in "
        "how many steps.",
    ),
    "pipeline-planner": Benchmark(
        "Perseus planner",
        (
            "python",
            "benchmarks/pipeline_planner.py",
            "--sizes",
            "4x8,4x16,8x16,8x32",
            "--exact-limit-s",
            "120",
        ),
        "The pipeline-frequency planner against lowtime 0.3.0 (Zeus's Perseus reference) and the exact ILP, on "
        "synthetic A40-like profiles.",
    ),
    "pipeline-example": Benchmark(
        "Perseus in a job",
        ("python", "benchmarks/pipeline_example.py"),
        "`examples/pipeline/`'s 4-rank gloo pipeline on SIMULATED A40s: the plan against all-max clocks, "
        "interleaved in the same processes.",
    ),
    "pipeline-engines": Benchmark(
        "Perseus in Megatron-Core and DeepSpeed",
        ("python", "benchmarks/pipeline_engines.py"),
        "Each engine's example on 4 SIMULATED A40s at a real model's sizes: the plan against all-max clocks, "
        "interleaved in the same processes.",
    ),
    "real-nodes": Benchmark(
        "The power-limit optimizer on real node types",
        ("python", "benchmarks/real_nodes.py"),
        "The power-limit optimizer on every shipped `nvidia-smi -q` dump (SIMULATED: timing modelled from the "
        "nearest traced GPU): the range profiled, the limit chosen and its saving against the limit in force, "
        "then the same starting at the maximum, as Zeus does.",
    ),
    "pipeline-measured-options": Benchmark(
        "Planning on the options as measured",
        ("python", "benchmarks/pipeline_measured_options.py"),
        "The pipeline planner on A40-like profiles (SIMULATED) with the options as measured, against the former "
        "monotone rewrite of their times.",
    ),
    "callback-overhead": Benchmark(
        "HF callbacks' cost per step",
        ("python", "benchmarks/callback_overhead.py"),
        "Per-step cost of `HFGlobalPowerLimitOptimizer` (once done) and `HFZeusMonitor` in one Trainer run "
        "(SIMULATED A40).",
    ),
    "heterogeneous-planner": Benchmark(
        "Heterogeneous planner",
        ("python", "benchmarks/heterogeneous_planner.py"),
        "Timings of the heterogeneous planner: the Zeus² search, vectorised and as a pure-Python loop, and the "
        "sync planner.",
    ),
}


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out.stdout.strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return None


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run(name: str) -> dict:
    """Run one benchmark with the current interpreter, print its output as it comes, and keep the record."""
    bench = BENCHMARKS[name]
    argv = [sys.executable, *bench.command[1:]]
    machine = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "load_before": _load(),
    }
    started = datetime.now(timezone.utc)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    code = proc.wait()
    machine["load_after"] = _load()
    record = {
        "source": "run",
        "command": " ".join(bench.command),
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "duration_s": round(time.monotonic() - t0),
        "exit_code": code,
        "commit": _git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "machine": machine,
        "output": "".join(lines),
    }
    if code != 0:
        print(f"{name}: exit code {code}; not kept", file=sys.stderr)
        return record
    RUNS.mkdir(exist_ok=True)
    (RUNS / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _machine_line(m: dict) -> str:
    load = (
        f"load average {m['load_before'][0]} before, {m['load_after'][0]} after"
        if m.get("load_before")
        else ""
    )
    parts = [m.get("cpu", ""), f"{m.get('cores')} cores", f"{m.get('memory_gib')} GiB", m.get("os", ""), load]
    return ", ".join(p for p in parts if p)


def _section(name: str, bench: Benchmark, record: dict | None) -> str:
    head = f"## {bench.title}\n\n{bench.about}\n\n"
    command = f"```bash\n{' '.join(bench.command)}\n```\n\n"
    if record is None:
        return head + command + "Not run yet: `python docs/gen_benchmarks.py run " + name + "`.\n"
    if record["source"] == "readme":
        note = (
            '!!! warning "Carried over from the README, not regenerated"\n'
            f"    These figures were typed by hand into README.md, as it stood at commit {record['commit']}; the "
            "date and machine are as it stated them. Run `python docs/gen_benchmarks.py run "
            f"{name}` to replace them with the benchmark's own output.\n\n"
        )
        return head + command + note + record["output"].strip() + "\n"
    dirty = " (with uncommitted changes)" if record.get("uncommitted_changes") else ""
    meta = (
        f"Run on {record['date']} at commit {record['commit']}{dirty}, {record['duration_s']} s, "
        f"by `python docs/gen_benchmarks.py run {name}`. Machine: {_machine_line(record['machine'])}.\n\n"
    )
    return head + command + meta + "```text\n" + record["output"].rstrip() + "\n```\n"


def page() -> str:
    """The page, from the kept records (none kept: the section says how to run it)."""
    sections = []
    for name, bench in BENCHMARKS.items():
        path = RUNS / f"{name}.json"
        record = json.loads(path.read_text()) if path.exists() else None
        sections.append(_section(name, bench, record))
    intro = (
        "# Benchmarks\n\n"
        "<!-- Written by docs/gen_benchmarks.py from docs/benchmark_runs/*.json: edit those, or rerun. -->\n\n"
        "Each section holds a benchmark's printed output with the date, machine, commit and command of its run, "
        "written by `docs/gen_benchmarks.py` (`python docs/gen_benchmarks.py run NAME`), not retyped. The "
        "benchmarks live under `benchmarks/`; those that compare with Zeus (and lowtime) run both in the same "
        "process. Figures on simulated GPUs are simulations, labelled SIMULATED: they show how the code behaves "
        "on the measured traces, not what a given GPU saves. Timings on the real clock move with the machine's load "
        "(other jobs on a shared 2-core machine stretch a step by tens of percent): each run gives its load average "
        "before and after.\n\n"
    )
    return intro + "\n".join(sections)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("list", help="the benchmarks and the source of their figures")
    run_p = sub.add_parser("run", help="run benchmarks, keep their output, rewrite the page")
    run_p.add_argument("names", nargs="+", choices=sorted(BENCHMARKS))
    sub.add_parser("page", help="rewrite the page from the kept runs")
    args = parser.parse_args()
    if args.what == "list":
        for name, bench in BENCHMARKS.items():
            path = RUNS / f"{name}.json"
            source = json.loads(path.read_text())["source"] if path.exists() else "not run"
            print(f"{name:24} {source:8} {' '.join(bench.command)}")
        return 0
    if args.what == "run":
        failed = [name for name in args.names if run(name)["exit_code"] != 0]
        PAGE.write_text(page())
        return 1 if failed else 0
    PAGE.write_text(page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
