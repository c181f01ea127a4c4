"""What the LLM providers' HTTP exchanges say about their rate limits, read for
`slotwise.httpx`: a request's token estimate, a response's token usage (a JSON body or a
stream of server-sent events) and the rate-limit headers (how long to wait, what is left).

Pure: bytes and header values in, numbers out, `now` passed in. Nothing here raises on
malformed input: a body or a header that cannot be read says nothing.
"""

from __future__ import annotations

import contextlib
import email.utils
import importlib
import json
import math
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import attrs

__all__ = (
    "CHARS_PER_TOKEN",
    "MAX_WAIT",
    "RateHeaders",
    "UsageMeter",
    "estimate_tokens",
    "parse_duration",
    "read_rate_headers",
    "usage_meter",
    "usage_total",
)

# A request's prompt is counted as its JSON body's size in characters over this: English text
# runs about four characters to a token for both providers' tokenizers, and the body's JSON
# punctuation makes the estimate err on the high side, where a rate limit wants it.
CHARS_PER_TOKEN = 4
# The longest pause a header can ask for: a date far in the future (or a mistaken one) pauses
# the limiter for an hour, then one request finds out.
MAX_WAIT = 3600.0
# The output caps of each request shape: OpenAI chat completions (`max_tokens`, and
# `max_completion_tokens` for reasoning models), OpenAI responses (`max_output_tokens`) and
# Anthropic messages (`max_tokens`).
_MAX_TOKENS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# A JSON body's last bytes kept to find its `usage`, which both providers send at its end.
_TAIL = 64 * 1024
# A line of a stream longer than this is not read for usage (a usage event is a few hundred
# bytes; a long line is content).
_MAX_LINE = 1024 * 1024
# A `usage` key with an object for a value (`"usage": null` says nothing).
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_USAGE_KEY = re.compile(r'"usage"\s*:\s*')
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
# The limits named in the rate-limit headers that are read: OpenAI's requests and tokens,
# Anthropic's requests, tokens, input tokens and output tokens.
_LIMITS = ("requests", "tokens", "input-tokens", "output-tokens")


