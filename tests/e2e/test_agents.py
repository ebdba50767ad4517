"""The two coding agents, unchanged, from npm, against the hub (issue 19, point 5): Claude Code
(``claude -p``) over ``/v1/messages`` and Codex CLI (``codex exec``) over ``/v1/responses``, each
through hub → runner → simulator on loopback, each printing the simulator's answer.

The agents run as subprocesses with a throwaway HOME (and CLAUDE_CONFIG_DIR / CODEX_HOME), a
minimal environment (no proxy, no API variables of this machine) and the settings that keep them
off the network; between them and the hub sits a tap that keeps both directions of every
connection, so a test can say exactly what an agent sent and what the hub answered.

Where they come from: ``npm install --prefix .ci/node`` at the versions below (``.ci/run`` does
it), or ``ALP_AGENTS_BIN``: a directory holding ``claude`` and ``codex``. Without them the tests
skip, saying how to install them; under ``CI=true`` they fail instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import pytest
import trio
from helpers import BACKEND_KEY, OWNER, PROJECT, runner_config, running

from gateway.hub import Hub, open_hub
from gateway.sim import SimOptions, open_sim

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.332"
CODEX = "@openai/codex@0.171.0"
INSTALL = f"npm install --prefix .ci/node {CLAUDE_CODE} {CODEX}"
PROJECT_BIN = Path(__file__).resolve().parents[2] / ".ci" / "node" / "node_modules" / ".bin"
ANSWER = "tok0 tok1 tok2 tok3 tok4"  # the simulator's answer (SimOptions(chunks=5))
WITHIN = 120.0  # seconds for one agent run (each takes about 1 s here; a cold start is slower)


def agent(name: str) -> Path:
    """The agent's executable: in ``ALP_AGENTS_BIN``, else in the project's ``.ci/node``."""
    where = os.environ.get("ALP_AGENTS_BIN")
    path = (Path(where) if where else PROJECT_BIN) / name
    if path.is_file() and os.access(path, os.X_OK):
        return path
    reason = (
        f"no {name} at {path}: install the agents with `{INSTALL}` "
        "(or set ALP_AGENTS_BIN to a directory holding claude and codex)"
    )
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"the coding agents are required under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def claude() -> Path:
    """Claude Code's ``claude`` (a sync fixture: a skip inside a trio test loses its reason)."""
    return agent("claude")


@pytest.fixture
def codex() -> Path:
    return agent("codex")


# -- the tap: what the agent sent, what the hub answered --------------------------------------


@dataclass
class Exchange:
    """One HTTP request an agent sent and the hub's answer (status None: none came)."""

    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    status: int | None = None
    answer: bytes = b""

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def __str__(self) -> str:
        return f"{self.method} {self.target} -> {self.status} {self.answer[:400]!r}"


@dataclass
class Connection:
    sent: bytearray = field(default_factory=bytearray)  # agent → hub
    answered: bytearray = field(default_factory=bytearray)  # hub → agent


def _event(conn: h11.Connection) -> Any:
    event = conn.next_event()
    return None if event is h11.NEED_DATA or event is h11.PAUSED else event


def exchanges_of(connection: Connection) -> list[Exchange]:
    """The HTTP/1.1 exchanges of one connection in order, read with h11 (both sides)."""
    server, client = h11.Connection(h11.SERVER), h11.Connection(h11.CLIENT)
    server.receive_data(bytes(connection.sent))
    client.receive_data(bytes(connection.answered))
    out: list[Exchange] = []
    while isinstance(request := _event(server), h11.Request):
        body = bytearray()
        while isinstance(event := _event(server), h11.Data):
            body += event.data
        headers = {k.decode(): v.decode("latin-1") for k, v in request.headers}
        exchange = Exchange(request.method.decode(), request.target.decode(), headers, bytes(body))
        out.append(exchange)
        if not isinstance(event, h11.EndOfMessage):
            break
        # the client side is told the same request, so that it reads the answer to it
        framing = (b"content-length", b"transfer-encoding")
        kept = [(k, v) for k, v in request.headers if k not in framing]
        kept.append((b"content-length", str(len(body)).encode()))
        client.send(h11.Request(method=request.method, target=request.target, headers=kept))
        if body:
            client.send(h11.Data(data=bytes(body)))
        client.send(h11.EndOfMessage())
        response = _event(client)
        while isinstance(response, h11.InformationalResponse):
            response = _event(client)
        if not isinstance(response, h11.Response):
            break
        exchange.status = response.status_code
        answer = bytearray()
        while isinstance(event := _event(client), h11.Data):
            answer += event.data
        exchange.answer = bytes(answer)
        if not isinstance(event, h11.EndOfMessage):
            break
        server.send(h11.Response(status_code=response.status_code, headers=[]))
        server.send(h11.EndOfMessage())
        if server.our_state is not h11.DONE or client.our_state is not h11.DONE:
            break
        server.start_next_cycle()
        client.start_next_cycle()
    return out


