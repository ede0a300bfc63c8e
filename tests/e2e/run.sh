#!/usr/bin/env bash
# Real-engine end-to-end suite: installs vLLM for CPU (tests/e2e/setup_vllm.sh) and
# guidellm (tests/e2e/setup_guidellm.sh), makes the tiny model, starts two vLLM
# engines (KV-cache events on) and Switchyard gateways in front of them, and runs
# tests/e2e/test_*.py: OpenAI and Anthropic SDKs, metrics, tokenization, prefix
# routing, the precise KV-event index, flow control, latency objectives, the
# `vllm bench serve` and `guidellm` clients, failover. Bounded: the whole suite is
# killed after E2E_TIMEOUT seconds (default 900). Fails loudly on any install problem.
#
#   tests/e2e/run.sh                      # uses target/debug/switchyard (built if missing)
#   SWITCHYARD_BIN=target/release/switchyard tests/e2e/run.sh -k prefix
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
timeout 1500 tests/e2e/setup_vllm.sh   # bounded too: ~9 min on a fresh, busy machine
timeout 600 tests/e2e/setup_guidellm.sh  # guidellm layered on vLLM's venv: ~30 s
export SWITCHYARD_BIN=${SWITCHYARD_BIN:-$PWD/target/debug/switchyard}
[ -x "$SWITCHYARD_BIN" ] || cargo build --locked --bin switchyard
export TINY_MODEL_DIR=${TINY_MODEL_DIR:-$PWD/bench-out/e2e/tiny-llama}
.venv-vllm/bin/python tests/e2e/make_tiny_model.py "$TINY_MODEL_DIR"
echo "== real vLLM e2e: setup took $(( $(date +%s) - start ))s"
# -p no:cacheprovider: nothing written into the source tree. -rs: skip reasons shown.
rc=0
timeout --kill-after=30 "${E2E_TIMEOUT:-900}" \
  .venv-vllm/bin/python -m pytest -p no:cacheprovider -rs -v tests/e2e "$@" || rc=$?
echo "== real vLLM e2e: $(( $(date +%s) - start ))s in total (rc=$rc)"
exit $rc
