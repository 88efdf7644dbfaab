"""/dashboard in a real headless Chromium against `pagedllm serve` on the tiny model, while long
streaming requests run: the page asks for the API key, then its block map and queue counts agree
with what /metrics says at about the same moment. Skipped when no Chromium binary is installed
(CI installs Debian's `chromium` first); nothing is downloaded here."""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.fake_engine import FakeEngine
from tests.entrypoints.openai.serve_utils import API_KEY, AUTH, MODEL, read_metrics, serve_tiny
from tests.utils import free_port, make_tiny_model

NUM_CLIENTS = 5
MAX_NUM_SEQS = 3  # so that some requests wait
SAMPLES = 16


def _chromium() -> str | None:
    for name in (os.environ.get("PAGEDLLM_CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    path = _chromium()
    if path is None:
        pytest.skip("no Chromium binary (chromium, chromium-browser, google-chrome or $PAGEDLLM_CHROMIUM); "
                    "on Debian: apt-get install chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package (the test extra)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def dash_server(tmp_path_factory):
    # A deeper tiny model and the longest requests it allows: each lasts seconds, so most of the
    # page's polls fall between two requests finishing, when the queues have one right answer.
    model = make_tiny_model(str(tmp_path_factory.mktemp("deep_llama")), "llama", num_hidden_layers=12)
    yield from serve_tiny(model, tmp_path_factory, extra_args=("--max-num-seqs", str(MAX_NUM_SEQS),
                                                               "--max-model-len", "512"))


@pytest.fixture
def load(dash_server):
    """NUM_CLIENTS clients, each streaming one long completion after another until the test ends."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def client(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Request {i} says hello to the dashboard", "max_tokens": 480,
                "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with httpx.Client(base_url=dash_server, headers=AUTH, timeout=60) as http:
                while not stop.is_set():
                    with http.stream("POST", "/v1/completions", json=body) as resp:
                        resp.raise_for_status()
                        for _ in resp.iter_lines():
                            if stop.is_set():
                                break
        except BaseException as e:  # reported by the test, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    yield
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors


# Every Content-Security-Policy violation the page causes (the server sends one: nothing may be blocked).
# Waits take functions, not expressions: the policy forbids eval, which Playwright uses for those.
CSP_VIOLATIONS = """window.cspViolations = [];
document.addEventListener("securitypolicyviolation",
                          (e) => window.cspViolations.push(`${e.violatedDirective} ${e.blockedURI}`));"""


def _new_page(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.add_init_script(CSP_VIOLATIONS)
    return page


DOM_COUNTS = """() => {
    const text = (id) => Number(document.getElementById(id).textContent);
    const used = [...document.querySelectorAll('#blockmaps rect.used')];
    const running = [...document.querySelectorAll('#queue-running td.id')].map((td) => td.title);
    return {renders: Number(document.body.dataset.renders), cells: document.querySelectorAll('#blockmaps rect').length,
            used: used.length, owners: [...new Set(used.map((r) => r.dataset.owner))],
            running: text('count-running'), waiting: text('count-waiting'), preempted: text('count-preempted'),
            running_ids: running};
}"""


def test_dashboard_in_chromium(browser, dash_server, load, tmp_path):
    page = _new_page(browser)
    page.goto(f"{dash_server}/dashboard")
    page.wait_for_selector("#keyform.shown", timeout=10_000)  # the state answered 401: the page asks
    page.fill("#key", API_KEY)
    page.click("#keyform button")
    page.wait_for_function("() => Number(document.body.dataset.renders) >= 3 "
                           "&& Number(document.getElementById('count-running').textContent) > 0", timeout=30_000)
    assert page.evaluate("sessionStorage.getItem('pagedllm-dashboard-key')") == API_KEY

    stable, samples = 0, []
    for _ in range(SAMPLES):
        before = read_metrics(dash_server)
        renders = page.evaluate("Number(document.body.dataset.renders)")
        page.wait_for_function(f"() => Number(document.body.dataset.renders) > {renders}", timeout=10_000)
        dom = page.evaluate(DOM_COUNTS)
        after = read_metrics(dash_server)
        samples.append((before, dom, after))
        # What the page draws agrees with itself: in-use cells belong to the running requests.
        assert dom["running"] == len(dom["running_ids"]) and set(dom["owners"]) <= set(dom["running_ids"])
        assert dom["running"] <= MAX_NUM_SEQS and dom["running"] + dom["waiting"] + dom["preempted"] <= NUM_CLIENTS
        if _finished(before) != _finished(after):
            continue  # a request finished and another started while the page polled: no fixed answer
        # No request came or went between the two scrapes, so the page's poll, in between, saw these
        # queues, and a block count between the two (a decode step adds at most one block a request).
        stable += 1
        assert dom["running"] == after["pagedllm:num_requests_running"], (before, dom, after)
        assert dom["waiting"] + dom["preempted"] == after["pagedllm:num_requests_waiting"], (before, dom, after)
        low, high = sorted(m["pagedllm:kv_cache_usage_perc"] * dom["cells"] for m in (before, after))
        assert low - 1 <= dom["used"] <= high + MAX_NUM_SEQS, (before, dom, after)
    print(f"dashboard: {stable} of {SAMPLES} polls fell between two finishing requests")
    assert stable >= 4, samples

    page.wait_for_function("() => document.querySelector('#chart polyline.gen').getAttribute('points')"
                           ".split(' ').length > 2")
    assert float(page.text_content("#rate-gen")) > 0
    assert page.text_content("#model") == MODEL
    cell = page.locator("#blockmaps rect.used").first
    cell.hover()
    assert "in use by" in page.text_content("#tooltip")
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"dashboard screenshot: {shot}")
    assert shot.stat().st_size > 10_000
    assert page.evaluate("window.cspViolations") == []


def _finished(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("pagedllm:request_success_total"))


class _TwoCoreEngine(FakeEngine):
    """Two data-parallel engine cores, speculation and LoRA on: stats keys as AsyncLLM's."""

    async def get_stats(self) -> dict:
        return {**await super().get_stats(), "spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 40,
                "spec_decode_num_accepted_tokens": 30, "spec_decode_acceptance_rate": 0.75,
                "spec_decode_mean_acceptance_length": 4.0, "lora_running:sql": 1, "lora_waiting:chat": 2}

    async def get_scheduler_state(self) -> list[dict]:
        (core,) = await super().get_scheduler_state()
        stats = await self.get_stats()
        now = time.time()
        req = {**_REQUEST, "id": "adapted", "lora": "sql", "block_ids": [0, 1, 2], "num_blocks": 3,
               "arrival_time": now - 3, "first_token_time": now - 2.5}
        waiting = [{**_REQUEST, "id": f"queued-{i}", "queue": "waiting", "status": "waiting", "lora": "chat",
                    "computed_tokens": 0, "prompt_computed": 0, "output_tokens": 0, "arrival_time": time.time() - 1}
                   for i in range(2)]
        second = {**core, "block_states": "uuu" + "c" * 2 + "f" * 27, "num_blocks": 32, "num_free_blocks": 29,
                  "requests": [req, *waiting], "stats": {**stats, "num_running": 1, "num_waiting": 2,
                                                         "kv_cache_usage": 3 / 32, "num_total_blocks": 32,
                                                         "num_free_blocks": 29}}
        return [{**core, "stats": {**core["stats"], "num_total_blocks": 16, "num_free_blocks": 16}}, second]


_REQUEST = {"queue": "running", "status": "running", "prompt_tokens": 30, "computed_tokens": 40, "prompt_computed": 30,
            "output_tokens": 10, "max_tokens": 64, "cached_tokens": 16, "num_preemptions": 0, "priority": 0,
            "arrival_time": 0.0, "first_token_time": None, "lora": None, "num_blocks": 0, "block_ids": []}


@pytest.fixture
def fake_server(fake_tokenizer, fake_model_dir):
    import uvicorn

    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.server_config import ServerConfig

    app = build_app(_TwoCoreEngine(fake_tokenizer, fake_model_dir), ServerConfig(served_model_names=("fake",)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_engines_adapters_and_speculation_in_chromium(browser, fake_server, tmp_path):
    page = _new_page(browser)
    page.goto(f"{fake_server}/dashboard")  # no --api-key: no form
    page.wait_for_function("() => Number(document.body.dataset.renders) >= 1", timeout=10_000)
    assert not page.is_visible("#keyform")
    assert page.is_visible("#spec-card") and page.text_content("#spec-rate") == "75.0%"
    assert page.locator("#engines tbody tr").count() == 2 and page.is_visible("#engines th.spec-col")
    loras = page.locator("#loras tbody tr").all_inner_texts()
    assert [row.split() for row in loras] == [["chat", "0", "2"], ["sql", "1", "0"]]
    assert page.locator("#blockmaps svg").count() == 2
    assert page.locator("#blocks-1 rect.used").count() == 3 and page.locator("#blocks-1 rect.cached").count() == 2
    assert {page.get_attribute(f"#blocks-1 rect:nth-child({i})", "data-owner") for i in (1, 2, 3)} == {"adapted"}
    assert "Engine" in page.locator("#queue-running th").all_inner_texts()
    assert page.text_content("#count-waiting") == "2" and page.text_content("#count-running") == "1"
    assert page.locator("#queue-running td").all_inner_texts()[5] == "500 ms"  # TTFT
    page.screenshot(path=str(tmp_path / "dashboard_dp.png"), full_page=True)
    assert page.evaluate("window.cspViolations") == []
