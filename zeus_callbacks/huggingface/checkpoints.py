"""transformers checkpoints as the HF adapter reads them: which are complete, and the optimizer state they
hold. Nothing here changes what a `Trainer` resumes from; `ZeusTrainerMixin` (opt-in) does, with these."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from zeus_callbacks.core.files import read_regular

__all__ = [
    "TRAINER_STATE_NAME",
    "trainer_state_problem",
    "earlier_checkpoints",
    "last_complete_checkpoint",
    "complete_checkpoint",
    "optimizer_state_in",
    "checkpoint_state",
    "warn_if_newest_checkpoint_is_cut_short",
    "resumed_checkpoint",
]

logger = logging.getLogger("zeus_callbacks.huggingface")

TRAINER_STATE_NAME = "trainer_state.json"  # transformers' name of the trainer state in a checkpoint
_CHECKPOINT_STEP = re.compile(rf"{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)")


def _read_trainer_state(checkpoint: Path) -> Any:
    """`checkpoint`'s trainer_state.json, parsed; read only as a regular file (a FIFO or a device planted
    there is refused at once, never waited on).

    Raises:
        OSError: missing, unreadable, or not a regular file (`UnsafePathError`).
        ValueError: not JSON (`UnicodeDecodeError` included).
    """
    return json.loads(read_regular(checkpoint / TRAINER_STATE_NAME).decode("utf-8"))


def trainer_state_problem(checkpoint: Path) -> str | None:
    """Why `checkpoint`'s trainer_state.json cannot be resumed from (missing, cut short, not a regular file,
    not a state), or None."""
    try:
        data = _read_trainer_state(checkpoint)
    except FileNotFoundError:
        return "is missing"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"is unreadable or cut short ({type(e).__name__}: {e})"
    if not isinstance(data, dict) or not isinstance(data.get("global_step"), int):
        return "holds no trainer state"
    return None


def earlier_checkpoints(checkpoint: Path) -> list[Path]:
    """The `checkpoint-N` folders beside `checkpoint` with a smaller N, newest first."""
    match = _CHECKPOINT_STEP.fullmatch(checkpoint.name)
    if match is None or not checkpoint.parent.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in checkpoint.parent.iterdir()
        if (m := _CHECKPOINT_STEP.fullmatch(p.name)) and p.is_dir() and int(m.group(1)) < int(match.group(1))
    ]
    return [p for _, p in sorted(found, reverse=True)]


def last_complete_checkpoint(checkpoint: Path) -> Path | None:
    """The newest complete checkpoint before `checkpoint`, or None."""
    return next((p for p in earlier_checkpoints(checkpoint) if trainer_state_problem(p) is None), None)


def complete_checkpoint(output_dir: str, resume: Any) -> Any:
    """What `train(resume_from_checkpoint=resume)` can resume from: `resume` itself when complete, else the
    last complete checkpoint before it, or None (training starts over); one warning naming the file.

    transformers writes a checkpoint in place (weights, optimizer, RNG state, then trainer_state.json, whose
    writing is not atomic) and `get_last_checkpoint` takes the newest folder whatever it holds, so a process
    killed while saving leaves a checkpoint that `train()` cannot load.
    """
    if resume is None or resume is False:
        return resume
    target = get_last_checkpoint(output_dir) if resume is True else resume
    if target is None:
        return resume  # transformers' own error: no checkpoint at all
    target = Path(target)
    problem = trainer_state_problem(target)
    if problem is None:
        return str(target)
    earlier = last_complete_checkpoint(target)
    logger.warning(
        "%s %s: that checkpoint was cut short while being saved. %s",
        target / TRAINER_STATE_NAME,
        problem,
        f"Resuming from {earlier}, the last complete checkpoint."
        if earlier is not None
        else f"No complete checkpoint before it in {target.parent}: training starts from the beginning.",
    )
    return str(earlier) if earlier is not None else None


def resumed_checkpoint(output_dir: str, global_step: int) -> Path | None:
    """The checkpoint a run resumed at `global_step` came from, where transformers saved it
    (`output_dir/checkpoint-<step>`, complete and at that step), or None."""
    candidate = Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{global_step}"
    if trainer_state_problem(candidate) is not None:
        return None
    try:
        step = _read_trainer_state(candidate)["global_step"]
    except (OSError, ValueError, KeyError):
        return None
    return candidate if step == global_step else None


def warn_if_newest_checkpoint_is_cut_short(output_dir: str) -> None:
    """One warning when the newest checkpoint in `output_dir` is incomplete, saying how to resume from the
    last complete one (for a trainer without `ZeusTrainerMixin`, whose resumption is left as it is)."""
    try:
        newest = get_last_checkpoint(output_dir)
    except (OSError, ValueError):
        return
    if newest is None or (problem := trainer_state_problem(Path(newest))) is None:
        return
    earlier = last_complete_checkpoint(Path(newest))
    logger.warning(
        "%s %s: that checkpoint was cut short while being saved, and resuming from it fails. %s",
        Path(newest) / TRAINER_STATE_NAME,
        problem,
        f"To resume from the last complete one, pass resume_from_checkpoint={str(earlier)!r} (or train with "
        "zeus_callbacks.huggingface.ZeusTrainerMixin, which skips a cut-short checkpoint itself)."
        if earlier is not None
        else "No complete checkpoint is before it: delete it and train from the beginning.",
    )


def optimizer_state_in(stateful_callbacks: Any, name: str) -> Any:
    """The optimizer state that a trainer state's `stateful_callbacks` hold for the callback class `name`
    (its first instance): None when they hold none, `{}` for an entry not shaped as `state()` makes it."""
    if not isinstance(stateful_callbacks, dict) or name not in stateful_callbacks:
        return None
    data = stateful_callbacks[name]
    if isinstance(data, list):
        data = data[0] if data else {}
    attributes = data.get("attributes") if isinstance(data, dict) else None
    return attributes.get("optimizer_state", {}) if isinstance(attributes, dict) else {}


def checkpoint_state(checkpoint: Path, name: str) -> Any:
    """The optimizer state `checkpoint`'s trainer_state.json holds for `name`, or None (none, or unreadable)."""
    try:
        data = _read_trainer_state(checkpoint)
    except (OSError, ValueError):
        return None
    return optimizer_state_in(data.get("stateful_callbacks") if isinstance(data, dict) else None, name)
