// decisiond console: one page on the admin API. Every action is a call to /admin/* with the session cookie
// (HttpOnly: this script never sees it) and, for a change, the session's CSRF token in X-CSRF-Token. Charts are
// uPlot's (vendored, /static/uplot.iife.min.js). No secret stays in the page: the master key's field is emptied on
// sign-in, a new key's secret is shown once and removed from the DOM when its box is closed.
"use strict";

const $ = (id) => document.getElementById(id);
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];
const SIGN_IN_ERRORS = {
  invalid_master_key: "That is not the master key.", sign_in_limited: "Too many failed sign-ins: wait a minute.",
  token_expired: "The identity provider's token had expired.", wrong_audience: "The ID token is for another client.",
  wrong_issuer: "The ID token comes from another issuer.", bad_signature: "The ID token's signature does not hold.",
  no_role: "Your identity provider grants you no console role.", state_mismatch: "The sign-in did not match: try again.",
  sign_in_expired: "The sign-in took too long: try again.",
};
let session = null;
let keyNames = {};
const charts = {};
let quality = null;

class ApiError extends Error {
  constructor(status, error) {
    super(error && error.message ? error.message : "HTTP " + status);
    this.status = status;
    this.code = error && error.code;
    this.param = error && error.param;
  }
}

async function api(method, path, body) {
  const headers = { accept: "application/json" };
  if (method !== "GET") headers["x-csrf-token"] = session ? session.csrf_token : "";
  if (body !== undefined) headers["content-type"] = "application/json";
  const response = await fetch(path, { method, headers, credentials: "same-origin", cache: "no-store",
                                       body: body === undefined ? undefined : JSON.stringify(body) });
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    const error = new ApiError(response.status, data && data.error);
    if (response.status === 401) signedOut();
    throw error;
  }
  return data;
}

function notice(text, kind) {
  const node = $("notice");
  node.textContent = text;
  node.dataset.kind = kind || "info";
  node.hidden = !text;
}

function failed(error) {
  notice(error.message, "error");
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else if (k === "on") node.addEventListener("click", v);
    else node[k] = v;
  }
  for (const child of children) node.append(child === null || child === undefined ? "" : child);
  return node;
}

const usd = (x) => "$" + Number(x || 0).toFixed(4);
const when = (iso) => (iso ? new Date(iso).toISOString().replace("T", " ").slice(0, 16) : "–");
const short = (iso) => new Date(iso).toISOString().slice(5, 19).replace("T", " ");
const fixed = (x, d) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));

function duration(seconds) {
  if (seconds >= 86400) return Math.round(seconds / 86400) + " d";
  if (seconds >= 3600) return Math.round(seconds / 3600) + " h";
  if (seconds >= 60) return Math.round(seconds / 60) + " min";
  return seconds + " s";
}

function actionButton(label, handler, extra) {
  return el("button", { type: "button", class: "admin-only " + (extra || "secondary"), textContent: label,
                        on: () => handler().catch(failed) });
}

// ------------------------------------------------------------------------------------------------ sign-in

function signedOut(code) {
  session = null;
  $("app").hidden = true;
  $("who").hidden = true;
  $("sign-in").hidden = false;
  if (code) {
    $("sign-in-error").textContent = SIGN_IN_ERRORS[code] || "Sign-in refused (" + code + ").";
    $("sign-in-error").hidden = false;
  }
}

function signedIn(current) {
  session = current;
  $("master-key").value = "";
  $("sign-in").hidden = true;
  $("sign-in-error").hidden = true;
  $("app").hidden = false;
  $("who").hidden = false;
  $("who-name").textContent = current.subject;
  $("who-role").textContent = current.role === "admin" ? "admin" : "read-only";
  document.body.classList.toggle("read-only", current.role !== "admin");
  document.body.dataset.role = current.role;
  const select = $("quality-model");
  select.replaceChildren(...current.stored_models.map((m) => el("option", { value: m, textContent: m })));
  refreshAll();
}

