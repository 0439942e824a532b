"""The web UI's jobs, for real: a tiny quickstart started through the launcher, a queue that outlives a restart of
the UI, the CLI's refusal of a second run in a folder in use, stop (SIGINT: a checkpoint) and resume, a `sample`
job, and a job that fails."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from helpers import without_others_samples, long_quickstart  # noqa: E402
from toolkit.errors import UserError  # noqa: E402
from toolkit.train.run_lock import RunLock  # noqa: E402
from toolkit.ui.app import create_app  # noqa: E402
from toolkit.ui.jobs import JobQueue  # noqa: E402
from toolkit.train.run_lock import lock_holder  # noqa: E402

LIVE = long_quickstart("live")


def wait_for(what: str, check, timeout: float = 120.0):
    """Poll `check()` until it returns something true; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what} (last: {value!r})")


def run_row(client, name: str) -> dict:
    return next((r for r in client.get("/api/runs").json()["runs"] if r["name"] == name), {})


def job_of(client, job_id: str) -> dict:
    return next(j for j in client.get("/api/runs").json()["jobs"] if j["id"] == job_id)


@pytest.fixture
def root(tmp_path, tiny_runs):
    out = tmp_path / "outputs"
    out.mkdir()
    shutil.copytree(tiny_runs["llm"], out / "done", ignore=without_others_samples)
    yield out
    for job in JobQueue(out).active():  # a failed test leaves no training behind
        if job.state == "running" and job.pid:
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_start_queue_restart_refuse_stop_sample_resume(root):
    assert yaml.safe_load(LIVE)["save"]["every"] == 0 and yaml.safe_load(LIVE)["log"]["every"] == 1
    with TestClient(create_app(root)) as client:
        started = client.post("/api/jobs", json={"yaml": LIVE})
        assert started.status_code == 201, started.text
        live = started.json()["job"]
        assert (started.json()["run"], live["state"]) == ("live", "running")
        # one run at a time on this machine's GPU set (here: the CPU): the sample jobs wait in the queue
        sample = client.post("/api/runs/done/sample", json={"step": 1}).json()["job"]
        extra = client.post("/api/runs/done/sample", json={"step": 2})
        assert sample["state"] == "queued" and extra.status_code == 409
        assert extra.json()["error"].startswith(f"run folder {root / 'done'} already has a queued job in this UI")
        saved = json.loads((root / ".ui" / "jobs.json").read_text())
        assert [(j["id"], j["state"]) for j in saved["jobs"]] == [(live["id"], "running"), (sample["id"], "queued")]
        wait_for("the run to log a step", lambda: (run_row(client, "live").get("step") or 0) >= 1)
        assert run_row(client, "live")["status"] == "running"
    # The UI is gone; the run it started goes on, in a session of its own.
    holder, alive = lock_holder(root / "live")
    assert alive and holder["pid"] != os.getpid()
    with TestClient(create_app(root)) as client:  # the UI again: its queue is as it was
        assert job_of(client, live["id"])["state"] == "running" and job_of(client, sample["id"])["state"] == "queued"
        assert run_row(client, "live")["status"] == "running"
        # a second run into the folder in use: refused with the message the CLI gives
        refused = client.post("/api/jobs", json={"yaml": LIVE})
        assert refused.status_code == 409
        message = refused.json()["error"]
        assert message.startswith(f"run folder {root / 'live'} is in use by another run (pid {holder['pid']} on host ")
        with pytest.raises(UserError) as cli:  # what `train` meets in that folder (the CLI prints "error: " and it)
            RunLock(root / "live").acquire(print)
        assert str(cli.value) == message
        config = client.get("/api/runs/live").json()
        saved_yaml = next(a for a in live["command"].split() if a.endswith(".yaml"))
        assert config["provenance_note"].startswith("sources: the YAML this UI started the run with")
        sources = {r["key"]: r["source"] for r in config["provenance"]}
        assert sources["train.steps"] == f"{Path(saved_yaml).name}:{LIVE.splitlines().index('  steps: 2000') + 1}"
        assert sources["run.output_dir"] == "the UI (outputs root)"

        stop = client.post("/api/runs/live/stop", json={})
        assert stop.json() == {"message": f"SIGINT sent to job {live['id']}: the run saves a checkpoint and stops"}
        wait_for("the run to stop", lambda: job_of(client, live["id"])["exit_code"] == 130)
        row = wait_for("the interrupted status", lambda: (r := run_row(client, "live"))["status"] == "interrupted" and r)
        stopped_at = row["step"]
        detail = client.get("/api/runs/live").json()
        assert [c["step"] for c in detail["checkpoints"]] == [stopped_at]
        assert f"stopped at step {stopped_at}; checkpoint saved" in detail["job"]["log_tail"]

        # the queued sample job starts once the GPU set is free, and its samples show on the run's page
        wait_for("the sample job", lambda: job_of(client, sample["id"])["state"] == "done")
        assert job_of(client, sample["id"])["exit_code"] == 0
        sets = client.get("/api/runs/done").json()["samples"]
        cli_set = next(s for s in sets if s["name"].startswith("cli-") and s["name"].endswith("-step-000001"))
        assert [i["prompt"] for i in cli_set["items"]] == ["the red circle"]

        resumed = client.post("/api/runs/live/resume", json={})
        assert resumed.status_code == 201 and "--fresh" not in resumed.json()["job"]["command"]
        wait_for("steps after the resume", lambda: (run_row(client, "live").get("step") or 0) > stopped_at)
        client.post("/api/runs/live/stop", json={})
        wait_for("the second stop", lambda: job_of(client, resumed.json()["job"]["id"])["exit_code"] == 130)
        log = client.get("/api/runs/live").json()["job"]["log_tail"]
        checkpoint = root / "live" / "checkpoints" / f"step-{stopped_at:06d}"
        assert f"resumed from {checkpoint} (step {stopped_at})" in log


def test_a_job_that_fails_shows_as_failed(root):
    broken = root / "broken"
    shutil.copytree(root / "done", broken)
    shutil.rmtree(broken / "final")
    config = yaml.safe_load((broken / "config.yaml").read_text())
    config["data"]["path"] = str(root / "missing.jsonl")
    (broken / "config.yaml").write_text(yaml.safe_dump(config))
    with TestClient(create_app(root)) as client:
        assert run_row(client, "broken")["status"] == "interrupted"
        job = client.post("/api/runs/broken/resume", json={}).json()["job"]
        assert job["command"] == f"train {broken}/config.yaml run.output_dir={broken.resolve()}"
        wait_for("the job to end", lambda: job_of(client, job["id"])["state"] == "done")
        row = run_row(client, "broken")
        assert (row["status"], row["note"]) == ("failed", f"job {job['id']} exited with code 2")
        log = client.get("/api/runs/broken").json()["job"]["log_tail"]
        assert f"'data.path' in {broken}/config.yaml:" in log and f"{root / 'missing.jsonl'} does not exist" in log
        assert client.post("/api/runs/broken/stop", json={}).json() == {"error": "run broken is not running\n  fix: nothing to stop"}
