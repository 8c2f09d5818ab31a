// probe's page: reads the JSON the CLI process serves (the same client calls as the commands) and draws it.
// No library and nothing from the network: the charts are SVG built here, every text set as text (never
// as HTML), so that a frame's name or a query's value from the program shows as written and runs nowhere.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
// The page token came in the URL probe printed; the server answered with a cookie that carries it from then
// on (HttpOnly: no script here reads it), so the address bar drops it, out of the history and of sight.
if (new URLSearchParams(location.search).has("token")) history.replaceState(null, "", location.pathname);
const STATES = {running: "running", silent: "silent", gil_held: "GIL held", stopped: "stopped", dead: "dead"};
const GROUP_COLOURS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
                       "#9c755f", "#bab0ac"];

let paused = false;
let timer = null;
let busy = false;
let refreshS = 5;
let lastDiagnosis = null;
let lastOverview = null;
let lastRows = null;
let shownRank = null;

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function $(id) { return document.getElementById(id); }

async function api(path, options) {
  const headers = Object.assign({}, (options && options.headers) || {});
  const response = await fetch(path, Object.assign({}, options || {}, {headers}));
  const kind = response.headers.get("Content-Type") || "";
  const body = kind.startsWith("application/json") ? await response.json() : await response.text();
  if (!response.ok) throw new Error((body && body.error) || ("HTTP " + response.status));
  return body;
}

function groupColour(group) {
  if (group === null || group === undefined) return "#ffffff";
  return GROUP_COLOURS[group % GROUP_COLOURS.length];
}

// -- the verdict -------------------------------------------------------------------------------------

function renderDiagnosis(d) {
  lastDiagnosis = d;
  const box = $("verdict");
  if (d.error) {
    box.className = "status-unknown";
    box.textContent = "diagnose could not run: " + d.error;
    return;
  }
  box.className = "status-" + d.status;
  const first = d.verdicts && d.verdicts.length ? d.verdicts[0] : null;
  box.textContent = d.status.toUpperCase() + (first ? ": " + first.summary : "");
  $("verdict-text").textContent = (d.lines || []).join("\n") + "\n(looked at " + d.at + ")";
  if (lastOverview) renderGrid(lastOverview);
}

// -- the grid of ranks ----------------------------------------------------------------------------------

function renderLegend() {
  const legend = $("legend");
  legend.replaceChildren();
  for (const [key, word] of Object.entries(STATES)) {
    const item = el("span", {class: "legend-item"});
    item.append(el("span", {class: "swatch state-" + key}), el("span", {}, word));
    legend.append(item);
  }
  const culprit = el("span", {class: "legend-item"});
  culprit.append(el("span", {class: "swatch culprit-swatch"}), el("span", {}, "named by the verdict"));
  legend.append(culprit);
}

function renderGrid(o) {
  const culprits = new Set((lastDiagnosis && lastDiagnosis.culprits) || []);
  const grid = $("grid");
  const cells = [];
  const big = o.ranks.length > 64;
  for (const r of o.ranks) {
    const cell = el("button", {type: "button", class: "cell state-" + r.state + (culprits.has(r.rank) ? " culprit" : "") +
                               (big ? " small" : ""),
                               "data-rank": r.rank, "data-state": r.state, "data-group": r.group === null ? "" : r.group,
                               "data-culprit": culprits.has(r.rank) ? "1" : "0"}, r.rank);
    cell.style.borderBottomColor = groupColour(r.group);
    cell.title = "rank " + r.rank + " (" + (r.host || "?") + ", pid " + (r.pid || "?") + "): " + STATES[r.state] +
                 (r.group === null ? "" : ", stack group " + r.group) + (r.why ? "\n" + r.why : "");
    cell.addEventListener("click", () => showRank(r.rank));
    cells.push(cell);
  }
  grid.replaceChildren(...cells);
  $("rank-count").textContent = "(" + o.ranks.length + " of " + o.total + ", read " + o.at + ")";
  const groups = $("groups");
  groups.replaceChildren();
  for (const g of o.groups.slice(0, 20)) {
    const line = el("div", {class: "group", "data-group": g.group});
    const swatch = el("span", {class: "swatch"});
    swatch.style.background = groupColour(g.group);
    line.append(swatch, el("span", {}, "group " + g.group + ": " + (g.count === 1 ? "rank " : "ranks ") + g.ranks_text +
                                         " (" + g.count + "), main thread in " + g.top));
    groups.append(line);
  }
  if (o.groups.length > 20) groups.append(el("div", {}, "and " + (o.groups.length - 20) + " groups more"));
  const failed = (o.failures || []).map(f => "rank " + f.rank + (f.host ? " (" + f.host + ")" : "") + ": " + f.reason);
  $("failures").textContent = failed.length ? "gave no stacks:\n" + failed.join("\n") : "";
}