async function start() {
  const params = new URLSearchParams(location.search);
  const current = await api("GET", "/console/session");
  $("sso-row").hidden = !current.sign_in.includes("oidc");
  if (params.has("sign_in_error")) history.replaceState(null, "", "/console");
  if (current.signed_in) signedIn(current);
  else signedOut(params.get("sign_in_error"));
}

async function signIn(event) {
  event.preventDefault();
  const key = $("master-key").value;
  $("master-key").value = "";
  const response = await fetch("/console/login", { method: "POST", credentials: "same-origin",
    headers: { "content-type": "application/json", accept: "application/json" },
    body: JSON.stringify({ master_key: key }) });
  const data = await response.json().catch(() => null);
  if (!response.ok) return signedOut(data && data.error ? data.error.code : "sign_in_failed");
  signedIn(await api("GET", "/console/session"));
}

async function signOut() {
  await api("POST", "/console/logout");
  signedOut();
}

// ---------------------------------------------------------------------------------------------------- keys

async function loadKeys() {
  const keys = (await api("GET", "/admin/keys")).data;
  keyNames = Object.fromEntries(keys.map((k) => [k.id, k.name]));
  $("key-table").tBodies[0].replaceChildren(...keys.map((k) => {
    const limits = k.rate_limits ? Object.entries(k.rate_limits).map(([n, v]) => n + " " + v).join(", ") : "–";
    return el("tr", { "data-id": k.id, "data-status": k.status },
      el("td", {}, k.name), el("td", {}, el("code", {}, k.id)), el("td", {}, k.user_path),
      el("td", {}, k.models ? k.models.join(", ") : "all"), el("td", {}, limits), el("td", {}, when(k.expires_at)),
      el("td", { class: "status-" + k.status }, k.status),
      el("td", {}, k.status === "active" ? actionButton("Revoke", () => revoke(k), "danger revoke") : ""));
  }));
}

async function revoke(key) {
  if (!confirm("Revoke " + key.name + " (" + key.id + ")? Its requests are refused at once.")) return;
  await api("DELETE", "/admin/keys/" + encodeURIComponent(key.id));
  notice("Revoked " + key.id + ".");
  await loadKeys();
}

async function createKey(event) {
  event.preventDefault();
  const body = { name: $("key-name").value.trim() };
  const path = $("key-path").value.trim();
  const models = $("key-models").value.split(",").map((s) => s.trim()).filter(Boolean);
  const rpm = $("key-rpm").value;
  const days = $("key-days").value;
  if (path) body.user_path = path;
  if (models.length) body.models = models;
  if (rpm) body.rate_limits = { requests_per_minute: Number(rpm) };
  if (days) body.expires_in_seconds = Math.round(Number(days) * 86400);
  const created = await api("POST", "/admin/keys", body);
  $("new-key-secret").textContent = created.key;
  $("new-key").dataset.id = created.id;
  $("new-key").hidden = false;
  $("key-form").reset();
  notice("Created " + created.id + ".");
  await loadKeys();
}

function forgetNewKey() {
  $("new-key-secret").replaceChildren();
  delete $("new-key").dataset.id;
  $("new-key").hidden = true;
}

// ------------------------------------------------------------------------------------------------- budgets

function scopeOf(b) {
  if (b.key) return { key: b.key };
  if (b.user_path) return { user_path: b.user_path };
  return { model: b.model };
}

function periodOf(b) {
  return b.period ? { period: b.period } : { period_seconds: b.period_seconds };
}

async function putBudget(b, limit) {
  if (!(limit >= 0)) throw new ApiError(400, { message: "a limit in USD, 0 or more", param: "limit_usd" });
  await api("PUT", "/admin/budgets", { ...scopeOf(b), limit_usd: limit, ...periodOf(b) });
  await loadBudgets();
}

