"""The backend hop's HTTP/1.1 client (gateway.wire.http1): keep-alive, proxies from the environment,
https through a CONNECT tunnel, and the request closed when its turn is cancelled.

Real sockets on loopback: the simulator as the backend, a small proxy written here (absolute
form and CONNECT, as office proxies do), a TLS backend with a throwaway CA (trustme).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trustme
from helpers import BACKEND_KEY

from gateway.config import ConfigError
from gateway.runner.backend import Backend, BackendUnreachable
from gateway.sim import Simulator, open_sim
from gateway.wire import http1

BODY = json.dumps(
    {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()


async def _read_all(response: http1.ClientResponse) -> bytes:
    return await response.read_body()


# -- proxies named by the environment (the rules: tests/unit/test_proxy.py) ------------------------


@pytest.mark.parametrize(
    ("env", "url", "proxied"),
    [
        ({"HTTP_PROXY": "proxy:3128"}, "http://gpu.lan:8000", True),
        ({"HTTP_PROXY": "http://p:1"}, "https://api.openai.com", False),  # https wants HTTPS_PROXY
        ({"ALL_PROXY": "http://p:1", "NO_PROXY": "gpu.lan:80"}, "http://gpu.lan/v1", False),
        ({"ALL_PROXY": "http://p:1", "NO_PROXY": "gpu.lan:443"}, "https://gpu.lan/v1", False),
        ({"ALL_PROXY": "http://p:1", "NO_PROXY": "10.0.0.0/8"}, "http://10.1.2.3:8000", False),
    ],
)
def test_the_client_asks_for_its_origin(env: dict[str, str], url: str, proxied: bool) -> None:
    """The origin's port is the scheme's default when the URL gives none."""
    client = http1.Client(url, env=env)
    assert (client.proxy is not None) is proxied


# -- a proxy on loopback -------------------------------------------------------------------------


class Proxy:
    """A forwarding HTTP proxy: absolute-form requests (each rewritten to origin form for the
    target, a kept-alive connection's too) and CONNECT tunnels. ``seen`` records each request
    line as it came."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.port = 0

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = await client.receive_some(65536)
            if not data:
                return
            head += data
        line = head.split(b"\r\n", 1)[0]
        method, target, _ = line.split(b" ")
        if method == b"CONNECT":
            self.seen.append(line)
            host, port = target.rsplit(b":", 1)
            upstream = await trio.open_tcp_stream(host.decode(), int(port))
            await client.send_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            leftover = head.split(b"\r\n\r\n", 1)[1]
            if leftover:
                await upstream.send_all(leftover)
            forward = partial(_pipe, client, upstream)
        else:
            assert target.startswith(b"http://")
            authority = target[7:].partition(b"/")[0]
            host, port = authority.rsplit(b":", 1)
            upstream = await trio.open_tcp_stream(host.decode(), int(port))
            forward = partial(self._requests, client, upstream, head)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(forward, nursery.cancel_scope)
            nursery.start_soon(_pipe, upstream, client, nursery.cancel_scope)
        await upstream.aclose()

    async def _requests(
        self,
        client: trio.SocketStream,
        upstream: trio.SocketStream,
        buf: bytes,
        done: trio.CancelScope,
    ) -> None:
        """Absolute-form requests (with a ``content-length`` body) forwarded in origin form."""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = await client.receive_some(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                line, fields = head.split(b"\r\n", 1)
                self.seen.append(line)
                length = int(fields.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(buf) < length:
                    buf += await client.receive_some(65536)
                body, buf = buf[:length], buf[length:]
                method, target, version = line.split(b" ")
                path = b"/" + target[7:].partition(b"/")[2]
                await upstream.send_all(
                    b"%s %s %s\r\n%s\r\n\r\n%s" % (method, path, version, fields, body)
                )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            done.cancel()


async def _pipe(src: trio.SocketStream, dst: trio.SocketStream, done: trio.CancelScope) -> None:
    try:
        while data := await src.receive_some(65536):
            await dst.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    done.cancel()


@asynccontextmanager
async def open_proxy() -> AsyncIterator[Proxy]:
    proxy = Proxy()
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        yield proxy
        nursery.cancel_scope.cancel()


async def _stream(backend: Backend) -> bytes:
    async with backend.stream(BODY) as response:
        assert response.status == 200
        return await _read_all(response)


async def test_http_backend_through_the_proxy_in_absolute_form(
    sim: Simulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_proxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        backend = Backend(sim.url, "sk-backend-very-secret-4242")
        try:
            body = await _stream(backend)
        finally:
            await backend.aclose()
        assert b"data: [DONE]" in body
        assert proxy.seen == [f"POST {sim.url}/chat/completions HTTP/1.1".encode()]


async def test_no_proxy_goes_direct(sim: Simulator, monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_proxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
        backend = Backend(sim.url, "sk-backend-very-secret-4242")
        try:
            assert b"data: [DONE]" in await _stream(backend)
        finally:
            await backend.aclose()
        assert proxy.seen == []


async def test_no_proxy_range_health_models_and_turns_all_go_direct(
    sim: Simulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``NO_PROXY=127.0.0.0/8``, a range httpx matches only at 127.0.0.0: the health probe, the
    model list and the turn all go direct, on one kept-alive connection (one client)."""
    async with open_proxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.setenv("NO_PROXY", "127.0.0.0/8")
        backend = Backend(sim.url, BACKEND_KEY)
        try:
            assert await backend.check() is None
            assert await backend.list_models() == ["sim-model"]
            assert b"data: [DONE]" in await _stream(backend)
        finally:
            await backend.aclose()
        assert proxy.seen == []
        assert [r.path for r in sim.requests] == [
            "/v1/models",
            "/v1/models",
            "/v1/chat/completions",
        ]
        assert sim.connections == 1


async def test_health_models_and_turns_take_the_same_proxy(
    sim: Simulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_proxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.setenv("NO_PROXY", "10.0.0.0/8,gpu.lan")
        backend = Backend(sim.url, BACKEND_KEY)
        try:
            assert await backend.check() is None
            assert await backend.list_models() == ["sim-model"]
            assert b"data: [DONE]" in await _stream(backend)
        finally:
            await backend.aclose()
        # each in absolute form, on one connection to the proxy kept alive
        assert proxy.seen == [
            f"GET {sim.url}/models HTTP/1.1".encode(),
            f"GET {sim.url}/models HTTP/1.1".encode(),
            f"POST {sim.url}/chat/completions HTTP/1.1".encode(),
        ]
        assert sim.connections == 1
        assert [r.path for r in sim.requests] == [
            "/v1/models",
            "/v1/models",
            "/v1/chat/completions",
        ]
        assert all(r.headers.get("authorization") == f"Bearer {BACKEND_KEY}" for r in sim.requests)


@asynccontextmanager
async def open_tls_backend(ca: trustme.CA) -> AsyncIterator[int]:
    """A TLS backend answering every request with one SSE event and [DONE] (keep-alive)."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(server_ctx)

    async def handle(stream: trio.SSLStream[trio.SocketStream]) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(buf) < length:
                    buf += await stream.receive_some(65536)
                buf = buf[length:]
                body = b'data: {"tls":true}\n\ndata: [DONE]\n\n'
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_ssl_over_tcp, handle, 0, server_ctx, host="127.0.0.1")
        )
        yield listeners[0].transport_listener.socket.getsockname()[1]
        nursery.cancel_scope.cancel()


async def test_https_backend_through_a_connect_tunnel(monkeypatch: pytest.MonkeyPatch) -> None:
    ca = trustme.CA()
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    async with open_tls_backend(ca) as port, open_proxy() as proxy:
        monkeypatch.setenv("HTTPS_PROXY", f"127.0.0.1:{proxy.port}")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        backend = Backend(f"https://localhost:{port}/v1", ssl_context=client_ctx)
        try:
            assert await backend.check() is None  # the health check: the same tunnel and TLS
            assert await _stream(backend) == b'data: {"tls":true}\n\ndata: [DONE]\n\n'
            assert await _stream(backend) == b'data: {"tls":true}\n\ndata: [DONE]\n\n'
        finally:
            await backend.aclose()
        # one tunnel: the later requests went over the kept-alive TLS connection inside it
        assert proxy.seen == [f"CONNECT localhost:{port} HTTP/1.1".encode()]


async def test_https_backend_with_an_unknown_ca_is_unreachable_not_sent() -> None:
    ca = trustme.CA()
    async with open_tls_backend(ca) as port:
        backend = Backend(f"https://localhost:{port}/v1", ssl_context=ssl.create_default_context())
        try:
            with pytest.raises(BackendUnreachable, match="certificate"):
                await _stream(backend)
            # the health check refuses the certificate as the turn does: the backend is down
            assert "certificate refused" in (await backend.check() or "")
        finally:
            await backend.aclose()


# -- keep-alive ------------------------------------------------------------------------------


async def test_connections_are_kept_alive_and_a_closed_one_is_replaced() -> None:
    async with open_sim() as sim:
        backend = Backend(sim.url)
        try:
            for _ in range(3):
                assert b"[DONE]" in await _stream(backend)
            assert sim.connections == 1
            url = sim.url
        except BaseException:
            await backend.aclose()
            raise
    try:
        # the backend restarted: the kept connection's peer is gone, and a fresh one is made
        async with open_sim(port=int(url.rsplit(":", 1)[1].split("/", 1)[0])) as again:
            assert b"[DONE]" in await _stream(backend)
            assert again.connections == 1
    finally:
        await backend.aclose()


async def test_every_turn_sends_the_head_built_once_with_its_own_length() -> None:
    """The turn's request head is built once per backend (``Client.prepare``); each turn adds its
    own content-length, on the one kept-alive connection, and ``request`` sends the same."""
    key = "sk-backend-very-secret-4242"
    async with open_sim(require_key=key) as sim:
        backend = Backend(sim.url, key)
        bodies = [BODY, BODY.replace(b'"hi"', b'"a longer prompt than hi"')]
        try:
            for body in bodies:
                async with backend.stream(body) as response:
                    assert response.status == 200
                    assert b"[DONE]" in await _read_all(response)
            response = await backend.http.request(
                b"POST", b"/v1/chat/completions", backend._turn_headers, BODY
            )
            assert response.status == 200 and b"[DONE]" in await _read_all(response)
            backend.http.release(response)
        finally:
            await backend.aclose()
    assert [r.body for r in sim.requests] == [*bodies, BODY]
    for recorded in sim.requests:
        assert recorded.method == "POST" and recorded.path == "/v1/chat/completions"
        assert recorded.headers["authorization"] == f"Bearer {key}"
        assert recorded.headers["accept"] == "text/event-stream"
        assert recorded.headers["content-type"] == "application/json"
        assert recorded.headers["user-agent"].startswith("alp-gateway/")
        assert recorded.headers["host"] == sim.url.split("/")[2]
        assert recorded.headers["content-length"] == str(len(recorded.body))
    assert sim.connections == 1


async def test_a_cancelled_turn_closes_its_backend_connection() -> None:
    async with open_sim() as sim:
        backend = Backend(sim.url)
        body = json.loads(BODY)
        body["sim"] = {"chunks": 1000, "interval": 0.01}
        try:
            with trio.CancelScope() as scope:
                async with backend.stream(json.dumps(body).encode()) as response:
                    await response.read_more()
                    scope.cancel()
                    await trio.sleep_forever()
            stream = sim.streams[0]
            with trio.fail_after(5):
                await stream.finished.wait()
            assert stream.client_closed  # the backend saw the connection go: the GPU stops
            assert b"[DONE]" in await _stream(backend)
            assert sim.connections == 2  # the cancelled one was not kept for reuse
        finally:
            await backend.aclose()


def test_a_proxy_this_client_cannot_speak_is_a_clear_config_error() -> None:
    env = {"HTTPS_PROXY": "socks5://p:1080"}
    with pytest.raises(ValueError, match=r"unsupported proxy socks5://p \(only http://\)"):
        http1.Client("https://api.openai.com/v1", env=env)


def test_backend_names_itself_when_its_proxy_is_unusable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "socks5://p:1080")
    with pytest.raises(ConfigError, match=r"backend cloud \(https://api.openai.com/v1\)"):
        Backend("https://api.openai.com/v1", name="cloud")
