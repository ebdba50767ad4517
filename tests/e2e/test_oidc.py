"""People sign in with OpenID Connect (issue 34, point 3), against a real provider on loopback
(node-oidc-provider, tests/support/oidc/provider.mjs): the authorization-code flow with PKCE, the page
session's cookie and CSRF token, an admin and a member (their own keys, a chat with one, their
own usage), sign-out, and a tampered state or nonce refused. The browser's walk of the same is
tests/e2e/test_oidc_page.py."""

from __future__ import annotations

import base64
import json
import logging
import math
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import httpx
import jwt
import openai
import pytest
import rsa as rsa_lib
import trio
import trustme
from cryptography.hazmat.primitives.asymmetric import rsa
from helpers import ADMIN, OWNER, PROJECT, LogCapture, runner_config, running
from oidcprovider import (
    ADMIN_GROUP,
    CLIENT_ID,
    CLIENT_SECRET,
    STEP,
    free_port,
    open_provider,
    query_of,
    sign_in_at_provider,
)

from gateway.hub import Hub, open_hub
from gateway.hub.oidc import Login, OidcError
from gateway.sim import Simulator

MEMBER_PROJECT = f"{OWNER}/{PROJECT}"


@dataclass
class Setup:
    hub: Hub
    base: str
    issuer: str


@asynccontextmanager
async def oidc_hub(
    tmp_path: Path, serve: dict[str, Any] | None = None, **overrides: Any
) -> AsyncIterator[Setup]:
    """A hub with sign-in (its data in ``tmp_path/hub``; ``serve``: ``open_hub``'s TLS files)
    and the provider it trusts."""
    port = free_port()
    issuer = f"http://127.0.0.1:{port}"
    secret = tmp_path / "oidc-secret"
    secret.write_text(CLIENT_SECRET + "\n")
    hub = Hub(
        tmp_path / "hub",
        admin_token=ADMIN,
        oidc_issuer=issuer,
        oidc_client_id=CLIENT_ID,
        oidc_client_secret_file=secret,
        oidc_admin_group=ADMIN_GROUP,
        oidc_member_projects=(MEMBER_PROJECT,),
        **overrides,
    )
    async with (
        open_hub(hub, **(serve or {})) as (the_hub, base),
        open_provider(port, [base + "/auth/callback"], tmp_path),
    ):
        yield Setup(the_hub, base, issuer)


async def sign_in(client: httpx.AsyncClient, base: str, login: str) -> dict[str, Any]:
    """``login`` signs in to the hub's page (the browser's redirects walked by ``client``);
    what ``/auth/me`` says then."""
    resp = await client.get(base + "/auth/login")
    assert resp.status_code == 302
    back = await sign_in_at_provider(client, resp.headers["location"], login)
    assert back.startswith(base + "/auth/callback?")
    resp = await client.get(back)
    assert resp.status_code == 303, resp.text
    assert resp.headers["location"] == "/"
    me = (await client.get(base + "/auth/me")).json()
    assert me["signedIn"] is True
    return dict(me)


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=STEP, follow_redirects=False)


async def test_sign_in_roles_member_keys_chat_usage_and_sign_out(
    tmp_path: Path, sim: Simulator
) -> None:
    logs = LogCapture()  # every line of the hub's and the runner's loggers, DEBUG included
    gateway_log = logging.getLogger("gateway")
    gateway_log.addHandler(logs)
    level = gateway_log.level
    gateway_log.setLevel(logging.DEBUG)
    try:
        await _walk(tmp_path, sim, logs)
    finally:
        gateway_log.removeHandler(logs)
        gateway_log.setLevel(level)


