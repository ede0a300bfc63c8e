"""Real-browser check of the built-in dashboard.

Starts `switchyard demo` (simulated workers + gateway), sends traffic, loads
/dashboard in headless Debian chromium through Playwright, and checks that the
fleet table lists every worker and that the charts have data points. Saves a
screenshot to $SCREENSHOT_DIR (default bench-out/).

Usage: python tests/browser/test_dashboard.py [path/to/switchyard]
"""
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from playwright.sync_api import sync_playwright

WORKERS = 3
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_demo(binary):
    port = free_port()
    proc = subprocess.Popen(
        [binary, "demo", "--listen", f"127.0.0.1:{port}", "--workers", str(WORKERS),
         "--time-scale", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    # Readiness: the demo prints its gateway line once it listens.
    deadline = time.time() + 60
    workers = []
    for line in proc.stdout:
        m = re.search(r"worker (http://\S+)", line)
        if m:
            workers.append(m.group(1))
        if "Gateway:" in line:
            break
        if time.time() > deadline:
            raise RuntimeError("demo did not start")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, url, workers


def post(url, body):
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def traffic(url, model, stop):
    i = 0
    while not stop.is_set():
        post(url, {"model": model, "stream": i % 2 == 0, "max_tokens": 8,
                   "messages": [{"role": "user", "content": f"hello {i}"}]})
        i += 1


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/debug/switchyard"
    out_dir = os.environ.get("SCREENSHOT_DIR", "bench-out")
    os.makedirs(out_dir, exist_ok=True)
    proc, url, workers = start_demo(binary)
    stop = threading.Event()
    threads = []
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        threads = [threading.Thread(target=traffic, args=(url, model, stop), daemon=True)
                   for _ in range(4)]
        for t in threads:
            t.start()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url + "/dashboard")
            # The fleet table lists every worker.
            page.wait_for_function(
                f"document.querySelectorAll('#fleet tbody tr').length === {len(workers)}",
                timeout=15000)
            listed = page.eval_on_selector_all(
                "#fleet tbody tr", "rows => rows.map(r => r.dataset.worker)")
            assert sorted(listed) == sorted(workers), (listed, workers)
            # The charts have data: several seconds of requests and TTFT/ITL points.
            for chart in ["chart-rps", "chart-ttft", "chart-itl"]:
                page.wait_for_function(
                    f"Number(document.getElementById('{chart}').dataset.points) >= 3",
                    timeout=20000)
            points = {c: int(page.get_attribute(f"#{c}", "data-points"))
                      for c in ["chart-rps", "chart-ttft", "chart-itl"]}
            pools = page.eval_on_selector_all(
                "#pools tbody tr", "rows => rows.map(r => r.dataset.pool)")
            assert pools == ["demo"], pools
            desired = page.text_content("#pools tbody tr .desired")
            assert int(desired) >= 1, desired
            shot = os.path.join(out_dir, "dashboard.png")
            page.screenshot(path=shot, full_page=True)
            browser.close()
        print(f"dashboard ok: {len(listed)} workers, chart points {points}, screenshot {shot}")
    finally:
        # The traffic threads finish their request in flight before the gateway
        # goes, so none of them dies on a reset connection.
        stop.set()
        for t in threads:
            t.join(timeout=35)
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
