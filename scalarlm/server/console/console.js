// scalarlm console: a few views over the server's REST API, no framework, no network beyond this server.
// The API key (when the server requires one) lives in sessionStorage and goes out as `Authorization: Bearer`,
// exactly as the Python client sends it. Nothing is fetched or shown before a key is accepted.
"use strict";

const KEY = "scalarlm.apiKey";
const REFRESH_MS = 2000;
let timer = null;
const queueSeries = { t: [], depth: [], tps: [] };

// --- DOM and HTTP helpers -----------------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

class Unauthorized extends Error {}

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  const key = sessionStorage.getItem(KEY);
  if (key) headers["Authorization"] = "Bearer " + key;
  if (options.json !== undefined) {
    headers["Content-Type"] = "application/json";
    options = Object.assign({}, options, { body: JSON.stringify(options.json) });
  }
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401) throw new Unauthorized(await message(response));
  if (!response.ok) throw new Error(await message(response));
  const type = response.headers.get("content-type") || "";
  return type.includes("json") ? response.json() : response.text();
}

async function message(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

function fmt(x, digits = 4) {
  if (x === null || x === undefined) return "–";
  if (typeof x === "number" && !Number.isInteger(x)) return x.toFixed(digits);
  return String(x);
}

// An RL session that names no max_steps is open-ended: its max_steps is this ceiling (MAX_STEPS in
// scalarlm/protocol/training.py), and its progress shows as the step alone.
const MAX_STEPS = 10000000;

function progress(step, maxSteps) {
  const done = fmt(step ?? 0);
  return maxSteps === null || maxSteps === undefined || maxSteps >= MAX_STEPS ? done : `${done} / ${maxSteps}`;
}

function ago(ts) {
  if (!ts) return "–";
  const s = Math.max(0, Date.now() / 1000 - ts);
  return s < 90 ? Math.round(s) + " s" : s < 5400 ? Math.round(s / 60) + " min" : Math.round(s / 3600) + " h";
}

function table(id, headers, rows) {
  return el("table", { id },
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows));
}

// --- a small SVG line chart ---------------------------------------------------------------------------------------

function chart(id, title, series) {
  // series: [{name, xs, ys, cls}]; every series shares the x axis.
  const W = 640, H = 220, L = 56, R = 12, T = 24, B = 28;
  const all = series.flatMap((s) => s.ys.map((y, i) => [s.xs[i], y])).filter(([, y]) => y !== null && isFinite(y));
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("class", "chart");
  svg.setAttribute("id", id);
  svg.setAttribute("data-points", String(series.length ? series[0].ys.length : 0));
  const add = (tag, attrs, text) => {
    const n = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    svg.append(n);
    return n;
  };
  add("text", { x: L, y: 16, class: "chart-title" }, title);
  if (!all.length) {
    add("text", { x: W / 2, y: H / 2, class: "chart-empty", "text-anchor": "middle" }, "no data yet");
    return svg;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    add("line", { x1: L, x2: W - R, y1: sy(y), y2: sy(y), class: "grid" });
    add("text", { x: L - 6, y: sy(y) + 4, class: "tick", "text-anchor": "end" }, y.toPrecision(3));
  }
  add("text", { x: L, y: H - 8, class: "tick" }, String(Math.round(x0 * 100) / 100));
  add("text", { x: W - R, y: H - 8, class: "tick", "text-anchor": "end" }, String(Math.round(x1 * 100) / 100));
  series.forEach((s, k) => {
    const pts = s.ys.map((y, i) => [s.xs[i], y]).filter(([, y]) => y !== null && isFinite(y));
    add("polyline", { points: pts.map(([x, y]) => `${sx(x)},${sy(y)}`).join(" "), class: "line " + (s.cls || "s" + k) });
    add("text", { x: W - R - 110 * (series.length - k), y: 16, class: "legend " + (s.cls || "s" + k) }, "● " + s.name);
  });
  return svg;
}

