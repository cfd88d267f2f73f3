// PlexRL dashboard: reads only the /plexrl/v1 API, with the API key the user gives it.
// No framework and nothing fetched from outside the gateway (a cluster reaches no CDN).
"use strict";

const API = "/plexrl/v1";
const KEY_STORE = "plexrl.apiKey";
const SVG_NS = "http://www.w3.org/2000/svg";
// Distinct, colour-blind-friendly hues; a job keeps its colour for the page's life.
const PALETTE = [
  "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
  "#b07aa1", "#ff9da7", "#9c755f", "#86bcb6", "#d37295", "#a0cbe8",
];
const OTHER_COLOUR = "#bab0ac";
const ROW_H = 30;
const LABEL_W = 120;
const AXIS_H = 22;

const state = {
  key: null,
  refreshMs: 2000,
  windowS: 300,
  entries: new Map(),   // call key -> timeline entry
  since: 0,             // next timeline read starts here (server clock, seconds)
  skewS: 0,             // server clock minus this browser's clock
  colours: new Map(),   // job id -> colour
  labels: new Map(),    // job id -> short label (J1, J2, ...)
  workers: [],          // the last /workers answer (rows of the timeline)
  timer: null,
  refreshes: 0,
};

class AuthError extends Error {}

function $(id) { return document.getElementById(id); }

// ---------------------------------------------------------------- formatting

function fmtDuration(s) {
  if (s === null || s === undefined || Number.isNaN(s)) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${s.toFixed(1)} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  const h = Math.floor(m / 60);
  return `${h}h ${String(m % 60).padStart(2, "0")}m`;
}

