// The live view: /debug/dashboard polled each second while it shows. Numbers, charts of the
// server's step log (uPlot, where installed) and the radix tree drawn as an icicle (SVG).
// Uses app.js's $ and api.
"use strict";

const WINDOW_S = 300;  // the seconds the charts span: the server's per-second ring
const STEPS_SHOWN = 60;  // the latest steps in the batch chart
// What the charts show, as the page holds it (tests read it): the server's `now` at the last poll,
// its seconds by whole second, its latest steps, the latency histograms, and the columns drawn.
const dashboard = {now: null, seconds: new Map(), steps: [], histograms: null, columns: null};
const charts = {};  // uPlot instances by name

function showTab(name) {
  for (const [tab, panel] of [["tab-chat", "chat"], ["tab-dash", "dash"]]) {
    $(tab).setAttribute("aria-selected", String(panel === name));
    $(panel).hidden = panel !== name;
  }
  if (name === "dash") refresh();
}
$("tab-chat").addEventListener("click", () => showTab("chat"));
$("tab-dash").addEventListener("click", () => showTab("dash"));

// ---- the step log -----------------------------------------------------------------------------

/** Take a poll's step log: its seconds replace the ones held (the first may have grown since). */
function merge(view) {
  for (const s of view.seconds) dashboard.seconds.set(s.t, s);
  for (const t of dashboard.seconds.keys()) if (t <= Math.floor(view.now) - WINDOW_S) dashboard.seconds.delete(t);
  dashboard.steps = dashboard.steps.concat(view.steps).slice(-STEPS_SHOWN);
  dashboard.histograms = view.histograms;
  dashboard.now = view.now;
}

/** One column per chart line, a value per second of the window. Rates are 0 in a second without a
 * step; levels (requests, pages) stay as the last step left them, and the current second shows
 * them as they are now (`view`). */
function columns(view) {
  const end = Math.floor(dashboard.now), c = {t: [], sampled: [], hit: [], running: [], queued: [],
    request_pages: [], locked_pages: [], evictable_pages: [], free_pages: [], tier_pages: []};
  const now = {running: view.running_requests, queued: view.waiting_requests, request_pages: view.request_pages,
               locked_pages: view.locked_pages, evictable_pages: view.evictable_pages, free_pages: view.free_pages,
               tier_pages: dashboard.steps.length ? dashboard.steps[dashboard.steps.length - 1].tier_pages : 0};
  let last = null;
  for (let t = end - WINDOW_S + 1; t <= end; t++) {
    const s = dashboard.seconds.get(t);
    if (s) last = s;
    const levels = t === end ? now : last;
    c.t.push(t);
    c.sampled.push(s ? s.sampled : 0);
    c.hit.push(s && s.prompt_tokens ? 100 * s.cached_tokens / s.prompt_tokens : null);
    for (const k of ["running", "queued", "request_pages", "locked_pages", "evictable_pages", "free_pages", "tier_pages"])
      c[k].push(levels ? levels[k] : null);
  }
  return c;
}

// ---- charts -----------------------------------------------------------------------------------

const CHARTS = typeof uPlot !== "undefined";
const COLOURS = {a: "#1f5fbf", b: "#c8702a", use: "#6f9bd8", lock: "#d9776a", evict: "#e3c56d", free: "#9fcfa9",
                 tier: "#7a5aa6", decode: "#1f5fbf", verify: "#7a5aa6", prefill: "#e3a33d"};

/** Running sums of `cols` (nulls stay null), the largest first: uPlot fills each series down to
 * zero, so drawn in that order the later, smaller ones leave bands: a stacked chart. */
function stacked(cols) {
  let sum = cols[0].map(() => 0);
  const out = cols.map((col) => (sum = col.map((v, i) => (v === null || sum[i] === null ? null : sum[i] + v))));
  return out.reverse();
}

function secondsAxis() {
  return {values: (u, ticks) => ticks.map((t) => `${Math.round(t - dashboard.now)} s`)};
}

/** Draw (or redraw) chart `name` with x values `xs` and `series` [{label, colour, values, fill, bars}];
 * stacked series are given as their own values and drawn as running sums, legend showing their own. */
function draw(name, xs, series, options = {}) {
  const shown = options.stack ? stacked(series.map((s) => s.values)) : series.map((s) => s.values);
  const order = options.stack ? [...series].reverse() : series;
  const data = [xs, ...shown];
  if (charts[name]) { charts[name].own = order.map((s) => s.values); charts[name].setData(data); return; }
  const el = $("chart-" + name);
  const bars = options.bars ? uPlot.paths.bars({size: [0.8, 24]}) : undefined;
  charts[name] = new uPlot({
    width: el.clientWidth || 320, height: 150, scales: {x: {time: false}, ...(options.scales || {})},
    axes: [options.xAxis || secondsAxis(), {size: 56}],
    series: [{label: options.xLabel || "time", value: options.xValue || ((u, t) => (t === null ? "–" : `${Math.round(t - dashboard.now)} s`))},
      ...order.map((s, k) => ({label: s.label, stroke: s.colour, width: 1.5, paths: bars, spanGaps: !options.stack,
                               fill: options.stack || options.bars || s.fill ? s.colour + (options.bars ? "" : "cc") : undefined,
                               value: (u, v, si, i) => legendValue(u.own[si - 1], i)}))],
  }, data, el);
  charts[name].own = order.map((s) => s.values);
}

