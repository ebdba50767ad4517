"""Several backends: their configuration, model routing and aliases, the allowlist, concurrency
limits with a bounded queue, health probes with failover, and the example configuration."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import (
    BACKEND_KEY,
    LogCapture,
    Turns,
    open_chat,
    request_frame,
    runner_config,
    running,
    send,
    start_killable_sim,
)

from gateway.config import SETTINGS, BackendSpec, Config, ConfigError, load_config
from gateway.hub import Hub
from gateway.runner.backend import Backend, BackendBusy, BackendError
from gateway.runner.backends import BackendPool
from gateway.sim import SimOptions, Simulator, open_sim, serve_sim
from gateway.wire.protocol import CAPABILITY

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config" / "alp-gateway.example.toml"


def body(model: str | None = None, **extra: Any) -> bytes:
    payload: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        **extra,
    }
    if model is not None:
        payload["model"] = model
    return json.dumps(payload).encode()


@asynccontextmanager
async def pool_of(*backends: Backend, **kwargs: Any) -> AsyncIterator[BackendPool]:
    pool = BackendPool(list(backends), kwargs.pop("default_model", None), **kwargs)
    try:
        yield pool
    finally:
        await pool.aclose()


# -- configuration -------------------------------------------------------------------------------


def test_backend_tables_aliases_and_limits(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text(
        'allowed_models = ["qwen2.5:7b", "gpt-4o-mini"]\nhealth_interval = 5\nmodels_refresh = 60\n'
        '[[backend]]\nname = "gpu"\nurl = "http://10.0.0.2:8000/v1/"\nkey_env = "GPU_KEY"\n'
        'models = ["qwen2.5:7b"]\nmax_concurrency = 4\nqueue = 8\n'
        '[[backend]]\nname = "ollama"\nurl = "http://127.0.0.1:11434/v1"\nkey = "sk-inline-1234"\n'
        '[aliases]\n"gpt-4o-mini" = "qwen2.5:7b"\n'
    )
    env = {
        "GPU_KEY": "sk-from-env-5678",
        "CHAT_LLM_BACKEND_URL": "http://127.0.0.1:1234/v1",
        "CHAT_LLM_BACKEND_KEY": "sk-shortcut-9999",
    }
    config = load_config({}, env, toml)
    assert [b.name for b in config.backends] == ["default", "gpu", "ollama"]  # the shortcut first
    default, gpu, ollama = config.backends
    assert default.url == "http://127.0.0.1:1234/v1" and default.key == "sk-shortcut-9999"
    assert gpu.url == "http://10.0.0.2:8000/v1" and gpu.key == "sk-from-env-5678"
    assert gpu.models == ("qwen2.5:7b",) and gpu.max_concurrency == 4 and gpu.queue == 8
    assert ollama.key == "sk-inline-1234" and ollama.models == () and ollama.max_concurrency is None
    assert ollama.queue == 16
    assert config.aliases == {"gpt-4o-mini": "qwen2.5:7b"}
    assert config.allowed_models == ("qwen2.5:7b", "gpt-4o-mini")
    assert config.health_interval == 5.0 and config.models_refresh == 60.0
    assert config.backend == ("http://127.0.0.1:1234/v1",)
    assert config.backend_key == "sk-shortcut-9999"
    for secret in ("sk-from-env-5678", "sk-inline-1234", "sk-shortcut-9999"):
        assert secret not in repr(config)
    defaults = load_config({}, {})
    assert defaults.backends == () and defaults.aliases == {} and defaults.allowed_models == ()
    assert defaults.health_interval == 30.0 and defaults.models_refresh == 300.0
    env_list = load_config({}, {"ALP_GATEWAY_ALLOWED_MODELS": "a, b,a"})
    assert env_list.allowed_models == ("a", "b")


def test_shortcut_backend_follows_backend_field() -> None:
    config = Config(backend="http://127.0.0.1:1/v1", backend_key="k-1234")
    assert config.backends == (
        BackendSpec("default", "http://127.0.0.1:1/v1", "k-1234", shortcut=True),
    )
    moved = replace(config, backend="http://127.0.0.1:2/v1")
    assert [b.url for b in moved.backends] == ["http://127.0.0.1:2/v1"]
    assert replace(config, backend=None).backends == ()
    extra = BackendSpec("gpu", "http://127.0.0.1:3/v1")
    both = replace(config, backends=(extra,))
    assert [b.name for b in both.backends] == ["default", "gpu"]


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[[backend]]\nname = "gpu"\n', "missing url"),
        (
            '[[backend]]\nname = "gpu"\nurl = "http://x:1/v1"\nkey_env = "NOPE_UNSET"\n',
            "NOPE_UNSET, which is not set",
        ),
        (
            '[[backend]]\nurl = "http://x:1/v1"\nkey = "sk-secret-77"\nkey_env = "K"\n',
            "key or key_env, not both",
        ),
        ('[[backend]]\nurl = "http://x:1/v1"\nmodel = "m"\n', "unknown setting(s) model"),
        ('[[backend]]\nurl = "http://x:1/v1"\nmax_concurrency = 0\n', "max_concurrency"),
        ('[[backend]]\nurl = "http://x:1/v1"\nqueue = -1\n', "queue"),
        ('[[backend]]\nurl = "ftp://x"\n', "http(s) URL"),
        ('[[backend]]\nurl = "http://x:1/v1"\nmodels = "m"\n', "list of model ids"),
        (
            '[[backend]]\nname = "a"\nurl = "http://x:1/v1"\n[[backend]]\nname = "a"\nurl = "http://y:1/v1"\n',
            "used twice",
        ),
        ('[backend]\nurl = "http://x:1/v1"\n', "[[backend]]"),
        ('[aliases]\n"a" = "b"\n"b" = "c"\n', "alias too"),
        ('[aliases]\n"a" = 3\n', "must name a local model"),
    ],
)
def test_backend_config_errors_are_one_line(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config({}, {"K": "sk-env-secret-88"}, path)
    text = str(info.value)
    assert message in text and "\n" not in text
    assert "sk-secret-77" not in text and "sk-env-secret-88" not in text


def test_shortcut_and_table_named_default_clash(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[[backend]]\nname = "default"\nurl = "http://x:1/v1"\n')
    assert [b.name for b in load_config({}, {}, path).backends] == ["default"]
    with pytest.raises(ConfigError, match="used twice"):
        load_config({"backend": "http://y:2/v1"}, {}, path)


def test_example_config_loads_and_documents_every_setting() -> None:
    config = load_config({}, {"VLLM_API_KEY": "sk-vllm-example"}, EXAMPLE)
    assert [b.name for b in config.backends] == ["gpu", "ollama"]
    assert config.backends[0].key == "sk-vllm-example" and config.backends[0].max_concurrency == 8
    assert config.aliases and config.allowed_models and config.project == "acme/chat"
    text = EXAMPLE.read_text()
    missing = [
        s.key for s in SETTINGS if f"\n{s.key} = " not in text and f"\n# {s.key} = " not in text
    ]
    assert not missing, f"document these settings in {EXAMPLE.name}: {missing}"
    with pytest.raises(ConfigError, match="VLLM_API_KEY"):
        load_config({}, {}, EXAMPLE)


# -- routing ------------------------------------------------------------------------------------


async def test_route_by_model_alias_and_frame_model() -> None:
    async with open_sim(models=["a-model"]) as a, open_sim(models=["b-model", "shared"]) as b:
        async with pool_of(
            Backend(a.url, name="a"),
            Backend(b.url, name="b"),
            aliases={"gpt-4o-mini": "b-model"},
            default_model="a-model",
        ) as pool:
            route = await pool.route(None, body("a-model"))
            assert [x.name for x in route.candidates] == ["a"] and route.body == body("a-model")
            route = await pool.route(None, body())  # no model anywhere: the default
            assert route.model == "a-model" and json.loads(route.body)["model"] == "a-model"
            route = await pool.route("gpt-4o-mini", body("a-model"))  # the frame's model wins
            assert route.requested == "gpt-4o-mini" and route.model == "b-model"
            assert [x.name for x in route.candidates] == ["b"]
            assert json.loads(route.body)["model"] == "b-model"  # the backend gets the local name
            assert sorted(await pool.models()) == ["a-model", "b-model", "gpt-4o-mini", "shared"]
            with pytest.raises(BackendError) as info:
                await pool.route(None, body("gpt-5"))
            assert "'gpt-5' is not available" in str(info.value)
            assert "a-model, b-model, shared, gpt-4o-mini" in str(info.value)
        assert a.streams == [] and b.streams == []  # nothing of a refused turn reached a backend


async def test_model_pulled_since_discovery_is_found() -> None:
    async with open_sim(models=["one"]) as sim, pool_of(Backend(sim.url, name="s")) as pool:
        await pool.refresh_models()
        sim.models.append("two")
        route = await pool.route(None, body("two"))
        assert route.model == "two" and route.candidates[0].models == ("one", "two")


async def test_allowlist_on_turns_and_models() -> None:
    async with open_sim(models=["a-model", "b-model", "c-model"]) as sim:
        async with pool_of(
            Backend(sim.url, name="s"),
            aliases={"gpt-4o-mini": "c-model"},
            allowed_models=["a-model", "gpt-4o-mini"],
        ) as pool:
            assert await pool.models() == ["a-model", "gpt-4o-mini"]
            with pytest.raises(BackendError) as info:
                await pool.route(None, body("b-model"))
            assert (
                str(info.value)
                == "model 'b-model' is not allowed on this runner; allowed: a-model, gpt-4o-mini"
            )
            route = await pool.route(None, body("gpt-4o-mini"))
            assert route.model == "c-model"
            with pytest.raises(BackendError, match="without a model is not allowed"):
                await pool.route(None, body())
        assert sim.streams == []


async def test_single_backend_without_model_list_forwards_anyway() -> None:
    async with (
        open_sim(require_key="sk-needed-1234") as sim,
        pool_of(Backend(sim.url, name="only")) as pool,
    ):
        route = await pool.route(None, body("anything"))  # discovery failed (401): forward as ever
        assert [b.name for b in route.candidates] == ["only"]
        assert pool.backends[0].discovery_error == "answered 401"
    async with open_sim(require_key="sk-needed-1234") as s1, open_sim() as s2:
        async with pool_of(Backend(s1.url, name="x"), Backend(s2.url, name="y")) as pool:
            with pytest.raises(BackendError, match="not available"):  # two backends: no guessing
                await pool.route(None, body("anything"))


# -- concurrency ---------------------------------------------------------------------------------


async def test_slots_are_granted_first_come_first_served_and_queue_is_bounded(
    logs: LogCapture,
) -> None:
    async with (
        open_sim() as sim,
        pool_of(Backend(sim.url, name="gpu", max_concurrency=2, queue=2)) as pool,
    ):
        backend = pool.backends[0]
        route = await pool.route(None, body("sim-model"))
        order: list[str] = []
        release = {name: trio.Event() for name in ("t1", "t2", "t3", "t4")}

        async def turn(name: str) -> None:
            async with pool.turn(route, "job", name):
                order.append(name)
                await release[name].wait()

        async with trio.open_nursery() as nursery:
            for name in ("t1", "t2"):
                nursery.start_soon(turn, name)
                await backend.wait_until(lambda b, name=name: name in order)
            for name, waiting in (("t3", 1), ("t4", 2)):
                nursery.start_soon(turn, name)
                await backend.wait_until(lambda b, n=waiting: b.waiting == n)
            assert order == ["t1", "t2"] and backend.in_flight == 2 and backend.waiting == 2
            with pytest.raises(BackendBusy) as info:
                async with pool.turn(route, "job", "t5"):
                    pass
            assert str(info.value) == "backend gpu is busy (2 in flight, 2 waiting)"
            release["t2"].set()
            await backend.wait_until(lambda b: "t3" in order)
            release["t1"].set()
            await backend.wait_until(lambda b: "t4" in order)
            assert order == ["t1", "t2", "t3", "t4"]
            release["t3"].set()
            release["t4"].set()
        assert backend.in_flight == 0 and backend.waiting == 0
        assert backend.waits_total == 2 and backend.busy_total == 1 and backend.turns_total == 4
        assert backend.waited_seconds_total > 0
        waits = [line for line in logs.lines if "waiting for backend gpu" in line]
        assert len(waits) == 2 and "request t3" in waits[0] and "job job" in waits[0]


async def test_cancelled_waiter_leaves_the_queue() -> None:
    async with (
        open_sim() as sim,
        pool_of(Backend(sim.url, name="gpu", max_concurrency=1, queue=1)) as pool,
    ):
        backend = pool.backends[0]
        route = await pool.route(None, body("sim-model"))
        done = trio.Event()

        async def hold() -> None:
            async with pool.turn(route, "job", "first"):
                await done.wait()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold)
            await backend.wait_until(lambda b: b.in_flight == 1)
            with trio.CancelScope() as scope:

                async def cancel_when_queued() -> None:
                    await backend.wait_until(lambda b: b.waiting == 1)
                    scope.cancel()

                nursery.start_soon(cancel_when_queued)
                async with pool.turn(route, "job", "second"):
                    pytest.fail("the waiter was not cancelled")
            assert backend.waiting == 0 and backend.in_flight == 1
            done.set()
        assert backend.in_flight == 0


async def test_busy_backend_through_the_runner(
    hub: tuple[Hub, str], tmp_path: Path, logs: LogCapture
) -> None:
    async with open_sim(options=SimOptions(chunks=200, interval=0.02)) as sim:
        spec = BackendSpec("gpu", sim.url, models=("sim-model",), max_concurrency=1, queue=1)
        config = runner_config(hub[1], None, tmp_path, backends=(spec,))
        async with running(config) as runner:
            backend = runner.pool.backends[0]
            job, ch = await open_chat(hub[0])
            turns = Turns(ch)
            await send(ch, request_frame(job.id, "r1"))
            await (await sim.wait_for_streams(1)).wait_sent(1)
            await send(ch, request_frame(job.id, "r2", sim={"chunks": 2, "interval": 0}))
            with trio.fail_after(5):
                await backend.wait_until(lambda b: b.waiting == 1)
            await send(ch, request_frame(job.id, "r3"))
            await turns.until("r3", errors={"r3"})
            assert turns.last("r3")["error"] == "backend gpu is busy (1 in flight, 1 waiting)"
            await send(ch, {"type": "chat.completion.cancel", "jobId": job.id, "requestId": "r1"})
            await turns.until("r1", "r2", errors={"r1"})
            assert turns.last("r1")["error"] == "cancelled"
            assert turns.last("r2")["type"] == "chat.completion.done"
            assert len(sim.streams) == 2  # r3 never reached the backend
    assert any(f"job {job.id} request r2: waiting for backend gpu" in line for line in logs.lines)


# -- health --------------------------------------------------------------------------------------


async def test_failover_to_another_backend_serving_the_model(
    hub: tuple[Hub, str], tmp_path: Path, logs: LogCapture
) -> None:
    async with open_sim(models=["m"]) as good, trio.open_nursery() as nursery:
        doomed, kill = await start_killable_sim(nursery, models=["m"])
        specs = (
            BackendSpec("first", doomed.url, models=("m",)),
            BackendSpec("second", good.url, models=("m",)),
        )
        config = runner_config(
            hub[1], None, tmp_path, backends=specs, model="m", health_interval=3600
        )
        async with running(config) as runner:
            first, second = runner.pool.backends
            assert first.up and runner.capabilities() == [CAPABILITY]
            job, ch = await open_chat(hub[0])
            kill.cancel()  # "first" dies; the runner has not noticed yet
            await send(ch, request_frame(job.id, "t", sim={"chunks": 3}))
            turns = Turns(ch)
            await turns.until("t")
            assert turns.last("t")["type"] == "chat.completion.done"  # served by "second"
            assert len(good.streams) == 1
            with trio.fail_after(5):
                await first.wait_until(lambda b: not b.up)  # probed right after the failed connect
            assert "unreachable" in (first.down_reason or "")
            assert runner.capabilities() == [CAPABILITY]  # "second" is up
            await send(ch, request_frame(job.id, "u", sim={"chunks": 1}))
            await turns.until("u")
            assert turns.last("u")["type"] == "chat.completion.done" and len(good.streams) == 2
            await send(ch, {"type": "chat.models.request", "jobId": job.id, "requestId": "m"})
            await turns.until("m")
            assert turns.last("m")["models"] == ["m"]
    assert sum("backend first" in line and "is down" in line for line in logs.lines) == 1
    assert all(BACKEND_KEY not in line for line in logs.lines)


async def test_capability_follows_backend_health(
    hub: tuple[Hub, str], tmp_path: Path, logs: LogCapture
) -> None:
    sim_scope = trio.CancelScope()

    async def serve(task_status: trio.TaskStatus[Simulator] = trio.TASK_STATUS_IGNORED) -> None:
        with sim_scope:
            await serve_sim(models=["m"], task_status=task_status)

    async with trio.open_nursery() as nursery:
        sim: Simulator = await nursery.start(serve)
        spec = BackendSpec("box", sim.url, models=("m",))
        config = runner_config(
            hub[1],
            None,
            tmp_path,
            backends=(spec,),
            model="m",
            health_interval=0.1,
            poll_interval=0.2,
        )
        async with running(config) as runner:
            backend = runner.pool.backends[0]
            assert runner.capabilities() == [CAPABILITY]
            sim_scope.cancel()  # the model server goes away
            with trio.fail_after(5):
                await backend.wait_until(lambda b: not b.up)
            assert runner.capabilities() == []
            polls = runner.counters.get("polls")
            job = await hub[0].board.enqueue(
                "acme", "chat", ["chat-llm:v1"], {"jobType": "chat_llm"}
            )
            with trio.fail_after(5):
                await runner.counters.wait("polls", polls + 2)
            assert job.claimed_by is None  # nothing is advertised while no backend is up
            async with open_sim(port=sim.port, models=["m"]) as back:  # ... and comes back
                with trio.fail_after(5):
                    await backend.wait_until(lambda b: b.up)
                assert runner.capabilities() == [CAPABILITY]
                ch = await hub[0].channels.wait(job.id, 10)
                assert ch is not None
                await send(ch, request_frame(job.id, "x", sim={"chunks": 1}))
                turns = Turns(ch)
                await turns.until("x")
                assert turns.last("x")["type"] == "chat.completion.done" and len(back.streams) == 1
    down = [line for line in logs.lines if "backend box" in line and "is down" in line]
    up = [line for line in logs.lines if "backend box" in line and "is up again" in line]
    assert len(down) == 1 and len(up) == 1


async def test_models_response_lists_only_servable_models(
    hub: tuple[Hub, str], tmp_path: Path
) -> None:
    async with open_sim(models=["a", "b"]) as live:
        async with open_sim(models=["c"]) as dead:
            specs = (BackendSpec("live", live.url), BackendSpec("dead", dead.url, models=("c",)))
            config = runner_config(
                hub[1],
                None,
                tmp_path,
                backends=specs,
                model="a",
                aliases={"alias-a": "a", "alias-c": "c", "alias-b": "b"},
                allowed_models=("a", "alias-b", "alias-c", "c"),
            )
        async with running(config) as runner:
            live_b, dead_b = runner.pool.backends
            await runner.pool.refresh_models()
            assert live_b.models == ("a", "b")
            await runner.pool.probe(dead_b)
            assert not dead_b.up
            job, ch = await open_chat(hub[0])
            await send(ch, {"type": "chat.models.request", "jobId": job.id, "requestId": "m"})
            await send(ch, request_frame(job.id, "t", model="c"))
            turns = Turns(ch)
            await turns.until("m", "t", errors={"t"})
            # a: allowed; b: not allowed, but its alias is; alias-a: target allowed; c: backend down
            assert turns.last("m")["models"] == ["a", "alias-a", "alias-b"]
            assert "unreachable" in turns.last("t")["error"]  # the only backend serving c is down


async def test_backend_unreachable_error_names_url_and_not_key(
    hub: tuple[Hub, str], tmp_path: Path
) -> None:
    async with trio.open_nursery() as nursery:
        sim, kill = await start_killable_sim(nursery)
        url = sim.url
        spec = BackendSpec("gone", url, key="sk-gone-secret-4321", models=("sim-model",))
        async with running(
            runner_config(hub[1], None, tmp_path, backends=(spec,), health_interval=3600)
        ):
            job, ch = await open_chat(hub[0])
            kill.cancel()
            await send(ch, request_frame(job.id, "x"))
            turns = Turns(ch)
            await turns.until("x", errors={"x"})
            error = turns.last("x")["error"]
            assert url in error and "sk-gone-secret-4321" not in error


async def test_no_model_and_no_default_uses_the_only_model(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    async with running(runner_config(hub[1], sim.url, tmp_path, model=None)):
        job, ch = await open_chat(hub[0])
        await send(ch, request_frame(job.id, "one", sim={"chunks": 2}))  # the body names no model
        turns = Turns(ch)
        await turns.until("one")
        assert turns.last("one")["type"] == "chat.completion.done"
        assert json.loads(sim.streams[-1].body)["model"] == "sim-model"
