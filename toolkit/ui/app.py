"""The UI's HTTP API (Starlette) and its one page. Every answer is read from the run folders at request time;
jobs go through jobs.JobQueue."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from functools import lru_cache
from pathlib import Path

import yaml
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from toolkit.errors import UserError
from toolkit.ui import configs, run_files
from toolkit.ui.auth import TokenGate
from toolkit.ui.jobs import Job, JobQueue, JobRefused, parse_gpus
from toolkit.ui.runs import RUN_NAME, run_names, summary

STATIC = Path(__file__).parent / "static"
LIVE = ("running", "queued", "starting")


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status)


def _job_json(job: Job | None, tail: int = 0) -> dict | None:
    if job is None:
        return None
    data = {k: getattr(job, k) for k in ("id", "kind", "run", "state", "exit_code", "queued_at", "started_at",
                                         "ended_at", "gpus", "devices", "stop_requested")}
    data["command"] = " ".join(job.args)
    if tail:
        try:
            data["log_tail"] = "\n".join(Path(job.log).read_text(encoding="utf-8", errors="replace")
                                         .splitlines()[-tail:])
        except OSError:
            data["log_tail"] = ""
    return data


def _flat(config: dict) -> dict[str, object]:
    from toolkit.config.load import flatten

    return dict(flatten(config))


@lru_cache(maxsize=64)
def _job_sources(config_file: str, overrides: tuple[str, ...]) -> dict[str, str]:
    """Where each value of a UI job's config came from: load_run over the YAML the UI saved and its overrides."""
    from toolkit.plan.run import load_run

    label = Path(config_file).name
    rows = load_run([config_file], list(overrides)).provenance()
    return {key: configs.UI_LABEL if source == "command line" else source.replace(config_file, label)
            for key, _, source in rows}


def provenance(run: Path, job: Job | None, decided: dict[str, str]) -> tuple[list[dict], str]:
    """The resolved config (the run's config.yaml, as the run wrote it) with each value's source."""
    config = run_files.read_config(run)
    note = ""
    sources: dict[str, str] = {}
    if job is not None and job.config_file and Path(job.config_file).is_file():
        try:
            sources = _job_sources(job.config_file, tuple(job.overrides))
            note = f"sources: the YAML this UI started the run with ({Path(job.config_file).name}) and its overrides"
        except UserError as err:
            note = f"the sources could not be read again: {str(err).splitlines()[0]}"
    if not sources:
        from toolkit.config.layers import read_yaml_layer

        with contextlib.suppress(UserError):
            layer = read_yaml_layer(run / "config.yaml", label="config.yaml")
            sources = {key: layer.where(key) for key in layer.lines}
        note = note or "started outside this UI: the run folder keeps only its resolved config.yaml"
    rows = [{"key": key, "value": value, "source": f"auto: {decided[key]}" if key in decided
             else sources.get(key, "default")} for key, value in _flat(config).items()]
    return rows, note


