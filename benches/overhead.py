#!/usr/bin/env python3
"""Gateway-overhead benchmark (driver; run it through benches/overhead.sh).

Measures, side by side and interleaved over several rounds:

  direct      load generator -> upstream (nginx `return 200 '<json>'`)
  nginx       load generator -> nginx reverse proxy (keepalive upstream) -> upstream
  switchyard  load generator -> switchyard -> upstream
  bare-hyper  load generator -> examples/bare_proxy -> upstream: the same HTTP stack
              (hyper server and client connections, thread-per-core tokio) doing
              nothing else, so switchyard minus bare-hyper is the gateway's own work
              (when BARE_BIN or target/release/examples/bare_proxy exists)
  (PEERS=1: sglang-router, vllm-router, when their packages are installed)
  (BUSY_POLL_US=N: switchyard-busy-poll, the same binary with `--busy-poll-us N`)
  (LIMITS=1: switchyard-limits, the same binary with API keys required and every
   in-memory limit on (per tenant and per key: requests and tokens per minute,
   concurrency, a daily budget), set high enough never to refuse; requests carry
   the key. Its CPU per request against `switchyard` is the price of tenancy.)

For each round and target: concurrency 1 for DURATION s (latency p50/p99) and
concurrency CONC for DURATION s (throughput), POSTing a small chat body. In each
phase the proxy's CPU time (utime+stime from /proc/PID/stat, summed over the
process and, for nginx, its workers) is divided by the number of requests
answered 200: "proxy CPU" is the high-concurrency figure, "CPU c=1" the other
(where busy polling shows its price). Reported figures are medians over rounds of per-round
differences/ratios against `direct` measured in the same round.

Loopback only; every child is started here and killed by PID on exit.
Stdlib only (Python 3.11).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = int(os.environ.get("ROUNDS", "3"))
DURATION = float(os.environ.get("DURATION", "5"))
CONC = int(os.environ.get("CONC", "64"))
WARMUP = float(os.environ.get("WARMUP", "1"))
PEERS = os.environ.get("PEERS", "0") == "1"
OUT_DIR = Path(os.environ.get("OUT_DIR", str(ROOT / "bench-out")))
SWITCHYARD = os.environ.get("SWITCHYARD_BIN", str(ROOT / "target/release/switchyard"))
# The profile-guided build (scripts/build-pgo.sh), measured as its own target when set.
SWITCHYARD_PGO = os.environ.get("SWITCHYARD_PGO_BIN", "")
BARE = os.environ.get("BARE_BIN", str(ROOT / "target/release/examples/bare_proxy"))
# Busy-poll window (µs) for an extra target running switchyard with --busy-poll-us; 0: none.
BUSY_POLL_US = int(os.environ.get("BUSY_POLL_US", "0"))
# Add the keys-and-limits target (switchyard-limits).
LIMITS = os.environ.get("LIMITS", "0") == "1"
BENCH_KEY = "sk-sy-benchkey-0123456789abcdefghijklmnopqrstuv"
# Extra request headers by target name (the limits target's API key).
TARGET_HEADERS: dict[str, list[str]] = {}
# Limits high enough never to refuse: every check runs, none says no.
LIMITS_TOML = """
[tenancy]
require_key = true
[[tenants]]
name = "bench"
api_key_env = "SWITCHYARD_BENCH_KEY"
[tenants.limits]
requests_per_minute = 1000000000
tokens_per_minute = 1000000000000
max_concurrent_requests = 1000000
daily_budget_usd = 1000000.0
[tenants.key_limits]
requests_per_minute = 1000000000
tokens_per_minute = 1000000000000
"""
NCPU = os.cpu_count() or 1
PROXY_WORKERS = int(os.environ.get("PROXY_WORKERS", str(NCPU)))
CLK_TCK = os.sysconf("SC_CLK_TCK")
# A whole run must end: rounds x targets x 2 phases x DURATION plus start-up slack.
READY_TIMEOUT = 60.0

MODEL = "bench-model"
MODELS_JSON = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}, separators=(",", ":"))
# ~300-byte non-streamed chat completion, usage at the end like real engines.
CHAT_RESPONSE = json.dumps(
    {
        "id": "chatcmpl-bench0000000000000000",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21},
    },
    separators=(",", ":"),
)
REQUEST_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16},
    separators=(",", ":"),
)
PATH = "/v1/chat/completions"


def log(msg: str) -> None:
    print(f"[overhead] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- processes

@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    # PIDs whose CPU counts as this target's (nginx: master + workers).
    cpu_pids: list[int] = field(default_factory=list)


CHILDREN: list[subprocess.Popen] = []


def spawn(name: str, argv: list[str], **kw) -> subprocess.Popen:
    p = subprocess.Popen(argv, **kw)
    CHILDREN.append(p)
    log(f"started {name} pid={p.pid}")
    return p


def cleanup() -> None:
    # Children only, by PID, newest first; nginx masters take their workers down on SIGTERM.
    for p in reversed(CHILDREN):
        if p.poll() is None:
            try:
                p.terminate()
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    for p in reversed(CHILDREN):
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    CHILDREN.clear()


def _on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 1.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def wait_ready(url: str, proc: subprocess.Popen, what: str) -> None:
    """Poll until `url` answers 200; fail if the process dies or time runs out."""
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before becoming ready")
        if http_status(url) == 200:
            return
        time.sleep(0.05)  # poll interval, not synchronisation
    raise RuntimeError(f"{what} not ready at {url} after {READY_TIMEOUT}s")


def children_of(pid: int) -> list[int]:
    out: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    for t in task_dir.iterdir():
        try:
            out += [int(x) for x in (t / "children").read_text().split()]
        except OSError:
            pass
    return out


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # Fields after the ")" that closes comm; utime and stime are fields 14 and 15.
        rest = stat[stat.rindex(")") + 2 :].split()
        total += int(rest[11]) + int(rest[12])
    return total


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# ---------------------------------------------------------------- nginx

NGINX_COMMON = """
daemon off;
master_process on;
worker_processes {workers};
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; multi_accept on; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 120s;
{servers}
}}
"""

UPSTREAM_SERVER = """
    server {{
        listen 127.0.0.1:{port} reuseport backlog=4096;
        default_type application/json;
        location = /v1/models {{ return 200 '{models}'; }}
        location / {{ return 200 '{chat}'; }}
    }}
