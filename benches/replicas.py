#!/usr/bin/env python3
"""Several independent gateway replicas vs one, precise vs approximate routing.

    python3 benches/replicas.py          # needs target/debug/switchyard (or SWITCHYARD_BIN)

ENGINES simulated engines publish their KV-cache events (`switchyard sim
--kv-events --kv-replay`) with bounded caches (SIM_BLOCKS blocks each). For each
mode (MODES, comma-separated; default all three) — `approximate` (policy `prefix`
on the gateway's own prefix index, `index = "approximate"`), `precise` (`weighted`
with `precise_prefix` and `queue`, routing on the engines' events) and
`prefix-precise` (policy `prefix` reading the engines' events, `index = "precise"`)
— and for 1 and REPLICAS gateways, the same shared-prefix workload (tests/e2e/workload.py:
GROUPS prompts, PER_GROUP requests each, seeded order) is sent round-robin over the
gateways at CONC concurrent clients, to freshly started engines. Reported: the
engines' own prefix-cache hit ratio (Δ hits / Δ queries, in tokens) per run and the
ratio REPLICAS/1 per mode. Loopback only; every child is killed on exit.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests/e2e"))
sys.path.insert(0, str(ROOT / "benches"))

import overhead  # noqa: E402  (process helpers)
from workload import Workload, hit_ratio_during, stream_chat, wait_http_ok  # noqa: E402

SWITCHYARD = os.environ.get("SWITCHYARD_BIN", str(ROOT / "target/debug/switchyard"))
ENGINES = int(os.environ.get("ENGINES", "8"))
REPLICAS = int(os.environ.get("REPLICAS", "4"))
GROUPS = int(os.environ.get("PREFIXES", "32"))
PER_GROUP = int(os.environ.get("PER_GROUP", "8"))
CONC = int(os.environ.get("CONC", "8"))
PREFIX_WORDS = int(os.environ.get("PREFIX_WORDS", "400"))
SIM_BLOCKS = int(os.environ.get("SIM_BLOCKS", "400"))
TIME_SCALE = float(os.environ.get("TIME_SCALE", "10"))
SEED = int(os.environ.get("SEED", "7"))
MODES = os.environ.get("MODES", "approximate,precise,prefix-precise").split(",")
MODEL = "sim-llama-8b"


def log(msg: str) -> None:
    print(f"[replicas] {msg}", file=sys.stderr, flush=True)


def start_sims(tmp: Path) -> list[dict]:
    sims = []
    for i in range(ENGINES):
        out = tmp / f"sim-{i}.out"
        p = overhead.spawn(f"sim-{i}", [
            SWITCHYARD, "sim", "--port", "0", "--num-blocks", str(SIM_BLOCKS),
            "--time-scale", str(TIME_SCALE), "--seed", str(i),
            "--kv-events", "tcp://127.0.0.1:0", "--kv-replay", "tcp://127.0.0.1:0",
        ], stdout=open(out, "w"), stderr=subprocess.DEVNULL)
        fields = None
        end = time.monotonic() + 30
        while time.monotonic() < end and fields is None:
            for line in out.read_text().splitlines():
                if line.startswith("switchyard-sim ready"):
                    fields = dict(kv.split("=", 1) for kv in line.split()[2:])
            if p.poll() is not None:
                raise RuntimeError(f"sim {i} exited")
            time.sleep(0.02)  # polling the readiness line
        if fields is None:
            raise RuntimeError(f"sim {i} did not print its readiness line")
        wait_http_ok(fields["url"] + "/health", 30, lambda: p.poll() is None, f"sim-{i}")
        sims.append({"proc": p, **fields})
    return sims


def config(sims: list[dict], mode: str) -> str:
    ws = ", ".join(
        f'{{ url = "{s["url"]}", kv_events = "{s["kv_events"]}", kv_replay = "{s["kv_replay"]}" }}'
        for s in sims)
    if mode == "precise":
        policy = ('policy = "weighted"\ntokenizer = "sim"\n'
                  f"workers = [{ws}]\n[pools.routing]\n"
                  'scorers = [{ name = "precise_prefix", weight = 1.0 }, { name = "queue", weight = 0.05 }]\n'
                  '[pools.kv_events]\ntopic = "kv-events"\n')
    elif mode == "prefix-precise":
        policy = (f'policy = "prefix"\ntokenizer = "sim"\nworkers = [{ws}]\n'
                  '[pools.routing]\nindex = "precise"\n[pools.kv_events]\ntopic = "kv-events"\n')
    elif mode == "approximate":
        policy = f'policy = "prefix"\nworkers = [{ws}]\n[pools.routing]\nindex = "approximate"\n'
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return f'[[pools]]\nname = "p"\nmodels = ["{MODEL}"]\n{policy}'


def start_gateway(tmp: Path, name: str, cfg: str) -> tuple[str, subprocess.Popen]:
    path = tmp / f"{name}.toml"
    path.write_text(cfg)
    err = open(tmp / f"{name}.log", "w")
    p = overhead.spawn(name, [SWITCHYARD, "serve", "--listen", "127.0.0.1:0", "--config", str(path)],
                       stdout=subprocess.PIPE, stderr=err, text=True,
                       env=dict(os.environ, RUST_LOG="warn"))
    line = p.stdout.readline()
    while line.startswith("switchyard listening"):
        line = p.stdout.readline()
    if "switchyard ready url=" not in line:
        raise RuntimeError(f"{name} did not start (got {line!r}); see {tmp}/{name}.log")
    url = line.split("url=", 1)[1].strip()
    overhead.wait_ready(url + "/ready", p, name)
    return url, p


def wait_precise_live(url: str, n: int) -> None:
    """Every worker live in the gateway's precise index."""
    from workload import scrape, total
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if total(scrape(url + "/metrics"), "switchyard_kv_worker_state") == 2 * n:
            return
        time.sleep(0.05)  # polling the gateway's metrics
    raise RuntimeError(f"{url}: workers not live in the precise index")


