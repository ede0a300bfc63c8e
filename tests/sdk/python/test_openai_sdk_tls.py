"""The official OpenAI Python SDK over HTTPS, trusting a custom CA.

Needs GATEWAY_HTTPS_URL, TLS_CA (the CA's PEM file) and MODEL, set by
scripts/sdk-tests.sh, which makes the CA and a certificate with openssl and starts
`switchyard serve --tls-cert --tls-key`. Skipped when they are not set.
"""

import os
import ssl

import openai
import pytest
from openai import OpenAI

URL = os.environ.get("GATEWAY_HTTPS_URL")
CA = os.environ.get("TLS_CA")
MODEL = os.environ.get("MODEL")

pytestmark = pytest.mark.skipif(not (URL and CA), reason="no HTTPS gateway configured")


def sdk(verify):
    return OpenAI(
        base_url=f"{URL}/v1",
        api_key="sk-client-key",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=verify),
    )


@pytest.fixture(scope="module")
def client():
    return sdk(ssl.create_default_context(cafile=CA))


def test_https_url_is_https():
    assert URL.startswith("https://")


def test_models_and_chat_over_https(client):
    assert MODEL in [m.id for m in client.models.list()]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something securely."}],
        max_tokens=5,
    )
    assert r.choices[0].message.content
    assert r.usage.completion_tokens == 5


def test_streaming_over_https(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream please."}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert len(pieces) == 4
    assert usage is not None and usage.completion_tokens == 4


def test_without_the_ca_the_certificate_is_refused():
    with pytest.raises(openai.APIConnectionError):
        sdk(ssl.create_default_context()).models.list()
