"""The health and metrics server of a real runner (hub + simulator on loopback), and `alp-gateway status`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from faultproxy import fault_proxy
from helpers import EXE, Turns, clean_env, open_chat, request_frame, runner_config, running, send
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import ConfigError, load_config
from gateway.hub import Hub
from gateway.observe import Counters, Histogram
from gateway.ops.status import Reading, Samples, default_url, summary
from gateway.runner.metrics import CONTENT_TYPE, render
from gateway.runner.snapshot import BackendStatus, HistogramStatus, RunnerSnapshot, safe_url
from gateway.runner.supervisor import Runner, RunnerExit
from gateway.sim import Simulator, open_sim

LOOPBACK_ANY_PORT = ("127.0.0.1", 0)


def metrics_url(runner: Runner) -> str:
    assert runner.metrics is not None
    return runner.metrics.url


async def get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        return await client.get(url)


def families(text: str) -> dict[str, Any]:
    """Parsed with prometheus_client's reference parser."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict[str, Any], family: str, sample: str | None = None, **labels: str) -> float:
    for s in fams[family].samples:
        if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise AssertionError(f"no sample {sample or family} {labels} in {family}")


# -- settings ------------------------------------------------------------------------------


def test_metrics_listen_setting() -> None:
    assert load_config({}, {}).metrics_listen is None  # off by default
    assert load_config({"metrics_listen": "9464"}, {}).metrics_listen == ("127.0.0.1", 9464)
    assert load_config({}, {"ALP_GATEWAY_METRICS_LISTEN": "0.0.0.0:9100"}).metrics_listen == (
        "0.0.0.0",
        9100,
    )
    assert load_config({"metrics_listen": "[::1]:9464"}, {}).metrics_listen == ("::1", 9464)
    with pytest.raises(ConfigError, match="--metrics-listen"):
        load_config({"metrics_listen": "localhost:http"}, {})


def test_status_default_url() -> None:
    assert default_url({}) == "http://127.0.0.1:9464"
    assert default_url({"ALP_GATEWAY_METRICS_LISTEN": "9100"}) == "http://127.0.0.1:9100"
    assert default_url({"ALP_GATEWAY_METRICS_LISTEN": "0.0.0.0:9100"}) == "http://127.0.0.1:9100"
    assert default_url({"ALP_GATEWAY_METRICS_URL": "http://box:1/"}) == "http://box:1"


# -- health and rendering without a network -------------------------------------------------


def snapshot(
    *, age: float | None = 1.0, backends: list[BackendStatus] | None = None, **more: Any
) -> RunnerSnapshot:
    """A RunnerStatus as a runner would take it: the readers' only input, no runner needed."""
    return RunnerSnapshot(
        max_sessions=8,
        poll_interval=10.0,
        last_poll_age=age,
        last_poll_error=None
        if age is not None and age < 30
        else "POST …/runners/jobs: Server answered 503",
        backends=[BackendStatus("default", "http://127.0.0.1:1/v1")]
        if backends is None
        else backends,
        **more,
    )


def test_health_rules() -> None:
    assert snapshot().health() == (True, "ok")
    ok, reason = snapshot(age=None).health()
    assert not ok and reason.startswith("no successful poll yet")
    ok, reason = snapshot(age=31).health()
    assert not ok and "last successful poll 31" in reason and "503" in reason
    down = BackendStatus("gpu", safe_url("http://u:secret@127.0.0.1:1/v1"), up=False)
    assert snapshot(backends=[down]).health() == (False, "no backend is up: gpu")
    assert snapshot(backends=[down, BackendStatus("cpu", "x")]).health() == (True, "ok")
    assert snapshot(backends=[]).health() == (False, "no backend configured")
    assert snapshot(shutting_down=True).health() == (False, "shutting down")


def test_snapshot_is_read_only() -> None:
    counters = Counters()
    counters.inc("chunks")
    status = snapshot(counters=counters.values)
    counters.inc("chunks")
    assert status.counters["chunks"] == 1  # a copy, not a view of the runner's counters
    frozen: Any = status
    with pytest.raises(AttributeError):
        frozen.counters = {}  # a frozen dataclass
    counts: Any = status.counters
    with pytest.raises(TypeError):
        counts["chunks"] = 5  # a read-only mapping


