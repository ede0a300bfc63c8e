#!/usr/bin/env python3
"""Chaos soak: the release gateway over 4 simulated workers with random faults.

Loopback only, bounded in requests and time, every child stopped by PID.
Run through benches/chaos_soak.sh (builds the release binary first).

Faults:
  * worker-side, random: each sim answers --error-rate of requests with 500 and
    delays --spike-rate of them by --spike-ms;
  * worker-side, chaos: every --chaos-every-s (1 s) one worker (never two at once) gets
    a fault for that period through POST /sim/faults: always reset, hang, 500,
    503, 429, die-after:3, or a failing /health (refused connections are left
    out: they close the listener that serves /sim/faults, so the script could
    not clear them);
  * client-forced: --forced-fraction of requests carry an x-sim-fault header
    (500, 429, reset, hang, die-after:N). The header is forwarded to every
    attempt, so these fail by the client's own request; they are counted apart
    and checked for the expected status (500/429 passed through, 502 on reset,
    504 on hang, a stream cut with an error event on die-after).

Classification of the other requests:
  succeeded        200 and a complete body (non-stream JSON with choices;
                   stream with content events and [DONE])
  eligible_failed  failed before any byte reached the client and not caused by
                   the client: any non-200 or transport error on a non-stream
                   request, or a stream that failed before its first content
                   event. Target: 0.
  cut_with_error   a stream that delivered content, then ended with an explicit
                   SSE error event (acceptable: the gateway cannot retry then)
  silent_truncated a stream that ended without [DONE] and without an error event
                   (must be 0)
"""

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HOST = "127.0.0.1"


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def free_range(n):
    for _ in range(200):
        base = random.randint(20000, 60000 - n)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((HOST, base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def http_json(method, port, path, body=None, timeout=5):
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        c.request(method, path, body=data, headers={"content-type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def wait_until(pred, within, what):
    end = time.time() + within
    while time.time() < end:
        try:
            if pred():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def percentile(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100.0 * len(xs) + 0.5)) - 1))
    return xs[k]


class Chaos(threading.Thread):
    """One worker at a time gets a fault for `every` seconds, then is cleared."""

    KINDS = [
        {"always": "reset"},
        {"always": "hang"},
        {"always": "500"},
        {"always": "503"},
        {"always": "429"},
        {"always": "die-after:3"},
        {"health_fail": True},
    ]

    def __init__(self, ports, baseline, every, rng):
        super().__init__(daemon=True)
        self.ports, self.baseline, self.every, self.rng = ports, baseline, every, rng
        self.stop = threading.Event()
        self.log = []

    def set(self, port, extra):
        try:
            http_json("POST", port, "/sim/faults", {**self.baseline, **extra})
        except OSError as e:
            self.log.append(("error", port, str(e)))

    def run(self):
        while not self.stop.is_set():
            port = self.rng.choice(self.ports)
            kind = self.rng.choice(self.KINDS)
            self.log.append((round(time.time(), 2), port, kind))
            self.set(port, kind)
            self.stop.wait(self.every)
            self.set(port, {})


FORCED = ["500", "429", "reset", "hang"]


def one_request(port, model, stream, forced, max_tokens, timeout_s, request_id):
    """Returns (class, latency_s, detail)."""
    body = {
        "model": model,
        "stream": stream,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": f"soak {random.random()}"}],
    }
    headers = {"content-type": "application/json", "x-request-id": request_id}
    if forced:
        headers["x-sim-fault"] = forced
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        c.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers=headers)
        r = c.getresponse()
        if not stream or r.status != 200:
            data = r.read()
            dt = time.perf_counter() - t0
            if r.status == 200:
                ok = "choices" in json.loads(data)
                return ("succeeded" if ok else "eligible_failed", dt, "200 without choices")
            msg = data[:160].decode(errors="replace")
            return ("eligible_failed", dt, f"status {r.status}: {msg}")
        content, done, error = 0, False, None
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            ev = json.loads(payload)
            if "error" in ev:
                error = ev["error"].get("code") or ev["error"].get("type")
            elif ev.get("choices"):
                content += 1
        dt = time.perf_counter() - t0
        if done and error is None:
            return ("succeeded", dt, "")
        if error is not None:
            if content == 0:
                return ("eligible_failed", dt, f"stream error before content: {error}")
            return ("cut_with_error", dt, str(error))
        return ("silent_truncated", dt, f"{content} events, no [DONE], no error")
    except (OSError, http.client.HTTPException, ValueError) as e:
        return ("eligible_failed", time.perf_counter() - t0, f"transport: {type(e).__name__}: {e}")
    finally:
        c.close()


