"""Precise mode against real vLLM engines: the engines publish their KV-cache events
(`--kv-events-config`, engines.py), a gateway in precise mode follows them with
the tiny model's own tokenizer, and the cached tokens it predicts for the chosen
worker are checked against what vLLM reports in `usage.prompt_tokens_details`.

Synchronisation: before each request the test asks every engine's replay endpoint
(ZeroMQ ROUTER, the protocol the gateway itself uses) whether it holds a batch the
gateway has not applied yet, so a request is only sent once the index is current."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest
import zmq

from engines import BLOCK_SIZE, KV_TOPIC, LOG_DIR, MODEL, MODEL_DIR, SWITCHYARD, record, server_config
from workload import Workload, prefix_text, samples, scrape

# Share of the measured requests whose prediction must equal the engine's count.
MIN_EXACT = 0.95
WAIT_S = 60.0
END_SEQ = (1 << 64) - 1  # the replay's end marker: -1 as 8 big-endian bytes


def precise_config(engines, access_log) -> str:
    workers = ",\n  ".join(
        f'{{ url = "{e.url}", kv_events = "{e.kv_events}", kv_replay = "{e.kv_replay}" }}'
        for e in engines)
    return server_config(debug_headers=True) + f"""
[access_log]
enabled = true
path = "{access_log}"

[[pools]]
name = "precise"
models = ["{MODEL}"]
policy = "weighted"
tokenizer = {{ kind = "hf", path = "{MODEL_DIR}" }}
workers = [
  {workers},
]
[pools.routing]
stats_interval_ms = 250
scorers = [{{ name = "precise_prefix", weight = 1.0 }}, {{ name = "queue", weight = 0.1 }}]
[pools.kv_events]
block_size = {BLOCK_SIZE}
topic = "{KV_TOPIC}"
probe_interval_ms = 200
"""


def worker_value(metrics: str, name: str, worker: str, **labels) -> float:
    return sum(v for lb, v in samples(metrics, name)
               if lb.get("worker") == worker and all(lb.get(k) == x for k, x in labels.items()))


def engine_has_batches_from(replay: str, start: int) -> bool:
    """Whether the engine's replay buffer holds a batch with sequence >= start."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replay)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        found = False
        while True:
            if not sock.poll(5000):
                raise RuntimeError(f"{replay}: no replay answer within 5 s")
            frames = sock.recv_multipart()
            seq = int.from_bytes(frames[-2], "big")
            if seq == END_SEQ or not frames[-1]:
                return found
            found = True
    finally:
        sock.close()


def wait_caught_up(gw, engines) -> None:
    """Until the gateway has applied (or counted lost) every batch each engine published."""
    end = time.monotonic() + WAIT_S
    while True:
        m = gw.metrics()
        behind = [e.name for e in engines if engine_has_batches_from(
            e.kv_replay, int(worker_value(m, "switchyard_kv_events_total", e.url, kind="applied")
                             + worker_value(m, "switchyard_kv_events_total", e.url, kind="lost")))]
        if not behind:
            return
        if time.monotonic() > end:
            raise AssertionError(f"gateway did not catch up with {behind} in {WAIT_S} s")
        time.sleep(0.02)


def wait_live(gw, engines) -> None:
    end = time.monotonic() + WAIT_S
    while True:
        m = gw.metrics()
        states = {e.name: worker_value(m, "switchyard_kv_worker_state", e.url) for e in engines}
        if all(s == 2 for s in states.values()):
            return
        if time.monotonic() > end:
            raise AssertionError(f"KV-event subscribers not live: {states}")
        time.sleep(0.05)


def chat(base: str, messages: list, request_id: str = "") -> tuple[dict, dict]:
    """A non-streamed chat completion; (response headers, body)."""
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 2,
                       "ignore_eos": True, "temperature": 0}).encode()
    headers = {"content-type": "application/json"}
    if request_id:
        headers["x-request-id"] = request_id
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return dict(r.headers), json.loads(r.read())


