// The ctxgate dashboard: polls /v1/ctx/dashboard/* every POLL_MS and redraws in place.
// Everything from the server is put in the page as text (textContent), never as HTML.
"use strict";

const POLL_MS = 2500;
const KEY_STORAGE = "ctxgate-dashboard-key";
const API = "/v1/ctx/dashboard";
const $ = (id) => document.getElementById(id);

let viewer = null;
let selected = null; // {tenant, session}
let polling = null;
let busy = false;
let sessionsOffset = 0; // the sessions page shown: its first row's place, newest first
const SESSIONS_PAGE = 50;

function key() { return sessionStorage.getItem(KEY_STORAGE) || ""; }

async function api(path, options = {}) {
  const headers = Object.assign({"Content-Type": "application/json"}, options.headers || {});
  if (key()) headers["Authorization"] = "Bearer " + key();
  const response = await fetch(path, Object.assign({}, options, {headers, cache: "no-store"}));
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  return {status: response.status, body};
}

function errorText(reply) {
  const error = reply.body && reply.body.error;
  return error ? error.message : "HTTP " + reply.status;
}

function number(value) { return value === null || value === undefined ? "–" : Number(value).toLocaleString("en"); }
function share(value) { return value === null || value === undefined ? "–" : Math.round(value * 100) + "%"; }
function when(seconds) { return seconds ? new Date(seconds * 1000).toLocaleTimeString() : "–"; }
function whenIso(text) { return text ? new Date(text).toLocaleTimeString() : "–"; }

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function status(text) { $("status").textContent = text; }

// -- start and the key -----------------------------------------------------------------------

async function start() {
  const reply = await api(API + "/viewer");
  if (reply.status === 200) {
    viewer = reply.body;
    $("key-form").hidden = true;
    $("refused").hidden = true;
    $("board").hidden = false;
    $("forget-key").hidden = !key();
    $("viewer").textContent = viewer.role === "tenant" ? "tenant " + viewer.tenant
      : viewer.role === "admin" ? "admin: every tenant" : "local: every tenant";
    $("metrics-section").hidden = viewer.role === "tenant";
    readHash();
    await refresh();
    if (!polling) polling = setInterval(refresh, POLL_MS);
  } else if (reply.status === 401) {
    $("board").hidden = true;
    $("key-form").hidden = false;
    $("key-error").textContent = key() ? errorText(reply) : "";
  } else {
    $("board").hidden = true;
    $("refused").hidden = false;
    $("refused").textContent = errorText(reply);
  }
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("key-input").value.trim());
  $("key-input").value = "";
  start();
});

$("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORAGE);
  location.reload();
});

function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  if (params.get("tenant") && params.get("session")) {
    selected = {tenant: params.get("tenant"), session: params.get("session")};
  }
}

window.addEventListener("hashchange", () => { readHash(); refresh(); });

function select(tenant, session) {
  selected = {tenant, session};
  history.replaceState(null, "", "#" + new URLSearchParams({tenant, session}).toString());
  refresh();
}

// -- polling ---------------------------------------------------------------------------------

async function refresh() {
  if (busy) return;
  busy = true;
  try {
    const jobs = [refreshSessions()];
    if (viewer && viewer.role !== "tenant") jobs.push(refreshMetrics());
    if (selected) jobs.push(refreshDetail());
    await Promise.all(jobs);
    const board = $("board");
    board.dataset.refreshes = String(Number(board.dataset.refreshes || 0) + 1);
  } catch (e) {
    status("update failed: " + e);
  } finally {
    busy = false;
  }
}