function curves(id, metrics) {
  const rows = metrics.filter((m) => m.step !== undefined);
  const xs = rows.map((m) => m.step);
  const series = [{ name: "loss", xs, ys: rows.map((m) => (m.loss === undefined ? null : m.loss)), cls: "loss" }];
  const reward = rows.map((m) => (m.reward_mean !== undefined ? m.reward_mean : m.reward));
  if (reward.some((r) => r !== undefined && r !== null)) {
    series.push({ name: "reward", xs, ys: reward.map((r) => (r === undefined ? null : r)), cls: "reward" });
  }
  return chart(id, "loss" + (series.length > 1 ? " and reward" : "") + " per step", series);
}

// The models that answer requests: the base model, then the jobs with a published step, newest first.
function servedModels(models) {
  return [...models.filter((m) => m.kind === "base"), ...models.filter((m) => m.kind !== "base" && m.deployed)];
}

// --- views --------------------------------------------------------------------------------------------------------

const views = {
  async jobs(view) {
    const { models } = await api("/v1/megatron/list_models");
    const jobs = models.filter((m) => m.kind !== "base");  // newest first
    const rows = jobs.map((m) => el("tr", { "data-job": m.name },
      el("td", {}, el("a", { href: "#job/" + m.name }, m.name)),
      el("td", { class: "status " + (m.status || "").toLowerCase() }, m.status),
      el("td", {}, progress(m.step, m.max_steps)),
      el("td", {}, fmt(m.loss)), el("td", {}, fmt(m.version)), el("td", {}, m.kind),
      el("td", {}, ago(m.start_time))));
    const parts = [el("h1", {}, "Training jobs"),
      jobs.length ? table("jobs-table", ["job", "status", "step", "loss", "version", "kind", "started"], rows)
                  : el("p", { id: "jobs-table", class: "muted" }, "No training jobs yet.")];
    if (jobs.length) {
      const newest = jobs[0];
      parts.push(el("h2", {}, "Newest job: ", el("a", { href: "#job/" + newest.name }, newest.name)));
      parts.push(curves("loss-chart", await api(`/v1/megatron/train/${newest.name}/metrics`)));
    }
    return parts;
  },

  async job(view, id) {
    const [info, metrics, ckpts, data] = await Promise.all([
      api(`/v1/megatron/train/${id}`), api(`/v1/megatron/train/${id}/metrics`),
      api(`/v1/megatron/train/${id}/checkpoints`), api(`/v1/megatron/train/${id}/dataset?limit=3`)]);
    const s = info.job_status;
    const last = metrics.length ? metrics[metrics.length - 1] : {};
    return [
      el("h1", {}, "Job ", el("span", { id: "job-id" }, id)),
      el("p", { class: "facts" },
        el("span", { id: "job-status", class: "status " + s.status.toLowerCase() }, s.status),
        ` step ${progress(s.step, s.max_steps)} · loss ${fmt(s.loss)} · ${data.rows} rows · base ${info.job_config.base_model.split("/").pop()}`,
        s.reason ? el("span", { class: "error" }, " · " + s.reason) : null,
        " · ", el("a", { id: "logs-link", href: `#logs/${id}` }, "logs"),
        " · ", el("a", { href: `/v1/megatron/train/${id}/dataset/download`, onclick: (e) => download(e, id) }, "dataset")),
      curves("loss-chart", metrics),
      el("p", { class: "muted" }, last.tokens_per_second ? `${fmt(last.tokens_per_second, 1)} tokens/s` : ""),
      el("h2", {}, "Checkpoints (versions)"),
      ckpts.checkpoints.length
        ? table("checkpoints-table", ["version", "kind", "size", "files", "published"], ckpts.checkpoints.map((c) =>
            el("tr", {}, el("td", {}, c.version + (c.latest ? " (latest)" : "")), el("td", {}, c.kind),
              el("td", {}, (c.bytes / 1e6).toFixed(2) + " MB"), el("td", {}, c.files.length), el("td", {}, ago(c.created) + " ago"))))
        : el("p", { id: "checkpoints-table", class: "muted" }, "No checkpoint published yet."),
    ];
  },

  async logs(view, id) {
    const text = await api(`/v1/megatron/train/${id}/logs`);
    const pre = el("pre", { id: "logs" }, text || "(no output yet)");
    return [el("h1", {}, "Logs of ", el("a", { href: "#job/" + id }, id)), pre];
  },

  async models(view) {
    const [{ models }, { workers }] = await Promise.all([api("/v1/megatron/list_models"), api("/v1/generate/workers")]);
    const served = servedModels(models);
    return [
      el("h1", {}, "Models"),
      table("models-table", ["model", "kind", "version", "status"], served.map((m) =>
        el("tr", { "data-model": m.name }, el("td", {}, m.name), el("td", {}, m.kind), el("td", {}, m.version),
          el("td", {}, m.status || "")))),
      el("h2", {}, "Workers"),
      workers.length
        ? table("workers-table", ["worker", "seen", "holds", "loaded (model: version)", "running", "waiting", "KV cache"],
            workers.map((w) => el("tr", {}, el("td", {}, w.worker_id), el("td", {}, ago(w.last_seen) + " ago"),
              el("td", {}, w.holding || "–"),
              el("td", {}, Object.entries(w.loaded).map(([k, v]) => `${k}: ${v}`).join(", ") || "–"),
              el("td", {}, w.load ? w.load.running : "–"), el("td", {}, w.load ? w.load.waiting : "–"),
              el("td", {}, w.load ? (100 * w.load.kv_cache_usage).toFixed(1) + " %" : "–"))))
        : el("p", { class: "muted" }, "No worker has asked for work yet."),
    ];
  },

  async queue(view) {
    const m = await api("/v1/generate/metrics");
    const squeue = await api("/v1/megatron/squeue");
    const now = Date.now() / 1000;
    queueSeries.t.push(now); queueSeries.depth.push(m.queue_depth); queueSeries.tps.push(m.tokens_per_second);
    for (const k of ["t", "depth", "tps"]) if (queueSeries[k].length > 300) queueSeries[k].shift();
    const xs = queueSeries.t.map((t) => t - queueSeries.t[0]);
    const q = m.queue || {};
    return [
      el("h1", {}, "Queue"),
      table("queue-table", ["queued", "leased", "completed", "failed", "requests/s", "tokens/s", "total tokens"], [el("tr", {},
        el("td", {}, q.queued), el("td", {}, q.leased), el("td", {}, q.completed), el("td", {}, q.failed),
        el("td", {}, fmt(m.requests_per_second, 2)), el("td", {}, fmt(m.tokens_per_second, 1)), el("td", {}, m.total_tokens))]),
      chart("depth-chart", "queue depth over time (s)", [{ name: "depth", xs, ys: queueSeries.depth, cls: "loss" }]),
      chart("tps-chart", "tokens/s over time (s)", [{ name: "tokens/s", xs, ys: queueSeries.tps, cls: "reward" }]),
      el("h2", {}, "Training jobs held by the launchers"),
      squeue.jobs.length
        ? table("squeue-table", ["job", "status", "launcher", "id", "processes", "step"], squeue.jobs.map((j) =>
            el("tr", {}, el("td", {}, el("a", { href: "#job/" + j.job_id }, j.job_id)), el("td", {}, j.status),
              el("td", {}, j.launcher || "–"), el("td", {}, j.launcher_id || "–"), el("td", {}, j.state),
              el("td", {}, progress(j.step, j.max_steps)))))
        : el("p", { class: "muted" }, "None."),
    ];
  },

  async playground(view) {
    const { models } = await api("/v1/megatron/list_models");
    const names = servedModels(models).map((m) => m.name);
    const answer = el("div", { id: "pg-result", hidden: "" },
      el("p", {}, "model ", el("code", { id: "pg-model-out" }), " · version ", el("code", { id: "pg-version-out" }),
        " · ", el("span", { id: "pg-finish" })),
      el("pre", { id: "pg-answer" }));
    const error = el("p", { id: "pg-error", class: "error", hidden: "" });
    const form = el("form", { id: "pg-form", onsubmit: (e) => send(e, answer, error) },
      el("label", {}, "model ", el("select", { id: "pg-model" }, names.map((n) => el("option", { value: n }, n)))),
      el("label", {}, "as ", el("select", { id: "pg-mode" }, el("option", { value: "completion" }, "completion"),
        el("option", { value: "chat" }, "chat"))),
      el("label", {}, "max tokens ", el("input", { id: "pg-max", type: "number", value: "16", min: "1", max: "512" })),
      el("textarea", { id: "pg-prompt", rows: "4", placeholder: "Prompt or user message" }),
      el("button", { id: "pg-send", type: "submit" }, "Send"));
    return [el("h1", {}, "Playground"), form, error, answer];
  },
};
views.jobs.live = views.job.live = views.models.live = views.queue.live = true;

