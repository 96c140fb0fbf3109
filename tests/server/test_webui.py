"""The web page at `/`, driven in headless Chromium (Debian's `chromium` and `chromium-driver`,
installed by scripts/setup.sh) against a live server: chat streams, Stop aborts on the server,
a follow-up reuses the cache, replies render as markdown with highlighted code and reasoning
apart, edit-and-regenerate and branches reuse the cache, two settings compare side by side, the
dashboard's numbers and charts are the server's own, and the tree drawn shows a shared system
prompt. Saves the screenshots docs/images/ holds (README shows them)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import time

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from server.conftest import ROOT, LiveServer, assert_kv_clean

IMAGES = os.path.join(ROOT, "docs", "images")
SYSTEM = ("You are a careful assistant for a small bakery. Answer questions about bread, opening hours "
          "and prices in one short sentence, and never invent a price that is not on the menu. ")


def _browser(width: int = 1280, height: int = 900) -> webdriver.Chrome:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "the browser tests need Debian's chromium and chromium-driver (scripts/setup.sh)"
    opts = Options()
    opts.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={width},{height}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=opts)


@pytest.fixture(scope="module")
def page(server):
    browser = _browser()
    browser.get(server.url + "/")
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "model").text)
    yield browser
    browser.quit()


def _set(page, element_id: str, value: str) -> None:
    el = page.find_element(By.ID, element_id)
    el.clear()
    el.send_keys(value)


def _replies(page):
    return page.find_elements(By.CSS_SELECTOR, "#log li[data-role=assistant]")


def _send(page, text: str) -> None:
    before = len(_replies(page))
    page.find_element(By.ID, "input").send_keys(text, Keys.ENTER)
    WebDriverWait(page, 10).until(lambda b: len(_replies(b)) == before + 1)


LAST_REPLY = """
const replies = document.querySelectorAll('#log li[data-role=assistant]');
const li = replies[replies.length - 1];
const part = (sel) => li && li.querySelector(sel);
return {text: part('.text') ? part('.text').textContent.trim() : '', meta: part('.meta') ? part('.meta').textContent : null,
        cached: part('.meta') ? Number(part('.meta').dataset.cached) : null,
        check: part('.meta [data-testid=validation]') ? part('.meta [data-testid=validation]').textContent : null,
        calls: part('[data-testid=tool-calls]') ? part('[data-testid=tool-calls]').textContent : null,
        running: !document.getElementById('stop').disabled};
