"""Processes of the real-engine suite and benchmarks, without pytest: two vLLM CPU
engines serving the tiny model, Switchyard gateways in front of them, all started
in their own process groups and killed by PID (group) on stop or at exit."""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from workload import scrape, wait_http_ok  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("VENV_VLLM", ROOT / ".venv-vllm"))
MODEL_DIR = Path(os.environ.get("TINY_MODEL_DIR", ROOT / "bench-out/e2e/tiny-llama"))
SWITCHYARD = os.environ.get("SWITCHYARD_BIN", str(ROOT / "target/debug/switchyard"))
MODEL = "tiny-llama"
# KV cache per engine, in 32-token blocks (the CPU attention backend needs a multiple
# of 32): 200 blocks = 6,400 tokens, about four of
# the workload's ~1.4k-token shared prompts (there are eight). See docs/e2e.md.
KV_BLOCKS = int(os.environ.get("E2E_KV_BLOCKS", "200"))
BLOCK_SIZE = 32
KV_TOPIC = "kv-events"
ENGINE_READY_S = float(os.environ.get("E2E_ENGINE_READY_S", "300"))
LOG_DIR = Path(os.environ.get("E2E_LOG_DIR", ROOT / "bench-out/e2e/logs"))
RESULTS = Path(os.environ.get("E2E_RESULTS", ROOT / "bench-out/e2e/results.json"))


def record(key: str, value) -> None:
    """Keep a measurement of this run under `key` in RESULTS (JSON)."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[key] = value
    RESULTS.write_text(json.dumps(data, indent=1))


# Every process group started here, so that an interrupted run (timeout's SIGTERM,
# Ctrl-C) still kills them by PID at exit.
SPAWNED: list[subprocess.Popen] = []


def _kill_spawned() -> None:
    for p in reversed(SPAWNED):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _on_sigterm(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")  # pytest then runs fixture teardown


atexit.register(_kill_spawned)


def install_sigterm_handler() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)


def spawn(argv: list[str], **kw) -> subprocess.Popen:
    p = subprocess.Popen(argv, start_new_session=True, **kw)
    SPAWNED.append(p)
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(p: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group led by p (vLLM forks an engine-core child), then SIGKILL."""
    if p.poll() is not None:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # leftovers of a group whose leader died
        except ProcessLookupError:
            pass
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=10)


@dataclass
class Engine:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path
    # The engine's KV-cache event publisher (ZeroMQ PUB) and replay (ROUTER) endpoints.
    kv_events: str = ""
    kv_replay: str = ""

    @property
    def metrics_url(self) -> str:
        return self.url + "/metrics"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Abrupt death of the whole engine (API server and engine core)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def engine_env() -> dict:
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_SERVER_DEV_MODE="1",  # exposes POST /reset_prefix_cache
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        OMP_NUM_THREADS="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def kv_events_config(events_port: int, replay_port: int) -> str:
    """vLLM's `--kv-events-config`: a ZeroMQ publisher of every block stored and
    removed, and its replay socket. A `*` host makes vLLM bind (not connect)."""
    return json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}", "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": KV_TOPIC,
    })


def start_engine(name: str) -> Engine:
    port, ev_port, replay_port = free_port(), free_port(), free_port()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"{name}.log"
    argv = [
        str(VENV / "bin/vllm"), "serve", str(MODEL_DIR),
        "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32",
        "--enforce-eager",  # no torch.compile: starts in seconds instead of minutes
        "--max-model-len", "4096",
        "--max-num-seqs", "8",
        "--max-num-batched-tokens", "4096",
        "--enable-prefix-caching",
        "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", str(KV_BLOCKS),
        # usage.prompt_tokens_details.cached_tokens: what the precise index is checked against.
        "--enable-prompt-tokens-details",
        "--kv-events-config", kv_events_config(ev_port, replay_port),
    ]
    p = spawn(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=engine_env(), cwd=ROOT)
    return Engine(name, f"http://127.0.0.1:{port}", p, log,
                  f"tcp://127.0.0.1:{ev_port}", f"tcp://127.0.0.1:{replay_port}")


