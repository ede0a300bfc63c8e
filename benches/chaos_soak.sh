#!/usr/bin/env bash
# Chaos soak: builds the release binary, then runs benches/chaos_soak.py against it
# (loopback only, bounded: 2 rounds x 3,000 requests, each round capped at 240 s).
# Results: bench-out/chaos_soak.json (+ gateway/sim log tails). Extra args go to the
# Python driver, e.g. `benches/chaos_soak.sh --requests 500 --rounds 1`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bin switchyard
exec timeout 900 python3 benches/chaos_soak.py --bin target/release/switchyard --out bench-out "$@"
