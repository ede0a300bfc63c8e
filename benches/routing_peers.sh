#!/usr/bin/env bash
# Routing quality against peer routers' cache-aware policies (driver:
# benches/routing_peers.py). A scripted benchmark, not a test.
#
#   benches/routing_peers.sh                         # simulated fleet, 4 targets, 3 rounds
#   FLEET=vllm benches/routing_peers.sh              # the two real vLLM CPU engines (tests/e2e)
#   TARGETS=switchyard-prefix,sglang-router-cache_aware ROUNDS=5 benches/routing_peers.sh
#
# Targets: switchyard-<policy>, switchyard-precise (`prefix` on the engines' KV-cache
#   events), switchyard-precise_prefix (precise_prefix + queue on them),
#   sglang-router-<policy>, vllm-router-<policy>.
# Env (sim): ENGINES (4), PREFIXES (16), PER_GROUP (8), CONC (8), SIM_BLOCKS (280),
#   TIME_SCALE (1); (vllm): PREFIXES (8), PER_GROUP (6), CONC (2); both: PREFIX_WORDS,
#   MAX_TOKENS (4), SEED (7), ROUNDS (3), STATS_INTERVAL_MS (250: the gateways' engine
#   scrapes), SWITCHYARD_BIN (needs the `prefix` policy).
# Output: bench-out/routing-peers-<fleet>.{md,json,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=bench-out/peers-venv
[[ -x $venv/bin/python ]] || { mkdir -p bench-out && python3 -m venv "$venv"; }
timeout 600 "$venv/bin/pip" install -q \
  "sglang-router==${SGLANG_ROUTER_VERSION:-0.3.2}" "vllm-router==${VLLM_ROUTER_VERSION:-0.1.17}" matplotlib
export SWITCHYARD_BIN="${SWITCHYARD_BIN:-$PWD/target/release/switchyard}"
[[ -x "$SWITCHYARD_BIN" ]] || cargo build --release
if [[ "${FLEET:-sim}" == vllm ]]; then
  tests/e2e/setup_vllm.sh
  .venv-vllm/bin/python tests/e2e/make_tiny_model.py "${TINY_MODEL_DIR:-bench-out/e2e/tiny-llama}"
fi
exec "$venv/bin/python" benches/routing_peers.py
