"""A real OpenID provider for the sign-in tests: node-oidc-provider (tests/support/oidc/provider.mjs) on
loopback, and a person signing in through it without a browser (its own login form posted).

The package comes from npm (.ci/run installs it into .ci/node/; ``ALP_OIDC_NODE_MODULES`` names
another node_modules). Skipped where node or the package is missing; under ``CI=true`` that
fails (CI must run these tests)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urljoin, urlsplit

import httpx
import pytest
import trio

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "oidc" / "provider.mjs"
CLIENT_ID = "alp-hub"
CLIENT_SECRET = "oidc-client-secret-for-tests-7f3a"
ADMIN_GROUP = "hub-admins"
ACCOUNTS = {
    "alice": {"email": "alice@example.test", "name": "Alice Admin", "groups": [ADMIN_GROUP]},
    "bob": {"email": "bob@example.test", "name": "Bob Member", "groups": ["staff"]},
}
STEP = 20  # s: each step at most


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"the OpenID provider is needed under CI=true: {reason}", pytrace=False)
    pytest.skip(f"no OpenID provider: {reason}")


def node_modules() -> Path:
    """Where oidc-provider is installed (skips, or fails under CI, without it)."""
    found = Path(os.environ.get("ALP_OIDC_NODE_MODULES") or ROOT / ".ci" / "node" / "node_modules")
    if shutil.which("node") is None:
        _missing("no node on PATH")
    if not (found / "oidc-provider" / "package.json").is_file():
        _missing(f"oidc-provider is not installed in {found} (npm install oidc-provider)")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Provider:
    issuer: str
    process: trio.Process


@asynccontextmanager
async def open_provider(port: int, redirect_uris: list[str], tmp: Path) -> AsyncIterator[Provider]:
    """oidc-provider serving on ``127.0.0.1:port`` until the block ends."""
    modules = node_modules()
    config = tmp / "oidc-provider.json"
    config.write_text(
        json.dumps(
            {
                "port": port,
                "client_id": CLIENT_ID,
                "client_secret": CLIENT_SECRET,
                "redirect_uris": redirect_uris,
                "accounts": ACCOUNTS,
            }
        )
    )
    process = await trio.lowlevel.open_process(
        ["node", str(SCRIPT), str(modules), str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        seen = b""
        with trio.fail_after(STEP):
            while b"listening on" not in seen:
                chunk = await process.stdout.receive_some(4096)
                if not chunk:
                    raise AssertionError("oidc-provider ended before it served")
                seen += chunk
        yield Provider(f"http://127.0.0.1:{port}", process)
    finally:
        process.terminate()
        with trio.move_on_after(5):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


_FORM = re.compile(r'<form[^>]*action="([^"]+)"[^>]*method="post"', re.I)


async def sign_in_at_provider(client: httpx.AsyncClient, authorize_url: str, login: str) -> str:
    """``login`` signs in at the provider's own form, starting from ``authorize_url``; the URL
    the provider sends the browser back to (the hub's callback, with code and state)."""
    resp = await client.get(authorize_url)
    while resp.status_code in (302, 303) and "/interaction/" in resp.headers["location"]:
        resp = await client.get(urljoin(str(resp.url), resp.headers["location"]))
    assert resp.status_code == 200, resp.text[:300]
    action = _FORM.search(resp.text)
    assert action is not None, resp.text[:500]
    resp = await client.post(
        urljoin(str(resp.url), action.group(1)), data={"prompt": "login", "login": login}
    )
    while resp.status_code in (302, 303):
        target = urljoin(str(resp.url), resp.headers["location"])
        if "/auth/callback" in urlsplit(target).path:
            return target
        resp = await client.get(target)
    raise AssertionError(f"the provider did not send the browser back: {resp.status_code}")


def query_of(url: str) -> dict[str, Any]:
    return {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
