// keel dashboard: one page, its views (#runs, #run=NAME, #data, #jobs, #experiments, #sql). Every view polls
// the server's JSON endpoints (see keel/dashboard/server.py) and redraws without a reload.
// Charts are uPlot; window.keelCharts holds them by name (tests read their data from there).
"use strict";

const POLL_MS = 2000;
const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#0a7b83", "#e16f24",
  "#57606a"];
const TABLE_METRICS = ["loss", "eval_bpb", "mfu", "tokens_per_s"];
const CHART_METRICS = ["loss", "eval_loss", "eval_bpb", "lr", "grad_norm", "tokens_per_s", "mfu"];
window.keelCharts = {};

const runsState = { selected: null, metric: "loss", smoothing: 0, filter: "", group: "" };
let refresh = null; // the current view's poll function
let timer = null;
let polls = 0; // poll() calls so far: only the latest schedules the next

// -- helpers ------------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== null && value !== undefined) node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

async function api(path, options) {
  const response = await fetch(path, options);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function showError(error) {
  const banner = document.getElementById("error");
  banner.textContent = error ? `error: ${error.message || error}` : "";
  banner.hidden = !error;
}

function fmt(value, digits = 4) {
  if (value === null || value === undefined) return "";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return value.toLocaleString("en");
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString("en");
  return value.toPrecision(digits);
}

function bytes(value) {
  if (value === null || value === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let size = value, unit = 0;
  while (size >= 1024 && unit < units.length - 1) { size /= 1024; unit += 1; }
  return `${unit ? size.toFixed(1) : size} ${units[unit]}`;
}

// Replace a polled box's content only when the data behind it changed: a poll that finds the same
// data leaves the page as it is (no flicker; text selection, focus and element handles survive).
const renderedData = new WeakMap(); // box element -> JSON of the data it shows
function renderIfChanged(box, data, build) {
  const key = JSON.stringify(data);
  if (renderedData.get(box) === key) return;
  renderedData.set(box, key);
  box.replaceChildren(build());
}

function table(id, headers, rows) {
  return el("table", { id },
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows));
}

function cell(value, numeric) {
  return el("td", { class: numeric ? "num" : "" }, numeric ? fmt(value) : value ?? "");
}

function q(params) {
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    for (const item of [].concat(value)) search.append(key, item);
  }
  return search.toString();
}

// -- charts ---------------------------------------------------------------------------------------

// series: [{label, steps, values}] -> uPlot data over the union of steps (gaps as null).
function aligned(series, smoothing) {
  const xs = [...new Set(series.flatMap((s) => s.steps))].sort((a, b) => a - b);
  const columns = series.map((s) => {
    const values = smooth(s.values, smoothing);
    const byStep = new Map(s.steps.map((step, i) => [step, values[i]]));
    return xs.map((x) => (byStep.has(x) ? byStep.get(x) : null));
  });
  return [xs, ...columns];
}

// Exponential moving average with bias correction (weight = smoothing in [0, 1)); 0: raw.
function smooth(values, weight) {
  if (!weight) return values;
  let average = 0;
  return values.map((value, i) => {
    average = weight * average + (1 - weight) * value;
    return average / (1 - weight ** (i + 1));
  });
}

function drawChart(name, container, title, series, smoothing = 0) {
  const data = aligned(series, smoothing);
  const labels = series.map((s) => s.label).join("\u0000");
  let chart = window.keelCharts[name];
  if (chart && chart.keelLabels === labels && chart.root.parentNode === container) {
    chart.setData(data);
    return chart;
  }
  if (chart) chart.destroy();
  container.replaceChildren();
  chart = new uPlot({
    title,
    width: Math.max(360, Math.min(container.clientWidth || 560, 900)),
    height: 260,
    scales: { x: { time: false } },
    axes: [{ label: "step" }, { size: 64, values: (u, ticks) => ticks.map(tick) }],
    series: [{ label: "step" }, ...series.map((s, i) => ({
      label: s.label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
    }))],
  }, data, container);
  chart.keelLabels = labels;
  window.keelCharts[name] = chart;
  return chart;
}

