"""The web UI's API through Starlette's test client, on tiny CPU runs: the runs and their status, a run's files,
live metrics, config validation as `validate` does it, the token, and bad input (the running jobs: test_ui_jobs.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("starlette")
pytest.importorskip("httpx")  # Starlette's TestClient
from starlette.testclient import TestClient  # noqa: E402

from conftest import REPO, run_toolkit  # noqa: E402
from helpers import without_others_samples, read_metrics  # noqa: E402
from toolkit.train.run_lock import lock_path  # noqa: E402
from toolkit.ui.app import create_app  # noqa: E402
from toolkit.ui.jobs import Job, JobQueue  # noqa: E402

QUICKSTART = (REPO / "configs/examples/quickstart_llm.yaml").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_runs) -> Path:
    """An outputs root with a finished tiny LLM run (2 steps, a checkpoint and text samples at each) and a
    finished tiny SD run (images)."""
    out = tmp_path_factory.mktemp("ui") / "outputs"
    out.mkdir()
    shutil.copytree(tiny_runs["llm"], out / "llm-done", ignore=without_others_samples)
    shutil.copytree(tiny_runs["sd"], out / "sd-done", ignore=without_others_samples)
    return out


@pytest.fixture
def client(root):
    with TestClient(create_app(root)) as c:
        yield c


def _copy(root: Path, name: str, source: str = "llm-done") -> Path:
    target = root / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(root / source, target)
    return target


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _rows(client) -> dict[str, dict]:
    response = client.get("/api/runs")
    assert response.status_code == 200
    return {r["name"]: r for r in response.json()["runs"]}


def test_runs_and_their_status(client, root):
    last = read_metrics(root / "llm-done")[-1]
    interrupted = _copy(root, "interrupted")
    shutil.rmtree(interrupted / "final")
    killed = _copy(root, "killed")
    shutil.rmtree(killed / "final")
    lock_path(killed).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    running = _copy(root, "running")
    config = yaml.safe_load((running / "config.yaml").read_text())
    config["train"]["steps"] = 10
    (running / "config.yaml").write_text(yaml.safe_dump(config))
    lock_path(running).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    start_failed = root / "start-failed"
    start_failed.mkdir(exist_ok=True)
    (start_failed / "config.yaml").write_text("run:\n  name: x\n")
    (root / "not-a-run").mkdir(exist_ok=True)  # no config, checkpoints or logs: not listed
    try:
        rows = _rows(client)
    finally:
        lock_path(running).unlink()
    assert {n: r["status"] for n, r in rows.items()} == {
        "llm-done": "finished", "sd-done": "finished", "interrupted": "interrupted", "killed": "failed",
        "running": "running", "start-failed": "failed"}
    done = rows["llm-done"]
    assert (done["step"], done["total_steps"], done["family"], done["model"]) == (2, 2, "llm", "tiny:llm")
    assert done["loss"] == pytest.approx(last["loss_smoothed"])
    assert done["device"] == "cpu cpu (CPU)" and done["eta_s"] is None
    assert rows["running"]["note"] == f"pid {os.getpid()}"
    assert rows["running"]["eta_s"] == pytest.approx((10 - 2) / last["steps_per_s"])
    assert "ended without releasing its lock: killed" in rows["killed"]["note"]
    assert rows["start-failed"]["note"] == "ended before its first checkpoint"


def test_a_run_page_data(client, root):
    llm = client.get("/api/runs/llm-done").json()
    assert [c["step"] for c in llm["checkpoints"]] == [1, 2]
    meta = json.loads((root / "llm-done/checkpoints/step-000002/meta.json").read_text())
    assert [f["name"] for f in llm["checkpoints"][1]["files"]] == meta["lora_files"]
    adapter = next(f for f in llm["checkpoints"][1]["files"] if f["name"] == "adapter_model.safetensors")
    download = client.get(f"/api/runs/llm-done/file/{adapter['url_path']}?download=1")
    assert download.status_code == 200
    assert download.content == (root / "llm-done/checkpoints/step-000002/adapter_model.safetensors").read_bytes()
    assert download.headers["content-disposition"].startswith("attachment")
    assert sorted(f["name"] for f in llm["final"]) == sorted(p.name for p in (root / "llm-done/final").iterdir())
    # text samples: the step's prompt and completion as samples.jsonl holds them
    assert [s["step"] for s in llm["samples"]] == [1, 2]
    written = [json.loads(line) for line in (root / "llm-done/samples/step-000002/samples.jsonl").read_text().splitlines()]
    assert llm["samples"][1]["items"] == [{"prompt": r["prompt"], "text": r["completion"]} for r in written]
    assert written[0]["prompt"] == "the red circle"
    # the auto decisions as the run's plan.json records them, the resolved config with each value's line
    decided = {d["key"]: d for d in llm["decisions"]}
    assert llm["decisions_from"] == "plan.json" and decided["train.compile"]["stage"] == "static"
    assert decided["train.compile"]["reason"] == "off on the CPU" and decided["train.compile"]["value"] is False
    rows = {r["key"]: r for r in llm["provenance"]}
    config_lines = (root / "llm-done/config.yaml").read_text().splitlines()
    assert rows["train.steps"]["value"] == 2
    assert rows["train.steps"]["source"] == f"config.yaml:{config_lines.index('  steps: 2') + 1}"
    assert rows["train.compile"]["source"] == "auto: off on the CPU"
    # image samples: each numbered image with its prompt (prompts.txt), served as written
    sd = client.get("/api/runs/sd-done").json()
    items = sd["samples"][0]["items"]
    assert [(i["prompt"], i["url_path"]) for i in items] == [
        ("sks, a red circle on a white background", "samples/step-000001/00.png"),
        ("sks a blue square", "samples/step-000001/01.png")]
    assert sd["samples"][0]["grid"] == "samples/step-000001/grid.png"
    image = client.get(f"/api/runs/sd-done/file/{items[0]['url_path']}")
    assert image.content == (root / "sd-done" / items[0]["url_path"]).read_bytes()
    assert image.headers["content-type"] == "image/png"


def test_files_outside_the_run_folder_are_not_served(client, root, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the browser")
    link = root / "llm-done" / "logs" / "link.txt"
    link.symlink_to(secret)
    try:
        response = client.get("/api/runs/llm-done/file/logs/link.txt")
    finally:
        link.unlink()
    assert response.status_code == 404 and "not for the browser" not in response.text
    assert client.get("/api/runs/..%2F..%2Fetc/file/passwd").status_code == 404


def test_metrics_from_an_offset_and_a_torn_line(client, root):
    run = _copy(root, "metrics")
    path = run / "logs" / "metrics.jsonl"
    first = client.get("/api/runs/metrics/metrics").json()
    assert first["records"] == read_metrics(run, key=None)
    assert first["offset"] == path.stat().st_size
    with path.open("a") as f:
        f.write('{"step": 3, "loss": 1.5, "lr": 0.01}\n{"step": 4, "lo')  # the trainer is writing step 4
    later = client.get(f"/api/runs/metrics/metrics?offset={first['offset']}").json()
    assert later["records"] == [{"step": 3, "loss": 1.5, "lr": 0.01}]
    with path.open("a") as f:
        f.write('ss": NaN}\n')
    last = client.get(f"/api/runs/metrics/metrics?offset={later['offset']}").json()
    assert last["records"] == [{"step": 4, "loss": None}] and last["offset"] == path.stat().st_size


def _events(client, name: str) -> list[tuple[str, object]]:
    events = []
    with client.stream("GET", f"/api/runs/{name}/events") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[len("data: "):])))
    return events


def test_events_of_a_finished_run(client, root):
    events = _events(client, "llm-done")
    assert [kind for kind, _ in events] == ["metrics", "status", "end"]
    assert events[0][1] == [r for r in read_metrics(root / "llm-done", key=None)]
    assert events[1][1]["status"] == "finished" and events[1][1]["samples"] == 2 and events[1][1]["checkpoints"] == 2


def test_a_run_folder_deleted_while_the_ui_is_open(client, root):
    run = _copy(root, "deleted")
    assert "deleted" in _rows(client)
    assert client.get("/api/runs/deleted").status_code == 200
    shutil.rmtree(run)
    assert "deleted" not in _rows(client)
    response = client.get("/api/runs/deleted")
    assert response.status_code == 404
    assert response.json() == {"error": f"run folder {root.resolve() / 'deleted'} does not exist (deleted?)"}
    assert _events(client, "deleted") == [("gone", {})]
    assert client.get("/api/runs/deleted/file/config.yaml").status_code == 404
    assert client.get("/api/compare?runs=llm-done,deleted").json() == {"error": "no run folder deleted (deleted?)"}


def test_validation_is_the_validate_commands(client, run_cli, capsys, tmp_path):
    text = QUICKSTART.replace("  rank: 16\n", "  rank: 16\n  rnak: 4\n").replace("steps: 100", "steps: 0")
    result = client.post("/api/validate", json={"yaml": text}).json()
    lines = text.splitlines()
    assert result["ok"] is False
    assert [p["line"] for p in result["problems"]] == [lines.index("  rnak: 4") + 1, lines.index("  steps: 0") + 1]
    assert result["problems"][0]["message"] == (f"unknown key 'network.rnak' in line {result['problems'][0]['line']}; "
                                                "did you mean 'network.rank'?")
    # the same problems as `validate` prints for the same file, where the file's name stands for "line"
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert run_cli("validate", path) == 2
    printed = capsys.readouterr().err
    for problem in result["problems"]:
        assert problem["message"].replace("line ", f"{path}:") in printed
    broken = client.post("/api/validate", json={"yaml": "train:\n  steps: [1\n"}).json()
    # the line to fix: where the unclosed bracket opens (config/yaml_errors.py), not where the parser gave up
    assert broken["problems"][0]["line"] == 2 and "invalid YAML" in broken["problems"][0]["message"]
    good = client.post("/api/validate", json={"yaml": QUICKSTART}).json()
    assert good["ok"] is True and good["problems"] == [] and good["run"] == "quickstart_llm"
    assert good["existing"] is None
    existing = client.post("/api/validate", json={"yaml": QUICKSTART.replace("name: quickstart_llm", "name: llm-done")})
    assert existing.json()["existing"] == "finished"
    sources = {r["key"]: r["source"] for r in good["rows"]}
    assert sources["run.name"] == "line 5" and sources["train.compile"] == "auto: off on the CPU"
    assert sources["run.output_dir"] == "the UI (outputs root)" and sources["run.seed"] == "default"


def test_a_run_folder_outside_the_root_is_refused(client, root, tmp_path):
    text = QUICKSTART.replace("  name: quickstart_llm\n", f"  name: quickstart_llm\n  output_dir: {tmp_path}/x\n")
    result = client.post("/api/validate", json={"yaml": text}).json()
    assert result["ok"] is False and result["problems"][0]["line"] == 6
    assert result["problems"][0]["message"].startswith(f"run.output_dir {tmp_path}/x is not a folder directly under "
                                                       f"the UI's outputs root {root.resolve()}")


def test_an_invalid_config_cannot_be_started(client, root):
    before = sorted((root / ".ui" / "configs").iterdir())
    response = client.post("/api/jobs", json={"yaml": QUICKSTART.replace("lr: 1.0e-2", "lr: fast")})
    assert response.status_code == 400
    assert response.json()["problems"] == [{"line": QUICKSTART.splitlines().index("  lr: 1.0e-2") + 1,
                                            "message": "'train.lr' in line 20: expected a number, got 'fast'"}]
    assert client.get("/api/runs").json()["jobs"] == []
    assert sorted((root / ".ui" / "configs").iterdir()) == before
    bad_gpus = client.post("/api/jobs", json={"yaml": QUICKSTART, "gpus": "two"})
    assert bad_gpus.status_code == 400 and bad_gpus.json()["error"].startswith("GPUs: 'two' is not a number of GPUs")


def test_preset_and_continue_from_a_checkpoint(client, root):
    with_preset = client.post("/api/preset", json={"yaml": QUICKSTART, "preset": "gfx1100"}).json()["yaml"]
    assert with_preset == QUICKSTART.replace("  preset: cpu\n", "  preset: gfx1100\n")  # comments kept
    without_device = QUICKSTART.replace("device:\n  preset: cpu\n", "")
    added = client.post("/api/preset", json={"yaml": without_device, "preset": "cpu"}).json()["yaml"]
    assert yaml.safe_load(added) == yaml.safe_load(QUICKSTART) and added.startswith("# Quickstart")
    cont = client.get("/api/runs/llm-done/continue?step=1").json()
    data = yaml.safe_load(cont["yaml"])
    assert cont["run"] == "llm-done-from-1"
    assert data["network"]["init_from"] == str(root / "llm-done/checkpoints/step-000001")
    assert data["run"] == {**data["run"], "name": "llm-done-from-1", "output_dir": str(root / "llm-done-from-1")}
    checked = client.post("/api/validate", json={"yaml": cont["yaml"]}).json()
    assert checked["ok"] is True, checked["problems"]
    assert client.get("/api/runs/llm-done/continue?step=7").status_code == 404


def test_compare(client, root):
    data = client.get("/api/compare?runs=llm-done,sd-done").json()
    assert data["runs"] == ["llm-done", "sd-done"]
    assert [step for step, _ in data["loss"]["llm-done"]] == [1, 2]
    assert data["loss"]["llm-done"][1][1] == pytest.approx(read_metrics(root / "llm-done")[-1]["loss_smoothed"])
    diff = {d["key"]: d["values"] for d in data["diff"]}
    assert diff["model.family"] == ["llm", "sd"] and diff["network.rank"] == ["16", "4"]
    assert "train.steps" not in diff  # both trained 2 steps
    assert [s["step"] for s in data["samples"]["sd-done"]] == [1, 2]
    assert client.get("/api/compare?runs=llm-done").status_code == 400


def test_a_token_is_required_when_set(root):
    with TestClient(create_app(root, token="s3cret"), follow_redirects=False) as c:
        assert c.get("/api/runs").status_code == 401
        assert c.get("/").status_code == 401
        assert c.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        first = c.get("/?token=s3cret")
        assert first.status_code == 303 and "toolkit_ui_token=s3cret" in first.headers["set-cookie"]
        assert c.get("/api/runs").status_code == 200  # the cookie from the first visit
        assert c.get("/static/app.js").status_code == 200


def test_local_only_host_origin_and_json(root):
    with TestClient(create_app(root, local_only=True), base_url="http://127.0.0.1:8642") as c:
        assert c.get("/api/runs").status_code == 200
        assert c.get("/api/runs", headers={"Host": "attacker.example:8642"}).status_code == 403
        post = {"yaml": QUICKSTART}
        assert c.post("/api/validate", json=post, headers={"Origin": "http://attacker.example"}).status_code == 403
        assert c.post("/api/validate", content=json.dumps(post), headers={"Content-Type": "text/plain"}).status_code == 415
        assert c.post("/api/validate", json=post, headers={"Origin": "http://127.0.0.1:8642"}).status_code == 200


def test_the_page_and_its_script_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and '<script src="/static/app.js"></script>' in page.text
    script = client.get("/static/app.js").text
    assert "http" not in script.replace("http://www.w3.org/2000/svg", "")  # nothing loaded from elsewhere


def test_a_port_in_use_is_named(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = run_toolkit("ui", "--port", port, "--outputs", tmp_path / "outputs", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == (f"error: port {port} on 127.0.0.1 is already in use (another program, or another `ui`)\n"
                           "  fix: --port N with a free port (--port 0 picks one), or stop what listens there\n")


def test_an_outputs_folder_under_a_missing_folder_is_refused_not_made(tmp_path):
    missing = tmp_path / "typo" / "outputs"
    proc = run_toolkit("ui", "--port", "0", "--outputs", missing, timeout=60)
    assert proc.returncode == 2 and not (tmp_path / "typo").exists()
    assert proc.stderr == (f"error: --outputs {missing}: {missing.parent} does not exist\n  fix: give a folder that "
                           "exists, or one to create inside an existing folder\n")


def test_a_non_local_server_prints_a_token_and_needs_it(tmp_path):
    import urllib.error
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "ui", "--host", "0.0.0.0", "--port", "0", "--outputs",
                             str(tmp_path / "outputs")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
        url = lines[1].split("open ", 1)[1].strip()
        assert lines[2].strip() == "(a new token: requests without it get 401; --token sets your own)"
        port, token = url.split(":")[2].split("/")[0], url.split("?token=")[1]
        assert len(token) >= 24
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/runs", timeout=10)
        assert refused.value.code == 401
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/runs?token={token}", timeout=10) as answer:
            assert json.load(answer)["runs"] == []
    finally:
        proc.send_signal(2)
        proc.wait(timeout=20)
        proc.stdout.close()
        proc.stderr.close()


def test_the_page_ships_with_the_package():
    import fnmatch
    import tomllib

    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["toolkit.ui"]
    static = sorted(p.relative_to(REPO / "toolkit/ui").as_posix() for p in (REPO / "toolkit/ui/static").iterdir())
    assert static == ["static/app.js", "static/index.html", "static/style.css"]
    assert all(any(fnmatch.fnmatch(name, g) for g in globs) for name in static)


def test_plan_json_decisions_are_shown_when_the_run_has_one(client, root):
    run = _copy(root, "planned")
    plan = {"version": 1, "decisions": [
        {"key": "train.compile", "value": True, "reason": "measured 1.4x", "stage": "measured",
         "evidence": "bench/results/compile.json"},
        {"key": "train.batch_size", "value": 4, "reason": "the preset's table", "stage": "static", "evidence": None}]}
    (run / "plan.json").write_text(json.dumps(plan))
    detail = client.get("/api/runs/planned").json()
    assert detail["decisions_from"] == "plan.json" and detail["decisions"] == plan["decisions"]
    sources = {r["key"]: r["source"] for r in detail["provenance"]}
    assert sources["train.compile"] == "auto: measured 1.4x" and sources["train.batch_size"] == "auto: the preset's table"


class Recorder(JobQueue):
    """A queue that records the jobs it would start instead of starting them."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.started: list[str] = []

    def _start(self, job: Job) -> None:
        job.state = "running"
        self.started.append(job.run)

    def _reap(self) -> bool:
        return False