function legendValue(values, i) {
  return i === null || values[i] === null || values[i] === undefined ? "–" : +values[i].toFixed(1);
}

function stepAgo(i) {
  const step = dashboard.steps[i];
  return step === undefined ? null : step.at - dashboard.now;
}

function drawCharts(view) {
  const c = dashboard.columns = columns(view);
  draw("tokens", c.t, [{label: "tokens/s", colour: COLOURS.a, values: c.sampled, fill: true}]);
  draw("requests", c.t, [{label: "running", colour: COLOURS.a, values: c.running},
                         {label: "queued", colour: COLOURS.b, values: c.queued}]);
  draw("hits", c.t, [{label: "hit rate %", colour: COLOURS.a, values: c.hit}], {scales: {y: {range: [0, 100]}}});
  draw("kv", c.t, [{label: "in use", colour: COLOURS.use, values: c.request_pages},
                   {label: "locked", colour: COLOURS.lock, values: c.locked_pages},
                   {label: "evictable", colour: COLOURS.evict, values: c.evictable_pages},
                   {label: "free", colour: COLOURS.free, values: c.free_pages}], {stack: true});
  if (c.tier_pages.some((v) => v)) {
    $("tier-card").hidden = false;
    draw("tier", c.t, [{label: "in the tier", colour: COLOURS.tier, values: c.tier_pages, fill: true}]);
  }
  const steps = dashboard.steps;
  draw("batch", steps.map((s, i) => i), [
    {label: "decode rows", colour: COLOURS.decode, values: steps.map((s) => s.decode_rows)},
    {label: "verify rows", colour: COLOURS.verify, values: steps.map((s) => s.verify_rows)},
    {label: "prefill tokens", colour: COLOURS.prefill, values: steps.map((s) => s.prefill_tokens)}],
  {stack: true, bars: true, xLabel: "step", xValue: (u, i) => (stepAgo(i) === null ? "–" : `${stepAgo(i).toFixed(1)} s`),
   xAxis: {values: (u, ticks) => ticks.map((i) => (stepAgo(i) === null ? "" : `${stepAgo(i).toFixed(0)} s`))}});
  for (const name of ["ttft", "itl"]) {
    const h = dashboard.histograms[name], labels = h.le.map((le) => (le === null ? "more" : `≤${le}`));
    draw(name, h.counts.map((_, i) => i), [{label: "requests", colour: COLOURS.a, values: h.counts}],
         {bars: true, xLabel: "bucket (s)", xValue: (u, i) => (i === null ? "–" : labels[i]),
          scales: {x: {time: false, range: [-0.5, h.counts.length - 0.5]}},
          xAxis: {values: (u, ticks) => ticks.map((i) => labels[i] || "")}});
  }
}

window.addEventListener("resize", () => {
  for (const [name, u] of Object.entries(charts)) u.setSize({width: $("chart-" + name).clientWidth, height: 150});
});

// ---- the radix tree, drawn --------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";
const TREE_HEIGHT = 260;
let tipFor = null;  // the id of the node the pointer (or focus) is on: its tip outlives redraws

function svg(tag, attrs) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

function deepest(node) {
  const hidden = node.hidden ? node.depth + node.hidden_tokens / node.hidden : node.depth;
  return Math.max(hidden, ...node.children.map(deepest));
}

/** An icicle, left to right: a node spans its token positions, and its height is its share of the
 * tokens cached under its parent (children stacked, the largest first). Colour: how recently it
 * was used (darker: more recent); a red edge: locked by running requests; grey: children left out. */