class Tap:
    """A loopback TCP proxy in front of the hub keeping both directions of each connection."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.connections: list[Connection] = []
        self.port = 0

    def exchanges(self) -> list[Exchange]:
        return [exchange for c in self.connections for exchange in exchanges_of(c)]

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, agent_side: trio.SocketStream) -> None:
        record = Connection()
        self.connections.append(record)
        async with agent_side:
            try:
                hub_side = await trio.open_tcp_stream("127.0.0.1", self.target_port)
            except OSError:
                return
            async with hub_side, trio.open_nursery() as nursery:

                async def pump(
                    src: trio.SocketStream, dst: trio.SocketStream, keep: bytearray
                ) -> None:
                    try:
                        while data := await src.receive_some(65536):
                            keep += data
                            await dst.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    nursery.cancel_scope.cancel()

                nursery.start_soon(pump, agent_side, hub_side, record.sent)
                nursery.start_soon(pump, hub_side, agent_side, record.answered)


# -- hub + runner + simulator, and one agent run ------------------------------------------------


@dataclass
class Setup:
    hub: Hub
    hub_url: str  # the hub itself
    url: str  # the tap in front of it: what the agent is given
    key: str
    tap: Tap


@asynccontextmanager
async def whole_path(tmp_path: Path, **hub_settings: Any) -> AsyncIterator[Setup]:
    """A simulator (5 chunks), a hub (``hub_settings``), a runner, and the tap before the hub."""
    async with open_sim(require_key=BACKEND_KEY, options=SimOptions(chunks=5)) as sim:
        async with open_hub(Hub(runner_wait_timeout=10, **hub_settings)) as (hub, url):
            config = runner_config(url, sim.url, tmp_path / "state", user_token=hub.admin_token)
            async with running(config), trio.open_nursery() as nursery:
                tap = await nursery.start(Tap(int(url.rsplit(":", 1)[1])).serve)
                key = await hub.keys.create("agents", f"{OWNER}/{PROJECT}")
                yield Setup(hub, url, f"http://127.0.0.1:{tap.port}", key, tap)
                nursery.cancel_scope.cancel()


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    exchanges: list[Exchange]

    def report(self) -> str:
        lines = [f"exit {self.returncode}", f"stdout: {self.stdout[-2000:]}"]
        lines.append(f"stderr: {self.stderr[-3000:]}")
        lines += [f"  {exchange}" for exchange in self.exchanges]
        return "\n".join(lines)


def base_env(tmp_path: Path) -> dict[str, str]:
    """A minimal environment: this PATH (node), a throwaway HOME; no proxy, no API variables.
    Makes the agent's working directory too (``tmp_path / "work"``, not a git repository)."""
    (tmp_path / "work").mkdir()
    home = tmp_path / "home"
    home.mkdir()
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8"}


async def run_agent(path: Setup, argv: list[str], env: dict[str, str], cwd: Path) -> Run:
    """The agent as a subprocess in ``cwd`` (made by the caller), stdin closed, within
    ``WITHIN`` seconds (killed after)."""
    with trio.fail_after(WITHIN):
        done = await trio.run_process(
            argv, stdin=b"", capture_stdout=True, capture_stderr=True, check=False, env=env, cwd=cwd
        )
    return Run(
        done.returncode,
        done.stdout.decode(errors="replace"),
        done.stderr.decode(errors="replace"),
        path.tap.exchanges(),
    )


def served(run: Run, route: str) -> list[Exchange]:
    """The turns on ``route`` the hub answered with 200; every exchange answered below 400."""
    refused = [exchange for exchange in run.exchanges if (exchange.status or 0) >= 400]
    assert not refused, f"the hub refused what the agent sent:\n{run.report()}"
    turns = [e for e in run.exchanges if e.path == route and e.status == 200]
    assert turns, f"no {route} turn was served:\n{run.report()}"
    return turns


# -- Claude Code ---------------------------------------------------------------------------------


def claude_env(tmp_path: Path, path: Setup, **models: str) -> dict[str, str]:
    env = base_env(tmp_path)
    env.update(
        ANTHROPIC_BASE_URL=path.url,
        ANTHROPIC_API_KEY=path.key,
        CLAUDE_CONFIG_DIR=str(tmp_path / "home" / ".claude"),
        # nothing but the turns: no telemetry, error reports, update checks or other traffic
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
        **models,
    )
    return env


async def test_claude_code_prints_the_simulators_answer(tmp_path: Path, claude: Path) -> None:
    """``claude -p`` with ANTHROPIC_MODEL (and its small/fast model) set to the runner's model."""
    async with whole_path(tmp_path) as path:
        models = {
            name: "sim-model"
            for name in (
                "ANTHROPIC_MODEL",
                "ANTHROPIC_SMALL_FAST_MODEL",
                "ANTHROPIC_DEFAULT_HAIKU_MODEL",
            )
        }
        env = claude_env(tmp_path, path, **models)
        run = await run_agent(path, [str(claude), "-p", "say hi"], env, tmp_path / "work")
        sessions = path.hub.sessions.listing()
    assert run.returncode == 0 and ANSWER in run.stdout, run.report()
    turns = served(run, "/v1/messages")
    for turn in turns:
        sent = json.loads(turn.body)
        assert sent["model"] == "sim-model" and turn.headers["x-api-key"] == path.key
        # its own session header (docs/hub.md "Sessions"): the hub's session for it
        assert ("agents", turn.headers["x-claude-code-session-id"]) in sessions
        assert b'"text_delta","text":"tok0 "' in turn.answer  # streamed, Anthropic's events