async function showRank(rank) {
  shownRank = rank;
  const box = $("rank-detail");
  box.hidden = false;
  $("rank-title").textContent = "rank " + rank + ": reading…";
  $("rank-stacks").textContent = "";
  $("rank-process").replaceChildren();
  let d;
  try {
    d = await api("/api/rank?rank=" + encodeURIComponent(rank));
  } catch (e) {
    $("rank-title").textContent = "rank " + rank + ": " + e.message;
    return;
  }
  if (shownRank !== rank) return;
  $("rank-title").textContent = "rank " + rank + (d.note ? " (" + d.note.split("\n")[0] + ")" : "");
  $("rank-cmd").textContent = d.command || "";
  if (d.process) {
    $("rank-process").append(table(["process.info", ""], Object.entries(d.process)));  // a column a line: it is wide
  } else if (d.process_error) {
    $("rank-process").append(el("p", {}, "process.info: " + d.process_error));
  }
  const lines = [];
  if (d.error) lines.push("no stacks: " + d.error);
  for (const t of d.threads || []) {
    lines.push('Thread ' + t.thread_id + ' "' + t.thread + '"' + (t.main ? " (main)" : ""));
    for (const f of t.frames) {
      lines.push((f.native ? "    [C] " : "    ") + f.func + " (" + f.file + ":" + f.line + ")");
      if (f.code) lines.push("        " + f.code);
    }
    lines.push("");
  }
  $("rank-stacks").textContent = lines.join("\n");
}

// -- where each rank has been ------------------------------------------------------------------------------

// Runs of one stack of each rank's main thread, from the node helpers' samples (run on the page's server).
const TIMELINE_SQL = `SELECT rank, any_value(func) AS func, min(epoch(time)) AS t0, max(epoch(time)) AS t1, count(*) AS n
FROM (SELECT rank, time, func, sum(CASE WHEN stack_id = prev THEN 0 ELSE 1 END) OVER (PARTITION BY rank ORDER BY time) AS run
      FROM (SELECT rank, time, func, stack_id, lag(stack_id) OVER (PARTITION BY rank ORDER BY time) AS prev
            FROM cluster.stack_history WHERE thread = 'MainThread'))
GROUP BY rank, run ORDER BY rank, t0`;

async function refreshTimeline() {
  let d;
  try {
    d = await api("/api/sql", {method: "POST", headers: {"Content-Type": "application/json", "X-Probe-Page": "1"},
                               body: JSON.stringify({sql: TIMELINE_SQL, rank: null, merge: null})});
  } catch (e) {
    $("timeline").replaceChildren();
    $("timeline-status").textContent = "no history: " + e.message;
    return;
  }
  renderTimeline(d.rows.map(r => ({rank: r[0], func: r[1], t0: r[2], t1: r[3], n: r[4]})));
}

function noTimeline() {
  $("timeline").replaceChildren();
  $("timeline-status").textContent = "no history: a job's node helpers keep it (cluster.stack_history); this page is of one process";
}