def expected_forced(fault, stream, cls, detail):
    """Did a client-forced fault end the way the gateway promises?"""
    if fault.startswith("die-after"):
        return cls == "cut_with_error" if stream else cls == "eligible_failed"
    want = {"500": "status 500", "429": "status 429", "reset": "status 502", "hang": "status 504"}
    return cls == "eligible_failed" and detail.startswith(want[fault] + ":")


def run_round(name, args, gw_port, model, rng):
    plan = []
    for i in range(args.requests):
        stream = rng.random() < args.stream_fraction
        forced = None
        if rng.random() < args.forced_fraction:
            forced = rng.choice(args.forced_kinds.split(",") + (["die-after:%d" % rng.randint(1, 4)] if stream else []))
        plan.append((stream, forced, rng.randint(8, 48), f"soak-{name}-{i}"))
    deadline = time.time() + args.round_timeout_s

    def go(item):
        stream, forced, mt, rid = item
        if time.time() > deadline:
            return (stream, forced, "not_sent", 0.0, "round deadline", 0, rid)
        t = round(time.time(), 2)
        return ((stream, forced) + one_request(gw_port, model, stream, forced, mt, args.client_timeout_s, rid)
                + (t, rid))

    t0 = time.time()
    with ThreadPoolExecutor(max_workers=args.concurrency) as ex:
        results = list(ex.map(go, plan))
    wall = time.time() - t0
    counts = {k: 0 for k in ["succeeded", "eligible_failed", "cut_with_error", "silent_truncated", "not_sent"]}
    forced_n, forced_unexpected, lat, failures = 0, [], [], []
    for stream, forced, cls, dt, detail, t, rid in results:
        if forced:
            forced_n += 1
            if not expected_forced(forced, stream, cls, detail):
                forced_unexpected.append((t, forced, stream, cls, detail, rid))
            continue
        counts[cls] += 1
        if cls == "succeeded":
            lat.append(dt)
        elif cls in ("eligible_failed", "silent_truncated"):
            failures.append((t, stream, cls, detail, rid))
    sent = args.requests - counts["not_sent"]
    return {
        "round": name,
        "sent": sent,
        "wall_s": round(wall, 1),
        "unforced": sent - forced_n,
        **counts,
        "forced": forced_n,
        "forced_unexpected": len(forced_unexpected),
        "p50_ms": round(percentile(lat, 50) * 1000, 1),
        "p99_ms": round(percentile(lat, 99) * 1000, 1),
        "failure_details": failures[:300],
        "forced_unexpected_details": forced_unexpected[:100],
    }


FAILED_LINE = re.compile(r'request failed.*?request_id="?([^" ]+)"?.*?attempts=("[^"]*"|\S*).*?stop="?(\w+)')


