"""The hub's settings: one typed dataclass every part reads (defaults are the hub command's)."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024


@dataclass
class HubSettings:
    """Every tunable of a hub; a part reads it when it needs it, so a change applies at once."""

    events: bool = True  # serve GET {base}/runners/events (the job_available push)
    register_paths: tuple[str, ...] = ("runners", "runners/register")  # under {base}/
    offline_after: float = 60.0  # s without a sign of life: the runner's jobs are force-ended
    reoffer_after: float = 10.0  # s: an unstarted claim is offered to its runner again
    session_idle_timeout: float = 600.0  # s: an idle chat session gets chat.end ("idle"); 0 never
    runner_wait_timeout: float = 30.0  # s: a session's first turn waits this long for a runner
    reconnect_timeout: float = 10.0  # s: a turn waits this long for a dropped channel's redial
    keepalive_interval: float = 15.0  # s: SSE keepalive comments (events route, streamed turns)
    models_timeout: float = 3.0  # s: /v1/models waits this long for an open channel's answer
    models_wait: float = 15.0  # s: bound on a listing session when no model list is known yet
    max_body: int = 16 * MiB  # bytes: request bodies and WebSocket messages
    head_timeout: float = 10.0  # s: a request head (or WebSocket handshake) complete within this
    body_timeout: float = 60.0  # s: a request body complete within this of the end of its head
    max_connections: int = 1024  # open connections; one more is answered 503 and closed
    ping_interval: float = 20.0  # s: a WebSocket ping on every Chat Channel; 0 = no pings
    ping_timeout: float | None = None  # s without any frame after a ping: closed (None: interval)
    first_frame_timeout: float = 300.0  # s: a turn's wait for its first frame with pings off
    # a model no runner lists is served by this one instead of a 404 (None: the 404); for
    # clients with fixed model names (Claude Code's claude-*)
    default_model: str | None = None
    # a streamed chat turn that does not ask for usage asks for it anyway (stream_options.
    # include_usage), the usage chunk kept from the client: the hub counts every turn's tokens
    count_usage: bool = True
    client_backlog: int = 1024 * 1024  # bytes of a turn's stream its client may fall behind by
    # when every runner of the project that could serve is at capacity (stopped advertising
    # chat-llm:v1 while it holds sessions), requests for a new session wait in the project's
    # queue (round-robin across API keys, FIFO within one): at most queue_length of them (one
    # more: 503 queue_full at once; 0: none wait), each at most queue_wait s (then 503
    # queue_timeout); both with Retry-After (was capacity_wait)
    queue_length: int = 64
    queue_wait: float = 10.0
    # live chat sessions one API key may hold (its least recently used idle one is ended to make
    # room for a new one; none idle: 429 too_many_sessions); 0 = no bound
    max_sessions_per_key: int = 16
    # s: how often the hub checks that its live sessions' API keys are still active (a key
    # revoked by another process on the same store); a revoked key's sessions end
    key_check_interval: float = 5.0
    # s: a front-door turn's usage row is kept this long (the hourly totals per key and model
    # are kept for good); API keys' limits changed by another process apply within
    # key_check_interval
    usage_retention: float = 7 * 86400.0
    # tokens a turn that names no max_tokens holds against its key's token limits (tpm,
    # tokens_per_day) while it is in flight (settled to what it used at its end)
    token_reservation: int = 1024

    @property
    def pong_timeout(self) -> float:
        """Seconds a channel may stay silent after a ping before it is closed as dead."""
        return self.ping_interval if self.ping_timeout is None else self.ping_timeout