"""


def _last_reply(page) -> dict:
    """The latest reply as the page shows it, read in one script (the page replaces a reply's
    element when it ends, so element handles held across that go stale)."""
    return page.execute_script(LAST_REPLY)


def _wait_reply_done(page, timeout: float = 120) -> dict:
    WebDriverWait(page, timeout).until(lambda b: _last_reply(b)["meta"] is not None)
    return _last_reply(page)


def _severe_logs(page) -> list:
    return [e for e in page.get_log("browser") if e["level"] == "SEVERE"]


def test_chat_streams_and_a_follow_up_reuses_the_cache(page, server):
    _set(page, "system", "You are a helpful assistant. Keep answers short.")
    _set(page, "max_tokens", "40")
    _set(page, "temperature", "0")
    _send(page, "Name three colours.")
    # streamed: text shows while the reply is still running (Stop enabled)
    WebDriverWait(page, 10).until(lambda b: _last_reply(b)["running"] or _last_reply(b)["meta"] is not None)
    seen_while_running, deadline = False, time.time() + 120
    while time.time() < deadline:
        now = _last_reply(page)
        if not now["running"]:
            break
        seen_while_running |= bool(now["text"])
        time.sleep(0.02)
    first = _wait_reply_done(page)
    assert seen_while_running, "no text was shown while the reply streamed"
    assert first["text"].strip()
    assert "completion" in first["meta"] and "tokens/s" in first["meta"] and "TTFT" in first["meta"]

    _send(page, "And three animals?")
    second = _wait_reply_done(page)
    assert second["cached"] > 0, "the second turn should reuse the first turn's prefix"
    assert not _severe_logs(page)
    os.makedirs(IMAGES, exist_ok=True)
    page.save_screenshot(os.path.join(IMAGES, "webui-chat.png"))
    assert_kv_clean(server.url)


def test_stop_aborts_the_request_on_the_server(page, server):
    _set(page, "max_tokens", "3000")
    _set(page, "temperature", "0.8")
    _send(page, "Write a very long story about a lighthouse keeper.")
    WebDriverWait(page, 60).until(lambda b: _last_reply(b)["text"])
    page.find_element(By.ID, "stop").click()
    assert "stopped" in _wait_reply_done(page, 30)["meta"]
    deadline, view = time.time() + 15, {}
    while time.time() < deadline:
        view = httpx.get(server.url + "/debug/dashboard", timeout=30).json()
        if view["running_requests"] == 0 and view["waiting_requests"] == 0:
            break
        time.sleep(0.2)
    assert view["running_requests"] == 0 and view["waiting_requests"] == 0, view
    assert_kv_clean(server.url)
    _set(page, "max_tokens", "40")
    _set(page, "temperature", "0")


TREE = """
const stats = {};
for (const el of document.querySelectorAll("[data-stat]")) stats[el.dataset.stat] = el.textContent;
const nodes = [...document.querySelectorAll("#tree g.node")].map((g) => Object.assign({}, g.dataset));
const top = document.querySelector('#tree g.node[data-level="1"] rect');
const box = top && top.getBoundingClientRect(), svg = document.getElementById("tree").getBoundingClientRect();
return [stats, nodes, box && {x: box.x + box.width / 2 - svg.x - svg.width / 2, y: box.y + box.height / 2 - svg.y - svg.height / 2}];
"""


def _wait_refresh(page) -> None:
    """Until the dashboard has polled once after now."""
    stamp = time.time() * 1000
    WebDriverWait(page, 10).until(lambda b: float(b.find_element(By.ID, "tree").get_attribute("data-updated") or 0) > stamp)


def test_the_dashboard_shows_the_servers_numbers_and_the_shared_prefix_drawn(page, server):
    assert_kv_clean(server.url)
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    for question in ("When do you open?", "How much is a baguette?"):
        r = httpx.post(server.url + "/generate", json={"text": SYSTEM + question,
                                                       "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
                       timeout=120)
        assert r.status_code == 200
    page.find_element(By.ID, "tab-dash").click()
    _wait_refresh(page)
    # the numbers and the tree read in one script, at one moment: the page redraws them every second
    # (elements found one call and read the next may be gone by then)
    shown, nodes, offset = page.execute_script(TREE)
    acct = httpx.get(server.url + "/debug/kv_accounting", timeout=30).json()  # idle: the same moment
    for key in ("free_pages", "evictable_pages", "locked_pages", "pool_pages"):
        assert int(shown[key]) == acct[key], (key, shown, acct)
    assert shown["running_requests"] == "0" and shown["request_pages"] == "0"
    # the shared system prompt is one box, the two questions' tails two boxes right of it
    (top,) = [n for n in nodes if n["level"] == "1"]
    below = [n for n in nodes if n["parent"] == top["id"]]
    assert top["children"] == "2" and len(below) == 2, "both requests' tails hang under the shared prefix"
    assert top["text"] and SYSTEM.startswith(top["text"]) and int(top["tokens"]) > 20
    assert top["hits"] == "1" and top["locks"] == "0"  # the second request reused it
    assert all(int(n["depth"]) > int(top["tokens"]) for n in below)
    # hovering the box shows its text (the pointer moved over the svg, which outlives the redraws)
    ActionChains(page).move_to_element_with_offset(page.find_element(By.ID, "tree"), int(offset["x"]),
                                                   int(offset["y"])).perform()
    tip = page.find_element(By.ID, "tree-tip")
    WebDriverWait(page, 5).until(lambda b: tip.is_displayed())
    assert top["text"] in tip.text and "1 hits" in tip.text, tip.text
    assert not _severe_logs(page)
    page.find_element(By.CSS_SELECTOR, ".tree-card").screenshot(os.path.join(IMAGES, "webui-tree.png"))
    page.find_element(By.ID, "tab-chat").click()


def test_conversations_are_kept_and_exported(page):
    stored = page.execute_script("return JSON.parse(localStorage.getItem('radixlm-conversations'))")
    (conv,) = [c for c in stored.values() if c["branches"][0]["messages"]]
    roles = [m["role"] for m in conv["branches"][0]["messages"]]
    assert roles[:4] == ["user", "assistant", "user", "assistant"] and conv["system"]
    page.refresh()
    WebDriverWait(page, 30).until(lambda b: len(_replies(b)) >= 2)  # the conversation is back after a reload
    assert page.find_element(By.ID, "export").is_enabled()


def test_structured_output_is_shown_validated(page):
    page.find_element(By.CSS_SELECTOR, "details summary").click()
    page.find_element(By.CSS_SELECTOR, "#format option[value=regex]").click()
    _set(page, "constraint", "(yes|no)")
    _send(page, "Is bread made from flour? Answer yes or no.")
    reply = _wait_reply_done(page)
    assert reply["text"] in ("yes", "no")
    assert "matches the regex" in reply["check"]
    page.find_element(By.CSS_SELECTOR, "#format option[value=text]").click()


def test_a_json_schema_reply_is_validated_and_tool_calls_are_shown(page):
    schema = '{"type": "object", "properties": {"open": {"type": "boolean"}}, "required": ["open"]}'
    page.find_element(By.CSS_SELECTOR, "#format option[value=json_schema]").click()
    _set(page, "constraint", schema)
    _send(page, "Is the bakery open on Sundays? Answer in JSON.")
    reply = _wait_reply_done(page)
    assert json.loads(reply["text"])["open"] in (True, False)
    assert "valid against the schema" in reply["check"]
    page.find_element(By.CSS_SELECTOR, "#format option[value=text]").click()

    # forced by name, with a closed set of arguments: the call ends whatever this CPU's arithmetic
    # makes the model prefer ("required" lets a small model repeat calls up to the length limit)
    tool = {"type": "function", "function": {"name": "get_price", "description": "the price of a bread",
                                             "parameters": {"type": "object",
                                                            "properties": {"bread": {"enum": ["baguette", "rye"]}},
                                                            "required": ["bread"]}}}
    _set(page, "tools", json.dumps([tool]))
    page.find_element(By.CSS_SELECTOR, "#tool_choice option[value='function:get_price']").click()
    _send(page, "How much is a baguette?")
    reply = _wait_reply_done(page)
    assert reply["calls"] is not None, f"no tool call shown: {reply}"
    name, _, arguments = reply["calls"].partition("(")
    assert name == "get_price" and json.loads(arguments.removesuffix(")"))["bread"] in ("baguette", "rye")
    page.find_element(By.CSS_SELECTOR, "#tool_choice option[value=auto]").click()
    page.find_element(By.ID, "tools").clear()

MARKDOWN = r"The \*\*crust\*\* matters:\n\n```python\ndef bake\(loaf\):\n    return loaf \* 2\n```"


def test_markdown_and_a_code_block_render_as_elements(page):
    page.find_element(By.ID, "new-conv").click()
    page.execute_script("document.querySelector('#chat details').open = true")  # structured output and tools
    page.find_element(By.CSS_SELECTOR, "#format option[value=regex]").click()
    _set(page, "constraint", MARKDOWN)  # the reply is forced to be this markdown, whatever the model prefers
    _send(page, "Show me a bread recipe in Python.")
    reply = _wait_reply_done(page)
    page.find_element(By.CSS_SELECTOR, "#format option[value=text]").click()
    rendered = page.execute_script("""
        const li = [...document.querySelectorAll('#log li[data-role=assistant]')].pop(), text = li.querySelector('.text');
        const code = text.querySelector('pre > code');
        return {strong: [...text.querySelectorAll('strong')].map((e) => e.textContent),
                code: code && code.textContent, language: code && code.className,
                highlighted: code ? code.querySelectorAll('span[class^=hljs-]').length : 0, raw: text.textContent};""")
    assert rendered["strong"] == ["crust"], rendered
    assert rendered["code"].startswith("def bake(loaf):") and "language-python" in rendered["language"], rendered
    assert rendered["highlighted"] >= 2, "the code block is highlighted (keyword, title, ...)"
    assert "**" not in rendered["raw"] and "```" not in rendered["raw"], "markdown shown as text"
    assert "matches the regex" in reply["check"]
    page.save_screenshot(os.path.join(IMAGES, "webui-markdown.png"))


def _user_items(page):
    return page.find_elements(By.CSS_SELECTOR, "#log li[data-role=user]")


def _user_texts(page) -> list:
    return page.execute_script("return [...document.querySelectorAll('#log li[data-role=user] .text')].map((e) => e.textContent)")


def test_edit_and_regenerate_replaces_the_reply_and_reuses_the_cache(page):
    page.find_element(By.ID, "new-conv").click()
    _set(page, "system", SYSTEM)
    _set(page, "max_tokens", "4")
    _send(page, "When do you open?")
    first = _wait_reply_done(page)
    _user_items(page)[0].find_element(By.CSS_SELECTOR, "[data-testid=edit]").click()
    _set_element(page.find_element(By.CSS_SELECTOR, "[data-testid=edit-text]"), "Do you sell rye bread?")
    page.find_element(By.CSS_SELECTOR, "[data-testid=save-edit]").click()
    WebDriverWait(page, 10).until(lambda b: not b.find_element(By.ID, "send").is_enabled())
    second = _wait_reply_done(page)
    WebDriverWait(page, 10).until(lambda b: b.find_element(By.ID, "send").is_enabled())
    assert _user_texts(page) == ["Do you sell rye bread?"] and len(_replies(page)) == 1
    assert second["cached"] > 20, ("the regenerated reply reuses the cached system prompt", first, second)


def test_a_branch_shares_its_prefix_and_two_settings_compare(page):
    # the conversation of the test before: branch after its reply, ask there; the branch's prompt
    # begins with the whole first exchange, which the cache holds
    (before,) = page.execute_script("return [...document.querySelectorAll('#log [data-testid=reply-meta]')]"
                                    ".map((m) => m.textContent)")
    prompt = int(before.split("prompt ")[1].split(" ")[0])
    page.find_element(By.CSS_SELECTOR, "#log li[data-role=assistant] [data-testid=branch]").click()
    WebDriverWait(page, 5).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#branches button")) == 2)
    _send(page, "And on Sundays?")
    reply = _wait_reply_done(page)
    assert reply["cached"] >= prompt, ("the branch reuses the first exchange", prompt, reply)
    # the first branch is as it was
    page.find_element(By.CSS_SELECTOR, "#branches button[data-branch='0']").click()
    assert _user_texts(page) == ["Do you sell rye bread?"] and len(_replies(page)) == 1
    page.find_element(By.CSS_SELECTOR, "#branches button[data-branch='1']").click()
    assert len(_replies(page)) == 2

    page.find_element(By.ID, "compare").click()
    _set(page, "temperature", "0")
    _set(page, "temperature_b", "1.5")
    _set(page, "seed_b", "7")
    _send(page, "Is the bread fresh?")
    WebDriverWait(page, 120).until(lambda b: b.execute_script(
        "return document.getElementById('stop').disabled && "
        "document.querySelectorAll('#log li.pair [data-testid=reply-meta]').length === 2"))
    page.find_element(By.ID, "compare").click()
    sides = page.execute_script("""
        return [...document.querySelectorAll('#log li.pair .side')].map((s) => ({
            label: s.querySelector('.settings-label').textContent, text: s.querySelector('.text').textContent,
            cached: Number(s.querySelector('[data-testid=reply-meta]').dataset.cached)}));""")
    assert len(sides) == 2 and "temperature 0 ·" in sides[0]["label"] and "temperature 1.5" in sides[1]["label"], sides
    assert all(s["cached"] >= prompt for s in sides), sides  # both from the shared prefix
    assert not _severe_logs(page)
    page.save_screenshot(os.path.join(IMAGES, "webui-branches.png"))


def _set_element(el, value: str) -> None:
    el.clear()
    el.send_keys(value)


PAGE_CHARTS = """
const c = dashboard.columns;
if (!c) return null;  // (not drawn yet)
return {now: dashboard.now, t: c.t, sampled: c.sampled, running: c.running, queued: c.queued, hit: c.hit,
        free: c.free_pages, steps: dashboard.steps, histograms: dashboard.histograms,
        drawn: Object.keys(charts).filter((n) => document.querySelector('#chart-' + n + ' canvas')).sort(),
        tokens: charts.tokens.data[1], ttft: charts.ttft.data[1]};
