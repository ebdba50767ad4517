"""A real ``anthropic.Anthropic`` client over a mock transport: the SDK's own parsers read the
bytes a test hands it (no network)."""

from __future__ import annotations

import anthropic
import httpx2
from anthropic.types import Message


class FakeAnthropic:
    """A real ``anthropic.Anthropic`` client whose transport answers with given bytes."""

    def __init__(self) -> None:
        self.status = 200
        self.content_type = "application/json"
        self.body = b""
        self.sent: list[bytes] = []
        transport = httpx2.MockTransport(self._handle)
        self.client = anthropic.Anthropic(
            api_key="test",
            base_url="http://hub.test",
            http_client=httpx2.Client(transport=transport),
            max_retries=0,
        )

    def _handle(self, request: httpx2.Request) -> httpx2.Response:
        self.sent.append(request.read())
        return httpx2.Response(
            self.status, headers={"content-type": self.content_type}, content=self.body
        )

    def stream(self, sse: bytes) -> Message:
        self.status, self.content_type, self.body = 200, "text/event-stream", sse
        with self.client.messages.stream(
            model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            return stream.get_final_message()

    def create(self, body: bytes, status: int = 200) -> Message:
        self.status, self.content_type, self.body = status, "application/json", body
        return self.client.messages.create(
            model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}]
        )
