"""The WebSocket connection state (gateway.wire.wsconn), driven in memory as h11's tests drive a
``Connection``: bytes in, bytes out, "now" given; no socket, no clock, no trio.

- the opening handshake both ways (RFC 6455 §4: the sample key's accept value, the checks of a
  101 answer and of an upgrade request);
- the close handshake between a client and a server connection, whichever closes first, both at
  once, and a failure;
- pings answered with at most one pong waiting: a newer ping's pong replaces an unsent older one,
  and a peer that keeps pinging while our pong waits for it to read is failed with 1008 (a
  property test against a model of the rule);
- the message bounds: bytes and fragments (1009);
- the keepalive clock: when it pings, when the peer is dead, what counts as heard.
"""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.wire import wsconn
from gateway.wire.wsconn import (
    PINGS_WHILE_PONG_WAITS,
    Keepalive,
    Tick,
    WebSocketConnection,
    WsState,
)
from gateway.wire.wsframes import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONTINUATION,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    ClientFramer,
    FrameReader,
    close_code_of,
    close_payload,
    server_frame,
    text_frame,
)

MAX = 1 << 20


def server(**kwargs: object) -> WebSocketConnection:
    return WebSocketConnection(client=False, max_message=MAX, **kwargs)  # type: ignore[arg-type]


def client(**kwargs: object) -> WebSocketConnection:
    return WebSocketConnection(client=True, max_message=MAX, **kwargs)  # type: ignore[arg-type]


_framer = ClientFramer()


def from_client(opcode: int, payload: bytes = b"", fin: bool = True) -> bytes:
    """A frame as a client sends it (masked)."""
    return _framer.message(opcode, payload, fin)


def frames_of(data: bytes, from_server: bool) -> list[tuple[int, bytes]]:
    """What a peer reads from ``data``: every frame, control frames included, in order."""
    reader = FrameReader(MAX, masked=not from_server)
    out = reader.feed(data)
    assert reader.violation is None
    return out


# -- the opening handshake -----------------------------------------------------------------------


def test_the_accept_value_of_rfc_6455s_sample_key() -> None:
    assert wsconn.accept_value(b"dGhlIHNhbXBsZSBub25jZQ==") == b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


def test_a_new_key_is_16_random_bytes_in_base64() -> None:
    keys = {wsconn.new_key() for _ in range(50)}
    assert len(keys) == 50 and all(len(base64.b64decode(k)) == 16 for k in keys)


def _answer(key: bytes, **changes: bytes | None) -> list[tuple[bytes, bytes]]:
    headers = dict((k.lower(), v) for k, v in wsconn.accept_headers(key))  # the server's own answer
    for name, value in changes.items():
        name_b = name.replace("_", "-").encode()
        if value is None:
            headers.pop(name_b, None)
        else:
            headers[name_b] = value
    return list(headers.items())


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({}, None),
        ({"connection": b"keep-alive, Upgrade"}, None),
        ({"upgrade": b"h2c"}, "no Upgrade: websocket"),
        ({"connection": None}, "no Connection: Upgrade"),
        ({"sec_websocket_accept": b"AAAA"}, "a Sec-WebSocket-Accept that does not match the key"),
        ({"sec_websocket_protocol": b"chat"}, "sec-websocket-protocol that was not asked for"),
        ({"sec_websocket_extensions": b"x"}, "sec-websocket-extensions that was not asked for"),
    ],
)
def test_the_client_checks_the_servers_answer(
    changes: dict[str, bytes | None], problem: str | None
) -> None:
    key = wsconn.new_key()
    assert wsconn.answer_problem(_answer(key, **changes), key) == problem


def test_the_server_checks_an_upgrade_request() -> None:
    headers = [
        (k.lower(), v) for k, v in wsconn.request_headers("hub", b"dGhlIHNhbXBsZSBub25jZQ==")
    ]
    assert wsconn.upgrade_key(b"GET", headers) == b"dGhlIHNhbXBsZSBub25jZQ=="
    assert wsconn.upgrade_key(b"POST", headers) is None
    assert wsconn.upgrade_key(b"GET", [h for h in headers if h[0] != b"sec-websocket-key"]) is None
    old = [(k, b"8" if k == b"sec-websocket-version" else v) for k, v in headers]
    assert wsconn.upgrade_key(b"GET", old) is None


# -- messages and the close handshake -------------------------------------------------------------