def create_app(root: Path, token: str | None = None, local_only: bool = False, jobs: JobQueue | None = None) -> Starlette:
    """The UI for the runs under `root`; `local_only` refuses requests whose Host is not a local name."""
    root = root.resolve()
    queue = jobs or JobQueue(root)

    def latest_job(name: str) -> Job | None:
        return queue.latest(name)

    def run_or_404(name: str) -> Path:
        if not RUN_NAME.fullmatch(name):
            raise _NotFound(f"no run named {name!r}")
        return root / name

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    def list_runs(request: Request) -> Response:
        names = set(run_names(root)) | {j.run for j in queue.active() if j.kind == "train"}
        rows = [s for s in (summary(root, n, latest_job(n)) for n in sorted(names)) if s is not None]
        with queue.lock:
            recent = [j for j in queue.jobs if j.state in ("done", "cancelled")][-10:]
        return JSONResponse({"root": str(root), "runs": rows,
                             "jobs": [_job_json(j) for j in queue.active() + recent[::-1]]})

    def run_detail(request: Request) -> Response:
        name = request.path_params["name"]
        run = run_or_404(name)
        job = latest_job(name)
        row = summary(root, name, job)
        if row is None:
            return _error(f"run folder {run} does not exist (deleted?)", 404)
        decisions, decided_from = run_files.decisions(run, Path(job.log) if job else None)
        rows, note = provenance(run, job, {d["key"]: d["reason"] for d in decisions if d.get("key")})
        try:
            config_text = (run / "config.yaml").read_text(encoding="utf-8")
        except OSError:
            config_text = ""
        return JSONResponse({**row, "config_yaml": config_text, "provenance": rows, "provenance_note": note,
                             "decisions": decisions, "decisions_from": decided_from,
                             "checkpoints": run_files.checkpoints(run), "final": run_files.final_files(run),
                             "samples": run_files.sample_sets(run), "report": (run / "report.html").is_file(),
                             "job": _job_json(job, tail=40), "sample_job": _job_json(queue.latest(name, "sample"), 40)})

    def metrics(request: Request) -> Response:
        run = run_or_404(request.path_params["name"])
        records, offset = run_files.read_records(run / "logs" / "metrics.jsonl", int(request.query_params.get("offset", 0)))
        return JSONResponse({"records": records, "offset": offset})

    async def events(request: Request) -> Response:
        """Server-sent events: new metrics records, and the run's row whenever it changes; `end` once the run is
        no longer live and everything was sent, `gone` when its folder disappears."""
        name = request.path_params["name"]
        run = run_or_404(name)

        async def stream():
            offset, last = 0, None
            while True:
                records, offset = run_files.read_records(run / "logs" / "metrics.jsonl", offset)
                if records:
                    yield f"event: metrics\ndata: {json.dumps(records)}\n\n"
                row = summary(root, name, latest_job(name))
                if row is None:
                    yield "event: gone\ndata: {}\n\n"
                    return
                row["samples"] = len(run_files.sample_sets(run))
                row["checkpoints"] = len(run_files.checkpoints(run))
                row.pop("updated", None)
                if row != last:
                    yield f"event: status\ndata: {json.dumps(row)}\n\n"
                    last = row
                elif not records and row["status"] not in LIVE:
                    yield "event: end\ndata: {}\n\n"
                    return
                await asyncio.sleep(0.5)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    def run_file(request: Request) -> Response:
        run = run_or_404(request.path_params["name"])
        path = (run / request.path_params["path"]).resolve()
        if run.resolve() not in path.parents or not path.is_file():
            return _error(f"no file {request.path_params['path']} in run {run.name}", 404)
        download = request.query_params.get("download") == "1"
        return FileResponse(path, filename=path.name if download else None,
                            content_disposition_type="attachment" if download else "inline")

    async def stop(request: Request) -> Response:
        name = request.path_params["name"]
        run_or_404(name)
        return JSONResponse({"message": queue.stop(name)})

    async def resume(request: Request) -> Response:
        name = request.path_params["name"]
        if not run_or_404(name).is_dir():
            return _error(f"run folder {root / name} does not exist (deleted?)", 404)
        args, gpus, devices, config_file, overrides = queue.resume_args(name)
        job = queue.submit("train", name, args, gpus, devices, config_file, overrides)
        return JSONResponse({"job": _job_json(job)}, 201)

    async def sample(request: Request) -> Response:
        """Queue `sample RUN [--checkpoint STEP] [--prompt=TEXT ...]` from {"step": N or null, "prompts": [...]}; with
        no prompts, `sample` takes the run's sample.prompts (or its training data's, and says so in the job's log)."""
        name = request.path_params["name"]
        run = run_or_404(name)
        if not run.is_dir():
            return _error(f"run folder {run} does not exist (deleted?)", 404)
        body = await request.json()
        step, prompts = body.get("step"), body.get("prompts", [])
        if not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)):
            raise UserError("prompts: expected a list of strings, one prompt each")
        args = ["sample", str(run)] + (["--checkpoint", str(int(step))] if step is not None else [])
        # --prompt=TEXT: a prompt that starts with '-' stays the option's value
        args += [f"--prompt={p.strip()}" for p in prompts if p.strip()]
        job = queue.submit("sample", name, args)
        return JSONResponse({"job": _job_json(job)}, 201)

    def continue_from(request: Request) -> Response:
        """New run's YAML to continue from a checkpoint's LoRA: the run's own config, a new name, and
        network.init_from set to the checkpoint."""
        name = request.path_params["name"]
        run = run_or_404(name)
        step = int(request.query_params["step"])
        folder = run / "checkpoints" / f"step-{step:06d}"
        if not (folder / "meta.json").is_file():
            return _error(f"run {name} has no finished checkpoint at step {step}", 404)
        job = latest_job(name)
        source = Path(job.config_file) if job and job.config_file else run / "config.yaml"
        text = source.read_text(encoding="utf-8") if source.is_file() else (run / "config.yaml").read_text("utf-8")
        new_name, n = f"{name}-from-{step}", 2
        while (root / new_name).exists():
            new_name, n = f"{name}-from-{step}-{n}", n + 1
        text = configs.set_yaml_key(text, "run.name", new_name)
        if (yaml.safe_load(text).get("run") or {}).get("output_dir") is not None:
            text = configs.set_yaml_key(text, "run.output_dir", str(root / new_name))
        return JSONResponse({"yaml": configs.set_yaml_key(text, "network.init_from", str(folder)), "run": new_name})

    def examples(request: Request) -> Response:
        return JSONResponse({"examples": configs.example_names(), "presets": configs.preset_list()})

    def example(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in configs.example_names():
            return _error(f"no example named {name}", 404)
        return JSONResponse({"yaml": (configs.EXAMPLES_DIR / name).read_text(encoding="utf-8")})

    async def with_preset(request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"yaml": configs.set_yaml_key(str(body["yaml"]), "device.preset", str(body["preset"]))})

    async def validate(request: Request) -> Response:
        """The validator's answer, and the status of the run folder the config names when it exists (Start then
        resumes it, or with --fresh moves it aside)."""
        body = await request.json()
        result = await asyncio.to_thread(configs.validate_text, str(body.get("yaml", "")), root)
        existing = summary(root, result["run"], latest_job(result["run"])) if result["run"] else None
        result["existing"] = existing["status"] if existing and (root / result["run"]).is_dir() else None
        return JSONResponse(result)

    async def start_job(request: Request) -> Response:
        """Check the YAML as `validate` does (invalid: 400 with the problems, nothing started), save it under .ui/,
        and queue `train` on it."""
        body = await request.json()
        text = str(body.get("yaml", ""))
        gpus, devices = parse_gpus(str(body.get("gpus", "")), str(body.get("devices", "")))
        checked = await asyncio.to_thread(configs.validate_text, text, root)
        if not checked["ok"]:
            return JSONResponse({"error": "the config has problems", "problems": checked["problems"]}, 400)
        name = checked["run"]
        saved = queue.dir / "configs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{int(time.time() * 1e6) % 10**6}.yaml"
        saved.write_text(text, encoding="utf-8")
        overrides = configs.output_override(text, root)
        args = ["train", str(saved), *overrides] + (["--fresh"] if body.get("fresh") else [])
        args += ["--gpus", gpus] if gpus else []
        try:
            job = queue.submit("train", name, args, gpus, devices, str(saved), overrides)
        except JobRefused:
            saved.unlink()
            raise
        return JSONResponse({"job": _job_json(job), "run": name}, 201)

    async def cancel_job(request: Request) -> Response:
        job = queue.get(request.path_params["id"])
        if job is None:
            return _error("no such job", 404)
        return JSONResponse({"message": queue.stop(job.run) if job.state in ("queued", "running") else "already ended"})

    def compare(request: Request) -> Response:
        names = [n for n in request.query_params.get("runs", "").split(",") if n]
        if not 2 <= len(names) <= 4:
            return _error("compare 2 to 4 runs (?runs=a,b)", 400)
        folders = [run_or_404(n) for n in names]
        missing = [f.name for f in folders if not f.is_dir()]
        if missing:
            return _error(f"no run folder {', '.join(missing)} (deleted?)", 404)
        loss = {}
        for folder in folders:
            records, _ = run_files.read_records(folder / "logs" / "metrics.jsonl")
            by_step = {r["step"]: r.get("loss_smoothed", r.get("loss")) for r in records if "loss" in r}
            loss[folder.name] = sorted(by_step.items())
        flat = [_flat(run_files.read_config(f)) for f in folders]
        keys = sorted(set().union(*flat))
        shown = [{k: v if isinstance(v, str) else json.dumps(v, default=str) for k, v in f.items()} for f in flat]
        diff = [{"key": k, "values": [s.get(k, "—") for s in shown]} for k in keys if len({s.get(k) for s in shown}) > 1]
        return JSONResponse({"runs": names, "loss": loss, "diff": diff,
                             "samples": {f.name: run_files.sample_sets(f) for f in folders}})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        queue.start_thread()
        try:
            yield
        finally:
            queue.stop_thread()

    async def user_error(request: Request, exc: Exception) -> Response:
        return _error(str(exc), 409 if isinstance(exc, JobRefused) else 400)

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(str(exc), 404)

    routes = [
        Route("/", index),
        Route("/api/runs", list_runs),
        Route("/api/runs/{name}", run_detail),
        Route("/api/runs/{name}/metrics", metrics),
        Route("/api/runs/{name}/events", events),
        Route("/api/runs/{name}/file/{path:path}", run_file),
        Route("/api/runs/{name}/stop", stop, methods=["POST"]),
        Route("/api/runs/{name}/resume", resume, methods=["POST"]),
        Route("/api/runs/{name}/sample", sample, methods=["POST"]),
        Route("/api/runs/{name}/continue", continue_from),
        Route("/api/examples", examples),
        Route("/api/examples/{name}", example),
        Route("/api/preset", with_preset, methods=["POST"]),
        Route("/api/validate", validate, methods=["POST"]),
        Route("/api/jobs", start_job, methods=["POST"]),
        Route("/api/jobs/{id}/cancel", cancel_job, methods=["POST"]),
        Route("/api/compare", compare),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(TokenGate, token=token, local_only=local_only)],
                     exception_handlers={UserError: user_error, _NotFound: not_found})


class _NotFound(Exception):
    """A run name that cannot name a folder under the root."""
