// decisiond playground: builds an OpenAI-shaped /v1/decisions request from the form and draws each answer as
// probability bars; shows the selected model's quality against its labels (GET /admin/quality). Plain JavaScript,
// no dependencies: the page works offline.
"use strict";

const $ = (id) => document.getElementById(id);
const TITLES = { predicate: "Yes / no", choice: "Choice", score: "Score" };
const OPTION_TITLES = { choice: "Options", score: "Levels, lowest first" };
const EXAMPLES = {
  predicate: { name: "billing", instructions: "Is this ticket about billing?" },
  choice: { name: "team", instructions: "Which team should handle it?", options: "billing\nshipping\ntechnical" },
  score: { name: "urgency", instructions: "How urgent is it?", options: "Can wait\nThis week\nToday" },
};
let counter = 0;

function headers() {
  const h = { "content-type": "application/json" };
  const key = $("key").value.trim();
  if (key) h.authorization = "Bearer " + key;
  return h;
}

function addQuestion(kind, values) {
  const node = $("question-template").content.firstElementChild.cloneNode(true);
  counter += 1;
  node.dataset.kind = kind;
  node.querySelector(".kind").textContent = TITLES[kind];
  const example = values || EXAMPLES[kind];
  node.querySelector(".q-name").value = counter > 3 && !values ? kind + counter : example.name;
  node.querySelector(".q-instructions").value = example.instructions;
  const optionsLabel = node.querySelector(".q-options-label");
  if (kind === "predicate") optionsLabel.remove();
  else {
    node.querySelector(".q-options-title").textContent = OPTION_TITLES[kind];
    node.querySelector(".q-options").value = example.options || "";
  }
  node.querySelector(".remove").addEventListener("click", () => node.remove());
  $("questions").appendChild(node);
  return node;
}

function lines(text) {
  return text.split("\n").map((s) => s.trim()).filter((s) => s.length > 0);
}

function questions() {
  return [...document.querySelectorAll("#questions .question")].map((node) => {
    const kind = node.dataset.kind;
    const q = { type: kind, name: node.querySelector(".q-name").value.trim(),
                instructions: node.querySelector(".q-instructions").value };
    if (kind === "choice") q.choices = lines(node.querySelector(".q-options").value).map((value) => ({ value }));
    if (kind === "score") q.levels = lines(node.querySelector(".q-options").value).map((label) => ({ label }));
    return q;
  });
}

function fmt(x, digits) {
  return x === undefined || x === null ? "–" : Number(x).toFixed(digits);
}

function bars(answer) {
  if (answer.type === "predicate") {
    return [{ label: "yes", p: answer.probability }, { label: "no", p: 1 - answer.probability }];
  }
  if (answer.type === "choice") return answer.probabilities.map((x) => ({ label: String(x.value), p: x.probability }));
  if (answer.type === "score") return answer.probabilities.map((x) => ({ label: x.label, p: x.probability }));
  return [];
}

function render(body, latencyMs, profile) {
  const out = $("answers");
  out.replaceChildren();
  const tokens = body.usage ? body.usage.input_tokens : undefined;
  $("status").textContent = `${body.answers.length} answers from ${body.model} · ${tokens} input tokens · ` +
    `${latencyMs.toFixed(0)} ms` + (profile ? ` · learned profile ${profile}` : "");
  $("status").dataset.profile = profile || "";
  $("status").dataset.tokens = tokens;
  $("status").dataset.latencyMs = latencyMs.toFixed(1);
  for (const answer of body.answers) {
    const card = document.createElement("div");
    card.className = "answer";
    card.dataset.name = answer.name || "";
    card.dataset.type = answer.type;
    const title = document.createElement("h3");
    let headline = "";
    if (answer.type === "predicate") headline = `P(yes) = ${fmt(answer.probability, 3)}`;
    if (answer.type === "choice") headline = `→ ${answer.choice}`;
    if (answer.type === "score") headline = `score ${fmt(answer.score, 2)}`;
    if (answer.type === "refusal") headline = "refused";
    title.textContent = `${answer.name || "(unnamed)"} ${headline}`;
    const meta = document.createElement("div");
    meta.className = "meta";
    const confidence = answer.type === "predicate" ? Math.abs(2 * answer.probability - 1) : answer.confidence;
    meta.textContent = `confidence ${fmt(confidence, 3)} · label_mass ${answer.label_mass === undefined ? "–" : Number(answer.label_mass).toPrecision(3)}`;
    card.dataset.confidence = confidence;
    card.dataset.labelMass = answer.label_mass;
    card.append(title, meta);
    const rows = bars(answer);
    const top = Math.max(...rows.map((r) => r.p));
    for (const row of rows) {
      const line = document.createElement("div");
      line.className = "bar-row" + (row.p === top ? " top" : "");
      line.dataset.label = row.label;
      line.dataset.probability = row.p;
      const label = document.createElement("span");
      label.className = "label";
      label.textContent = row.label;
      label.title = row.label;
      const track = document.createElement("div");
      track.className = "track";
      const fill = document.createElement("div");
      fill.className = "fill";
      fill.style.width = (100 * row.p).toFixed(2) + "%";
      track.appendChild(fill);
      const value = document.createElement("span");
      value.className = "value";
      value.textContent = (100 * row.p).toFixed(1) + "%";
      line.append(label, track, value);
      card.appendChild(line);
    }
    out.appendChild(card);
  }
}

