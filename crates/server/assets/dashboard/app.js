// Onceguard's dashboard: reads /v1/dashboard every two seconds with an admin API key and draws
// it. The key stays in this tab (sessionStorage) and goes only in the Authorization header.
"use strict";

const KEY_STORAGE = "onceguard.adminKey";
const REFRESH_MS = 2000;
const OUTCOMES = ["acquired", "replay", "in_flight", "mismatch", "denied", "pending_approval", "proceed"];
const COLORS = { acquired: "#3b6fd8", replay: "#2e9d62", in_flight: "#d9a21b", mismatch: "#d2542c", denied: "#7a4bc4", pending_approval: "#1f9bb0", proceed: "#8a8f98" };
// One colour per namespace named in the tokens chart (at most eight), and one for the others.
const NAMESPACE_COLORS = ["#2e9d62", "#3b6fd8", "#d9a21b", "#7a4bc4", "#d2542c", "#1f9bb0", "#b0417a", "#6b7a2a"];
const OTHERS_COLOR = "#9aa3ad";
const SVG_NS = "http://www.w3.org/2000/svg";

// `approvals`: the ids of the approvals listed (null: draw them at the next refresh), so that a
// refresh does not redraw the rows (and the reasons being typed) while they stay the same.
const state = { key: sessionStorage.getItem(KEY_STORAGE) || "", tenant: "", timer: null, updated: null, approvals: null };

const $ = (id) => document.getElementById(id);
const byTest = (id) => document.querySelector(`[data-testid="${id}"]`);

function setText(testId, text) {
  const el = byTest(testId);
  if (el) el.textContent = text;
}

function count(n) {
  return Number(n).toLocaleString("en-US");
}

function ms(v) {
  return v === null || v === undefined ? "–" : `${v.toFixed(2)} ms`;
}

