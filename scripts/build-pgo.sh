#!/usr/bin/env bash
# Build switchyard with profile-guided optimisation (PGO):
#   1. an instrumented release build (cargo-pgo),
#   2. a training workload through it (benches/pgo_train.py: fixed-response and
#      simulated-engine upstreams, streaming and not, embeddings, errors, scrapes),
#   3. the optimised release build from the profile it wrote.
# The result is target/pgo/switchyard. Same sources and release profile as
# `cargo build --release`; only the compiler's code layout and inlining differ.
#
#   scripts/build-pgo.sh                 # ~12 min on 2 cores
#   PGO_TRAIN_SCALE=2 scripts/build-pgo.sh   # train twice as long
#
# Installs what is missing: the llvm-tools rustup component, cargo-pgo and oha
# (cargo install --locked), nginx (apt).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

if ! command -v cargo-pgo >/dev/null; then
  cargo install cargo-pgo --locked
fi
if ! cargo pgo info 2>&1 | grep -q "llvm-profdata\]: found"; then
  rustup component add llvm-tools
fi
if ! command -v nginx >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null
fi
command -v oha >/dev/null || cargo install oha --locked

host=$(rustc -vV | sed -n 's/^host: //p')
cargo pgo build -- --bin switchyard
python3 benches/pgo_train.py --bin "target/$host/release/switchyard"
cargo pgo optimize build -- --bin switchyard
mkdir -p target/pgo
cp "target/$host/release/switchyard" target/pgo/switchyard
echo "built target/pgo/switchyard"