function drawTree(root) {
  const el = $("tree"), width = el.clientWidth || 800;
  el.setAttribute("viewBox", `0 0 ${width} ${TREE_HEIGHT}`);
  el.setAttribute("height", TREE_HEIGHT);
  const x = (tokens) => tokens * width / Math.max(deepest(root), 1);
  const oldest = Math.max(1, ...walk(root).map((n) => n.uses_ago));
  const parts = [];
  const place = (node, y, h, level, id) => {
    const total = node.children.reduce((sum, c) => sum + c.subtree_tokens, 0) + node.hidden_tokens;
    let at = y;
    for (const child of node.children) {
      const ch = h * child.subtree_tokens / total, childId = `${id}/${child.head.slice(0, 16).join(".")}`;
      parts.push(nodeBox(child, x(child.depth - child.tokens), at, x(child.tokens), ch, level, childId, id, oldest));
      place(child, at, ch, level + 1, childId);
      at += ch;
    }
    if (node.hidden) {
      const rest = svg("rect", {x: x(node.depth), y: at, width: Math.max(x(node.hidden_tokens / node.hidden), 2),
                                height: h * node.hidden_tokens / total, class: "hidden-nodes"});
      const title = svg("title", {});
      title.textContent = `+${node.hidden} smaller (${node.hidden_tokens} tokens)`;
      rest.append(title);
      parts.push(rest);
    }
  };
  if (root.subtree_tokens) place(root, 0, TREE_HEIGHT, 1, "");
  else parts.push(Object.assign(svg("text", {x: 8, y: 20, class: "empty"}), {textContent: "nothing cached"}));
  el.replaceChildren(...parts);
  const hovered = tipFor === null ? null : [...el.querySelectorAll("g.node")].find((g) => g.dataset.id === tipFor);
  if (hovered) showTip(hovered); else hideTip();
}

function walk(node) { return [node, ...node.children.flatMap(walk)]; }

function nodeBox(node, x0, y, w, h, level, id, parent, oldest) {
  const g = svg("g", {class: "node" + (node.locks ? " locked" : ""), tabindex: 0});
  Object.assign(g.dataset, {id, parent, level, tokens: node.tokens, depth: node.depth, children: node.children.length,
                            hits: node.hits, locks: node.locks, usesAgo: node.uses_ago,
                            text: node.head_text || node.head.join(" "), more: node.head.length < node.tokens});
  g.setAttribute("aria-label", `${node.tokens} tokens, ${node.hits} hits`);
  const recent = 1 - node.uses_ago / oldest;
  g.append(svg("rect", {x: x0, y, width: Math.max(w - 1, 1), height: Math.max(h - 1, 1),
                        fill: `hsl(215, ${25 + 50 * recent}%, ${86 - 38 * recent}%)`}));
  if (w > 46 && h > 14) {
    const label = svg("text", {x: x0 + 4, y: y + Math.min(h / 2, 14) + 4});
    label.textContent = `${node.tokens} tok · ${node.hits} hits`;
    g.append(label);
  }
  return g;
}

function showTip(g) {
  const d = g.dataset, tip = $("tree-tip");
  tipFor = d.id;
  tip.textContent = `${d.text}${d.more === "true" ? "…" : ""}\n${d.tokens} tokens (prefix ${d.depth}) · ${d.hits} hits · ` +
    `${d.locks} locks · used ${d.usesAgo} tree uses ago`;
  const box = g.getBoundingClientRect(), card = tip.parentElement.getBoundingClientRect();
  tip.style.left = `${Math.max(0, box.left - card.left)}px`;
  tip.style.top = `${box.bottom - card.top + 4}px`;
  tip.hidden = false;
}

function hideTip() { tipFor = null; $("tree-tip").hidden = true; }

for (const [on, off] of [["mouseover", "mouseout"], ["focusin", "focusout"]]) {
  $("tree").addEventListener(on, (event) => { const g = event.target.closest("g.node"); if (g) showTip(g); });
  $("tree").addEventListener(off, (event) => {
    if (!event.relatedTarget || !event.relatedTarget.closest || !event.relatedTarget.closest("g.node")) hideTip();
  });
}

// ---- each second ------------------------------------------------------------------------------

let polling = false;  // one poll at a time: each reads from where the one before left off

async function refresh() {
  if ($("dash").hidden || polling) return;
  let view;
  const since = dashboard.now === null ? "" : `?since=${dashboard.now}`;
  polling = true;
  try { view = await (await api("/debug/dashboard" + since)).json(); } catch (e) { $("error").textContent = e.message; return; }
  finally { polling = false; }
  const step = view.last_step || {decode_rows: 0, prefill_tokens: 0};
  const values = Object.assign({}, view, {decode_rows: step.decode_rows, prefill_tokens: step.prefill_tokens,
    tokens_per_s: view.tokens_per_s.toFixed(1), cache_hit_rate: (100 * view.cache_hit_rate).toFixed(0) + "%"});
  for (const el of document.querySelectorAll("[data-stat]")) el.textContent = values[el.dataset.stat];
  const parts = ["request_pages", "locked_pages", "evictable_pages", "free_pages"].map((k) => {
    const bar = document.createElement("span");
    bar.style.width = (100 * view[k] / view.pool_pages) + "%";
    return bar;
  });
  $("kvbar").replaceChildren(...parts);
  merge(view);
  $("no-charts").hidden = CHARTS;
  if (CHARTS) drawCharts(view);
  drawTree(view.tree);
  $("tree").dataset.updated = Date.now();
}
setInterval(refresh, 1000);
