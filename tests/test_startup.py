"""The start-up line (toolkit/startup.py): where a run's time went before its first step ended, phase by phase."""

import pstats
import re
import time

from conftest import run_toolkit
from helpers import diffusion_train_args

from toolkit.startup import StartupClock

LINE = re.compile(r"start-up: ([\d.]+) s to the end of the first step: (.*)")


def phases(stderr: str) -> tuple[float, dict[str, float]]:
    found = LINE.search(stderr)
    assert found, stderr[-2000:]
    parts = dict(re.fullmatch(r"(.+) ([\d.]+) s", p).groups() for p in found.group(2).split(", "))
    return float(found.group(1)), {name: float(seconds) for name, seconds in parts.items()}


def test_a_run_says_where_its_start_up_went_and_profiles_it_when_asked(tmp_path):
    profile = tmp_path / "startup.prof"
    started = time.time()
    done = run_toolkit(*diffusion_train_args("quickstart_sd.yaml", tmp_path / "run"),
                       env={"TOOLKIT_PROFILE_STARTUP": str(profile)})
    wall = time.time() - started
    assert done.returncode == 0, done.stderr[-2000:]
    total, parts = phases(done.stderr)
    assert list(parts) == ["python", "imports and config", "trainer imports", "processes", "run folder",
                           "model built", "model loaded", "data", "measurements", "optimizer and wrappers",
                           "logs and report", "first step"]
    assert abs(sum(parts.values()) - total) <= 0.1 * len(parts)  # each shown to 0.1 s
    assert 0 < total < wall  # counted from the process's start, which came after `started`
    assert done.stderr.count("start-up:") == 1  # the first step only
    stats = pstats.Stats(str(profile))  # the profile stops with the first step: the loop's later steps are not in it
    assert any(name == "load_model" for _, _, name in stats.stats)
    assert not any(name == "export_final" for _, _, name in stats.stats)


def test_phases_add_up_and_a_phase_marked_twice_adds():
    clock = StartupClock(started=100.0)
    clock.marks = [("python", 100.5)]
    for phase, at in (("imports and config", 102.0), ("data", 103.0), ("imports and config", 103.5)):
        clock.marks.append((phase, at))
    assert clock.phases() == {"python": 0.5, "imports and config": 2.0, "data": 1.0}
    assert clock.summary() == ("start-up: 3.5 s to the end of the first step: python 0.5 s, imports and config "
                               "2.0 s, data 1.0 s")
    assert clock.summary_once() is not None and clock.summary_once() is None


def test_the_package_map_is_read_once_and_answers_as_before(monkeypatch):
    import importlib.metadata

    from toolkit.startup import share_package_map

    original = importlib.metadata.packages_distributions
    monkeypatch.setattr(importlib.metadata, "packages_distributions", getattr(original, "__wrapped__", original))
    expected = importlib.metadata.packages_distributions()
    share_package_map()
    share_package_map()  # a second entry (the tests' in-process runs) wraps nothing twice
    shared = importlib.metadata.packages_distributions
    assert shared.__wrapped__ is getattr(original, "__wrapped__", original)
    assert shared() == expected and shared() is shared()
    assert shared.cache_info().misses == 1  # three calls, one read


def test_each_process_of_a_launch_profiles_into_a_file_of_its_own(monkeypatch):
    from toolkit.startup import profile_file

    monkeypatch.delenv("RANK", raising=False)
    assert profile_file("/tmp/p.prof") == "/tmp/p.prof"
    monkeypatch.setenv("RANK", "0")
    assert profile_file("/tmp/p.prof") == "/tmp/p.prof"
    monkeypatch.setenv("RANK", "3")
    assert profile_file("/tmp/p.prof") == "/tmp/p.prof.rank3"