// An axis label: 3 significant digits, small and large values in exponent form.
function tick(value) {
  if (value === 0) return "0";
  const size = Math.abs(value);
  if (size < 1e-2 || size >= 1e6) return value.toExponential(1);
  return String(Number(value.toPrecision(3)));
}

function dropCharts() {
  for (const chart of Object.values(window.keelCharts)) chart.destroy();
  window.keelCharts = {};
}

// -- runs -----------------------------------------------------------------------------------------

function viewRuns(main) {
  const metric = el("select", { id: "metric", onchange: (e) => { runsState.metric = e.target.value; poll(); } },
    CHART_METRICS.map((m) => el("option", { value: m }, m)));
  metric.value = runsState.metric;
  const smoothing = el("input", { id: "smoothing", type: "range", min: "0", max: "0.99", step: "0.01",
    value: String(runsState.smoothing), oninput: (e) => { runsState.smoothing = Number(e.target.value); poll(); } });
  const filter = el("input", { id: "run-filter", placeholder: "filter runs", value: runsState.filter,
    oninput: (e) => { runsState.filter = e.target.value; poll(); } });
  const group = el("select", { id: "run-group", onchange: (e) => { runsState.group = e.target.value; poll(); } },
    el("option", { value: "" }, "no grouping"), el("option", { value: "experiment" }, "group by experiment"),
    el("option", { value: "state" }, "group by state"));
  group.value = runsState.group;
  main.append(
    el("section", {}, el("h2", {}, "Runs"), el("div", { class: "controls" }, filter, group),
      el("div", { id: "runs-table-box" })),
    el("section", {}, el("h2", {}, "Metrics"),
      el("div", { class: "controls" }, el("label", {}, "metric ", metric),
        el("label", {}, "smoothing ", smoothing, el("span", { id: "smoothing-value" }, String(runsState.smoothing)))),
      el("div", { id: "runs-chart" })),
    el("section", {}, el("h2", {}, "Config diff"),
      el("div", { class: "controls" }, el("select", { id: "diff-a", onchange: () => showDiff() }),
        "vs", el("select", { id: "diff-b", onchange: () => showDiff() })),
      el("div", { id: "diff-box" })));
  return async () => {
    const { runs } = await api("/api/runs");
    if (runsState.selected === null) runsState.selected = new Set(runs.map((r) => r.run));
    renderRunsTable(runs);
    fillDiffSelects(runs);
    document.getElementById("smoothing-value").textContent = String(runsState.smoothing);
    const shown = runs.filter((r) => runsState.selected.has(r.run) && matches(r));
    const answers = await Promise.all(shown.map((r) =>
      api(`/api/metrics?${q({ run: r.run, name: runsState.metric })}`)));
    const series = answers.map((a) => ({ label: a.run.split("/").pop(), run: a.run,
      steps: a.series[runsState.metric][0], values: a.series[runsState.metric][1] }));
    drawChart("runs", document.getElementById("runs-chart"), runsState.metric, series, runsState.smoothing);
    window.keelCharts.runs.keelRuns = series.map((s) => s.run);
  };
}

function matches(run) {
  const text = runsState.filter.trim().toLowerCase();
  return !text || [run.run, run.state, run.experiment].some((v) => (v || "").toLowerCase().includes(text));
}

function renderRunsTable(runs) {
  const box = document.getElementById("runs-table-box");
  const state = [runs, [...runsState.selected], runsState.filter, runsState.group];
  renderIfChanged(box, state, () => runsTable(runs));
}

function runsTable(runs) {
  const rows = [];
  const visible = runs.filter(matches);
  const key = runsState.group;
  const groups = new Map();
  for (const run of visible) {
    const name = key ? (run[key] || "(none)") : "";
    if (!groups.has(name)) groups.set(name, []);
    groups.get(name).push(run);
  }
  for (const [name, members] of groups) {
    if (key) rows.push(el("tr", { class: "group" }, el("td", { colspan: "9" }, `${key}: ${name} (${members.length})`)));
    for (const run of members) {
      const box = el("input", { type: "checkbox", class: "run-select", onchange: (e) => {
        if (e.target.checked) runsState.selected.add(run.run); else runsState.selected.delete(run.run);
        poll();
      } });
      box.checked = runsState.selected.has(run.run);
      rows.push(el("tr", { "data-run": run.run },
        el("td", {}, box),
        el("td", {}, el("a", { href: `#run=${encodeURIComponent(run.run)}` }, run.name)),
        el("td", { class: `state-${run.state}` }, run.state),
        cell(run.experiment), cell(run.step, true),
        ...TABLE_METRICS.map((m) => cell(run[m], true))));
    }
  }
  return table("runs-table",
    ["", "run", "state", "experiment", "step", "loss", "bits/byte", "MFU", "tokens/s"], rows);
}