function fmtAgo(at, now) {
  if (!at) return "–";
  return `${fmtDuration(Math.max(0, now - at))} ago`;
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = n;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${units[i]}`;
}

function fmtPct(x) {
  return x === null || x === undefined ? "–" : `${(x * 100).toFixed(1)}%`;
}

function fmtClock(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

function shortId(id) {
  return id.length > 22 ? `${id.slice(0, 8)}…${id.slice(-12)}` : id;
}

// ---------------------------------------------------------------- API

function now() { return Date.now() / 1000 + state.skewS; }

async function get(path) {
  const response = await fetch(API + path, { headers: { "X-API-Key": state.key } });
  const date = response.headers.get("date");
  if (date) {
    // The timeline is in the server's wall clock; one-second resolution is plenty here.
    state.skewS = Date.parse(date) / 1000 - Date.now() / 1000;
    if (Math.abs(state.skewS) < 1.5) state.skewS = 0;
  }
  if (response.status === 401) {
    const body = await response.json().catch(() => ({}));
    throw new AuthError(body.error || "the gateway refused the API key");
  }
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw new Error(`${path}: ${response.status} ${body.error || response.statusText}`);
  }
  return response.json();
}

function entryKey(e) { return `${e.request_id}|${e.worker_id}|${e.started_at}`; }
function entryEnd(e) { return e.started_at + e.swap_s + e.compute_s; }

async function readTimeline() {
  const from = now() - state.windowS;
  const since = Math.max(state.since, from);
  const entries = await get(`/timeline?since=${since.toFixed(3)}&limit=10000`);
  let latest = state.since;
  for (const e of entries) {
    state.entries.set(entryKey(e), e);
    latest = Math.max(latest, entryEnd(e));
  }
  // A call is appended when it finishes, a little after its end; re-reading a short
  // overlap (de-duplicated by key) catches one recorded late.
  state.since = Math.max(since, latest - 10);
  for (const [k, e] of state.entries) {
    if (entryEnd(e) < from) state.entries.delete(k);
  }
}

// ---------------------------------------------------------------- rendering

function colourOf(jobId) {
  return state.colours.get(jobId) || OTHER_COLOUR;
}

function assignColours(jobs) {
  for (const j of jobs) {
    const id = j.job.job_id;
    if (!state.colours.has(id)) {
      const n = state.colours.size;
      state.colours.set(id, PALETTE[n % PALETTE.length]);
      state.labels.set(id, `J${n + 1}`);
    }
  }
}

function text(cell, value, cls) {
  const td = document.createElement("td");
  td.textContent = value;
  if (cls) td.className = cls;
  cell.appendChild(td);
  return td;
}

function renderSummary(cluster, workers, jobs) {
  const sched = cluster.scheduler || {};
  const live = workers.filter((w) => !w.error).length;
  $("s-workers").textContent = String(live);
  $("s-jobs").textContent = String(
    jobs.filter((j) => j.job.kind === "training" && !j.job.unloaded).length,
  );
  $("s-samplers").textContent = String(jobs.filter((j) => j.job.kind === "sampling").length);
  $("s-queue").textContent = sched.reachable ? String(sched.pending ?? 0) : "?";
  $("s-queue").title = sched.reachable ? "calls waiting at the scheduler" : "scheduler unreachable";
  $("s-inflight").textContent = sched.reachable ? String(Object.keys(sched.inflight || {}).length) : "?";
  let used = 0;
  let dedicated = 0;
  for (const j of jobs) {
    used += j.accounting.device_s;
    dedicated += j.accounting.dedicated_device_s;
  }
  $("s-device").textContent = `${used.toFixed(1)} / ${dedicated.toFixed(1)}`;
  $("s-savings").textContent = dedicated > 0 ? fmtPct(1 - used / dedicated) : "–";
}

function renderJobs(jobs, t) {
  const body = $("jobs").querySelector("tbody");
  body.replaceChildren();
  for (const j of jobs) {
    const id = j.job.job_id;
    const tr = document.createElement("tr");
    tr.dataset.job = id;
    const sw = document.createElement("td");
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = colourOf(id);
    sw.appendChild(swatch);
    tr.appendChild(sw);
    const idCell = text(tr, `${state.labels.get(id) || ""} ${shortId(id)}`, "id");
    idCell.title = id;
    text(tr, j.job.unloaded ? `${j.job.kind} (unloaded)` : j.job.kind);
    text(tr, j.job.spec.base_model + (j.job.spec.lora ? ` · LoRA r${j.job.spec.lora.rank}` : " · full"));
    text(tr, j.home || "–");
    const tierCell = document.createElement("td");
    const tier = document.createElement("span");
    const tierName = j.residency ? j.residency.tier : "none";
    tier.className = `tier tier-${tierName}`;
    tier.textContent = j.residency ? `${tierName} · ${j.residency.worker_id}` : "–";
    tierCell.appendChild(tier);
    tr.appendChild(tierCell);
    text(tr, fmtBytes(j.residency ? j.residency.bytes : j.job.spec.state_bytes), "num");
    text(tr, String(j.accounting.calls), "num");
    text(tr, String(j.activity.steps), "num");
    const rate = j.activity.steps_per_min;
    text(tr, rate === null ? "–" : rate.toFixed(1), "num");
    text(tr, String(j.activity.swaps), "num");
    text(tr, j.accounting.device_s.toFixed(2), "num");
    text(tr, j.accounting.dedicated_device_s.toFixed(2), "num");
    const saving = j.accounting.savings_fraction;
    text(tr, fmtPct(saving), `num ${saving > 0 ? "good" : ""}`);
    text(tr, fmtAgo(j.activity.last_at, t));
    body.appendChild(tr);
  }
  $("jobs-note").textContent =
    `steps, steps/min and swaps: over the last ${fmtDuration(state.windowS)}; ` +
    "device-s and savings: since each job's first call (dedicated = holding its devices " +
    "from its first call to its last).";
}

function renderWorkers(workers, cluster, t) {
  const inflight = (cluster.scheduler && cluster.scheduler.inflight) || {};
  const body = $("workers").querySelector("tbody");
  body.replaceChildren();
  for (const w of workers) {
    const tr = document.createElement("tr");
    tr.dataset.worker = w.worker_id;
    text(tr, w.worker_id, "id");
    if (w.error) {
      text(tr, w.error, "stale").colSpan = 7;
      body.appendChild(tr);
      continue;
    }
    text(tr, `${w.device}${w.devices > 1 ? ` ×${w.devices}` : ""}`);
    const running = inflight[w.worker_id];
    if (running) {
      text(tr, `running ${state.labels.get(running) || shortId(running)}`, "busy");
    } else {
      text(tr, w.busy ? "busy" : "idle", w.busy ? "busy" : "idle");
    }
    const byTier = {};
    let deviceUsed = 0;
    let hostUsed = 0;
    for (const r of w.resident || []) {
      byTier[r.tier] = (byTier[r.tier] || 0) + 1;
      if (r.tier === "device") deviceUsed += r.bytes;
      if (r.tier === "host") hostUsed += r.bytes;
    }
    const tiers = Object.entries(byTier).map(([k, v]) => `${v} ${k}`).join(" · ");
    text(tr, tiers || "none");
    text(tr, `${fmtBytes(deviceUsed)} / ${fmtBytes(w.device_bytes)}`, "num");
    text(tr, `${fmtBytes(hostUsed)} / ${fmtBytes(w.host_bytes)}`, "num");
    // A group's ranks each hold their shard of every job: device bytes used per rank.
    const ranks = w.ranks || [];
    text(
      tr,
      ranks.length
        ? `${ranks.map((r) => fmtBytes(r.device_used)).join(" · ")} of ${fmtBytes(ranks[0].device_bytes)} each`
        : "-",
      "num",
    );
    const age = w.age_s;
    text(tr, `${fmtDuration(age)} ago`, age > 15 ? "stale" : "");
    body.appendChild(tr);
  }
}

function svg(name, attrs, parent) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (parent) parent.appendChild(el);
  return el;
}

function tickStep(windowS) {
  const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600];
  return steps.find((s) => windowS / s <= 8) || 3600;
}

// Tail releases: a worker let its next dispatch in beside a rollout's straggling tail at
// `tail_released_at` (timeline entries of the sample calls still running then), or beside
// a rollout the scheduler preempted (`preempted`).
function drawTailRelease(layer, entry, x, y) {
  if (entry.tail_released_at === undefined || entry.tail_released_at === null) return;
  const xt = x(entry.tail_released_at);
  const cls = entry.preempted ? "preempt" : "tail";
  svg("line", { class: cls, x1: xt, x2: xt, y1: y + 2, y2: y + ROW_H - 4 }, layer);
}

function renderTimeline(workers) {
  const root = $("timeline");
  const width = Math.max(480, $("timeline-box").clientWidth);
  const t1 = now();
  const t0 = t1 - state.windowS;
  const rows = new Set(workers.map((w) => w.worker_id));
  for (const e of state.entries.values()) rows.add(e.worker_id);
  const names = [...rows].sort();
  const height = AXIS_H + Math.max(1, names.length) * ROW_H + 4;
  root.replaceChildren();
  root.setAttribute("viewBox", `0 0 ${width} ${height}`);
  root.setAttribute("height", String(height));

  const defs = svg("defs", {}, root);
  const hatch = svg("pattern", {
    id: "hatch", width: 5, height: 5, patternUnits: "userSpaceOnUse",
    patternTransform: "rotate(45)",
  }, defs);
  svg("rect", { width: 5, height: 5, fill: "#ffffff", "fill-opacity": 0.55 }, hatch);
  svg("line", { x1: 0, y1: 0, x2: 0, y2: 5, stroke: "#1d2330", "stroke-width": 2 }, hatch);

  const plotW = width - LABEL_W - 8;
  const x = (t) => LABEL_W + ((t - t0) / (t1 - t0)) * plotW;
  const rowY = new Map(names.map((n, i) => [n, AXIS_H + i * ROW_H]));

  names.forEach((n, i) => {
    const y = rowY.get(n);
    svg("rect", { class: `row-bg${i % 2 ? " odd" : ""}`, x: LABEL_W, y, width: plotW, height: ROW_H }, root);
    const label = svg("text", { class: "row-label", x: 6, y: y + ROW_H / 2 + 4 }, root);
    label.textContent = n;
  });

  const step = tickStep(state.windowS);
  for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) {
    const xt = x(t);
    svg("line", { class: "tick", x1: xt, x2: xt, y1: AXIS_H - 4, y2: height }, root);
    if (xt > width - 60) continue;  // no room for its label before the edge
    const label = svg("text", { class: "tick-label", x: xt + 3, y: AXIS_H - 8 }, root);
    label.textContent = fmtClock(t);
  }

  const bars = svg("g", { id: "bars" }, root);
  let drawn = 0;
  const entries = [...state.entries.values()].sort((a, b) => a.started_at - b.started_at);
  for (const e of entries) {
    const y = rowY.get(e.worker_id);
    const start = Math.max(e.started_at, t0);
    const end = entryEnd(e);
    if (end < t0 || y === undefined) continue;
    const x0 = x(start);
    const w = Math.max(1.5, x(end) - x0);
    const g = svg("g", { class: "call" }, bars);
    const bar = svg("rect", {
      class: `bar${e.ok ? "" : " failed"}`,
      x: x0, y: y + 4, width: w, height: ROW_H - 8,
      fill: colourOf(e.job_id),
      "data-job": e.job_id, "data-worker": e.worker_id, "data-function": e.function,
    }, g);
    const title = svg("title", {}, bar);
    title.textContent =
      `${state.labels.get(e.job_id) || ""} ${e.job_id}\n${e.function} on ${e.worker_id}` +
      `\nstarted ${fmtClock(e.started_at)}\nswap-in ${fmtDuration(e.swap_s)}, ` +
      `compute ${fmtDuration(e.compute_s)}${e.ok ? "" : "\nFAILED"}`;
    if (e.swap_s > 0) {
      // The swap-in comes first: hatched over the job's colour, with a tick at its start.
      const sw = Math.max(1.5, x(e.started_at + e.swap_s) - x0);
      svg("rect", { class: "swap", x: x0, y: y + 4, width: sw, height: ROW_H - 8, "data-job": e.job_id }, g);
      svg("rect", { class: "swap-tick", x: x0, y: y + 1, width: 1.5, height: ROW_H - 2 }, g);
    }
    drawTailRelease(g, e, x, y);
    drawn += 1;
  }
  const nowLine = x(t1) - 1;
  svg("line", { class: "now", x1: nowLine, x2: nowLine, y1: AXIS_H - 4, y2: height }, root);
  if (drawn === 0) {
    const empty = svg("text", { class: "empty", x: LABEL_W + 12, y: AXIS_H + ROW_H / 2 + 4 }, root);
    empty.textContent = `no calls in the last ${fmtDuration(state.windowS)}`;
  }
  root.dataset.bars = String(drawn);
}

function renderLegend() {
  const legend = $("legend");
  legend.replaceChildren();
  const seen = new Set([...state.entries.values()].map((e) => e.job_id));
  for (const [id, colour] of state.colours) {
    if (!seen.has(id)) continue;
    const item = document.createElement("span");
    const sw = document.createElement("span");
    sw.className = "swatch";
    sw.style.background = colour;
    item.appendChild(sw);
    item.append(` ${state.labels.get(id)} ${shortId(id)}`);
    item.title = id;
    legend.appendChild(item);
  }
}

// ---------------------------------------------------------------- refresh loop

function showError(message) {
  const el = $("error");
  el.hidden = !message;
  el.textContent = message || "";
}

async function refresh() {
  try {
    const [cluster, workers, jobs] = await Promise.all([
      get("/cluster"),
      get("/workers"),
      get(`/jobs?details=true&window_s=${state.windowS}`),
      readTimeline(),
    ]);
    const t = now();
    state.workers = workers;
    assignColours(jobs);
    renderSummary(cluster, workers, jobs);
    renderTimeline(workers);
    renderLegend();
    renderJobs(jobs, t);
    renderWorkers(workers, cluster, t);
    state.refreshes += 1;
    document.body.dataset.state = "ok";
    document.body.dataset.refreshes = String(state.refreshes);
    $("status").textContent = `live · updated ${fmtClock(t)}`;
    showError(null);
  } catch (err) {
    document.body.dataset.state = "error";
    if (err instanceof AuthError) {
      stop();
      askForKey(`${err.message}`);
      return;
    }
    $("status").textContent = "retrying…";
    showError(`cannot read ${API}: ${err.message}`);
  }
}

function stop() {
  if (state.timer !== null) clearInterval(state.timer);
  state.timer = null;
}

function start() {
  stop();
  $("key-form").hidden = true;
  $("forget-key").hidden = false;
  refresh();
  state.timer = setInterval(refresh, state.refreshMs);
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("forget-key").hidden = true;
  $("status").textContent = "";
  showError(message);
  $("key-input").focus();
}

function init() {
  const params = new URLSearchParams(window.location.search);
  const fromUrl = params.get("key");
  if (fromUrl) {
    localStorage.setItem(KEY_STORE, fromUrl);
    // Keep the key out of the address bar, history and anything copied from it.
    params.delete("key");
    const rest = params.toString();
    history.replaceState(null, "", window.location.pathname + (rest ? `?${rest}` : ""));
  }
  const refreshS = Number(params.get("refresh"));
  if (refreshS >= 0.5) state.refreshMs = refreshS * 1000;
  const windowS = Number(params.get("window"));
  if (windowS > 0) {
    state.windowS = windowS;
    let option = [...$("window").options].find((o) => Number(o.value) === windowS);
    if (!option) {
      option = new Option(fmtDuration(windowS), String(windowS));
      $("window").add(option, 0);
    }
    option.selected = true;
  }
  $("window").addEventListener("change", (ev) => {
    state.windowS = Number(ev.target.value);
    state.since = 0;
    start();
  });
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.key = $("key-input").value.trim();
    localStorage.setItem(KEY_STORE, state.key);
    start();
  });
  $("forget-key").addEventListener("click", () => {
    stop();
    localStorage.removeItem(KEY_STORE);
    askForKey(null);
  });
  window.addEventListener("resize", () => renderTimeline(state.workers));
  state.key = localStorage.getItem(KEY_STORE);
  if (state.key) start();
  else askForKey("enter an API key (the one your jobs use, e.g. TINKER_API_KEY) to see its jobs");
}

document.addEventListener("DOMContentLoaded", init);
