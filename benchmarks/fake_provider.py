"""A fake LLM provider: OpenAI-like chat completions behind an RPM, a TPM and a concurrency
limit, each enforced as the providers document them, answering 429 with ``retry-after`` past
any of them.

    python -m benchmarks.fake_provider [--rpm 600] [--tpm 100000] [--concurrency 16]
                                       [--no-limit-headers]

It prints ``{"port": N}`` on its first line, serves on 127.0.0.1:N until its standard input
closes, and keeps to the standard library so that its own cost stays small and fixed.

- Requests and tokens are token buckets, full at the start (or at ``POST /reset``, whose
  optional ``{"start_in": seconds}`` says when the run starts) and
  refilling continuously: ``rpm / 60`` requests and ``tpm / 60`` tokens a second.
- A request is admitted when a request is left in the first bucket, its prompt tokens plus
  its ``max_tokens`` in the second, and fewer than ``concurrency`` requests are in flight. It
  is charged that much at once; when it ends, the output tokens it did not use are given
  back (as Anthropic does for output tokens: estimated from ``max_tokens`` at the start,
  adjusted at the end). A prompt counts one token per 4 characters of its messages.
- An admitted request produces 30-100% of its ``max_tokens`` and takes 0.3 s plus 1.2 s per
  thousand output tokens (0.3 to 1.5 s).
- A refused request is charged nothing and answered at once: 429 with ``retry-after``
  (seconds, rounded up) and ``retry-after-ms``, saying when every limit it met will have room
  for it (the first request in flight to end, the buckets' refill).
- Every answer carries OpenAI's ``x-ratelimit-limit-*``, ``-remaining-*`` and ``-reset-*``
  headers for requests and tokens, as OpenAI's and Anthropic's do; with
  ``--no-limit-headers`` it leaves the ``x-ratelimit-limit-*`` ones out (the limits are
  enforced all the same), as a provider that does not state its limits.

``GET /stats`` returns what it admitted and refused since the last reset: requests, tokens
used (prompt plus output), busy time (the sum of the admitted requests' durations, to compare
with ``concurrency`` x the elapsed time), the most requests in flight at once, the refusals by
the limit that caused them and per second, and for how long each bucket sat full (its refill
lost: capacity that nobody used), up to the last request; after a reset that gave the run's
``duration``, a timeline: the buckets' levels, the requests in flight and the counts, each
second and at the end of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from typing import Any

REASONS = ("requests", "tokens", "concurrency")


class Bucket:
    """A token bucket: ``capacity`` per ``per`` seconds, full at the start."""

    def __init__(self, capacity: float, per: float = 60.0, start: float | None = None) -> None:
        self.capacity = capacity
        self.rate = capacity / per
        self.level = capacity
        self.stamp = time.monotonic() if start is None else start
        self.wasted = 0.0  # refill lost to a full bucket: capacity nobody used

    def refill(self, now: float) -> None:
        if now <= self.stamp:
            return
        level = self.level + (now - self.stamp) * self.rate
        self.wasted += max(0.0, level - self.capacity)
        self.level = min(self.capacity, level)
        self.stamp = now

    def wait(self, amount: float) -> float:
        """Seconds until the bucket holds ``amount`` (after :meth:`refill`)."""
        return max(0.0, (amount - self.level) / self.rate)


def prompt_tokens(body: dict[str, Any]) -> int:
    """One token per 4 characters of the messages' text, as a rough tokenizer counts."""
    return sum(math.ceil(len(str(m.get("content", ""))) / 4) for m in body.get("messages", []))