function fillDiffSelects(runs) {
  for (const [id, index] of [["diff-a", 0], ["diff-b", 1]]) {
    const select = document.getElementById(id);
    const names = runs.map((r) => r.run);
    const current = [...select.options].map((o) => o.value);
    if (current.join("\n") === names.join("\n")) continue;
    const keep = select.value;
    select.replaceChildren(...names.map((n) => el("option", { value: n }, n.split("/").pop())));
    select.value = names.includes(keep) ? keep : names[Math.min(index, names.length - 1)] || "";
    if (id === "diff-b") showDiff();
  }
}

async function showDiff() {
  const a = document.getElementById("diff-a").value, b = document.getElementById("diff-b").value;
  const box = document.getElementById("diff-box");
  if (!a || !b) { box.replaceChildren(); return; }
  const diff = await api(`/api/config-diff?${q({ a, b })}`);
  const show = (v) => (v === undefined || v === null ? "(absent)" : JSON.stringify(v));
  box.replaceChildren(diff.rows.length ? table("diff-table", ["key", a.split("/").pop(), b.split("/").pop()],
    diff.rows.map((r) => el("tr", { "data-key": r.key }, el("td", {}, r.key),
      el("td", { class: "diff-a" }, show(r.a)), el("td", { class: "diff-b" }, show(r.b)))))
    : el("p", { id: "diff-table" }, "the two configs are the same"));
}

// -- one run --------------------------------------------------------------------------------------

function viewRun(main, run) {
  main.append(el("section", {}, el("h2", {}, `Run ${run}`), el("div", { class: "charts", id: "run-charts" })),
    el("section", {}, el("h2", {}, "Evaluation"), el("div", { id: "eval-box" })));
  const panels = [
    ["run-loss", "loss", (n) => ["loss", "eval_loss"].includes(n)],
    ["run-lr", "learning rate", (n) => n === "lr"],
    ["run-grad-norm", "gradient norm", (n) => n === "grad_norm"],
    ["run-router-load", "router load (max / mean, per layer)", (n) => n.startsWith("router.load_max_over_mean.")],
    ["run-drop-rate", "router drop rate (per layer)", (n) => n.startsWith("router.drop_rate.")],
    ["run-throughput", "tokens/s", (n) => n === "tokens_per_s"],
  ];
  return async () => {
    const { names } = await api(`/api/metric-names?${q({ run })}`);
    const wanted = names.filter((n) => panels.some(([, , pick]) => pick(n)) || n.startsWith("eval"));
    const { series } = await api(`/api/metrics?${q({ run, name: wanted })}`);
    const box = document.getElementById("run-charts");
    for (const [name, title, pick] of panels) {
      const chosen = names.filter(pick);
      let holder = document.getElementById(name);
      if (!chosen.length) { if (holder) holder.remove(); continue; }
      if (!holder) { holder = el("div", { id: name }); box.append(holder); }
      drawChart(name, holder, title, chosen.map((n) => ({ label: n, steps: series[n][0], values: series[n][1] })));
    }
    const evals = names.filter((n) => n.startsWith("eval"));
    const latest = evals.map((n) => [n, series[n][0].at(-1), series[n][1].at(-1)]);
    renderIfChanged(document.getElementById("eval-box"), latest, () => table("eval-table",
      ["metric", "step", "value"],
      latest.map(([n, step, value]) => el("tr", {}, cell(n), cell(step, true), cell(value, true)))));
  };
}

// -- data -----------------------------------------------------------------------------------------