def test_messages_come_out_in_order_and_control_frames_stay_inside() -> None:
    conn = server()
    data = (
        from_client(OP_TEXT, b"one")
        + from_client(OP_PING, b"p")
        + from_client(OP_BINARY, b"\x00\x01", fin=False)
        + from_client(OP_PONG, b"")
        + from_client(OP_CONTINUATION, b"\x02")
        + from_client(OP_TEXT, b"two")
    )
    assert conn.receive(data, 1.0) == [(OP_TEXT, b"one"), (OP_BINARY, b"\x00\x01\x02"), (1, b"two")]
    assert conn.pending and frames_of(conn.data_to_send(), True) == [(OP_PONG, b"p")]
    assert not conn.pending and conn.data_to_send() == b""
    assert conn.state is WsState.OPEN and conn.heard_at == 1.0


@pytest.mark.parametrize("first", ["client", "server"])
def test_the_close_handshake_whichever_end_starts_it(first: str) -> None:
    ends = {"client": client(), "server": server()}
    starter, answerer = ends[first], ends["server" if first == "client" else "client"]
    starter.close(1001, "going away")
    assert starter.state is WsState.CLOSING and starter.close_code == 1001
    assert answerer.receive(starter.data_to_send(), 0.0) == []
    assert answerer.state is WsState.CLOSED and answerer.failure is None
    assert (answerer.close_code, answerer.close_reason) == (1001, "going away")
    reply = answerer.data_to_send()
    assert [(op, close_code_of(p)) for op, p in frames_of(reply, first == "client")] == [
        (OP_CLOSE, 1001)
    ]
    starter.receive(reply, 0.0)
    assert starter.state is WsState.CLOSED and starter.close_code == 1001  # the first closer's
    assert not starter.pending and not answerer.pending


def test_both_ends_closing_at_once_send_one_close_frame_each() -> None:
    a, b = client(), server()
    a.close(1000)
    b.close(4000, "replaced")
    to_b, to_a = a.data_to_send(), b.data_to_send()
    b.receive(to_b, 0.0)
    a.receive(to_a, 0.0)
    assert a.state is b.state is WsState.CLOSED
    assert not a.pending and not b.pending  # no answer to a close that answered ours
    assert (a.close_code, b.close_code) == (1000, 4000)  # each its own: it closed first


def test_nothing_after_the_peers_close_frame_is_read() -> None:
    conn = server()
    got = conn.receive(
        from_client(OP_TEXT, b"before")
        + from_client(OP_CLOSE, close_payload(1000))
        + from_client(OP_TEXT, b"after")
        + from_client(OP_PING, b"late"),
        0.0,
    )
    assert got == [(OP_TEXT, b"before")]
    assert frames_of(conn.data_to_send(), True) == [(OP_CLOSE, (1000).to_bytes(2, "big"))]
    assert conn.receive(from_client(OP_TEXT, b"later"), 0.0) == [] and not conn.pending


def test_a_close_without_a_code_is_1005_and_answered_empty() -> None:
    conn = client()
    conn.receive(server_frame(OP_CLOSE, b""), 0.0)
    assert conn.close_code == 1005
    assert frames_of(conn.data_to_send(), False) == [(OP_CLOSE, b"")]


def test_while_closing_pings_get_no_pong_and_messages_still_come() -> None:
    conn = server()
    conn.close(1000)
    conn.data_to_send()
    got = conn.receive(from_client(OP_PING, b"p") + from_client(OP_TEXT, b"late"), 0.0)
    assert got == [(OP_TEXT, b"late")] and not conn.pending


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (from_client(OP_TEXT, b"\xff"), 1007),
        (server_frame(OP_TEXT, b"{}"), 1002),  # unmasked, from a client
        (from_client(0x3, b"x"), 1002),
        (from_client(OP_CONTINUATION, b"x"), 1002),
        (from_client(OP_CLOSE, close_payload(999)), 1002),
    ],
)
def test_a_violation_fails_the_connection_with_its_code(data: bytes, code: int) -> None:
    conn = server()
    assert conn.receive(from_client(OP_TEXT, b"ok") + data, 0.0) == [(OP_TEXT, b"ok")]
    assert conn.state is WsState.CLOSED and conn.failure is not None and conn.close_code == code
    assert [(op, close_code_of(p)) for op, p in frames_of(conn.data_to_send(), True)] == [
        (OP_CLOSE, code)
    ]
    assert conn.receive(from_client(OP_TEXT, b"more"), 0.0) == []


# -- the bounds of a message -----------------------------------------------------------------------


def test_a_message_in_more_fragments_than_the_bound_fails_with_1009() -> None:
    """Empty continuation frames cost nothing in bytes: the bound counts them (issue 30 row 3)."""
    conn = server(max_fragments=8)
    whole = from_client(OP_TEXT, b"", fin=False) + from_client(OP_CONTINUATION, b"", fin=False) * 6
    assert conn.receive(whole + from_client(OP_CONTINUATION, b"x"), 0.0) == [(OP_TEXT, b"x")]
    assert conn.state is WsState.OPEN  # 8 frames: within the bound
    conn.receive(whole + from_client(OP_CONTINUATION, b"", fin=False), 0.0)  # 8, more to come
    assert conn.state is WsState.OPEN
    conn.receive(from_client(OP_CONTINUATION, b"", fin=False), 0.0)  # the 9th
    assert conn.state is WsState.CLOSED and conn.close_code == 1009
    assert conn.failure == (1009, "a message in over 8 frames")


