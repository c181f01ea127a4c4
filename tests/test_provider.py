"""What slotwise.httpx reads from the providers' exchanges: token estimates, usage in bodies
and streams, and rate-limit headers (each format, and malformed ones, which never raise)."""

from __future__ import annotations

import gzip
import json
import math
import zlib
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slotwise._provider import (
    MAX_WAIT,
    RateHeaders,
    estimate_tokens,
    parse_duration,
    read_rate_headers,
    usage_meter,
    usage_total,
)

NOW = 1_800_000_000.0  # a wall-clock time, seconds since the epoch


def rfc3339(seconds_from_now: float) -> str:
    return (datetime.fromtimestamp(NOW, UTC) + timedelta(seconds=seconds_from_now)).isoformat()


def http_date(seconds_from_now: float) -> str:
    return format_datetime(
        datetime.fromtimestamp(NOW, UTC) + timedelta(seconds=seconds_from_now), usegmt=True
    )


# -- estimates ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_body", "cap"),
    [
        ({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}, 100),
        ({"model": "m", "max_completion_tokens": 70, "messages": []}, 70),
        ({"model": "m", "max_output_tokens": 50, "input": "a long prompt " * 20}, 50),
        ({"model": "m", "messages": []}, 0),  # no cap: the size alone
        ({"model": "m", "max_tokens": None, "messages": []}, 0),
        ({"model": "m", "max_tokens": "100", "messages": []}, 0),
        ({"model": "m", "max_tokens": -5, "messages": []}, 0),
        ({"model": "m", "max_tokens": True, "messages": []}, 0),
    ],
)
def test_the_estimate_is_the_output_cap_plus_the_size(request_body: object, cap: int) -> None:
    body = json.dumps(request_body).encode()
    assert estimate_tokens(body) == cap + math.ceil(len(body) / 4)


def test_a_cap_inside_the_messages_is_not_the_requests() -> None:
    tool_use = {"type": "tool_use", "id": "t", "name": "llm", "input": {"max_tokens": 9999}}
    body = json.dumps(
        {
            "messages": [
                {"role": "user", "content": '{"max_tokens": 9999}'},
                {"role": "assistant", "content": [tool_use]},
            ],
            "max_tokens": 10,
        }
    ).encode()
    assert estimate_tokens(body) == 10 + math.ceil(len(body) / 4)


@pytest.mark.parametrize(
    "body", [b"", b"   ", b"[1, 2]", b"not json", b'{"max_tokens": 1', b"\xff\xfe{", b"{}}"]
)
def test_a_body_that_is_no_json_object_costs_nothing(body: bytes) -> None:
    assert estimate_tokens(body) == 0


# -- usage ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("usage", "total"),
    [
        ({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}, 15),
        ({"prompt_tokens": 10, "completion_tokens": 5}, 15),
        ({"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}, 15),  # responses API
        ({"input_tokens": 10, "output_tokens": 5}, 15),  # Anthropic
        (
            {
                "input_tokens": 10,
                "cache_creation_input_tokens": 100,
                "cache_read_input_tokens": 1000,
                "output_tokens": 5,
            },
            115,
        ),
        ({"output_tokens": 7}, 7),  # Anthropic's message_delta alone
        ({"total_tokens": None, "prompt_tokens": 3, "completion_tokens": 4}, 7),
        ({}, None),
        ({"total_tokens": "15"}, None),
        ({"input_tokens": -1}, None),
    ],
)
def test_the_usage_total(usage: dict[str, object], total: int | None) -> None:
    assert usage_total(usage) == total


def feed_in_pieces(content_type: str, encoding: str, body: bytes, size: int) -> int | None:
    meter = usage_meter(content_type, encoding)
    assert meter is not None
    for start in range(0, len(body), size):
        meter.feed(body[start : start + size])
    return meter.total(True)


OPENAI_COMPLETION = {
    "id": "chatcmpl-1",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": '"usage": {"x": 1}'}}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42},
}
ANTHROPIC_MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "content": [{"type": "tool_use", "input": {"usage": {"input_tokens": 999}}}],
    "usage": {"input_tokens": 12, "output_tokens": 30},
}


