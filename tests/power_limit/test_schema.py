"""The saved form of measurements (`schema`): profiles and checkpoint states written by the code before
`Chunk` records (version 1, positional chunk lists; `data/`, written by `data/make_fixtures.py` at commit
1e9a50b) are read to the same figures, and today's (version 2) round-trip."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit.chunk import Chunk, ChunkError
from zeus_callbacks.core.power_limit.optimizer import CorruptedStateError, GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.schema import SCHEMA_VERSION, parse_state
from zeus_callbacks.core.power_limit.selectors import MaxSlowdownConstraint, ZeusCost

DATA = Path(__file__).parent / "data"
EXPECTED = json.loads((DATA / "expected.json").read_text())
SELECTORS = {"adaptive_bursts": MaxSlowdownConstraint(1.1)}
SEARCH = {"sweep_complete": "sweep"}


@pytest.fixture(autouse=True)
def _sim_off():
    yield
    sim.disable()


def _optimizer(name: str, refresh_ms: float | None = None, **kw) -> GlobalPowerLimitOptimizer:
    sim.simulate("a40", virtual_clock=True, noise=0.02, seed=5, energy_refresh_ms=refresh_ms)
    return GlobalPowerLimitOptimizer(
        ZeusMonitor(), SELECTORS.get(name, ZeusCost(0.5)), search=SEARCH.get(name, "adaptive"), **kw
    )


def _assert_figures(opt: GlobalPowerLimitOptimizer, name: str) -> None:
    expected = EXPECTED[name]
    assert sorted(opt.stats) == sorted(int(pl) for pl in expected["stats"])
    for pl, want in expected["stats"].items():
        s = opt.stats[int(pl)]
        got = {
            "steps": s.steps,
            "samples": s.samples,
            "dropped_steps": s.dropped_steps,
            "mean_time_s": s.mean_time_s,
            "mean_energy_j": s.mean_energy_j,
            "windows": len(s.power_windows_w),
            "visits": s.visits,
            "pruned": s.pruned,
            "rel_vars": list(s.rel_vars()),
        }
        # The same arithmetic on the same numbers: equal to the last bit (NaN: a limit with no kept step).
        assert _nan_as_text(got) == _nan_as_text(want), (name, pl)


def _nan_as_text(figures: dict) -> str:
    return json.dumps(figures, sort_keys=True).replace("NaN", '"nan"')


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_version_1_checkpoint_state_reads_to_the_same_figures(name):
    """Fails if a version-1 chunk list is read into other fields (every figure is compared to the last bit)."""
    state = json.loads((DATA / f"{name}.state.json").read_text())
    assert state["version"] == 1 and any(isinstance(c, list) for s in state["stats"] for c in s["chunks"])
    opt = _optimizer(name)
    opt.load_state_dict(state)
    opt.on_step_begin()
    opt.on_step_end()
    _assert_figures(opt, name)
    assert opt.optimal_power_limit_w == EXPECTED[name]["optimal_power_limit_w"]
    # Written again as version 2 (chunks as dicts), it reads back the same.
    again = opt.state_dict()
    assert again["version"] == SCHEMA_VERSION == 2
    assert all(isinstance(c, dict) for s in again["stats"] for c in s["chunks"])
    reread = parse_state(json.loads(json.dumps(again)))
    assert {pl: s.chunks for pl, s in reread.stats.items()} == {pl: s.chunks for pl, s in opt.stats.items()}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_version_1_profile_reads_to_the_same_figures(tmp_path: Path, name):
    """Fails if a version-1 profile reads to other figures or another choice."""
    path = tmp_path / "profile.json"
    shutil.copy(DATA / f"{name}.profile.json", path)
    opt = _optimizer(name, profile_path=path)
    _assert_figures(opt, name)
    complete = EXPECTED[name]["phase"] == "done"
    assert opt.phase == ("done" if complete else "waiting")
    assert opt.optimal_power_limit_w == EXPECTED[name]["optimal_power_limit_w"]


def test_a_partial_version_1_profile_resumes_and_is_written_as_version_2(tmp_path: Path):
    """Fails if a resumed profile is written back in version 1."""
    path = tmp_path / "profile.json"
    shutil.copy(DATA / "adaptive_partial.profile.json", path)
    opt = _optimizer("adaptive_partial", refresh_ms=100, profile_path=path)
    for _ in range(5000):
        opt.on_step_begin()
        sim.active().run_step(0.02)
        opt.on_step_end()
        if opt.phase == "done":
            break
    assert opt.phase == "done" and len(opt.stats) == 9
    saved = json.loads(path.read_text())
    assert saved["version"] == 2 and saved["complete"]
    assert all(isinstance(c, dict) for m in saved["measurements"] for c in m["chunks"])


def test_a_chunk_reads_back_from_either_version():
    """Fails if a version-1 list of 3, 4, 6 or 7 numbers reads to another chunk, or a malformed chunk of
    either version is accepted."""
    v1 = [3, 0.3, 60.0, 2, 200.0, 12.5]
    assert Chunk.from_v1(v1) == Chunk(3, 0.3, 60.0, visit=2, power_w=200.0, end_s=12.5)
    assert Chunk.from_v1([1, 0.1, 0.0, 2, -1.0, 3.0, 1]) == Chunk(1, 0.1, 0.0, 2, None, 3.0, settling=True)
    assert Chunk.from_v1([2, 0.2, 40.0]) == Chunk(2, 0.2, 40.0)  # the oldest files: no visit
    assert Chunk.from_v1([2, 0.2, 40.0, 3]) == Chunk(2, 0.2, 40.0, visit=3)  # or a visit and no readings
    c = Chunk(1, 0.1, 20.0, visit=3, power_w=None, end_s=7.0)
    assert Chunk.from_saved(json.loads(json.dumps(c.to_saved()))) == c
    for bad in ([1, 0.1], [0, 0.1, 2.0], [1, float("nan"), 2.0], "1,2,3"):
        with pytest.raises(ChunkError):
            Chunk.from_v1(bad)
    for bad in ({"steps": 1, "time_s": 0.1}, {**c.to_saved(), "extra": 1}, {**c.to_saved(), "power_w": -1}):
        with pytest.raises(ChunkError):
            Chunk.from_saved(bad)


def test_a_chunk_in_the_other_version_form_or_an_unknown_version_is_refused():
    """Fails if version 2 reads version 1's lists, or a state of an unknown version is read."""
    state = json.loads((DATA / "adaptive_partial.state.json").read_text())
    parse_state(state)
    with pytest.raises(CorruptedStateError, match="stats entry 0: chunk"):
        parse_state({**state, "version": 2})  # version 2 with version 1's lists
    with pytest.raises(CorruptedStateError, match="unknown version 3"):
        parse_state({**state, "version": 3})


def test_a_profile_of_an_unknown_version_says_what_to_do(tmp_path: Path):
    """Fails if a profile of an unknown version is read, or refused without saying what to do."""
    path = tmp_path / "profile.json"
    data = json.loads((DATA / "adaptive_complete.profile.json").read_text())
    path.write_text(json.dumps({**data, "version": 3}))
    with pytest.raises(ValueError, match="version 3.*upgrade zeus_callbacks, or delete it"):
        _optimizer("adaptive_complete", profile_path=path)