async function refreshSessions() {
  const reply = await api(API + "/sessions?limit=" + SESSIONS_PAGE + "&offset=" + sessionsOffset);
  if (reply.status !== 200) { status(errorText(reply)); return; }
  const body = $("sessions").tBodies[0];
  const rows = reply.body.data.map((s) => {
    const row = document.createElement("tr");
    row.dataset.session = s.id;
    row.dataset.tenant = s.tenant;
    row.dataset.answered = String(s.answered_turns);
    if (selected && selected.tenant === s.tenant && selected.session === s.id) row.className = "selected";
    cell(row, s.tenant);
    cell(row, s.id);
    cell(row, number(s.answered_turns));
    cell(row, number(s.failed_turns));
    cell(row, number(s.tokens_in));
    cell(row, number(s.tokens_out));
    cell(row, s.last_level ? s.last_level + " at " + when(s.last_compaction_at) : "–", "level");
    cell(row, share(s.cache_stable_share));
    cell(row, number(s.summary_calls));
    cell(row, s.points_per_100_turns == null ? "–" : s.points_per_100_turns.toFixed(1));
    cell(row, s.summaries_per_point == null ? "–" : s.summaries_per_point.toFixed(2));
    cell(row, s.cache_read_tokens == null ? "–" : number(s.cache_read_tokens) + " / " + number(s.cache_write_tokens));
    cell(row, s.input_cost == null ? "–" : "$" + s.input_cost.toFixed(4));
    cell(row, when(s.updated_at));
    row.addEventListener("click", () => select(s.tenant, s.id));
    return row;
  });
  body.replaceChildren(...rows);
  $("no-sessions").hidden = rows.length > 0 || sessionsOffset > 0;
  $("sessions-newer").disabled = sessionsOffset === 0;
  $("sessions-older").disabled = !reply.body.has_more;
  $("sessions-range").textContent = rows.length ? (sessionsOffset + 1) + "–" + (sessionsOffset + rows.length) : "";
}

$("sessions-newer").addEventListener("click", () => {
  sessionsOffset = Math.max(0, sessionsOffset - SESSIONS_PAGE);
  refreshSessions();
});
$("sessions-older").addEventListener("click", () => {
  sessionsOffset += SESSIONS_PAGE;
  refreshSessions();
});

async function refreshMetrics() {
  const reply = await api(API + "/metrics");
  if (reply.status !== 200) return;
  const minutes = reply.body.data;
  const x = minutes.map((m) => new Date(m.start * 1000));
  const series = (name, field, extra) => Object.assign({name, x, y: minutes.map((m) => m[field])}, extra);
  Plotly.react("metrics-chart", [
    series("requests", "requests", {type: "bar"}),
    series("errors", "errors", {type: "bar"}),
    series("compactions", "compactions", {type: "bar"}),
    series("tokens in", "tokens_in", {type: "scatter", mode: "lines", yaxis: "y2"}),
    series("tokens out", "tokens_out", {type: "scatter", mode: "lines", yaxis: "y2"}),
  ], {
    margin: {t: 10, r: 60, b: 60, l: 50}, barmode: "group", legend: {orientation: "h"},
    yaxis: {title: "per minute", rangemode: "tozero"},
    yaxis2: {title: "tokens", overlaying: "y", side: "right", rangemode: "tozero"},
  }, {displayModeBar: false, responsive: true});
}

async function refreshDetail() {
  const {tenant, session} = selected;
  const path = API + "/tenants/" + encodeURIComponent(tenant) + "/sessions/" + encodeURIComponent(session);
  const [reply, memory] = await Promise.all([api(path),
    api(API + "/memory?" + new URLSearchParams({tenant}).toString())]);
  if (reply.status !== 200) {
    $("detail").hidden = true;
    status(errorText(reply));
    return;
  }
  const s = reply.body;
  $("detail").hidden = false;
  $("detail").dataset.session = s.id;
  $("detail").dataset.tenant = s.tenant;
  $("detail-title").textContent = s.tenant + " / " + s.id;
  $("no-wal").hidden = s.wal;
  drawTimeline(s);
  drawCompactions(s.compactions);
  drawCheckpoints(s.checkpoints);
  drawMemory(tenant, memory);
}