def sse(*events: tuple[str, object], crlf: bool = False) -> bytes:
    end = "\r\n" if crlf else "\n"
    text = ""
    for name, data in events:
        if name:
            text += f"event: {name}{end}"
        text += f"data: {data if isinstance(data, str) else json.dumps(data)}{end}{end}"
    return text.encode()


def openai_stream(with_usage: bool) -> bytes:
    chunk = {"choices": [{"delta": {"content": "hi"}}], "usage": None}
    events: list[tuple[str, object]] = [("", chunk), ("", chunk)]
    if with_usage:
        usage = {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42}
        events.append(("", {"choices": [], "usage": usage}))
    return sse(*events, ("", "[DONE]"))


def anthropic_stream(*, input_in_delta: bool = False) -> bytes:
    delta_usage: dict[str, int] = {"output_tokens": 30}
    if input_in_delta:
        delta_usage["input_tokens"] = 12
    return sse(
        (
            "message_start",
            {
                "type": "message_start",
                "message": {"usage": {"input_tokens": 12, "output_tokens": 1}},
            },
        ),
        ("content_block_delta", {"type": "content_block_delta", "delta": {"text": "hi"}}),
        ("message_delta", {"type": "message_delta", "usage": delta_usage}),
        ("message_stop", {"type": "message_stop"}),
    )


RESPONSES_STREAM = sse(
    ("response.created", {"type": "response.created", "response": {"usage": None}}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "hi"}),
    (
        "response.completed",
        {
            "type": "response.completed",
            "response": {"usage": {"input_tokens": 12, "output_tokens": 30, "total_tokens": 42}},
        },
    ),
)

BODIES = [
    ("application/json", json.dumps(OPENAI_COMPLETION).encode()),
    ("application/json; charset=utf-8", json.dumps(ANTHROPIC_MESSAGE).encode()),
    ("text/event-stream", openai_stream(True)),
    ("text/event-stream; charset=utf-8", anthropic_stream()),
    ("text/event-stream", anthropic_stream(input_in_delta=True)),
    ("text/event-stream", sse(("", {"usage": {"total_tokens": 42}}), crlf=True)),
    ("text/event-stream", RESPONSES_STREAM),
]


@pytest.mark.parametrize(("content_type", "body"), BODIES)
@pytest.mark.parametrize("size", [1, 7, 64, 1 << 20])
def test_usage_is_found_however_the_body_is_cut(content_type: str, body: bytes, size: int) -> None:
    assert feed_in_pieces(content_type, "", body, size) == 42


