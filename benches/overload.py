#!/usr/bin/env python3
"""Goodput under overload on a mixed simulated fleet: `least_queue`, `prefix` and
the `slo` policy (shedding what no worker is predicted to meet) side by side.

    benches/overload.sh                         # defaults below
    POLICIES=least_queue,slo DURATION=20 benches/overload.sh

Fleet: H100 and L4 profiles of the same model (`switchyard sim`, `H100S` and
`L4S` of each), slowed by TIME_SCALE so that a Python client can overload it,
each engine's batch capped at MAX_SEQS. Workload, open loop (Poisson arrivals):
two tenants (`x-switchyard-tenant`), `quiet` with short prompts and `noisy`
with prompts 10x longer (10x the prompt tokens), half of the requests each;
every request is of class `tight` (x-slo-ttft-ms TIGHT_TTFT_MS, x-slo-tpot-ms
TIGHT_TPOT_MS) or `lax` (x-slo-ttft-ms LAX_TTFT_MS), at random.

Method: the fleet's capacity is measured first (closed loop, least_queue,
CAPACITY_S seconds, 2x the fleet's batch slots as clients); each run then
offers LOAD x that rate for WARMUP seconds (not measured: the latency models
learn) and DURATION seconds (measured), on fresh engines and a fresh gateway.
The quiet tenant's traffic is also run alone (its half of the offered rate,
least_queue) for its reference TTFT p99. Reported per policy: goodput (requests
that met every objective of their class, per second of offered load), the
quiet tenant's TTFT p99 against alone, attainment per class, shed share, and
the median absolute TTFT prediction error (the access log's predicted_ttft_ms
against ttft_ms, measured requests only). `NAME+flow` runs add the gateway's
flow control (MAX_SEQS in flight per engine, `[pools.flow_control]` with
`hold_for_faster = HOLD_FOR_FASTER` when set, else its default;
`NAME+flow:KEY=V,...` sets `[pools.flow_control]` keys for that run, e.g.
`slo+flow:reserved_slots=0`). CAPACITY and ALONE_P99 skip those
measurements with the figures of an earlier run. Each run's
access log is kept as OUT_DIR/overload-POLICY.access.jsonl; request ids are
`TAG-N-TENANT-CLASS`, so its queued_ms / dispatched_ms / ttft_ms split per
tenant and class.

Loopback only; every child is started here and killed by PID on exit.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benches"))
import overhead  # noqa: E402  (spawn/cleanup by PID, readiness)

SWITCHYARD = os.environ.get("SWITCHYARD_BIN", str(ROOT / "target/release/switchyard"))
# `NAME+flow`: policy NAME with the gateway's flow control on (each engine's batch
# slots as the in-flight limit, the rest held in the gateway, tenants sharing
# fairly in tokens).
POLICIES = os.environ.get("POLICIES", "least_queue,prefix,slo,slo+flow").split(",")
H100S = int(os.environ.get("H100S", "2"))
L4S = int(os.environ.get("L4S", "2"))
MAX_SEQS = int(os.environ.get("MAX_SEQS", "8"))
TIME_SCALE = float(os.environ.get("TIME_SCALE", "0.25"))
LOAD = float(os.environ.get("LOAD", "1.5"))
CAPACITY_S = float(os.environ.get("CAPACITY_S", "15"))
WARMUP = float(os.environ.get("WARMUP", "8"))
DURATION = float(os.environ.get("DURATION", "30"))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "16"))
QUIET_WORDS = int(os.environ.get("QUIET_WORDS", "40"))
TIGHT_TTFT_MS = int(os.environ.get("TIGHT_TTFT_MS", "800"))
TIGHT_TPOT_MS = int(os.environ.get("TIGHT_TPOT_MS", "150"))
LAX_TTFT_MS = int(os.environ.get("LAX_TTFT_MS", "8000"))
SEED = int(os.environ.get("SEED", "7"))
# `[pools.flow_control].hold_for_faster` of the `+flow` runs (unset: the default).
HOLD_FOR_FASTER = os.environ.get("HOLD_FOR_FASTER", "")
# Skip a measurement by giving its result from an earlier run (req/s, ms).
CAPACITY = float(os.environ.get("CAPACITY", "0"))
ALONE_P99 = float(os.environ.get("ALONE_P99", "0"))
OUT_DIR = Path(os.environ.get("OUT_DIR", str(ROOT / "bench-out")))
MODEL = "sim-llama-8b"
CLASSES = {"tight": (TIGHT_TTFT_MS, TIGHT_TPOT_MS), "lax": (LAX_TTFT_MS, None)}


def log(msg: str) -> None:
    print(f"[overload] {msg}", file=sys.stderr, flush=True)


def start_sim(tmp: Path, name: str, profile: str) -> str:
    out = tmp / f"{name}.out"
    p = overhead.spawn(name, [
        SWITCHYARD, "sim", "--port", "0", "--profile", profile, "--time-scale", str(TIME_SCALE),
        "--max-num-seqs", str(MAX_SEQS), "--seed", name[-1],
    ], stdout=open(out, "w"), stderr=subprocess.DEVNULL)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        for line in out.read_text().splitlines():
            if line.startswith("switchyard-sim ready"):
                url = line.split("url=", 1)[1].split()[0]
                overhead.wait_ready(url + "/health", p, name)
                return url
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited")
        time.sleep(0.02)  # poll for the ready line
    raise RuntimeError(f"{name} printed no ready line")


def start_gateway(tmp: Path, name: str, policy: str, urls: list[str]) -> str:
    policy, _, flow = policy.partition("+")
    flow, _, settings = flow.partition(":")
    knobs = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
    if HOLD_FOR_FASTER:
        knobs.setdefault("hold_for_faster", HOLD_FOR_FASTER)
    shed = "shed" if policy == "slo" else "downgrade"
    flow_lines = (f"max_concurrency_per_worker = {MAX_SEQS}\n[pools.flow_control]\n"
                  + "".join(f"{k} = {v}\n" for k, v in knobs.items())
                  if flow else "")
    workers = ", ".join(f'{{ url = "{u}" }}' for u in urls)
    cfg = tmp / f"{name}.toml"
    cfg.write_text(f"""
