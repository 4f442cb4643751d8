import asyncio

import pytest

from engine.protocol import FinishReason, RequestOutput, SamplingParams, Scheduling
from engine.wire import (
    MAX_FRAME_BYTES,
    Codec,
    FrameError,
    Outputs,
    Submit,
    ToClient,
    ToWorker,
    parse_address,
    read_frame,
)


def feed(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_round_trip_of_tagged_messages():
    to_worker, to_client = Codec(ToClient), Codec(ToWorker)
    sched = Scheduling(priority=2, tenant="acme", weight=2.5)
    submit = Submit("r1", [1, 2, 3], SamplingParams(max_tokens=5, stop=("x",)), sched)
    frame = to_worker.encode(submit)
    body = await read_frame(feed(frame))
    assert body is not None
    assert to_client.decode(body) == submit
    out = Outputs(
        [
            RequestOutput(
                request_id="r1",
                new_token_ids=[4],
                finish_reason=FinishReason.LENGTH,
                num_output_tokens=5,
            )
        ]
    )
    decoded = to_worker.decode((await read_frame(feed(to_client.encode(out)))) or b"")
    assert isinstance(decoded, Outputs)
    assert decoded.outputs[0].finish_reason is FinishReason.LENGTH


async def test_clean_eof_and_truncated_frames():
    assert await read_frame(feed(b"")) is None
    with pytest.raises(FrameError, match="mid-header"):
        await read_frame(feed(b"\x00\x00"))
    with pytest.raises(FrameError, match="mid-frame"):
        await read_frame(feed(b"\x00\x00\x00\x10abc"))


async def test_oversized_frame_is_refused_before_reading_it():
    header = (MAX_FRAME_BYTES + 1).to_bytes(4, "big")
    with pytest.raises(FrameError, match="exceeds"):
        await read_frame(feed(header))


def test_garbage_and_wrong_types_are_frame_errors():
    codec = Codec(ToWorker)
    with pytest.raises(FrameError):
        codec.decode(b"\xc1garbage")
    bad = Codec(ToClient).encode(Outputs([]))[4:]  # a worker->client message sent the wrong way
    with pytest.raises(FrameError):
        codec.decode(bad)


def test_unknown_sampling_field_is_rejected():
    raw = Codec(ToClient)._enc.encode(
        {
            "type": "submit",
            "request_id": "a",
            "prompt_token_ids": [1],
            "params": {"max_tokens": 1, "bogus": 3},
        }
    )
    with pytest.raises(FrameError, match="bogus"):
        Codec(ToWorker).decode(raw)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("unix:///tmp/e.sock", ("unix", "/tmp/e.sock", 0)),
        ("tcp://127.0.0.1:9000", ("tcp", "127.0.0.1", 9000)),
        ("tcp://[::1]:9000", ("tcp", "::1", 9000)),
        ("tls://worker-3.internal:7000", ("tls", "worker-3.internal", 7000)),
    ],
)
def test_parse_address(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["http://x", "tcp://host", "unix://", "tcp://h:port"])
def test_parse_address_rejects(address):
    with pytest.raises(ValueError, match="address"):
        parse_address(address)
