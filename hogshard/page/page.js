// The hogshard status page: fetches api/page every two seconds (no reloads) and draws it.
// Plain JavaScript, no library: the plots are hand-drawn SVG. Read-only: no action is offered.
"use strict";

const REFRESH_MS = 2000;
const TOKEN = new URLSearchParams(window.location.search).get("token");
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c"];
let lastPhase = null;
let lastOk = 0;

function withToken(path) {
  return TOKEN ? path + "?token=" + encodeURIComponent(TOKEN) : path;
}

function $(id) { return document.getElementById(id); }

function text(id, value) { $(id).textContent = value; }

function duration(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return "-";
  seconds = Math.max(0, Math.round(seconds));
  const h = Math.floor(seconds / 3600), m = Math.floor(seconds / 60) % 60, s = seconds % 60;
  return (h ? h + "h " : "") + (h || m ? m + "m " : "") + s + "s";
}

function bytes(n) {
  n = Number(n || 0);
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n.toFixed(0)) + " " + units[i];
}

function num(v, digits) {
  if (v === null || v === undefined) return "-";
  return typeof v === "number" && !Number.isInteger(v) ? v.toFixed(digits ?? 1) : String(v);
}

function row(cells, cls) {
  const tr = document.createElement("tr");
  if (cls) tr.className = cls;
  for (const [value, name] of cells) {
    const td = document.createElement("td");
    td.textContent = value;
    if (name) td.className = name;
    tr.appendChild(td);
  }
  return tr;
}

function fill(tbodyParent, rows) {
  const body = $(tbodyParent).tBodies[0];
  body.replaceChildren(...rows);
}

function memberClass(m) {
  const stats = m.stats || {};
  if (stats.fenced || m.fenced) return "fenced";
  return m.state;
}

function stateLabel(m) {
  const stats = m.stats || {};
  return stats.fenced || m.fenced ? "fenced" : m.state;
}

function drawServers(status, summary) {
  const shards = new Map((summary.shards || []).map((s) => [s.rank, s]));
  const servers = (status.members || []).filter((m) => m.role === "server")
    .sort((a, b) => a.rank - b.rank);
  fill("servers", servers.map((m) => {
    const st = m.stats || {}, held = shards.get(m.rank) || {};
    const errors = Object.values(st.errors || {}).reduce((a, b) => a + Number(b), 0);
    const tr = row([[m.node_id], [stateLabel(m), "state"],
      [num(held.primary_chunks ?? 0) + (held.slots ? " + " + held.slots + " emb." : "")],
      [num(held.backup_chunks ?? 0)], [num(held.primary_floats ?? 0)],
      [bytes(st.bytes_in)], [bytes(st.bytes_out)],
      [m.state === "alive" ? num(st.updates_per_second ?? 0, 0) : "-"],
      [String(errors)], [num(m.heartbeat_age, 1) + " s ago"], [m.address || ""]],
    memberClass(m));
    tr.dataset.node = m.node_id;
    tr.dataset.state = stateLabel(m);
    return tr;
  }));
  return servers;
}

function drawWorkers(status) {
  const workers = (status.members || []).filter((m) => m.role === "worker")
    .sort((a, b) => a.rank - b.rank);
  const top = Math.max(0, ...workers.filter((w) => w.state === "alive").map((w) => w.clock));
  fill("workers", workers.map((m) => {
    const p = m.progress || {};
    const steps = p.total ? p.done + "/" + p.total : (p.done ?? "-");
    const tr = row([[m.node_id], [stateLabel(m), "state"], [String(m.rank)], [String(m.clock)],
      [String(steps)], [m.state === "alive" ? String(top - m.clock) : "-"],
      [num(p.loss, 4)], [num(m.heartbeat_age, 1) + " s ago"]], memberClass(m));
    tr.dataset.node = m.node_id;
    tr.dataset.state = stateLabel(m);
    return tr;
  }));
  return workers;
}