function budgetRow(b) {
  const [scope, value] = Object.entries(scopeOf(b))[0];
  const input = el("input", { type: "number", min: "0", step: "any", class: "admin-only budget-limit",
                              placeholder: "new limit" });
  return el("div", { class: "budget", "data-id": b.id, "data-scope": value, "data-spent": b.spent_usd,
                     "data-limit": b.limit_usd, "data-reserved": b.reserved_usd },
    el("div", { class: "budget-head" }, el("strong", {}, scope.replace("_", " ") + " " +
       (scope === "key" && keyNames[value] ? keyNames[value] + " (" + value + ")" : value)),
       el("span", { class: "hint" }, (b.period || duration(b.period_seconds)) + ", resets in " +
          duration(b.resets_in_seconds) + (b.source === "config" ? " (from the config file)" : ""))),
    el("div", { class: "bar", title: usd(b.spent_usd) + " spent, " + usd(b.reserved_usd) + " reserved" },
       el("span", { class: "spent" }), el("span", { class: "reserved" })),
    el("div", { class: "budget-foot" },
       el("span", { class: "amounts" }, usd(b.spent_usd) + " of " + usd(b.limit_usd) + " spent, " +
          usd(b.reserved_usd) + " reserved" + (b.limit_usd === 0 ? " — stopped" : "")),
       input, actionButton("Set", () => putBudget(b, input.value === "" ? NaN : Number(input.value)), "set-limit"),
       actionButton("Stop now", () => putBudget(b, 0), "danger stop"),
       actionButton("Delete", () => api("DELETE", "/admin/budgets/" + b.id).then(loadBudgets), "secondary")),
  );
}

async function loadBudgets() {
  if ($("budget-list").contains(document.activeElement) && document.activeElement.tagName === "INPUT") return;
  const budgets = (await api("GET", "/admin/budgets")).data;
  const rows = budgets.map(budgetRow);
  $("budget-list").replaceChildren(...(rows.length ? rows : [el("p", { class: "hint" }, "No budget yet.")]));
  for (const [row, b] of rows.map((r, i) => [r, budgets[i]])) {
    const total = Math.max(b.limit_usd, b.spent_usd + b.reserved_usd, 1e-9);
    row.querySelector(".spent").style.width = (100 * b.spent_usd / total).toFixed(2) + "%";
    row.querySelector(".reserved").style.width = (100 * b.reserved_usd / total).toFixed(2) + "%";
    row.querySelector(".bar").classList.toggle("over", b.limit_usd === 0 || b.spent_usd >= b.limit_usd);
  }
}

async function createBudget(event) {
  event.preventDefault();
  const scope = $("budget-scope").value;
  await api("PUT", "/admin/budgets", { [scope]: $("budget-of").value.trim(), limit_usd: Number($("budget-limit").value),
                                       period: $("budget-period").value });
  $("budget-form").reset();
  await loadBudgets();
}

// --------------------------------------------------------------------------------------------------- charts

function chart(id, series, data, options) {
  if (charts[id]) charts[id].destroy();
  const box = $(id);
  box.replaceChildren();
  if (!data[0].length) {
    box.append(el("p", { class: "hint empty" }, "Nothing yet."));
    delete charts[id];
    return;
  }
  const width = Math.max(260, box.clientWidth || 360);
  charts[id] = new uPlot({ width, height: 200, series: [{}, ...series], legend: { live: false },
                           cursor: { drag: { x: false, y: false } }, ...(options || {}) }, data, box);
}

// A time axis from a bucket before the first point to one after the last (uPlot would span years round one point).
function timeAxis(times, seconds) {
  const range = times.length ? [times[0] - seconds, times[times.length - 1] + seconds] : [0, 1];
  return { scales: { x: { time: true, auto: false, range } } };
}

function line(label, i) {
  return { label, stroke: COLORS[i % COLORS.length], width: 2, points: { show: true, size: 5 }, spanGaps: true };
}