function duration(seconds) {
  const s = Math.max(0, Math.floor(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

function clock(rfc3339) {
  if (!rfc3339) return "–";
  const d = new Date(rfc3339);
  return d.toISOString().replace("T", " ").slice(0, 19) + "Z";
}

function status(text, error) {
  const el = $("status");
  el.textContent = text;
  el.classList.toggle("error", Boolean(error));
}

async function api(path, params) {
  const query = new URLSearchParams();
  for (const [name, value] of Object.entries(params || {})) {
    if (value !== undefined && value !== null && value !== "") query.set(name, value);
  }
  const url = query.toString() ? `${path}?${query}` : path;
  const response = await fetch(url, { headers: { Authorization: `Bearer ${state.key}` }, cache: "no-store" });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const error = new Error(body.detail || `${response.status} ${response.statusText}`);
    error.status = response.status;
    throw error;
  }
  return body;
}

async function send(path, body, method = "POST") {
  const response = await fetch(path, {
    method,
    headers: { Authorization: `Bearer ${state.key}`, "Content-Type": "application/json" },
    body: JSON.stringify(body),
    cache: "no-store",
  });
  const answer = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(answer.detail || `${response.status} ${response.statusText}`);
  return answer;
}

// ---------------------------------------------------------------------------------------------
// Charts (plain SVG)
// ---------------------------------------------------------------------------------------------

const CHART = { width: 600, height: 180, left: 44, right: 8, top: 8, bottom: 20 };

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function axes(svg, max, slots, unit) {
  const { width, height, left, right, top, bottom } = CHART;
  const plotH = height - top - bottom;
  for (const f of [0, 0.5, 1]) {
    const y = top + plotH * (1 - f);
    svg.appendChild(svgEl("line", { class: "grid", x1: left, x2: width - right, y1: y, y2: y }));
    const value = max * f;
    const label = value >= 100 ? Math.round(value) : Number(value.toFixed(2));
    svg.appendChild(svgEl("text", { x: left - 4, y: y + 3, "text-anchor": "end" }, `${label}${unit}`));
  }
  const minutes = (slots * 10) / 60;
  for (const f of [0, 1 / 3, 2 / 3, 1]) {
    const x = left + (width - left - right) * f;
    const label = f === 1 ? "now" : `-${Math.round(minutes * (1 - f))}m`;
    svg.appendChild(svgEl("text", { x, y: height - 5, "text-anchor": f === 0 ? "start" : f === 1 ? "end" : "middle" }, label));
  }
}

function stackedBars(svg, layers, colors, scale) {
  svg.replaceChildren();
  const names = Object.keys(layers);
  const slots = names.length ? layers[names[0]].length : 0;
  const totals = Array.from({ length: slots }, (_, i) => names.reduce((s, n) => s + layers[n][i] * scale, 0));
  const max = niceMax(Math.max(0, ...totals));
  axes(svg, max, slots, "");
  const { width, height, left, right, top, bottom } = CHART;
  const plotH = height - top - bottom;
  const w = (width - left - right) / Math.max(1, slots);
  for (let i = 0; i < slots; i++) {
    let y = top + plotH;
    for (const n of names) {
      const v = layers[n][i] * scale;
      if (!v) continue;
      const h = (v / max) * plotH;
      y -= h;
      svg.appendChild(svgEl("rect", { x: left + i * w + 0.5, y, width: Math.max(1, w - 1), height: h, fill: colors[n] }, undefined));
    }
  }
}

function lines(svg, series, colors) {
  svg.replaceChildren();
  const names = Object.keys(series);
  const slots = names.length ? series[names[0]].length : 0;
  const values = names.flatMap((n) => series[n].filter((v) => v !== null));
  const max = niceMax(Math.max(0, ...values));
  axes(svg, max, slots, "");
  const { width, height, left, right, top, bottom } = CHART;
  const plotH = height - top - bottom;
  const w = (width - left - right) / Math.max(1, slots);
  for (const n of names) {
    let d = "";
    let pen = false;
    series[n].forEach((v, i) => {
      if (v === null) { pen = false; return; }
      const x = left + i * w + w / 2;
      const y = top + plotH * (1 - v / max);
      d += `${pen ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)} `;
      pen = true;
      svg.appendChild(svgEl("circle", { cx: x, cy: y, r: 1.8, fill: colors[n] }));
    });
    if (d) svg.appendChild(svgEl("path", { d, fill: "none", stroke: colors[n], "stroke-width": 1.8 }));
  }
}

function legend(el, colors, labels) {
  el.replaceChildren();
  for (const [name, color] of Object.entries(colors)) {
    const span = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = color;
    span.append(swatch, labels[name] || name);
    el.appendChild(span);
  }
}

// ---------------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------------

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "–" : String(text);
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function renderTenants(d) {
  const select = $("tenant");
  const current = Array.from(select.options).map((o) => o.value).join(",");
  if (current !== d.tenants.join(",")) {
    select.replaceChildren(...d.tenants.map((t) => new Option(t, t)));
  }
  select.value = d.tenant;
  select.disabled = d.tenants.length < 2;
}

function renderTokens(byNamespace) {
  const layers = {};
  const colors = {};
  byNamespace.namespaces.forEach((n, i) => {
    layers[n.namespace] = n.per_slot;
    colors[n.namespace] = NAMESPACE_COLORS[i % NAMESPACE_COLORS.length];
  });
  if (byNamespace.others.some((v) => v > 0)) {
    layers["(other namespaces)"] = byNamespace.others;
    colors["(other namespaces)"] = OTHERS_COLOR;
  }
  stackedBars($("chart-tokens"), Object.keys(layers).length ? layers : { saved: byNamespace.others }, colors, 1);
  legend($("legend-tokens"), colors, {});
}

function render(d) {
  renderTenants(d);
  setText("instance", `v${d.instance.version} · ${d.store.kind} store · tenant ${d.tenant}`);
  setText("started-at", clock(d.instance.started_at));
  setText("claims-acquired", count(d.claims.acquired));
  setText("claims-replay", count(d.claims.replay));
  setText("claims-in-flight", count(d.claims.in_flight));
  setText("claims-mismatch", count(d.claims.mismatch));
  setText("claims-denied", count(d.claims.denied));
  setText("cost-saved", count(d.cost_saved));
  setText("tokens-saved", count(d.tokens_saved));
  setText("stale-calls", count(d.stale_calls));
  setText("recoveries", count(d.recoveries.lease_expired + d.recoveries.reported_unknown));
  setText("recoveries-detail", `${count(d.recoveries.lease_expired)} lease expired · ${count(d.recoveries.reported_unknown)} reported unknown`);
  setText("keys-in-flight", count(d.keys.in_flight));
  setText("keys-stuck", count(d.keys.stuck));
  setText("keys-as-of", d.keys.as_of ? `counted ${clock(d.keys.as_of)}${d.keys.complete ? "" : " (at least)"}` : "not counted yet");
  setText("latency-p50", ms(d.latency.p50_ms));
  setText("latency-p99", ms(d.latency.p99_ms));
  setText("latency-window", `${count(d.latency.count)} calls, last ${d.latency.window_seconds / 60} min${d.figures === "instance" ? ", every tenant" : ""}`);
  const offset = d.store.clock_offset_ms;
  const clockOff = offset !== null && Math.abs(offset) > d.store.max_clock_offset_ms;
  setText("store-status", !d.store.up ? "DOWN" : clockOff ? "CLOCK OFF" : "up");
  setText("store-kind", d.store.kind);
  $("store-tile").classList.toggle("down", !d.store.up || clockOff);
  const clockText = offset === null
    ? ""
    : ` Clock offset: this instance is ${count(Math.abs(offset))} ms ${offset >= 0 ? "ahead of" : "behind"} the store's (bound ${count(d.store.max_clock_offset_ms)} ms)${clockOff ? ": claims are refused with 503 clock-offset until it is back within bound" : ""}.`;
  setText("store-detail", (d.store.up
    ? `${d.store.kind}: answered the last check at ${clock(d.store.checked_at)}.`
    : `${d.store.kind}: does not answer (${d.store.error || "not checked yet"}). Claims fail closed with 503.`) + clockText);
  setText("controls", d.controls.summary);
  $("controls").classList.toggle("alert", d.controls.switches.length > 0 || (d.controls.observing || []).length > 0);
  renderTripwires(d.controls.tripwires || []);

  const slotSeconds = d.series.slot_seconds;
  const colors = Object.fromEntries(OUTCOMES.map((o) => [o, COLORS[o]]));
  stackedBars($("chart-claims"), Object.fromEntries(OUTCOMES.map((o) => [o, d.series.claims[o]])), colors, 1 / slotSeconds);
  legend($("legend-claims"), colors, { in_flight: "in flight", pending_approval: "awaiting approval", proceed: "proceeded (observe mode)" });
  stackedBars($("chart-cost"), { saved: d.series.cost_saved }, { saved: COLORS.replay }, 1);
  renderTokens(d.series.tokens_saved_by_namespace);
  const latencyColors = { p50: "#3b6fd8", p99: "#d2542c" };
  lines($("chart-latency"), { p50: d.series.p50_ms, p99: d.series.p99_ms }, latencyColors);
  legend($("legend-latency"), latencyColors, {});

  const stuckRows = d.stuck.map((k) => {
    const row = document.createElement("tr");
    row.className = "clickable";
    row.dataset.namespace = k.namespace;
    row.dataset.key = k.key;
    row.title = "Inspect this key";
    cell(row, k.namespace);
    cell(row, k.key);
    cell(row, k.run);
    cell(row, k.reported_unknown ? `${duration(k.stuck_for_seconds)} (reported unknown)` : duration(k.stuck_for_seconds), "num");
    cell(row, duration(k.age_seconds), "num");
    cell(row, k.attempt, "num");
    cell(row, k.fence, "num");
    cell(row, k.last_checkpoint ? `${k.last_checkpoint.name} (fence ${k.last_checkpoint.fence}, ${clock(k.last_checkpoint.at)})` : "none");
    row.addEventListener("click", () => inspect(k.namespace, k.key));
    return row;
  });
  $("stuck-rows").replaceChildren(...stuckRows);
  $("stuck-empty").hidden = stuckRows.length > 0;
  setText("stuck-count", d.keys.stuck > d.stuck.length ? `(${d.stuck.length} of ${count(d.keys.stuck)} shown)` : "");

  const recentRows = d.recent.map((e) => {
    const row = document.createElement("tr");
    row.className = "clickable";
    cell(row, clock(e.at));
    cell(row, e.kind === "stale_completion" ? `stale ${e.op}` : e.kind);
    cell(row, e.namespace);
    cell(row, e.key);
    cell(row, e.fence, "num");
    cell(row, e.reason);
    row.addEventListener("click", () => inspect(e.namespace, e.key));
    return row;
  });
  $("recent-rows").replaceChildren(...recentRows);
  $("recent-empty").hidden = recentRows.length > 0;

  const opRows = d.store.ops.map((op) => {
    const row = document.createElement("tr");
    cell(row, op.op);
    cell(row, count(op.count), "num");
    cell(row, count(op.errors), "num");
    cell(row, ms(op.p50_ms), "num");
    cell(row, ms(op.p99_ms), "num");
    return row;
  });
  $("store-rows").replaceChildren(...opRows);
  renderApprovals(d.approvals);
  renderObserved(d.observed);
  renderRollbacks(d.rollbacks);
}

// What observe mode let through: duplicates enforcement would have stopped, and what they cost again.
function renderObserved(o) {
  setText("observed-duplicates", count(o.duplicates_not_prevented));
  const c = o.claims;
  setText("observed-detail", `${count(c.replay)} replays, ${count(c.in_flight)} in flight, ${count(c.mismatch)} mismatches, ${count(c.denied)} denials would have been`);
  setText("observed-cost", count(o.cost_not_saved));
  setText("observed-tokens", `and ${count(o.tokens_not_saved)} tokens enforcing would have saved`);
}

// Runs being rolled back, with their progress (a failed compensation is kept and shown).
function renderRollbacks(rollbacks) {
  const rows = rollbacks.map((r) => {
    const row = document.createElement("tr");
    row.dataset.testid = `rollback-${r.run}`;
    if (r.failed > 0) row.className = "bad";
    cell(row, r.run);
    cell(row, clock(r.started_at));
    cell(row, r.why);
    for (const n of [r.effects, r.compensated, r.pending, r.in_progress, r.failed, r.not_compensable, r.effects_in_flight]) {
      cell(row, count(n), "num");
    }
    return row;
  });
  $("rollback-rows").replaceChildren(...rows);
  $("rollbacks-empty").hidden = rows.length > 0;
}

function renderApprovals(panel) {
  setText("approvals-pending", count(panel.pending));
  setText("approvals-oldest", panel.pending ? `oldest waits ${duration(panel.oldest_pending_seconds)}` : "calls a person must approve");
  setText("approvals-count", panel.pending > panel.waiting.length ? `(${panel.waiting.length} of ${count(panel.pending)} shown)` : "");
  $("approvals-empty").hidden = panel.waiting.length > 0;
  const listed = panel.waiting.map((a) => a.id).join(",");
  // The ages move on; the rows (and any reason being typed) are redrawn only when the list does.
  for (const a of panel.waiting) {
    const row = document.querySelector(`#approval-rows tr[data-id="${a.id}"]`);
    if (row) {
      row.querySelector(".waiting").textContent = duration(a.waiting_seconds);
      row.querySelector(".expires").textContent = duration(a.expires_in_seconds);
      row.querySelector(".webhook").textContent = webhook(a.notice);
    }
  }
  if (listed === state.approvals) return;
  state.approvals = listed;
  const rows = panel.waiting.map((a) => {
    const row = document.createElement("tr");
    row.dataset.id = a.id;
    row.dataset.testid = `approval-${a.key}`;
    cell(row, a.namespace);
    cell(row, a.key);
    cell(row, a.summary);
    cell(row, a.run);
    cell(row, a.cost, "num");
    cell(row, duration(a.waiting_seconds), "num waiting");
    cell(row, duration(a.expires_in_seconds), "num expires");
    cell(row, webhook(a.notice), "webhook");
    const decide = document.createElement("td");
    const why = document.createElement("input");
    why.placeholder = "why (required)";
    why.className = "why";
    why.dataset.testid = `approval-why-${a.key}`;
    const approve = document.createElement("button");
    approve.type = "button";
    approve.textContent = "Approve";
    approve.dataset.testid = `approve-${a.key}`;
    const deny = document.createElement("button");
    deny.type = "button";
    deny.textContent = "Deny";
    deny.className = "deny";
    deny.dataset.testid = `deny-${a.key}`;
    const decided = document.createElement("span");
    decided.className = "muted";
    decided.dataset.testid = `approval-result-${a.key}`;
    const act = async (verdict) => {
      if (!why.value.trim()) {
        decided.textContent = "say why first";
        return;
      }
      approve.disabled = deny.disabled = true;
      try {
        const view = await send(`/v1/approvals/${encodeURIComponent(a.id)}/${verdict}`, { why: why.value.trim(), tenant: state.tenant });
        decided.textContent = `${view.state} by ${view.decision.by}`;
        state.approvals = null;
      } catch (e) {
        decided.textContent = e.message;
        approve.disabled = deny.disabled = false;
      }
    };
    approve.addEventListener("click", () => act("approve"));
    deny.addEventListener("click", () => act("deny"));
    decide.append(why, " ", approve, " ", deny, " ", decided);
    row.appendChild(decide);
    return row;
  });
  $("approval-rows").replaceChildren(...rows);
}

function webhook(notice) {
  if (!notice) return "–";
  if (notice.delivered_at) return `delivered ${clock(notice.delivered_at)}`;
  return `${notice.attempts} attempt${notice.attempts === 1 ? "" : "s"}${notice.last_error ? `: ${notice.last_error}` : ""}`;
}

function definitionList(pairs) {
  const dl = document.createElement("dl");
  for (const [name, value, testId] of pairs) {
    const dt = document.createElement("dt");
    dt.textContent = name;
    const dd = document.createElement("dd");
    if (value instanceof Node) dd.appendChild(value);
    else dd.textContent = value === null || value === undefined ? "–" : String(value);
    if (testId) dd.dataset.testid = testId;
    dl.append(dt, dd);
  }
  return dl;
}

function badge(text, className) {
  const span = document.createElement("span");
  span.className = `badge ${className}`;
  span.textContent = text;
  return span;
}

function renderRecord(r) {
  const out = $("inspect-result");
  const stateBadge = document.createElement("span");
  stateBadge.append(badge(r.state, r.state));
  if (r.stuck) stateBadge.append(" ", badge("stuck", "stuck"));
  const facts = definitionList([
    ["state", stateBadge, "inspect-state"],
    ["fence", r.fence, "inspect-fence"],
    ["attempt", r.attempt, "inspect-attempt"],
    ["run", r.run, "inspect-run"],
    ["lease until", r.lease_expires_at ? clock(r.lease_expires_at) : null],
    ["reported unknown", r.reported_unknown ? "yes" : "no"],
    ["fingerprint", r.fingerprint],
    ["compensation", r.compensation ?? "none", "inspect-compensation"],
    ["stored outcome", r.stored ? `${r.stored.status}${r.stored.reconciled ? " (reconciled)" : ""}, ${r.stored.content_type}, ${count(r.stored.bytes)} bytes${r.stored.digest_only ? " (digest only)" : ""}${r.stored.cost === null ? "" : `, cost ${count(r.stored.cost)}`}` : "none", "inspect-stored"],
  ]);
  const checkpoints = document.createElement("div");
  const h = document.createElement("h4");
  h.textContent = `Checkpoints (${r.checkpoints.length})`;
  const list = document.createElement("ol");
  list.className = "timeline";
  list.dataset.testid = "inspect-checkpoints";
  for (const cp of r.checkpoints) {
    const li = document.createElement("li");
    const time = document.createElement("time");
    time.textContent = clock(cp.at);
    li.append(time, `${cp.name} (fence ${cp.fence})`);
    list.appendChild(li);
  }
  checkpoints.append(h, list);
  const timeline = document.createElement("div");
  const th = document.createElement("h4");
  th.textContent = "Timeline (from the record's timestamps)";
  const tl = document.createElement("ol");
  tl.className = "timeline";
  tl.dataset.testid = "inspect-timeline";
  for (const entry of r.timeline) {
    const li = document.createElement("li");
    const time = document.createElement("time");
    time.textContent = clock(entry.at);
    li.append(time, entry.what);
    tl.appendChild(li);
  }
  timeline.append(th, tl);
  const grid = document.createElement("div");
  grid.className = "inspect-grid";
  grid.append(facts, checkpoints, timeline);
  const title = document.createElement("h4");
  title.textContent = `${r.namespace} / ${r.key}`;
  out.replaceChildren(title, grid);
}

async function inspect(namespace, key) {
  $("inspect-namespace").value = namespace;
  $("inspect-key").value = key;
  const out = $("inspect-result");
  try {
    const record = await api("/v1/dashboard/record", { tenant: state.tenant, namespace, key });
    renderRecord(record);
  } catch (e) {
    const p = document.createElement("p");
    p.className = "empty";
    p.dataset.testid = "inspect-error";
    p.textContent = e.status === 404 ? "No live record for this key (never claimed, expired or purged)." : e.message;
    out.replaceChildren(p);
  }
}

// ---------------------------------------------------------------------------------------------
// Session
// ---------------------------------------------------------------------------------------------

async function refresh() {
  clearTimeout(state.timer);
  if (!state.key) return;
  try {
    const d = await api("/v1/dashboard", { tenant: state.tenant });
    state.tenant = d.tenant;
    render(d);
    $("main").hidden = false;
    $("connect").hidden = true;
    $("session").hidden = false;
    document.body.dataset.loaded = "true";
    state.updated = new Date().toLocaleTimeString("en-GB");
    $("main").classList.remove("stale");
    status(`Live · updated ${state.updated}`);
  } catch (e) {
    if (e.status === 401 || e.status === 403) {
      status(`Refused: ${e.message}`, true);
      return;
    }
    // Keep the last figures, dimmed, and say since when (a store that does not answer also
    // stops API keys from being checked: the server answers 503).
    $("main").classList.add("stale");
    status(`Not live: ${e.message}${state.updated ? ` · figures from ${state.updated}` : ""}`, true);
  }
  state.timer = setTimeout(refresh, REFRESH_MS);
}

$("connect").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("api-key").value.trim();
  $("api-key").value = "";
  sessionStorage.setItem(KEY_STORAGE, state.key);
  status("Connecting…");
  refresh();
});

