"""``alp-gateway doctor``: check the configuration, the state file, the Server and every backend, with a fix for each failure."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import stat
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx
import msgspec
import trio

from gateway import logsafe
from gateway.config import Config, ConfigError, load_config, setting_flags, split_project
from gateway.observe import Redactor
from gateway.runner.alp import (
    AlpClient,
    Refused,
    ServerUnavailable,
    TokenRefused,
    describe_error,
    make_ssl_context,
)
from gateway.runner.backend import Answer, Backend, ProbeFailed
from gateway.runner.backends import BackendPool
from gateway.runner.backendurl import missing_v1, where_configured
from gateway.runner.discovery import discover_local
from gateway.runner.snapshot import BackendStatus
from gateway.runner.state import SavedRegistration, StateError, StateStore, WhichServer

OK, FAIL, WARN, SKIP = "✓", "✗", "!", "–"
_BODY_LIMIT = 200
_DEEP_PROMPT = "Reply with the single word OK."
_DEEP_ANSWER_TIME = 120.0  # a one-token completion may load the model first


@dataclass
class Check:
    """One line of the report: a mark, what was checked, what was found, and how to fix a failure."""

    mark: str
    name: str
    detail: str
    hint: str | None = None
    snippet: str | None = None  # lines to copy (a config file's table), shown under the hint

    @property
    def failed(self) -> bool:
        return self.mark == FAIL


def _cut(text: str, limit: int = _BODY_LIMIT) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "…"


def _kind(exc: BaseException) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    return type(exc).__name__


class Doctor:
    """Runs the checks for one configuration and collects their lines."""

    def __init__(self, config: Config, *, deep: bool = False, probe_timeout: float = 5.0) -> None:
        self.config = config
        self.deep = deep
        self.probe_timeout = probe_timeout
        self.checks: list[Check] = []
        self.redact = Redactor(
            [config.user_token, config.backend_key, *(b.key for b in config.backends)], limit=None
        )

    def add(
        self, mark: str, name: str, detail: str, hint: str | None = None, snippet: str | None = None
    ) -> Check:
        check = Check(mark, name, self.redact(detail), self.redact(hint) if hint else None, snippet)
        self.checks.append(check)
        return check

    async def run(self) -> list[Check]:
        self.check_config()
        registration = self.check_state()
        if self.config.project:
            await self.check_server(registration)
        await self.check_backends()
        return self.checks

    # -- configuration and state -----------------------------------------------------------

    def check_config(self) -> None:
        config = self.config
        if not config.project:
            self.add(
                FAIL,
                "configuration",
                "no project",
                "give --project OWNER/PROJECT (or ALP_PROJECT, or project = in the config file)",
            )
            return
        count = len(config.backends)
        parts = [
            f"project {config.project}",
            f"server {config.server}",
            f"{count} backend{'s' if count != 1 else ''}",
            f"default model {config.model or '(none)'}",
        ]
        if config.aliases:
            parts.append(f"{len(config.aliases)} alias(es)")
        if config.allowed_models:
            parts.append(f"allowlist {', '.join(config.allowed_models)}")
        self.add(OK, "configuration", ", ".join(parts))

    def check_state(self) -> SavedRegistration | None:
        config = self.config
        store = StateStore(config.state_dir)
        path = store.path
        if not config.project:
            self.add(SKIP, "state file", f"{path}: not checked without a project")
            return None
        server = f" --server {config.server}" if config.server_explicit else ""
        register = (
            f"run `alp-gateway register --project {config.project}{server} --user-token …` once "
            "(a user credential registers the runner)"
        )
        if not path.exists():
            if config.user_token:
                self.add(
                    WARN,
                    "state file",
                    f"{path} does not exist yet; `run` registers with the user credential",
                )
            else:
                self.add(
                    FAIL,
                    "state file",
                    f"{path} does not exist: this runner is not registered",
                    register,
                )
            return None
        try:
            # before load, which makes a directory of ours 0700 (gateway.runner.state.private_dir)
            dir_mode = stat.S_IMODE(path.parent.stat().st_mode)
            registration = store.find(
                config.server, config.project, server_given=config.server_explicit
            )
            missing = store.missing(config.server, config.project)
        except WhichServer as exc:
            self.add(FAIL, "state file", str(exc))
            return None
        except StateError as exc:
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode & 0o077:
                self.add(
                    FAIL,
                    "state file",
                    f"{path} is readable by others (mode {mode:o}), and it holds the runner token",
                    f"chmod 600 {path}",
                )
            else:
                self.add(FAIL, "state file", str(exc), "move the file away and register again")
            return None
        mode = stat.S_IMODE(path.stat().st_mode)
        if registration is None:
            if config.user_token:
                self.add(
                    WARN,
                    "state file",
                    f"{path} (mode {mode:o}): {missing}; `run` registers with the user credential",
                )
            else:
                self.add(FAIL, "state file", f"{path} (mode {mode:o}): {missing}", register)
            return None
        if dir_mode & 0o077:
            self.add(
                WARN,
                "state file",
                f"{path} is private, but its directory was mode {dir_mode:o} "
                "(made 0700 now; `run` does the same at every start)",
            )
        else:
            self.add(
                OK,
                "state file",
                f"{path} (mode {mode:o}): runner {registration.name} ({registration.id})",
            )
        return registration

    # -- the Server ------------------------------------------------------------------------

    async def check_server(self, registration: SavedRegistration | None) -> None:
        config = self.config
        # the registration's own Server (StateStore.find chose it for config.server)
        server = config.server if registration is None else registration.server
        ssl_context = make_ssl_context(config.ca_file)
        fix_server = (
            "check --server (or AGENTICS_SERVER) and that the Server is up and reachable from here"
        )
        if registration is None:
            try:
                async with httpx.AsyncClient(
                    verify=ssl_context, timeout=self.probe_timeout
                ) as client:
                    answer = await client.get(server)
                if (
                    answer.status_code == 400
                    and server.startswith("http://")
                    and b"speaks HTTPS" in answer.content
                ):
                    https = "https://" + server.split("://", 1)[1]
                    self.add(
                        WARN,
                        "Server",
                        f"{server} speaks HTTPS at that port: `run` registers at {https}",
                        f"give --server {https} (and --ca-file for a private CA)",
                    )
                    return
            except httpx.HTTPError as exc:
                why = _kind(exc) if isinstance(exc, httpx.TimeoutException) else None
                why = why or describe_error(exc, server)
                self.add(FAIL, "Server", f"{server} unreachable: {why}", fix_server)
                return
            self.add(
                OK, "Server", f"{server} reachable (runner token not checked: not registered yet)"
            )
            return
        assert config.project
        owner, project = split_project(config.project)
        alp = AlpClient(
            server,
            owner,
            project,
            ssl_context=ssl_context,
            ca_file=config.ca_file,
            timeout=self.probe_timeout,
        )
        alp.token = registration.token
        try:
            await alp.poll([])  # no capabilities: a poll like this never claims a job
        except ServerUnavailable as exc:
            self.add(FAIL, "Server", f"{server} unreachable: {exc}", fix_server)
            return
        except TokenRefused as exc:
            self.add(
                FAIL,
                "Server",
                f"{server} reachable, but {exc}",
                f"register again: `alp-gateway register --project {config.project} --user-token …` "
                "(or give AGENTICS_USER_TOKEN so `run` re-registers)",
            )
            return
        except Refused as exc:
            self.add(
                FAIL,
                "Server",
                f"{server}: {exc}",
                f"is {config.project} the right project, and {server} an ALP Server?",
            )
            return
        finally:
            await alp.aclose()
        self.add(
            OK, "Server", f"{server} reachable; runner token accepted (a poll with no capabilities)"
        )

    # -- backends --------------------------------------------------------------------------

    async def check_backends(self) -> None:
        config = self.config
        if not config.backends:
            await self.no_backend()
            return
        ssl_context = make_ssl_context(config.ca_file)
        timeout = min(config.connect_timeout, self.probe_timeout)
        backends = [
            Backend.from_spec(
                spec,
                connect_timeout=timeout,
                idle_timeout=max(timeout, 60.0),
                ssl_context=ssl_context,
            )
            for spec in config.backends
        ]
        pool = BackendPool(
            backends, config.model, aliases=config.aliases, allowed_models=config.allowed_models
        )
        try:
            for backend in backends:
                await self.check_backend(backend, pool)
            self.check_models(pool)
        finally:
            await pool.aclose()

    async def check_backend(self, backend: Backend, pool: BackendPool) -> None:
        name = f"backend {backend.name}"
        where = where_configured(backend)
        reason = await backend.check()
        backend.mark(reason)
        if reason is not None:
            if "key" in reason:
                hint = (
                    f"check the key of {where} (key / key_env; CHAT_LLM_BACKEND_KEY for --backend)"
                )
            else:
                hint = (
                    f"is the model server running at {backend.url}? "
                    f"start it, or fix the url of {where}"
                )
            self.add(FAIL, name, f"{backend.url}: {reason}", hint)
            return
        listed: list[str] | None = None
        problem = ""
        try:
            listed = await backend.list_models()
        except ProbeFailed as exc:
            problem = exc.reason
        if listed is None and problem == "answered 404":
            # Ollama's plain http://127.0.0.1:11434 (and vLLM's, LiteLLM's host) answer 404 on
            # /models: every chat turn would 404 too. Ask where the API really is (as `run` does).
            wrong = None
            with trio.move_on_after(self.probe_timeout):
                wrong = await missing_v1(backend)
            if wrong is not None:
                self.add(FAIL, name, wrong.detail, wrong.fix)
                return
        if listed is None:
            if backend.declared_models:
                self.add(
                    OK,
                    name,
                    f"{backend.url} reachable; "
                    f"models (declared): {', '.join(backend.declared_models)}",
                )
            else:
                self.add(
                    WARN,
                    name,
                    f"{backend.url} reachable, but it lists no models ({problem})",
                    f'declare them: models = ["…"] in {where}',
                )
        else:
            backend.mark(None, listed)
            with trio.move_on_after(self.probe_timeout):
                await backend.learn_contexts(backend.models)
            missing = [m for m in backend.declared_models if m not in listed]
            shown = with_contexts(listed, backend.contexts) or "none"
            if missing:
                self.add(
                    WARN,
                    name,
                    f"{backend.url} reachable; lists {shown}; declared but not listed: "
                    f"{', '.join(missing)}",
                    f"pull or load {', '.join(missing)}, or fix models in {where}",
                )
            elif not backend.models:
                self.add(
                    WARN,
                    name,
                    f"{backend.url} reachable, but serves no model yet",
                    "load or pull a model (e.g. `ollama pull qwen2.5:7b`)",
                )
            else:
                self.add(OK, name, f"{backend.url} reachable; models: {shown}")
        if self.deep:
            await self.deep_check(backend, pool)

    async def deep_check(self, backend: Backend, pool: BackendPool) -> None:
        name = f"  {backend.name} completion"
        model = None
        default = self.config.model
        if default is not None:
            local = pool.aliases.get(default, default)
            if local in backend.models:
                model = local
        if model is None and backend.models:
            model = backend.models[0]
        if model is None:
            model = default
        if model is None:
            self.add(SKIP, name, "no model to ask (none listed, no --model)")
            return
        body = msgspec.json.encode(
            {
                "model": model,
                "messages": [{"role": "user", "content": _DEEP_PROMPT}],
                "max_tokens": 1,
                "stream": False,
            }
        )
        start = time.perf_counter()
        answer: Answer | None = None
        problem = "no answer in time"
        with trio.move_on_after(self.probe_timeout + _DEEP_ANSWER_TIME):
            try:
                answer = await backend.fetch("POST", "/chat/completions", body)
            except ProbeFailed as exc:
                problem = exc.reason
        if answer is None:
            self.add(
                FAIL,
                name,
                f"{model}: {problem}",
                "the backend answers /models but not a completion: check its logs",
            )
            return
        elapsed = (time.perf_counter() - start) * 1000.0
        if not answer.ok:
            text = answer.body.decode("utf-8", "replace")
            self.add(
                FAIL,
                name,
                f"{model}: backend returned {answer.status}: {_cut(text)}",
                f"can {backend.name} load {model}? check its logs and memory",
            )
            return
        try:
            msgspec.json.decode(answer.body)
        except msgspec.DecodeError:
            self.add(
                FAIL,
                name,
                f"{model}: the answer is not JSON",
                "is this an OpenAI-compatible /v1 URL?",
            )
            return
        self.add(OK, name, f"one-token completion from {model} in {elapsed:.0f} ms")

    def check_models(self, pool: BackendPool) -> None:
        config = self.config
        servable = pool.servable()
        states = [BackendStatus.of(b) for b in pool.backends]
        if not any(b.up for b in states):
            self.add(
                FAIL,
                "models",
                "no backend is up: the runner will not advertise chat-llm:v1",
                "start a backend (see the lines above)",
            )
            return
        known = any(b.models for b in states)
        if not known:
            self.add(
                WARN,
                "models",
                "no backend lists a model; turns are forwarded unchecked (one backend only)",
            )
            return
        shown = with_contexts(servable, pool.contexts(servable))
        self.add(OK, "models", f"servable now: {shown or 'none'}")
        if config.model is not None and config.model not in servable:
            self.add(
                FAIL,
                "default model",
                f"{config.model} is not served by any backend that is up",
                f"set --model (CHAT_LLM_MODEL) to one of: {', '.join(servable) or '(none)'}",
            )
        local = {m for b in states if b.up for m in b.models}
        dangling = [f"{a} → {t}" for a, t in config.aliases.items() if t not in local]
        if dangling:
            self.add(
                WARN,
                "aliases",
                f"target not served: {', '.join(dangling)}",
                "point each alias at a model a backend serves",
            )
        unserved = [m for m in config.allowed_models if m not in local and m not in config.aliases]
        if unserved:
            self.add(WARN, "allowlist", f"allowed but not served: {', '.join(unserved)}")

    async def no_backend(self) -> None:
        found = await discover_local()
        if not found:
            self.add(
                FAIL,
                "backend",
                "none configured, and no model server answers at the usual local ports",
                "start one (Ollama, vLLM, llama.cpp, LM Studio, LiteLLM), then give --backend URL, "
                "e.g. --backend http://127.0.0.1:11434/v1",
            )
            return
        kind, url, models = found[0]
        others = "; ".join(f"{k} at {u}" for k, u, _ in found[1:])
        detail = f"none configured; found {kind} at {url} serving {', '.join(models[:5])}"
        if others:
            detail += f" (also: {others})"
        hint = (
            f"use it: --backend {url} (or CHAT_LLM_BACKEND_URL={url}), or this table in a "
            "config file (--config FILE):"
        )
        self.add(FAIL, "backend", detail, hint, backend_table(kind, url))


def with_contexts(models: Sequence[str], contexts: dict[str, int]) -> str:
    """Models with the context length their backend said (issue 37, point 3): the hub refuses
    a prompt over it rather than let the backend drop its start."""
    return ", ".join(
        f"{m} (context {contexts[m]} tokens)" if m in contexts else f"{m} (context not said)"
        for m in models
    )


def backend_table(kind: str, url: str) -> str:
    """A ``[[backend]]`` table for a model server of ``kind`` at ``url``, as TOML: its name is
    the kind's (``ollama``, ``lm-studio``, ``llama-cpp``; ``sim`` for our simulator)."""
    name = re.sub(r"[^a-z0-9]+", "-", kind.lower().removeprefix("alp-gateway ")).strip("-")
    return f"[[backend]]\nname = {json.dumps(name or 'local')}\nurl = {json.dumps(url)}\n"