def _count(value: object) -> int | None:
    """A token or request count from JSON: a non-negative integer, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


# -- the request --------------------------------------------------------------------------


def estimate_tokens(body: bytes) -> int:
    """The tokens a request may use, from its JSON body: its output cap (`max_tokens`,
    `max_completion_tokens` or `max_output_tokens`) plus its size in characters over
    `CHARS_PER_TOKEN`. 0 for a body that is not a JSON object (no prompt to count)."""
    stripped = body.lstrip()
    if not stripped.startswith(b"{"):
        return 0
    try:
        request = json.loads(body)
    except ValueError:
        return 0
    if not isinstance(request, dict):
        return 0
    cap = max((_count(request.get(key)) or 0 for key in _MAX_TOKENS), default=0)
    return cap + math.ceil(len(body) / CHARS_PER_TOKEN)


# -- the response's usage -----------------------------------------------------------------


def usage_total(usage: Mapping[str, Any]) -> int | None:
    """The tokens a `usage` object counts, input and output together: OpenAI's
    `total_tokens` (else `prompt_tokens` + `completion_tokens`, or `input_tokens` +
    `output_tokens`), Anthropic's `input_tokens` + `cache_creation_input_tokens` +
    `output_tokens` (what its input and output rate limits count; cache reads are not
    counted). None when it counts nothing recognisable."""
    total = _count(usage.get("total_tokens"))
    if total is not None:
        return total
    for parts in (
        ("prompt_tokens", "completion_tokens"),
        ("input_tokens", "cache_creation_input_tokens", "output_tokens"),
    ):
        counts = [_count(usage.get(part)) for part in parts]
        if any(count is not None for count in counts):
            return sum(count or 0 for count in counts)
    return None


def _usage_of(data: object) -> tuple[dict[str, Any], bool] | None:
    """The usage an object of a response carries, and whether it is the request's final
    count: at the top (a JSON body, an OpenAI chat completion chunk, an Anthropic
    `message_delta`), in `message` (Anthropic's `message_start`: the input, and only the first
    output token) or in `response` (the events of OpenAI's responses API)."""
    if not isinstance(data, dict):
        return None
    for holder in (data, data.get("message"), data.get("response")):
        if isinstance(holder, dict) and isinstance(usage := holder.get("usage"), dict):
            return usage, data.get("type") != "message_start"
    return None


class UsageMeter:
    """Reads a response body as it passes to the client, keeping only what it needs to find
    the request's token usage; `total()` says what it found. Never raises: a body it cannot
    read stops it."""

    __slots__ = ("broken", "decode")

    def __init__(self, decode: Callable[[bytes], bytes] | None) -> None:
        self.decode = decode
        self.broken = False

    def feed(self, chunk: bytes) -> None:
        if self.broken or not chunk:
            return
        try:
            self._feed(self.decode(chunk) if self.decode is not None else chunk)
        except Exception:
            self.broken = True

    def total(self, complete: bool) -> int | None:
        """The tokens used, if the body said (`complete`: it was read to its end)."""
        if self.broken:
            return None
        try:
            return self._total(complete)
        except Exception:
            return None

    def _feed(self, data: bytes) -> None:
        raise NotImplementedError

    def _total(self, complete: bool) -> int | None:
        raise NotImplementedError


class _JsonUsage(UsageMeter):
    """A JSON body: its `usage`, read once the body is complete. Only the last `_TAIL`
    bytes are kept; a larger body is searched there for its last `usage` key (both providers
    send it at the end)."""

    __slots__ = ("cut", "tail")

    def __init__(self, decode: Callable[[bytes], bytes] | None) -> None:
        super().__init__(decode)
        self.tail = bytearray()
        self.cut = False

    def _feed(self, data: bytes) -> None:
        tail = self.tail
        tail += data
        if len(tail) > 2 * _TAIL:
            del tail[:-_TAIL]
            self.cut = True

    def _total(self, complete: bool) -> int | None:
        if not complete:
            return None
        text = self.tail.decode("utf-8", errors="replace")
        if not self.cut:
            found = _usage_of(json.loads(text))
            return None if found is None else usage_total(found[0])
        matches = list(_USAGE_KEY.finditer(text))
        if not matches:
            return None
        usage, _ = json.JSONDecoder().raw_decode(text, matches[-1].end())
        return usage_total(usage) if isinstance(usage, dict) else None


class _EventUsage(UsageMeter):
    """A stream of server-sent events: the usage of its events, merged (Anthropic sends
    the input in `message_start` and the output in `message_delta`; OpenAI sends one usage
    event at the end). Only the line being received is kept."""

    __slots__ = ("final", "line", "skipping", "usage")

    def __init__(self, decode: Callable[[bytes], bytes] | None) -> None:
        super().__init__(decode)
        self.line = bytearray()
        self.skipping = False  # inside a line too long to be read
        self.usage: dict[str, Any] = {}
        self.final = False

    def _feed(self, data: bytes) -> None:
        *lines, rest = data.split(b"\n")
        for line in lines:
            if self.skipping:
                self.skipping = False
            elif self.line:
                self.line += line
                self._read(bytes(self.line))
            else:
                self._read(line)
            self.line.clear()
        if not self.skipping:
            self.line += rest
            if len(self.line) > _MAX_LINE:
                self.line.clear()
                self.skipping = True

    def _read(self, line: bytes) -> None:
        if not line.startswith(b"data:") or _USAGE.search(line) is None:
            return
        with contextlib.suppress(ValueError):
            found = _usage_of(json.loads(line[5:]))
            if found is not None:
                usage, final = found
                self.usage.update((k, v) for k, v in usage.items() if _count(v) is not None)
                self.final = self.final or final

    def _total(self, complete: bool) -> int | None:
        return usage_total(self.usage) if self.final else None


def usage_meter(content_type: str, content_encoding: str) -> UsageMeter | None:
    """A meter for a response body of this type and encoding, or None when it cannot carry
    a usage (not JSON nor a stream of events) or is encoded in a way this process cannot
    decode."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "text/event-stream":
        cls: type[UsageMeter] = _EventUsage
    elif media == "application/json" or media.endswith("+json"):
        cls = _JsonUsage
    else:
        return None
    decoders = []
    for encoding in reversed([e.strip().lower() for e in content_encoding.split(",")]):
        if encoding in ("", "identity"):
            continue
        decoder = _decoder(encoding)
        if decoder is None:
            return None
        decoders.append(decoder)
    if not decoders:
        return cls(None)
    if len(decoders) == 1:
        return cls(decoders[0])

    def decode(data: bytes) -> bytes:
        for step in decoders:
            data = step(data)
        return data

    return cls(decode)


def _decoder(encoding: str) -> Callable[[bytes], bytes] | None:
    """An incremental decoder of a content encoding (those httpx decodes), or None."""
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(zlib.MAX_WBITS | 16).decompress
    if encoding == "deflate":
        return _Deflate().decode
    for name, module_names in (("br", ("brotli", "brotlicffi")), ("zstd", ("zstandard",))):
        if encoding != name:
            continue
        for module_name in module_names:  # what httpx decodes it with, when installed
            with contextlib.suppress(ImportError):
                module: Any = importlib.import_module(module_name)
                if name == "br":
                    return module.Decompressor().process  # type: ignore[no-any-return]
                return module.ZstdDecompressor().decompressobj().decompress  # type: ignore[no-any-return]
    return None


class _Deflate:
    """`deflate` as servers send it: zlib-wrapped, or raw (as httpx accepts both)."""

    __slots__ = ("inner", "started")

    def __init__(self) -> None:
        self.inner = zlib.decompressobj()
        self.started = False

    def decode(self, data: bytes) -> bytes:
        if not self.started:
            self.started = True
            try:
                return self.inner.decompress(data)
            except zlib.error:
                self.inner = zlib.decompressobj(-zlib.MAX_WBITS)
        return self.inner.decompress(data)


# -- the rate-limit headers ---------------------------------------------------------------


@attrs.frozen(kw_only=True)
class RateHeaders:
    """What a response's headers say of the provider's rate limits.

    Attributes:
        requests: Requests left in the provider's window, if it said.
        tokens: Tokens left (the least of the token counts it gave), if it said.
        retry_after: Seconds to wait before the next request: the longest of the waits that
            apply (see `read_rate_headers`); None when none does.
        requests_limit: The provider's requests a minute, if it said.
        tokens_limit: The provider's tokens a minute, if it said (see `read_rate_headers`).
    """

    requests: int | None = None
    tokens: int | None = None
    retry_after: float | None = None
    requests_limit: int | None = None
    tokens_limit: int | None = None


def read_rate_headers(
    headers: Iterable[tuple[str, str]], now: float, tokens_needed: int = 0
) -> RateHeaders:
    """Read the rate-limit headers of a response (names in any case).

    Remaining: OpenAI's `x-ratelimit-remaining-requests` / `-tokens`; Anthropic's
    `anthropic-ratelimit-requests-remaining` and `-tokens-remaining`, `-input-tokens-remaining`,
    `-output-tokens-remaining` (the least of the token counts).

    Limits (a minute): OpenAI's `x-ratelimit-limit-requests` / `-tokens`; Anthropic's
    `anthropic-ratelimit-requests-limit`, and for tokens the sum of
    `anthropic-ratelimit-input-tokens-limit` and `-output-tokens-limit` when it gives both
    (slotwise counts input and output together; the sum never limits below either of the
    provider's), else `anthropic-ratelimit-tokens-limit`. A limit of 0 says nothing.

    Wait: `retry-after` (seconds, or an HTTP date) and `retry-after-ms` always apply; a
    limit's reset (OpenAI's `x-ratelimit-reset-requests` / `-tokens`, durations such as
    `"6m0s"`; Anthropic's `anthropic-ratelimit-*-reset`, RFC 3339 times) applies when that
    limit could not serve this request: its remaining count is missing, or below one request,
    or below `tokens_needed` (at least one) tokens. The longest wait that applies wins, capped
    at `MAX_WAIT`. A malformed header is ignored.

    Args:
        headers: The response's header names and values.
        now: The wall clock (`time.time()`), for the dates.
        tokens_needed: The request's token estimate.
    """
    values: dict[str, str] = {}
    for name, text in headers:
        values.setdefault(name.lower(), text)
    remaining: dict[str, int | None] = {}
    resets: dict[str, float | None] = {}
    limits: dict[str, int] = {}
    for limit in _LIMITS:
        for name in (f"x-ratelimit-limit-{limit}", f"anthropic-ratelimit-{limit}-limit"):
            if (value := values.get(name)) is not None and (count := _remaining(value)):
                limits[limit] = count
        if (value := values.get(f"x-ratelimit-remaining-{limit}")) is not None:
            remaining[limit] = _remaining(value)
        if (value := values.get(f"anthropic-ratelimit-{limit}-remaining")) is not None:
            remaining[limit] = _remaining(value)
        if (value := values.get(f"x-ratelimit-reset-{limit}")) is not None:
            resets[limit] = parse_duration(value)
        if (value := values.get(f"anthropic-ratelimit-{limit}-reset")) is not None:
            resets[limit] = _until(_rfc3339(value), now)
    waits = [
        _seconds(values.get("retry-after"), now),
        _milliseconds(values.get("retry-after-ms")),
    ]
    for limit, wait in resets.items():
        left = remaining.get(limit)
        needed = 1 if limit == "requests" else max(1, tokens_needed)
        if left is None or left < needed:
            waits.append(wait)
    given = [wait for wait in waits if wait is not None]
    token_counts = [
        count for limit, count in remaining.items() if limit != "requests" and count is not None
    ]
    tokens_limit = limits.get("tokens")
    if "input-tokens" in limits and "output-tokens" in limits:
        tokens_limit = limits["input-tokens"] + limits["output-tokens"]
    return RateHeaders(
        requests=remaining.get("requests"),
        tokens=min(token_counts, default=None),
        retry_after=min(max(given), MAX_WAIT) if given else None,
        requests_limit=limits.get("requests"),
        tokens_limit=tokens_limit,
    )


def _remaining(value: str) -> int | None:
    value = value.strip()
    return int(value) if value.isascii() and value.isdigit() else None


def _number(value: str) -> float | None:
    value = value.strip()
    return float(value) if _NUMBER.fullmatch(value) else None


def _seconds(value: str | None, now: float) -> float | None:
    """`retry-after`: seconds (an integer, or a decimal as some servers send), or an HTTP
    date."""
    if value is None:
        return None
    number = _number(value)
    if number is not None:
        return number
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return _until(when, now)


def _milliseconds(value: str | None) -> float | None:
    number = None if value is None else _number(value)
    return None if number is None else number / 1000.0


def parse_duration(value: str) -> float | None:
    """Seconds from a duration such as OpenAI's reset headers give (`"6m0s"`, `"1s"`,
    `"20ms"`, `"1h2m3.5s"`), or a plain number of seconds; None when malformed."""
    value = value.strip()
    number = _number(value)
    if number is not None:
        return number
    position, total = 0, 0.0
    for match in _DURATION.finditer(value):
        if match.start() != position:
            return None
        position = match.end()
        total += float(match[1]) * _UNIT[match[2]]
    return total if position == len(value) and position > 0 else None


def _rfc3339(value: str) -> datetime | None:
    try:
        return datetime.fromisoformat(value.strip())
    except ValueError:
        return None


def _until(when: datetime | None, now: float) -> float | None:
    """Seconds from `now` until `when` (0 when past); a time without a zone is UTC."""
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    try:
        return max(0.0, when.timestamp() - now)
    except (OverflowError, OSError, ValueError):
        return None
