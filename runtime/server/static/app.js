// radixlm's page: a chat playground over the OpenAI API and a live view of /debug/dashboard.
// No libraries, no build step. Conversations live in localStorage; an API key in sessionStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "radixlm-conversations";
const KEY = "radixlm-api-key";
let model = null;
let running = null; // the AbortController of the reply being streamed
let conversations = JSON.parse(localStorage.getItem(STORE) || "{}");
let current = null;

// ---- the API, with the key when the server wants one ------------------------------------------

async function api(path, options = {}) {
  const key = sessionStorage.getItem(KEY);
  const headers = Object.assign({"Content-Type": "application/json"}, options.headers || {});
  if (key) headers.Authorization = "Bearer " + key;
  const response = await fetch(path, Object.assign({}, options, {headers}));
  if (response.status === 401) {
    $("keyform").hidden = false;
    $("key").focus();
    throw new Error("this server wants an API key");
  }
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try { message = (await response.json()).error.message || message; } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  return response;
}

$("keyform").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key").value);
  $("keyform").hidden = true;
  start();
});

// ---- conversations ----------------------------------------------------------------------------

function save() { localStorage.setItem(STORE, JSON.stringify(conversations)); }

function newConversation() {
  const id = "c" + Date.now().toString(36);
  conversations[id] = {title: "New conversation", system: $("system").value, messages: []};
  current = id;
  save();
  renderConversations();
  renderLog();
}

function renderConversations() {
  const select = $("conv");
  select.replaceChildren(...Object.entries(conversations).reverse().map(([id, c]) => {
    const option = document.createElement("option");
    option.value = id;
    option.textContent = c.title;
    option.selected = id === current;
    return option;
  }));
}

$("conv").addEventListener("change", () => {
  current = $("conv").value;
  $("system").value = conversations[current].system || "";
  renderLog();
});
$("new-conv").addEventListener("click", newConversation);
$("system").addEventListener("change", () => { conversations[current].system = $("system").value; save(); });
$("export").addEventListener("click", () => {
  const blob = new Blob([JSON.stringify(conversations, null, 2)], {type: "application/json"});
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = "radixlm-conversations.json";
  link.click();
  URL.revokeObjectURL(link.href);
});

// ---- the log ----------------------------------------------------------------------------------

function renderLog() {
  const log = $("log");
  log.replaceChildren();
  for (const m of conversations[current].messages) log.append(messageItem(m));
}

function messageItem(m) {
  const li = document.createElement("li");
  li.className = m.role;
  li.dataset.role = m.role;
  const text = document.createElement("span");
  text.className = "text";
  text.textContent = m.content || "";
  li.append(text);
  if (m.tool_calls && m.tool_calls.length) {
    const calls = document.createElement("span");
    calls.className = "calls";
    calls.dataset.testid = "tool-calls";
    calls.textContent = m.tool_calls.map((c) => `${c.function.name}(${c.function.arguments})`).join("\n");
    li.append(calls);
  }
  if (m.meta) {
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.dataset.testid = "reply-meta";
    const s = m.meta;
    meta.textContent = `prompt ${s.prompt} · cached ${s.cached} · completion ${s.completion} · ` +
      `TTFT ${s.ttft.toFixed(2)} s · ${s.rate.toFixed(1)} tokens/s` + (s.stopped ? " · stopped" : "");
    meta.dataset.cached = s.cached;
    if (s.check) {
      const check = document.createElement("span");
      check.className = s.check.ok ? "valid" : "invalid";
      check.dataset.testid = "validation";
      check.textContent = " · " + s.check.text;
      meta.append(check);
    }
    li.append(meta);
  }
  return li;
}

// ---- checking a structured reply ----------------------------------------------------------------

function checkSchema(value, schema, path) {
  // the common JSON-schema keywords: type, enum, const, required, properties, items
  const types = [].concat(schema.type || []);
  const kind = Array.isArray(value) ? "array" : value === null ? "null" : Number.isInteger(value) ? "integer" : typeof value;
  if (types.length && !types.some((t) => t === kind || (t === "number" && kind === "integer")))
    return `${path || "the value"} is ${kind}, not ${types.join(" or ")}`;
  if (schema.enum && !schema.enum.some((e) => JSON.stringify(e) === JSON.stringify(value))) return `${path} is not one of the enum`;
  if ("const" in schema && JSON.stringify(schema.const) !== JSON.stringify(value)) return `${path} is not the const`;
  if (kind === "object") {
    for (const name of schema.required || []) if (!(name in value)) return `${path}.${name} is missing`;
    for (const [name, sub] of Object.entries(schema.properties || {}))
      if (name in value) { const e = checkSchema(value[name], sub, `${path}.${name}`); if (e) return e; }
  }
  if (kind === "array" && schema.items)
    for (let i = 0; i < value.length; i++) { const e = checkSchema(value[i], schema.items, `${path}[${i}]`); if (e) return e; }
  return null;
}