def test_a_message_over_the_byte_bound_fails_with_1009() -> None:
    conn = WebSocketConnection(client=True, max_message=100)
    conn.receive(server_frame(OP_BINARY, b"x" * 101), 0.0)
    assert conn.failure == (1009, "a message over 100 bytes")


# -- pings and pongs -----------------------------------------------------------------------------------


def test_pings_in_one_read_get_one_pong_with_the_latest_payload() -> None:
    conn = server()
    conn.receive(b"".join(from_client(OP_PING, b"%d" % i) for i in range(100)), 0.0)
    assert conn.state is WsState.OPEN
    assert frames_of(conn.data_to_send(), True) == [(OP_PONG, b"99")]


def test_a_peer_that_pings_while_our_pong_waits_is_failed_with_1008() -> None:
    """Issue 30 row 1: the pong waits because the peer does not read; every later ping's pong
    replaces it (nothing piles up), and the peer is failed once it has pinged on regardless."""
    conn = server()
    conn.receive(from_client(OP_PING, b"first"), 0.0)  # the socket is full: not taken
    for n in range(1, PINGS_WHILE_PONG_WAITS):
        conn.receive(from_client(OP_PING, b"%d" % n), 0.0)
        assert conn.state is WsState.OPEN
    conn.receive(from_client(OP_PING, b"last"), 0.0)
    assert conn.state is WsState.CLOSED and conn.close_code == 1008
    out = frames_of(conn.data_to_send(), True)
    assert [op for op, _ in out] == [OP_PONG, OP_CLOSE]  # one pong, the latest, then the close
    assert out[0][1] == b"%d" % (PINGS_WHILE_PONG_WAITS - 1)


def test_pings_answered_as_they_come_never_fail() -> None:
    conn = server()
    for n in range(10 * PINGS_WHILE_PONG_WAITS):
        conn.receive(from_client(OP_PING, b"%d" % n), 0.0)
        assert frames_of(conn.data_to_send(), True) == [(OP_PONG, b"%d" % n)]
    assert conn.state is WsState.OPEN


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.lists(st.binary(max_size=8), min_size=1, max_size=5),  # a read of pings
            st.just("take"),  # the socket had room: what is owed is written
        ),
        max_size=60,
    )
)
def test_pong_rule_against_a_model(steps: list[list[bytes] | str]) -> None:
    """Whatever the order of reads and writes: every write holds at most one pong, the latest
    ping's; the connection fails with 1008 exactly when the model says the peer pinged on
    ``PINGS_WHILE_PONG_WAITS`` times while a pong from an earlier read waited."""
    conn = server()
    latest: bytes | None = None  # the model: the pong owed
    counted = 0
    failed = False
    for step in steps:
        if step == "take":
            out = frames_of(conn.data_to_send(), True)
            pongs = [p for op, p in out if op == OP_PONG]
            assert pongs == ([] if latest is None else [latest])
            latest, counted = None, 0
            if failed:
                assert not out or out[-1][0] == OP_CLOSE
            continue
        assert isinstance(step, list)
        if failed:
            assert conn.receive(b"".join(from_client(OP_PING, p) for p in step), 0.0) == []
            continue
        carried = latest is not None
        for payload in step:
            if carried:
                counted += 1
                if counted >= PINGS_WHILE_PONG_WAITS:
                    failed = True
                    break
            latest = payload
        conn.receive(b"".join(from_client(OP_PING, p) for p in step), 0.0)
        assert (conn.state is WsState.CLOSED) == failed
        if failed:
            assert conn.close_code == 1008
        assert conn.pending == (latest is not None or failed)


# -- the keepalive clock -----------------------------------------------------------------------------


def test_no_keepalive_never_ticks() -> None:
    conn = server(keepalive=Keepalive(0, 5))
    assert conn.next_tick() == float("inf") and conn.tick(1e9) is None


def test_pings_an_interval_after_the_peer_was_last_heard() -> None:
    conn = server(keepalive=Keepalive(20, 10), now=100.0)
    assert conn.next_tick() == 120.0 and conn.tick(110.0) is None
    for n in range(5):
        now = conn.next_tick()
        assert now == 120.0 + 21 * n  # the pong came 1 s after each ping
        assert conn.tick(now) is Tick.PING
        assert frames_of(conn.data_to_send(), True) == [(OP_PING, wsconn.PING_PAYLOAD)]
        conn.receive(from_client(OP_PONG, wsconn.PING_PAYLOAD), now + 1)  # answered
    assert conn.state is WsState.OPEN