function viewData(main) {
  main.append(el("section", {}, el("h2", {}, "DataKit stages: documents and bytes in, kept, dropped by reason"),
    el("div", { id: "stages-box" })));
  return async () => {
    const { stages } = await api("/api/stages");
    renderIfChanged(document.getElementById("stages-box"), stages, () => stagesTable(stages));
  };
}

function stagesTable(stages) {
  const rows = stages.map((s) => {
    const kept = s.documents_in ? s.documents_out / s.documents_in : 1;
    const bar = el("div", { class: "bar" }, el("div", {}));
    bar.firstChild.style.width = `${Math.round(kept * 100)}%`;
    const reasons = Object.entries(s.dropped).map(([r, n]) => `${r}: ${n}`).join(", ");
    return el("tr", { "data-step": s.step }, cell(s.step), cell(s.stage),
      el("td", { class: "num docs-in" }, fmt(s.documents_in)),
      el("td", { class: "num docs-out" }, fmt(s.documents_out)), el("td", {}, bar),
      el("td", { class: "num docs-dropped" }, fmt(s.documents_in - s.documents_out)),
      el("td", { class: "reasons" }, reasons), el("td", { class: "num" }, bytes(s.bytes_in)),
      el("td", { class: "num" }, bytes(s.bytes_out)), cell(s.tokens, true));
  });
  return table("stages-table",
    ["step", "stage", "documents in", "kept", "", "dropped", "dropped by reason", "bytes in",
      "bytes kept", "tokens"], rows);
}

// -- steps & jobs ---------------------------------------------------------------------------------

function viewJobs(main) {
  const search = el("input", { id: "log-search", placeholder: "text in task logs" });
  main.append(
    el("section", {}, el("h2", {}, "Steps"), el("div", { id: "steps-box" })),
    el("section", {}, el("h2", {}, "Jobs"), el("div", { id: "jobs-box" }), el("pre", { id: "job-log", hidden: "" })),
    el("section", {}, el("h2", {}, "Log search"),
      el("form", { class: "controls", onsubmit: (e) => { e.preventDefault(); searchLogs(search.value); } },
        search, el("button", { id: "log-search-run" }, "search")),
      el("div", { id: "search-box" })));
  return async () => {
    const [{ steps }, { jobs }] = await Promise.all([api("/api/steps"), api("/api/jobs")]);
    renderIfChanged(document.getElementById("steps-box"), steps, () => table("steps-table",
      ["step", "state", "depends on", "started", "ended", "error"],
      steps.map((s) => el("tr", { "data-step": s.step }, cell(s.step),
        el("td", { class: `state-${s.state.toLowerCase()}` }, s.state), cell(s.depends_on.join(", ")),
        cell(isoTime(s.start)), cell(isoTime(s.end)), cell(s.error)))));
    renderIfChanged(document.getElementById("jobs-box"), jobs, () => table("jobs-table",
      ["job", "name", "state", "cluster", "submitted", "ended", ""],
      jobs.map((j) => el("tr", { "data-job": j.id }, cell(j.id), cell(j.name),
        el("td", { class: `state-${j.state}` }, j.state), cell(j.cluster),
        cell(when(j.submitted_at)), cell(when(j.ended_at)),
        el("td", {}, el("button", { class: "show-log", onclick: () => showLog(j.id) }, "logs"))))));
  };
}

// -- experiments ----------------------------------------------------------------------------------

function viewExperiments(main) {
  main.append(el("section", {},
    el("h2", {}, "Experiment records: hypothesis, runs, report"), el("div", { id: "experiments-box" })));
  return async () => {
    const { experiments } = await api("/api/experiments");
    renderIfChanged(document.getElementById("experiments-box"), experiments,
      () => experimentsTable(experiments));
  };
}

