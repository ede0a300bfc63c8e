#!/usr/bin/env bash
# Gateway-overhead benchmark: switchyard vs direct-to-upstream vs nginx as a plain
# reverse proxy, on loopback. A scripted benchmark, not a test.
#
#   benches/overhead.sh                    # 3 rounds x 5 s per phase (~2 min)
#   ROUNDS=5 DURATION=10 benches/overhead.sh
#   PEERS=1 benches/overhead.sh            # also sglang-router and vllm-router (pip, pinned)
#   PGO=1 benches/overhead.sh              # also the profile-guided build (scripts/build-pgo.sh)
#   BUSY_POLL_US=200 benches/overhead.sh   # also switchyard with --busy-poll-us 200
#
# Env: ROUNDS (3), DURATION seconds per phase (5), CONC high concurrency (64),
#      WARMUP seconds per target (1), PROXY_WORKERS nginx proxy workers (nproc),
#      SWITCHYARD_BIN (target/release/switchyard; built if missing), NO_INSTALL=1,
#      PGO=1 with SWITCHYARD_PGO_BIN (target/pgo/switchyard; built if missing),
#      PEERS=1 (pip-installs sglang-router, vllm-router and matplotlib into
#      bench-out/peers-venv; versions: SGLANG_ROUTER_VERSION, VLLM_ROUTER_VERSION).
# Output: a table on stdout, bench-out/overhead.md, .json and (with matplotlib) .png.
# Installs what is missing: nginx (apt), oha (cargo install --locked).
set -euo pipefail
cd "$(dirname "$0")/.."

need_install() { [[ "${NO_INSTALL:-0}" != 1 ]]; }

if ! command -v nginx >/dev/null; then
  need_install || { echo "nginx missing (apt-get install -y nginx)" >&2; exit 2; }
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null
fi
# apt's nginx may start a system instance on :80; we use our own on free loopback ports.
if ! command -v oha >/dev/null; then
  need_install || { echo "oha missing (cargo install oha --locked)" >&2; exit 2; }
  cargo install oha --locked
  export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v python3 >/dev/null || { echo "python3 is required" >&2; exit 2; }

export SWITCHYARD_BIN="${SWITCHYARD_BIN:-$PWD/target/release/switchyard}"
if [[ ! -x "$SWITCHYARD_BIN" ]]; then
  cargo build --release
fi
if [[ "${PGO:-0}" == 1 ]]; then
  export SWITCHYARD_PGO_BIN="${SWITCHYARD_PGO_BIN:-$PWD/target/pgo/switchyard}"
  [[ -x "$SWITCHYARD_PGO_BIN" ]] || scripts/build-pgo.sh
fi
# The bare-hyper baseline (same HTTP stack, no gateway work); skipped if it cannot build.
export BARE_BIN="${BARE_BIN:-$PWD/target/release/examples/bare_proxy}"
if [[ ! -x "$BARE_BIN" ]]; then
  cargo build --release --example bare_proxy || echo "bare_proxy did not build: no bare-hyper baseline" >&2
fi

if [[ "${PEERS:-0}" == 1 ]]; then
  venv=bench-out/peers-venv
  if [[ ! -x $venv/bin/python ]]; then
    mkdir -p bench-out && python3 -m venv "$venv"
  fi
  # Pinned to the versions measured in docs/benchmarks.md; override to try others.
  # A peer that cannot be installed or started is an error (the run is about them).
  timeout 600 "$venv/bin/pip" install -q \
    "sglang-router==${SGLANG_ROUTER_VERSION:-0.3.2}" "vllm-router==${VLLM_ROUTER_VERSION:-0.1.17}" matplotlib
  exec "$venv/bin/python" benches/overhead.py
fi
# The driver starts every process itself and kills them by PID on exit (also on
# SIGINT/SIGTERM); exec so signals reach it directly.
exec python3 benches/overhead.py
