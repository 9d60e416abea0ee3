// The trajectory viewer: sessions list and session page; no build step, no external resources.
"use strict";

const app = document.getElementById("app");
const ROW_HEIGHT = 20;
const ROW_TOKENS = 32;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

async function api(path) {
  const response = await fetch(path, { credentials: "same-origin" });
  if (response.status === 401 || response.status === 403) throw new Error("login");
  const body = await response.json();
  if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
  return body;
}

function loginForm() {
  const key = el("input", { type: "password", id: "admin-key", placeholder: "admin key" });
  const status = el("span", { class: "error" });
  const form = el("form", { class: "panel", id: "login" }, "This proxy needs its admin key: ", key, " ",
    el("button", { type: "submit" }, "Open"), " ", status);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const response = await fetch("/ui/login", {
      method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ key: key.value }), credentials: "same-origin",
    });
    if (response.ok) route(); else status.textContent = "wrong key";
  });
  app.replaceChildren(form);
}

// ---- sessions list ----------------------------------------------------------------------------

const FILTERS = [
  ["status", "select", ["", "active", "finished"]], ["group", "text"], ["since", "datetime-local"],
  ["until", "datetime-local"], ["reward_min", "number"], ["reward_max", "number"],
  ["weight_version", "text"], ["drift", "text"],
];

function filterForm(params) {
  const form = el("form", { class: "filters", id: "filters" });
  for (const [name, kind, options] of FILTERS) {
    let input;
    if (kind === "select") {
      input = el("select", { name });
      for (const option of options) input.append(el("option", { value: option }, option || "any"));
    } else {
      input = el("input", { name, type: kind, step: "any", placeholder: name === "drift" ? "kind,kind" : "" });
    }
    input.value = params.get(name) || "";
    form.append(el("label", {}, name.replace("_", " "), input));
  }
  form.append(el("button", { type: "submit", id: "apply" }, "Filter"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const next = new URLSearchParams();
    for (const [key, value] of new FormData(form)) if (value) next.set(key, value);
    location.hash = "#/?" + next.toString();
  });
  return form;
}

async function sessionsPage(params) {
  const query = new URLSearchParams(params);
  const body = await api("/ui/api/sessions?" + query.toString());
  const rows = body.data.map((s) => el("tr", { class: "session-row", "data-id": s.id },
    el("td", {}, el("a", { href: "#/s/" + encodeURIComponent(s.id) }, s.id)),
    el("td", {}, s.status), el("td", {}, s.group ?? ""), el("td", {}, s.reward ?? ""),
    el("td", {}, s.num_calls), el("td", {}, s.num_segments),
    el("td", {}, s.weight_versions.join(", ")),
    el("td", { title: "computed when filtering on drift, and on the session page" },
      ...(s.drift_kinds === null ? ["–"] : s.drift_kinds.map((k) => el("span", { class: "tag drift" }, k)))),
    el("td", {}, s.created_at.slice(0, 19).replace("T", " "))));
  const table = el("table", { id: "sessions" },
    el("tr", {}, ...["session", "status", "group", "reward", "calls", "segments", "weight versions",
      "drift kinds", "created"].map((h) => el("th", {}, h))), ...rows);
  const pager = el("div", { class: "toolbar" });
  if (params.get("after")) pager.append(el("a", { href: "#/?" + withParam(params, "after", null) }, "⟵ first page"));
  if (body.next_cursor) {
    pager.append(el("a", { id: "next", href: "#/?" + withParam(params, "after", body.next_cursor) }, "next page ⟶"));
  }
  app.replaceChildren(filterForm(params), table, pager);
}

function withParam(params, key, value) {
  const next = new URLSearchParams(params);
  if (value === null) next.delete(key); else next.set(key, value);
  return next.toString();
}

// ---- one session --------------------------------------------------------------------------------

const SEGMENT_REASONS = {
  new_conversation: "a new conversation (fresh render)",
  history_not_matched: "the echoed history matches no recorded turn (edited, summarized or another tool list)",
  delta_unavailable: "the template self-test could not prove this append safe",
  template_render_differs: "history mode template: a fresh render differs from the stream",
  token_prompt: "a token prompt that extends no recorded call",
  fresh_render: "fresh render",
};

function branchTree(detail) {
  const tree = el("div", { class: "panel tree", id: "tree" }, el("b", {}, "Calls and branches"));
  for (const call of detail.calls) {
    const indent = "  ".repeat(call.depth);
    const opened = call.opens_segment
      ? ` ▶ segment ${call.segment_id} opened: ${SEGMENT_REASONS[call.segment_reason] || call.segment_reason}`
      : "";
    tree.append(el("div", { class: "node" + (call.opens_segment ? " segment" : ""), "data-call": call.id },
      `${indent}└ call ${call.id}`, " ", el("span", { class: "tag " + call.branch }, call.branch),
      ` choice ${call.choice ?? 0} · ${call.status} · ${call.finish_reason} · weights ${call.weight_version ?? "?"}` +
      (call.reward !== null ? ` · reward ${call.reward}` : "") + opened));
  }
  return tree;
}