def test_one_job_at_a_time_per_set_of_gpus(tmp_path):
    """The queue's rule, without processes: a job starts when no running job holds one of its GPUs."""
    queue = Recorder(tmp_path / "outputs")
    for run, gpus, devices in [("a", "", ""), ("b", "", "1"), ("c", "2", "1,2"), ("d", "2", ""), ("e", "all", ""),
                               ("f", "", "3")]:
        queue.submit("train", run, ["train", f"{run}.yaml"], gpus, devices)
    # a: GPU 0; b: GPU 1; c: GPUs 1 and 2 (waits for b); d: GPUs 0 and 1 (waits); e: every GPU (waits); f: GPU 3
    assert queue.started == ["a", "b", "f"]
    assert [(j.run, sorted(j.device_keys())) for j in queue.jobs] == [
        ("a", ["0"]), ("b", ["1"]), ("c", ["1", "2"]), ("d", ["0", "1"]), ("e", ["*"]), ("f", ["3"])]
    for job in queue.jobs:
        if job.run in ("a", "b", "f"):
            job.state = "done"
    queue.tick()
    assert queue.started == ["a", "b", "f", "c"]  # in queue order; d shares GPU 1 with c, e needs them all
    saved = json.loads((tmp_path / "outputs/.ui/jobs.json").read_text())
    assert [(j["run"], j["state"]) for j in saved["jobs"]] == [
        ("a", "done"), ("b", "done"), ("c", "running"), ("d", "queued"), ("e", "queued"), ("f", "done")]


def test_a_run_on_chosen_gpus_is_started_as_the_cli_would(tmp_path):
    root = tmp_path / "outputs"
    queue = Recorder(root)
    with TestClient(create_app(root, jobs=queue)) as client:
        answer = client.post("/api/jobs", json={"yaml": QUICKSTART, "gpus": "2", "devices": "0, 1", "fresh": True})
        assert answer.status_code == 201, answer.text
    job = queue.jobs[0]
    saved = root.resolve() / ".ui" / "configs"
    assert job.args == ["train", str(next(saved.iterdir())), f"run.output_dir={root.resolve()}/${{run.name}}", "--fresh",
                        "--gpus", "2"]
    assert (job.gpus, job.devices, job.device_keys()) == ("2", "0,1", {"0", "1"})
    assert next(saved.iterdir()).read_text() == QUICKSTART
    from toolkit.ui.jobs import launcher_command

    command, env = launcher_command(job.args)
    assert command == [str(REPO / "start_toolkit.sh"), *job.args] and env["TOOLKIT_PYTHON"] == sys.executable