function showError(message) {
  $("error").hidden = false;
  $("error").textContent = message;
}

async function decide(event) {
  event.preventDefault();
  $("error").hidden = true;
  const body = { model: $("model").value, input: $("input").value, questions: questions() };
  if ($("order").value) body.order = $("order").value;
  if ($("calibrate").value) body.calibrate = $("calibrate").value;
  $("submit").disabled = true;
  $("status").textContent = "Asking…";
  const started = performance.now();
  try {
    const response = await fetch("/v1/decisions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    const data = await response.json();
    const latency = performance.now() - started;
    if (!response.ok) {
      const e = data.error || {};
      showError(`${response.status} ${e.code || ""}${e.param ? " at " + e.param : ""}: ${e.message || JSON.stringify(data)}`);
      $("status").textContent = "Refused.";
      return;
    }
    render(data, latency, response.headers.get("x-decisiond-profile"));
  } catch (err) {
    showError(String(err));
    $("status").textContent = "Failed.";
  } finally {
    $("submit").disabled = false;
  }
}

async function loadModels() {
  $("error").hidden = true;
  try {
    const response = await fetch("/v1/models?capability=decisions", { headers: headers() });
    const data = await response.json();
    if (!response.ok) {
      showError(`${response.status}: ${(data.error && data.error.message) || "cannot list models"}`);
      return;
    }
    const select = $("model");
    const current = select.value;
    select.replaceChildren();
    for (const name of ["default", ...data.data.map((m) => m.id)]) {
      const option = document.createElement("option");
      option.value = option.textContent = name;
      select.appendChild(option);
    }
    select.value = [...select.options].some((o) => o.value === current) ? current : "default";
    select.dataset.loaded = "true";
  } catch (err) {
    showError(String(err));
  }
}

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  row.appendChild(td);
}

async function loadQuality() {
  const model = $("model").value;
  $("quality-status").textContent = "Reading…";
  $("quality").hidden = true;
  try {
    const response = await fetch("/admin/quality?model=" + encodeURIComponent(model), { headers: headers() });
    const data = await response.json();
    if (!response.ok) {
      const e = data.error || {};
      $("quality-status").textContent = `${response.status}: ${e.message || JSON.stringify(data)}`;
      return;
    }
    const body = $("quality").querySelector("tbody");
    body.replaceChildren();
    for (const q of data.questions) {
      const row = document.createElement("tr");
      row.dataset.question = q.question;
      const served = q.served || {};
      const profile = q.profile || null;
      const cv = (profile && profile.cv) || {};
      cell(row, q.question);
      cell(row, String(q.labels));
      cell(row, fmt(served.accuracy, 3));
      cell(row, fmt(served.log_loss, 3));
      cell(row, fmt(served.ece, 3));
      cell(row, q.escalated_share === null ? "–" : (100 * q.escalated_share).toFixed(1) + "%");
      const others = (q.profiles || []).length - (profile ? 1 : 0);
      cell(row, (profile ? `${profile.kind} v${profile.version} (${profile.id})` : "none") +
        (others > 0 ? ` · ${others} of other user paths` : ""), "profile");
      cell(row, fmt(cv.accuracy, 3));
      cell(row, fmt(cv.log_loss, 3));
      body.appendChild(row);
    }
    $("quality-status").textContent = `${data.decisions} stored decisions of ${data.model}` +
      " (the profile serving /, the operator's; a profile's figures are cross-validated on the labels it learned" +
      " from)";
    $("quality").hidden = false;
  } catch (err) {
    $("quality-status").textContent = String(err);
  }
}

$("form").addEventListener("submit", decide);
$("load-quality").addEventListener("click", loadQuality);
$("load-models").addEventListener("click", loadModels);
for (const kind of ["predicate", "choice", "score"]) {
  $("add-" + kind).addEventListener("click", () => addQuestion(kind));
}
addQuestion("predicate");
addQuestion("choice");
addQuestion("score");
