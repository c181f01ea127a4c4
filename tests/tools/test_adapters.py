"""The SDK adapters, with the real ``anthropic`` and ``openai`` types, and one full agent turn per
API against the fake provider: the model asks for four tools, one fails, the results go back
matched by id, and the model answers."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from anthropic import AsyncAnthropic
from anthropic.types import Message
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.responses import Response

from slotwise import MemoryLimiter, Workload
from slotwise.tools import (
    ToolBox,
    ToolCall,
    ToolResult,
    from_anthropic,
    from_openai,
    from_openai_responses,
    to_anthropic,
    to_openai,
    to_openai_responses,
)

from .conftest import ASKED, BROKEN, FakeProvider, answer_text

pytestmark = pytest.mark.anyio

RESULTS = [
    ToolResult(call_id="a", name="t", content="fine"),
    ToolResult(call_id="b", name="t", content="Tool 't' failed: E", error="failed", effect="none"),
]


def anthropic_message(content: list[dict[str, Any]]) -> Message:
    return Message.model_validate(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": content,
            "stop_reason": "tool_use",
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
    )


def test_from_anthropic_reads_the_tool_use_blocks_in_order() -> None:
    content: list[dict[str, Any]] = [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {"q": "x"}},
        {"type": "tool_use", "id": "toolu_2", "name": "fetch", "input": {}},
    ]
    expected = [
        ToolCall(id="toolu_1", name="search", arguments={"q": "x"}),
        ToolCall(id="toolu_2", name="fetch", arguments={}),
    ]
    assert from_anthropic(anthropic_message(content)) == expected
    assert from_anthropic({"content": content}) == expected  # the same data as a dict
    assert from_anthropic(anthropic_message([{"type": "text", "text": "done"}])) == []
    assert from_anthropic({"role": "assistant", "content": "plain text"}) == []


def test_to_anthropic_gives_tool_result_blocks() -> None:
    assert to_anthropic(RESULTS) == [
        {"type": "tool_result", "tool_use_id": "a", "content": "fine", "is_error": False},
        {
            "type": "tool_result",
            "tool_use_id": "b",
            "content": "Tool 't' failed: E",
            "is_error": True,
        },
    ]


def test_from_openai_reads_the_function_tool_calls() -> None:
    completion = ChatCompletion.model_validate(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "search", "arguments": '{"q": "x"}'},
                            },
                            {
                                "id": "call_2",
                                "type": "function",
                                "function": {"name": "fetch", "arguments": ""},
                            },
                        ],
                    },
                }
            ],
        }
    )
    message = completion.choices[0].message
    expected = [
        ToolCall(id="call_1", name="search", arguments='{"q": "x"}'),
        ToolCall(id="call_2", name="fetch", arguments=""),
    ]
    assert from_openai(message) == expected
    assert from_openai(message.to_dict()) == expected
    assert from_openai(ChatCompletionMessage(role="assistant", content="done")) == []


def test_to_openai_gives_tool_messages() -> None:
    assert to_openai(RESULTS) == [
        {"role": "tool", "tool_call_id": "a", "content": "fine"},
        {"role": "tool", "tool_call_id": "b", "content": "Tool 't' failed: E"},
    ]


def test_from_openai_responses_reads_the_function_call_items() -> None:
    response = Response.model_validate(
        {
            "id": "r",
            "object": "response",
            "created_at": 0,
            "model": "m",
            "status": "completed",
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "output": [
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                },
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_1",
                    "name": "search",
                    "arguments": '{"q": "x"}',
                },
            ],
        }
    )
    expected = [ToolCall(id="call_1", name="search", arguments='{"q": "x"}')]
    assert from_openai_responses(response) == expected
    assert from_openai_responses(response.output) == expected
    assert from_openai_responses(response.to_dict()) == expected


def test_to_openai_responses_gives_function_call_outputs() -> None:
    assert to_openai_responses(RESULTS) == [
        {"type": "function_call_output", "call_id": "a", "output": "fine"},
        {"type": "function_call_output", "call_id": "b", "output": "Tool 't' failed: E"},
    ]


async def test_json_text_arguments_are_parsed_by_the_toolbox() -> None:
    box = ToolBox(limiter=MemoryLimiter(max_concurrent=2))

    @box.tool
    async def fetch() -> str:
        return "fetched"

    @box.tool
    async def search(q: str) -> str:
        return q

    results = await box.run(
        [
            ToolCall(id="1", name="fetch", arguments=""),  # no arguments at all
            ToolCall(id="2", name="search", arguments='{"q": "x"}'),
            ToolCall(id="3", name="search", arguments='{"q": '),
        ]
    )
    assert [(r.content, r.error) for r in results[:2]] == [("fetched", None), ("x", None)]
    assert results[2].error == "invalid-arguments"


# -- one agent turn per API, against the fake provider --------------------------------------------


WEATHER = {"Paris": "18 °C", "Lima": "24 °C"}  # no Oslo: that call fails


def weather_box() -> tuple[ToolBox[str], list[str]]:
    box = ToolBox(
        limiter=MemoryLimiter(
            name="tools",
            max_concurrent=4,
            workloads={"weather": Workload(max_concurrent=2), "default": Workload()},
        )
    )
    ran: list[str] = []

    @box.tool(pool="weather")
    async def get_weather(city: str) -> str:
        ran.append(city)
        await anyio.sleep(0.01)
        return WEATHER[city]

    @box.tool
    async def convert(amount: float, to: str) -> dict[str, Any]:
        return {"amount": amount * 0.92, "currency": to}

    return box, ran


FAILED_OSLO = "Tool 'get_weather' failed: KeyError: 'Oslo'"
CONVERTED = '{"amount": 92.0, "currency": "EUR"}'
INVALID = (
    "Invalid arguments for tool 'convert': they are not valid JSON "
    f"(Expecting value at character {len(BROKEN)})."
)


def sent(provider: FakeProvider) -> list[dict[str, Any]]:
    return [json.loads(body) for body in provider.bodies]


async def test_an_anthropic_turn(tool_model: FakeProvider) -> None:
    box, ran = weather_box()
    client = AsyncAnthropic(api_key="k", base_url=tool_model.url)
    messages: list[Any] = [{"role": "user", "content": "weather?"}]
    response = await client.messages.create(model="m", max_tokens=64, messages=messages)
    calls = from_anthropic(response)
    assert [call.id for call in calls] == [call_id for call_id, _, _ in ASKED]
    results = await box.run(calls)
    messages += [response.to_param(), {"role": "user", "content": to_anthropic(results)}]
    final = await client.messages.create(model="m", max_tokens=64, messages=messages)
    await client.close()
    assert sorted(ran) == ["Lima", "Oslo", "Paris"]
    [answer] = final.content
    assert answer.type == "text"
    assert answer.text == answer_text(
        [
            ("call_paris", "18 °C"),
            ("call_oslo", "error: " + FAILED_OSLO),
            ("call_lima", "24 °C"),
            ("call_eur", CONVERTED),
        ]
    )
    blocks = sent(tool_model)[-1]["messages"][-1]["content"]
    assert [(b["tool_use_id"], b["is_error"]) for b in blocks] == [
        ("call_paris", False),
        ("call_oslo", True),
        ("call_lima", False),
        ("call_eur", False),
    ]


async def test_an_openai_chat_turn(tool_model: FakeProvider) -> None:
    box, _ = weather_box()
    client = AsyncOpenAI(api_key="k", base_url=f"{tool_model.url}/v1")
    messages: list[Any] = [{"role": "user", "content": "weather?"}]
    completion = await client.chat.completions.create(model="m", messages=messages)
    message = completion.choices[0].message
    results = await box.run(from_openai(message))
    messages += [message.to_dict(), *to_openai(results)]
    final = await client.chat.completions.create(model="m", messages=messages)
    await client.close()
    assert final.choices[0].message.content == answer_text(
        [
            ("call_paris", "18 °C"),
            ("call_oslo", FAILED_OSLO),
            ("call_lima", "24 °C"),
            ("call_eur", INVALID),
        ]
    )


async def test_an_openai_responses_turn(tool_model: FakeProvider) -> None:
    box, _ = weather_box()
    client = AsyncOpenAI(api_key="k", base_url=f"{tool_model.url}/v1")
    response = await client.responses.create(model="m", input="weather?")
    results = await box.run(from_openai_responses(response))
    final = await client.responses.create(
        model="m", previous_response_id=response.id, input=to_openai_responses(results)
    )
    await client.close()
    assert final.output_text == answer_text(
        [
            ("call_paris", "18 °C"),
            ("call_oslo", FAILED_OSLO),
            ("call_lima", "24 °C"),
            ("call_eur", INVALID),
        ]
    )