function renderTimeline(runs) {
  const box = $("timeline");
  box.replaceChildren();
  if (!runs.length) { $("timeline-status").textContent = "no samples yet"; return; }
  const ranks = [...new Set(runs.map(r => r.rank))].slice(0, 64);
  const start = Math.min(...runs.map(r => r.t0));
  const end = Math.max(...runs.map(r => r.t1));
  // The sampling period, from runs of several samples; 1 s where there is none (every run one sample).
  const periods = runs.filter(r => r.n > 1 && r.t1 > r.t0).map(r => (r.t1 - r.t0) / (r.n - 1));
  const step = periods.length ? Math.max(1, Math.min(...periods)) : 1;
  const width = Math.max(600, box.clientWidth || 1000), left = 70, row = 16;
  const scale = (width - left - 10) / Math.max(end - start + step, 1);
  const chart = svg("svg", {width, height: ranks.length * row + 20, class: "timeline"});
  ranks.forEach((rank, i) => {
    chart.append(svg("text", {x: 2, y: i * row + 12, class: "label"}, "rank " + rank));
    for (const r of runs.filter(x => x.rank === rank)) {
      const bar = svg("rect", {x: left + (r.t0 - start) * scale, y: i * row + 2, height: row - 4,
                               width: Math.max(2, (r.t1 - r.t0 + step) * scale), "data-rank": rank, "data-func": r.func});
      bar.style.fill = "hsl(" + (hue(r.func || "?") * 7 % 360) + ", 55%, 62%)";
      bar.append(svg("title", {}, "rank " + rank + ": " + r.func + " from " + new Date(r.t0 * 1000).toLocaleTimeString() +
                                   " to " + new Date(r.t1 * 1000).toLocaleTimeString() + ", " + r.n + " samples"));
      chart.append(bar);
    }
  });
  chart.append(svg("text", {x: left, y: ranks.length * row + 16, class: "label"}, new Date(start * 1000).toLocaleTimeString()));
  chart.append(svg("text", {x: width - 80, y: ranks.length * row + 16, class: "label"}, new Date(end * 1000).toLocaleTimeString()));
  box.append(chart);
  $("timeline-status").textContent = runs.length + " runs of " + ranks.length + " ranks; hover a bar for its function";
}

// -- the flame graph ---------------------------------------------------------------------------------------

function hue(text) {
  let h = 0;
  for (let i = 0; i < text.length; i++) h = (h * 31 + text.charCodeAt(i)) >>> 0;
  return 20 + (h % 35);
}

function renderFlame(flame) {
  const box = $("flame");
  box.replaceChildren();
  const width = Math.max(600, box.clientWidth || 1000);
  const row = 18;
  for (const t of flame.threads) {
    box.append(el("h3", {}, 'Thread "' + t.thread + '": ' + t.stacks + " distinct stack" + (t.stacks === 1 ? "" : "s") +
                             " across " + t.ranks_answered + " of " + flame.total + " rank" + (flame.total === 1 ? "" : "s") +
                             (t.stacks_drawn < t.stacks ? " (the largest " + t.stacks_drawn + " drawn)" : "")));
    const rects = [];
    let depth = 0;
    const place = (node, x, w, level, minority) => {
      depth = Math.max(depth, level + 1);
      const departs = node.departs;
      const g = svg("g", {class: "frame" + (departs ? " departs" : "") + (minority ? " minority" : ""),
                         "data-func": node.func, "data-ranks": node.ranks, "data-n": node.n});
      const fill = departs ? "#d62728" : minority ? "#f7b267" : level === 0 ? "#c9c9c9" : "hsl(" + hue(node.func) + ",85%,62%)";
      g.append(svg("rect", {x: x.toFixed(1), y: level * row, width: Math.max(0.5, w - 1).toFixed(1), height: row - 1, fill,
                            rx: 2}));
      g.append(svg("title", {}, (level === 0 ? "thread " + node.func : node.func + " (" + node.file + ":" + node.line + ")") +
                               "\n" + (node.n === 1 ? "rank " : "ranks ") + node.ranks + " (" + node.n + " of " + flame.total + ")" +
                               (departs ? "\nwhere these ranks depart from the larger group" : "")));
      if (w > 40) {
        const label = level === 0 ? node.func : node.func + " " + node.ranks;
        const chars = Math.floor((w - 6) / 6.5);
        g.append(svg("text", {x: (x + 3).toFixed(1), y: level * row + 13},
                     label.length > chars ? label.slice(0, Math.max(1, chars - 1)) + "…" : label));
      }
      rects.push(g);
      // A frame as wide as its ranks; one where a few ranks depart is kept wide enough to see and point at
      // (one rank of 256 would be a hair), taken from the largest.
      const kids = node.kids || [];
      const widths = kids.map(k => w * k.n / node.n);
      for (let i = 1; i < kids.length; i++) {
        const wanted = Math.min(8, w / (2 * kids.length));
        if (widths[i] < wanted && widths[0] - (wanted - widths[i]) > wanted) {
          widths[0] -= wanted - widths[i];
          widths[i] = wanted;
        }
      }
      let offset = x;
      kids.forEach((kid, i) => {
        if (widths[i] >= 0.5) place(kid, offset, widths[i], level + 1, minority || departs);
        offset += widths[i];
      });
    };
    place(t.tree, 0, width, 0, false);
    const chart = svg("svg", {class: "flame", width, height: depth * row, viewBox: "0 0 " + width + " " + depth * row,
                              "data-thread": t.thread});
    chart.append(...rects);
    box.append(chart);
  }
  if (flame.threads_more) box.append(el("p", {}, "and " + flame.threads_more + " thread names more (see the CLI)"));
  if (!flame.threads.length) box.append(el("p", {}, "no rank gave its stacks"));
}