[tenancy]
trust_tenant_header = true
anonymous_allow_slo_headers = true
anonymous_max_priority = "critical"
[access_log]
enabled = true
path = "{tmp / (name + '.access.jsonl')}"
buffer = 65536
[[pools]]
name = "p"
models = ["{MODEL}"]
policy = "{policy}"
workers = [{workers}]
{flow_lines}[pools.routing]
stats_interval_ms = 100
slo_unattainable = "{shed}"
""")
    err = open(tmp / f"{name}.log", "w")
    p = overhead.spawn(name, [SWITCHYARD, "serve", "--listen", "127.0.0.1:0", "--config", str(cfg)],
                       stdout=subprocess.PIPE, stderr=err, text=True,
                       env=dict(os.environ, RUST_LOG="warn"))
    line = p.stdout.readline()
    while line.startswith("switchyard listening"):
        line = p.stdout.readline()
    if "switchyard ready url=" not in line:
        raise RuntimeError(f"{name}: no ready line ({line!r})")
    url = line.split("url=", 1)[1].strip()
    overhead.wait_ready(url + "/ready", p, name)
    return url


def fleet(tmp: Path, tag: str) -> list[str]:
    return ([start_sim(tmp, f"{tag}-h100-{i}", "llama-8b-h100") for i in range(H100S)]
            + [start_sim(tmp, f"{tag}-l4-{i}", "llama-8b-l4") for i in range(L4S)])


def prompt(rng: random.Random, tenant: str) -> str:
    words = QUIET_WORDS * (10 if tenant == "noisy" else 1)
    return " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega", "sigma"))
                    for _ in range(words))


def one(base: str, tenant: str, cls: str, text: str, rid: str) -> dict:
    """One streamed request; what the client saw."""
    ttft_ms, tpot_ms = CLASSES[cls]
    headers = {"Content-Type": "application/json", "x-switchyard-tenant": tenant,
               "x-slo-ttft-ms": str(ttft_ms), "x-request-id": rid}
    if tpot_ms:
        headers["x-slo-tpot-ms"] = str(tpot_ms)
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": MAX_TOKENS,
                       "ignore_eos": True,
                       "messages": [{"role": "user", "content": text}]}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers=headers)
    t0 = time.monotonic()
    first = last = None
    n = 0
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                obj = json.loads(line[5:])
                if obj.get("choices") and obj["choices"][0].get("delta", {}).get("content"):
                    now = time.monotonic()
                    first = first or now
                    last = now
                    n += 1
        status = 200
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError:
        status = 0
    ttft = (first - t0) * 1e3 if first else None
    tpot = ((last - first) * 1e3 / (n - 1)) if n > 1 else None
    met = (status == 200 and ttft is not None and ttft <= ttft_ms
           and (tpot_ms is None or (tpot is not None and tpot <= tpot_ms)))
    return {"tenant": tenant, "cls": cls, "status": status, "ttft": ttft, "tpot": tpot, "met": met}


def open_loop(base: str, rate: float, seconds: float, tenants: tuple[str, ...], tag: str,
              rng: random.Random) -> list[dict]:
    """Poisson arrivals at `rate`/s for `seconds`; waits for every answer."""
    out: list[dict] = []
    lock = threading.Lock()
    threads = []
    t_end = time.monotonic() + seconds
    nxt = time.monotonic()
    i = 0
    while True:
        nxt += rng.expovariate(rate)
        if nxt >= t_end:
            break
        delay = nxt - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the arrival schedule itself, not synchronisation
        tenant = rng.choice(tenants)
        cls = rng.choice(("tight", "lax"))
        text = prompt(rng, tenant)
        rid = f"{tag}-{i}-{tenant}-{cls}"
        i += 1

        def run(t=tenant, c=cls, x=text, r=rid):
            res = one(base, t, c, x, r)
            with lock:
                out.append(res)

        th = threading.Thread(target=run, daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout=180)
    return out


def capacity(tmp: Path) -> float:
    urls = fleet(tmp, "cap")
    base = start_gateway(tmp, "gw-cap", "least_queue", urls)
    rng = random.Random(SEED)
    done = []
    lock = threading.Lock()
    end = time.monotonic() + CAPACITY_S

    def client(k: int):
        r = random.Random(SEED + k)
        while time.monotonic() < end:
            t = r.choice(("quiet", "noisy"))
            res = one(base, t, "lax", prompt(r, t), f"cap-{k}")
            res["at"] = time.monotonic()
            with lock:
                done.append(res)

    clients = 2 * MAX_SEQS * (H100S + L4S)
    ths = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    t0 = time.monotonic()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    overhead.cleanup()
    # Answers completed inside the window: the queues' drain afterwards is not
    # throughput.
    ok = sum(1 for d in done if d["status"] == 200 and d["at"] <= end)
    del rng
    return ok / (end - t0)


def quiet_alone(tmp: Path, rate: float) -> float:
    """The quiet tenant's TTFT p99 with its half of `rate` alone (least_queue)."""
    urls = fleet(tmp, "alone")
    base = start_gateway(tmp, "gw-alone", "least_queue", urls)
    rng = random.Random(SEED)
    open_loop(base, rate / 2, WARMUP, ("quiet",), "walone", rng)
    alone = open_loop(base, rate / 2, DURATION, ("quiet",), "malone", rng)
    overhead.cleanup()
    return pct([r["ttft"] for r in alone if r["ttft"] is not None], 0.99)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def prediction_error(path: Path, prefix: str) -> tuple[float, int]:
    errs = []
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if not r["request_id"].startswith(prefix):
                continue
            p, a = r.get("predicted_ttft_ms"), r.get("ttft_ms")
            if p is not None and a:
                errs.append(abs(p - a) / a)
    return (statistics.median(errs) if errs else float("nan")), len(errs)