async def test_claude_code_with_the_hubs_default_model(tmp_path: Path, claude: Path) -> None:
    """``claude -p`` asking for its own claude-* model, served by the hub's default_model, on a
    fresh hub (it learns the runners' model lists first, on the first such request)."""
    async with whole_path(tmp_path, default_model="sim-model") as path:
        env = claude_env(tmp_path, path)
        run = await run_agent(path, [str(claude), "-p", "say hi"], env, tmp_path / "work")
    assert run.returncode == 0 and ANSWER in run.stdout, run.report()
    for turn in served(run, "/v1/messages"):
        asked = json.loads(turn.body)["model"]
        assert asked.startswith("claude-") and f'"model":"{asked}"'.encode() in turn.answer


# -- Codex CLI -----------------------------------------------------------------------------------

CODEX_CONFIG = """\
model = "sim-model"
model_provider = "alp"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[features]
plugins = false  # else it looks up github.com, api.github.com and chatgpt.com (plugin sync)

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"

[model_providers.alp]
name = "ALP hub"
base_url = "{base_url}"
env_key = "ALP_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
"""


async def test_codex_prints_the_simulators_answer(tmp_path: Path, codex: Path) -> None:
    """``codex exec`` with a custom provider (the Responses API) at the hub."""
    async with whole_path(tmp_path) as path:
        codex_home = tmp_path / "codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(CODEX_CONFIG.format(base_url=path.url + "/v1"))
        env = base_env(tmp_path)
        env.update(CODEX_HOME=str(codex_home), ALP_KEY=path.key)
        argv = [str(codex), "exec", "--skip-git-repo-check", "--strict-config", "say hi"]
        run = await run_agent(path, argv, env, tmp_path / "work")
    assert run.returncode == 0 and ANSWER in run.stdout, run.report()
    for turn in served(run, "/v1/responses"):
        sent = json.loads(turn.body)
        assert sent["model"] == "sim-model" and sent["stream"] is True
        assert turn.headers["authorization"] == f"Bearer {path.key}"
        assert b"event: response.completed" in turn.answer


# -- each agent's own sessions (issue 37, point 2) --------------------------------------------


def codex_run(
    tmp_path: Path, path: Setup, codex: Path, name: str
) -> tuple[list[str], dict[str, str], Path]:
    """``codex exec`` at the hub in a CODEX_HOME and working directory of its own (``name``)."""
    codex_home = tmp_path / f"codex-{name}"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(base_url=path.url + "/v1"))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    home = tmp_path / f"home-{name}"
    work = tmp_path / f"work-{name}"
    home.mkdir()
    work.mkdir()
    env.update(HOME=str(home), CODEX_HOME=str(codex_home), ALP_KEY=path.key)
    argv = [str(codex), "exec", "--skip-git-repo-check", "--strict-config", f"say hi {name}"]
    return argv, env, work


async def test_two_concurrent_codex_sessions_on_one_key_land_on_two_chat_jobs(
    tmp_path: Path, codex: Path
) -> None:
    """Two ``codex exec`` at once with one API key and no X-Chat-Session: each sends its own
    ``session-id`` header (Codex 0.171), and each is a session of its own, on a Chat Job of its
    own (on main both landed in the key's ``default`` session, one job)."""
    runs: dict[str, Run] = {}
    async with whole_path(tmp_path) as path:

        async def one(name: str) -> None:
            argv, env, work = codex_run(tmp_path, path, codex, name)
            runs[name] = await run_agent(path, argv, env, work)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "a")
            nursery.start_soon(one, "b")
        sessions = path.hub.sessions.listing()
    exchanges = path.tap.exchanges()
    for run in runs.values():
        assert run.returncode == 0 and ANSWER in run.stdout, run.report()
    turns = [e for e in exchanges if e.path == "/v1/responses" and e.status == 200]
    sent = {turn.headers["session-id"] for turn in turns}
    for turn in turns:  # what Codex 0.171 sends for its session, seen on the wire
        assert json.loads(turn.body)["prompt_cache_key"] == turn.headers["session-id"]
        assert turn.headers["thread-id"] == turn.headers["session-id"]
    assert len(sent) == 2, [t.headers for t in turns]
    mine = {sid: job for (key, sid), job in sessions.items() if key == "agents"}
    print(f"codex sessions -> Chat Jobs: {mine}")
    assert set(mine) == sent and len(set(mine.values())) == 2 and None not in mine.values()