function logprobColour(logprob) {
  const p = Math.exp(logprob);
  return `hsl(${Math.round(120 * p)}, 75%, ${88 - 10 * p}%)`;
}

function tokenRows(ids, start, end) {
  // Rows break after a newline or every ROW_TOKENS tokens, so each row has one fixed height.
  const rows = [];
  let row = [];
  for (let i = start; i < end; i++) {
    row.push(i);
    if (row.length >= ROW_TOKENS || ids.pieces[i].includes("\n")) { rows.push(row); row = []; }
  }
  if (row.length) rows.push(row);
  return rows;
}

function markIndex(data) {
  const marks = new Map();
  for (const edit of data.edits) marks.set(edit.position, { cls: "edit", kind: edit.kind });
  for (const d of data.drift) if (!marks.has(d.position)) marks.set(d.position, { cls: "drift", kind: d.kind });
  return marks;
}

function tokenSpan(data, i, marks, diffSet) {
  const mask = data.mask[i];
  const span = el("span", { class: `tok m${mask}` + (data.special[i] ? " sp" : ""), "data-pos": i, "data-id": data.ids[i] });
  span.textContent = data.pieces[i].replace(/\n/g, "↵");
  let title = `id ${data.ids[i]} · position ${i} · mask ${mask}`;
  if (mask === 1) {
    span.style.background = logprobColour(data.logprobs[i]);
    title += ` · logprob ${data.logprobs[i].toFixed(4)}`;
  }
  const mark = marks && marks.get(i);
  if (mark) { span.classList.add(mark.cls); span.dataset.kind = mark.kind; title += ` · ${mark.cls}: ${mark.kind}`; }
  if (diffSet && diffSet(i)) span.classList.add("diff");
  span.title = title;
  return span;
}

// Renders only the rows in view (plus a margin), so 32k+ token paths stay responsive.
function virtualTokens(data, rows, id, marks, diffSet) {
  const box = el("div", { class: "tokens", id });
  const spacer = el("div", { style: `height:${rows.length * ROW_HEIGHT}px` });
  box.append(spacer);
  let drawn = "";
  function draw() {
    const first = Math.max(0, Math.floor(box.scrollTop / ROW_HEIGHT) - 20);
    const last = Math.min(rows.length, first + Math.ceil((box.clientHeight || 600) / ROW_HEIGHT) + 40);
    if (drawn === `${first}:${last}`) return;
    drawn = `${first}:${last}`;
    const children = [spacer];
    for (let r = first; r < last; r++) {
      const row = el("div", { class: "row", style: `top:${r * ROW_HEIGHT}px` }, el("span", { class: "ln" }, rows[r][0]));
      for (const i of rows[r]) row.append(tokenSpan(data, i, marks, diffSet));
      children.push(row);
    }
    box.replaceChildren(...children);
  }
  box.addEventListener("scroll", () => requestAnimationFrame(draw));
  box.scrollToPosition = (pos) => {
    const r = rows.findIndex((row) => row[0] <= pos && pos <= row[row.length - 1]);
    box.scrollTop = Math.max(0, r * ROW_HEIGHT - 40);
    draw();
  };
  requestAnimationFrame(draw);
  draw();
  return box;
}

function callsPanel(data) {
  const panel = el("div", { class: "panel calls", id: "calls" }, el("b", {}, "Calls on this path"));
  for (const call of data.calls) {
    const tools = (call.tool_calls || []).map((t) => el("div", { class: "toolcall" },
      `tool call ${t.function ? t.function.name : ""}(${t.function ? t.function.arguments : ""})`));
    panel.append(el("div", { class: "call" },
      el("div", {}, `call ${call.call_id} · tokens ${call.start}–${call.end} · weights ${call.weight_version ?? "?"}` +
        ` · ${call.finish_reason}` + (call.reward !== null ? ` · reward ${call.reward}` : "")),
      call.reasoning ? el("div", { class: "reasoning" }, "reasoning: " + call.reasoning) : null,
      call.content ? el("div", {}, call.content) : null, ...tools));
  }
  return panel;
}

function markerList(data, box) {
  const list = el("div", { class: "markers", id: "markers" }, el("b", {}, "Edits and drift: "));
  const entries = [...data.edits.map((e) => ["edit", e]), ...data.drift.map((d) => ["drift", d])];
  if (!entries.length) list.append("none");
  for (const [cls, entry] of entries) {
    list.append(el("a", { class: "marker " + cls, onclick: () => box.scrollToPosition(entry.position) },
      `${entry.kind} @${entry.position}`));
  }
  return list;
}

function mergedView(data) {
  const box = virtualTokens(data, tokenRows(data, 0, data.ids.length), "stream", markIndex(data));
  return [markerList(data, box), box];
}

function stepsView(data) {
  // What a trainer receives step-wise: each call's exact prompt (a prefix of the stream) and its output.
  const views = [];
  data.calls.forEach((call, step) => {
    const context = Math.max(0, call.start - 48);
    views.push(el("div", { class: "step panel" },
      el("b", {}, `step ${step} · call ${call.call_id}: prompt ${call.start} tokens (…last ${call.start - context} shown), ` +
        `response ${call.end - call.start} tokens, loss mask 1`),
      stepTokens(data, call, context, step)));
  });
  return views;
}