$("forget").addEventListener("click", () => {
  clearTimeout(state.timer);
  sessionStorage.removeItem(KEY_STORAGE);
  state.key = "";
  state.tenant = "";
  $("main").hidden = true;
  $("connect").hidden = false;
  $("session").hidden = true;
  delete document.body.dataset.loaded;
  status("Enter an admin API key to connect.");
});

$("tenant").addEventListener("change", () => {
  state.tenant = $("tenant").value;
  state.approvals = null;
  $("inspect-result").replaceChildren();
  refresh();
});

$("inspect").addEventListener("submit", (event) => {
  event.preventDefault();
  inspect($("inspect-namespace").value.trim(), $("inspect-key").value);
});

if (state.key) refresh();

// ---------------------------------------------------------------------------------------------
// Tripwires: rules that engage a kill switch by themselves
// ---------------------------------------------------------------------------------------------

function symptomText(s) {
  switch (s.kind) {
    case "failure_rate": return `failure rate > ${s.above}`;
    case "latency": return `p${Math.round(s.quantile * 1000) / 10} > ${s.above_ms} ms`;
    case "spend": return `${s.unit} > ${s.per_minute}/min`;
    case "mismatches": return `mismatches > ${s.per_minute}/min`;
    default: return s.kind;
  }
}