async function send(event, answer, error) {
  event.preventDefault();
  const model = document.getElementById("pg-model").value;
  const prompt = document.getElementById("pg-prompt").value;
  const max_tokens = parseInt(document.getElementById("pg-max").value, 10) || 16;
  const chat = document.getElementById("pg-mode").value === "chat";
  error.hidden = true;
  document.getElementById("pg-send").disabled = true;
  try {
    const body = chat
      ? await api("/v1/chat/completions", { method: "POST", json: { model, max_tokens, messages: [{ role: "user", content: prompt }] } })
      : await api("/v1/completions", { method: "POST", json: { model, max_tokens, prompt } });
    const choice = body.choices[0];
    document.getElementById("pg-answer").textContent = chat ? choice.message.content : choice.text;
    document.getElementById("pg-model-out").textContent = body.model;
    document.getElementById("pg-version-out").textContent = String(body.scalarlm_version);
    document.getElementById("pg-finish").textContent = `${choice.finish_reason} · ${body.usage ? body.usage.completion_tokens : "?"} tokens`;
    answer.hidden = false;
  } catch (e) {
    if (e instanceof Unauthorized) return showLogin(e.message);
    error.textContent = e.message;
    error.hidden = false;
  } finally {
    document.getElementById("pg-send").disabled = false;
  }
}

