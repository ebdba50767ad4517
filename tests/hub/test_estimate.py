"""Prompt estimates that count the chat template (issue 35, point 5): a turn whose backend said
no usage is charged its prompt estimated as its characters / 4 plus each message's template
tokens and the answer's opening, marked estimated. A real hub on loopback, the fake runner
(tests/support/fake_runner.py) answering without usage, trio's autojump clock."""

from __future__ import annotations

import math

import httpx
import trio
import trio.testing
from fake_runner import Script
from test_causes import GUARD, OWNER, PROJECT
from test_key_limits import served

from gateway.hub.frontdoor.shapes import MESSAGE_TOKENS, REPLY_TOKENS

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello"},
]


async def test_a_turn_without_usage_is_charged_its_template_too_marked_estimated(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scripts = {"silent": Script(usage=False)}
    async with served(scripts=scripts) as (hub, url, _runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        body = {"model": "silent", "messages": MESSAGES, "stream": True}
        with trio.fail_after(GUARD):
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                reply = await http.post(
                    "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )
            await ended.count(1)
            (row,) = await hub.store.usage_rows()
    assert reply.status_code == 200
    chars = len("You are terse.") + len("Hello")
    # 5 for the text, 2 messages' roles and delimiters (10), the answer's opening (3): 18,
    # where characters / 4 alone said 5
    assert (MESSAGE_TOKENS, REPLY_TOKENS) == (5, 3)
    assert row["prompt_tokens"] == math.ceil(chars / 4) + 2 * MESSAGE_TOKENS + REPLY_TOKENS == 18
    assert row["estimated"] is True