def run(urls: list[str]) -> list[str]:
    reqs = Workload(seed=SEED, groups=GROUPS, per_group=PER_GROUP, prefix_words=PREFIX_WORDS).requests()
    it = iter(enumerate(reqs))
    lock = threading.Lock()
    errors: list[str] = []

    def client() -> None:
        while True:
            with lock:
                nxt = next(it, None)
            if nxt is None:
                return
            i, r = nxt
            try:  # round-robin over the replicas
                stream_chat(urls[i % len(urls)], MODEL, r["messages"], 4)
            except (OSError, RuntimeError, ValueError) as e:
                with lock:
                    errors.append(repr(e)[:200])

    with ThreadPoolExecutor(CONC) as ex:
        for f in [ex.submit(client) for _ in range(CONC)]:
            f.result()
    return errors


def one(tmp: Path, mode: str, replicas: int) -> float:
    sims = start_sims(tmp)
    gws = []
    try:
        for g in range(replicas):
            gws.append(start_gateway(tmp, f"gw-{mode}-{replicas}-{g}", config(sims, mode)))
        if mode != "approximate":
            for url, _ in gws:
                wait_precise_live(url, len(sims))
        metrics = [s["url"] + "/metrics" for s in sims]
        ratio, errors = hit_ratio_during(metrics, lambda: run([u for u, _ in gws]))
        if errors:
            log(f"{mode} x{replicas}: {len(errors)} errors, first: {errors[0]}")
        return ratio
    finally:
        for _, p in gws:
            p.terminate()
            p.wait(timeout=10)
        for s in sims:
            s["proc"].terminate()
            s["proc"].wait(timeout=10)


def main() -> int:
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        try:
            for mode, replicas in itertools.product(MODES, [1, REPLICAS]):
                rows[(mode, replicas)] = one(Path(d), mode, replicas)
                log(f"{mode} x{replicas}: hit ratio {rows[(mode, replicas)]:.3f}")
        finally:
            overhead.cleanup()
    print(f"| mode | 1 gateway | {REPLICAS} gateways (round robin) | ratio |")
    print("|---|---|---|---|")
    for mode in MODES:
        one_gw, many = rows[(mode, 1)], rows[(mode, REPLICAS)]
        print(f"| {mode} | {one_gw:.3f} | {many:.3f} | {many / one_gw:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