function experimentsTable(experiments) {
  const rows = experiments.map((x) => el("tr", { "data-experiment": x.id }, cell(x.id),
    cell(x.name), el("td", { class: "hypothesis" }, x.hypothesis), cell(x.status),
    el("td", { class: "num" }, fmt(x.runs)), el("td", { class: "num" }, fmt(x.failed)),
    el("td", {}, x.issue ? el("a", { href: x.issue, rel: "noopener" }, "issue") : ""),
    el("td", {}, x.report
      ? el("a", { class: "report", href: `/experiments/${encodeURIComponent(x.id)}/report`, target: "_blank" }, "report")
      : el("span", { class: "muted" }, `keel experiment report ${x.id}`))));
  return table("experiments-table",
    ["id", "name", "hypothesis", "status", "runs", "failed or stopped", "", "report"], rows);
}

function isoTime(text) {
  return text ? text.replace("T", " ").slice(0, 19) : "";
}

function when(seconds) {
  return seconds ? new Date(seconds * 1000).toISOString().replace("T", " ").slice(0, 19) : "";
}

async function showLog(jobId) {
  const answer = await api(`/api/jobs/${encodeURIComponent(jobId)}/logs`);
  const log = document.getElementById("job-log");
  log.textContent = answer.tasks.map((t) =>
    `# ${jobId} replica ${t.replica} (${answer.state})\n${t.stdout}${t.stderr ? `\n# stderr\n${t.stderr}` : ""}`).join("\n");
  log.hidden = false;
  log.dataset.job = jobId;
}

async function searchLogs(text) {
  try {
    document.getElementById("search-box").replaceChildren(resultTable("search-results", await api(`/api/search?${q({ q: text })}`)));
    showError(null);
  } catch (error) { showError(error); }
}

function resultTable(id, result) {
  return el("div", {}, el("p", { class: "muted" }, `${result.total} rows`),
    table(id, result.columns, result.rows.map((row) => el("tr", {}, row.map((v) => cell(v, typeof v === "number"))))));
}

// -- SQL ------------------------------------------------------------------------------------------

function viewSql(main) {
  const box = el("textarea", { id: "sql", spellcheck: "false" });
  box.value = 'SELECT run, name, count(*) AS rows, max(step) AS last_step\nFROM "train.metrics" GROUP BY run, name ORDER BY run, name';
  main.append(el("section", {}, el("h2", {}, "SQL over the telemetry namespaces (read-only)"), box,
    el("div", { class: "controls" }, el("button", { id: "sql-run", onclick: () => runSql(box.value) }, "run")),
    el("div", { id: "sql-box" })),
  el("section", {}, el("h2", {}, "Namespaces"), el("div", { id: "namespaces" })));
  api("/api/overview").then((o) => document.getElementById("namespaces").replaceChildren(
    ...Object.entries(o.namespaces).map(([n, cols]) => el("p", {}, el("code", {}, `"${n}"`), " ",
      Object.entries(cols).map(([c, t]) => `${c} ${t}`).join(", ")))));
  return null;
}

async function runSql(sql) {
  try {
    const result = await api("/api/sql", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ sql }) });
    document.getElementById("sql-box").replaceChildren(resultTable("sql-result", result));
    showError(null);
  } catch (error) { showError(error); }
}

// -- routing --------------------------------------------------------------------------------------

function route() {
  const hash = decodeURIComponent(location.hash.slice(1)) || "runs";
  const main = document.getElementById("view");
  dropCharts();
  main.replaceChildren();
  const view = hash.startsWith("run=") ? "run" : hash;
  for (const link of document.querySelectorAll("nav a")) {
    link.classList.toggle("active", link.dataset.view === (view === "run" ? "runs" : view));
  }
  const views = { runs: viewRuns, data: viewData, jobs: viewJobs, experiments: viewExperiments,
    sql: viewSql };
  refresh = view === "run" ? viewRun(main, hash.slice(4)) : (views[view] || viewRuns)(main);
  poll();
}

// Run the view's refresh now, then every POLL_MS; a call while one is running (a control
// changed) supersedes it, so there is only ever one chain of timers.
async function poll() {
  clearTimeout(timer);
  if (!refresh) return;
  const generation = ++polls;
  try {
    await refresh();
    if (generation === polls) showError(null);
  } catch (error) { if (generation === polls) showError(error); }
  if (generation === polls) timer = setTimeout(poll, POLL_MS);
}

window.addEventListener("hashchange", route);
api("/api/overview").then((o) => { document.getElementById("source").textContent = o.label; }, showError);
route();