"""


def test_the_charts_draw_and_move_with_the_servers_numbers(page, server):
    page.find_element(By.ID, "tab-dash").click()
    start = httpx.get(server.url + "/debug/dashboard", timeout=30).json()["now"]

    def busy(c):  # the indices of the seconds since the load began in which steps sampled tokens
        return [i for i, t in enumerate(c["t"]) if t > start and c["sampled"][i]]

    with cf.ThreadPoolExecutor(2) as pool:
        load = [pool.submit(httpx.post, server.url + "/generate", timeout=120, json={
            "text": f"Count to a thousand, {i}.", "rid": f"chart-{i}",
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}) for i in range(2)]
        try:
            # the charts move: seconds with output tokens, then later seconds, while the load runs
            WebDriverWait(page, 30).until(lambda b: (c := b.execute_script(PAGE_CHARTS)) and len(busy(c)) >= 3)
            before = page.execute_script(PAGE_CHARTS)
            WebDriverWait(page, 10).until(lambda b: b.execute_script(PAGE_CHARTS)["t"][-1] > before["t"][-1])
            shown = page.execute_script(PAGE_CHARTS)
            view = httpx.get(server.url + "/debug/dashboard", timeout=30).json()
        finally:
            for i in range(2):
                httpx.post(server.url + "/abort_request", json={"rid": f"chart-{i}"}, timeout=30)
            for f in load:
                f.result(timeout=60)
    assert shown["drawn"] == ["batch", "hits", "itl", "kv", "requests", "tokens", "ttft"], shown["drawn"]
    assert shown["tokens"] == shown["sampled"]  # what the chart holds is the column compared below
    # every second the page holds whole (it ended before the page's poll) is the server's, exactly
    seconds = {s["t"]: s for s in view["seconds"]}
    whole = [i for i, t in enumerate(shown["t"]) if t + 1 <= shown["now"] and t in seconds]
    loaded = [i for i in busy(shown) if i in whole]
    assert len(loaded) >= 2, shown
    for i in whole:
        s = seconds[shown["t"][i]]
        assert (shown["sampled"][i], shown["running"][i], shown["queued"][i], shown["free"][i]) == \
            (s["sampled"], s["running"], s["queued"], s["free_pages"]), (i, shown, s)
    assert all(shown["running"][i] for i in loaded)  # (the load's requests run until aborted)
    steps = {s["at"]: s for s in view["steps"]}
    assert shown["steps"] and all(steps[s["at"]] == s for s in shown["steps"] if s["at"] in steps)
    assert sum(s["decode_rows"] for s in shown["steps"]) > 0
    page.find_element(By.CSS_SELECTOR, ".charts").screenshot(os.path.join(IMAGES, "webui-charts.png"))
    # the latency histograms: once idle, the next poll shows the server's
    assert_kv_clean(server.url)
    _wait_refresh(page)
    shown = page.execute_script(PAGE_CHARTS)
    assert shown["histograms"] == httpx.get(server.url + "/debug/dashboard", timeout=30).json()["histograms"]
    assert shown["ttft"] == shown["histograms"]["ttft"]["counts"] and sum(shown["ttft"]) > 0
    assert not _severe_logs(page)
    page.find_element(By.ID, "tab-chat").click()



def test_phone_width_fits_without_errors(server):
    browser = _browser(390, 844)
    try:
        browser.get(server.url + "/")
        WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "model").text)
        for tab in ("tab-chat", "tab-dash"):
            browser.find_element(By.ID, tab).click()
            time.sleep(0.3)
            assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth"), tab
        assert not _severe_logs(browser)
    finally:
        browser.quit()


def test_with_an_api_key_the_page_asks_for_it_its_picker_lists_adapters_and_reasoning_shows_apart(tiny_qwen3, tmp_path):
    import peft
    import transformers

    adapter = str(tmp_path / "story")
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3)
    peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    srv = LiveServer("--model-path", tiny_qwen3, "--api-key", "page-key",  # (behaviour alone: tiny weights)
                     "--lora-paths", f"story={adapter}", "--reasoning-parser", "qwen3")
    browser = _browser()
    try:
        browser.get(srv.url + "/")
        form = WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "keyform"))
        WebDriverWait(browser, 10).until(lambda b: form.is_displayed())
        browser.find_element(By.ID, "key").send_keys("page-key", Keys.ENTER)
        WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "model").text)
        assert browser.execute_script("return sessionStorage.getItem('radixlm-api-key')") == "page-key"
        assert browser.execute_script("return localStorage.getItem('radixlm-api-key')") is None
        options = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#model option")]
        assert len(options) == 2 and options[1] == "story", options  # the base model, then the adapter

        # a reasoning block and its answer, the real stream split by the server's qwen3 parser: with
        # thinking off the constraint holds from the first token, so it can force the block
        browser.find_element(By.CSS_SELECTOR, "details summary").click()
        browser.find_element(By.CSS_SELECTOR, "#thinking option[value=off]").click()
        browser.find_element(By.CSS_SELECTOR, "#format option[value=regex]").click()
        _set(browser, "constraint", r"<think>The user greets me\. A greeting back\.</think>\n\nHello, \*\*friend\*\*!")
        _set(browser, "temperature", "0")
        _send(browser, "Hi!")
        _wait_reply_done(browser)
        shown = browser.execute_script("""
            const li = [...document.querySelectorAll('#log li[data-role=assistant]')].pop();
            const details = li.querySelector('details.reasoning');
            return {open: details && details.open, reasoning: details && details.querySelector('.reasoning-text').textContent,
                    text: li.querySelector('.text').textContent, strong: li.querySelector('.text strong')?.textContent};""")
        assert shown["open"] is False, "the reasoning shows in its own block, shut"
        assert shown["reasoning"].strip() == "The user greets me. A greeting back.", shown
        assert shown["text"].strip() == "Hello, friend!" and shown["strong"] == "friend", shown
        browser.find_element(By.CSS_SELECTOR, "#log details.reasoning summary").click()
        assert [e for e in _severe_logs(browser) if "401 (Unauthorized)" not in e["message"]] == []  # (before the key)
        browser.save_screenshot(os.path.join(IMAGES, "webui-reasoning.png"))
    finally:
        browser.quit()
        assert srv.stop() == 0
