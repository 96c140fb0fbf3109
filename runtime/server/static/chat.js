// The chat: conversations of branches, replies streamed and rendered, edit, regenerate, branch,
// and two sampling settings compared side by side. Uses app.js's $, api and model.
"use strict";

let conversations = JSON.parse(localStorage.getItem(STORE) || "{}");
let current = null;
// a conversation: {title, system, branches: [{name, messages}], branch: the index shown}; the
// branches of one conversation share the messages they were made from, so their requests share
// that prefix in the server's radix cache
for (const c of Object.values(conversations)) {
  if (!c.branches) { c.branches = [{name: "main", messages: c.messages || []}]; c.branch = 0; delete c.messages; }
}

// ---- conversations and branches ---------------------------------------------------------------

function save() { localStorage.setItem(STORE, JSON.stringify(conversations)); }
function conv() { return conversations[current]; }
function branch() { const c = conv(); return c.branches[c.branch]; }

function newConversation() {
  const id = "c" + Date.now().toString(36);
  conversations[id] = {title: "New conversation", system: $("system").value, branches: [{name: "main", messages: []}], branch: 0};
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

function renderBranches() {
  const c = conv();
  $("branches").hidden = c.branches.length < 2;
  $("branches").replaceChildren(...c.branches.map((b, i) => {
    const button = makeButton(b.name, () => { if (!running) { c.branch = i; save(); renderLog(); } });
    button.setAttribute("aria-pressed", String(i === c.branch));
    button.dataset.branch = i;
    return button;
  }));
}

/** A new branch made of the first `count` messages of the one shown, and shown. */
function branchFrom(count) {
  const c = conv();
  const messages = JSON.parse(JSON.stringify(branch().messages.slice(0, count)));
  c.branches.push({name: `branch ${c.branches.length + 1} (from message ${count})`, messages});
  c.branch = c.branches.length - 1;
  save();
  renderLog();
}

$("conv").addEventListener("change", () => {
  current = $("conv").value;
  $("system").value = conv().system || "";
  renderLog();
});
$("new-conv").addEventListener("click", newConversation);
$("system").addEventListener("change", () => { conv().system = $("system").value; save(); });
$("export").addEventListener("click", () => {
  const blob = new Blob([JSON.stringify(conversations, null, 2)], {type: "application/json"});
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = "radixlm-conversations.json";
  link.click();
  URL.revokeObjectURL(link.href);
});

// ---- rendering a message ----------------------------------------------------------------------

const RICH = typeof marked !== "undefined" && typeof DOMPurify !== "undefined";

/** Model output into `el`: markdown as elements (sanitised: never the model's own HTML) with its
 * code highlighted, or plain text without the libraries or for JSON replies (data, not prose). */
function renderText(el, text, plain) {
  if (!RICH || plain) { el.textContent = text; el.classList.remove("md"); return; }
  el.innerHTML = DOMPurify.sanitize(marked.parse(text));
  el.classList.add("md");
  if (typeof hljs !== "undefined") el.querySelectorAll("pre code").forEach((code) => hljs.highlightElement(code));
}

function makeButton(label, onclick, testid) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.addEventListener("click", onclick);
  if (testid) b.dataset.testid = testid;
  return b;
}

