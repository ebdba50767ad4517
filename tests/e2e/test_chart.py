"""Usage over time on the status page (issue 35, point 4), and its prices (point 1): tokens and cost per hour for the last
day and per day for the last month, per key or per model, drawn as inline SVG by the page's own
script (no script or font from elsewhere), checked in headless Chromium (tests/e2e/test_page.py's
browser), with a screenshot saved where ``ALP_CHART_SCREENSHOT`` says (none when unset)."""

from __future__ import annotations

import os
import time

import trio
from helpers import ADMIN
from test_page import POLL_MS, STEP, Browser, browser, chromium  # noqa: F401 (fixtures)

from gateway.hub import Hub
from gateway.hub.money import Price
from gateway.hub.store import UsageRecord

DAY = 86400


def _row(key: str, model: str, prompt: int, completion: int, cost: float) -> UsageRecord:
    return UsageRecord(
        f"id-{key}",
        key,
        "s",
        "chat",
        model,
        True,
        "ok",
        None,
        None,
        prompt,
        completion,
        cost=cost,
        ref_cost=cost * 3,
    )


async def test_the_chart_draws_tokens_and_cost_per_hour_and_per_day_by_key_or_model(
    browser: Browser,  # noqa: F811 (the fixture)
    hub: tuple[Hub, str],
) -> None:
    from playwright.sync_api import expect

    the_hub, base = hub
    now = time.time()
    # the last day: alice on m1 twice an hour ago; bob on m2 three hours ago; and 10 days ago
    await the_hub.store.add_usage(_row("alice", "m1", 100, 200, 0.25), now - 3600)
    await the_hub.store.add_usage(_row("alice", "m1", 50, 50, 0.05), now - 3600)
    await the_hub.store.add_usage(_row("bob", "m2", 300, 400, 1.5), now - 3 * 3600)
    await the_hub.store.add_usage(_row("bob", "m1", 1000, 1000, 4.0), now - 10 * DAY)
    await the_hub.store.set_price(Price("m1", 0.5, 1.5, "hosted-x", 2.5, 10.0))
    page = browser.page
    run = browser.run

    def sign_in() -> None:
        response = page.goto(f"{base}/?poll={POLL_MS}")
        assert response is not None and response.status == 200
        page.get_by_label("Admin credential").fill(ADMIN)
        page.get_by_role("button", name="Sign in").click()

    def day_by_key() -> None:
        svg = page.locator("#usage-chart svg")
        expect(svg).to_have_attribute("data-view", "day-tokens-key")
        expect(page.locator('#usage-chart svg rect[data-key="alice"]')).to_have_count(1)
        expect(page.locator('#usage-chart svg rect[data-key="bob"]')).to_have_count(1)
        title = page.locator('#usage-chart svg rect[data-key="alice"] title')
        expect(title).to_contain_text("400 tokens")  # its two turns in that hour

    def month_cost_by_model() -> None:
        page.select_option("#usage-span", "month")
        page.select_option("#usage-measure", "cost")
        page.select_option("#usage-by", "model")
        svg = page.locator("#usage-chart svg")
        expect(svg).to_have_attribute("data-view", "month-cost-model")
        # m1: today's day (alice, 0.30) and ten days ago (bob, 4.00); m2: today's (1.50)
        expect(page.locator('#usage-chart svg rect[data-key="m1"]')).to_have_count(2)
        expect(page.locator('#usage-chart svg rect[data-key="m2"]')).to_have_count(1)
        expect(page.locator('#usage-chart svg rect[data-key="m2"] title')).to_contain_text(
            "1.50 USD"
        )
        expect(page.locator("#usage-chart .legend")).to_contain_text("m1")

    def prices() -> None:
        row = page.locator('#prices tbody tr[data-model="m1"]')
        expect(row).to_contain_text("0.5 USD")
        expect(row).to_contain_text("hosted-x 2.5 USD / 10 USD")

    def external() -> list[str]:
        found: list[str] = page.evaluate(
            "[...document.querySelectorAll('script[src],link[href],img[src]')]"
            ".map(e => e.src || e.href).filter(u => !u.startsWith(location.origin))"
        )
        return found

    with trio.fail_after(STEP):
        await run(sign_in)
        await run(day_by_key)
        await run(month_cost_by_model)
        await run(prices)
        assert await run(external) == []  # nothing from outside the hub: it works on a LAN
    shot = os.environ.get("ALP_CHART_SCREENSHOT", "")
    if shot:

        def screenshot() -> None:
            page.locator("#usage-chart").scroll_into_view_if_needed()
            page.locator("#usage-chart").screenshot(path=shot)

        with trio.fail_after(STEP):
            await run(screenshot)