def gateway_failures(log_path):
    """request id -> (attempts trail, stop reason) from the gateway's `request failed` lines."""
    out = {}
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                m = FAILED_LINE.search(ANSI.sub("", line))
                if m:
                    out[m.group(1)] = (m.group(2).strip('"'), m.group(3))
    except OSError:
        pass
    return out


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def explain(rounds, log_path):
    """Attach the gateway's view to every failure and print them grouped."""
    seen = gateway_failures(log_path)
    for r in rounds:
        groups = {}
        for i, (t, stream, cls, detail, rid) in enumerate(r["failure_details"]):
            trail, stop = seen.get(rid, ("?", "?"))
            r["failure_details"][i] = {"t": t, "stream": stream, "class": cls, "detail": detail,
                                       "request_id": rid, "attempts": trail, "stop": stop}
            outcomes = ",".join(a.rsplit("=", 1)[-1] for a in trail.split(",")) if trail not in ("", "?") else trail
            key = (cls, detail[:60], stop, outcomes)
            groups[key] = groups.get(key, 0) + 1
        if groups:
            print(f"{r['round']}: {r['eligible_failed']} eligible-failed, {r['silent_truncated']} silently truncated:",
                  flush=True)
            for (cls, detail, stop, outcomes), n in sorted(groups.items(), key=lambda kv: -kv[1]):
                print(f"  {n:4d} x {cls}: {detail!r}; gateway: attempts {outcomes}, stopped: {stop}", flush=True)


