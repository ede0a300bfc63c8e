#!/usr/bin/env bash
# Bounded fuzz runs of every target in fuzz/ (cargo-fuzz, libFuzzer, nightly).
#   scripts/fuzz.sh                  RUNS executions per target (default 300000: 1.2M in all)
#   RUNS=20000 scripts/fuzz.sh       a short run
#   RECORD=1 scripts/fuzz.sh         also write the counts into docs/fuzzing.md
# Builds unoptimised (debug assertions and overflow checks on; a fraction of the
# optimised build's time on a small machine) and without a sanitizer (the gateway
# is `forbid(unsafe_code)`; what is hunted is panics, overflows and failed assertions).
# A crash stops the script; its input is left in fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-300000}
TARGETS=(inspect sse_observer engine_metrics config)
export CARGO_INCREMENTAL=0
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
(cd fuzz && cargo +nightly fuzz build -s none --dev)
rows=()
total=0
for t in "${TARGETS[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  log=$(mktemp)
  # The corpus grows across runs; the committed seeds start it.
  (cd fuzz && cargo +nightly fuzz run -s none --dev "$t" "corpus/$t" "seeds/$t" -- \
      -runs="$RUNS" -max_len=65536 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1) >"$log" 2>&1 || {
    tail -40 "$log"; echo "fuzz target $t failed; input in fuzz/artifacts/$t/" >&2; exit 1; }
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  secs=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  corpus=$(ls "fuzz/corpus/$t" | wc -l)
  echo "$t: $runs runs in ${secs}s, coverage $cov edges, corpus $corpus inputs, no crash"
  rows+=("| \`$t\` | $runs | ${secs} | $cov | $corpus |")
  total=$((total + runs))
  rm -f "$log"
done
echo "total: $total executions, no crash"
if [ "${RECORD:-0}" = 1 ]; then
  table=$(printf '%s\n' "| Target | Executions | Seconds | Coverage (edges) | Corpus |" "|---|---:|---:|---:|---:|" "${rows[@]}" "| **total** | **$total** | | | |")
  stamp="Recorded $(date -u +%Y-%m-%d) with \`RUNS=$RUNS scripts/fuzz.sh\` ($(rustc +nightly --version | cut -d' ' -f1-2)); no crash."
  python3 - "$table" "$stamp" <<'PY'
import re, sys
table, stamp = sys.argv[1], sys.argv[2]
p = "docs/fuzzing.md"
s = open(p).read()
block = f"<!-- fuzz-counts -->\n{stamp}\n\n{table}\n<!-- /fuzz-counts -->"
s = re.sub(r"<!-- fuzz-counts -->.*?<!-- /fuzz-counts -->", lambda m: block, s, flags=re.S)
open(p, "w").write(s)
PY
fi