def test_a_peer_heard_from_within_each_interval_is_never_pinged() -> None:
    """Issue 39: a busy channel (or one whose peer pings) costs no keepalive of its own."""
    conn = server(keepalive=Keepalive(20, 10), now=0.0)
    for second in range(1, 200):
        if second % 15 == 0:
            conn.receive(from_client(OP_TEXT, b"{}"), float(second))
        assert conn.tick(float(second)) is None
    assert conn.next_tick() == 195.0 + 20


def test_two_ends_that_both_ping_take_turns_one_ping_a_round() -> None:
    """Issue 39: a runner and the hub each keep a keepalive, yet each round has one ping and
    its pong, not one from each end: each end's clock starts again at what it hears."""
    hub, runner = server(keepalive=Keepalive(20, 20)), client(keepalive=Keepalive(20, 20))
    delay, now, pings = 0.5, 0.0, 0
    while now < 400.0:
        now = min(hub.next_tick(), runner.next_tick())
        for end, other in ((hub, runner), (runner, hub)):
            if end.tick(now) is Tick.PING:
                pings += 1
                other.receive(end.data_to_send(), now + delay)  # the ping arrives
                end.receive(other.data_to_send(), now + 2 * delay)  # its pong comes back
    assert hub.state is WsState.OPEN and runner.state is WsState.OPEN
    assert 400.0 / 21.0 - 1 <= pings <= 400.0 / 20.0 + 1  # about one a round: not two


def test_a_silent_peer_is_dead_timeout_after_a_ping() -> None:
    conn = client(keepalive=Keepalive(20, 10))
    assert conn.tick(20.0) is Tick.PING
    assert conn.next_tick() == 30.0
    assert conn.tick(29.9) is None
    assert conn.tick(30.0) is Tick.DEAD
    assert conn.silence() == "no answer to a ping within 10 s"


def test_anything_heard_after_a_ping_counts_as_its_answer() -> None:
    conn = server(keepalive=Keepalive(20, 10))
    conn.tick(20.0)
    conn.heard(25.0)  # the server's reader waited for a slow consumer: alive
    assert conn.tick(30.0) is None
    assert conn.tick(44.9) is None and conn.tick(45.0) is Tick.PING
    conn.receive(from_client(OP_TEXT, b"{}"), 46.0)  # a message is an answer too
    assert conn.tick(56.0) is None and conn.next_tick() == 66.0


def test_a_closing_connection_has_no_keepalive() -> None:
    conn = server(keepalive=Keepalive(20, 10))
    conn.close(1000)
    assert conn.next_tick() == float("inf") and conn.tick(100.0) is None


def test_text_frames_built_by_either_end_are_read_by_the_other() -> None:
    """Data frames are built by each end's I/O; this object reads them."""
    assert client().receive(text_frame(b"hi"), 0.0) == [(OP_TEXT, b"hi")]
    assert server().receive(_framer.frame(b"hi"), 0.0) == [(OP_TEXT, b"hi")]


def test_a_reader_waiting_on_its_consumer_pings_on_and_never_finds_the_peer_dead() -> None:
    """The server's reader held up by a slow consumer reads no pong: the peer is not dead for
    that, and it still hears a ping every interval (else its own keepalive, unanswered, would
    find the path dead)."""
    conn = server(keepalive=Keepalive(20, 10))
    pings = []
    for second in range(1, 200):
        conn.unread()
        tick = conn.tick(float(second))
        assert tick is not Tick.DEAD
        if tick is Tick.PING:
            pings.append(second)
            conn.data_to_send()
    assert pings == list(range(20, 200, 20))


def test_an_end_with_patience_leaves_the_pinging_to_a_peer_that_pings_every_interval() -> None:
    """Issue 39: the hub (patience 1.5) facing a runner that pings every interval (its pings a
    little late or early, as a loaded path delivers them) is never due to ping: its keepalive
    sleeps through (with patience 1 it would be due before every late ping)."""
    hub = server(keepalive=Keepalive(20, 20, patience=1.5))
    for n in range(1, 40):
        arrives = 20.0 * n + (0.5 if n % 2 else 0.01)  # the runner's schedule, jittered
        assert hub.next_tick() > arrives  # not due before the runner's ping
        assert hub.tick(arrives) is None
        hub.receive(from_client(OP_PING, b"r"), arrives)
        assert frames_of(hub.data_to_send(), True) == [(OP_PONG, b"r")]  # only the pong
    assert hub.state is WsState.OPEN
