// The lora-toolkit web UI: four pages (runs, a run, new run, compare) over the server's /api. No build step,
// no libraries: it must work offline, as shipped in the Python package.
"use strict";

const main = document.getElementById("main");
let cleanup = [];  // timers and event sources of the page on screen, closed when the route changes

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== null && value !== undefined && value !== false) node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

async function api(path, body) {
  const options = body === undefined ? {} :
    {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)};
  const response = await fetch(path, options);
  const data = await response.json().catch(() => ({error: `${response.status} ${response.statusText}`}));
  if (!response.ok) {
    const err = new Error(data.error || response.statusText);
    Object.assign(err, {status: response.status, data});
    throw err;
  }
  return data;
}

function showError(message) {
  const box = document.getElementById("error");
  box.textContent = message || "";
  box.hidden = !message;
}

const fmt = {
  loss: (v) => (v === null || v === undefined ? "–" : Number(v).toFixed(4)),
  eta: (s) => {
    if (s === null || s === undefined) return "–";
    s = Math.round(s);
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    return (h ? `${h}:${String(m).padStart(2, "0")}` : `${m}`) + `:${String(r).padStart(2, "0")}`;
  },
  bytes: (b) => (b === null || b === undefined ? "" : b > 2 ** 20 ? `${(b / 2 ** 20).toFixed(1)} MiB` : `${(b / 1024).toFixed(1)} KiB`),
  time: (t) => (t ? new Date(t * 1000).toLocaleString() : ""),
  step: (row) => (row.step === null || row.step === undefined ? "–" : row.step) + (row.total_steps ? ` / ${row.total_steps}` : ""),
};

const statusBadge = (state) => el("span", {class: `status status-${state}`}, state);
const fileUrl = (run, path, download) =>
  `/api/runs/${encodeURIComponent(run)}/file/${path.split("/").map(encodeURIComponent).join("/")}${download ? "?download=1" : ""}`;

// -- charts: one SVG line chart, series [{name, color, points: [[x, y], ...]}] --------------------------------------
const COLORS = ["#1f5fa8", "#c0392b", "#1f8a4c", "#8e44ad", "#9ab"];