async function download(event, id) {
  event.preventDefault();  // a plain link would go without the key
  const text = await api(`/v1/megatron/train/${id}/dataset/download`);
  const url = URL.createObjectURL(new Blob([typeof text === "string" ? text : JSON.stringify(text)], { type: "application/jsonl" }));
  el("a", { href: url, download: id + ".jsonl" }).click();
}

// --- routing and login --------------------------------------------------------------------------------------------

async function render() {
  clearTimeout(timer);
  const [name, id] = (location.hash.slice(1) || "jobs").split("/");
  const viewFn = views[name] || views.jobs;
  const view = document.getElementById("view");
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.view === name);
  try {
    const parts = await viewFn(view, id);
    const scroll = window.scrollY;
    view.replaceChildren(...parts);
    window.scrollTo(0, scroll);
    view.dataset.view = name;
    view.dataset.rendered = String(Date.now());
  } catch (e) {
    if (e instanceof Unauthorized) return showLogin(e.message);
    view.replaceChildren(el("p", { class: "error", id: "view-error" }, e.message));
  }
  if (viewFn.live) timer = setTimeout(render, REFRESH_MS);
}

function showLogin(reason) {
  clearTimeout(timer);
  sessionStorage.removeItem(KEY);
  document.getElementById("view").replaceChildren();
  document.getElementById("nav").hidden = true;
  document.getElementById("logout").hidden = true;
  document.getElementById("login").hidden = false;
  const err = document.getElementById("login-error");
  err.hidden = !reason;
  err.textContent = reason ? "Refused: " + reason : "";
  document.body.dataset.state = "login";
}

function showApp() {
  document.getElementById("login").hidden = true;
  document.getElementById("nav").hidden = false;
  document.getElementById("logout").hidden = !sessionStorage.getItem(KEY);
  document.body.dataset.state = "app";
  render();
}

async function probe() {
  try {
    await api("/v1/megatron/list_models");
    return null;
  } catch (e) {
    return e instanceof Unauthorized ? e.message : null;
  }
}

document.getElementById("login-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY, document.getElementById("key").value);
  document.getElementById("key").value = "";
  const refused = await probe();
  if (refused) showLogin(refused);
  else showApp();
});
document.getElementById("logout").addEventListener("click", () => showLogin(null));
window.addEventListener("hashchange", () => { if (document.body.dataset.state === "app") render(); });

(async () => {
  const hadKey = !!sessionStorage.getItem(KEY);
  const refused = await probe();
  if (refused === null) showApp();
  else showLogin(hadKey ? refused : null);
})();
