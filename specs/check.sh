#!/usr/bin/env bash
# Run every spin model/variant in specs/ and compare each verdict with the
# table of expected results below.  Exits non-zero on any mismatch.
#
# Verdicts:
#   refuted  pan found an assertion violation (a counterexample: definite)
#   no-cex   pan found none.  With mode "bit" this is a PARTIAL search
#            (bitstate hashing, -DBITSTATE): evidence, not a proof.  See
#            specs/README.md, "Coverage".
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
for tool in spin gcc timeout; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "check.sh: '$tool' not found; install with: apt-get install -y spin gcc" >&2
    exit 2
  fi
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# model | variant flags (comma separated, "-" for none) | mode | expected | property named by the counterexample
# mode: dfs = exhaustive DFS (stops at the first violation)
#       bit = bitstate DFS, -w24, randomised order (partial search)
table='
lease.pml|-|bit|no-cex|-
lease.pml|STRICT_I3|dfs|refuted|I3_publisher_held_head_lease
lease.pml|NO_PT_MARGIN|dfs|refuted|I3_publisher_held_head_lease
lease.pml|REL_NEXT|dfs|refuted|I3_publisher_held_head_lease
lease.pml|NO_QUAR|dfs|refuted|I3_publisher_held_head_lease
lease.pml|SKEW_BUG|dfs|refuted|NO_OVERLAPPING_BELIEF
lease.pml|TAKEOVER|bit|refuted|I3_publisher_held_head_lease
lease.pml|TAKEOVER,TAKEOVER_FIX|bit|no-cex|-
'

limit="${CHECK_TIMEOUT:-60}"
fail=0
start_all=$SECONDS
printf '%-10s %-24s %-8s %-8s %-8s %12s %8s  %s\n' model variant mode expected got states seconds property
while IFS='|' read -r model variant mode expected prop; do
  [ -z "$model" ] && continue
  run="$work/$model.$variant"
  mkdir -p "$run"
  cp "$here/$model" "$run/"
  defs=()
  if [ "$variant" != "-" ]; then
    IFS=',' read -ra vs <<<"$variant"
    for v in "${vs[@]}"; do defs+=("-D$v"); done
  fi
  t0=$(date +%s.%N)
  (
    cd "$run"
    spin "${defs[@]}" -a "$model" >spin.log 2>&1
    if [ "$mode" = bit ]; then
      gcc -O2 -w -DSAFETY -DBITSTATE -DT_RAND -DP_RAND -o pan pan.c >gcc.log 2>&1
      timeout "$limit" ./pan -w24 -m5000 -RS7 >pan.log 2>&1 || true
    else
      gcc -O2 -w -DSAFETY -DMEMLIM=2000 -o pan pan.c >gcc.log 2>&1
      timeout "$limit" ./pan -m3000000 >pan.log 2>&1 || true
    fi
  ) || { echo "check.sh: spin/gcc failed on $model $variant (see logs)" >&2; cat "$run"/*.log >&2; fail=1; continue; }
  t1=$(date +%s.%N)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
  log="$run/pan.log"
  states=$(awk '/states, stored/{print $1; exit}' "$log")
  if grep -q 'assertion violated' "$log"; then
    got=refuted
    gotprop=$(grep -o 'assertion violated.*' "$log" | head -1 | grep -oE '[A-Z][A-Z0-9_]+[a-z_]*[A-Za-z0-9_]*' | grep -E '^(I3|I4|NO_|LOST|LIVE)' | head -1 || true)
  elif grep -q 'states, stored' "$log"; then
    got=no-cex; gotprop=-
  else
    got=timeout; gotprop=-
  fi
  ok=yes
  [ "$got" = "$expected" ] || ok=no
  if [ "$got" = refuted ] && [ "$prop" != "-" ] && [ "$gotprop" != "$prop" ]; then ok=no; fi
  [ "$ok" = yes ] || fail=1
  printf '%-10s %-24s %-8s %-8s %-8s %12s %8s  %s%s\n' "$model" "$variant" "$mode" "$expected" "$got" "${states:-?}" "$secs" "$gotprop" "$([ "$ok" = yes ] || echo '   <-- MISMATCH')"
done <<<"$table"
echo "total ${SECONDS}s (started at ${start_all}s)"
if [ "$fail" -ne 0 ]; then
  echo "check.sh: at least one verdict differs from the expected table" >&2
  exit 1
fi
echo "check.sh: every verdict matches the expected table"
