"""The official OpenAI Python SDK against a running Switchyard gateway.

Needs GATEWAY_URL and MODEL (set by scripts/sdk-tests.sh, which starts a simulated
worker and the gateway in front of it).
"""

import os

import openai
import pytest
from openai import OpenAI

GATEWAY_URL = os.environ["GATEWAY_URL"]
MODEL = os.environ["MODEL"]


@pytest.fixture(scope="module")
def client():
    return OpenAI(base_url=f"{GATEWAY_URL}/v1", api_key="sk-client-key", max_retries=0)


def test_models_list_contains_the_served_model(client):
    ids = [m.id for m in client.models.list()]
    assert MODEL in ids


def test_chat_non_streaming(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.usage.prompt_tokens > 0
    assert r.usage.completion_tokens == 8


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream please."}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert len(pieces) == 6
    assert usage is not None and usage.completion_tokens == 6


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.usage.completion_tokens == 5


def test_completions_streaming(client):
    texts = [
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="Count:", max_tokens=4, stream=True
        )
        if c.choices and c.choices[0].text
    ]
    assert len(texts) == 4


def test_embeddings(client):
    r = client.embeddings.create(model=MODEL, input=["hello", "world"])
    assert len(r.data) == 2
    assert len(r.data[0].embedding) > 0


def test_unknown_model_raises_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.status_code == 404
    assert e.value.body["code"] == "model_not_found"


def test_models_retrieve(client):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_responses_non_streaming_and_streaming(client):
    r = client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=6)
    assert r.status == "completed"
    assert r.output_text
    assert r.usage.output_tokens == 6
    events = list(
        client.responses.create(
            model=MODEL, input="Stream a story.", max_output_tokens=5, stream=True
        )
    )
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 5
    assert events[-1].type == "response.completed"


def test_responses_continue_retrieve_and_delete(client):
    first = client.responses.create(model=MODEL, input="Remember the word lantern.", max_output_tokens=4)
    # The gateway's id names the worker that stored the response.
    assert first.id.startswith("resp_sy")
    second = client.responses.create(
        model=MODEL, input="Which word?", max_output_tokens=4, previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(second.id).id == second.id
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_chat_with_n_choices(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Two answers."}],
        max_tokens=4,
        n=2,
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 8


def test_chat_required_tool_call(client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools,
        tool_choice="required",
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    import json

    assert "city" in json.loads(call.function.arguments)