def deflate_raw(body: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(body) + compressor.flush()


ENCODINGS = [
    ("gzip", gzip.compress),
    ("x-gzip", gzip.compress),
    ("deflate", zlib.compress),
    ("deflate", deflate_raw),
    ("gzip, gzip", lambda body: gzip.compress(gzip.compress(body))),
    ("identity", lambda body: body),
]


@pytest.mark.parametrize(("encoding", "encode"), ENCODINGS)
@pytest.mark.parametrize(("content_type", "body"), BODIES[:3])
def test_usage_is_found_in_an_encoded_body(
    encoding: str, encode: object, content_type: str, body: bytes
) -> None:
    assert callable(encode)
    assert feed_in_pieces(content_type, encoding, encode(body), 5) == 42


def test_usage_is_found_in_a_zstd_body() -> None:
    zstandard = pytest.importorskip("zstandard")
    body = json.dumps(OPENAI_COMPLETION).encode()
    encoded = zstandard.ZstdCompressor().compress(body)
    assert feed_in_pieces("application/json", "zstd", encoded, 5) == 42


def test_a_large_json_body_keeps_only_its_tail_and_still_finds_its_usage() -> None:
    big = {**OPENAI_COMPLETION, "choices": [{"message": {"content": "x" * 1_000_000}}]}
    body = json.dumps(big).encode()
    meter = usage_meter("application/json", "")
    assert meter is not None
    for start in range(0, len(body), 4096):
        meter.feed(body[start : start + 4096])
        assert len(meter.tail) <= 2 * 64 * 1024 + 4096  # type: ignore[attr-defined]
    assert meter.total(True) == 42


def test_a_long_stream_line_is_skipped_not_kept() -> None:
    usage = sse(("", {"usage": {"total_tokens": 42}}))
    body = b"data: " + b"x" * 3_000_000 + b"\n\n" + usage
    meter = usage_meter("text/event-stream", "")
    assert meter is not None
    for start in range(0, len(body), 65536):
        meter.feed(body[start : start + 65536])
        assert len(meter.line) <= 1024 * 1024 + 65536  # type: ignore[attr-defined]
    assert meter.total(True) == 42


@pytest.mark.parametrize(
    ("content_type", "body", "complete", "total"),
    [
        # A JSON body cut short says nothing; a stream says what it said, when it is final.
        ("application/json", json.dumps(OPENAI_COMPLETION).encode(), False, None),
        ("text/event-stream", openai_stream(True), False, 42),
        ("text/event-stream", openai_stream(False), True, None),  # no include_usage
        # Only message_start: the input and one output token, not the request's usage.
        ("text/event-stream", anthropic_stream()[:200], False, None),
        ("application/json", b'{"usage": null}', True, None),
        ("application/json", b"[1, 2, 3]", True, None),
        ("application/json", b'{"usage": {"total_tokens": 42}', True, None),  # truncated
        ("application/json", b"\x00\xff garbage", True, None),
        ("text/event-stream", b'data: {"usage": {"total_tokens": 4\n\n', True, None),
        ("text/event-stream", b'data: {"usage": {"total_tokens": -4}}\n\n', True, None),
    ],
)
def test_what_says_no_usage(
    content_type: str, body: bytes, complete: bool, total: int | None
) -> None:
    meter = usage_meter(content_type, "")
    assert meter is not None
    meter.feed(body)
    assert meter.total(complete) == total


def test_an_anthropic_stream_ended_early_keeps_its_estimate() -> None:
    body = anthropic_stream()
    cut = body.index(b"event: message_delta")
    meter = usage_meter("text/event-stream", "")
    assert meter is not None
    meter.feed(body[:cut])
    assert meter.total(False) is None


@pytest.mark.parametrize(
    ("content_type", "encoding"),
    [("text/plain", ""), ("application/octet-stream", ""), ("", ""), ("application/json", "lzma")],
)
def test_bodies_that_cannot_carry_a_readable_usage_get_no_meter(
    content_type: str, encoding: str
) -> None:
    assert usage_meter(content_type, encoding) is None


def test_a_body_that_fails_to_decode_stops_the_meter_without_raising() -> None:
    meter = usage_meter("application/json", "gzip")
    assert meter is not None
    meter.feed(b"this is not gzip")
    meter.feed(gzip.compress(json.dumps(OPENAI_COMPLETION).encode()))
    assert meter.total(True) is None


@given(st.binary(max_size=300), st.sampled_from(["application/json", "text/event-stream"]))
def test_no_body_makes_a_meter_raise(body: bytes, content_type: str) -> None:
    for encoding in ("", "gzip", "deflate"):
        meter = usage_meter(content_type, encoding)
        assert meter is not None
        meter.feed(body)
        total = meter.total(True)
        assert total is None or total >= 0


# -- rate-limit headers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("6m0s", 360.0),
        ("1s", 1.0),
        ("20ms", 0.02),
        ("1h2m3.5s", 3723.5),
        ("0.5s", 0.5),
        ("7.66s", 7.66),
        ("2m59.56s", 179.56),
        ("1500us", 0.0015),
        ("250ns", 2.5e-7),
        ("3", 3.0),
        ("0.25", 0.25),
        (" 1s ", 1.0),
    ],
)
def test_durations(value: str, seconds: float) -> None:
    assert parse_duration(value) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value", ["", "s", "1x", "-1s", "1s2", "ms", "1.2.3s", "1 s", "inf", "nan", "1e3s", "1m-2s"]
)
def test_malformed_durations(value: str) -> None:
    assert parse_duration(value) is None


def headers(**values: str) -> list[tuple[str, str]]:
    return [(name.replace("_", "-"), value) for name, value in values.items()]