def metric(text, name):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ":
            total += float(line.rsplit(" ", 1)[1])
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/switchyard")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--requests", type=int, default=3000, help="per round")
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds (after the warm-up)")
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="rounds run first, reported, but not counted for RSS growth")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--stream-fraction", type=float, default=0.5)
    ap.add_argument("--forced-fraction", type=float, default=0.05)
    ap.add_argument("--forced-kinds", default=",".join(FORCED),
                    help="x-sim-fault values for client-forced requests (die-after:N is added for streams)")
    ap.add_argument("--error-rate", type=float, default=0.05)
    ap.add_argument("--spike-rate", type=float, default=0.02)
    ap.add_argument("--spike-ms", type=int, default=300)
    ap.add_argument("--chaos-every-s", type=float, default=1.0)
    ap.add_argument("--no-chaos", action="store_true")
    ap.add_argument("--first-byte-ms", type=int, default=1000)
    ap.add_argument("--eject-after-failures", type=int, default=3, help="health.eject_after_failures")
    ap.add_argument("--max-attempts", type=int, default=4)
    ap.add_argument("--retry-budget-ratio", type=float, default=0.5)
    ap.add_argument("--client-timeout-s", type=float, default=15)
    ap.add_argument("--round-timeout-s", type=float, default=240)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    base = free_range(4)
    gw_port = free_port()
    sim_ports = [base + i for i in range(4)]
    procs = []
    logs = tempfile.mkdtemp(prefix="chaos-soak-")

    def cleanup(*_):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()

    signal.signal(signal.SIGTERM, lambda *a: (cleanup(), sys.exit(1)))
    try:
        sim_cmd = [args.bin, "sim", "--workers", "4", "--base-port", str(base), "--time-scale", "20",
                   "--error-rate", str(args.error_rate), "--spike-rate", str(args.spike_rate),
                   "--spike-ms", str(args.spike_ms), "--seed", str(args.seed)]
        procs.append(subprocess.Popen(sim_cmd, stdout=open(f"{logs}/sim.log", "w"), stderr=subprocess.STDOUT))
        for p in sim_ports:
            wait_until(lambda p=p: http_json("GET", p, "/health")[0] == 200, 20, f"sim :{p}")
        model = json.loads(http_json("GET", sim_ports[0], "/v1/models")[1])["data"][0]["id"]
        workers = ", ".join(f'{{ url = "http://{HOST}:{p}" }}' for p in sim_ports)
        cfg = f"""[server]
listen = "{HOST}:{gw_port}"
[server.timeouts]
first_byte_ms = {args.first_byte_ms}
idle_ms = 3000
total_ms = 20000
[health]
interval_ms = 200
timeout_ms = 300
eject_after_failures = {args.eject_after_failures}
[[pools]]
name = "soak"
models = ["{model}"]
max_attempts = {args.max_attempts}
retry_budget_ratio = {args.retry_budget_ratio}
workers = [{workers}]
"""
        cfg_path = os.path.join(args.out, "chaos_soak_gateway.toml")
        with open(cfg_path, "w") as f:
            f.write(cfg)
        gw = subprocess.Popen([args.bin, "serve", "--config", cfg_path],
                              stdout=open(f"{logs}/gateway.log", "w"), stderr=subprocess.STDOUT,
                              env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")})
        procs.append(gw)
        wait_until(lambda: http_json("GET", gw_port, "/ready")[0] == 200, 20, "gateway ready")
        baseline = {"error_rate": args.error_rate, "error_status": 500,
                    "spike_rate": args.spike_rate, "spike_ms": args.spike_ms}
        rss = {"start": rss_kib(gw.pid)}
        rounds = []
        total = args.warmup_rounds + args.rounds
        for i in range(total):
            chaos = None
            if not args.no_chaos:
                chaos = Chaos(sim_ports, baseline, args.chaos_every_s, random.Random(args.seed + 100 + i))
                chaos.start()
            name = f"warmup{i + 1}" if i < args.warmup_rounds else f"round{i + 1 - args.warmup_rounds}"
            res = run_round(name, args, gw_port, model, rng)
            if chaos:
                chaos.stop.set()
                chaos.join()
                res["chaos_events"] = len(chaos.log)
                res["chaos_log"] = chaos.log
            for p in sim_ports:
                http_json("POST", p, "/sim/faults", baseline)
            time.sleep(1.0)  # let in-flight cleanup finish before sampling memory
            rss[f"after_{name}"] = rss_kib(gw.pid)
            res["rss_kib_after"] = rss[f"after_{name}"]
            rounds.append(res)
            print(json.dumps({k: v for k, v in res.items() if not k.endswith(("details", "log"))}), flush=True)
        gw_log = f"{logs}/gateway.log"
        explain(rounds, gw_log)
        measured = [r for r in rounds if r["round"].startswith("round")]
        if measured:
            base_rss = rounds[args.warmup_rounds - 1]["rss_kib_after"] if args.warmup_rounds else rss["start"]
            growth = [r["rss_kib_after"] - base_rss for r in measured]
            rss["after_warmup"] = base_rss
            rss["growth_kib_per_round"] = round((measured[-1]["rss_kib_after"] - base_rss) / len(measured), 1)
            print(f"RSS (KiB): start {rss['start']}, after warm-up {base_rss}, after each measured round "
                  f"{[r['rss_kib_after'] for r in measured]} (growth {growth}; "
                  f"{rss['growth_kib_per_round']} KiB per round)", flush=True)
        text = http_json("GET", gw_port, "/metrics")[1].decode()
        gm = {n: metric(text, n) for n in [
            "switchyard_retries_total", "switchyard_retry_budget_exhausted_total",
            "switchyard_worker_ejections_total", "switchyard_stream_errors_total",
            "switchyard_worker_overloaded_total", "switchyard_upstream_attempts_total"]}
        report = {"command": " ".join(sys.argv), "sim_command": " ".join(sim_cmd),
                  "config": cfg, "rss_kib": rss, "rounds": rounds, "gateway_metrics": gm,
                  "gateway_alive": gw.poll() is None}
        with open(os.path.join(args.out, "chaos_soak.json"), "w") as f:
            json.dump(report, f, indent=2)
        print(json.dumps({"rss_kib": rss, "gateway_metrics": gm}), flush=True)
        bad = sum(r["eligible_failed"] + r["silent_truncated"] for r in measured)
        return 1 if bad else 0
    finally:
        cleanup()
        for name in ("gateway.log", "sim.log"):
            try:
                with open(f"{logs}/{name}") as src, open(os.path.join(args.out, f"chaos_soak_{name}"), "w") as dst:
                    dst.write(src.read()[-200_000:])
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