def run_policy(tmp: Path, policy: str, rate: float) -> dict:
    urls = fleet(tmp, policy)
    base = start_gateway(tmp, f"gw-{policy}", policy, urls)
    rng = random.Random(SEED)
    open_loop(base, rate, WARMUP, ("quiet", "noisy"), f"w{policy}", rng)
    res = open_loop(base, rate, DURATION, ("quiet", "noisy"), f"m{policy}", rng)
    time.sleep(1.0)  # let the access-log writer flush its last lines (no signal for it)
    access = tmp / f"gw-{policy}.access.jsonl"
    err, n_err = prediction_error(access, f"m{policy}")
    if access.exists():  # kept for the per-request breakdown (queued_ms, dispatched_ms, ...)
        shutil.copy(access, OUT_DIR / f"overload-{policy}.access.jsonl")
    overhead.cleanup()
    return summarize(policy, res, err, n_err)


def summarize(name: str, res: list[dict], err: float = float("nan"), n_err: int = 0) -> dict:
    quiet = [r["ttft"] for r in res if r["tenant"] == "quiet" and r["ttft"] is not None]
    by_cls = {c: [r for r in res if r["cls"] == c] for c in CLASSES}
    return {
        "policy": name, "requests": len(res),
        "goodput_rps": sum(r["met"] for r in res) / DURATION,
        "quiet_ttft_p99_ms": pct(quiet, 0.99),
        "attainment": {c: (sum(r["met"] for r in rs) / len(rs) if rs else float("nan"))
                       for c, rs in by_cls.items()},
        "shed": sum(r["status"] == 503 for r in res) / max(len(res), 1),
        "errors": sum(r["status"] not in (200, 503) for r in res),
        "median_abs_ttft_error": err, "predictions": n_err,
    }


