#!/usr/bin/env python3
"""Instructions per proxied request, counted by valgrind (callgrind): a figure that
does not move with the host's noise, unlike the timings of benches/overhead.sh.

Each proxy runs alone under `valgrind --tool=callgrind --separate-threads=yes` in
front of the same fixed-response nginx upstream as overhead.py. A client sends 300
warm-up requests, the counters are zeroed (`callgrind_control -z`), then REQUESTS
sequential keep-alive requests (the c=1 case) follow and the counters are dumped.
Reported: user-space instructions per request of the proxy thread that served them
(the thread with the most; other threads, such as switchyard's stats poller, run on
a clock and are left out).

  targets   nginx (one worker, master_process off), bare-hyper (examples/bare_proxy),
            switchyard (--threads 1), switchyard-pgo (when target/pgo/switchyard exists),
            switchyard-limits (LIMITS=1: keys required, every in-memory limit on)

  python3 benches/instructions.py                # ~20 s; needs valgrind and nginx
  REQUESTS=5000 python3 benches/instructions.py

Counts are of instructions, not time: a cold cache at c=1 makes each one dearer,
which is why fewer instructions matter most there. Kernel work (syscalls, loopback
TCP) is not counted.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead as o  # noqa: E402  (the same upstream, body and helpers)

REQUESTS = int(os.environ.get("REQUESTS", "2000"))
WARMUP = 300


def drive(port: int, n: int, headers: dict[str, str] | None = None) -> None:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = o.REQUEST_BODY.encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    for _ in range(n):
        c.request("POST", o.PATH, body, h)
        r = c.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"port {port}: {r.status} {data[:200]!r}")
    c.close()


def totals(path: Path) -> int:
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    return 0


def measure(tmp: Path, name: str, argv: list[str], port: int,
            headers: dict[str, str] | None = None) -> dict:
    out = tmp / name
    out.mkdir()
    p = o.spawn(name, ["valgrind", "--tool=callgrind", "--separate-threads=yes",
                       f"--callgrind-out-file={out}/cg.%p", *argv],
                stdout=subprocess.DEVNULL, stderr=open(out / "valgrind.log", "w"))
    # Under valgrind start-up takes seconds; /v1/models answers once it listens.
    deadline = time.monotonic() + 120
    while o.http_status(f"http://127.0.0.1:{port}/v1/models", 2.0) != 200:
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start under valgrind; see {out}/valgrind.log")
        time.sleep(0.2)  # poll interval
    drive(port, WARMUP, headers)
    subprocess.run(["callgrind_control", "-z", str(p.pid)], check=True, capture_output=True)
    drive(port, REQUESTS, headers)
    subprocess.run(["callgrind_control", "-d", str(p.pid)], check=True, capture_output=True)
    # The dump (part 1, one file per thread: cg.PID.1-TT) is written by the process
    # itself: wait until it is complete.
    deadline = time.monotonic() + 30
    last: list[int] = []
    while True:
        per_thread = sorted(totals(f) for f in out.glob("cg.*.1-*"))
        if per_thread and max(per_thread) > 0 and per_thread == last:
            break
        last = per_thread
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: no callgrind dump in {out}")
        time.sleep(0.2)  # poll interval
    p.terminate()
    p.wait(timeout=30)
    return {"target": name, "thread": max(per_thread) / REQUESTS}


def main() -> int:
    for tool in ("valgrind", "callgrind_control", "nginx"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            raise SystemExit(f"{tool} is required (apt-get install -y valgrind nginx)")
    root = Path(__file__).resolve().parent.parent
    sy = os.environ.get("SWITCHYARD_BIN", str(root / "target/release/switchyard"))
    pgo = os.environ.get("SWITCHYARD_PGO_BIN", str(root / "target/pgo/switchyard"))
    bare = os.environ.get("BARE_BIN", str(root / "target/release/examples/bare_proxy"))
    tmp = Path(tempfile.mkdtemp(prefix="switchyard-instr-"))
    try:
        up_port = o.free_port()
        up = o.start_nginx(tmp, "upstream", 1, o.UPSTREAM_SERVER.format(
            port=up_port, models=o.MODELS_JSON, chat=o.CHAT_RESPONSE))
        o.wait_ready(f"http://127.0.0.1:{up_port}/v1/models", up.popen, "nginx upstream")
        up_url = f"http://127.0.0.1:{up_port}"
        rows = []
        # nginx as the proxy: one process serving everything, so its counts are comparable.
        port = o.free_port()
        d = tmp / "proxy"
        d.mkdir()
        conf = d / "nginx.conf"
        conf.write_text(o.NGINX_COMMON.replace("master_process on;", "master_process off;").format(
            workers=1, dir=d, servers=o.PROXY_SERVER.format(port=port, up_port=up_port)))
        rows.append(measure(tmp, "nginx", ["nginx", "-p", str(d), "-c", str(conf)], port))
        if os.access(bare, os.X_OK):
            port = o.free_port()
            rows.append(measure(tmp, "bare-hyper", [bare, f"127.0.0.1:{port}",
                                                    f"127.0.0.1:{up_port}"], port))
        for name, binary in (("switchyard", sy), ("switchyard-pgo", pgo)):
            if os.access(binary, os.X_OK):
                port = o.free_port()
                rows.append(measure(tmp, name, [binary, "serve", "--listen", f"127.0.0.1:{port}",
                                                "--worker", up_url, "--threads", "1"], port))
        if o.LIMITS and os.access(sy, os.X_OK):
            # The same binary with keys required and every in-memory limit on.
            os.environ["SWITCHYARD_BENCH_KEY"] = o.BENCH_KEY
            cfg = tmp / "limits.toml"
            cfg.write_text(o.LIMITS_TOML)
            port = o.free_port()
            rows.append(measure(tmp, "switchyard-limits",
                                [sy, "serve", "--listen", f"127.0.0.1:{port}", "--config", str(cfg),
                                 "--worker", up_url, "--threads", "1"], port,
                                {"Authorization": f"Bearer {o.BENCH_KEY}"}))
        base = rows[0]["thread"]
        print(f"Instructions per request (callgrind, {REQUESTS} sequential requests after "
              f"{WARMUP} warm-up; user space only)\n")
        print("| target | instructions per request | vs nginx |")
        print("|---|---:|---:|")
        for r in rows:
            print(f"| {r['target']} | {r['thread']:,.0f} | {r['thread'] / base:.2f}× |")
        return 0
    finally:
        o.cleanup()


if __name__ == "__main__":
    sys.exit(main())