def test_render_backends_and_histogram_buckets() -> None:
    backends = [
        BackendStatus(
            "gpu",
            safe_url("http://user:pw@10.0.0.2:8000/v1"),
            up=False,
            in_flight=3,
            waiting=2,
            turns=7,
            waits=4,
            waited_seconds=1.5,
            busy=1,
        ),
        BackendStatus("plain", "http://127.0.0.1:11434/v1"),
    ]
    hist = Histogram()
    for seconds in (0.0001, 0.3, 0.3, 99.0):
        hist.observe(seconds)
    text = render(
        snapshot(
            backends=backends,
            counters={"turns_done": 2, "something_new": 1, "reports_lost": 3},
            histograms={"ttft_seconds": HistogramStatus.of(hist)},
        )
    )
    assert "pw" not in text  # a credential in a backend URL is not exposed
    fams = families(text)
    assert value(fams, "alp_gateway_backend_up", backend="gpu") == 0
    assert value(fams, "alp_gateway_backend_in_flight", backend="gpu") == 3
    assert value(fams, "alp_gateway_backend_waiting", backend="gpu") == 2
    for name, expected in (("turns", 7), ("waits", 4), ("wait_seconds", 1.5), ("busy", 1)):
        family = f"alp_gateway_backend_{name}"
        assert value(fams, family, family + "_total", backend="gpu") == expected
        assert value(fams, family, family + "_total", backend="plain") == 0
    assert (
        value(fams, "alp_gateway_backend_up", backend="plain", url="http://127.0.0.1:11434/v1") == 1
    )
    assert value(fams, "alp_gateway_turns", "alp_gateway_turns_total", outcome="done") == 2
    assert value(fams, "alp_gateway_turns", "alp_gateway_turns_total", outcome="error") == 0
    assert value(fams, "alp_gateway_something_new", "alp_gateway_something_new_total") == 1
    reports = ("alp_gateway_final_reports", "alp_gateway_final_reports_total")
    assert value(fams, *reports, outcome="lost") == 3
    assert value(fams, *reports, outcome="success") == 0
    ttft = fams["alp_gateway_ttft_seconds"]
    assert ttft.type == "histogram"
    buckets = [(s.labels["le"], s.value) for s in ttft.samples if s.name.endswith("_bucket")]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts)  # cumulative
    assert dict(buckets)["0.0005"] == 1 and dict(buckets)["0.25"] == 1 and dict(buckets)["0.5"] == 3
    assert (
        buckets[-1] == ("+Inf", 4)
        and value(fams, "alp_gateway_ttft_seconds", "alp_gateway_ttft_seconds_count") == 4
    )


# -- a real runner ----------------------------------------------------------------------------


