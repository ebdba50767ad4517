"""People sign in to the status page in a real browser (issue 34, point 3): headless Chromium
(Playwright, as tests/e2e/test_page.py drives it) against a hub with sign-in, node-oidc-provider
on loopback (tests/support/oidcprovider.py) and a simulator runner. A member signs in, makes a key,
chats with it, sees it and their usage on the page, is refused an admin route, signs out; an
admin sees the member's key and usage; a tampered state or nonce is refused.

``ALP_OIDC_SCREENSHOTS=DIR`` saves the signed-in page of the admin and of the member there
(oidc-admin.png, oidc-member.png); they always go to the test's tmp_path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urljoin, urlsplit, urlunsplit

import openai
import trio
from helpers import runner_config, running
from oidcprovider import STEP
from test_oidc import MEMBER_PROJECT, oidc_hub
from test_page import POLL_MS, Browser, browser, chromium  # noqa: F401 (fixtures)

from gateway.sim import Simulator

NONCE = "an-attackers-nonce-0123456789"


def _changed(url: str, name: str, value: str) -> str:
    """``url`` with its query parameter ``name`` set to ``value``."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    assert name in query, url
    query[name] = value
    return urlunsplit(parts._replace(query=urlencode(query)))


def _shots(tmp_path: Path) -> list[Path]:
    folders = [tmp_path]
    extra = os.environ.get("ALP_OIDC_SCREENSHOTS")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        folders.append(Path(extra))
    return folders