async def _walk(tmp_path: Path, sim: Simulator, logs: LogCapture) -> None:
    async with oidc_hub(tmp_path) as setup:
        base = setup.base
        async with (
            running(runner_config(base, sim.url, tmp_path / "state")),
            _client() as alice,
            _client() as bob,
        ):
            # -- no sign-in yet: the page says sign-in is on; the admin API wants a credential
            me = (await bob.get(base + "/auth/me")).json()
            assert me == {"oidc": True, "signedIn": False}
            assert (await bob.get(base + "/api/hub/keys")).status_code == 401

            # -- the login redirect: PKCE S256, state and nonce, the cookie's attributes ----
            resp = await bob.get(base + "/auth/login")
            location = query_of(resp.headers["location"])
            assert location["code_challenge_method"] == "S256"
            assert location["client_id"] == CLIENT_ID
            assert location["redirect_uri"] == base + "/auth/callback"
            assert "groups" in location["scope"].split()
            cookie = resp.headers["set-cookie"]
            assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Path=/auth/" in cookie
            assert "Secure" not in cookie  # plain HTTP here (the TLS test below sees it Secure)
            assert cookie.split(";")[0].split("=", 1)[1].split(".")[0] == location["state"]
            bob.cookies.clear()

            # -- the admin and the member sign in ----------------------------------------
            me_alice = await sign_in(alice, base, "alice")
            assert me_alice["role"] == "admin" and me_alice["email"] == "alice@example.test"
            me_bob = await sign_in(bob, base, "bob")
            assert me_bob["role"] == "member" and me_bob["sub"] == "bob"
            assert me_bob["projects"] == [MEMBER_PROJECT]
            session_cookie = bob.cookies.get("alp_session")
            assert session_cookie
            bob_csrf = {"x-csrf-token": me_bob["csrf"]}
            alice_csrf = {"x-csrf-token": me_alice["csrf"]}

            # -- a state-changing request without the CSRF token is refused ---------------
            body = {"name": "bob-laptop", "project": MEMBER_PROJECT}
            resp = await bob.post(base + "/api/hub/keys", json=body)
            assert resp.status_code == 403 and resp.json()["error"]["code"] == "csrf"
            resp = await bob.post(
                base + "/api/hub/keys", json=body, headers={"x-csrf-token": me_alice["csrf"]}
            )
            assert resp.status_code == 403  # another session's token is no better
            assert await setup.hub.keys.listing() == []

            # -- a member makes a key, for an allowed project only; it carries who made it --
            resp = await bob.post(
                base + "/api/hub/keys",
                json={"name": "bob-other", "project": "elsewhere/proj"},
                headers=bob_csrf,
            )
            assert resp.status_code == 403
            assert resp.json()["error"]["code"] == "project_not_allowed"
            resp = await bob.post(base + "/api/hub/keys", json=body, headers=bob_csrf)
            assert resp.status_code == 201, resp.text
            made = resp.json()
            assert made["person"] == {"sub": "bob", "email": "bob@example.test"}
            bob_key = made["key"]
            resp = await alice.post(
                base + "/api/hub/keys",
                json={"name": "alice-ci", "project": "elsewhere/proj"},
                headers=alice_csrf,
            )
            assert resp.status_code == 201  # an admin may make a key for any project
            resp = await alice.post(
                base + "/api/hub/keys",
                json={"name": "alice-desk", "project": MEMBER_PROJECT},
                headers=alice_csrf,
            )
            alice_key = resp.json()["key"]

            # -- the admin allows a person other projects than the hub's default -----------
            projects = base + "/api/hub/people/bob/projects"
            other = {"projects": ["acme/other"]}
            resp = await bob.put(projects, json=other, headers=bob_csrf)
            assert resp.status_code == 403  # not a member's to say
            resp = await alice.put(projects, json={"projects": ["no-slash"]}, headers=alice_csrf)
            assert resp.status_code == 400
            resp = await alice.put(
                base + "/api/hub/people/nobody/projects", json=other, headers=alice_csrf
            )
            assert resp.status_code == 404
            resp = await alice.put(projects, json=other, headers=alice_csrf)
            assert resp.status_code == 200 and resp.json()["projects"] == ["acme/other"]
            assert (await bob.get(base + "/auth/me")).json()["projects"] == ["acme/other"]
            resp = await bob.post(
                base + "/api/hub/keys",
                json={"name": "bob-2", "project": MEMBER_PROJECT},
                headers=bob_csrf,
            )
            assert resp.status_code == 403
            assert "acme/other" in resp.json()["error"]["message"]
            resp = await alice.put(projects, json={"projects": None}, headers=alice_csrf)
            assert resp.status_code == 200
            assert (await bob.get(base + "/auth/me")).json()["projects"] == [MEMBER_PROJECT]

            # -- the member sees only their own keys; the admin sees every key's owner -----
            mine = (await bob.get(base + "/api/hub/keys")).json()["keys"]
            assert [k["name"] for k in mine] == ["bob-laptop"]
            every = (await alice.get(base + "/api/hub/keys")).json()["keys"]
            owners = {k["name"]: (k["person"] or {}).get("sub") for k in every}
            assert owners == {"bob-laptop": "bob", "alice-ci": "alice", "alice-desk": "alice"}

            # -- a member is refused the admin's routes -----------------------------------
            for path in ("/api/hub/runners", "/api/hub/jobs", "/api/hub/people", "/metrics"):
                resp = await bob.get(base + path)
                assert resp.status_code == 403, path
            assert (await alice.get(base + "/api/hub/runners")).status_code == 200
            people = (await alice.get(base + "/api/hub/people")).json()["people"]
            assert {(p["sub"], p["role"], p["activeKeys"], p["projects"]) for p in people} == {
                ("alice", "admin", 2, None),
                ("bob", "member", 1, None),
            }
            # ... and another's key: not even said to exist
            resp = await bob.post(
                base + "/api/hub/keys/revoke", json={"name": "alice-desk"}, headers=bob_csrf
            )
            assert resp.status_code == 404
            assert "alice-desk" in {k["name"] for k in await setup.hub.keys.listing()}

            # -- chats with the member's key and the admin's, through the front door ------
            for key, words in ((bob_key, 5), (bob_key, 7), (alice_key, 3)):
                client = openai.AsyncOpenAI(
                    base_url=base + "/v1", api_key=key, max_retries=0, timeout=STEP
                )
                with trio.fail_after(STEP):
                    answer = await client.chat.completions.create(
                        model="sim-model",
                        messages=[{"role": "user", "content": "hello"}],
                        extra_body={"sim": {"chunks": words}},
                    )
                assert answer.choices[0].message.content
            with trio.fail_after(STEP):
                await setup.hub.store.flush_usage()

            # -- usage per person: the member sees their own, the admin everyone's ---------
            since = time.time() - 3600
            resp = await bob.get(base + f"/api/hub/usage?since={since}")
            rows = resp.json()["usage"]
            assert resp.json()["by"] == "person"
            assert {r["person"] for r in rows} == {"bob"}
            assert sum(r["turns"] for r in rows) == 2
            bob_tokens = sum(r["completionTokens"] for r in rows)
            assert bob_tokens > 0
            resp = await alice.get(base + f"/api/hub/usage?since={since}&by=person")
            every_row = resp.json()["usage"]
            per = {}
            for r in every_row:
                per[r["person"]] = per.get(r["person"], 0) + r["turns"]
            assert per == {"alice": 1, "bob": 2}
            resp = await alice.get(base + f"/api/hub/usage?since={since}&by=team")
            assert resp.status_code == 400

            # -- the member revokes their own key: the front door refuses it at once -------
            resp = await bob.delete(base + "/api/hub/keys/bob-laptop", headers=bob_csrf)
            assert resp.status_code == 200
            resp = await httpx.AsyncClient(timeout=STEP).post(
                base + "/v1/chat/completions",
                headers={"authorization": f"Bearer {bob_key}"},
                json={"model": "sim-model", "messages": [{"role": "user", "content": "x"}]},
            )
            assert resp.status_code == 401

            # -- sign-out: the session is gone, its cookie refused from then on -----------
            resp = await bob.post(base + "/auth/logout")
            assert resp.status_code == 403  # without its CSRF token, not even sign-out
            resp = await bob.post(base + "/auth/logout", headers=bob_csrf)
            assert resp.status_code == 200
            assert "Max-Age=0" in resp.headers["set-cookie"]
            assert (await bob.get(base + "/auth/me")).json()["signedIn"] is False
            replay = httpx.Cookies({"alp_session": session_cookie})
            async with httpx.AsyncClient(timeout=STEP, cookies=replay) as stolen:
                resp = await stolen.get(base + "/api/hub/keys")
                assert resp.status_code == 401  # the old cookie: signed out for good

    # -- no secret in any log line: the client secret, a session's token, an API key ------
    text = "\n".join(logs.lines)
    for secret in (CLIENT_SECRET, session_cookie, bob_key, alice_key, me_bob["csrf"]):
        assert secret not in text
    assert "bob@example.test signed in to the status page as member" in text

    # -- `hub usage --by person` reads the same ledger from the store --------------------
    result = await _hub_cli(["usage", "--data", str(tmp_path / "hub"), "--by", "person"])
    lines = result.splitlines()
    assert lines[1].split()[:3] == ["PERSON", "EMAIL", "MODEL"]
    found = {line.split()[0]: line.split() for line in lines[2:]}
    assert found["bob"][1] == "bob@example.test" and found["bob"][3] == "2"
    assert found["alice"][3] == "1"


