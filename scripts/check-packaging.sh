#!/usr/bin/env bash
# Packaging checks: lint the Dockerfile (hadolint), validate the Compose files
# against the Compose specification's schema, validate the shipped container
# configs, render the Helm chart with Helm's Go SDK and validate every manifest
# against the Kubernetes schemas (scripts/check_packaging.py). No container
# engine or cluster needed. Usage: scripts/check-packaging.sh [SWITCHYARD_BIN]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-target/debug/switchyard}"
[ -x "$BIN" ] || { echo "no switchyard binary at $BIN (cargo build --bins first)" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q --disable-pip-version-check -r docker/check-requirements.txt

echo "-- hadolint docker/Dockerfile"
.venv/bin/hadolint --failure-threshold style docker/Dockerfile
# What hadolint does not enforce: a non-root numeric user and a health check.
last_user=$(awk '/^USER /{u=$2} END{print u}' docker/Dockerfile)
case "${last_user%%:*}" in
  ''|0|root|*[!0-9]*) echo "docker/Dockerfile: final USER must be a numeric non-root uid (got '$last_user')" >&2; exit 1 ;;
esac
grep -q '^HEALTHCHECK ' docker/Dockerfile || { echo "docker/Dockerfile: no HEALTHCHECK" >&2; exit 1; }

echo "-- compose files against the Compose specification"
.venv/bin/check-jsonschema --builtin-schema vendor.compose-spec docker/compose.yaml docker/compose.vllm.yaml

echo "-- container configs"
for f in docker/*.toml; do "$BIN" check-config --no-secrets "$f"; done

echo "-- Helm chart: render, Kubernetes schemas, references, gateway config"
.venv/bin/python scripts/check_packaging.py "$BIN"
echo "packaging checks: ok"