// -- step time and memory ----------------------------------------------------------------------------------

function renderMetrics(m) {
  if (m.error) {
    $("metrics-source").textContent = "(" + m.error + ")";
    return;
  }
  const sources = {};
  for (const s of m.series) (sources[s.source] = sources[s.source] || []).push(s.rank);
  const words = {trace: "the trace", counter: "the step counter and RSS", memory: "RSS a look (no optimizer step counted)"};
  $("metrics-source").textContent = "(" + (Object.entries(sources).map(([k, ranks]) =>
    words[k] + " on " + ranks.length + " rank" + (ranks.length === 1 ? "" : "s")).join("; ") || "no rank answered") +
    "; the last " + m.steps + " steps)";
  $("metrics-queries").textContent = (m.queries || []).join("\n");
  const heat = m.series.length > 8;
  for (const [key, box] of [["step_s", $("chart-step")], ["memory_mb", $("chart-memory")]]) {
    box.replaceChildren(heat ? heatMap(m.series, key) : lineChart(m.series, key));
  }
}

function extent(series, key) {
  let lo = Infinity, hi = -Infinity;
  for (const s of series) for (const v of s[key]) if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  return lo === Infinity ? null : [lo, hi === lo ? lo + 1e-9 : hi];
}

function fmt(v) { return v === null || v === undefined ? "–" : Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(3); }

function lineChart(series, key) {
  const W = 460, H = 220, L = 54, B = 24, T = 8, R = 8;
  const chart = svg("svg", {class: "chart", width: W, height: H + 18 * Math.ceil(series.length / 4), "data-kind": "lines"});
  const ys = extent(series, key);
  let x0 = Infinity, x1 = -Infinity;
  for (const s of series) for (const x of s.x) { x0 = Math.min(x0, x); x1 = Math.max(x1, x); }
  if (!ys || x0 === Infinity) {
    chart.append(svg("text", {x: 10, y: 20}, "nothing to draw yet"));
    return chart;
  }
  const lo = Math.min(0, ys[0]), hi = ys[1];
  const sx = x => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
  const sy = v => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
  chart.append(svg("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}),
               svg("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"}),
               svg("text", {x: L - 4, y: T + 10, "text-anchor": "end"}, fmt(hi)),
               svg("text", {x: L - 4, y: H - B, "text-anchor": "end"}, fmt(lo)),
               svg("text", {x: L, y: H - 6}, String(x0)),
               svg("text", {x: W - R, y: H - 6, "text-anchor": "end"}, String(x1) + " (" + (series[0].unit || "step") + ")"));
  series.forEach((s, i) => {
    const colour = GROUP_COLOURS[i % GROUP_COLOURS.length];
    const points = [];
    s.x.forEach((x, j) => { if (s[key][j] !== null) points.push(sx(x).toFixed(1) + "," + sy(s[key][j]).toFixed(1)); });
    const line = svg("polyline", {points: points.join(" "), fill: "none", stroke: colour, "stroke-width": 1.6,
                                  "data-rank": s.rank});
    line.append(svg("title", {}, "rank " + s.rank + ": last " + fmt(s[key][s[key].length - 1])));
    chart.append(line);
    if (points.length === 1) {
      const [cx, cy] = points[0].split(",");
      chart.append(svg("circle", {cx, cy, r: 3, fill: colour}));
    }
    chart.append(svg("rect", {x: L + (i % 4) * 100, y: H + 4 + 18 * Math.floor(i / 4), width: 10, height: 10, fill: colour}),
                 svg("text", {x: L + 14 + (i % 4) * 100, y: H + 13 + 18 * Math.floor(i / 4)}, "rank " + s.rank));
  });
  return chart;
}