async def _hub_cli(argv: list[str]) -> str:
    """``alp-gateway hub ARGV`` in a thread (it runs trio itself); its stdout."""
    import contextlib
    import io

    from gateway.hub.cli import main as hub_main

    out = io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out):
            return hub_main(argv)

    status = await trio.to_thread.run_sync(run)
    assert status == 0, out.getvalue()
    return out.getvalue()


async def test_tampered_state_or_nonce_is_refused(tmp_path: Path) -> None:
    async with oidc_hub(tmp_path) as setup, _client() as browser:
        base = setup.base
        # -- a callback whose state is not the one this browser started with ------------
        resp = await browser.get(base + "/auth/login")
        back = await sign_in_at_provider(browser, resp.headers["location"], "alice")
        parts = urlsplit(back)
        query = query_of(back)
        query["state"] = query["state"][:-2] + ("AA" if not query["state"].endswith("AA") else "BB")
        tampered = urlunsplit(parts._replace(query=urlencode(query)))
        resp = await browser.get(tampered)
        assert resp.status_code == 400
        assert "state does not match" in resp.json()["error"]["message"]
        assert "alp_session" not in resp.headers.get("set-cookie", "")
        assert (await browser.get(base + "/auth/me")).json()["signedIn"] is False

        # -- a callback without the browser's login cookie (another browser's code) -----
        async with _client() as other:
            resp = await other.get(back)
            assert resp.status_code == 400
            assert "no sign-in was started" in resp.json()["error"]["message"]

        # -- a nonce changed on the way to the provider: the ID token carries another -----
        browser.cookies.clear()
        resp = await browser.get(base + "/auth/login")
        authorize = resp.headers["location"]
        parts = urlsplit(authorize)
        query = query_of(authorize)
        query["nonce"] = "an-attackers-nonce-0123456789"
        back = await sign_in_at_provider(
            browser, urlunsplit(parts._replace(query=urlencode(query))), "alice"
        )
        resp = await browser.get(back)
        assert resp.status_code == 401
        assert "nonce" in resp.json()["error"]["message"]
        assert (await browser.get(base + "/auth/me")).json()["signedIn"] is False

        # -- the untampered flow signs in (the refusals above were for their reason) -----
        browser.cookies.clear()
        me = await sign_in(browser, base, "alice")
        assert me["role"] == "admin"


