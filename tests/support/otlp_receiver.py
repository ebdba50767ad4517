"""A real OTLP/HTTP trace receiver on loopback: decodes each export with the OpenTelemetry proto."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import h11
import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    """One span as the collector got it, ids in hex."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    events: list[str]
    links: list[tuple[str, str]]
    status_code: int
    resource: dict[str, Any]
    start_ns: int = 0


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(items: Any) -> dict[str, Any]:
    return {item.key: _value(item.value) for item in items}


@dataclass
class OtlpReceiver:
    """Collects spans from ``POST /v1/traces``; ``status`` answers every export (200: taken)."""

    url: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    exports: int = 0
    status: int = 200
    changed: trio.Event = field(default_factory=trio.Event)

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes=_attributes(span.attributes),
                            events=[event.name for event in span.events],
                            links=[
                                (link.trace_id.hex(), link.span_id.hex()) for link in span.links
                            ],
                            status_code=span.status.code,
                            resource=resource,
                            start_ns=span.start_time_unix_nano,
                        )
                    )
        self.exports += 1
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, count: int, name_prefix: str = "") -> list[ReceivedSpan]:
        """Wait until ``count`` spans whose name starts with ``name_prefix`` have arrived."""
        while True:
            found = [s for s in self.spans if s.name.startswith(name_prefix)]
            if len(found) >= count:
                return found
            await self.changed.wait()

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        body = b""
        async with stream:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    if self.status == 200:
                        self.take(body)
                    payload = ExportTraceServiceResponse().SerializeToString()
                    headers = [
                        ("content-type", "application/x-protobuf"),
                        ("content-length", str(len(payload))),
                    ]
                    await stream.send_all(
                        conn.send(h11.Response(status_code=self.status, headers=headers))
                        + conn.send(h11.Data(data=payload))
                        + conn.send(h11.EndOfMessage())
                    )
                    body = b""
                    if conn.our_state is h11.MUST_CLOSE:
                        return
                    conn.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    return


@asynccontextmanager
async def open_receiver() -> AsyncIterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, receiver.serve_connection, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        receiver.url = f"http://127.0.0.1:{port}"
        yield receiver
        nursery.cancel_scope.cancel()
