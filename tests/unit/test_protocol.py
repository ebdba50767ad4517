"""Frame decoding and encoding through the one encoder (gateway.wire.protocol)."""

import json

import msgspec
import pytest

from gateway.wire import protocol


def test_completion_request_keeps_body_raw() -> None:
    text = '{"type":"chat.completion.request","jobId":"j","requestId":"r","body":{"messages":[],"model":"m", "x" : 1}}'
    frame = protocol.decode_frame(text)
    assert isinstance(frame, protocol.CompletionRequest)
    assert bytes(frame.body) == b'{"messages":[],"model":"m", "x" : 1}'
    assert frame.model is None


def test_frame_level_model_and_other_types() -> None:
    frame = protocol.decode_frame(
        '{"type":"chat.completion.request","requestId":"r","model":"big","body":{"messages":[]}}'
    )
    assert isinstance(frame, protocol.CompletionRequest) and frame.model == "big"
    assert isinstance(protocol.decode_frame('{"type":"chat.end"}'), protocol.End)
    assert isinstance(
        protocol.decode_frame('{"type":"chat.models.request","requestId":"r"}'),
        protocol.ModelsRequest,
    )
    assert isinstance(
        protocol.decode_frame('{"type":"chat.completion.cancel","requestId":"r"}'),
        protocol.CompletionCancel,
    )
    unknown = protocol.decode_frame('{"type":"chat.future","whatever":[1]}')
    assert isinstance(unknown, protocol.Unknown) and unknown.type == "chat.future"


@pytest.mark.parametrize(
    ("text", "request_id"),
    [
        ("not json", None),
        ("[1,2]", None),
        ('{"notype":1}', None),
        ('{"type":"chat.completion.request","requestId":"r1"}', "r1"),
        ('{"type":"chat.completion.request","requestId":"r2","body":"text"}', "r2"),
        ('{"type":"chat.completion.request","requestId":5,"body":{}}', None),
        ('{"type":"chat.models.request"}', None),
    ],
)
def test_bad_frames_raise_with_request_id(text: str, request_id: str | None) -> None:
    with pytest.raises(protocol.FrameError) as info:
        protocol.decode_frame(text)
    assert info.value.request_id == request_id


def test_chunk_frame_splices_payload_verbatim() -> None:
    payload = b'{"id":"c1","choices":[{"delta":{"content":"h\\u00e9 \\"x\\""}}],  "odd" : 1}'
    frames = protocol.TurnFrames('job"1%s', "req%d\u0000")
    frame = frames.chunk(payload)
    decoded = json.loads(frame)
    assert decoded["type"] == "chat.completion.chunk"
    assert decoded["jobId"] == 'job"1%s' and decoded["requestId"] == "req%d\u0000"
    assert frame.endswith(b'"chunk":' + payload + b"}")
    raw = protocol.ChunkFrame('job"1%s', "req%d\u0000", msgspec.Raw(payload))
    assert frame == protocol.encode_frame(raw)  # the template is the encoder's own frame
    assert json.loads(frames.done) == {
        "type": "chat.completion.done",
        "jobId": 'job"1%s',
        "requestId": "req%d\u0000",
    }


def test_runner_frames_from_the_one_encoder() -> None:
    assert json.loads(protocol.error_frame("j", "r", "no")) == {
        "type": "chat.completion.error",
        "jobId": "j",
        "requestId": "r",
        "error": "no",
    }
    assert json.loads(protocol.models_frame("j", "r", ["a"])) == {
        "type": "chat.models.response",
        "jobId": "j",
        "requestId": "r",
        "models": ["a"],
    }
    assert json.loads(protocol.end_frame("j", "bye")) == {
        "type": "chat.end",
        "jobId": "j",
        "reason": "bye",
    }


def test_with_model_sets_or_keeps() -> None:
    body = b'{"model":"a","messages":[]}'
    assert protocol.with_model(body, "a") is body
    assert json.loads(protocol.with_model(body, "b"))["model"] == "b"
    assert json.loads(protocol.with_model(b'{"messages":[]}', "c"))["model"] == "c"
    assert protocol.body_model(b'{"messages":[]}') is None


def test_a_frame_traceparent_is_taken_whatever_it_holds() -> None:
    """The extension (§6) never refuses a turn: a bad value is ignored later, by tracing."""
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for value, kept in ((tp, tp), (42, 42), (None, None)):
        text = json.dumps(
            {"type": "chat.completion.request", "requestId": "r", "body": {}, "traceparent": value}
        )
        frame = protocol.decode_frame(text)
        assert isinstance(frame, protocol.CompletionRequest)
        assert frame.traceparent == kept
    frame = protocol.decode_frame('{"type":"chat.completion.request","requestId":"r","body":{}}')
    assert isinstance(frame, protocol.CompletionRequest) and frame.traceparent is None


def test_hub_frames_come_from_the_one_encoder_and_read_back() -> None:
    """The hub's request, cancel and models-request frames are the encoder's Structs; the
    runner's decoder reads them back, the client's body byte for byte (spaces kept), and a
    request with no traceparent carries no such key."""

    def request_frame(job: str, rid: str, body: str, traceparent: str | None = None) -> bytes:
        # as the hub's turn sends it (gateway/hub/serving.py)
        raw = msgspec.Raw(body.encode())
        return protocol.encode_frame(protocol.RequestFrame(job, rid, raw, traceparent))

    body = '{"messages":[],"model":"m", "x" : 1}'
    text = request_frame("j", "r", body)
    assert b"traceparent" not in text
    frame = protocol.decode_frame(text)
    assert isinstance(frame, protocol.CompletionRequest)
    assert bytes(frame.body) == body.encode() and frame.requestId == "r"
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    frame = protocol.decode_frame(request_frame("j", "r", body, tp))
    assert isinstance(frame, protocol.CompletionRequest) and frame.traceparent == tp
    cancel = protocol.encode_frame(protocol.CancelFrame("j", "r"))
    assert isinstance(protocol.decode_frame(cancel), protocol.CompletionCancel)
    ask = protocol.encode_frame(protocol.ModelsRequestFrame("j", "m"))
    assert isinstance(protocol.decode_frame(ask), protocol.ModelsRequest)