class Gateway:
    def __init__(self, url: str, proc: subprocess.Popen, config: Path):
        self.url, self.proc, self.config = url, proc, config

    def metrics(self) -> str:
        return scrape(self.url + "/metrics")


def server_config(debug_headers: bool = False) -> str:
    """The gateway's `[server]` section every e2e gateway uses: an ephemeral port,
    a short connect timeout (a killed engine is noticed at once) and a first-byte
    timeout long enough for a CPU prefill."""
    return f"""
[server]
listen = "127.0.0.1:0"
debug_headers = {str(debug_headers).lower()}

[server.timeouts]
connect_ms = 500
first_byte_ms = 120000
"""


def gateway_config(engines: list[Engine], policy: str, routing: bool, debug_headers: bool = False) -> str:
    workers = ",\n  ".join(f'{{ url = "{e.url}" }}' for e in engines)
    cfg = server_config(debug_headers) + f"""
[[pools]]
name = "e2e"
models = ["{MODEL}"]
policy = "{policy}"
max_attempts = 3
workers = [
  {workers},
]
"""
    if routing:
        cfg += "\n[pools.routing]\nstats_interval_ms = 250\n"
    return cfg




def start_gateway(config_text: str, log: Path, switchyard: str = "") -> Gateway:
    """Start `switchyard serve --config` with this TOML; wait for its ready line and /ready."""
    log.parent.mkdir(parents=True, exist_ok=True)
    cfg = log.with_suffix(".toml")
    cfg.write_text(config_text)
    p = spawn([switchyard or SWITCHYARD, "serve", "--config", str(cfg)], stdout=subprocess.PIPE,
              stderr=open(log, "w"), text=True,
              env=dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn")))
    # The ready line; a gateway that cannot serve yet first prints a
    # `switchyard listening url=…, not ready: …` line saying why.
    line = p.stdout.readline()
    while line.startswith("switchyard listening"):
        line = p.stdout.readline()
    if "switchyard ready url=" not in line:
        stop(p)
        raise RuntimeError(f"gateway did not start: {line!r}\n{log.read_text()[-3000:]}")
    url = line.split("url=", 1)[1].split()[0]
    wait_http_ok(url + "/ready", 30, lambda: p.poll() is None, "switchyard")
    return Gateway(url, p, cfg)


def start_engines(names=("vllm-a", "vllm-b"), ready_s: float = 0) -> list[Engine]:
    """Start the engines concurrently and wait for each one's /health and /v1/models."""
    if not (VENV / "bin/vllm").exists():
        raise RuntimeError(f"{VENV}/bin/vllm missing: run tests/e2e/setup_vllm.sh")
    if not (MODEL_DIR / "config.json").exists():
        subprocess.run([str(VENV / "bin/python"), str(ROOT / "tests/e2e/make_tiny_model.py"),
                        str(MODEL_DIR)], check=True, timeout=600)
    started = [start_engine(n) for n in names]
    t0 = time.monotonic()
    budget = ready_s or ENGINE_READY_S
    try:
        for e in started:
            try:
                wait_http_ok(e.url + "/health", budget - (time.monotonic() - t0), e.alive, e.name)
                wait_http_ok(e.url + "/v1/models", 30, e.alive, e.name)
            except RuntimeError as err:
                tail = e.log.read_text()[-4000:] if e.log.exists() else ""
                raise RuntimeError(f"{err}\n--- {e.log} (tail) ---\n{tail}") from None
    except BaseException:
        for e in started:
            stop(e.proc)
        raise
    print(f"[e2e] {len(started)} vLLM engines ready in {time.monotonic() - t0:.0f}s: "
          f"{[e.url for e in started]}", flush=True)
    return started
