"""`zeus-callbacks demo`: HF Trainer fine-tunes a tiny LM while the power-limit optimizer profiles a (simulated) GPU."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from zeus_callbacks.cli.demo_env import package_log, require_hf_extra
from zeus_callbacks.cli.options import GPU_KINDS, add_objective_arguments, objective_from_args
from zeus_callbacks.core.power_limit.selectors import OptimumSelector
from zeus_callbacks.core.report.saving import saving_text

STEPS_AFTER_CHOICE = 10  # steps trained at the chosen limit before the demo stops
_WAIT_STEPS = 5  # the first steps of a run are slow (allocation, caches): not charged to the maximum limit
_SEQ_LEN = 64
_BATCH = 4
# Each step's work on the simulated GPU (at the maximum limit), queued as a kernel at the step's start
# (`HFSimulatedGPUWork`): it runs beside the tiny model's host work (about 7 ms of CPU a step), which is not
# GPU work, so the GPU's pace sets each step's time on an idle and a loaded host alike. A quarter second
# keeps the host's work between steps (3-7 ms, a few times that beside CPU burners) within the 5% that
# lets one-second power windows form, so that energy rests on them, not on the counter's 100 ms rounding
# (at 0.1 s a step the saving moved by 5 points between two idle runs).
_STEP_GPU_WORK_S = 0.25
# The A40's workload when neither --gpu nor --workload is given: its best limit under the default selector
# stands 5% clear of the next (175 W, 28% less energy for 4% more time), where the A40's own default's best
# two are 1.5% apart, within the search's noise at this length, so the demo's choice does not hinge on it.
_A40_WORKLOAD = "imagenet/resnet50/16/adadelta"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `demo` subcommand."""
    parser = subparsers.add_parser(
        "demo",
        help="watch the power-limit optimizer pick a limit while HF Trainer fine-tunes a tiny LM (simulated GPU)",
        description=(
            "Fine-tune a tiny causal LM (built from a config, on a generated corpus) with HF Trainer on the CPU "
            "while HFGlobalPowerLimitOptimizer profiles the power limits of a simulated GPU, then report every "
            "profiled limit and the choice. Nothing on this machine changes unless --real is given."
        ),
    )
    parser.add_argument("--gpu", choices=GPU_KINDS, help="simulated GPU model (default a40)")
    parser.add_argument(
        "--real",
        action="store_true",
        help="use this machine's GPU 0 instead: changes its power limit (needs root)",
    )
    parser.add_argument(
        "--workload",
        metavar="KEY",
        help=f"traced workload of the simulated GPU (default: {_A40_WORKLOAD} on the A40, else the GPU's own)",
    )
    add_objective_arguments(parser)
    parser.add_argument("--noise", type=float, default=0.02, help="simulated run-to-run noise (default 0.02)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, the corpus and the noise")
    parser.add_argument(
        "--steps",
        type=int,
        default=300,
        help=f"most training steps (default 300); the demo stops {STEPS_AFTER_CHOICE} steps after the choice",
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=3, help="warm-up steps per power limit (default 3)"
    )
    parser.add_argument(
        "--profile-steps", type=int, default=24, help="measured steps per power limit (default 24)"
    )
    parser.add_argument(
        "--pl-step", type=int, default=25, help="stride between power limits in W (default 25)"
    )
    parser.add_argument(
        "--plot", metavar="FILE.png", help="plot time and energy per step against the power limit"
    )
    parser.add_argument(
        "--report",
        metavar="FILE.html",
        help="record the run and write its HTML report (the record is kept beside it in FILE.run/)",
    )
    parser.add_argument(
        "--carbon-intensity",
        type=float,
        metavar="G_PER_KWH",
        help="grid carbon intensity for the report's CO2eq (gCO2eq/kWh; default: not given)",
    )
    parser.add_argument(
        "--region",
        metavar="CODE",
        help="the report's carbon intensity from the shipped yearly average of a region (ISO code, e.g. DE, US)",
    )
    parser.add_argument(
        "--price", type=float, metavar="PER_KWH", help="electricity price per kWh for the report's cost"
    )
    parser.add_argument("--currency", default="USD", help="currency of --price (default USD)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Train, profile, report; 2 on bad input."""
    try:
        require_hf_extra()
        selector = _checked_selector(args)
    except ValueError as e:
        print(f"zeus-callbacks demo: {e}", file=sys.stderr)
        return 2
    progress = sys.stderr if args.json else sys.stdout
    from zeus_callbacks import sim

    try:
        tmp_state = None if args.real else _simulate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"zeus-callbacks demo: {e}", file=sys.stderr)
        return 2
    try:
        with (
            tempfile.TemporaryDirectory(prefix="zeus-callbacks-demo-") as tmp,
            _stdout_to_stderr(args.json),
            package_log(progress),
        ):
            report = _train(args, selector, Path(tmp), progress)
    finally:
        if not args.real:
            sim.disable()  # restores what the run changed, if anything is left
            if tmp_state is not None:
                tmp_state.cleanup()
    _print_results(args, report, progress)
    return 0 if report["optimal_power_limit_w"] is not None else 1