def render(checks: Sequence[Check], out: TextIO) -> None:
    width = max((len(c.name) for c in checks), default=0)
    for check in checks:  # what a Server or a backend said, escaped as in the logs
        out.write(f"  {check.mark}  {check.name.ljust(width)}  {logsafe.escape(check.detail)}\n")
        if check.hint and check.mark in (FAIL, WARN):
            out.write(f"     {' ' * width}  → {logsafe.escape(check.hint)}\n")
            for line in (check.snippet or "").splitlines():
                out.write(f"     {' ' * width}      {line}\n")
    failed = sum(c.failed for c in checks)
    if failed:
        out.write(f"\n{failed} required check{'s' if failed != 1 else ''} failed.\n")
    else:
        out.write("\nAll required checks passed.\n")


async def diagnose(
    config: Config, *, deep: bool = False, probe_timeout: float = 5.0
) -> list[Check]:
    return await Doctor(config, deep=deep, probe_timeout=probe_timeout).run()


def _project_of_registration(config: Config) -> tuple[Config, list[Check]]:
    """``config`` with the project of the state file's one registration (its Server found by
    ``StateStore.find`` as ``run`` finds it), and a line that says so; ``config`` as it is when
    the file holds none, or several (a line naming them)."""
    store = StateStore(config.state_dir)
    projects = store.projects()  # [] for a damaged file: check_state says what is wrong
    if len(projects) == 1:
        found = dataclasses.replace(config, project=projects[0])
        line = f"{projects[0]}, from the saved registration ({store.path}); --project for another"
        return found, [Check(OK, "project", line)]
    if projects:
        line = f"{store.path} holds registrations for {', '.join(projects)}"
        return config, [Check(FAIL, "project", line, "give --project OWNER/PROJECT: which one")]
    return config, []


def run_doctor(
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    config_file: Path | None,
    *,
    deep: bool = False,
    out: TextIO | None = None,
) -> int:
    """Load the configuration, run every check, print the table; 1 when a required check failed."""
    out = out or sys.stdout
    out.write("alp-gateway doctor\n\n")
    try:
        config = load_config(flags, env, config_file)
    except ConfigError as exc:
        render(
            [
                Check(
                    FAIL,
                    "configuration",
                    str(exc),
                    "fix that setting (flags > environment > config file); "
                    "`alp-gateway run --help` lists every one, with its variable and default",
                )
            ],
            out,
        )
        return 1
    saved: list[Check] = []
    if config.project is None:  # the saved registration's project, when it holds just one
        config, saved = _project_of_registration(config)
    checks = saved + trio.run(lambda: diagnose(config, deep=deep))
    render(checks, out)
    return 1 if any(c.failed for c in checks) else 0


def main(args: argparse.Namespace) -> int:
    """The ``doctor`` subcommand (flags as for ``run``, plus ``--deep``)."""
    return run_doctor(
        setting_flags(args), os.environ, args.config, deep=bool(getattr(args, "deep", False))
    )