function renderTripwires(rules) {
  $("tripwire-empty").hidden = rules.length > 0;
  const rows = rules.map((r) => {
    const row = document.createElement("tr");
    row.dataset.testid = `tripwire-${r.name}`;
    cell(row, r.name);
    cell(row, r.prefix || "the tenant");
    cell(row, symptomText(r.symptom));
    cell(row, r.window);
    cell(row, r.min_calls, "num");
    const scope = r.per === "run" ? "the run" : (r.prefix || "the tenant");
    cell(row, r.action === "observe" ? `observe: ${scope}` : `switch: ${scope}`);
    const actions = document.createElement("td");
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "deny";
    remove.textContent = "Delete";
    remove.dataset.testid = `tripwire-delete-${r.name}`;
    remove.addEventListener("click", async () => {
      remove.disabled = true;
      const query = new URLSearchParams({ name: r.name, why: "deleted from the dashboard", tenant: state.tenant });
      const response = await fetch(`/v1/tripwires?${query}`, { method: "DELETE", headers: { Authorization: `Bearer ${state.key}` } });
      setText("tw-result", response.ok ? `deleted ${r.name}` : `could not delete ${r.name} (${response.status})`);
      remove.disabled = false;
    });
    actions.appendChild(remove);
    row.appendChild(actions);
    return row;
  });
  $("tripwire-rows").replaceChildren(...rows);
}

$("tripwire-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const kind = $("tw-kind").value;
  const threshold = Number($("tw-threshold").value);
  const symptom = {
    failure_rate: { kind, above: threshold },
    latency: { kind, quantile: 0.95, above_ms: Math.round(threshold) },
    spend: { kind, unit: "cost", per_minute: Math.round(threshold) },
    mismatches: { kind, per_minute: Math.round(threshold) },
  }[kind];
  const rule = {
    name: $("tw-name").value.trim(),
    prefix: $("tw-prefix").value.trim() || undefined,
    symptom,
    window: $("tw-window").value.trim(),
    min_calls: Number($("tw-min").value),
    per: $("tw-per-run").checked ? "run" : "namespace",
    action: $("tw-observe").checked ? "observe" : "switch",
    why: "set from the dashboard",
    tenant: state.tenant,
  };
  try {
    const set = await send("/v1/tripwires", rule, "PUT");
    setText("tw-result", `set ${set.name}`);
  } catch (e) {
    setText("tw-result", e.message);
  }
});
