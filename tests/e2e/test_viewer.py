"""The trajectory viewer in a real headless browser (Debian's chromium driven by Playwright)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.viewed_sessions import record_viewed_sessions

CHROMIUM = os.environ.get("TITO_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "ui"
ADMIN = "admin-key-1"

playwright_api = pytest.importorskip("playwright.sync_api")
if not shutil.which(CHROMIUM):
    pytest.skip(f"no chromium at {CHROMIUM} (scripts/test installs Debian's on CI)", allow_module_level=True)


@pytest.fixture
def viewer_url(start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Tokenizer) -> Iterator[str]:
    engine.context_length = 131072  # room for the 32k+ token trajectory
    with start_proxy(api_key="harness-key", admin_key=ADMIN) as url:
        record_viewed_sessions(url, engine, qwen_tokenizer, key=ADMIN)
        yield url


@contextmanager
def _browser_tab(headers: dict[str, str] | None = None) -> Iterator[tuple[Any, list[str]]]:
    """A Chromium tab, and the console errors and uncaught exceptions of its pages."""
    errors: list[str] = []
    with playwright_api.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1400, "height": 1000}, extra_http_headers=headers)
        tab = context.new_page()
        tab.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        tab.on("pageerror", lambda error: errors.append(str(error)))
        try:
            yield tab, errors
        finally:
            browser.close()


@pytest.fixture
def page(viewer_url: str) -> Iterator[Any]:
    """The viewer opened with the admin key sent as a header on every request."""
    with _browser_tab({"Authorization": f"Bearer {ADMIN}"}) as (tab, errors):
        tab.goto(f"{viewer_url}/ui")
        tab.wait_for_selector("#sessions")
        yield tab
    assert errors == [], errors


def test_the_page_asks_for_the_key_once(viewer_url: str) -> None:
    with _browser_tab() as (tab, errors):
        tab.goto(f"{viewer_url}/ui")
        tab.wait_for_selector("#login")
        _shot(tab, "login")
        # The only error: Chromium reports the page's own 401, which is what tells it to ask.
        assert [e for e in errors if "401" not in e] == []
        errors.clear()
        tab.fill("#admin-key", "wrong")
        tab.click("#login button")
        tab.wait_for_selector("#login .error:has-text('wrong key')")
        errors.clear()  # the refused login's 401
        tab.fill("#admin-key", ADMIN)
        tab.click("#login button")
        tab.wait_for_selector("#sessions")
        assert _listed(tab) == ["live", "other", "viewed"]
        tab.reload()  # the cookie keeps the key
        tab.wait_for_selector("#sessions")
        assert errors == [], errors


def _shot(tab: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _listed(tab: Any) -> list[str]:
    return sorted(tab.eval_on_selector_all(".session-row", "rows => rows.map(r => r.dataset.id)"))


def test_the_data_needs_the_admin_key(viewer_url: str) -> None:
    assert httpx.get(f"{viewer_url}/ui").status_code == 401  # a page that asks for the key
    assert httpx.get(f"{viewer_url}/ui", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert httpx.get(f"{viewer_url}/ui", cookies={"tito_admin_key": ADMIN}).status_code == 200
    assert httpx.get(f"{viewer_url}/ui/api/sessions").status_code == 401
    harness = {"Authorization": "Bearer harness-key"}
    assert httpx.get(f"{viewer_url}/ui/api/sessions", headers=harness).status_code == 403
    assert httpx.post(f"{viewer_url}/ui/login", json={"key": "wrong"}).status_code == 401
    cookie = {"tito_admin_key": ADMIN}
    assert httpx.get(f"{viewer_url}/ui/api/sessions", cookies=cookie).status_code == 200


def test_sessions_list_and_filters(page: Any) -> None:
    _shot(page, "sessions")
    assert _listed(page) == ["live", "other", "viewed"]
    for query, expected in (
        ("status=finished", ["other", "viewed"]),
        ("group=g1", ["live", "viewed"]),
        ("reward_min=0.75", ["other"]),
        ("weight_version=v0", ["live", "other", "viewed"]),
        ("weight_version=v9", []),
        ("drift=think_wrapper", ["viewed"]),
        ("drift=final_separator_absent,think_wrapper", ["viewed"]),
    ):
        page.evaluate(f"location.hash = '#/?{query}'")
        page.wait_for_function(f"location.hash.includes('{query}') && document.querySelector('#filters')")
        page.wait_for_timeout(300)
        assert _listed(page) == expected, query
    # The filter form drives the same query.
    page.evaluate("location.hash = '#/'")
    page.wait_for_timeout(300)
    page.select_option("select[name=status]", "active")
    page.click("#apply")
    page.wait_for_function("location.hash.includes('status=active')")
    page.wait_for_timeout(300)
    assert _listed(page) == ["live"]


def test_paging_over_cursors(page: Any) -> None:
    page.evaluate("location.hash = '#/?status=finished&limit=1'")
    page.wait_for_selector("#next")
    first = _listed(page)
    page.click("#next")
    page.wait_for_function("location.hash.includes('after=')")
    page.wait_for_timeout(300)
    second = _listed(page)
    assert sorted(first + second) == ["other", "viewed"]


def test_a_session_shows_tokens_masks_drift_and_branches(page: Any) -> None:
    page.click("a[href='#/s/viewed']")
    page.wait_for_selector("#stream .tok")
    _shot(page, "session")
    assert page.inner_text("#session-id") == "viewed"
    branches = page.eval_on_selector_all("#tree .tag", "tags => tags.map(t => t.textContent)")
    assert "final" in branches
    assert "sample" in branches  # n=2: the other choice
    assert page.locator("#paths button.path").count() == 2
    assert "segment 1 opened: a new conversation" in page.inner_text("#tree")
    assert page.locator("#stream .tok.m1").count() > 0
    assert page.locator("#stream .tok.m0").count() > 0
    hover = page.get_attribute("#stream .tok.m1", "title")
    assert hover is not None
    assert "logprob" in hover
    assert "id " in hover
    edit = page.locator("#stream .tok.edit").first
    assert edit.get_attribute("data-kind") == "truncation_close_synthesized"
    assert "truncation_close_synthesized" in page.inner_text("#markers")
    assert "final_separator_absent" in page.inner_text("#markers")
    calls = page.inner_text("#calls")
    assert "reasoning: I should run it" in calls
    assert "tool call run" in calls
    page.click("#paths button.path[data-index='1']")  # the sample: no reasoning, think_wrapper drift
    page.wait_for_selector("#stream .tok.drift")
    assert page.get_attribute("#stream .tok.drift", "data-kind") == "think_wrapper"
    page.click("#paths button.path[data-index='0']")
    page.wait_for_selector("#calls .reasoning")
    page.click("#view-steps")
    page.wait_for_selector("#step-1 .tok")
    # Step 1's prompt holds call 1's sampled tokens as context: only its own output has mask 1.
    step_masks = page.eval_on_selector_all(
        "#step-1 .tok", "toks => toks.map(t => [+t.dataset.pos, t.classList.contains('m1')])"
    )
    assert all(sampled == (pos >= 130) for pos, sampled in step_masks), step_masks
    _shot(page, "steps")
    page.click("#view-diff")
    page.wait_for_selector("#diff-render .tok")
    _shot(page, "diff")


def test_a_32k_token_path_renders_only_what_is_on_screen(viewer_url: str, page: Any) -> None:
    # A 32k+ token prompt (the template render of a long tool result, mask 0) and a short answer.
    long_text = " ".join(f"w{i}" for i in range(12000))
    body = {"model": "m", "messages": [{"role": "user", "content": long_text}], "max_tokens": 8}
    response = httpx.post(
        f"{viewer_url}/sessions/long/v1/chat/completions",
        json=body,
        headers={"Authorization": "Bearer harness-key"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 32000
    page.evaluate("location.hash = '#/s/long'")
    page.wait_for_selector("#stream .tok", timeout=60000)
    drawn = page.locator("#stream .tok").count()
    assert drawn < 5000, drawn
    page.eval_on_selector("#stream", "box => { box.scrollTop = box.scrollHeight; }")
    page.wait_for_timeout(300)
    last = page.eval_on_selector_all("#stream .tok", "toks => Math.max(...toks.map(t => +t.dataset.pos))")
    assert last > 32000
    _shot(page, "long")