async function loadUsage() {
  const group = $("usage-group").value;
  const label = (n) => (n === "(none)" && group === "key" ? "master" : keyNames[n] ? keyNames[n] + " (" + n + ")" : n);
  const answer = await api("GET", "/admin/usage/series?bucket=" + $("usage-bucket").value + "&group_by=" + group);
  const times = [...new Set(answer.data.map((r) => Date.parse(r.bucket) / 1000))].sort((a, b) => a - b);
  const names = [...new Set(answer.data.map((r) => String(r[group] === null ? "(none)" : r[group])))].sort();
  const totals = Object.fromEntries(names.map((n) => [n, { requests: 0, tokens: 0, cost: 0 }]));
  const grid = (field) => names.map((n) => times.map((t) => {
    const row = answer.data.find((r) => Date.parse(r.bucket) / 1000 === t && String(r[group] ?? "(none)") === n);
    return row ? field(row) : null;
  }));
  for (const r of answer.data) {
    const t = totals[String(r[group] ?? "(none)")];
    t.requests += r.requests;
    t.tokens += r.input_tokens + r.output_tokens;
    t.cost += r.cost_usd;
  }
  const series = names.map((n, i) => line(label(n), i));
  const axis = timeAxis(times, answer.bucket_seconds);
  chart("chart-requests", series, [times, ...grid((r) => r.requests)], axis);
  chart("chart-tokens", series, [times, ...grid((r) => r.input_tokens + r.output_tokens)], axis);
  chart("chart-cost", series, [times, ...grid((r) => r.cost_usd)], axis);
  $("usage-table").tBodies[0].replaceChildren(...names.map((n) => el("tr",
    { "data-group": n, "data-requests": totals[n].requests, "data-cost": totals[n].cost },
    el("td", {}, label(n)), el("td", {}, String(totals[n].requests)), el("td", {}, String(totals[n].tokens)),
    el("td", {}, usd(totals[n].cost)))));
}

// ------------------------------------------------------------------------------------------------- quality

async function loadQuality() {
  const model = $("quality-model").value;
  if (!model) {
    $("quality-status").textContent = "No model keeps its decisions (store: true in the config).";
    return;
  }
  const [report, series] = await Promise.all([
    api("GET", "/admin/quality?model=" + encodeURIComponent(model)),
    api("GET", "/admin/quality/series?model=" + encodeURIComponent(model) + "&bucket=" + $("quality-bucket").value),
  ]);
  quality = { report, series };
  const select = $("quality-question");
  const chosen = select.value;
  select.replaceChildren(...report.questions.map((q) => el("option", { value: q.question, textContent: q.question })));
  if (report.questions.some((q) => q.question === chosen)) select.value = chosen;
  $("quality-status").textContent = report.decisions + " stored decisions of " + model + ".";
  drawQuestion();
  $("profile-table").tBodies[0].replaceChildren(...report.questions.flatMap((q) => q.profiles.map((p) => el("tr",
    { "data-profile": p.id, "data-question": q.question, "data-scope": p.scope },
    el("td", {}, q.question), el("td", {}, p.scope), el("td", {}, p.kind + " v" + p.version + " (" + p.id + ")"),
    el("td", {}, String(p.labels)), el("td", {}, fixed(p.cv && p.cv.accuracy, 3)),
    el("td", {}, fixed(p.cv && p.cv.log_loss, 3)), el("td", {}, fixed(p.served_before && p.served_before.accuracy, 3)),
    el("td", {}, actionButton("Roll back", () => rollBack(p), "danger rollback"))))));
}

function drawQuestion() {
  const name = $("quality-question").value;
  const question = quality.report.questions.find((q) => q.question === name);
  const points = (quality.series.questions.find((q) => q.question === name) || { points: [] }).points;
  const times = points.map((p) => Date.parse(p.bucket) / 1000);
  const axis = timeAxis(times, quality.series.bucket === "hour" ? 3600 : 86400);
  chart("chart-quality", [line("accuracy", 0), line("ECE", 1)],
        [times, points.map((p) => p.accuracy), points.map((p) => p.ece)],
        { scales: { ...axis.scales, y: { auto: false, range: [0, 1] } } });
  const bins = question ? question.reliability : [];
  const xs = [0, ...bins.map((b) => b.confidence), 1];
  chart("chart-reliability", [{ label: "perfect", stroke: "#9ca3af", dash: [4, 4] },
    { label: "accuracy", stroke: COLORS[0], width: 0, paths: () => null, points: { show: true, size: 9, fill: COLORS[0] } }],
    bins.length ? [xs, xs, [null, ...bins.map((b) => b.accuracy), null]] : [[]],
    { scales: { x: { time: false, auto: false, range: [0, 1] }, y: { auto: false, range: [0, 1] } } });
  $("chart-reliability").dataset.bins = String(bins.length);
}

