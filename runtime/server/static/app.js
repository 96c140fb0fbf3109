// radixlm's page: a chat playground over the OpenAI API and a live view of /debug/dashboard.
// No build step. Libraries, where installed (webui.py): marked + DOMPurify render replies as
// markdown, highlight.js colours their code, uPlot draws the charts; without them replies are
// plain text and there are no charts. Conversations (each a list of branches) live in
// localStorage; an API key in sessionStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "radixlm-conversations";
const KEY = "radixlm-api-key";
let model = null;
let running = null; // the AbortController of the reply (or the compared pair) being streamed

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
    if (ids.length) { current = ids[ids.length - 1]; $("system").value = conv().system || ""; }
    else newConversation();
  }
  renderConversations();
  renderLog();
}
// chat.js and dashboard.js (loaded after this file) define the rest
document.addEventListener("DOMContentLoaded", start);