def markdown(rate_cap: float, alone_p99: float, rows: list[dict]) -> str:
    out = [f"Capacity (closed loop, least_queue): {rate_cap:.1f} req/s; offered {LOAD}x = "
           f"{LOAD * rate_cap:.1f} req/s for {DURATION:.0f} s after {WARMUP:.0f} s of warm-up. "
           f"Quiet tenant alone: TTFT p99 {alone_p99:.0f} ms.", "",
           "| policy | goodput (req/s) | quiet TTFT p99 (ms) | vs alone | tight met | lax met "
           "| shed | errors | median abs TTFT error |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["attainment"]
        err = r["median_abs_ttft_error"]
        out.append(
            f"| {r['policy']} | {r['goodput_rps']:.2f} | {r['quiet_ttft_p99_ms']:.0f} | "
            f"{r['quiet_ttft_p99_ms'] / alone_p99:.2f}x | {a['tight']:.0%} | {a['lax']:.0%} | "
            f"{r['shed']:.0%} | {r['errors']} | "
            + (f"{err:.0%} (n={r['predictions']})" if err == err else "–") + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    import signal
    signal.signal(signal.SIGTERM, overhead._on_signal)  # children die with us
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="overload-") as d:
            tmp = Path(d)
            cap = CAPACITY or capacity(tmp)
            rate = LOAD * cap
            log(f"capacity {cap:.1f} req/s; offering {rate:.1f} req/s")
            alone_p99 = ALONE_P99 or quiet_alone(tmp, rate)
            rows = []
            for policy in POLICIES:
                rows.append(run_policy(tmp, policy, rate))
                log(json.dumps(rows[-1]))
    finally:
        overhead.cleanup()
    md = markdown(cap, alone_p99, rows)
    (OUT_DIR / "overload.md").write_text(md)
    (OUT_DIR / "overload.json").write_text(json.dumps(
        {"capacity_rps": cap, "quiet_alone_ttft_p99_ms": alone_p99, "rows": rows}, indent=2))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
