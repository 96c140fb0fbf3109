"""The web page at `/`, driven in headless Chromium (Debian's `chromium` and `chromium-driver`,
installed by scripts/setup.sh) against a live server: chat streams, Stop aborts on the server,
a follow-up reuses the cache, the dashboard's numbers are the server's own, and the tree shows a
shared system prompt. Saves the screenshots docs/images/ holds (README shows them)."""

from __future__ import annotations

import json
import os
import shutil
import time

import httpx
import pytest
from selenium import webdriver
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
return {text: part('.text') ? part('.text').textContent : '', meta: part('.meta') ? part('.meta').textContent : null,
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


def test_the_dashboard_shows_the_servers_numbers_and_the_shared_prefix(page, server):
    assert_kv_clean(server.url)
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    for question in ("When do you open?", "How much is a baguette?"):
        r = httpx.post(server.url + "/generate", json={"text": SYSTEM + question,
                                                       "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
                       timeout=120)
        assert r.status_code == 200
    page.find_element(By.ID, "tab-dash").click()
    stamp = time.time() * 1000
    WebDriverWait(page, 10).until(lambda b: float(b.find_element(By.ID, "tree").get_attribute("data-updated") or 0) > stamp)
    # the numbers and the tree read in one script, at one moment: the page redraws them every second
    # (elements found one call and read the next may be gone by then)
    shown, tops = page.execute_script("""
        const stats = {};
        for (const el of document.querySelectorAll("[data-stat]")) stats[el.dataset.stat] = el.textContent;
        const tops = [...document.querySelectorAll("#tree > li > .node")].map(
            (n) => ({children: n.dataset.children, title: n.title, tokens: n.dataset.tokens}));
        return [stats, tops];""")
    acct = httpx.get(server.url + "/debug/kv_accounting", timeout=30).json()  # idle: the same moment
    for key in ("free_pages", "evictable_pages", "locked_pages", "pool_pages"):
        assert int(shown[key]) == acct[key], (key, shown, acct)
    assert shown["running_requests"] == "0" and shown["request_pages"] == "0"
    (top,) = tops
    assert top["children"] == "2", "both requests' tails hang under the shared prefix"
    assert top["title"] and SYSTEM.startswith(top["title"])
    assert int(top["tokens"]) > 20
    assert not _severe_logs(page)
    page.save_screenshot(os.path.join(IMAGES, "webui-dashboard.png"))
    page.find_element(By.ID, "tab-chat").click()


def test_conversations_are_kept_and_exported(page):
    stored = page.execute_script("return JSON.parse(localStorage.getItem('radixlm-conversations'))")
    (conv,) = [c for c in stored.values() if c["messages"]]
    roles = [m["role"] for m in conv["messages"]]
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


def test_with_an_api_key_the_page_asks_for_it_and_its_picker_lists_adapters(tiny_qwen3, tmp_path):
    import peft
    import transformers

    adapter = str(tmp_path / "story")
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3)
    peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    srv = LiveServer("--model-path", tiny_qwen3, "--api-key", "page-key",  # (behaviour alone: tiny weights)
                     "--lora-paths", f"story={adapter}")
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
    finally:
        browser.quit()
        assert srv.stop() == 0