class Provider:
    def __init__(
        self, *, rpm: int, tpm: int, concurrency: int, seed: int = 0, limit_headers: bool = True
    ) -> None:
        self.rpm, self.tpm, self.concurrency = rpm, tpm, concurrency
        self.limit_headers = limit_headers
        self.rng = random.Random(seed)
        self.sampler: asyncio.Task[None] | None = None
        self.reset()

    def reset(self, start_in: float = 0.0, duration: float | None = None) -> None:
        """Full buckets and no counts, as of ``start_in`` seconds from now; with a
        ``duration``, a timeline of the run, one sample a second and one at its end."""
        if self.sampler is not None:
            self.sampler.cancel()
            self.sampler = None
        self.timeline: list[dict[str, float]] = []
        self.started = time.monotonic() + start_in
        self.requests = Bucket(self.rpm, start=self.started)
        self.tokens = Bucket(self.tpm, start=self.started)
        self.ends: list[float] = []  # when each request in flight ends
        self.admitted = 0
        self.completed = 0
        self.tokens_used = 0
        self.busy = 0.0
        self.max_in_flight = 0
        self.refused = dict.fromkeys(REASONS, 0)
        self.refused_per_second: list[int] = []  # 429s in each second since the reset
        self.serial = 0
        if duration is not None:
            self.sampler = asyncio.get_running_loop().create_task(self.sample(duration))

    async def sample(self, duration: float) -> None:
        t = 0.0
        while t < duration:
            t = min(t + 1.0, duration)
            await asyncio.sleep(self.started + t - time.monotonic())
            now = time.monotonic()
            self.requests.refill(now)
            self.tokens.refill(now)
            self.timeline.append(
                {
                    "t": round(now - self.started, 3),
                    "tokens": round(self.tokens.level),
                    "requests": round(self.requests.level, 1),
                    "in_flight": len(self.ends),
                    "admitted": self.admitted,
                    "refused": sum(self.refused.values()),
                }
            )

    def stats(self) -> dict[str, Any]:
        return {
            "elapsed": time.monotonic() - self.started,
            "admitted": self.admitted,
            "completed": self.completed,
            "tokens_used": self.tokens_used,
            "busy": self.busy,
            "max_in_flight": self.max_in_flight,
            "refused": dict(self.refused),
            "refused_per_second": self.refused_per_second,
            "timeline": self.timeline,
            "seconds_full": {
                kind: bucket.wasted / bucket.rate
                for kind, bucket in (("requests", self.requests), ("tokens", self.tokens))
            },
            "limits": {"rpm": self.rpm, "tpm": self.tpm, "concurrency": self.concurrency},
        }

    def _rate_headers(self) -> dict[str, str]:
        headers = {}
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if self.limit_headers:
                headers[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level)))
            headers[f"x-ratelimit-reset-{kind}"] = f"{bucket.wait(bucket.capacity):.3f}s"
        return headers

    async def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
        now = time.monotonic()
        self.requests.refill(now)
        self.tokens.refill(now)
        prompt = prompt_tokens(body)
        max_tokens = int(body.get("max_tokens", 256))
        charge = prompt + max_tokens
        waits: dict[str, float] = {}
        if len(self.ends) >= self.concurrency:
            waits["concurrency"] = min(self.ends) - now
        if self.requests.level < 1:
            waits["requests"] = self.requests.wait(1)
        if self.tokens.level < charge:
            waits["tokens"] = self.tokens.wait(charge)
        if waits:
            reason = max(waits, key=waits.__getitem__)
            self.refused[reason] += 1
            second = max(0, int(now - self.started))
            while len(self.refused_per_second) <= second:
                self.refused_per_second.append(0)
            self.refused_per_second[second] += 1
            retry_after = max(0.001, waits[reason])
            headers = self._rate_headers()
            headers["retry-after"] = str(math.ceil(retry_after))
            headers["retry-after-ms"] = str(math.ceil(retry_after * 1000))
            error = {
                "message": f"Rate limit reached for {reason}; retry in {retry_after:.3f}s.",
                "type": reason,
                "code": "rate_limit_exceeded",
            }
            return 429, headers, {"error": error}

        # Admitted: charged at once, before the first await (no other request can interleave).
        self.requests.level -= 1
        self.tokens.level -= charge
        self.admitted += 1
        self.serial += 1
        serial = self.serial
        output = max(1, round(max_tokens * self.rng.uniform(0.3, 1.0)))
        duration = 0.3 + 1.2 * output / 1000
        end = now + duration
        self.ends.append(end)
        self.max_in_flight = max(self.max_in_flight, len(self.ends))
        try:
            await asyncio.sleep(duration)
        finally:
            self.ends.remove(end)
            done = time.monotonic()
            self.tokens.refill(done)
            self.tokens.level = min(self.tokens.capacity, self.tokens.level + max_tokens - output)
            self.requests.refill(done)
        self.completed += 1
        self.tokens_used += prompt + output
        self.busy += duration
        payload = {
            "id": f"chatcmpl-{serial}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "fake"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "tok " * output},
                    "finish_reason": "length" if output == max_tokens else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": output,
                "total_tokens": prompt + output,
            },
        }
        return 200, self._rate_headers(), payload

    async def route(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, str], Any]:
        if method == "POST" and path == "/v1/chat/completions":
            return await self.complete(json.loads(body))
        if method == "POST" and path == "/reset":
            self.reset(**json.loads(body or b"{}"))
            return 200, {}, {}
        if method == "GET" and path == "/stats":
            return 200, {}, self.stats()
        return 404, {}, {"error": {"message": f"no route {method} {path}"}}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """HTTP/1.1 with keep-alive and Content-Length bodies: what httpx sends."""
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, target, _ = head[0].split(" ", 2)
                fields = dict(line.split(":", 1) for line in head[1:] if line)
                headers = {name.strip().lower(): value.strip() for name, value in fields.items()}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                status, extra, payload = await self.route(method, target, body)
                data = json.dumps(payload).encode()
                lines = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}"]
                lines += [f"{name}: {value}" for name, value in extra.items()]
                lines += ["content-type: application/json", f"content-length: {len(data)}"]
                writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def serve(provider: Provider, port: int = 0) -> None:
    server = await asyncio.start_server(provider.handle, "127.0.0.1", port, backlog=1024)
    print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
    # Serve until the parent closes our standard input (or dies).
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fake_provider")
    parser.add_argument("--rpm", type=int, default=600)
    parser.add_argument("--tpm", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--limit-headers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="state the limits in x-ratelimit-limit-* headers (default: yes)",
    )
    args = parser.parse_args(argv)
    provider = Provider(
        rpm=args.rpm,
        tpm=args.tpm,
        concurrency=args.concurrency,
        seed=args.seed,
        limit_headers=args.limit_headers,
    )
    asyncio.run(serve(provider, args.port))


if __name__ == "__main__":
    main()