function heatMap(series, key) {
  // Many ranks: a row a rank, a column a step (the latest steps of any rank), darker is more.
  const columns = [...new Set(series.flatMap(s => s.x))].sort((a, b) => a - b).slice(-200);
  const index = new Map(columns.map((x, i) => [x, i]));
  const ys = extent(series, key);
  const L = 40, W = 460, cw = Math.max(1, (W - L) / Math.max(1, columns.length));
  const ch = Math.max(2, Math.min(14, 360 / series.length));
  const H = ch * series.length;
  const chart = svg("svg", {class: "chart heat", width: W, height: H + 30, "data-kind": "heat"});
  const info = svg("text", {x: L, y: H + 24}, ys ? "from " + fmt(ys[0]) + " (light) to " + fmt(ys[1]) + " (dark); point at a cell" : "nothing to draw yet");
  const cells = [];
  series.forEach((s, row) => {
    if (ch >= 8 || row % Math.ceil(10 / ch) === 0) {
      chart.append(svg("text", {x: L - 4, y: row * ch + Math.min(ch, 11), "text-anchor": "end", class: "small"}, s.rank));
    }
    s.x.forEach((x, j) => {
      const v = s[key][j];
      if (v === null || !ys || !index.has(x)) return;
      const t = (v - ys[0]) / (ys[1] - ys[0]);
      cells.push(svg("rect", {x: (L + index.get(x) * cw).toFixed(1), y: (row * ch).toFixed(1), width: cw.toFixed(2),
                              height: ch, fill: "hsl(" + (210 - 200 * t).toFixed(0) + ",70%," + (88 - 50 * t).toFixed(0) + "%)"}));
    });
  });
  chart.append(...cells, info);
  chart.addEventListener("mousemove", ev => {
    const box = chart.getBoundingClientRect();
    const row = Math.floor((ev.clientY - box.top) / ch), col = Math.floor((ev.clientX - box.left - L) / cw);
    const s = series[row];
    if (!s || col < 0 || col >= columns.length) return;
    const j = s.x.indexOf(columns[col]);
    info.textContent = "rank " + s.rank + ", " + (s.unit || "step") + " " + columns[col] + ": " + (j < 0 ? "–" : fmt(s[key][j]));
  });
  return chart;
}

// -- SQL -------------------------------------------------------------------------------------------------

function table(columns, rows) {
  const t = el("table", {class: "rows"});
  const head = el("tr");
  for (const c of columns) head.append(el("th", {}, c));
  t.append(el("thead"));
  t.firstChild.append(head);
  const body = el("tbody");
  for (const r of rows) {
    const tr = el("tr");
    for (const v of r) tr.append(el("td", {}, v === null ? "NULL" : typeof v === "object" ? JSON.stringify(v) : v));
    body.append(tr);
  }
  t.append(body);
  return t;
}

async function runSql(ev) {
  ev.preventDefault();
  const status = $("sql-status");
  status.textContent = "running…";
  $("sql-result").replaceChildren();
  $("sql-csv").disabled = true;
  const rank = $("sql-rank").value.trim();
  try {
    const d = await api("/api/sql", {method: "POST", headers: {"Content-Type": "application/json", "X-Probe-Page": "1"},
                                     body: JSON.stringify({sql: $("sql").value, rank: rank === "" ? null : rank,
                                                           merge: $("sql-merge").value.trim() || null})});
    lastRows = d;
    const names = d.columns.map(c => c.name);
    $("sql-result").append(table(names, d.rows));
    $("sql-cmd").textContent = d.command || "";
    const failed = (d.failures || []).map(f => "rank " + f.rank + ": " + f.reason);
    status.textContent = d.rows.length + " row" + (d.rows.length === 1 ? "" : "s") +
      (d.truncated ? " (cut: " + d.total + " came, the page shows " + d.rows.length + ")" : "") +
      (failed.length ? "; no answer from " + failed.join("; ") : "");
    status.setAttribute("data-rows", d.rows.length);
    $("sql-csv").disabled = false;
  } catch (e) {
    status.textContent = "error: " + e.message;
    status.setAttribute("data-rows", "error");
  }
}

