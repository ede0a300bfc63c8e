#!/usr/bin/env bash
# Goodput under overload on a mixed H100/L4 simulated fleet: least_queue, prefix
# and slo side by side (driver: benches/overload.py; its docstring has the method
# and every knob). Loopback only, bounded: about 3 x (WARMUP + DURATION) seconds
# plus the capacity probe and the quiet-tenant-alone run.
#
#   benches/overload.sh
#   SWITCHYARD_BIN=target/debug/switchyard DURATION=20 benches/overload.sh
#
# Output: bench-out/overload.{md,json}.
set -euo pipefail
cd "$(dirname "$0")/.."
export SWITCHYARD_BIN="${SWITCHYARD_BIN:-$PWD/target/release/switchyard}"
[[ -x "$SWITCHYARD_BIN" ]] || cargo build --release --bin switchyard
exec timeout 1200 python3 benches/overload.py