async def test_sign_in_make_a_key_chat_see_it_and_sign_out_in_chromium(
    browser: Browser,  # noqa: F811
    sim: Simulator,
    tmp_path: Path,
) -> None:
    from playwright.sync_api import expect

    run = browser.run
    async with (
        oidc_hub(tmp_path) as setup,
        running(runner_config(setup.base, sim.url, tmp_path / "state")),
    ):
        base, issuer = setup.base, setup.issuer
        pages: dict[str, Any] = {}

        def new_page(who: str) -> None:
            # a browser context of its own per person: their own cookies
            page = browser._browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(10_000)
            page.route("https://fonts.googleapis.com/**", lambda route: route.abort())
            pages[who] = page

        def sign_in(who: str, login: str | None = None, tamper: str | None = None) -> None:
            page = pages[who]
            # Playwright routes only the first request of a redirect chain: each tampering
            # takes that request's answer (route.fetch, the context's cookies) and changes it
            if tamper == "nonce":  # the nonce the hub sends the browser to the provider with

                def change_nonce(route: Any) -> None:
                    answer = route.fetch(max_redirects=0)
                    location = _changed(answer.headers["location"], "nonce", NONCE)
                    route.fulfill(response=answer, headers={**answer.headers, "location": location})

                page.route(f"{base}/auth/login", change_nonce)
            if tamper == "state":  # the state the provider sends the browser back with

                def change_state(route: Any) -> None:
                    if route.request.method != "POST":
                        route.continue_()
                        return
                    target = route.request.url
                    answer = route.fetch(max_redirects=0)
                    while True:  # the provider's redirects, up to its redirect to the hub
                        target = urljoin(target, answer.headers["location"])
                        if target.startswith(f"{base}/auth/callback"):
                            break
                        answer = page.request.get(target, max_redirects=0)
                    location = _changed(target, "state", "tampered-state")
                    route.fulfill(status=303, headers={"location": location})

                page.route(f"{issuer}/interaction/**", change_state)
            page.goto(f"{base}/?poll={POLL_MS}")
            page.get_by_role("link", name="Sign in with your team's account").click()
            page.locator('input[name="login"]').fill(login or who)
            page.locator('input[name="password"]').fill("any")
            page.get_by_role("button", name="Sign-in").click()

        def signed_in(who: str, role: str) -> None:
            page = pages[who]
            expect(page.locator("#whoami")).to_have_text(f"{who}@example.test ({role})")
            expect(page.locator("#dashboard")).to_be_visible()
            runners = page.locator("#runners-section")
            if role == "admin":
                row = page.locator('#runners tbody tr[data-name="test-runner"]')
                expect(row).to_contain_text("up")
            else:
                expect(runners).to_be_hidden()
            # the session's cookie is HttpOnly: the page's script cannot read it
            assert "alp_session" not in page.evaluate("document.cookie")

        with trio.fail_after(3 * STEP):
            await run(new_page, "alice")
            await run(new_page, "bob")
            await run(sign_in, "alice")
            await run(signed_in, "alice", "admin")
            await run(sign_in, "bob")
            await run(signed_in, "bob", "member")

        # -- the member makes a key on the page, shown once -------------------------------
        def create_key(who: str, name: str) -> str:
            page = pages[who]
            form = page.locator("#create-key")
            form.get_by_label("Name").fill(name)
            expect(form.get_by_label("Project")).to_have_value(MEMBER_PROJECT)
            form.get_by_role("button", name="Create key").click()
            expect(page.locator("#new-key-name")).to_have_text(name)
            key = page.locator("#new-key-value").text_content()
            assert key and key.startswith("alpk_")
            page.get_by_role("button", name="Done").click()
            expect(page.locator(f'#keys tbody tr[data-name="{name}"]')).to_contain_text("active")
            return str(key)

        with trio.fail_after(STEP):
            key = await run(create_key, "bob", "bob-laptop")

        # -- a chat with it, through the hub's front door -------------------------------
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=STEP)
        with trio.fail_after(STEP):
            answer = await client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": "hello"}],
                extra_body={"sim": {"chunks": 6}},
            )
            assert answer.choices[0].message.content
            await setup.hub.store.flush_usage()

        # -- both see it on the page: the member their own, the admin everyone's ----------
        def usage_seen(who: str) -> None:
            page = pages[who]
            row = page.locator('#people-usage tbody tr[data-person="bob"]')
            expect(row).to_contain_text("bob@example.test")
            expect(row.locator("td").nth(3)).to_have_text("1")  # one turn
            key_row = page.locator('#keys tbody tr[data-name="bob-laptop"]')
            expect(key_row).to_contain_text("bob@example.test")
            expect(page.locator("#usage-chart svg rect").first).to_be_attached()

        def member_refused_admin_route() -> None:
            page = pages["bob"]
            status = page.evaluate(
                "fetch('/api/hub/runners', {credentials: 'same-origin'}).then(r => r.status)"
            )
            assert status == 403
            mine = page.evaluate(
                "fetch('/api/hub/keys', {credentials: 'same-origin'}).then(r => r.json())"
            )
            assert [k["name"] for k in mine["keys"]] == ["bob-laptop"]
            # a change without the CSRF token is refused even from the page's own origin
            status = page.evaluate(
                "fetch('/api/hub/keys', {method: 'POST', credentials: 'same-origin',"
                " headers: {'content-type': 'application/json'},"
                " body: JSON.stringify({name: 'sneaky'})}).then(r => r.status)"
            )
            assert status == 403

        def screenshot(who: str) -> None:
            for folder in _shots(tmp_path):
                pages[who].screenshot(
                    path=str(folder / f"oidc-{who_role[who]}.png"), full_page=True
                )

        who_role = {"alice": "admin", "bob": "member"}
        with trio.fail_after(2 * STEP):
            await run(usage_seen, "bob")
            await run(usage_seen, "alice")
            await run(member_refused_admin_route)
            await run(screenshot, "alice")
            await run(screenshot, "bob")
        assert (tmp_path / "oidc-admin.png").stat().st_size > 10_000
        assert (tmp_path / "oidc-member.png").stat().st_size > 10_000

        # -- sign-out: the page says so, the session is gone -------------------------------
        def sign_out() -> None:
            page = pages["bob"]
            page.get_by_role("button", name="Sign out").click()
            expect(page.locator("#signin-section")).to_be_visible()
            expect(page.locator("#signin-error")).to_have_text("Signed out.")
            me = page.evaluate("fetch('/auth/me').then(r => r.json())")
            assert me["signedIn"] is False
            status = page.evaluate("fetch('/api/hub/keys').then(r => r.status)")
            assert status == 401
            page.reload()
            expect(page.locator("#oidc-signin")).to_be_visible()
            expect(page.locator("#dashboard")).to_be_hidden()

        with trio.fail_after(STEP):
            await run(sign_out)

        # -- a tampered state, a tampered nonce: refused, nobody signed in ------------------
        def refused(who: str, words: str) -> None:
            page = pages[who]
            expect(page.locator("body")).to_contain_text(words)
            me = page.evaluate("fetch('/auth/me').then(r => r.json())")
            assert me["signedIn"] is False

        with trio.fail_after(3 * STEP):
            await run(new_page, "mallory-state")
            await run(sign_in, "mallory-state", "alice", "state")
            await run(refused, "mallory-state", "state does not match")
            await run(new_page, "mallory-nonce")
            await run(sign_in, "mallory-nonce", "alice", "nonce")
            await run(refused, "mallory-nonce", "nonce is not this sign-in's")