function csvCell(v) {
  const s = v === null ? "" : typeof v === "object" ? JSON.stringify(v) : String(v);
  return /[",\n\r]/.test(s) ? '"' + s.replace(/"/g, '""') + '"' : s;
}

function csvText(result) {
  const lines = [result.columns.map(c => csvCell(c.name)).join(",")];
  for (const r of result.rows) lines.push(r.map(csvCell).join(","));
  return lines.join("\n") + "\n";
}

function downloadCsv() {
  if (lastRows) save(new Blob([csvText(lastRows)], {type: "text/csv"}), "probe-query.csv");
}

function save(blob, name) {
  const a = el("a", {href: URL.createObjectURL(blob), download: name});
  document.body.append(a);
  a.click();
  setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
}

async function exportTrace() {
  const status = $("trace-status");
  status.textContent = "exporting…";
  try {
    const response = await fetch("/api/trace");
    if (!response.ok) throw new Error((await response.json()).error);
    const blob = await response.blob();
    const name = ((response.headers.get("Content-Disposition") || "").match(/filename="([^"]+)"/) || [])[1] || "probe-trace.json";
    save(blob, name);
    status.textContent = response.headers.get("X-Probe-Events") + " events saved as " + name + " (open it in ui.perfetto.dev)";
  } catch (e) {
    status.textContent = "error: " + e.message;
  }
}

// -- refreshing --------------------------------------------------------------------------------------------

function stamp() { $("updated").textContent = (paused ? "paused; " : "") + "last read " + new Date().toLocaleTimeString(); }

async function refresh() {
  if (busy) return;
  busy = true;
  clearTimeout(timer);
  const overview = api("/api/overview").then(o => {
    if (o.error) { $("failures").textContent = "no ranks read: " + o.error; return; }  // the job gone, its helper silent
    lastOverview = o;
    renderGrid(o);
    renderFlame(o.flame);
    return o;
  })
    .catch(e => { $("failures").textContent = "the page's server: " + e.message; });
  const metrics = api("/api/metrics").then(renderMetrics).catch(e => { $("metrics-source").textContent = "(" + e.message + ")"; });
  const diagnosis = api("/api/diagnose").then(renderDiagnosis).catch(e => renderDiagnosis({error: e.message}));
  // The history is the node helpers' (a job's): a page of one process has none to ask for.
  const timeline = overview.then(o => o && o.job ? refreshTimeline() : noTimeline());
  await Promise.all([overview, metrics, diagnosis, timeline]);
  busy = false;
  stamp();
  if (!paused) timer = setTimeout(refresh, refreshS * 1000);
}

async function start() {
  renderLegend();
  try {
    const about = await api("/api/about");
    refreshS = about.refresh_s;
    $("target").textContent = about.target + (about.single ? " (one process)" : "");
    document.title = "probe " + about.target;
    $("diagnose-cmd").textContent = about.diagnose;
    $("backtrace-cmd").textContent = about.backtrace;
  } catch (e) {
    $("verdict").textContent = "the page's server does not answer: " + e.message;
    return;
  }
  $("pause").addEventListener("click", () => {
    paused = !paused;
    $("pause").textContent = paused ? "Resume" : "Pause";
    clearTimeout(timer);
    if (!paused) refresh(); else stamp();
  });
  $("refresh-now").addEventListener("click", refresh);
  $("sql-form").addEventListener("submit", runSql);
  $("sql-csv").addEventListener("click", downloadCsv);
  $("trace-export").addEventListener("click", exportTrace);
  refresh();
}

start();