def cached(body: dict) -> int:
    details = body["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def access_records(path, ids: set[str]) -> dict[str, dict]:
    """The access-log lines of these request ids (written by a background task)."""
    end = time.monotonic() + WAIT_S
    while True:
        recs = {}
        if path.exists():
            for line in path.read_text().splitlines():
                r = json.loads(line)
                if r["request_id"] in ids:
                    recs[r["request_id"]] = r
        if len(recs) == len(ids) or time.monotonic() > end:
            return recs
        time.sleep(0.05)


def reset_prefix_caches(engines) -> None:
    for e in engines:
        req = urllib.request.Request(e.url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200


@pytest.fixture(scope="module")
def precise(engines, start_gateway):
    reset_prefix_caches(engines)
    log = LOG_DIR / "access-precise.jsonl"
    log.unlink(missing_ok=True)
    gw = start_gateway(config=precise_config(engines, log), name="precise")
    wait_live(gw, engines)
    wait_caught_up(gw, engines)
    return gw, log


def test_the_index_follows_traffic_the_gateway_never_saw(engines, precise):
    """A prompt sent straight to one engine is found there through its events alone."""
    gw, _ = precise
    for i, e in enumerate(engines):
        system = {"role": "system", "content": prefix_text(41, i, 120)}
        chat(e.url, [system, {"role": "user", "content": "direct"}])
        wait_caught_up(gw, engines)
        headers, body = chat(gw.url, [system, {"role": "user", "content": "through the gateway"}])
        route = headers["x-switchyard-route"].split(";")
        assert route[0].strip() == e.url, (e.name, route)
        assert cached(body) >= BLOCK_SIZE, (e.name, body["usage"])


def test_predicted_cached_tokens_equal_the_engines_count(engines, precise):
    gw, log = precise
    wl = Workload(seed=43, groups=4, per_group=5, prefix_words=150, max_tokens=2)
    reqs = wl.requests()
    seen, measured = set(), []
    for i, r in enumerate(reqs):
        wait_caught_up(gw, engines)
        rid = f"e2e-precise-{i}"
        _, body = chat(gw.url, r["messages"], rid)
        # Warm-up: a group's first request (nothing of it cached anywhere yet).
        if r["group"] in seen:
            measured.append((rid, cached(body)))
        seen.add(r["group"])
    recs = access_records(log, {rid for rid, _ in measured})
    assert len(recs) == len(measured), f"{len(recs)} of {len(measured)} access-log lines"
    rows = [(rid, recs[rid]["predicted_cached_tokens"], actual, recs[rid]["cached_tokens"])
            for rid, actual in measured]
    exact = [r for r in rows if r[1] == r[2]]
    record("precise_index", {"measured": len(rows), "exact": len(exact),
                             "hits": sum(1 for r in rows if r[2] > 0),
                             "predicted_vs_reported": [r[1:3] for r in rows]})
    assert all(r[2] == r[3] for r in rows), "access log disagrees with the response's usage"
    assert sum(1 for r in rows if r[2] > 0) >= len(rows) // 2, f"too few cache hits: {rows}"
    assert len(exact) >= MIN_EXACT * len(rows), rows
    # Every decision of this pool was taken on the precise index, none approximately.
    by_mode = {}
    for lb, v in samples(gw.metrics(), "switchyard_cache_predictions_total"):
        if lb.get("pool") == "precise":
            by_mode[lb.get("mode")] = by_mode.get(lb.get("mode"), 0) + v
    assert by_mode.get("precise", 0) >= len(reqs) and not by_mode.get("approximate"), by_mode


def prompt_len(messages: list) -> int:
    """The prompt's token count, as the gateway (and, tested elsewhere, vLLM) computes it."""
    out = subprocess.run([SWITCHYARD, "tokenize", "--model-dir", str(MODEL_DIR)],
                         input=json.dumps({"model": MODEL, "messages": messages}).encode(),
                         capture_output=True, check=True, timeout=30).stdout
    return len(json.loads(out))


def test_a_repeated_prompt_of_whole_blocks_is_predicted_as_the_engine_counts(engines, precise):
    """An engine recomputes a prompt's last token (it needs its logits), so a prompt of
    exactly n blocks, sent again, hits n - 1 of them: the prediction must say so too."""
    gw, log = precise
    words = prefix_text(47, 0, 100).split()
    messages = []
    for n in range(60, len(words)):
        messages = [{"role": "user", "content": " ".join(words[:n])}]
        if prompt_len(messages) % BLOCK_SIZE == 0:
            break
    size = prompt_len(messages)
    assert size % BLOCK_SIZE == 0, size
    rows = []
    for i in range(2):
        wait_caught_up(gw, engines)
        rid = f"e2e-whole-blocks-{i}"
        _, body = chat(gw.url, messages, rid)
        assert body["usage"]["prompt_tokens"] == size, body["usage"]
        rows.append((rid, cached(body)))
    recs = access_records(log, {rid for rid, _ in rows})
    rid, actual = rows[1]
    assert actual == size - BLOCK_SIZE, (size, rows)
    assert recs[rid]["predicted_cached_tokens"] == actual, (size, recs[rid], rows)


def test_kv_event_counters_per_worker(engines, precise):
    gw, _ = precise
    m = scrape(gw.url + "/metrics")
    for e in engines:
        applied = worker_value(m, "switchyard_kv_events_total", e.url, kind="applied")
        blocks = worker_value(m, "switchyard_kv_index_blocks", e.url)
        assert applied > 0, (e.name, applied)
        assert blocks > 0, (e.name, blocks)
        assert worker_value(m, "switchyard_kv_events_total", e.url, kind="lost") == 0
        assert worker_value(m, "switchyard_kv_refusals_total", e.url) == 0