function drawChart(container, title, series, caption, width) {
  const W = width || 370, H = 200, L = 52, R = 10, T = 10, B = 28;
  const all = series.flatMap((s) => s.points).filter((p) => p[1] !== null && Number.isFinite(p[1]));
  container.replaceChildren();
  container.append(el("div", {class: "caption"}, el("b", {}, title), " ", el("span", {class: "last"}, caption || "")));
  container.dataset.points = String(all.length);
  if (!all.length) {
    container.append(el("div", {class: "note"}, `no ${title} logged yet`));
    return;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.05 || 1; y1 += Math.abs(y1) * 0.05 || 1; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R), sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  const add = (tag, attrs, text) => {
    const node = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
  };
  add("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "#fff", stroke: "#ddd"});
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    add("text", {x: L - 4, y: sy(y) + 3, "text-anchor": "end"}, Math.abs(y) < 0.01 && y !== 0 ? y.toExponential(1) : y.toPrecision(4));
  }
  for (const x of [x0, x1]) add("text", {x: sx(x), y: H - 10, "text-anchor": "middle"}, String(Math.round(x)));
  add("text", {x: (L + W) / 2, y: H - 1, "text-anchor": "middle"}, "step");
  series.forEach((s, i) => {
    const pts = s.points.filter((p) => p[1] !== null && Number.isFinite(p[1]));
    if (!pts.length) return;
    const color = s.color || COLORS[i % COLORS.length];
    add("polyline", {points: pts.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "), fill: "none",
                     stroke: color, "stroke-width": 1.6, class: "series", "data-name": s.name});
    if (pts.length < 3) pts.forEach((p) => add("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: color}));
    add("text", {x: L + 8, y: T + 14 + 12 * i, fill: color}, s.name);
  });
  container.append(svg);
}

// -- Runs -----------------------------------------------------------------------------------------------------------
async function runsPage() {
  const selected = new Set();
  const compareButton = el("button", {id: "compare-selected", disabled: true,
    onclick: () => { location.hash = `#/compare?runs=${[...selected].map(encodeURIComponent).join(",")}`; }}, "Compare selected");
  const body = el("tbody");
  const jobsBody = el("tbody");
  const rootNote = el("span", {class: "note"});
  main.replaceChildren(el("h1", {}, "Runs"), el("div", {class: "row"}, rootNote, compareButton,
      el("button", {class: "primary", onclick: () => { location.hash = "#/new"; }}, "New run")),
    el("table", {id: "runs-table"}, el("thead", {}, el("tr", {}, ["", "run", "status", "step", "loss", "ETA", "device", "model"]
      .map((h) => el("th", {}, h)))), body),
    el("h2", {}, "Jobs"), el("table", {id: "jobs"}, el("thead", {}, el("tr", {},
      ["job", "kind", "run", "state", "exit", "command", ""].map((h) => el("th", {}, h)))), jobsBody));
  async function refresh() {
    let data;
    try { data = await api("/api/runs"); showError(""); } catch (err) { showError(err.message); return; }
    rootNote.textContent = `outputs root: ${data.root}`;
    const names = new Set(data.runs.map((r) => r.name));
    for (const name of [...selected]) if (!names.has(name)) selected.delete(name);
    body.replaceChildren(...data.runs.map((r) => el("tr", {"data-run": r.name},
      el("td", {}, el("input", {type: "checkbox", checked: selected.has(r.name), onchange: (e) => {
        e.target.checked ? selected.add(r.name) : selected.delete(r.name);
        compareButton.disabled = selected.size < 2 || selected.size > 4;
      }})),
      el("td", {}, el("a", {href: `#/run/${encodeURIComponent(r.name)}`}, r.name)),
      el("td", {title: r.note || ""}, statusBadge(r.status)),
      el("td", {class: "num step"}, fmt.step(r)), el("td", {class: "num"}, fmt.loss(r.loss)),
      el("td", {class: "num"}, fmt.eta(r.eta_s)), el("td", {}, r.device || ""), el("td", {}, r.model || ""))));
    if (!data.runs.length) body.append(el("tr", {}, el("td", {colspan: 8, class: "note"}, "no runs yet: start one with New run")));
    compareButton.disabled = selected.size < 2 || selected.size > 4;
    jobsBody.replaceChildren(...data.jobs.map((j) => el("tr", {"data-job": j.id}, el("td", {}, j.id), el("td", {}, j.kind),
      el("td", {}, j.run), el("td", {}, j.state), el("td", {class: "num"}, j.exit_code ?? ""), el("td", {class: "note"}, j.command),
      el("td", {}, j.state === "queued" ? el("button", {onclick: () => api(`/api/jobs/${j.id}/cancel`, {}).then(refresh)
        .catch((e) => showError(e.message))}, "cancel") : ""))));
  }
  await refresh();
  const timer = setInterval(refresh, 2000);
  cleanup.push(() => clearInterval(timer));
}

// -- A run ----------------------------------------------------------------------------------------------------------
async function runPage(name) {
  const q = encodeURIComponent(name);
  const records = [];
  const head = el("div");
  const charts = {loss: el("div", {class: "chart", id: "chart-loss"}), eval: el("div", {class: "chart", id: "chart-eval"}),
                  lr: el("div", {class: "chart", id: "chart-lr"})};
  // The prompts box is made once: the checkpoint list and the sample job below it are redrawn, the box is not
  // (what the user typed, and the focus, stay).
  const promptBox = el("textarea", {id: "sample-prompts", rows: 3, spellcheck: "false",
    placeholder: "one prompt a line (empty: the run's sample.prompts; an llm trained with an objective: the first 3 prompts of its data)"});
  const checkpointList = el("div", {id: "checkpoint-list"}), sampleJobBox = el("div", {id: "sample-job-box"});
  const sections = {samples: el("section", {id: "samples"}),
                    checkpoints: el("section", {id: "checkpoints"}, el("h2", {}, "Checkpoints"),
                      el("label", {class: "prompts"}, "Prompts to sample from", promptBox), checkpointList, sampleJobBox),
                    decisions: el("section", {id: "decisions"}), config: el("section", {id: "config"}),
                    job: el("section", {id: "job"})};
  main.replaceChildren(el("h1", {}, name, " ", el("span", {id: "run-status"})), head,
    el("h2", {}, "Charts"), el("div", {class: "charts"}, charts.loss, charts.eval, charts.lr),
    sections.samples, sections.checkpoints, sections.decisions, sections.config, sections.job);
  let row = null, counts = "", source = null, poll = null, sampleIndex = null, sampleRounds = 0;

  function redrawCharts() {
    const series = (key) => {
      const byStep = new Map();
      for (const r of records) if (key in r) byStep.set(r.step, r[key]);
      return [...byStep.entries()].sort((a, b) => a[0] - b[0]);
    };
    const loss = series("loss"), smooth = series("loss_smoothed"), evals = series("eval_loss"), lr = series("lr");
    const last = (pts, digits) => (pts.length ? `step ${pts[pts.length - 1][0]}: ${Number(pts[pts.length - 1][1]).toFixed(digits)}` : "");
    drawChart(charts.loss, "loss", [{name: "loss", points: loss, color: "#9ab"}, {name: "smoothed", points: smooth, color: "#1f5fa8"}], last(loss, 4));
    drawChart(charts.eval, "eval loss", [{name: "eval loss", points: evals, color: "#c0392b"}], last(evals, 4));
    const lastLr = lr.length ? `step ${lr[lr.length - 1][0]}: ${Number(lr[lr.length - 1][1]).toExponential(2)}` : "";
    drawChart(charts.lr, "learning rate", [{name: "lr", points: lr, color: "#1f8a4c"}], lastLr);
  }

  function renderHead(r) {
    row = r;
    document.getElementById("run-status").replaceChildren(statusBadge(r.status), " ", el("span", {class: "note"}, r.note || ""));
    const live = ["running", "starting", "queued"].includes(r.status);
    head.replaceChildren(el("div", {class: "facts"},
      el("span", {}, "step ", el("b", {id: "step"}, r.step ?? "–"), r.total_steps ? ` / ${r.total_steps}` : ""),
      el("span", {}, "loss ", el("b", {id: "loss"}, fmt.loss(r.loss))), el("span", {}, "ETA ", el("b", {id: "eta"}, fmt.eta(r.eta_s))),
      el("span", {}, "device ", el("b", {id: "device"}, r.device || "–"))),
      el("div", {class: "row"},
        el("button", {id: "stop", disabled: !live, onclick: () => act("stop")}, r.status === "queued" ? "Cancel" : "Stop"),
        el("button", {id: "resume", disabled: live || r.status === "finished", onclick: () => act("resume")}, "Resume"),
        el("a", {href: fileUrl(name, "report.html"), target: "_blank"}, "report.html")));
  }

  async function act(what) {
    try { await api(`/api/runs/${q}/${what}`, {}); showError(""); } catch (err) { showError(err.message); }
    await loadDetail();
    if (what === "resume") openStream();
  }

  function renderSamples(sets) {
    const box = sections.samples;
    box.replaceChildren(el("h2", {}, "Samples"));
    if (!sets.length) { box.append(el("p", {class: "note"}, "no samples yet")); return; }
    // on the newest round (or none yet): follow a newer one (a sample job's) as it appears
    if (sampleIndex === null || sampleIndex >= sampleRounds - 1 || sampleIndex >= sets.length) sampleIndex = sets.length - 1;
    sampleRounds = sets.length;
    const label = el("b", {id: "sample-step"});
    const grid = el("div", {class: "samples-grid", id: "sample-grid"});
    const show = () => {
      const set = sets[sampleIndex];
      label.textContent = set.step !== null ? `step ${set.step}` : set.name;
      grid.replaceChildren(...set.items.map((item) => el("figure", {class: "sample"},
        item.url_path ? el("img", {src: fileUrl(name, item.url_path), alt: item.prompt}) : null,
        el("figcaption", {}, el("div", {class: "prompt"}, item.prompt), item.text !== undefined ? el("div", {class: "text"}, item.text) : null))));
    };
    const slider = el("input", {type: "range", id: "sample-slider", min: 0, max: sets.length - 1, value: sampleIndex,
      oninput: (e) => { sampleIndex = Number(e.target.value); show(); }});
    box.append(el("div", {class: "row"}, slider, label, el("span", {class: "note"}, `${sets.length} sampling rounds`)), grid);
    show();
  }

  async function startSample(step) {
    const prompts = promptBox.value.split("\n").map((p) => p.trim()).filter(Boolean);
    try { await api(`/api/runs/${q}/sample`, {step, prompts}); showError(""); } catch (err) { showError(err.message); }
    await loadDetail();
  }

  function renderSampleJob(job) {
    sampleJobBox.replaceChildren();
    if (!job) return;
    const lines = (job.log_tail || "").split("\n");
    const error = lines.map((l) => l.startsWith("error:")).lastIndexOf(true);
    const failed = job.exit_code !== null && job.exit_code !== 0;
    sampleJobBox.append(el("p", {id: "sample-job", class: "note"}, `sample job ${job.id}: ${job.state}` +
      (job.exit_code !== null ? ` (exit ${job.exit_code})` : "")),
      failed && error >= 0 ? el("pre", {id: "sample-error", class: "problem"}, lines.slice(error).join("\n")) : null,
      el("pre", {class: "log", id: "sample-log"}, job.log_tail || ""));
    const log = sampleJobBox.lastChild;
    log.scrollTop = log.scrollHeight;  // its last lines: what the job ended with
  }

  function renderCheckpoints(d) {
    const box = checkpointList;
    box.replaceChildren();
    const links = (files) => files.map((f) => el("div", {}, el("a", {href: fileUrl(name, f.url_path, true)}, f.name), " ",
      el("span", {class: "note"}, fmt.bytes(f.bytes))));
    const table = el("table", {id: "checkpoint-table"}, el("thead", {}, el("tr", {}, ["step", "saved", "LoRA files", ""].map((h) => el("th", {}, h)))),
      el("tbody", {}, d.checkpoints.map((c) => el("tr", {"data-step": c.step}, el("td", {class: "num"}, c.step),
        el("td", {}, fmt.time(c.time)), el("td", {}, links(c.files)),
        el("td", {}, el("button", {class: "sample-from", onclick: () => startSample(c.step)}, "sample from this checkpoint"), " ",
          el("button", {class: "continue-from", onclick: () => { location.hash = `#/new?continue=${q}&step=${c.step}`; }},
            "continue from this LoRA"))))));
    box.append(d.checkpoints.length ? table : el("p", {class: "note"}, "no checkpoints yet"));
    if (d.final.length) box.append(el("h3", {}, "final/ ", el("button", {id: "sample-final", onclick: () => startSample(null)},
      "sample from final/")), ...links(d.final));
    renderSampleJob(d.sample_job);
  }

  function renderDecisions(d) {
    const box = sections.decisions;
    box.replaceChildren(el("h2", {}, "Auto decisions"));
    if (!d.decisions.length) { box.append(el("p", {class: "note"}, "none recorded yet")); return; }
    box.append(el("p", {class: "note"}, `from ${d.decisions_from}`), el("table", {id: "decision-table"},
      el("thead", {}, el("tr", {}, ["key", "value", "reason", "stage", "evidence"].map((h) => el("th", {}, h)))),
      el("tbody", {}, d.decisions.map((x) => el("tr", {}, el("td", {}, x.key), el("td", {}, String(x.value)), el("td", {}, x.reason),
        el("td", {}, x.stage || ""), el("td", {}, x.evidence || ""))))));
  }

  function renderConfig(d) {
    const box = sections.config;
    const filter = el("input", {type: "search", placeholder: "filter keys", oninput: (e) => {
      for (const tr of table.querySelectorAll("tbody tr")) tr.hidden = !tr.dataset.key.includes(e.target.value);
    }});
    const table = el("table", {id: "provenance"}, el("thead", {}, el("tr", {}, ["key", "value", "source"].map((h) => el("th", {}, h)))),
      el("tbody", {}, d.provenance.map((p) => el("tr", {"data-key": p.key}, el("td", {}, p.key), el("td", {}, String(p.value)),
        el("td", {class: "source"}, p.source)))));
    box.replaceChildren(el("h2", {}, "Resolved config"), el("div", {class: "row"}, filter, el("span", {class: "note"}, d.provenance_note)), table);
  }

  function renderJob(d) {
    const box = sections.job;
    box.replaceChildren();
    if (!d.job) return;
    box.append(el("h2", {}, "Last job"), el("p", {class: "note"}, `job ${d.job.id} (${d.job.state}` +
      (d.job.exit_code !== null ? `, exit ${d.job.exit_code}` : "") + `): ${d.job.command}`),
      el("pre", {class: "log", id: "job-log"}, d.job.log_tail || ""));
  }

  async function loadDetail() {
    let d;
    try { d = await api(`/api/runs/${q}`); } catch (err) {
      if (err.status === 404) gone(); else showError(err.message);
      return null;
    }
    renderHead(d); renderSamples(d.samples); renderCheckpoints(d); renderDecisions(d); renderConfig(d); renderJob(d);
    counts = `${d.samples.length}/${d.checkpoints.length}/${d.job ? d.job.state : ""}`;
    return d;
  }

  function gone() {
    if (source) source.close();
    head.replaceChildren(el("p", {id: "gone", class: "note"}, "This run folder was deleted; it is no longer shown."));
    for (const button of main.querySelectorAll("button")) button.disabled = true;
  }

  function openStream() {
    if (source) source.close();
    clearInterval(poll);
    records.length = 0;
    source = new EventSource(`/api/runs/${q}/events`);
    source.addEventListener("metrics", (e) => { records.push(...JSON.parse(e.data)); redrawCharts(); });
    source.addEventListener("status", (e) => {
      const r = JSON.parse(e.data);
      renderHead(r);
      const now = `${r.samples}/${r.checkpoints}/${r.status}`;
      if (now !== counts) { counts = now; loadDetail(); }
    });
    source.addEventListener("gone", gone);
    source.addEventListener("end", () => {  // the run is not live: look again every 2 s, in case it is resumed
      source.close();
      loadDetail();
      poll = setInterval(async () => {
        const d = await loadDetail();
        if (d && ["running", "starting", "queued"].includes(d.status)) openStream();
      }, 2000);
    });
  }

  redrawCharts();
  if (await loadDetail()) openStream();
  cleanup.push(() => { if (source) source.close(); clearInterval(poll); });
}

// -- New run --------------------------------------------------------------------------------------------------------
async function newPage(params) {
  const gutter = el("pre", {id: "gutter"});
  const text = el("textarea", {id: "yaml", spellcheck: "false", wrap: "off"});
  const problems = el("ul", {id: "problems"});
  const example = el("select", {id: "example"});
  const preset = el("select", {id: "preset"}, el("option", {value: ""}, "(preset: as the YAML says)"));
  const gpus = el("input", {id: "gpus", size: 6, placeholder: "1"});
  const devices = el("input", {id: "devices", size: 8, placeholder: "all"});
  const fresh = el("input", {type: "checkbox", id: "fresh"});
  const start = el("button", {id: "start", class: "primary", disabled: true, onclick: submit}, "Start");
  const resolved = el("tbody");
  const runName = el("span", {id: "run-name", class: "note"});
  main.replaceChildren(el("h1", {}, "New run"),
    el("div", {class: "row"}, el("label", {}, "example ", example), el("label", {}, preset)),
    el("div", {class: "editor"}, gutter, text), problems,
    el("div", {class: "row"}, el("label", {title: "--gpus: processes, one per GPU"}, "GPUs ", gpus),
      el("label", {title: "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES"}, "devices ", devices),
      el("label", {title: "--fresh: move an existing run folder aside (never deleted)"}, fresh, " start over (--fresh)"), start, runName),
    el("details", {}, el("summary", {}, "resolved config, with the source of each value"),
      el("table", {id: "resolved"}, el("thead", {}, el("tr", {}, ["key", "value", "source"].map((h) => el("th", {}, h)))), resolved)));
  let timer = null, bad = new Map(), generation = 0;

  function drawGutter() {
    const count = text.value.split("\n").length;
    gutter.replaceChildren(...Array.from({length: count}, (_, i) => {
      const line = i + 1;
      const span = el("span", bad.has(line) ? {class: "bad", title: bad.get(line)} : {}, String(line));
      return [span, "\n"];
    }).flat());
    gutter.scrollTop = text.scrollTop;
  }
  function goToLine(line) {
    const lines = text.value.split("\n");
    const offset = lines.slice(0, line - 1).reduce((n, l) => n + l.length + 1, 0);
    text.focus();
    text.setSelectionRange(offset, offset + (lines[line - 1] || "").length);
    text.scrollTop = Math.max(0, (line - 5) * 18);
  }
  function showProblems(list, ok) {
    bad = new Map(list.filter((p) => p.line).map((p) => [p.line, p.message]));
    problems.replaceChildren(...list.map((p) => el("li", {"data-line": p.line ?? "", onclick: () => p.line && goToLine(p.line)},
      p.line ? `line ${p.line}: ${p.message}` : p.message)));
    if (ok) problems.append(el("li", {class: "ok", id: "valid"}, "config OK: checked by the same validator as `validate`"));
    drawGutter();
  }
  async function check() {
    const mine = ++generation;
    let result;
    try { result = await api("/api/validate", {yaml: text.value}); } catch (err) { showError(err.message); return; }
    if (mine !== generation) return;  // a newer check is under way
    showProblems(result.problems, result.ok);
    start.disabled = !result.ok;
    runName.textContent = !result.run ? "" : `run folder: ${result.run}` + (!result.existing ? "" :
      ` (exists, ${result.existing}: Start resumes it; "start over" moves it aside first)`);
    resolved.replaceChildren(...result.rows.map((r) => el("tr", {}, el("td", {}, r.key), el("td", {}, r.value), el("td", {class: "source"}, r.source))));
  }
  function changed() {
    start.disabled = true;
    drawGutter();
    clearTimeout(timer);
    timer = setTimeout(check, 400);
  }
  async function submit() {
    start.disabled = true;
    try {
      const r = await api("/api/jobs", {yaml: text.value, gpus: gpus.value, devices: devices.value, fresh: fresh.checked});
      showError("");
      location.hash = `#/run/${encodeURIComponent(r.run)}`;
    } catch (err) {
      showProblems(err.data && err.data.problems ? err.data.problems : [{line: null, message: err.message}], false);
    }
  }
  async function load(yamlText) { text.value = yamlText; changed(); }

  text.addEventListener("input", changed);
  text.addEventListener("scroll", () => { gutter.scrollTop = text.scrollTop; });
  cleanup.push(() => clearTimeout(timer));
  const lists = await api("/api/examples");
  example.append(el("option", {value: ""}, "(example)"), ...lists.examples.map((n) => el("option", {value: n}, n)));
  preset.append(...lists.presets.map((p) => el("option", {value: p.name, title: p.description}, `preset ${p.name}`)));
  example.addEventListener("change", async () => { if (example.value) load((await api(`/api/examples/${example.value}`)).yaml); });
  preset.addEventListener("change", async () => {
    if (!preset.value) return;
    try { load((await api("/api/preset", {yaml: text.value, preset: preset.value})).yaml); } catch (err) { showError(err.message); }
  });
  if (params.get("continue")) {
    const r = await api(`/api/runs/${encodeURIComponent(params.get("continue"))}/continue?step=${params.get("step")}`);
    load(r.yaml);
  } else {
    example.value = params.get("example") || (lists.examples.includes("quickstart_llm.yaml") ? "quickstart_llm.yaml" : "");
    load(example.value ? (await api(`/api/examples/${example.value}`)).yaml : "");
  }
}

// -- Compare --------------------------------------------------------------------------------------------------------
async function comparePage(params) {
  const names = (params.get("runs") || "").split(",").filter(Boolean);
  if (names.length < 2) {
    main.replaceChildren(el("h1", {}, "Compare"), el("p", {}, "Pick 2 to 4 runs on the ", el("a", {href: "#/"}, "Runs"), " page."));
    return;
  }
  const data = await api(`/api/compare?runs=${names.map(encodeURIComponent).join(",")}`);
  const chart = el("div", {class: "chart", id: "chart-compare"});
  drawChart(chart, "loss (smoothed)", names.map((n) => ({name: n, points: data.loss[n]})), "", 760);
  const diff = el("table", {id: "diff"}, el("thead", {}, el("tr", {}, el("th", {}, "key"), names.map((n) => el("th", {}, n)))),
    el("tbody", {}, data.diff.map((d) => el("tr", {}, el("td", {}, d.key), d.values.map((v) => el("td", {}, v))))));
  const setKey = (s) => (s.step !== null ? `step ${s.step}` : s.name);
  const keys = [...new Set(names.flatMap((n) => data.samples[n].map(setKey)))];
  const stepSelect = el("select", {id: "cmp-step"}, keys.map((k) => el("option", {value: k}, k)));
  const promptSelect = el("select", {id: "cmp-prompt"});
  const cols = el("div", {class: "compare-cols", id: "cmp-samples"});
  const itemsAt = (n) => ((data.samples[n].find((s) => setKey(s) === stepSelect.value) || {items: []}).items);
  function fillPrompts() {
    const prompts = [...new Set(names.flatMap((n) => itemsAt(n).map((i) => i.prompt)))];
    promptSelect.replaceChildren(...prompts.map((p) => el("option", {value: p}, p)));
    showSamples();
  }
  function showSamples() {
    cols.replaceChildren(...names.map((n) => {
      const item = itemsAt(n).find((i) => i.prompt === promptSelect.value);
      return el("figure", {class: "sample", "data-run": n}, el("div", {class: "prompt"}, n),
        !item ? el("div", {class: "note"}, "no sample for this step and prompt") :
        item.url_path ? el("img", {src: fileUrl(n, item.url_path), alt: item.prompt}) : el("div", {class: "text"}, item.text));
    }));
  }
  stepSelect.addEventListener("change", fillPrompts);
  promptSelect.addEventListener("change", showSamples);
  if (keys.length) stepSelect.value = keys.filter((k) => names.every((n) => data.samples[n].some((s) => setKey(s) === k))).pop() || keys[0];
  main.replaceChildren(el("h1", {}, "Compare"), el("p", {}, names.map((n, i) => [i ? ", " : "", el("a", {href: `#/run/${encodeURIComponent(n)}`}, n)])),
    el("h2", {}, "Loss"), chart, el("h2", {}, `Config diff (${data.diff.length} keys differ)`), diff,
    el("h2", {}, "Samples"), el("div", {class: "row"}, stepSelect, promptSelect), cols);
  fillPrompts();
}

// -- routing --------------------------------------------------------------------------------------------------------
async function route() {
  cleanup.forEach((f) => f());
  cleanup = [];
  showError("");
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const params = new URLSearchParams(query || "");
  const parts = (path || "/").split("/").filter(Boolean);
  for (const a of document.querySelectorAll("header nav a")) a.classList.remove("active");
  try {
    if (parts[0] === "run" && parts[1]) await runPage(decodeURIComponent(parts[1]));
    else if (parts[0] === "new") { document.getElementById("nav-new").classList.add("active"); await newPage(params); }
    else if (parts[0] === "compare") { document.getElementById("nav-compare").classList.add("active"); await comparePage(params); }
    else { document.getElementById("nav-runs").classList.add("active"); await runsPage(); }
  } catch (err) {
    showError(err.message);
  }
}

window.addEventListener("hashchange", route);
route();