function checkReply(text, format, constraint) {
  if (format === "regex") {
    const ok = new RegExp("^(?:" + constraint + ")$", "s").test(text);
    return {ok, text: ok ? "matches the regex" : "does not match the regex"};
  }
  let value;
  try { value = JSON.parse(text); } catch (e) { return {ok: false, text: "not JSON: " + e.message}; }
  const problem = checkSchema(value, JSON.parse(constraint), "");
  return {ok: !problem, text: problem ? "invalid: " + problem : "valid against the schema"};
}

// ---- one reply, streamed ----------------------------------------------------------------------

function number(id) { const v = $(id).value; return v === "" ? null : Number(v); }

function requestBody(messages) {
  const body = {model, messages, stream: true, stream_options: {include_usage: true},
                temperature: number("temperature"), top_p: number("top_p"), top_k: number("top_k"),
                max_tokens: number("max_tokens")};
  if (number("seed") !== null) body.seed = number("seed");
  const format = $("format").value, constraint = $("constraint").value.trim();
  if (format === "json_schema" && constraint)
    body.response_format = {type: "json_schema", json_schema: {name: "reply", schema: JSON.parse(constraint)}};
  if (format === "regex" && constraint) body.regex = constraint;
  const tools = $("tools").value.trim();
  if (tools) {
    body.tools = JSON.parse(tools);
    const choice = $("tool_choice").value;  // "auto", "required", "none", or "function:<name>"
    body.tool_choice = choice.startsWith("function:")
      ? {type: "function", function: {name: choice.slice("function:".length)}} : choice;
  }
  return body;
}

// Tool choice offers each tool by name (forced) beside auto, required and none, while the box parses.
$("tools").addEventListener("input", () => {
  const select = $("tool_choice"), kept = select.value;
  select.querySelectorAll("option[value^='function:']").forEach((o) => o.remove());
  let tools = [];
  try { tools = JSON.parse($("tools").value || "[]"); } catch (e) { /* still being typed */ }
  for (const t of Array.isArray(tools) ? tools : []) {
    const name = t && t.function && t.function.name;
    if (typeof name !== "string" || !name) continue;
    const option = document.createElement("option");
    option.value = "function:" + name;
    option.textContent = `${name}: this call is forced`;
    select.append(option);
  }
  select.value = [...select.options].some((o) => o.value === kept) ? kept : "auto";
});

async function send(text) {
  const conv = conversations[current];
  const system = $("system").value.trim();
  conv.system = system;
  const user = {role: "user", content: text};
  conv.messages.push(user);
  if (conv.title === "New conversation") conv.title = text.slice(0, 40);
  const history = conv.messages.map(({role, content, tool_calls}) => tool_calls ? {role, content, tool_calls} : {role, content});
  const messages = (system ? [{role: "system", content: system}] : []).concat(history);
  let body;
  try { body = requestBody(messages); } catch (e) { $("error").textContent = "bad JSON in a box: " + e.message; conv.messages.pop(); return; }
  const reply = {role: "assistant", content: "", tool_calls: []};
  $("log").append(messageItem(user));
  const item = messageItem(reply);
  $("log").append(item);
  const shown = item.querySelector(".text");
  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  $("error").textContent = "";
  const began = performance.now();
  let first = null, usage = null, stopped = false, pieces = 0; // pieces: content deltas (one per token as streamed)
  try {
    const response = await api("/v1/chat/completions", {method: "POST", body: JSON.stringify(body), signal: running.signal});
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, {stream: true});
      const events = buffered.split("\n\n");
      buffered = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          if (delta.content) {
            if (first === null) first = performance.now();
            pieces += 1;
            reply.content += delta.content;
            shown.textContent = reply.content;
          }
          for (const call of delta.tool_calls || []) {
            if (first === null) first = performance.now();
            const at = reply.tool_calls[call.index] || (reply.tool_calls[call.index] = {type: "function", function: {name: "", arguments: ""}});
            if (call.id) at.id = call.id;
            if (call.function && call.function.name) at.function.name += call.function.name;
            if (call.function && call.function.arguments) at.function.arguments += call.function.arguments;
          }
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else $("error").textContent = e.message;
  }
  const ended = performance.now();
  // a stopped reply has no usage chunk: its completion is counted from the deltas, its prompt unknown
  const completion = usage ? usage.completion_tokens : pieces;
  reply.meta = {
    prompt: usage ? usage.prompt_tokens : "–", cached: usage ? (usage.prompt_tokens_details || {}).cached_tokens || 0 : "–",
    completion, stopped,
    ttft: ((first || ended) - began) / 1000,
    rate: completion && first !== null && ended > first ? (completion - 1) / ((ended - first) / 1000) : 0,
  };
  if (body.response_format || body.regex) reply.meta.check = checkReply(reply.content, $("format").value, $("constraint").value.trim());
  if (!reply.tool_calls.length) delete reply.tool_calls;
  conv.messages.push(reply);
  item.replaceWith(messageItem(reply));
  running = null;
  $("send").disabled = false;
  $("stop").disabled = true;
  save();
  renderConversations();
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || running) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (running) running.abort(); });