async def test_under_tls_the_sign_in_cookies_are_secure(tmp_path: Path) -> None:
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    cert, key, ca_file = tmp_path / "hub.pem", tmp_path / "hub.key", tmp_path / "ca.pem"
    cert.write_bytes(b"".join(pem.bytes() for pem in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    serve = {"certfile": cert, "keyfile": key}
    async with (
        oidc_hub(tmp_path, serve) as setup,
        httpx.AsyncClient(timeout=STEP, verify=ssl.create_default_context(cafile=ca_file)) as tls,
    ):
        assert setup.base.startswith("https://")
        resp = await tls.get(setup.base + "/auth/login")
        assert "; Secure" in resp.headers["set-cookie"]
        assert query_of(resp.headers["location"])["redirect_uri"].startswith("https://")
        back = await sign_in_at_provider(tls, resp.headers["location"], "bob")
        resp = await tls.get(back)
        assert resp.status_code == 303
        session = [c for c in resp.headers.get_list("set-cookie") if c.startswith("alp_session=")]
        assert len(session) == 1
        assert all(part in session[0] for part in ("; Secure", "; HttpOnly", "; SameSite=Lax"))


async def test_id_token_signed_by_another_key_or_for_another_client_is_refused(
    tmp_path: Path,
) -> None:
    """The ID token's checks one by one, on tokens made here against the provider's real
    discovery document and JWKS: a forged signature (the provider's key id, another key), a
    token for another client, an expired one, an unsigned one."""
    async with oidc_hub(tmp_path) as setup:
        oidc = setup.hub.people.oidc
        assert oidc is not None
        disco = await oidc.discovery()
        keys = (await httpx.AsyncClient().get(disco.jwks_uri)).json()["keys"]
        kid = keys[0]["kid"]
        forger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        now = int(time.time())
        claims = {
            "iss": setup.issuer,
            "aud": CLIENT_ID,
            "sub": "mallory",
            "iat": now,
            "exp": now + 300,
            "nonce": "n-123",
        }

        def forged(**changes: Any) -> str:
            return jwt.encode({**claims, **changes}, forger, "RS256", headers={"kid": kid})

        with pytest.raises(OidcError, match="signature"):
            await oidc.verify(forged(), "n-123", disco)
        unsigned = (
            base64.urlsafe_b64encode(json.dumps({"alg": "none", "kid": kid}).encode()).decode()
            + "."
            + base64.urlsafe_b64encode(json.dumps(claims).encode()).decode()
            + "."
        ).replace("=", "")
        with pytest.raises(OidcError, match="algorithm"):
            await oidc.verify(unsigned, "n-123", disco)
        hs = jwt.encode(claims, CLIENT_SECRET, "HS256", headers={"kid": kid})
        with pytest.raises(OidcError, match="algorithm"):
            await oidc.verify(hs, "n-123", disco)
        other = jwt.encode(claims, forger, "RS256", headers={"kid": "not-the-providers"})
        with pytest.raises(OidcError, match="JWKS does not hold"):
            await oidc.verify(other, "n-123", disco)
        # -- a key the hub trusts (as if the issuer's JWKS held it): each claim checked --------
        numbers = forger.public_key().public_numbers()
        oidc._jwks = ({"k-test": rsa_lib.PublicKey(numbers.n, numbers.e)}, math.inf)

        def signed(alg: str = "RS256", header_alg: str | None = None, **changes: Any) -> str:
            token = jwt.encode({**claims, **changes}, forger, alg, headers={"kid": "k-test"})
            if header_alg is None:
                return token
            head, body, sig = token.split(".")
            header = {"alg": header_alg, "kid": "k-test", "typ": "JWT"}
            new_head = base64.urlsafe_b64encode(json.dumps(header).encode()).decode()
            return ".".join([new_head.rstrip("="), body, sig])

        assert (await oidc.verify(signed(), "n-123", disco))["sub"] == "mallory"
        for token, nonce, words in (
            (signed(exp=now - 3600), "n-123", "expired"),
            (signed(aud="another-client"), "n-123", "aud"),
            (signed(iss="https://elsewhere.example"), "n-123", "iss"),
            (signed(), "n-other", "nonce"),
            (signed(nonce=None), "n-123", "nonce"),
            (signed("RS512", header_alg="RS256"), "n-123", "signature"),  # its hash, not RS256's
            (signed()[:-4] + "AAAA", "n-123", "signature"),
        ):
            with pytest.raises(OidcError, match=words):
                await oidc.verify(token, nonce, disco)
    assert Login.from_cookie("a.b") is None and Login.from_cookie("a.b.c") == Login("a", "b", "c")


async def test_without_oidc_the_sign_in_routes_are_absent_and_a_cookie_is_nothing() -> None:
    async with open_hub(Hub(admin_token=ADMIN)) as (_hub, base), _client() as client:
        assert (await client.get(base + "/auth/me")).json() == {"oidc": False, "signedIn": False}
        assert (await client.get(base + "/auth/login")).status_code == 404
        client.cookies.set("alp_session", "A" * 43)
        assert (await client.get(base + "/api/hub/keys")).status_code == 401
        resp = await client.get(
            base + "/api/hub/keys", headers={"authorization": f"Bearer {ADMIN}"}
        )
        assert resp.status_code == 200


def test_oidc_settings_go_together() -> None:
    from gateway.config import ConfigError, load_hub_settings

    with pytest.raises(ConfigError, match="go together"):
        load_hub_settings({"oidc_issuer": "https://id.example"}, {})
    settings = load_hub_settings(
        {"oidc_issuer": "https://id.example/", "oidc_client_id": "hub"},
        {"ALP_GATEWAY_HUB_OIDC_CLIENT_SECRET": "s3cret-from-env"},
    )
    assert settings.oidc_issuer == "https://id.example"
    assert settings.oidc_client_secret == "s3cret-from-env"
    assert "s3cret" not in repr(settings)


def test_a_client_secret_file_that_cannot_be_read_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.hub.cli import main as hub_main

    base = ["--data", str(tmp_path / "hub"), "--listen", "127.0.0.1:0"]
    oidc = ["--oidc-issuer", "https://id.example", "--oidc-client-id", "alp-hub"]
    missing = tmp_path / "no-such-secret"
    assert hub_main([*base, *oidc, "--oidc-client-secret-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("alp-gateway hub: error: ") and str(missing) in err
    assert err.count("\n") == 1 and "Traceback" not in err
    empty = tmp_path / "empty-secret"
    empty.write_text("\n")
    assert hub_main([*base, *oidc, "--oidc-client-secret-file", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err == f"alp-gateway hub: error: the OIDC client secret file {empty} is empty\n"


async def test_a_session_checked_on_a_store_that_fails_answers_503(tmp_path: Path) -> None:
    hub = Hub(
        tmp_path / "hub",
        admin_token=ADMIN,
        oidc_issuer="http://127.0.0.1:9",  # never reached: no sign-in starts here
        oidc_client_id=CLIENT_ID,
    )
    async with open_hub(hub) as (_, base), _client() as client:
        client.cookies.set("alp_session", "A" * 43)
        assert (await client.get(base + "/api/hub/keys")).status_code == 401  # no such session
        await hub.store.close()  # as a database that went away
        for path in ("/api/hub/keys", "/auth/me"):
            resp = await client.get(base + path)
            assert resp.status_code == 503, path
            assert resp.json()["error"]["code"] == "store_unavailable"


async def test_a_session_made_on_one_replica_is_good_on_another(
    pg_url: str, tmp_path: Path
) -> None:
    """Two replicas on one PostgreSQL store behind no balancer: a person signs in through
    one, and the other honours the session (the store keeps it), makes their key, and signs
    them out for both."""
    from test_replicas import replicas

    port = free_port()
    issuer = f"http://127.0.0.1:{port}"
    settings = {
        "oidc_issuer": issuer,
        "oidc_client_id": CLIENT_ID,
        "oidc_client_secret": CLIENT_SECRET,
        "oidc_admin_group": ADMIN_GROUP,
        "oidc_member_projects": (MEMBER_PROJECT,),
    }
    async with replicas(pg_url, 2, **settings) as (r0, r1):
        base0, base1 = r0.url, r1.url
        callbacks = [base0 + "/auth/callback", base1 + "/auth/callback"]
        async with open_provider(port, callbacks, tmp_path), _client() as bob:
            me = await sign_in(bob, base0, "bob")
            other = (await bob.get(base1 + "/auth/me")).json()
            assert other["signedIn"] is True and other["sub"] == "bob"
            assert other["csrf"] == me["csrf"]
            resp = await bob.post(
                base1 + "/api/hub/keys",
                json={"name": "bob-team", "project": MEMBER_PROJECT},
                headers={"x-csrf-token": me["csrf"]},
            )
            assert resp.status_code == 201
            mine = (await bob.get(base0 + "/api/hub/keys")).json()["keys"]
            assert [k["name"] for k in mine] == ["bob-team"]
            cookie = bob.cookies.get("alp_session")
            resp = await bob.post(base1 + "/auth/logout", headers={"x-csrf-token": me["csrf"]})
            assert resp.status_code == 200
            async with httpx.AsyncClient(
                timeout=STEP, cookies=httpx.Cookies({"alp_session": cookie})
            ) as replay:
                assert (await replay.get(base0 + "/auth/me")).json()["signedIn"] is False
                assert (await replay.get(base0 + "/api/hub/keys")).status_code == 401