function drawShards(status, summary) {
  const tables = status.tables || {};
  fill("shards", Object.keys(tables).sort().map((name) => {
    const entry = tables[name], per = {}, backups = {}, moving = {};
    for (const c of entry.chunks || []) {
      per[c[3]] = (per[c[3]] || 0) + 1;
      if (c.length > 4 && c[4] >= 0) backups[c[4]] = (backups[c[4]] || 0) + 1;
      if (c.length > 5 && c[5] >= 0) moving[c[5]] = (moving[c[5]] || 0) + 1;
    }
    const list = (o) => Object.keys(o).map((r) => "server-" + r + ": " + o[r]).join(", ");
    let placement = list(per);
    if (Object.keys(backups).length) placement += "; backups " + list(backups);
    if (Object.keys(moving).length) placement += "; moving to " + list(moving);
    const size = (entry.table || {}).size ?? "-";
    return row([[name], [String(size)], [String((entry.chunks || []).length)],
      [String(entry.replication ?? 1)], [placement]]);
  }));
  const slots = status.embedding_slots;
  text("shard-note", slots ? "embedding slots: " + JSON.stringify(slots) : "");
}

function drawLog(status, log) {
  const items = [];
  if (status.failed) items.push(["failure", "FAILED: " + status.failed]);
  for (const r of status.recoveries || []) {
    items.push(["WARNING", "recovered " + r.node_id + " from " + r.from + ": " +
      r.lost_updates + " chunk updates lost"]);
  }
  for (const entry of (log || []).slice().reverse()) items.push([entry.level, entry.line]);
  const errors = status.errors || {};
  for (const code of Object.keys(errors)) {
    items.push(["WARNING", "scheduler replied " + code + " x" + errors[code]]);
  }
  $("log").replaceChildren(...items.slice(0, 30).map(([cls, line]) => {
    const li = document.createElement("li");
    li.className = cls;
    li.textContent = line;
    return li;
  }));
}

function drawCheckpoints(status) {
  const c = status.checkpoint || {}, items = [];
  if (c.latest) items.push(["", "latest complete: " + c.latest]);
  if (c.running) items.push(["WARNING", "writing: " + c.running]);
  if (c.last && !c.last.ok) items.push(["failure", "FAILED (" + (c.failures || 1) + " so far): " + c.last.error]);
  if (!items.length) items.push(["", "none yet"]);
  $("checkpoints").replaceChildren(...items.map(([cls, line]) => {
    const li = document.createElement("li");
    li.className = cls;
    li.textContent = line;
    return li;
  }));
}

function el(name, attrs, content) {
  const node = document.createElementNS(SVG, name);
  for (const key of Object.keys(attrs)) node.setAttribute(key, attrs[key]);
  if (content !== undefined) node.textContent = content;
  return node;
}

