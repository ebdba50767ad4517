"""Sessions placed by model (issue 31, point 1), on trio's autojump clock: a real hub on loopback
and two fake runners of one project, one serving ``sim-model`` and one ``slow-model``. Every new
session's job goes only to the runner that serves its model, a later turn for a model its
runner lacks moves the session, and ``/v1/models`` is the union of the runners' lists, steady
(from its first read). The status page shows an idle runner's models and forgets a runner long
gone (issue 31, point 12)."""

from __future__ import annotations

from typing import Any

import httpx
import trio
import trio.testing
from fake_runner import FakeRunner
from test_causes import ADMIN, GUARD, OWNER, PROJECT, chat, hub_of

from gateway.hub import open_hub
from gateway.hub.snapshot import FORGET_DOWN_AFTER


async def test_new_sessions_go_only_to_the_runner_that_serves_their_model_and_models_are_steady(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of()) as (hub, url), trio.open_nursery() as runners:
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        fakes: dict[str, FakeRunner] = {}
        for name, model in (("a", "sim-model"), ("b", "slow-model")):
            fake = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT, models=(model,), name=name)
            fakes[model] = fake
            await runners.start(fake.run)
        wrong = 0
        with trio.fail_after(GUARD):
            for n in range(100):
                model = ("sim-model", "slow-model")[n % 2]
                reply = await chat(url, key, f"s{n}", model=model)
                assert reply.status_code == 200, reply.text
                other = fakes["slow-model" if model == "sim-model" else "sim-model"]
                wrong += sum(t.body.get("model") == model for t in other.turns.values())
            listings: list[Any] = []
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                for _ in range(20):
                    found = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                    listings.append(sorted(m["id"] for m in found.json()["data"]))
        runners.cancel_scope.cancel()
    assert wrong == 0  # no turn ever reached a runner that does not serve its model
    assert listings == [["sim-model", "slow-model"]] * 20  # the union, on every read


async def test_a_later_turn_for_a_model_its_runner_lacks_moves_the_session(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of()) as (hub, url), trio.open_nursery() as runners:
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        a = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT, models=("sim-model",), name="a")
        b = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT, models=("slow-model",), name="b")
        await runners.start(a.run)
        await runners.start(b.run)
        with trio.fail_after(GUARD):
            assert (await chat(url, key, "s", model="sim-model")).status_code == 200
            (first,) = a.claimed
            moved = await chat(url, key, "s", model="slow-model")
            assert moved.status_code == 200, moved.text
            back = await chat(url, key, "s", model="slow-model")
        runners.cancel_scope.cancel()
    assert back.status_code == 200
    assert [t.body["model"] for t in a.turns.values()] == ["sim-model"]
    assert [t.body["model"] for t in b.turns.values()] == ["slow-model", "slow-model"]
    # (b may have taken the first session's job before its list was known, and left it)
    assert hub.sessions.listing()[("k", "s")] == b.claimed[-1]
    assert (first, "its runner does not serve slow-model") in a.ends


async def test_the_first_models_read_is_the_union_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two runners whose lists are not known yet, one slower to answer: the first read of
    ``/v1/models`` waits for both, instead of answering with the first runner's list."""
    async with open_hub(hub_of()) as (hub, url), trio.open_nursery() as runners:
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        a = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT, models=("sim-model",), name="a")
        b = FakeRunner(
            url,
            ADMIN,
            owner=OWNER,
            project=PROJECT,
            models=("slow-model",),
            name="b",
            poll_interval=1.0,  # it claims its listing job a second after a does
        )
        await runners.start(a.run)
        await runners.start(b.run)
        listings: list[list[str]] = []
        with trio.fail_after(GUARD):
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                for _ in range(3):
                    found = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                    listings.append(sorted(m["id"] for m in found.json()["data"]))
        runners.cancel_scope.cancel()
    assert listings == [["sim-model", "slow-model"]] * 3


async def runners_shown(url: str) -> list[dict[str, Any]]:
    """The status page's runners (``/api/hub/runners``), on a connection of its own."""
    auth = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=url, timeout=GUARD, headers=auth) as admin:
        found: list[dict[str, Any]] = (await admin.get("/api/hub/runners")).json()["runners"]
    return found