async def test_healthz_and_metrics_count_a_served_turn(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    config = runner_config(hub[1], sim.url, tmp_path / "state", metrics_listen=LOOPBACK_ANY_PORT)
    async with running(config) as runner:
        url = metrics_url(runner)
        assert url.startswith("http://127.0.0.1:")
        resp = await get(url + "/healthz")
        assert (resp.status_code, resp.text) == (200, "ok\n")
        assert (await get(url + "/livez")).status_code == 200

        job, ch = await open_chat(hub[0])
        await send(ch, request_frame(job.id, "r1", sim={"chunks": 5}))
        turns = Turns(ch)
        await turns.until("r1")
        with trio.fail_after(5):
            await runner.counters.wait("turns_done", 1)
        chunks = len(turns.chunks("r1"))

        resp = await get(url + "/metrics")
        assert resp.status_code == 200 and resp.headers["content-type"] == CONTENT_TYPE
        fams = families(resp.text)
        assert value(fams, "alp_gateway_turns", "alp_gateway_turns_total", outcome="done") == 1
        assert value(fams, "alp_gateway_turns", "alp_gateway_turns_total", outcome="error") == 0
        assert value(fams, "alp_gateway_chunks", "alp_gateway_chunks_total") == chunks >= 6
        assert value(fams, "alp_gateway_sessions_open") == 1
        assert (
            value(fams, "alp_gateway_sessions_started", "alp_gateway_sessions_started_total") == 1
        )
        assert value(fams, "alp_gateway_polls", "alp_gateway_polls_total") >= 1
        assert value(fams, "alp_gateway_healthy") == 1
        assert value(fams, "alp_gateway_ttft_seconds", "alp_gateway_ttft_seconds_count") == 1
        assert value(fams, "alp_gateway_relay_seconds", "alp_gateway_relay_seconds_count") >= 1
        assert value(fams, "alp_gateway_backend_up", backend="default") == 1
        assert value(fams, "alp_gateway_info", version=__import__("gateway").__version__) == 1
        # nothing secret in the exposition
        assert config.backend_key and config.backend_key not in resp.text
        assert runner.registration is not None and runner.registration.token not in resp.text


async def test_healthz_503_while_polls_fail_then_200_again(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    async with fault_proxy(hub[1]) as proxy:  # a Server whose polls fail
        config = runner_config(
            proxy.url,
            sim.url,
            tmp_path / "state",
            metrics_listen=LOOPBACK_ANY_PORT,
            poll_interval=0.1,
        )
        async with running(config) as runner:
            url = metrics_url(runner) + "/healthz"
            assert (await get(url)).status_code == 200
            proxy.faults["poll"] = [503] * 1000
            errors = runner.counters.get("poll_errors")
            with trio.fail_after(15):
                while (resp := await get(url)).status_code == 200:  # each failed poll moves time on
                    errors += 1
                    await runner.counters.wait("poll_errors", errors)
            assert resp.status_code == 503
            assert "last successful poll" in resp.text and "503" in resp.text
            ready = await get(metrics_url(runner) + "/readyz")  # the readiness probe's name
            assert ready.status_code == 503 and "last successful poll" in ready.text
            assert (await get(metrics_url(runner) + "/livez")).status_code == 200  # not restarted
            proxy.faults["poll"] = []
            with trio.fail_after(15):
                while (resp := await get(url)).status_code != 200:
                    await runner.counters.wait("polls", runner.counters.get("polls") + 1)
            assert resp.text == "ok\n"


async def test_http_edges(hub: tuple[Hub, str], sim: Simulator, tmp_path: Path) -> None:
    config = runner_config(hub[1], sim.url, tmp_path / "state", metrics_listen=LOOPBACK_ANY_PORT)
    async with running(config) as runner, httpx.AsyncClient(timeout=5, trust_env=False) as client:
        url = metrics_url(runner)
        assert (await client.get(url + "/nope")).status_code == 404
        assert (await client.post(url + "/metrics", content=b"x")).status_code == 405
        head = await client.head(url + "/metrics")
        assert (
            head.status_code == 200
            and head.content == b""
            and int(head.headers["content-length"]) > 100
        )
        assert (await client.get(url + "/healthz?verbose=1")).status_code == 200
        # a client that connects and says nothing does not block the others
        async with await trio.open_tcp_stream(runner.metrics.host, runner.metrics.port):
            assert (await client.get(url + "/healthz")).status_code == 200


async def test_busy_metrics_port_fails_the_start(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    try:
        config = runner_config(
            hub[1], sim.url, tmp_path / "state", metrics_listen=("127.0.0.1", port)
        )
        with pytest.raises(RunnerExit, match=f"--metrics-listen 127.0.0.1:{port}") as caught:
            with trio.fail_after(10):
                await Runner(config).run()
        assert caught.value.code == 2
    finally:
        for listener in listeners:
            await listener.aclose()


async def test_off_by_default(hub: tuple[Hub, str], sim: Simulator, tmp_path: Path) -> None:
    async with running(runner_config(hub[1], sim.url, tmp_path / "state")) as runner:
        assert runner.metrics is None


# -- alp-gateway status ---------------------------------------------------------------------


async def status(*args: str) -> tuple[int, str, str]:
    env = clean_env()
    with trio.fail_after(30):
        result = await trio.run_process(
            [EXE, "status", *args], env=env, capture_stdout=True, capture_stderr=True, check=False
        )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def test_status_command(hub: tuple[Hub, str], sim: Simulator, tmp_path: Path) -> None:
    config = runner_config(hub[1], sim.url, tmp_path / "state", metrics_listen=LOOPBACK_ANY_PORT)
    async with running(config) as runner:
        job, ch = await open_chat(hub[0])
        await send(ch, request_frame(job.id, "r1", sim={"chunks": 3}))
        await Turns(ch).until("r1")
        with trio.fail_after(5):
            await runner.counters.wait("turns_done", 1)
        url = metrics_url(runner)
        code, out, err = await status("--metrics-url", url, "--rate")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].startswith("alp-gateway ") and url in lines[0]
        assert "healthy: ok" in out
        assert "1 open (max 64), 1 started, 0 ended" in out
        assert "1 done, 0 error, 0 cancelled" in out
        assert "/s over the last" in out
        assert "first token p50 ≤" in out and "(1 samples)" in out
        assert any(
            line.split()[1:3] == ["default", "up"] for line in lines if line.startswith("backends")
        )
        assert len(lines) <= 24  # one screen
        assert config.backend_key not in out

        runner.pool.backends[0].mark("down")  # what a failed health check records
        code, out, _ = await status("--metrics-url", url)
        assert code == 1 and "NOT HEALTHY (503): no backend is up" in out and "DOWN" in out
        runner.pool.backends[0].mark(None)
    code, _, err = await status("--metrics-url", url)  # runner gone: nothing answers
    assert code == 2 and "is not answering" in err


async def test_status_after_a_turn_answered_whole_says_what_is_timed(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """Issue 31 point 12: after a non-streamed turn, ``status`` said ``first token no samples
    yet`` as if nothing had been served; it says that only streamed turns are timed."""
    config = runner_config(hub[1], sim.url, tmp_path / "state", metrics_listen=LOOPBACK_ANY_PORT)
    async with running(config) as runner:
        job, ch = await open_chat(hub[0])
        await send(ch, request_frame(job.id, "whole", sim={"chunks": 3}, stream=False))
        await Turns(ch).until("whole")
        with trio.fail_after(5):
            await runner.counters.wait("turns_done", 1)
        code, out, err = await status("--metrics-url", metrics_url(runner))
    assert code == 0, err
    assert "no samples yet" not in out, out
    assert "first token timed on streamed turns only: none yet (1 done)" in out, out


def test_samples_parser_reads_what_render_writes() -> None:
    text = (
        'alp_gateway_backend_up{backend="a \\"b\\"",url="x"} 1\n'
        "# HELP x y\n"
        "alp_gateway_chunks_total 7\n"
    )
    samples = Samples.parse(text)
    assert samples.get("backend_up", backend='a "b"') == 1 and samples.get("chunks_total") == 7


def test_status_reads_back_the_snapshot_that_metrics_rendered() -> None:
    hist = Histogram()
    for seconds in (0.002, 0.3, 40.0):
        hist.observe(seconds)
    sent = snapshot(
        sessions_open=2,
        backends=[BackendStatus("gpu", "http://10.0.0.2:8000/v1", up=False, in_flight=1)],
        counters={"turns_done": 3, "turns_error": 1, "chunks": 70, "pings_sent": 4},
        histograms={"ttft_seconds": HistogramStatus.of(hist)},
    )
    back = Samples.parse(render(sent)).snapshot()
    assert back.sessions_open == 2 and back.max_sessions == sent.max_sessions
    assert back.last_poll_age == sent.last_poll_age and back.version == sent.version
    assert [(b.name, b.url, b.up, b.in_flight) for b in back.backends] == [
        ("gpu", "http://10.0.0.2:8000/v1", False, 1)
    ]
    # every counter comes back, a new one (pings_sent) included
    assert {k: v for k, v in back.counters.items() if v} == sent.counters
    assert back.histograms["ttft_seconds"] == sent.histograms["ttft_seconds"]
    assert back.histograms["ttft_seconds"].quantile(0.5) == 0.5
    assert back.histograms["ttft_seconds"].quantile(0.99) == float("inf")


def test_keepalive_counters_in_metrics_and_status() -> None:
    """Pings sent, pong timeouts and channels declared dead: always in /metrics (0 before the
    first), with the ping interval, and on the `status` screen."""
    fams = families(render(snapshot()))
    for name in ("pings_sent", "pong_timeouts", "channels_dead"):
        assert value(fams, f"alp_gateway_{name}", f"alp_gateway_{name}_total") == 0
    assert value(fams, "alp_gateway_ping_interval_seconds") == 0
    counters = {"pings_sent": 41, "pong_timeouts": 2, "channels_dead": 2, "reconnects": 2}
    text = render(snapshot(ping_interval=20.0, counters=counters))
    fams = families(text)
    assert value(fams, "alp_gateway_pings_sent", "alp_gateway_pings_sent_total") == 41
    assert value(fams, "alp_gateway_pong_timeouts", "alp_gateway_pong_timeouts_total") == 2
    assert value(fams, "alp_gateway_channels_dead", "alp_gateway_channels_dead_total") == 2
    assert value(fams, "alp_gateway_ping_interval_seconds") == 20
    back = Samples.parse(text).snapshot()
    assert back.ping_interval == 20.0 and back.counters["channels_dead"] == 2
    out = summary("http://x", Reading(200, "ok", Samples.parse(text), 0.0))
    assert (
        "keepalive   ping every 20 s: 41 pings sent, 2 pong timeouts, 2 channels dead"
        in out.splitlines()
    )
    off = summary("http://x", Reading(200, "ok", Samples.parse(render(snapshot())), 0.0))
    assert "keepalive   pings off: 0 pings sent, 0 pong timeouts, 0 channels dead" in off


async def test_status_against_something_that_is_not_a_runner() -> None:
    """A simulator answers 404 on /metrics: said as such, not as 'not answering
    (HTTPStatusError)'."""
    async with open_sim() as sim:
        root = sim.url.removesuffix("/v1")
        code, out, err = await status("--metrics-url", root)
    assert code == 2 and out == "", err
    assert err.strip() == (
        f"alp-gateway status: {root}/metrics answered 404: something listens there, but it is "
        "not an alp-gateway runner's metrics port; give the address of the runner's "
        "--metrics-listen (--metrics-url or ALP_GATEWAY_METRICS_URL)"
    )
    with trio.socket.socket() as s:  # a port nothing listens on
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = await status("--metrics-url", f"http://127.0.0.1:{port}")
    assert code == 2 and (
        f"is not answering (connection refused by 127.0.0.1:{port}: nothing listens there)" in err
    ), err


def test_status_prints_what_the_runner_said_escaped() -> None:
    """Issue 30, row 6: the health text and the backends' names and URLs come from the process
    at --metrics-url; a terminal gets them escaped (``gateway.logsafe``), one line each."""
    evil = "gpu\x1b]0;pwned\x07\r\nhealth      healthy: forged"
    text = render(snapshot(backends=[BackendStatus(evil, "http://x/v1\x1b[2J", up=True)]))
    out = summary("http://x", Reading(503, "down\x1b[2J\nforged", Samples.parse(text), 0.0))
    lines = out.split("\n")
    assert all(line.isprintable() for line in lines), out
    assert [line for line in lines if line.startswith("health ")] == [
        "health      NOT HEALTHY (503): down\\x1b[2J\\nforged"
    ]
    assert any("gpu\\x1b]0;pwned\\x07\\r\\nhealth" in line for line in lines)


async def test_status_takes_the_metrics_address_from_the_runners_config_file(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """``alp-gateway status --config FILE`` with no --metrics-url asks the address the runner's
    ``metrics_listen`` in that file binds, not 127.0.0.1:9464 (issue 37, point 5)."""
    config = runner_config(hub[1], sim.url, tmp_path / "state", metrics_listen=LOOPBACK_ANY_PORT)
    async with running(config) as runner:
        listen = metrics_url(runner).removeprefix("http://")
        toml = tmp_path / "runner.toml"
        toml.write_text(f'metrics_listen = "{listen}"\n')
        assert default_url({}, toml) == f"http://{listen}"
        with trio.fail_after(60):
            done = await trio.run_process(
                [EXE, "status", "--config", str(toml)],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env=clean_env(),
            )
    assert done.returncode == 0, done.stderr
    said = done.stdout.decode()
    assert f"at http://{listen}\n" in said and "healthy: ok" in said