function stepTokens(data, call, context, step) {
  // In a step the whole prompt is context (mask 0), earlier sampled turns included.
  const stepData = { ...data, mask: data.mask.map((_, i) => (i >= call.start && i < call.end ? 1 : 0)) };
  const box = virtualTokens(stepData, tokenRows(data, context, call.end), `step-${step}`, markIndex(data));
  box.style.height = "30vh";
  return box;
}

function diffView(data) {
  if (data.render.error) return [el("p", { class: "error" }, "no fresh render: " + data.render.error)];
  const a = data.ids, b = data.render.ids;
  let prefix = 0;
  while (prefix < a.length && prefix < b.length && a[prefix] === b[prefix]) prefix++;
  let suffix = 0;
  while (suffix < a.length - prefix && suffix < b.length - prefix && a[a.length - 1 - suffix] === b[b.length - 1 - suffix]) suffix++;
  const render = { ids: b, pieces: data.render.pieces, mask: b.map(() => 0), logprobs: b.map(() => 0),
    special: data.render.special, edits: [], drift: [] };
  return [el("p", {}, `Identical for ${prefix} tokens from the start and ${suffix} from the end; the differing middle is highlighted.`),
    el("div", { class: "side" },
      el("div", {}, el("b", {}, "recorded stream"), virtualTokens(data, tokenRows(data, 0, a.length), "diff-stream",
        markIndex(data), (i) => i >= prefix && i < a.length - suffix)),
      el("div", {}, el("b", {}, "fresh chat-template render"), virtualTokens(render, tokenRows(render, 0, b.length), "diff-render",
        null, (i) => i >= prefix && i < b.length - suffix)))];
}

async function pathView(sessionId, index, holder, mode) {
  const data = await api(`/ui/api/sessions/${encodeURIComponent(sessionId)}/tokens?path=${index}`);
  const legend = el("div", { class: "legend" },
    el("span", { class: "tok m1", style: `background:${logprobColour(0)}` }, "sampled, p≈1"),
    el("span", { class: "tok m1", style: `background:${logprobColour(-3)}` }, "sampled, p≈0.05"),
    el("span", { class: "tok m0" }, "template / tool text (mask 0)"),
    el("span", { class: "tok edit" }, "boundary edit"), el("span", { class: "tok drift" }, "drift"));
  const toolbar = el("div", { class: "toolbar" });
  for (const [name, label] of [["merged", "Merged segment"], ["steps", "Step-wise samples"], ["diff", "Diff vs fresh render"]]) {
    toolbar.append(el("button", { id: "view-" + name, class: mode === name ? "on" : "",
      onclick: () => pathView(sessionId, index, holder, name) }, label));
  }
  const info = el("div", {}, `segment ${data.segment_id} · `, el("span", { class: "tag " + data.branch }, data.branch),
    ` · ${data.ids.length} tokens (prompt ${data.prompt_len}) · reward ${data.reward ?? "none"} · drift `,
    ...Object.entries(data.drift_counts).map(([k, n]) => el("span", { class: "tag drift" }, `${k}×${n}`)));
  const body = mode === "steps" ? stepsView(data) : mode === "diff" ? diffView(data) : mergedView(data);
  holder.replaceChildren(info, toolbar, legend, ...body, callsPanel(data));
}

async function sessionPage(sessionId) {
  const detail = await api(`/ui/api/sessions/${encodeURIComponent(sessionId)}`);
  const head = el("div", { class: "panel" }, el("a", { href: "#/" }, "⟵ sessions"), " ",
    el("b", { id: "session-id" }, detail.id), ` · ${detail.status} · reward ${detail.reward ?? "none"}` +
    ` · ${detail.num_calls} calls in ${detail.num_segments} segments · weights ${detail.weight_versions.join(", ") || "?"}`);
  const holder = el("div", { id: "path" });
  const paths = el("div", { class: "toolbar", id: "paths" }, "Paths: ");
  for (const path of detail.paths) {
    paths.append(el("button", { class: "path", "data-index": path.index, onclick: () => pathView(detail.id, path.index, holder, "merged") },
      `segment ${path.segment_id} · ${path.branch} · calls ${path.call_ids.join(",")}`));
  }
  app.replaceChildren(head, branchTree(detail), paths, holder);
  if (detail.paths.length) await pathView(detail.id, 0, holder, "merged");
}

async function route() {
  const hash = location.hash || "#/";
  try {
    const auth = await (await fetch("/ui/auth", { credentials: "same-origin" })).json();
    if (auth.needs_key) { loginForm(); return; }
    if (hash.startsWith("#/s/")) await sessionPage(decodeURIComponent(hash.slice(4)));
    else await sessionsPage(new URLSearchParams(hash.split("?")[1] || ""));
  } catch (error) {
    if (error.message === "login") loginForm();
    else app.replaceChildren(el("p", { class: "error" }, String(error.message)));
  }
}

window.addEventListener("hashchange", route);
route();