async def test_the_status_page_shows_an_idle_runners_models_and_forgets_a_runner_long_gone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A runner with no session yet: the first read of the runners asks it for its models, so
    that the page shows them (not "not listed yet"); a runner silent for FORGET_DOWN_AFTER
    leaves the list (it is not kept as "down" for ever)."""
    async with open_hub(hub_of()) as (hub, url):
        a = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT, models=("sim-model",), name="a")
        async with trio.open_nursery() as runners:
            await runners.start(a.run)  # its registration was a sign of life: it is up
            with trio.fail_after(60):  # virtual seconds (the runner polls every 0.02 s)
                await runners_shown(url)
                while hub.catalog.of_runner(str(a.runner_id)) is None:
                    await hub.catalog.answered.wait()
            [shown] = await runners_shown(url)
            runners.cancel_scope.cancel()
        autojump_clock.jump(FORGET_DOWN_AFTER / 2)
        [down] = await runners_shown(url)
        autojump_clock.jump(FORGET_DOWN_AFTER)
        gone = await runners_shown(url)
    assert (shown["models"], shown["up"]) == (["sim-model"], True)
    assert (down["id"], down["up"]) == (a.runner_id, False)
    assert gone == []


async def test_a_session_keeps_its_runner_for_a_model_it_serves_but_had_not_listed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Runner a listed only sim-model when its channel opened, then began to serve slow-model
    too (a model pulled since); runner b lists slow-model. The session on a asking for
    slow-model asks a for its list again and stays (issue 37, point 2: no ``chat.end … does
    not serve`` churn when its runner serves both)."""
    async with open_hub(hub_of()) as (hub, url), trio.open_nursery() as runners:
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        a = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT, models=("sim-model",), name="a")
        await runners.start(a.run)
        with trio.fail_after(GUARD):
            assert (await chat(url, key, "s", model="sim-model")).status_code == 200
            b = FakeRunner(
                url, ADMIN, owner=OWNER, project=PROJECT, models=("slow-model",), name="b"
            )
            await runners.start(b.run)
            listed = await chat(url, key, "other", model="slow-model")  # b is known to list it
            assert listed.status_code == 200, listed.text
            a.models.append("slow-model")  # served by a from now on; the hub has not asked
            for n in range(4):
                model = ("slow-model", "sim-model")[n % 2]
                assert (await chat(url, key, "s", model=model)).status_code == 200
        runners.cancel_scope.cancel()
    assert [t.body["model"] for t in a.turns.values()] == ["sim-model", "slow-model"] * 2 + [
        "sim-model"
    ]
    assert [t.body["model"] for t in b.turns.values()] == ["slow-model"]  # the other session's
    assert a.ends == [] and len(a.claimed) == 1  # the session's job never left a
    assert hub.sessions.listing()[("k", "s")] == a.claimed[0]


async def test_an_unknown_model_is_404_at_once_beside_a_runner_that_withdrew_its_capability(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 36, point 1: one live runner serving ``sim-model``, and one that stopped (its last
    poll withdrew chat-llm:v1; its models never listed): a model nobody lists is 404
    ``model_not_found`` at once, not a wait for the stopped runner (``runner_wait_timeout``,
    here so long that waiting would show) ending in 503 "no runner connected within"."""
    async with open_hub(hub_of()) as (hub, url), trio.open_nursery() as runners:
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        a = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT, models=("sim-model",), name="a")
        await runners.start(a.run)
        base = f"/api/owners/{OWNER}/projects/{PROJECT}"
        async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
            reply = await http.post(
                f"{base}/runners",
                json={"name": "stopped"},
                headers={"Authorization": f"Bearer {ADMIN}"},
            )
            token = reply.json()["token"]
            auth = {"Authorization": f"Bearer {token}"}
            for capabilities in (["chat-llm:v1"], []):  # served, then stopped: withdrawn
                polled = await http.post(
                    f"{base}/runners/jobs", json={"capabilities": capabilities}, headers=auth
                )
                assert polled.status_code in (200, 204), polled.text
        with trio.fail_after(GUARD):
            asked_at = trio.current_time()
            unknown = await chat(url, key, "s", model="no-such-model")
            took = trio.current_time() - asked_at
            served = await chat(url, key, "t", model="sim-model")
        runners.cancel_scope.cancel()
    print(f"no-such-model: {unknown.status_code} in {took:.3f} s")
    assert unknown.status_code == 404, unknown.text
    assert unknown.json()["error"]["code"] == "model_not_found" and took < 1.0
    assert "sim-model" in unknown.json()["error"]["message"]
    assert served.status_code == 200


async def test_a_model_only_a_stopped_runner_lists_waits_for_it_then_names_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 36, point 1: runner b served ``slow-model`` and stopped (its last poll withdrew
    chat-llm:v1), runner a (``sim-model``) is connected: a turn for ``slow-model`` waits for b,
    bounded by ``runner_wait_timeout``, then 503 naming the model and b, never "no runner
    connected" while a is."""
    async with open_hub(hub_of(runner_wait_timeout=5.0)) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with trio.open_nursery() as runners:
            a = FakeRunner(
                url, ADMIN, owner=OWNER, project=PROJECT, models=("sim-model",), name="a"
            )
            await runners.start(a.run)
            async with trio.open_nursery() as only_b:
                b = FakeRunner(
                    url, ADMIN, owner=OWNER, project=PROJECT, models=("slow-model",), name="b"
                )
                await only_b.start(b.run)
                with trio.fail_after(GUARD):
                    assert (await chat(url, key, "s", model="slow-model")).status_code == 200
                    (job_id,) = b.claimed
                    await b.end_session(job_id)  # b stops cleanly: its session ended, reported
                    await (await hub.board.all_jobs.get(job_id)).completed.wait()
                only_b.cancel_scope.cancel()
            base = f"/api/owners/{OWNER}/projects/{PROJECT}"
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                farewell = await http.post(  # b's last poll: the capability withdrawn
                    f"{base}/runners/jobs",
                    json={"capabilities": []},
                    headers={"Authorization": f"Bearer {b.token}"},
                )
                assert farewell.status_code in (200, 204)
            with trio.fail_after(GUARD):
                asked_at = trio.current_time()
                waited = await chat(url, key, "t", model="slow-model")
                took = trio.current_time() - asked_at
            runners.cancel_scope.cancel()
    print(f"slow-model: {waited.status_code} after {took:.1f} s: {waited.json()}")
    error = waited.json()["error"]
    assert waited.status_code == 503 and 5.0 <= took < 6.0
    assert "'slow-model'" in error["message"] and "runner b" in error["message"]
    assert "no runner" not in error["message"]