@pytest.mark.parametrize(
    ("given_headers", "tokens_needed", "expected"),
    [
        # retry-after: seconds, decimals, an HTTP date; retry-after-ms.
        (headers(retry_after="12"), 0, RateHeaders(retry_after=12.0)),
        (headers(retry_after="0.5"), 0, RateHeaders(retry_after=0.5)),
        (headers(retry_after=http_date(30)), 0, RateHeaders(retry_after=30.0)),
        (headers(retry_after=http_date(-30)), 0, RateHeaders(retry_after=0.0)),
        (headers(retry_after_ms="1500"), 0, RateHeaders(retry_after=1.5)),
        # The longest wait wins.
        (headers(retry_after="1", retry_after_ms="2500"), 0, RateHeaders(retry_after=2.5)),
        # OpenAI: resets apply when their limit could not serve the request.
        (
            headers(
                x_ratelimit_remaining_requests="0",
                x_ratelimit_remaining_tokens="5000",
                x_ratelimit_reset_requests="20ms",
                x_ratelimit_reset_tokens="6m0s",
            ),
            100,
            RateHeaders(requests=0, tokens=5000, retry_after=0.02),
        ),
        (
            headers(
                x_ratelimit_remaining_requests="99",
                x_ratelimit_remaining_tokens="50",
                x_ratelimit_reset_requests="20ms",
                x_ratelimit_reset_tokens="1.5s",
            ),
            100,
            RateHeaders(requests=99, tokens=50, retry_after=1.5),
        ),
        (
            headers(
                retry_after="3",
                x_ratelimit_remaining_requests="99",
                x_ratelimit_remaining_tokens="5000",
                x_ratelimit_reset_requests="20ms",
                x_ratelimit_reset_tokens="6m0s",
            ),
            100,
            RateHeaders(requests=99, tokens=5000, retry_after=3.0),
        ),
        # A reset without its remaining count applies.
        (headers(x_ratelimit_reset_tokens="2s"), 0, RateHeaders(retry_after=2.0)),
        # Anthropic: RFC 3339 resets, four limits; the least token count is what is left.
        (
            headers(
                retry_after="4",
                anthropic_ratelimit_requests_remaining="10",
                anthropic_ratelimit_requests_reset=rfc3339(60),
                anthropic_ratelimit_tokens_remaining="0",
                anthropic_ratelimit_tokens_reset=rfc3339(20),
                anthropic_ratelimit_input_tokens_remaining="3000",
                anthropic_ratelimit_input_tokens_reset=rfc3339(5),
                anthropic_ratelimit_output_tokens_remaining="0",
                anthropic_ratelimit_output_tokens_reset=rfc3339(9),
            ),
            100,
            RateHeaders(requests=10, tokens=0, retry_after=20.0),
        ),
        (
            headers(
                anthropic_ratelimit_requests_remaining="0",
                anthropic_ratelimit_requests_reset=rfc3339(7.5).replace("+00:00", "Z"),
            ),
            0,
            RateHeaders(requests=0, retry_after=7.5),
        ),
        (
            headers(anthropic_ratelimit_tokens_reset="2030-01-01T00:00:00"),  # no zone: UTC
            0,
            RateHeaders(
                retry_after=min(MAX_WAIT, datetime(2030, 1, 1, tzinfo=UTC).timestamp() - NOW)
            ),
        ),
        # Names in any case; the first of repeated headers.
        (
            [("Retry-After", "5"), ("retry-after", "50"), ("X-RateLimit-Remaining-Tokens", "7")],
            0,
            RateHeaders(tokens=7, retry_after=5.0),
        ),
        # A wait longer than an hour is an hour.
        (headers(retry_after="86400"), 0, RateHeaders(retry_after=MAX_WAIT)),
        (headers(retry_after=http_date(10**7)), 0, RateHeaders(retry_after=MAX_WAIT)),
        (headers(retry_after="9" * 400), 0, RateHeaders(retry_after=MAX_WAIT)),
        # Nothing said: a backoff.
        ([], 0, RateHeaders()),
        (headers(content_type="application/json"), 0, RateHeaders()),
    ],
)
def test_rate_headers(
    given_headers: list[tuple[str, str]], tokens_needed: int, expected: RateHeaders
) -> None:
    said = read_rate_headers(given_headers, NOW, tokens_needed)
    assert said.requests == expected.requests
    assert said.tokens == expected.tokens
    if expected.retry_after is None:
        assert said.retry_after is None
    else:
        assert said.retry_after == pytest.approx(expected.retry_after, abs=1e-6)