@contextlib.contextmanager
def _stdout_to_stderr(whole_file: bool) -> Iterator[None]:
    """What the libraries print on stdout meanwhile goes to stderr (DeepSpeed, which accelerate imports
    when it is installed, warns on stdout that it sets its accelerator to the CPU); with `whole_file`, also
    what reaches the stdout file descriptor, so that `--json` leaves nothing but the JSON there."""
    sys.stdout.flush()
    saved = os.dup(1) if whole_file else None
    if saved is not None:
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            sys.stdout.flush()  # what was written to it meanwhile goes to stderr too
            os.dup2(saved, 1)
            os.close(saved)


def _checked_selector(args: argparse.Namespace) -> OptimumSelector:
    """The objective the options ask for, once they are checked (ValueError: a bad option, named)."""
    selector = objective_from_args(args)
    if args.real and (args.gpu or args.workload):
        raise ValueError("--real uses this machine's GPU: drop --gpu/--workload")
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: must be at least 1")
    _check_report_options(args)
    return selector


def _check_report_options(args: argparse.Namespace) -> None:
    """Check the report's options (ValueError: a bad one); `--region` sets `args.carbon_intensity`."""
    for option, value in (("--carbon-intensity", args.carbon_intensity), ("--price", args.price)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{option} {value}: must be a number >= 0")
        if value is not None and not args.report:
            raise ValueError(f"{option} goes into the HTML report: add --report FILE.html")
    if args.region is not None:
        if args.carbon_intensity is not None:
            raise ValueError("--region and --carbon-intensity both set the carbon intensity: pass one")
        if not args.report:
            raise ValueError("--region goes into the HTML report: add --report FILE.html")
        args.carbon_intensity, args.carbon_source = _region_intensity(args.region)
    if args.report and Path(args.report).is_dir():
        raise ValueError(f"--report {args.report}: is a folder; pass a file name such as demo.html")


def _simulate(args: argparse.Namespace) -> tempfile.TemporaryDirectory | None:
    """Simulate the GPU the options name; returns the temporary folder made for its state, to clean up.

    ValueError or FileNotFoundError (an unknown GPU model or workload) leaves nothing behind.
    """
    from zeus_callbacks import sim

    workload = args.workload or (None if args.gpu else _A40_WORKLOAD)
    spec = f"{args.gpu or 'a40'}" + (f":{workload}" if workload else "")
    # A fresh node (at its maximum limit) unless the user chose where simulated GPUs live.
    state_dir = os.environ.get("ZEUS_CALLBACKS_SIM_STATE_DIR")
    tmp_state = None if state_dir else tempfile.TemporaryDirectory(prefix="zeus-callbacks-demo-sim-")
    where = state_dir if tmp_state is None else tmp_state.name
    try:
        sim.simulate(spec, noise=args.noise, seed=args.seed, state_dir=where, export_env=False)
    except (ValueError, FileNotFoundError):
        if tmp_state is not None:
            tmp_state.cleanup()
        raise
    return tmp_state


def _print_results(args: argparse.Namespace, report: dict[str, Any], progress: TextIO) -> None:
    """Write the plot if asked, say where the files went (on `progress`), and print the report."""
    if args.plot:
        from zeus_callbacks.cli.demo_plot import plot

        plot(report, args.plot)
        print(f"Plot written to {args.plot}.", file=progress)
    if args.report:
        from zeus_callbacks.core.report import run_dir_for

        print(f"Report written to {args.report} (record in {run_dir_for(args.report)}).", file=progress)
    print(json.dumps(_plain(report), indent=1) if args.json else table(report))


def _train(args: argparse.Namespace, selector: OptimumSelector, tmp: Path, out: TextIO) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import PrinterCallback, ProgressCallback, Trainer, TrainingArguments

    from zeus_callbacks import sim
    from zeus_callbacks.core.monitor.monitor import ZeusMonitor
    from zeus_callbacks.huggingface import HFGlobalPowerLimitOptimizer
    from zeus_callbacks.sim import HFSimulatedGPUWork

    transformers.logging.set_verbosity_error()
    monitor = ZeusMonitor(gpu_indices=[0])
    plo = HFGlobalPowerLimitOptimizer(
        monitor,
        selector,
        wait_steps=_WAIT_STEPS,
        warmup_steps=args.warmup_steps,
        profile_steps=args.profile_steps,
        pl_step=args.pl_step,
    )
    recorder = None
    if args.report:
        from zeus_callbacks.core.report import start_report

        recorder = start_report(
            args.report,
            monitor,
            carbon_intensity_gco2_per_kwh=args.carbon_intensity,
            price_per_kwh=args.price,
            currency=args.currency,
            carbon_intensity_source=getattr(args, "carbon_source", None),
            title=f"demo: a tiny GPT-2 on {monitor.gpus[0].name}",
        )
    label = "SIMULATED" if monitor.simulated else "measured"
    name = monitor.gpus[0].name
    system = sim.active()
    workload = system.gpus[0].trace.workload if system is not None else None
    if workload is not None:
        modelled = monitor.gpus[0].provenance
        traced = f"{modelled}; workload {workload}" if modelled else f"traced workload {workload}"
        print(
            f"SIMULATED {name} ({traced}); a tiny GPT-2 trains on the CPU, each step with "
            f"{1000 * _STEP_GPU_WORK_S:.0f} ms of simulated GPU work.",
            file=out,
        )
    training_args = TrainingArguments(
        output_dir=str(tmp / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=_BATCH,
        learning_rate=1e-3,
        use_cpu=not args.real,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
    )
    trainer = Trainer(
        model=tiny_model(args.seed),
        args=training_args,
        train_dataset=ToyCorpus(args.seed),
        callbacks=[plo, HFSimulatedGPUWork(0, _STEP_GPU_WORK_S), _progress_callback(plo, out, label)],
    )
    if recorder is not None:
        trainer.add_callback(_record_callback(recorder))  # after the optimizer: its step is measured first
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    print(f"Profiling power limits with {selector!r} ({label}):", file=out)
    threads = torch.get_num_threads()
    # One thread: the tiny model's host work stays short beside the GPU's, on a host others load too.
    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        trainer.train()
    except BaseException as e:
        if recorder is not None:
            recorder.finish(optimizers=[plo], failed=f"{type(e).__name__}: {e}")
        raise
    finally:
        plo.optimizer.on_train_end()  # done by the trainer already, unless training raised
        torch.set_num_threads(threads)
    if recorder is not None:
        recorder.finish(optimizers=[plo])
    report = plo.optimizer.report()
    report.update(
        gpu=name,
        workload=workload,
        training_steps=trainer.state.global_step,
        wall_time_s=time.perf_counter() - started,
    )
    if report["optimal_power_limit_w"] is None:
        print(
            f"zeus-callbacks demo: no choice after {args.steps} steps (phase {report['phase']}); raise --steps.",
            file=sys.stderr,
        )
    return report


def tiny_model(seed: int):
    """A 1-layer GPT-2 over bytes, built from a config (nothing downloaded)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=256,
        n_positions=_SEQ_LEN,
        bos_token_id=10,
        eos_token_id=10,
    )
    return GPT2LMHeadModel(config)


class ToyCorpus:
    """Byte-level blocks of generated English-like sentences, as `{"input_ids", "labels"}` samples."""

    _WORDS = (
        "the gpu trains a small model while the optimizer lowers its power limit and measures time and energy "
        "per step then keeps the limit with the lowest cost"
    ).split()

    def __init__(self, seed: int = 0, num_blocks: int = 4096) -> None:
        import torch

        rng = random.Random(seed)
        text = "\n".join(
            " ".join(rng.choice(self._WORDS) for _ in range(rng.randint(4, 12)))
            for _ in range(num_blocks * 8)
        )
        data = torch.tensor(list(text.encode()), dtype=torch.long)
        self._blocks = data[: len(data) // _SEQ_LEN * _SEQ_LEN].view(-1, _SEQ_LEN)[:num_blocks]

    def __len__(self) -> int:
        return len(self._blocks)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self._blocks[i], "labels": self._blocks[i]}


def _region_intensity(region: str) -> tuple[float, str]:
    """(gCO2eq/kWh, where it comes from) of `region` in the shipped table."""
    from zeus_callbacks.core.monitor.carbon import RegionCarbonIntensity

    try:
        provider = RegionCarbonIntensity(region)
    except Exception as e:  # the table's own message lists the known regions
        raise ValueError(f"--region {region}: {e}") from None
    return (
        provider.get_current_carbon_intensity(),
        f"{provider.name}, {provider.year} average, {provider.source}",
    )


def _record_callback(recorder):
    """A callback that feeds each training step to the run recorder (built here, as `_progress_callback`)."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            recorder.on_step_begin()

        def on_step_end(self, args, state, control, **kwargs):
            recorder.on_step_end()

    return Record()


def _progress_callback(plo, out: TextIO, label: str):
    """A callback (built here so that transformers is imported only when the demo runs) that prints each
    visit of a power limit as it ends and stops training a few steps after the choice."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def __init__(self, plo, out: TextIO, label: str) -> None:
            self._optimizer = plo.optimizer
            self._out = out
            self._label = label
            self._visiting: int | None = None
            self._done_at: int | None = None

        def on_step_end(self, args, state, control, **kwargs):
            opt = self._optimizer
            visiting = opt.power_limit_w if opt.phase in ("warmup", "profiling") else None
            if visiting != self._visiting:
                if self._visiting is not None:
                    self._visit_ended(self._visiting)
                self._visiting = visiting
            if opt.phase == "inactive":
                control.should_training_stop = True
            elif opt.phase == "done":
                if self._done_at is None:
                    self._done_at = state.global_step
                    print(
                        f"  -> chose {opt.optimal_power_limit_w} W at step {state.global_step}",
                        file=self._out,
                    )
                if state.global_step - self._done_at >= STEPS_AFTER_CHOICE:
                    control.should_training_stop = True

        def _visit_ended(self, pl: int) -> None:
            stats = self._optimizer.stats.get(pl)
            visit = f"visit {stats.visits}" if stats is not None else "visit"
            row = next(
                (r for r in self._optimizer.report()["power_limits"] if r["power_limit_w"] == pl), None
            )
            text = _row_text(row) if row is not None else f"{pl:>4} W  every sample set aside (a burst)"
            print(f"  {text}  {visit}  ({self._label})", file=self._out, flush=True)

    return Progress(plo, out, label)


def _row_text(row: dict[str, Any]) -> str:
    kind = "pruned" if row["pruned"] else "full"
    return (
        f"{row['power_limit_w']:>4} W  {1000 * row['time_per_step_s']:8.1f} ms/step  "
        f"{row['energy_per_step_j']:8.2f} J/step  {row['steps']:>3} steps  {kind}"
    )


def table(report: dict[str, Any]) -> str:
    """The report as text: every profiled limit, the choice, and the saving against the maximum limit."""
    sim = report["simulated"]
    label = " (SIMULATED)" if sim else ""
    lines = []
    if sim:
        lines.append("SIMULATED GPU: every figure below is a simulation, not a measurement.")
    lines.append(
        f"GPU: {report['num_gpus']} x {report['gpu']}{label}"
        + (f", traced workload {report['workload']}" if report.get("workload") else "")
    )
    lines.append(f"Selector: {report['selector']}; search: {report['search']}")
    header = ["", "power limit", "time/step", "energy/step", "cost", "steps", "profile"]
    rows = [header]
    for r in report["power_limits"]:
        chosen = r["power_limit_w"] == report["optimal_power_limit_w"]
        rows.append(
            [
                "*" if chosen else "",
                f"{r['power_limit_w']} W",
                f"{1000 * r['time_per_step_s']:.1f} ms",
                f"{r['energy_per_step_j']:.2f} J",
                "n/a" if math.isnan(r["cost"]) else f"{r['cost']:.4g}",
                str(r["steps"]),
                "pruned" if r["pruned"] else "full",
            ]
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    for row in rows:
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    pl = report["optimal_power_limit_w"]
    if pl is None:
        lines.append(f"No power limit chosen (phase: {report['phase']}).")
    else:
        applied = "" if report["applied"] else f", not applied: {report.get('inactive_reason', 'inactive')}"
        lines.append(f"Chosen power limit: {pl} W{label}{applied}: {saving_text(report)}{label}.")
    lines.append(
        f"Profiling cost: {report['profiling_steps']} steps, {report['profiling_energy_j']:.1f} J{label}; "
        f"{report['training_steps']} training steps in {report['wall_time_s']:.1f} s."
    )
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    """JSON-safe: NaN and infinities become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
