#!/usr/bin/env bash
# Every test suite: Rust unit + integration tests, then the official OpenAI SDK
# suites (Python and Node) against a live gateway. Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== installing test dependencies"
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q --disable-pip-version-check -r tests/sdk/python/requirements.txt
(cd tests/sdk/node && npm ci --no-audit --no-fund --loglevel=error)

echo "== cargo build"
cargo build --locked --bins

echo "== cargo test"
cargo test --locked

echo "== SDK compatibility"
scripts/sdk-tests.sh