// One plot: series = [{name, values: [[t, v|null], ...], dashed}], drawn as polylines over
// the shared time axis, with the y axis from 0 to the largest value.
function plot(id, series) {
  const svg = $(id);
  const w = svg.clientWidth || 400, h = svg.clientHeight || 160;
  const left = 40, right = 8, top = 8, bottom = 18;
  const points = series.flatMap((s) => s.values.filter((p) => p[1] !== null && p[1] !== undefined));
  svg.setAttribute("viewBox", "0 0 " + w + " " + h);
  svg.replaceChildren();
  svg.dataset.points = String(points.length);
  if (!points.length) {
    svg.appendChild(el("text", {x: left, y: h / 2}, "no data yet"));
    return;
  }
  const t0 = Math.min(...points.map((p) => p[0])), t1 = Math.max(...points.map((p) => p[0]));
  const ymax = Math.max(1e-9, ...points.map((p) => p[1])) * 1.1;
  const x = (t) => left + (t1 > t0 ? (t - t0) / (t1 - t0) : 1) * (w - left - right);
  const y = (v) => h - bottom - (v / ymax) * (h - top - bottom);
  svg.appendChild(el("line", {x1: left, y1: h - bottom, x2: w - right, y2: h - bottom, stroke: "#d1d5db"}));
  svg.appendChild(el("line", {x1: left, y1: top, x2: left, y2: h - bottom, stroke: "#d1d5db"}));
  svg.appendChild(el("text", {x: 2, y: top + 8}, num(ymax / 1.1, ymax < 10 ? 2 : 0)));
  svg.appendChild(el("text", {x: 2, y: h - bottom}, "0"));
  svg.appendChild(el("text", {x: left, y: h - 4}, duration(t0)));
  svg.appendChild(el("text", {x: w - right - 40, y: h - 4}, duration(t1)));
  series.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    const pts = s.values.filter((p) => p[1] !== null && p[1] !== undefined)
      .map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" ");
    if (pts) {
      const attrs = {points: pts, fill: "none", stroke: color, "stroke-width": 1.5};
      if (s.dashed) attrs["stroke-dasharray"] = "4 3";
      const line = el("polyline", attrs);
      line.dataset.series = s.name;
      svg.appendChild(line);
    }
    svg.appendChild(el("text", {x: left + 6 + i * 70, y: top + 8, fill: color}, s.name));
  });
}

function drawPlots(history) {
  const of = (key) => history.map((p) => [p.t, p[key] ?? null]);
  plot("plot-updates", [{name: "updates/s", values: of("updates_per_s")}]);
  plot("plot-traffic", [{name: "pushes/s", values: of("pushes_per_s")},
                        {name: "pulls/s", values: of("pulls_per_s")}]);
  plot("plot-staleness", [{name: "p50", values: of("staleness_p50")},
                          {name: "p99", values: of("staleness_p99")},
                          {name: "bound", values: of("bound"), dashed: true, color: "#6b7280"}]);
  plot("plot-loss", [{name: "loss", values: of("loss")}]);
}

function draw(page) {
  const status = page.status || {}, summary = page.summary || {}, job = status.job || {};
  const phase = job.phase || (status.shutdown ? "stopping" : "running");
  lastPhase = phase;
  $("phase").textContent = phase;
  $("phase").dataset.phase = phase;
  text("policy", status.policy || "-");
  text("elapsed", duration(status.uptime));
  text("eta", summary.eta_s === null || summary.eta_s === undefined ? "unknown" : duration(summary.eta_s));
  text("steps", summary.total ? summary.done + "/" + summary.total : "-");
  text("epoch", String(status.epoch ?? "-"));
  text("reason", job.reason || "-");
  $("failed").hidden = !status.failed;
  text("failed", status.failed ? "FAILED: " + status.failed : "");
  const servers = drawServers(status, summary), workers = drawWorkers(status);
  const alive = (list) => list.filter((m) => m.state === "alive").length;
  text("server-count", alive(servers) + " alive / " + (status.expected_servers ?? servers.length));
  text("worker-count", alive(workers) + " alive" + (job.num_workers ? " / " + job.num_workers : ""));
  drawShards(status, summary);
  drawLog(status, page.log);
  drawCheckpoints(status);
  drawPlots(page.history || []);
  document.title = "hogshard: " + phase;
}

async function refresh() {
  try {
    const response = await fetch(withToken("api/page"), {cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    draw(await response.json());
    lastOk = Date.now();
    $("conn").className = "conn";
    $("conn").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (err) {
    $("conn").className = "conn lost";
    $("conn").textContent = "scheduler unreachable" +
      (lastOk ? " for " + duration((Date.now() - lastOk) / 1000) : "") +
      (lastPhase ? " (last phase: " + lastPhase + ")" : "") + ": " + err.message;
  } finally {
    window.setTimeout(refresh, REFRESH_MS);
  }
}

$("raw").href = withToken("api/status");
refresh();