async function rollBack(profile) {
  if (!confirm("Roll back " + profile.id + "? What it replaced in " + profile.scope + " is served again.")) return;
  const answer = await api("PUT", "/admin/profiles/" + encodeURIComponent(profile.id), { active: false });
  notice("Rolled back " + profile.id + (answer.active_for_question ? "; now serving " + answer.active_for_question : "") + ".");
  await loadQuality();
}

// ------------------------------------------------------------------------------------------ batches, audit

async function loadBatches() {
  const batches = (await api("GET", "/admin/batches?limit=50")).data;
  $("batch-table").tBodies[0].replaceChildren(...batches.map((b) => {
    const done = b.request_counts.completed + b.request_counts.failed;
    const share = b.request_counts.total ? done / b.request_counts.total : 0;
    const bar = el("div", { class: "bar small" }, el("span", { class: "spent" }));
    bar.firstChild.style.width = (100 * share).toFixed(1) + "%";
    const open = ["validating", "in_progress"].includes(b.status);
    return el("tr", { "data-id": b.id, "data-status": b.status },
      el("td", {}, el("code", {}, b.id)), el("td", {}, b.key_id || "master"), el("td", {}, b.status),
      el("td", {}, bar, done + " / " + b.request_counts.total + (b.request_counts.failed ? " (" + b.request_counts.failed + " failed)" : "")),
      el("td", {}, when(new Date(b.created_at * 1000).toISOString())),
      el("td", {}, open ? actionButton("Cancel", () => api("POST", "/admin/batches/" + b.id + "/cancel").then(loadBatches), "danger cancel") : ""));
  }));
}

async function loadAudit() {
  const rows = (await api("GET", "/admin/audit?limit=25")).data;
  $("audit-table").tBodies[0].replaceChildren(...rows.map((r) => el("tr", { "data-id": r.id },
    el("td", {}, short(r.time)), el("td", {}, r.key_id ? keyNames[r.key_id] || r.key_id : "master"), el("td", {}, r.user_path),
    el("td", {}, r.request_type), el("td", {}, r.resolved_model || r.requested_model || "–"),
    el("td", { class: r.status >= 400 ? "status-revoked" : "" }, String(r.status)),
    el("td", {}, String(r.input_tokens + r.output_tokens)), el("td", {}, usd(r.cost)))));
}

// ------------------------------------------------------------------------------------------------- wiring

async function refreshAll() {
  if (!session) return;
  try {
    await loadKeys();  // first: the others name keys by their names
    const loads = [loadBudgets, loadUsage, loadBatches, loadAudit, loadQuality];
    const failure = (await Promise.allSettled(loads.map((load) => load()))).find((r) => r.status === "rejected");
    if (failure) failed(failure.reason);
  } catch (error) {
    failed(error);
  }
  document.body.dataset.refreshed = String(Date.now());
}

function wire() {
  $("login").addEventListener("submit", (e) => signIn(e).catch(failed));
  $("sign-out").addEventListener("click", () => signOut().catch(failed));
  $("key-form").addEventListener("submit", (e) => createKey(e).catch(failed));
  $("new-key-done").addEventListener("click", forgetNewKey);
  $("new-key-copy").addEventListener("click", () => navigator.clipboard.writeText($("new-key-secret").textContent)
    .then(() => notice("Copied."), () => notice("Copy it by hand: the clipboard is not available here.")));
  $("budget-form").addEventListener("submit", (e) => createBudget(e).catch(failed));
  $("refresh").addEventListener("click", () => { notice(""); refreshAll(); });
  for (const id of ["usage-group", "usage-bucket"]) $(id).addEventListener("change", () => loadUsage().catch(failed));
  for (const id of ["quality-model", "quality-bucket"]) $(id).addEventListener("change", () => loadQuality().catch(failed));
  $("quality-question").addEventListener("change", drawQuestion);
  setInterval(() => {
    if (session && document.visibilityState === "visible") Promise.all([loadBudgets(), loadBatches()]).catch(failed);
  }, 10000);
}

wire();
start().catch((error) => notice("The console could not start: " + error.message, "error"));
