"""The official Anthropic Python SDK against a running Switchyard gateway, in
both pool modes: `passthrough` (the simulated engine serves /v1/messages) and
`translate` (the gateway speaks chat completions to the engine).

Needs ANTHROPIC_GATEWAY_URL, MODEL (the passthrough pool's model) and
TRANSLATED_MODEL (the translating pool's), set by scripts/sdk-tests.sh.
"""

import json
import os

import anthropic
import pytest
from anthropic import Anthropic

GATEWAY_URL = os.environ.get("ANTHROPIC_GATEWAY_URL")
MODELS = {
    "passthrough": os.environ.get("MODEL"),
    "translate": os.environ.get("TRANSLATED_MODEL"),
}

pytestmark = pytest.mark.skipif(
    not GATEWAY_URL, reason="ANTHROPIC_GATEWAY_URL not set (run scripts/sdk-tests.sh)"
)

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client():
    return Anthropic(base_url=GATEWAY_URL, api_key="sk-client-key", max_retries=0)


@pytest.fixture(params=["passthrough", "translate"])
def model(request):
    return MODELS[request.param]


def test_create_with_system_prompt_and_turns(client, model):
    m = client.messages.create(
        model=model,
        max_tokens=8,
        system=[{"type": "text", "text": "You are terse."}],
        messages=[
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again."},
        ],
    )
    assert m.type == "message" and m.role == "assistant"
    assert m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0
    assert 1 <= m.usage.output_tokens <= 8


def test_stream_text(client, model):
    with client.messages.stream(
        model=model,
        max_tokens=6,
        messages=[{"role": "user", "content": "Stream please."}],
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert pieces and "".join(pieces) == final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= final.usage.output_tokens <= 6


def test_stream_event_sequence(client, model):
    events = list(
        client.messages.create(
            model=model,
            max_tokens=4,
            stream=True,
            messages=[{"role": "user", "content": "Events."}],
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert any(e.type == "content_block_delta" and e.delta.type == "text_delta" for e in events)


def test_tool_use(client, model):
    m = client.messages.create(
        model=model,
        max_tokens=64,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
    )
    assert m.stop_reason == "tool_use"
    call = next(b for b in m.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input["city"], str)
    # The tool's answer goes back as a tool_result block.
    follow = client.messages.create(
        model=model,
        max_tokens=8,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21C"}],
            },
        ],
    )
    assert follow.content[0].type == "text" and follow.content[0].text


def test_stream_tool_use(client, model):
    with client.messages.stream(
        model=model,
        max_tokens=64,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather in Bergen?"}],
    ) as stream:
        partial = "".join(e.partial_json for e in stream if e.type == "input_json")
        final = stream.get_final_message()
    call = final.content[0]
    assert call.type == "tool_use" and call.name == "get_weather"
    assert json.loads(partial) == call.input
    assert final.stop_reason == "tool_use"


def test_count_tokens(client):
    n = client.messages.count_tokens(
        model=MODELS["passthrough"],
        system="You are terse.",
        messages=[{"role": "user", "content": "How many tokens is this?"}],
    )
    assert n.input_tokens > 0


def test_count_tokens_needs_the_engines_messages_api(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.count_tokens(
            model=MODELS["translate"], messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.body["error"]["type"] == "not_found_error"


def test_unknown_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.body["type"] == "error"
    assert "no-such-model" in e.value.body["error"]["message"]


def test_bad_request_is_reported(client, model):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=model,
            max_tokens=0,
            messages=[{"role": "user", "content": "x"}],
        )
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