@pytest.mark.parametrize(
    ("given_headers", "requests_limit", "tokens_limit"),
    [
        # OpenAI: a minute's requests and tokens.
        (
            headers(x_ratelimit_limit_requests="600", x_ratelimit_limit_tokens="100000"),
            600,
            100_000,
        ),
        # Anthropic: the input and output limits together, as slotwise counts tokens.
        (
            headers(
                anthropic_ratelimit_requests_limit="50",
                anthropic_ratelimit_tokens_limit="8000",
                anthropic_ratelimit_input_tokens_limit="40000",
                anthropic_ratelimit_output_tokens_limit="8000",
            ),
            50,
            48_000,
        ),
        # Only the combined limit, or only one of input and output: the combined one.
        (headers(anthropic_ratelimit_tokens_limit="80000"), None, 80_000),
        (
            headers(
                anthropic_ratelimit_tokens_limit="80000",
                anthropic_ratelimit_output_tokens_limit="16000",
            ),
            None,
            80_000,
        ),
        (headers(anthropic_ratelimit_input_tokens_limit="40000"), None, None),
        # A limit of 0 says nothing (no provider allows nothing and answers).
        (headers(x_ratelimit_limit_requests="0", x_ratelimit_limit_tokens="0"), None, None),
        ([("X-RateLimit-Limit-Tokens", "2000")], None, 2_000),
        ([], None, None),
    ],
)
def test_limit_headers(
    given_headers: list[tuple[str, str]], requests_limit: int | None, tokens_limit: int | None
) -> None:
    said = read_rate_headers(given_headers, NOW, 0)
    assert (said.requests_limit, said.tokens_limit) == (requests_limit, tokens_limit)
    assert said.retry_after is None  # a limit is no reason to wait


MALFORMED = [
    "",
    " ",
    "soon",
    "-5",
    "1e3",
    "inf",
    "NaN",
    "12 seconds",
    "Wed, 99 Foo 2025 99:99:99 GMT",
    "Mon, 01 Jan 99999 00:00:00 GMT",
    "2025-13-45T25:61:00Z",
    "\x00\xff",
    "١٢",  # Arabic-Indic digits: str.isdigit() is true, int() would read them
    "1,000",
    "0x10",
]


@pytest.mark.parametrize("value", MALFORMED)
@pytest.mark.parametrize(
    "name",
    [
        "retry-after",
        "retry-after-ms",
        "x-ratelimit-reset-requests",
        "x-ratelimit-reset-tokens",
        "anthropic-ratelimit-tokens-reset",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-remaining-tokens",
        "anthropic-ratelimit-requests-remaining",
        "anthropic-ratelimit-output-tokens-remaining",
        "x-ratelimit-limit-requests",
        "x-ratelimit-limit-tokens",
        "anthropic-ratelimit-tokens-limit",
    ],
)
def test_a_malformed_header_says_nothing(name: str, value: str) -> None:
    said = read_rate_headers([(name, value)], NOW, 100)
    assert said.requests is None
    assert said.tokens is None
    assert said.requests_limit is None
    assert said.tokens_limit is None
    assert said.retry_after is None  # even a reset, whose limit's count is unknown


@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "retry-after",
                    "retry-after-ms",
                    "x-ratelimit-reset-requests",
                    "x-ratelimit-reset-tokens",
                    "x-ratelimit-remaining-requests",
                    "x-ratelimit-remaining-tokens",
                    "anthropic-ratelimit-requests-reset",
                    "anthropic-ratelimit-input-tokens-remaining",
                    "anthropic-ratelimit-output-tokens-reset",
                    "x-ratelimit-limit-tokens",
                    "anthropic-ratelimit-input-tokens-limit",
                    "anthropic-ratelimit-output-tokens-limit",
                ]
            ),
            st.text(max_size=40),
        ),
        max_size=6,
    ),
    st.integers(min_value=0, max_value=10**9),
)
def test_no_header_makes_the_reader_raise(pairs: list[tuple[str, str]], needed: int) -> None:
    said = read_rate_headers(pairs, NOW, needed)
    assert said.requests is None or said.requests >= 0
    assert said.tokens is None or said.tokens >= 0
    assert said.retry_after is None or 0 <= said.retry_after <= MAX_WAIT
    assert said.requests_limit is None or said.requests_limit > 0
    assert said.tokens_limit is None or said.tokens_limit > 0
