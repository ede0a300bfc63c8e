"""Clients users point at a gateway, unchanged, against real vLLM behind it: the
official `anthropic` SDK on vLLM's own `/v1/messages` (passed through, not
translated), and the benchmark clients `vllm bench serve` and `guidellm`, each
for a short bounded run that must complete every request without an error."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request

import pytest
from anthropic import Anthropic

from engines import LOG_DIR, MODEL, MODEL_DIR, VENV, server_config
from workload import samples

GUIDELLM = os.environ.get("GUIDELLM_BIN", str(VENV.parent / ".venv-guidellm/bin/guidellm"))
BENCH_TIMEOUT_S = 300
BENCH_PROMPTS = 8


def messages_config(engines) -> str:
    workers = ", ".join(f'{{ url = "{e.url}" }}' for e in engines)
    return server_config() + f"""
[[pools]]
name = "clients"
models = ["{MODEL}"]
policy = "round_robin"
anthropic = "passthrough"
workers = [{workers}]
"""


@pytest.fixture(scope="module")
def gateway(engines, start_gateway):
    return start_gateway(name="clients", config=messages_config(engines))


def engine_messages_requests(engines) -> float:
    """`/v1/messages` requests the engines' own API servers answered."""
    total = 0.0
    for e in engines:
        text = urllib.request.urlopen(e.metrics_url, timeout=10).read().decode()
        total += sum(v for lb, v in samples(text, "http_requests_total")
                     if lb.get("handler") == "/v1/messages")
    return total


def test_anthropic_sdk_on_vllm_messages(engines, gateway):
    client = Anthropic(base_url=gateway.url, api_key="sk-e2e", max_retries=0, timeout=120)
    before = engine_messages_requests(engines)
    msg = client.messages.create(model=MODEL, max_tokens=8, system="Be brief.",
                                 messages=[{"role": "user", "content": "Say something."}])
    assert msg.type == "message" and msg.role == "assistant", msg
    assert msg.content and msg.content[0].type == "text", msg
    assert msg.stop_reason in ("end_turn", "max_tokens"), msg
    assert 1 <= msg.usage.output_tokens <= 8 and msg.usage.input_tokens > 3, msg.usage

    stream = client.messages.create(model=MODEL, max_tokens=8, stream=True,
                                    messages=[{"role": "user", "content": "Stream please."}])
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert "content_block_start" in kinds and "content_block_stop" in kinds, kinds
    delta = [e for e in events if e.type == "message_delta"]
    assert len(delta) == 1 and 1 <= delta[0].usage.output_tokens <= 8, delta
    # Served by the engines' own Messages endpoint: passed through, not translated.
    assert engine_messages_requests(engines) - before == 2


def run_bench(argv: list[str], name: str) -> subprocess.CompletedProcess:
    log = LOG_DIR / f"{name}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run(argv, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S, env=env)
    log.write_text(f"$ {' '.join(argv)}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    assert r.returncode == 0, f"{name} exited {r.returncode}; see {log}\n{r.stderr[-3000:]}"
    return r


def test_vllm_bench_serve_through_the_gateway(gateway, tmp_path):
    run_bench([
        str(VENV / "bin/vllm"), "bench", "serve", "--backend", "openai-chat",
        "--base-url", gateway.url, "--endpoint", "/v1/chat/completions",
        "--model", MODEL, "--tokenizer", str(MODEL_DIR),
        "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
        "--num-prompts", str(BENCH_PROMPTS), "--max-concurrency", "2", "--ignore-eos",
        "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "bench.json",
    ], "vllm-bench-serve")
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["completed"] == BENCH_PROMPTS and res["failed"] == 0, res.get("errors")
    assert res["total_output_tokens"] == 8 * BENCH_PROMPTS, res["total_output_tokens"]


def test_guidellm_through_the_gateway(gateway, tmp_path):
    out = tmp_path / "guidellm.json"
    run_bench([
        GUIDELLM, "run",
        "--backend", f"kind=openai_http,target={gateway.url},model={MODEL}",
        "--tokenizer", f"kind=huggingface_auto,model={MODEL_DIR}",
        "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={BENCH_PROMPTS}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ], "guidellm")
    totals = json.loads(out.read_text())["benchmarks"][0]["metrics"]["request_totals"]
    # guidellm counts what it measured (a run may leave a request out of the report);
    # none of them may have failed.
    assert totals["errored"] == 0 and totals["incomplete"] == 0, totals
    assert totals["successful"] >= BENCH_PROMPTS - 1, totals