function drawTimeline(s) {
  const points = s.timeline;
  const x = points.map((p, i) => i + 1);
  const compacted = points.map((p, i) => [p, i + 1]).filter(([p]) => p.levels.length);
  const traces = [
    {name: "client sent", x, y: points.map((p) => p.tokens_in), mode: "lines+markers", type: "scatter"},
    {name: "forwarded", x, y: points.map((p) => p.tokens_out), mode: "lines+markers", type: "scatter"},
    {name: "budget", x, y: points.map((p) => p.budget), mode: "lines", type: "scatter",
     line: {dash: "dash", color: "#b3261e"}},
    {name: "compaction", x: compacted.map(([, i]) => i), y: compacted.map(([p]) => p.tokens_out),
     text: compacted.map(([p]) => p.levels.join("+")), mode: "markers+text", textposition: "top center",
     type: "scatter", marker: {symbol: "diamond", size: 12, color: "#e07b00"}},
  ];
  const shapes = s.rollbacks.map((r) => ({type: "line", x0: r.after_points + 0.5, x1: r.after_points + 0.5,
    yref: "paper", y0: 0, y1: 1, line: {dash: "dot", color: "#6a4caf"}}));
  Plotly.react("timeline-chart", traces, {
    margin: {t: 10, r: 20, b: 40, l: 60}, legend: {orientation: "h"}, shapes,
    xaxis: {title: "answered turn", dtick: points.length > 30 ? undefined : 1}, yaxis: {title: "tokens", rangemode: "tozero"},
  }, {displayModeBar: false, responsive: true});
}

function drawCompactions(compactions) {
  const rows = compactions.map((c) => {
    const row = document.createElement("tr");
    row.dataset.level = c.level;
    cell(row, c.level === "rollback" ? "rollback to " + c.to_seq : c.level, "level");
    cell(row, c.tokens_before === null || c.tokens_before === undefined ? "–"
      : number(c.tokens_before) + " → " + number(c.tokens_after));
    cell(row, c.reason || "–");
    cell(row, when(c.at));
    return row;
  });
  $("compactions").tBodies[0].replaceChildren(...rows);
}

function drawCheckpoints(checkpoints) {
  const rows = checkpoints.map((c) => {
    const row = document.createElement("tr");
    row.dataset.seq = String(c.seq);
    cell(row, String(c.seq));
    cell(row, c.reason + (c.rolled_back_to ? " to " + c.rolled_back_to : ""));
    cell(row, number(c.turns));
    cell(row, number(c.messages_tokens));
    cell(row, whenIso(c.timestamp));
    const button = document.createElement("button");
    button.type = "button";
    button.className = "rollback";
    button.dataset.seq = String(c.seq);
    button.textContent = "Roll back here";
    button.addEventListener("click", () => rollback(c.seq));
    row.appendChild(document.createElement("td")).appendChild(button);
    return row;
  });
  $("checkpoints").tBodies[0].replaceChildren(...rows);
}

function drawMemory(tenant, reply) {
  $("memory-tenant").textContent = tenant;
  const entries = reply.status === 200 ? reply.body.data : [];
  const rows = entries.map((e) => {
    const row = document.createElement("tr");
    row.dataset.entry = e.id;
    cell(row, e.category);
    cell(row, e.content);
    cell(row, [e.scope.user && "user " + e.scope.user, e.scope.project && "project " + e.scope.project]
      .filter(Boolean).join(", ") || "tenant");
    cell(row, e.origin + (e.shared ? ", shared" : ""));
    cell(row, e.source || "");
    cell(row, e.session || "");
    cell(row, e.status + (e.quarantine ? " (" + e.quarantine.reason + ")" : ""));
    if (e.provenance.length) row.title = e.provenance.map((p) => p.source + ": " + p.span).join("\n");
    return row;
  });
  $("memory").tBodies[0].replaceChildren(...rows);
}

async function rollback(seq) {
  const {tenant, session} = selected;
  if (!confirm("Roll session " + session + " back to checkpoint " + seq + "?")) return;
  const path = API + "/tenants/" + encodeURIComponent(tenant) + "/sessions/" + encodeURIComponent(session)
    + "/rollback";
  const reply = await api(path, {method: "POST", body: JSON.stringify({to_seq: seq})});
  status(reply.status === 200 ? "rolled back to checkpoint " + seq : "rollback refused: " + errorText(reply));
  await refresh();
}

start();
