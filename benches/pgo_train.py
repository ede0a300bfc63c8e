#!/usr/bin/env python3
"""Training workload for a profile-guided build (run it through scripts/build-pgo.sh).

Drives an instrumented `switchyard serve` through the paths a gateway spends its
time on, so the profile the optimized build is made from reflects real use, not
one benchmark request:

  fixed       non-streamed chat to a fixed-response nginx upstream (the overhead
              benchmark's upstream), concurrency 64 and 1
  streaming   streamed and non-streamed chat and streamed completions to four simulated
              engines (`switchyard sim`) under the `prefix` policy, with prompts
              that share prefixes
  embeddings  `/v1/embeddings` to the simulated engines
  errors      unknown model (404), malformed JSON (400), oversize body (413)
  scrapes     `/metrics`, `/v1/models`, `/ready` while the load runs

The simulated engines are started from the same instrumented binary with their
profile written elsewhere and discarded: only the gateway's profile is kept.
Loopback only; every child is started here and killed by PID on exit.
Stdlib only (Python 3.11); needs nginx and oha (scripts/build-pgo.sh installs them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead as oh  # noqa: E402  (shared process, nginx and readiness helpers)

SIM_MODEL = "sim-model"
SCALE = float(os.environ.get("PGO_TRAIN_SCALE", "1"))


def log(msg: str) -> None:
    print(f"[pgo-train] {msg}", file=sys.stderr, flush=True)


def oha(url: str, body: str, conc: int, seconds: float) -> dict:
    """oha POSTing `body` for `seconds`; returns its status-code distribution."""
    argv = ["oha", "--no-tui", "--output-format", "json", "-z", f"{seconds * SCALE:.1f}s",
            "-c", str(conc), "-m", "POST", "-T", "application/json", "-d", body, url]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=seconds * SCALE + 60)
    if r.returncode != 0:
        raise RuntimeError(f"oha failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout).get("statusCodeDistribution", {})


def expect(what: str, codes: dict, status: str) -> None:
    """A phase that got none of the answers it exists for trained the wrong path."""
    if int(codes.get(status, 0)) == 0:
        raise RuntimeError(f"{what}: no {status} answers (got {codes})")
    log(f"{what}: {codes}")


def scrape(base: str, stop: threading.Event) -> None:
    while not stop.wait(0.2):  # a scrape interval, not synchronisation
        for path in ("/metrics", "/v1/models", "/ready"):
            oh.http_status(base + path, timeout=2)


def chat(prompt: str, stream: bool, model: str = SIM_MODEL, max_tokens: int = 16) -> str:
    return json.dumps({"model": model, "stream": stream, "max_tokens": max_tokens,
                       "messages": [{"role": "system", "content": prompt},
                                    {"role": "user", "content": "Summarise the above."}]})


def run(binary: str, sim_binary: str, tmp: Path) -> None:
    up_port, sim_port, gw_port = oh.free_port(), oh.free_port(), oh.free_port()
    upstream = oh.start_nginx(tmp, "upstream", 1, oh.UPSTREAM_SERVER.format(
        port=up_port, models=oh.MODELS_JSON, chat=oh.CHAT_RESPONSE))
    up_url = f"http://127.0.0.1:{up_port}"
    oh.wait_ready(up_url + "/v1/models", upstream.popen, "nginx upstream")

    # Simulated engines: the sim's own profile goes to a directory that is thrown away.
    sim_env = dict(os.environ, RUST_LOG="warn", LLVM_PROFILE_FILE=str(tmp / "sim-%p.profraw"))
    sim = oh.spawn("sim", [sim_binary, "sim", "--workers", "4", "--base-port", str(sim_port),
                           "--profile", "tiny", "--time-scale", "50", "--model", SIM_MODEL],
                   stdout=subprocess.DEVNULL, stderr=open(tmp / "sim.log", "w"), env=sim_env)
    sim_urls = [f"http://127.0.0.1:{sim_port + i}" for i in range(4)]
    for u in sim_urls:
        oh.wait_ready(u + "/v1/models", sim, "sim")

    config = tmp / "gateway.toml"
    workers = "\n".join(f'[[pools.workers]]\nurl = "{u}"\n' for u in sim_urls)
    config.write_text(f"""
[server]
listen = "127.0.0.1:{gw_port}"
max_body_bytes = 65536
# SIGTERM must end the process well within cleanup()'s 5 s: the profile is
# written at a normal exit.
drain_timeout_ms = 2000

[[pools]]
name = "fixed"
models = ["{oh.MODEL}"]
workers = [{{ url = "{up_url}" }}]

[[pools]]
name = "sim"
models = ["{SIM_MODEL}"]
policy = "prefix"
{workers}
""")
    gw = oh.spawn("switchyard (instrumented)", [binary, "serve", "--config", str(config)],
                  stdout=subprocess.DEVNULL, stderr=open(tmp / "gateway.log", "w"),
                  env=dict(os.environ, RUST_LOG="warn"))
    base = f"http://127.0.0.1:{gw_port}"
    oh.wait_ready(base + "/ready", gw, "switchyard")

    stop = threading.Event()
    scraper = threading.Thread(target=scrape, args=(base, stop), daemon=True)
    scraper.start()
    try:
        chat_url = base + "/v1/chat/completions"
        expect("fixed c=64", oha(chat_url, oh.REQUEST_BODY, 64, 6), "200")
        expect("fixed c=1", oha(chat_url, oh.REQUEST_BODY, 1, 2), "200")
        shared = "You are a careful assistant. " * 40
        for i, (stream, conc) in enumerate([(True, 16), (False, 8), (True, 4)]):
            expect(f"sim chat stream={stream} c={conc}",
                   oha(chat_url, chat(shared + f"Document {i}.", stream), conc, 3), "200")
        completion = json.dumps({"model": SIM_MODEL, "prompt": shared, "max_tokens": 8,
                                 "stream": True})
        expect("sim completions", oha(base + "/v1/completions", completion, 8, 2), "200")
        emb = json.dumps({"model": SIM_MODEL, "input": ["switchyard", shared]})
        expect("sim embeddings", oha(base + "/v1/embeddings", emb, 8, 2), "200")
        expect("unknown model", oha(chat_url, chat("x", False, model="no-such-model"), 1, 0.5), "404")
        expect("malformed JSON", oha(chat_url, '{"model": "sim-model", "messages": [', 1, 0.5), "400")
        expect("oversize body", oha(chat_url, chat("y" * 70000, False), 1, 0.5), "413")
    finally:
        stop.set()
        scraper.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="the instrumented switchyard binary")
    ap.add_argument("--sim-bin", help="binary for the simulated engines (default: --bin, "
                    "its profile discarded)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, oh._on_signal)
    signal.signal(signal.SIGINT, oh._on_signal)
    tmp = Path(tempfile.mkdtemp(prefix="switchyard-pgo-"))
    try:
        run(args.bin, args.sim_bin or args.bin, tmp)
    finally:
        # SIGTERM: the gateway drains and exits normally, which writes its profile.
        oh.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
