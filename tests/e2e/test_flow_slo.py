"""Flow control and latency objectives in front of real vLLM engines: a request held
in the gateway while the engine's own running count (scraped from its /metrics)
says it is saturated, then dispatched when the first request leaves; and a request
whose time-to-first-token objective the learnt latency models say no engine can
meet, shed with 503 `slo_unattainable` and `Retry-After`."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from engines import MODEL, server_config
from workload import samples

WAIT_S = 60.0


def pool_config(name: str, engines, extra: str) -> str:
    workers = ", ".join(f'{{ url = "{e.url}" }}' for e in engines)
    return server_config(debug_headers=True) + f"""
[tenancy]
anonymous_allow_slo_headers = true
anonymous_max_priority = "critical"
[[pools]]
name = "{name}"
models = ["{MODEL}"]
workers = [{workers}]
{extra}
"""


def metric(text: str, name: str, **labels) -> float:
    return sum(v for lb, v in samples(text, name)
               if all(lb.get(k) == x for k, x in labels.items()))


def wait_metric(gw, what: str, name: str, at_least: float, **labels) -> None:
    end = time.monotonic() + WAIT_S
    while metric(gw.metrics(), name, **labels) < at_least:
        if time.monotonic() > end:
            raise AssertionError(f"{what}: {name}{labels} < {at_least} after {WAIT_S} s")
        time.sleep(0.05)


def post(base: str, body: dict, headers: dict | None = None):
    """POST a chat completion; (status, headers, parsed body or raw text)."""
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            status, h = r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, h = e.read(), e.code, dict(e.headers)
    text = raw.decode()
    try:
        return status, h, json.loads(text)
    except ValueError:
        return status, h, text


def chat_body(content: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def engine_requests(engine) -> float:
    """Requests the engine itself is running or has waiting, from its own /metrics."""
    text = urllib.request.urlopen(engine.metrics_url, timeout=10).read().decode()
    return (metric(text, "vllm:num_requests_running")
            + metric(text, "vllm:num_requests_waiting"))


def test_a_request_is_held_while_the_engine_is_saturated_then_dispatched(engines, start_gateway):
    engine = engines[0]
    # Saturated at one running request, as the engine's scraped stats tell; stale
    # stats would disable the check, so a busy engine's slow /metrics may not.
    gw = start_gateway(name="flow", config=pool_config("held", [engine], """
policy = "least_queue"
[pools.routing]
stats_interval_ms = 250
stale_after_ms = 30000
[pools.flow_control]
max_running = 1
"""))
    # A long stream that the client abandons once the second request is held.
    req = urllib.request.Request(gw.url + "/v1/chat/completions",
                                 data=json.dumps(chat_body("go on", 3000, True)).encode(),
                                 headers={"content-type": "application/json"})
    first = urllib.request.urlopen(req, timeout=120)
    assert first.status == 200
    first.readline()
    wait_metric(gw, "a scrape shows the stream running", "switchyard_worker_running", 1,
                worker=engine.url)
    out = {}
    second = threading.Thread(target=lambda: out.setdefault("r", post(gw.url, chat_body("next", 4))))
    second.start()
    wait_metric(gw, "the second request queued", "switchyard_flow_requests_total", 1,
                pool="held", event="queued")
    assert out == {}, f"answered while it should be held: {out}"
    assert engine_requests(engine) == 1, "the held request reached the saturated engine"
    first.close()  # the client leaves: the gateway cancels it and the slot frees
    second.join(timeout=120)
    status, _, body = out["r"]
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4, body
    m = gw.metrics()
    assert metric(m, "switchyard_flow_requests_total", pool="held", event="dispatched") == 1
    assert metric(m, "switchyard_queue_wait_seconds_count", pool="held") == 1
    assert metric(m, "switchyard_flow_shed_total", pool="held") == 0


def stream_with(base: str, content: str, headers: dict) -> tuple[int, dict, object]:
    """A short streamed chat (streams teach the latency models); status, headers, body."""
    status, h, body = post(base, {**chat_body(content, 4, True),
                                  "stream_options": {"include_usage": True}}, headers)
    return status, h, body


def test_an_unattainable_latency_objective_is_shed(engines, start_gateway):
    gw = start_gateway(name="slo", config=pool_config("slo", engines, """
policy = "slo"
[pools.routing]
allow_policy_override = true
stats_interval_ms = 250
slo_unattainable = "shed"
"""))
    tight = {"x-slo-ttft-ms": "1"}
    # Nothing is shed on a guess: the models have not learnt anything yet.
    status, _, body = stream_with(gw.url, "cold", tight)
    assert status == 200, body
    # Teach both engines' models: streamed answers, alternating engines.
    for i in range(24):
        status, _, body = stream_with(gw.url, f"warm-up {i}: the weather",
                                      {"x-switchyard-policy": "round_robin"})
        assert status == 200, body
    # A reachable objective is met; 1 ms to the first token is not.
    status, h, body = stream_with(gw.url, "relaxed", {"x-slo-ttft-ms": "600000"})
    assert status == 200, body
    assert "x-switchyard-slo" not in {k.lower() for k in h}, h
    status, h, body = stream_with(gw.url, "now", tight)
    assert status == 503, body
    assert isinstance(body, dict), body
    assert body["error"]["code"] == "slo_unattainable", body
    assert body["error"]["message"] and body["error"]["type"], body
    retry = {k.lower(): v for k, v in h.items()}.get("retry-after")
    assert retry is not None and 1 <= int(retry) <= 60, h
    m = gw.metrics()
    assert metric(m, "switchyard_slo_decisions_total", pool="slo", result="shed") == 1, m
    assert metric(m, "switchyard_slo_decisions_total", pool="slo", result="met") >= 1
    assert metric(m, "switchyard_gateway_errors_total", reason="slo_unattainable") == 1
    for e in engines:
        assert metric(m, "switchyard_predicted_ttft_seconds_count", worker=e.url) > 0, e.name
