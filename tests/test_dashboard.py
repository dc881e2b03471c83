"""The dashboard in a real headless browser (Debian's chromium, driven by Playwright)."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from playwright.async_api import Browser, async_playwright

from evolution_ingest.core.events import Event
from tests.conftest import RABBITMQ_URL, OpenRuntime, running_service, serving
from tests.support import Recorder, fixtures, wait_until
from tests.support.evolution import EvolutionPublisher, broker, send_both

CHROMIUM = os.environ.get("TEST_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS", Path(__file__).parent.parent / "artifacts"))
TOKEN = "test-dashboard-token-not-a-secret"
UNIQUE = 19


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    if not shutil.which(CHROMIUM):
        pytest.fail(f"no browser at {CHROMIUM}: install Debian's chromium (scripts/browser.sh does)")
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-background-networking", "--disable-gpu", "--no-first-run"],
        )
        try:
            yield launched
        finally:
            await launched.close()


class FailsOnCall(Recorder):
    async def __call__(self, event: Event) -> None:
        if event.event == "call":
            raise RuntimeError("the call handler is down")
        await super().__call__(event)


async def test_the_dashboard_shows_the_figures_of_a_known_set_of_events(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, browser: Browser
) -> None:
    items = fixtures()
    failing = sum(1 for item in items if item["webhook_body"]["event"] == "call")
    async with (
        open_runtime(
            FailsOnCall(), dashboard_token=TOKEN, coverage_settle_seconds=0.0, retry_delays_seconds=[60.0]
        ) as runtime,
        running_service(runtime) as service,
    ):
        settings = runtime.settings
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            await send_both(http, service.url, publisher, items)
            async with http.post(service.url, data=b'{"event": "call", "data": {}}') as refused:
                assert refused.status == 400

            async def settled() -> bool:
                counted = await runtime.counters.read(["rabbitmq:received"])
                return counted["rabbitmq:received"] >= 20

            await wait_until(settled, within=20, message="20 RabbitMQ deliveries")
        base = service.url.removesuffix("/api/internal/webhook")
        context = await browser.new_context(
            http_credentials={"username": "operator", "password": TOKEN},
            viewport={"width": 1366, "height": 900},
        )
        page = await context.new_page()
        await page.goto(base + "/dashboard")
        await page.wait_for_selector("body[data-loaded=yes]", timeout=15_000)

        async def figure(name: str) -> str:
            return (await page.inner_text(f"[data-figure={name}] .figure")).strip()

        assert await figure("webhook-received") == "20"
        assert await figure("rabbitmq-received") == "20"
        assert await figure("processed") == str(UNIQUE - failing)
        assert await figure("pending") == str(failing)
        assert await figure("failed") == "0"
        # One duplicate on the webhook (the re-emission), every processed RabbitMQ copy.
        assert int((await figure("duplicates")).replace(",", "")) >= 1 + UNIQUE - failing
        coverage_row = page.locator("#coverage tr[data-instance=acme-sales]")
        assert "acme-sales" in await coverage_row.inner_text()
        assert "100%" in await coverage_row.inner_text()  # every event came on both channels
        failures = page.locator("#failures tbody tr")
        assert await failures.count() == failing
        assert "the call handler is down" in await failures.first.inner_text()
        assert "lock-busy" in await page.inner_text("#queues")
        refusals = page.locator("#refusals tbody tr")
        assert await refusals.count() == 1
        assert "missing field 'instance'" in await refusals.first.inner_text()
        assert "1 kept" in (await page.text_content("#refusals-summary") or "")
        # The fixtures' connection.update events: connecting, open, then closed (logged out, 401).
        instance_row = await page.locator("#instances tr[data-instance=acme-sales]").inner_text()
        assert "close" in instance_row
        assert "401, logged out" in instance_row
        assert "no backfill yet" in await page.inner_text("#backfill")
        await asyncio.to_thread(ARTIFACTS.mkdir, parents=True, exist_ok=True)
        await page.screenshot(path=ARTIFACTS / "dashboard.png", full_page=True)

        # The link of a failure opens the event, apikey hidden.
        await failures.first.locator("a").click()
        await page.wait_for_load_state()
        shown = await page.inner_text("body")
        assert "the call handler is down" in shown
        assert "[redacted]" in shown
        assert items[0]["webhook_body"]["apikey"] not in shown
        await page.go_back()
        await page.wait_for_selector("body[data-loaded=yes]", timeout=15_000)
        await page.locator("#refusals tbody tr a").first.click()
        await page.wait_for_load_state()
        assert '{\\"event\\": \\"call\\", \\"data\\": {}}' in await page.inner_text("body")
        await context.close()

        # Without the token: refused, in the browser and by plain HTTP.
        stranger = await browser.new_context()
        answer = await stranger.request.get(base + "/dashboard")
        assert answer.status == 401
        assert "token is required" in await answer.text()
        await stranger.close()
        for path in ("/dashboard", "/dashboard/data", "/dashboard/events/1"):
            async with http.get(base + path) as response:
                assert response.status == 401
                assert response.headers["WWW-Authenticate"].startswith("Basic")
            wrong = base64.b64encode(b"operator:wrong-token").decode()
            async with http.get(base + path, headers={"Authorization": f"Basic {wrong}"}) as response:
                assert response.status == 401
        async with http.get(
            base + "/dashboard/data", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as response:
            assert response.status == 200
            assert (await response.json())["counters"]["webhook:received"] == 20


async def test_the_dashboard_is_off_unless_a_token_is_set(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession
) -> None:
    async with (
        open_runtime() as runtime,
        serving(runtime) as url,
        http.get(url.removesuffix("/api/internal/webhook") + "/dashboard") as response,
    ):
        assert response.status == 404
        assert "EVOLUTION_INGEST_DASHBOARD_TOKEN" in (await response.json())["error"]
