"""Fixtures for the tool-call tests: a fake provider that asks for tools, and PostgreSQL.

The fake provider is the integration tests' one (``tests/integrations/conftest.py``), answering
the Anthropic messages, OpenAI chat completions and OpenAI Responses endpoints as a model that
uses tools: the first request of a conversation gets four tool calls (one with malformed JSON
arguments for OpenAI), and a request that carries tool results gets an answer that quotes them,
id by id, so a test can see which result reached the model for which call.

The PostgreSQL fixtures (a reachable server or a skip, a unique schema) are those of
``tests/postgres/conftest.py``, loaded from that file.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from integrations.conftest import (  # the fake provider and its fixtures
    FakeProvider,
    _provider_server,
    _respond,
    provider,
)

__all__ = ("FakeProvider", "_provider_server", "provider")

_spec = importlib.util.spec_from_file_location(
    "tools_postgres_fixtures", Path(__file__).parent.parent / "postgres" / "conftest.py"
)
assert _spec is not None
assert _spec.loader is not None
_postgres = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_postgres)
dsn = _postgres.dsn
schema = _postgres.schema
tagged_dsn = _postgres.tagged_dsn
limiters = _postgres.limiters
eventually = _postgres.eventually

# What the fake model asks for on its first turn: (call id, tool, arguments as JSON text).
ASKED = [
    ("call_paris", "get_weather", '{"city": "Paris"}'),
    ("call_oslo", "get_weather", '{"city": "Oslo"}'),
    ("call_lima", "get_weather", '{"city": "Lima"}'),
    ("call_eur", "convert", '{"amount": 100, "to": "EUR"}'),
]
BROKEN = '{"amount": 100, "to": '  # what the fake OpenAI model sends for the last call


def answer_text(results: list[tuple[str, str]]) -> str:
    """The fake model's answer once it has the results: each call id with what it got."""
    return " | ".join(f"{call_id}: {content}" for call_id, content in results)


def _anthropic(request: dict[str, Any]) -> dict[str, Any]:
    last = request["messages"][-1]["content"]
    got = [
        (block["tool_use_id"], ("error: " if block.get("is_error") else "") + block["content"])
        for block in (last if isinstance(last, list) else [])
        if block.get("type") == "tool_result"
    ]
    if got:
        content: list[dict[str, Any]] = [{"type": "text", "text": answer_text(got)}]
    else:
        content = [
            {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments)}
            for call_id, name, arguments in ASKED
        ]
    return {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": "fake",
        "content": content,
        "stop_reason": "end_turn" if got else "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }


def _openai_arguments(call_id: str, arguments: str) -> str:
    return BROKEN if call_id == "call_eur" else arguments


def _chat(request: dict[str, Any]) -> dict[str, Any]:
    got = [(m["tool_call_id"], m["content"]) for m in request["messages"] if m["role"] == "tool"]
    message: dict[str, Any] = {"role": "assistant", "content": answer_text(got) if got else None}
    if not got:
        message["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": _openai_arguments(call_id, arguments)},
            }
            for call_id, name, arguments in ASKED
        ]
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": "fake",
        "choices": [
            {"index": 0, "message": message, "finish_reason": "stop" if got else "tool_calls"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def _responses(request: dict[str, Any]) -> dict[str, Any]:
    items = request["input"] if isinstance(request["input"], list) else []
    got = [(i["call_id"], i["output"]) for i in items if i.get("type") == "function_call_output"]
    if got:
        output: list[dict[str, Any]] = [
            {
                "type": "message",
                "id": "msg_fake",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": answer_text(got), "annotations": []}],
            }
        ]
    else:
        output = [
            {
                "type": "function_call",
                "id": f"fc_{call_id}",
                "call_id": call_id,
                "name": name,
                "arguments": _openai_arguments(call_id, arguments),
                "status": "completed",
            }
            for call_id, name, arguments in ASKED
        ]
    return {
        "id": "resp_fake",
        "object": "response",
        "created_at": 0,
        "model": "fake",
        "status": "completed",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


_SCRIPTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "/messages": _anthropic,
    "/chat/completions": _chat,
    "/responses": _responses,
}


@pytest.fixture
def tool_model(provider: FakeProvider, monkeypatch: pytest.MonkeyPatch) -> FakeProvider:
    """The fake provider, answering as a model that asks for the ``ASKED`` tools."""
    plain = provider._answer

    async def answer(
        path: str, headers: dict[str, str], body: bytes, send: Any, finish: Any, gone: Any
    ) -> None:
        for suffix, script in _SCRIPTS.items():
            if path.endswith(suffix):
                finish()
                await _respond(send, 200, script(json.loads(body)))
                return
        await plain(path, headers, body, send, finish, gone)

    monkeypatch.setattr(provider, "_answer", answer)
    return provider
