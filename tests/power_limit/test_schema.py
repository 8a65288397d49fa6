"""The saved form of measurements (`schema`): today's version round-trips through checkpoints and profile
files; version 1 (positional chunk lists, written only by development commits up to 1e9a50b) and unknown
versions are refused, saying what to do (issue 39: the v1 reader and its fixtures are gone)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit.chunk import Chunk, ChunkError
from zeus_callbacks.core.power_limit.optimizer import CorruptedStateError, GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.schema import SCHEMA_VERSION, parse_state
from zeus_callbacks.core.power_limit.selectors import ZeusCost
from zeus_callbacks.core.power_limit.session import PowerLimitOptions, PowerLimitSession

# A version-1 limit's measurement, as development commits wrote it: chunks as positional lists.
V1_STATS = {
    "power_limit_w": 200,
    "steps": 3,
    "time_s": 0.3,
    "energy_j": 60.0,
    "chunks": [[3, 0.3, 60.0, 1, 200.0, 12.5]],
}


def _optimizer(**kw) -> GlobalPowerLimitOptimizer:
    sim.simulate("a40", virtual_clock=True, noise=0.02, seed=5)
    return GlobalPowerLimitOptimizer(ZeusMonitor(), ZeusCost(0.5), warmup_steps=1, profile_steps=8, **kw)


def _profiled(**kw) -> GlobalPowerLimitOptimizer:
    opt = _optimizer(**kw)
    for _ in range(2000):
        opt.on_step_begin()
        sim.active().run_step(0.05)
        opt.on_step_end()
        if opt.phase == "done":
            return opt
    raise AssertionError(opt.phase)


def test_a_state_round_trips_through_json():
    """Fails if a checkpoint state reads back to other chunks or another choice."""
    opt = _profiled()
    state = json.loads(json.dumps(opt.state_dict()))
    assert state["version"] == SCHEMA_VERSION == 2
    assert all(isinstance(c, dict) for s in state["stats"] for c in s["chunks"])
    reread = parse_state(state)
    assert {pl: s.chunks for pl, s in reread.stats.items()} == {pl: s.chunks for pl, s in opt.stats.items()}
    assert reread.optimal_power_limit_w == opt.optimal_power_limit_w


def test_a_profile_round_trips(tmp_path: Path):
    """Fails if a complete profile is not applied at construction with the same choice and figures."""
    path = tmp_path / "profile.json"
    first = _profiled(profile_path=path)
    assert json.loads(path.read_text())["version"] == SCHEMA_VERSION
    again = _optimizer(profile_path=path)
    assert again.phase == "done" and again.optimal_power_limit_w == first.optimal_power_limit_w
    assert {pl: s.chunks for pl, s in again.stats.items()} == {pl: s.chunks for pl, s in first.stats.items()}


def test_a_chunk_reads_back_and_a_malformed_one_is_refused():
    c = Chunk(1, 0.1, 20.0, visit=3, power_w=None, end_s=7.0)
    assert Chunk.from_saved(json.loads(json.dumps(c.to_saved()))) == c
    for bad in (
        {"steps": 1, "time_s": 0.1},
        {**c.to_saved(), "extra": 1},
        {**c.to_saved(), "power_w": -1},
        [3, 0.3, 60.0],  # version 1's list
    ):
        with pytest.raises(ChunkError):
            Chunk.from_saved(bad)
    assert not hasattr(Chunk, "from_v1")


@pytest.mark.parametrize(
    ("version", "words"),
    [(1, "schema version 1, written only by development versions"), (3, "unknown schema version 3")],
)
def test_a_state_of_version_1_or_an_unknown_one_is_refused(version, words):
    state = {"version": version, "optimal_power_limit_w": 200, "stats": [V1_STATS]}
    with pytest.raises(CorruptedStateError, match=words):
        parse_state(state)
    with pytest.raises(CorruptedStateError, match="stats entry 0: chunk"):  # version 2 with version 1's lists
        parse_state({**state, "version": SCHEMA_VERSION})


def test_a_version_1_checkpoint_state_is_refused_with_one_warning_and_profiling_starts_afresh(caplog):
    sim.simulate("a40", virtual_clock=True, noise=0.02, seed=5)
    session = PowerLimitSession("HFGlobalPowerLimitOptimizer", ZeusMonitor(), PowerLimitOptions())
    state = {"version": 1, "optimal_power_limit_w": 200, "stats": [V1_STATS]}
    with caplog.at_level(logging.WARNING, logger="zeus_callbacks"):
        assert not session.load_state(state, "checkpoint-8/trainer_state.json")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "schema version 1" in said[0] and "profiling starts afresh" in said[0], said
    assert session.optimizer.stats == {} and session.optimizer.optimal_power_limit_w is None


@pytest.mark.parametrize("version", [1, None])
def test_a_version_1_profile_says_delete_it_and_it_is_profiled_again(tmp_path: Path, version):
    """A profile of version 1 (the first files had no `version`) is refused at construction, naming the file
    and what to do; deleted, the GPUs are profiled again."""
    path = tmp_path / "profile.json"
    opt = _profiled(profile_path=path)
    data = json.loads(path.read_text())
    data["measurements"] = [V1_STATS]
    data.pop("version")
    if version is not None:
        data["version"] = version
    path.write_text(json.dumps(data))
    with pytest.raises(
        ValueError,
        match=r"schema version 1, written only by development.*Delete it: the GPUs are profiled again",
    ) as e:
        _optimizer(profile_path=path)
    assert str(path) in str(e.value)
    path.unlink()
    assert _profiled(profile_path=path).optimal_power_limit_w == opt.optimal_power_limit_w


def test_a_profile_of_an_unknown_version_says_what_to_do(tmp_path: Path):
    path = tmp_path / "profile.json"
    _profiled(profile_path=path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "version": 3}))
    with pytest.raises(ValueError, match="unknown schema version 3.*Delete it.*upgrade zeus_callbacks"):
        _optimizer(profile_path=path)