"""

PROXY_SERVER = """
    upstream bench_upstream {{
        server 127.0.0.1:{up_port};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port} reuseport backlog=4096;
        location / {{
            proxy_pass http://bench_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
"""


def start_nginx(tmp: Path, name: str, workers: int, servers: str) -> Proc:
    d = tmp / name
    d.mkdir()
    os.chmod(d, 0o755)
    conf = d / "nginx.conf"
    conf.write_text(NGINX_COMMON.format(workers=workers, dir=d, servers=servers))
    p = spawn(f"nginx-{name}", ["nginx", "-p", str(d), "-c", str(conf)],
              stdout=subprocess.DEVNULL, stderr=open(d / "stderr.log", "w"))
    return Proc(name, p)


def nginx_pids(proc: Proc, workers: int) -> list[int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = children_of(proc.popen.pid)
        if len(kids) >= workers:
            return [proc.popen.pid] + kids
        time.sleep(0.05)
    raise RuntimeError(f"nginx {proc.name}: workers did not appear")


# ---------------------------------------------------------------- load generator

def run_load(url: str, conc: int, seconds: float, headers: list[str] | None = None) -> dict:
    """oha for `seconds` at concurrency `conc`: 200 count, 200s per second, raw p50/p99 (µs),
    and any non-200 answers or errors (requests cut off at the deadline excluded)."""
    extra = [a for h in (headers or []) for a in ("-H", h)]
    argv = ["oha", "--no-tui", "--output-format", "json", "-z", f"{seconds}s",
            "-c", str(conc), "-m", "POST", "-T", "application/json", *extra,
            "-d", REQUEST_BODY, url]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
    if r.returncode != 0:
        raise RuntimeError(f"oha failed: {r.stderr[-2000:]}")
    j = json.loads(r.stdout)
    codes = j.get("statusCodeDistribution", {})
    ok = int(codes.get("200", 0))
    errors = j.get("errorDistribution", {})
    bad = {k: v for k, v in codes.items() if k != "200"}
    # Requests cut at the deadline are not failures of the target.
    errors = {k: v for k, v in errors.items() if "deadline" not in k}
    pct = j["latencyPercentiles"]
    total = j["summary"]["total"]
    return {
        "ok": ok,
        "rps": ok / total,
        "p50_us": pct["p50"] * 1e6,
        "p99_us": pct["p99"] * 1e6,
        "bad": {**bad, **errors},
    }


TMP = ""


# ---------------------------------------------------------------- peers

PEER_PACKAGES = {"sglang-router": "sglang_router", "vllm-router": "vllm_router"}


def start_switchyard(tmp: Path, name: str, binary: str, up_url: str,
                     extra: tuple[str, ...] = ()) -> tuple[str, Proc]:
    """`switchyard serve` in front of the upstream on an ephemeral port; its URL."""
    env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
    err = open(tmp / f"{name}.log", "w")
    p = spawn(name, [binary, "serve", "--listen", "127.0.0.1:0", "--worker", up_url, *extra],
              stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    # Port 0: the gateway binds first and prints the address it got.
    # The ready line; a gateway that cannot serve yet first prints a
    # `switchyard listening url=…, not ready: …` line saying why.
    line = p.stdout.readline()
    while line.startswith("switchyard listening"):
        line = p.stdout.readline()
    if "switchyard ready url=" not in line:
        raise RuntimeError(f"{name} did not print its url (got {line!r}); see {tmp}/{name}.log")
    url = line.split("url=", 1)[1].strip()
    wait_ready(url + "/ready", p, name)
    return url, Proc(name, p, [p.pid])


def peer_version(name: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def peer_argv(name: str, up_urls: list[str], port: int, policy: str = "round_robin") -> list[str]:
    """CLI of the peer routers (from their `--help`, sglang-router 0.3.x, vllm-router 0.1.x):
    loopback only, metrics listener on its own free loopback port, quiet logs."""
    bindir = Path(sys.executable).parent
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *up_urls,
              "--policy", policy, "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(free_port())]
    if name == "sglang-router":
        return [str(bindir / "sglang-router"), "launch", *common, "--log-level", "warn"]
    if name == "vllm-router":
        return [str(bindir / "vllm-router"), *common, "--log-level", "warning"]
    raise ValueError(name)


def start_peer(name: str, up_urls: list[str], policy: str = "round_robin",
               ready_path: str = "/v1/models") -> tuple[str, Proc]:
    """Start a peer router in front of `up_urls`; raises if it is missing or does not come up
    (PEERS=1 asks for the peers: a missing one is an error, not a silent skip)."""
    try:
        __import__(PEER_PACKAGES[name])
    except ImportError:
        raise RuntimeError(f"{name} is not installed in {sys.executable} (pip install {name})") from None
    port = free_port()
    log_path = Path(TMP) / f"{name}-{port}.log"
    p = spawn(name, peer_argv(name, up_urls, port, policy), stdout=subprocess.DEVNULL,
              stderr=open(log_path, "w"))
    proc = Proc(name, p, [p.pid])
    try:
        wait_ready(f"http://127.0.0.1:{port}{ready_path}", p, name)
    except RuntimeError as e:
        raise RuntimeError(f"{e}; log: {log_path.read_text()[-2000:]}") from None
    # The console script runs the Rust router in-process (PyO3); count children too, if any.
    proc.cpu_pids = [p.pid] + children_of(p.pid)
    return f"http://127.0.0.1:{port}", proc


# ---------------------------------------------------------------- main

def tool_version(argv: list[str]) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        return (r.stdout + r.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "?"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    global TMP
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="switchyard-overhead-"))
    TMP = str(tmp)
    try:
        return run(tmp)
    finally:
        cleanup()
        if os.environ.get("KEEP_TMP") != "1":
            shutil.rmtree(tmp, ignore_errors=True)


def run(tmp: Path) -> int:
    if not os.access(SWITCHYARD, os.X_OK):
        raise SystemExit(f"{SWITCHYARD} not found: cargo build --release first")

    up_port, px_port = free_port(), free_port()
    upstream = start_nginx(tmp, "upstream", 1, UPSTREAM_SERVER.format(
        port=up_port, models=MODELS_JSON, chat=CHAT_RESPONSE))
    proxy = start_nginx(tmp, "proxy", PROXY_WORKERS, PROXY_SERVER.format(port=px_port, up_port=up_port))
    up_url = f"http://127.0.0.1:{up_port}"
    px_url = f"http://127.0.0.1:{px_port}"
    wait_ready(up_url + "/v1/models", upstream.popen, "nginx upstream")
    wait_ready(px_url + "/v1/models", proxy.popen, "nginx proxy")
    upstream.cpu_pids = nginx_pids(upstream, 1)
    proxy.cpu_pids = nginx_pids(proxy, PROXY_WORKERS)

    gw_url, gateway = start_switchyard(tmp, "switchyard", SWITCHYARD, up_url)
    gw = gateway.popen

    targets: list[tuple[str, str, Proc | None]] = [
        ("direct", up_url, upstream),
        ("nginx", px_url, proxy),
        ("switchyard", gw_url, gateway),
    ]
    if SWITCHYARD_PGO:
        url, proc = start_switchyard(tmp, "switchyard-pgo", SWITCHYARD_PGO, up_url)
        targets.append(("switchyard-pgo", url, proc))
    if BUSY_POLL_US:
        url, proc = start_switchyard(tmp, "switchyard-busy-poll", SWITCHYARD, up_url,
                                     ("--busy-poll-us", str(BUSY_POLL_US)))
        targets.append(("switchyard-busy-poll", url, proc))
    if LIMITS:
        os.environ["SWITCHYARD_BENCH_KEY"] = BENCH_KEY
        cfg = tmp / "limits.toml"
        cfg.write_text(LIMITS_TOML)
        url, proc = start_switchyard(tmp, "switchyard-limits", SWITCHYARD, up_url,
                                     ("--config", str(cfg)))
        targets.append(("switchyard-limits", url, proc))
        TARGET_HEADERS["switchyard-limits"] = [f"Authorization: Bearer {BENCH_KEY}"]
    if os.access(BARE, os.X_OK):
        bare_port = free_port()
        bp = spawn("bare-hyper", [BARE, f"127.0.0.1:{bare_port}", f"127.0.0.1:{up_port}"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        bare_url = f"http://127.0.0.1:{bare_port}"
        wait_ready(bare_url + "/v1/models", bp, "bare-hyper")
        targets.append(("bare-hyper", bare_url, Proc("bare-hyper", bp, [bp.pid])))
    else:
        log(f"{BARE} not built: no bare-hyper baseline (cargo build --release --example bare_proxy)")
    if PEERS:
        for name in ("sglang-router", "vllm-router"):
            url, proc = start_peer(name, [up_url])
            targets.append((name, url, proc))

    # Sanity: every target answers the chat body with the upstream's JSON.
    for name, url, _ in targets:
        hdrs = {"Content-Type": "application/json"}
        hdrs.update(h.split(": ", 1) for h in TARGET_HEADERS.get(name, []))
        req = urllib.request.Request(url + PATH, data=REQUEST_BODY.encode(), headers=hdrs)
        with urllib.request.urlopen(req, timeout=5) as r:
            body = r.read().decode()
            if r.status != 200 or json.loads(body).get("object") != "chat.completion":
                raise RuntimeError(f"{name}: unexpected answer {r.status} {body[:200]}")

    for name, url, _ in targets:
        run_load(url + PATH, CONC, WARMUP, TARGET_HEADERS.get(name))

    gw_rss0 = rss_kib(gw.pid)
    gw_reqs = 0
    # results[target] = list of per-round dicts
    results: dict[str, list[dict]] = {name: [] for name, _, _ in targets}
    n = len(targets)
    for rnd in range(ROUNDS):
        order = [targets[(rnd + k) % n] for k in range(n)]  # rotate who goes first
        row: dict[str, dict] = {name: {} for name, _, _ in targets}
        for name, url, proc in order:
            t0 = cpu_ticks(proc.cpu_pids)
            r = run_load(url + PATH, 1, DURATION, TARGET_HEADERS.get(name))
            t1 = cpu_ticks(proc.cpu_pids)
            row[name].update(p50=r["p50_us"], p99=r["p99_us"], c1_rps=r["rps"], c1_bad=r["bad"],
                             c1_cpu_us=(t1 - t0) / CLK_TCK / max(1, r["ok"]) * 1e6)
            if name == "switchyard":
                gw_reqs += r["ok"]
        for name, url, proc in order:
            t0 = cpu_ticks(proc.cpu_pids)
            up0 = cpu_ticks(upstream.cpu_pids)
            r = run_load(url + PATH, CONC, DURATION, TARGET_HEADERS.get(name))
            t1 = cpu_ticks(proc.cpu_pids)
            up1 = cpu_ticks(upstream.cpu_pids)
            ok = max(1, r["ok"])
            row[name].update(rps=r["rps"], ok=r["ok"], bad=r["bad"],
                             cpu_us=(t1 - t0) / CLK_TCK / ok * 1e6,
                             up_cpu_us=(up1 - up0) / CLK_TCK / ok * 1e6)
            if name == "switchyard":
                gw_reqs += r["ok"]
        for name in row:
            results[name].append(row[name])
            d = row[name]
            log(f"round {rnd + 1}/{ROUNDS} {name:<14} p50={d['p50']:7.1f}us p99={d['p99']:7.1f}us "
                f"c{CONC}={d['rps']:8.0f}/s cpu={d['cpu_us']:6.1f}us/req "
                f"{'ERRORS ' + str(d['bad']) + str(d['c1_bad']) if d['bad'] or d['c1_bad'] else ''}")
    gw_rss1 = rss_kib(gw.pid)

    # Per-round comparisons against direct in the same round, then medians.
    direct = results["direct"]
    table = []
    for name, _, _ in targets:
        rs = results[name]
        added50 = [r["p50"] - d["p50"] for r, d in zip(rs, direct)]
        added99 = [r["p99"] - d["p99"] for r, d in zip(rs, direct)]
        ratio = [r["rps"] / d["rps"] for r, d in zip(rs, direct)]
        table.append({
            "target": name,
            "p50": median([r["p50"] for r in rs]),
            "p99": median([r["p99"] for r in rs]),
            "added_p50": median(added50),
            "added_p99": median(added99),
            "rps": median([r["rps"] for r in rs]),
            "ratio": median(ratio),
            "cpu": median([r["cpu_us"] for r in rs]),
            "c1_cpu": median([r["c1_cpu_us"] for r in rs]),
            "up_cpu": median([r["up_cpu_us"] for r in rs]),
            "errors": sum(sum(r["bad"].values()) + sum(r["c1_bad"].values()) for r in rs),
            "rounds": rs,
        })

    versions = {
        "nginx": tool_version(["nginx", "-v"]),
        "loadgen": tool_version(["oha", "--version"]),
        "switchyard": tool_version([SWITCHYARD, "--version"]),
        "kernel": os.uname().release,
        "cpus": str(NCPU),
    }
    if PEERS:
        for name in PEER_PACKAGES:
            versions[name] = peer_version(name)
    md = render_markdown(table, versions, gw_rss0, gw_rss1, gw_reqs)
    print(md)
    (OUT_DIR / "overhead.md").write_text(md)
    (OUT_DIR / "overhead.json").write_text(json.dumps(
        {"config": {"rounds": ROUNDS, "duration_s": DURATION, "conc": CONC, "proxy_workers": PROXY_WORKERS}, "versions": versions, "table": table,
         "switchyard_rss_kib": [gw_rss0, gw_rss1], "switchyard_requests": gw_reqs}, indent=1))
    log(f"wrote {OUT_DIR / 'overhead.md'}")
    plot(table, OUT_DIR / "overhead.png")
    return 1 if any(t["errors"] for t in table) else 0


def plot(table, path: Path) -> None:
    """Three bar panels (added p50 at c=1, throughput ratio, proxy CPU per request), if
    matplotlib is importable (PEERS=1 installs it into the bench venv)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no chart")
        return
    rows = [t for t in table if t["target"] != "direct"]
    names = [t["target"] for t in rows]
    colors = ["#2b8a3e" if n.startswith("switchyard") else "#a5d8a2" if n == "bare-hyper" else "#868e96"
              for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = [("added_p50", "added latency p50, c=1 (µs)\nlower is better"),
              ("ratio", f"throughput at c={CONC} / direct\nhigher is better"),
              ("cpu", "proxy CPU per request (µs)\nlower is better")]
    for ax, (key, title) in zip(axes, panels):
        vals = [t[key] for t in rows]
        bars = ax.bar(names, vals, color=colors)
        ax.bar_label(bars, fmt="%.2f" if key == "ratio" else "%.0f", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.margins(y=0.15)
    fig.suptitle(f"Proxy overhead in front of a fixed-response nginx upstream "
                 f"(medians of {ROUNDS} interleaved rounds, 2 shared CPUs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    log(f"wrote {path}")


def render_markdown(table, versions, rss0, rss1, gw_reqs) -> str:
    lines = [
        f"Gateway overhead: {ROUNDS} rounds x {DURATION:g} s per phase, c=1 and c={CONC}, "
        f"loadgen {versions['loadgen']}, {versions['nginx']}, {versions['cpus']} CPUs, "
        f"nginx proxy worker_processes={PROXY_WORKERS}. Medians over rounds; added latency and "
        f"throughput ratio are computed against `direct` within each round."
        + "".join(f" {k} {versions[k]}." for k in PEER_PACKAGES if k in versions),
        "",
        f"| target | p50 c=1 (µs) | p99 c=1 (µs) | added p50 (µs) | added p99 (µs) | req/s c={CONC} | ratio to direct | proxy CPU (µs/req) | CPU c=1 (µs/req) | upstream CPU (µs/req) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in table:
        def rel(key: str) -> str:
            return "—" if t["target"] == "direct" else f"{t[key]:.1f}"
        lines.append(
            f"| {t['target']} | {t['p50']:.1f} | {t['p99']:.1f} | {rel('added_p50')} | {rel('added_p99')} | "
            f"{t['rps']:.0f} | {t['ratio']:.2f} | {rel('cpu')} | {rel('c1_cpu')} | {t['up_cpu']:.1f} |"
        )
    lines += ["", "Per round (p50 µs / p99 µs / req/s / proxy CPU µs per request):", ""]
    for t in table:
        per = "; ".join(f"{r['p50']:.0f}/{r['p99']:.0f}/{r['rps']:.0f}/{r['cpu_us']:.1f}" for r in t["rounds"])
        lines.append(f"- {t['target']}: {per}")
    if gw_reqs:
        lines += ["", f"switchyard RSS {rss0} KiB -> {rss1} KiB over {gw_reqs} measured requests "
                      f"({(rss1 - rss0) * 1024 / gw_reqs:.1f} bytes/request)."]
    errs = [t["target"] for t in table if t["errors"]]
    if errs:
        lines += ["", f"**Non-200 answers or errors from: {', '.join(errs)}** (see overhead.json)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