// ---- the dashboard ----------------------------------------------------------------------------

function showTab(name) {
  for (const [tab, panel] of [["tab-chat", "chat"], ["tab-dash", "dash"]]) {
    $(tab).setAttribute("aria-selected", String(panel === name));
    $(panel).hidden = panel !== name;
  }
  if (name === "dash") refresh();
}
$("tab-chat").addEventListener("click", () => showTab("chat"));
$("tab-dash").addEventListener("click", () => showTab("dash"));

function treeItem(node) {
  const li = document.createElement("li");
  const label = document.createElement("span");
  label.className = "node" + (node.locks ? " locked" : "");
  label.tabIndex = 0;
  label.dataset.tokens = node.tokens;
  label.dataset.depth = node.depth;
  label.dataset.children = node.children.length;
  label.title = node.head_text || node.head.join(" ");
  label.textContent = `${node.tokens} tokens · to ${node.depth} · ${node.locks} locks · ${node.uses_ago} uses ago`;
  li.append(label);
  const children = node.children.map(treeItem);
  if (node.hidden) {
    const more = document.createElement("li");
    more.className = "hidden-nodes";
    more.textContent = `+${node.hidden} smaller (${node.hidden_tokens} tokens)`;
    children.push(more);
  }
  if (children.length) { const ul = document.createElement("ul"); ul.append(...children); li.append(ul); }
  return li;
}

async function refresh() {
  if ($("dash").hidden) return;
  let view;
  try { view = await (await api("/debug/dashboard")).json(); } catch (e) { $("error").textContent = e.message; return; }
  const step = view.last_step || {decode_rows: 0, prefill_tokens: 0};
  const values = Object.assign({}, view, {decode_rows: step.decode_rows, prefill_tokens: step.prefill_tokens,
    tokens_per_s: view.tokens_per_s.toFixed(1), cache_hit_rate: (100 * view.cache_hit_rate).toFixed(0) + "%"});
  for (const el of document.querySelectorAll("[data-stat]")) el.textContent = values[el.dataset.stat];
  const parts = ["request_pages", "locked_pages", "evictable_pages", "free_pages"].map((k) => {
    const span = document.createElement("span");
    span.style.width = (100 * view[k] / view.pool_pages) + "%";
    return span;
  });
  $("kvbar").replaceChildren(...parts);
  const root = view.tree;
  const items = root.children.map(treeItem);
  if (root.hidden) { const li = document.createElement("li"); li.className = "hidden-nodes"; li.textContent = `+${root.hidden} smaller (${root.hidden_tokens} tokens)`; items.push(li); }
  if (!items.length) { const li = document.createElement("li"); li.className = "muted"; li.textContent = "nothing cached"; items.push(li); }
  $("tree").replaceChildren(...items);
  $("tree").dataset.updated = Date.now();
}
setInterval(refresh, 1000);

// ---- start ------------------------------------------------------------------------------------

async function start() {
  try {
    const models = await (await api("/v1/models")).json();
    // the base model first, then its LoRA adapters (cards with a parent): the chat runs on the one picked
    const picker = $("model");
    picker.replaceChildren(...models.data.map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = m.parent ? `${m.id} (LoRA on ${m.parent})` : m.id;
      return option;
    }));
    model = picker.value;
    picker.onchange = () => { model = picker.value; };
  } catch (e) { $("error").textContent = e.message; return; }
  if (!current) {
    const ids = Object.keys(conversations);
    if (ids.length) { current = ids[ids.length - 1]; $("system").value = conversations[current].system || ""; }
    else newConversation();
  }
  renderConversations();
  renderLog();
}
start();
