#!/usr/bin/env bash
# Run the official OpenAI SDK suites (Python, Node) and the Anthropic Python SDK
# suite against gateways in front of a simulated worker. Expects the debug binary built and the SDKs installed
# (scripts/test-all.sh does both).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/debug/switchyard}
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT

# Wait until FILE has a line starting with PREFIX; print that line.
wait_line() {
  local file=$1 prefix=$2 pid=$3
  for _ in $(seq 1 300); do
    if line=$(grep -m1 "^$prefix" "$file" 2>/dev/null); then echo "$line"; return 0; fi
    kill -0 "$pid" 2>/dev/null || { echo "process exited early:" >&2; cat "$file" "$file.err" >&2; return 1; }
    sleep 0.1
  done
  echo "timed out waiting for '$prefix'" >&2; return 1
}
field() { tr ' ' '\n' <<<"$1" | sed -n "s/^$2=//p"; }

"$BIN" sim --port 0 --time-scale 20 >"$tmp/sim.out" 2>"$tmp/sim.out.err" &
pids+=($!)
sim_line=$(wait_line "$tmp/sim.out" "switchyard-sim ready" $!)
sim_url=$(field "$sim_line" url)
export MODEL=$(field "$sim_line" model)

RUST_LOG=warn "$BIN" serve --listen 127.0.0.1:0 --worker "$sim_url" >"$tmp/gw.out" 2>"$tmp/gw.out.err" &
gw_pid=$!
pids+=($gw_pid)
export GATEWAY_URL=$(field "$(wait_line "$tmp/gw.out" "switchyard ready" $gw_pid)" url)
# Ready once the worker's models are discovered.
for _ in $(seq 1 100); do curl -fs "$GATEWAY_URL/ready" >/dev/null && break; sleep 0.1; done
curl -fs "$GATEWAY_URL/ready" >/dev/null

# A second gateway for Anthropic's Messages API: one pool passes it through to
# the sim's /v1/messages, another translates it to chat completions.
export TRANSLATED_MODEL="$MODEL-translated"
cat >"$tmp/anthropic.toml" <<TOML
[[pools]]
name = "messages-passthrough"
models = ["$MODEL"]
anthropic = "passthrough"
workers = [{ url = "$sim_url" }]
[[pools]]
name = "messages-translate"
models = ["$TRANSLATED_MODEL"]
upstream_model = "$MODEL"
anthropic = "translate"
workers = [{ url = "$sim_url" }]
TOML
RUST_LOG=warn "$BIN" serve --config "$tmp/anthropic.toml" --listen 127.0.0.1:0 >"$tmp/gw2.out" 2>"$tmp/gw2.out.err" &
gw2_pid=$!
pids+=($gw2_pid)
export ANTHROPIC_GATEWAY_URL=$(field "$(wait_line "$tmp/gw2.out" "switchyard ready" $gw2_pid)" url)
for _ in $(seq 1 100); do curl -fs "$ANTHROPIC_GATEWAY_URL/ready" >/dev/null && break; sleep 0.1; done
curl -fs "$ANTHROPIC_GATEWAY_URL/ready" >/dev/null
# The same worker behind an HTTPS gateway (the quick start's --tls-cert/--tls-key),
# with a CA and certificate made here; the Python SDK trusts that CA.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -subj /CN=switchyard-sdk-test-ca -keyout "$tmp/ca.key" -out "$tmp/ca.pem" \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=localhost \
  -keyout "$tmp/gw.key" -out "$tmp/gw.csr" 2>/dev/null
printf '%s\n' 'subjectAltName=DNS:localhost,IP:127.0.0.1' 'extendedKeyUsage=serverAuth' \
  'basicConstraints=critical,CA:FALSE' 'keyUsage=critical,digitalSignature' \
  'subjectKeyIdentifier=hash' 'authorityKeyIdentifier=keyid' >"$tmp/gw.ext"
openssl x509 -req -in "$tmp/gw.csr" -CA "$tmp/ca.pem" -CAkey "$tmp/ca.key" -CAcreateserial \
  -days 2 -extfile "$tmp/gw.ext" -out "$tmp/gw.pem" 2>/dev/null
RUST_LOG=warn "$BIN" serve --listen 127.0.0.1:0 --worker "$sim_url" \
  --tls-cert "$tmp/gw.pem" --tls-key "$tmp/gw.key" >"$tmp/gws.out" 2>"$tmp/gws.out.err" &
gws_pid=$!
pids+=($gws_pid)
export GATEWAY_HTTPS_URL=$(field "$(wait_line "$tmp/gws.out" "switchyard ready" $gws_pid)" url)
export TLS_CA="$tmp/ca.pem"
curl -fs --cacert "$TLS_CA" "$GATEWAY_HTTPS_URL/health" >/dev/null

echo "== OpenAI Python SDK ($(.venv/bin/python -c 'import openai; print(openai.__version__)'))"
.venv/bin/python -m pytest -q tests/sdk/python/test_openai_sdk.py tests/sdk/python/test_openai_sdk_tls.py
echo "== Anthropic Python SDK ($(.venv/bin/python -c 'import anthropic; print(anthropic.__version__)'))"
.venv/bin/python -m pytest -q tests/sdk/python/test_anthropic_sdk.py
echo "== OpenAI Node SDK ($(node -p 'require("./tests/sdk/node/node_modules/openai/package.json").version'))"
(cd tests/sdk/node && node --test)