function span(className, text) {
  const el = document.createElement("span");
  el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

/** The parts of one reply (reasoning, text, tool calls, meta) into `box`, replacing what was there. */
function fillReply(box, r) {
  box.replaceChildren();
  if (r.settings) box.append(span("settings-label", r.settings));
  if (r.reasoning) {
    const details = document.createElement("details");
    details.className = "reasoning";
    details.dataset.testid = "reasoning";
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const body = document.createElement("div");
    body.className = "reasoning-text";
    renderText(body, r.reasoning);
    details.append(summary, body);
    box.append(details);
  }
  const text = document.createElement("div");
  text.className = "text";
  renderText(text, r.content || "", r.plain);
  box.append(text);
  if (r.tool_calls && r.tool_calls.length) {
    const calls = span("calls", r.tool_calls.map((c) => `${c.function.name}(${c.function.arguments})`).join("\n"));
    calls.dataset.testid = "tool-calls";
    box.append(calls);
  }
  if (r.meta) box.append(metaLine(r.meta));
}

function metaLine(s) {
  const meta = span("meta", `prompt ${s.prompt} · cached ${s.cached} · completion ${s.completion} · ` +
    `TTFT ${s.ttft.toFixed(2)} s · ${s.rate.toFixed(1)} tokens/s` + (s.stopped ? " · stopped" : ""));
  meta.dataset.testid = "reply-meta";
  meta.dataset.cached = s.cached;
  if (s.check) {
    const check = span(s.check.ok ? "valid" : "invalid", " · " + s.check.text);
    check.dataset.testid = "validation";
    meta.append(check);
  }
  return meta;
}

function copyText(text, button) {
  const done = () => { button.textContent = "Copied"; setTimeout(() => { button.textContent = "Copy"; }, 1500); };
  if (navigator.clipboard && window.isSecureContext) { navigator.clipboard.writeText(text).then(done, () => {}); return; }
  const area = document.createElement("textarea");  // plain http on another host: the old way
  area.value = text;
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
  done();
}

/** One message of the branch shown, at index `i`, with its actions. */
function messageItem(m, i) {
  const li = document.createElement("li");
  li.className = m.role + (m.compare ? " pair" : "");
  li.dataset.role = m.role;
  if (m.role === "user") {
    const text = document.createElement("div");
    text.className = "text";
    text.textContent = m.content;
    li.append(text);
  } else if (m.compare) {
    const a = document.createElement("div"), b = document.createElement("div");
    a.className = b.className = "side";
    fillReply(a, m);
    fillReply(b, m.compare);
    li.append(a, b);
  } else {
    fillReply(li, m);
  }
  if (i === undefined) return li;  // still streaming: no actions yet
  const actions = document.createElement("div");
  actions.className = "actions";
  if (m.role === "user") {
    actions.append(makeButton("Edit", () => editMessage(li, i), "edit"),
                   makeButton("Branch", () => { branchFrom(i); $("input").value = m.content; $("input").focus(); }, "branch"));
  } else {
    const copy = makeButton("Copy", () => copyText(m.content || "", copy), "copy");
    actions.append(copy, makeButton("Regenerate", () => regenerate(i), "regenerate"),
                   makeButton("Branch", () => branchFrom(i + 1), "branch"));
    if (m.compare) actions.append(makeButton("Continue with B", () => continueWithB(i), "continue-b"));
  }
  li.append(actions);
  return li;
}

function renderLog() {
  renderBranches();
  $("log").replaceChildren(...branch().messages.map((m, i) => messageItem(m, i)));
}

function editMessage(li, i) {
  if (running) return;
  const area = document.createElement("textarea");
  area.value = branch().messages[i].content;
  area.rows = 3;
  area.dataset.testid = "edit-text";
  const saveButton = makeButton("Save and regenerate", () => {
    const text = area.value.trim();
    if (!text) return;
    const messages = branch().messages;
    messages.splice(i, messages.length - i, {role: "user", content: text});
    renderLog();
    generate();
  }, "save-edit");
  li.replaceChildren(area, saveButton, makeButton("Cancel", renderLog));
  area.focus();
}

function regenerate(i) {
  if (running) return;
  branch().messages.splice(i);
  renderLog();
  generate();
}

/** A new branch whose last reply is B's of a compared pair. */
function continueWithB(i) {
  if (running) return;
  const b = branch().messages[i].compare;
  branchFrom(i);
  branch().messages.push({role: "assistant", content: b.content, reasoning: b.reasoning, meta: b.meta});
  save();
  renderLog();
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

// ---- replies, streamed ------------------------------------------------------------------------

function number(id) { const v = $(id).value; return v === "" ? null : Number(v); }

function settingsA() { return {temperature: number("temperature"), top_p: number("top_p"), seed: number("seed")}; }
function settingsB() { return {temperature: number("temperature_b"), top_p: number("top_p_b"), seed: number("seed_b")}; }
function describe(s) { return `temperature ${s.temperature} · top-p ${s.top_p}` + (s.seed !== null ? ` · seed ${s.seed}` : ""); }

/** The request for `messages` with the sampling settings `sampling` (A's or B's) and the rest of the page's. */
function requestBody(messages, sampling) {
  const body = {model, messages, stream: true, stream_options: {include_usage: true},
                temperature: sampling.temperature, top_p: sampling.top_p, top_k: number("top_k"),
                max_tokens: number("max_tokens")};
  if (sampling.seed !== null) body.seed = sampling.seed;
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
  const thinking = $("thinking").value;
  if (thinking) body.chat_template_kwargs = {enable_thinking: thinking === "on"};
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

/** Stream the reply to `body` into `reply` (content, reasoning, tool calls), calling `shown` after
 * each delta; then its meta: token counts (cached: what the prefix cache served), TTFT, rate. */
async function stream(body, reply, shown, signal) {
  const began = performance.now();
  let first = null, usage = null, stopped = false, pieces = 0; // pieces: content deltas (one per token as streamed)
  try {
    const response = await api("/v1/chat/completions", {method: "POST", body: JSON.stringify(body), signal});
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
          if (delta.content || delta.reasoning_content) {
            if (first === null) first = performance.now();
            pieces += 1;
            reply.content += delta.content || "";
            reply.reasoning += delta.reasoning_content || "";
          }
          for (const call of delta.tool_calls || []) {
            if (first === null) first = performance.now();
            const at = reply.tool_calls[call.index] || (reply.tool_calls[call.index] = {type: "function", function: {name: "", arguments: ""}});
            if (call.id) at.id = call.id;
            if (call.function && call.function.name) at.function.name += call.function.name;
            if (call.function && call.function.arguments) at.function.arguments += call.function.arguments;
          }
        }
        shown();
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
  // (a reasoning model's constraint holds after its reasoning, or over it with thinking off: not checked)
  if ((body.response_format || body.regex) && !reply.reasoning)
    reply.meta.check = checkReply(reply.content, $("format").value, $("constraint").value.trim());
  if (!reply.tool_calls.length) delete reply.tool_calls;
  if (!reply.reasoning) delete reply.reasoning;
}

/** The reply to the branch shown, as it stands: streamed in place, then added to the branch. With
 * Compare on, two replies to the same prompt, one per setting, side by side. False if the page's
 * boxes do not make a request. */
async function generate() {
  const c = conv(), messages = branch().messages;
  const system = $("system").value.trim();
  c.system = system;
  const history = messages.map(({role, content, tool_calls}) => tool_calls ? {role, content, tool_calls} : {role, content});
  const prompt = (system ? [{role: "system", content: system}] : []).concat(history);
  const sides = [settingsA()].concat($("compare").checked ? [settingsB()] : []);
  let bodies;
  try { bodies = sides.map((s) => requestBody(prompt, s)); } catch (e) { $("error").textContent = "bad JSON in a box: " + e.message; return false; }
  const replies = sides.map((s, k) => ({role: "assistant", content: "", reasoning: "", tool_calls: [],
                                        plain: Boolean(bodies[k].response_format), settings: sides.length > 1 ? describe(s) : undefined}));
  const reply = replies[0];
  if (replies.length > 1) reply.compare = replies[1];
  let item = messageItem(reply);
  $("log").append(item);
  const redraw = () => {  // a new item for the reply so far, its reasoning left open or shut as the user had it
    const open = [...item.querySelectorAll("details.reasoning")].map((d) => d.open);
    const next = messageItem(reply);
    next.querySelectorAll("details.reasoning").forEach((d, k) => { d.open = Boolean(open[k]); });
    item.replaceWith(next);
    item = next;
  };
  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  $("error").textContent = "";
  await Promise.all(replies.map((r, k) => stream(bodies[k], r, redraw, running.signal)));
  messages.push(reply);
  running = null;
  $("send").disabled = false;
  $("stop").disabled = true;
  save();
  renderConversations();
  renderLog();
  return true;
}

async function send(text) {
  const c = conv();
  branch().messages.push({role: "user", content: text});
  if (c.title === "New conversation") c.title = text.slice(0, 40);
  $("log").append(messageItem({role: "user", content: text}));
  if (!await generate()) { branch().messages.pop(); renderLog(); }
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
