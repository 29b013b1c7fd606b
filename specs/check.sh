#!/usr/bin/env bash
# Run every spin model/variant in specs/ and compare each verdict with the
# table of expected results below.  Exits non-zero on any mismatch, on a
# search that did not complete, or when spin/gcc is missing.
#
# Verdicts:
#   refuted  pan found a counterexample (definite: a concrete trace)
#   holds    pan found none.  Mode "exhaustive": a full search (the state
#            count is every reachable state; the depth bound was not hit).
#            Mode "bitstate": a PARTIAL search (-DBITSTATE), evidence only.
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

# model | variant flags (comma separated, "-" for none) | mode | expected | property a counterexample must name
# mode: exhaustive = safety DFS, full search
#       ltl        = full search for acceptance cycles and assertions (pan -a) with the model's ltl formula
#       bitstate   = safety DFS with bitstate hashing (partial)
table='
lease_safety.pml|-|exhaustive|holds|-
lease_safety.pml|MAXF=1,MAXD=1|exhaustive|holds|-
lease_safety.pml|STRICT_I3|exhaustive|refuted|I3_publisher_held_head_lease
lease_safety.pml|NO_PT_MARGIN|exhaustive|refuted|I3_publisher_held_head_lease
lease_safety.pml|REL_NEXT|exhaustive|refuted|NO_OVERLAPPING_BELIEF
lease_safety.pml|NO_QUAR|exhaustive|refuted|I3_publisher_held_head_lease
lease_safety.pml|SKEW_BUG,MAXD=2|exhaustive|refuted|NO_OVERLAPPING_BELIEF
lease_safety.pml|NO_VCHECK,STALE_WM|exhaustive|refuted|I4_versions_gapless_increasing
lease_safety.pml|OVERRUN|exhaustive|refuted|I3_publisher_held_head_lease
lease_safety.pml|N3|bitstate|holds|-
lease_safety.pml|REL_CUT,MAXF=1|exhaustive|holds|-
lease_safety.pml|REL_AT_ONCE|exhaustive|refuted|I3_publisher_held_head_lease
takeover.pml|-|exhaustive|refuted|I3_serial_publishes
takeover.pml|EMB_SENT|exhaustive|refuted|I3_serial_publishes
takeover.pml|EMB_REPLY|exhaustive|holds|-
takeover.pml|EMB_REPLY,LITERAL_I3|exhaustive|refuted|I3_publisher_held_head_lease
takeover.pml|EMB_REPLY,START_KEEPS_ID,OWN_HEAD_AT_ONCE|exhaustive|refuted|I3_serial_publishes
takeover.pml|EMB_REPLY,SOLE_HEAD_ONLY|exhaustive|holds|-
takeover.pml|EMB_REPLY,CONTESTED_AT_ONCE|exhaustive|refuted|I3_serial_publishes
lease_live.pml|-|ltl|holds|-
lease_live.pml|LATCH_EARLY|ltl|refuted|LATCH_ONLY_AFTER_LONG_REFUSAL
lease_live.pml|STUCK_QUAR|ltl|refuted|held_eventually
compaction.pml|-|exhaustive|holds|-
compaction.pml|MOVE_IN_CAPTURES|exhaustive|refuted|READ_EXACTLY_ONCE
compaction.pml|LIST_DROPS_MOVES|exhaustive|refuted|READ_EXACTLY_ONCE
compaction.pml|NO_RECHECK|exhaustive|refuted|NO_RESURRECTION
compaction.pml|NO_GRACE|exhaustive|refuted|NO_DANGLING_LOCATOR
compaction.pml|NO_PURGE_GRACE|exhaustive|refuted|PINNED_SNAPSHOT
compaction.pml|PURGE_BEFORE_ERASURE|exhaustive|refuted|ERASURE_FINDABLE
replicated.pml|-|exhaustive|holds|-
replicated.pml|STALE_READS|exhaustive|refuted|NO_DOUBLE_PUBLISH
replicated.pml|STALE_VCHECK|exhaustive|refuted|NO_DOUBLE_PUBLISH
replicated.pml|STALE_LEASE|exhaustive|refuted|NO_SHARED_TERM
replicated.pml|STALE_LEASE,NO_TERM_CHECK|exhaustive|refuted|NO_DOUBLE_PUBLISH
'
# Slower "holds" runs (about 4 more minutes), run with CHECK_ALL=1:
if [ "${CHECK_ALL:-0}" = 1 ]; then
  table="$table
lease_safety.pml|NO_VCHECK|exhaustive|holds|-
lease_safety.pml|STALE_WM|exhaustive|holds|-
lease_safety.pml|LOST_LITERAL|exhaustive|holds|-
lease_safety.pml|REL_CUT|exhaustive|holds|-
"
fi

limit="${CHECK_TIMEOUT:-300}"
# Runs go side by side, one per core (CHECK_JOBS to change); each is single-threaded, and the largest needs about 3 GB.
jobs="${CHECK_JOBS:-$(nproc)}"

# Check one row of the table in its own directory: writes the row's line of the report to $run/result and, on a
# verdict other than the expected one, the file $run/mismatch.
check_one() {
  local model="$1" variant="$2" mode="$3" expected="$4" prop="$5" run="$6"
  mkdir -p "$run"
  cp "$here"/*.pml "$run/"
  local defs=()
  if [ "$variant" != "-" ]; then
    local vs v
    IFS=',' read -ra vs <<<"$variant"
    for v in "${vs[@]}"; do defs+=("-D$v"); done
  fi
  local t0 t1
  t0=$(date +%s.%N)
  (
    cd "$run"
    spin "${defs[@]}" -a "$model" >spin.log 2>&1
    case "$mode" in
      exhaustive)
        gcc -O2 -w -DSAFETY -DMEMLIM=8000 -o pan pan.c >gcc.log 2>&1
        timeout "$limit" ./pan -m2000000 >pan.log 2>&1 || true ;;
      ltl)
        gcc -O2 -w -DMEMLIM=2000 -o pan pan.c >gcc.log 2>&1
        timeout "$limit" ./pan -a -m2000000 >pan.log 2>&1 || true ;;
      bitstate)
        gcc -O2 -w -DSAFETY -DBITSTATE -o pan pan.c >gcc.log 2>&1
        timeout "$limit" ./pan -w24 -m2000000 >pan.log 2>&1 || true ;;
    esac
  ) || {
    { echo "check.sh: spin/gcc failed on $model $variant"; cat "$run"/*.log; } >"$run/result"
    touch "$run/mismatch"
    return
  }
  t1=$(date +%s.%N)
  local secs log states gotprop got ok
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
  log="$run/pan.log"
  states=$(awk '/states, stored/{print $1; exit}' "$log")
  gotprop=-
  if grep -q 'assertion violated' "$log"; then
    got=refuted
    gotprop=$(grep -m1 -oE '\|\| *[A-Za-z0-9_]+\)' "$log" | grep -oE '[A-Za-z0-9_]+' || true)
  elif grep -q 'acceptance cycle' "$log"; then
    got=refuted
    gotprop=$(grep -m1 -oE 'never claim.*\(([a-z_]+)\)' "$log" | grep -oE '\([a-z_]+\)' | tr -d '()' || true)
    [ -n "$gotprop" ] || gotprop=$(grep -oE '^ltl [a-z_]+' "$run/$model" | head -1 | cut -d' ' -f2)
  elif grep -q 'states, stored' "$log" && grep -q 'errors: 0' "$log"; then
    got=holds
  else
    got=timeout
  fi
  # an exhaustive "holds" is only a proof if the search was not truncated
  if [ "$got" = holds ] && grep -qE 'max search depth too small|search not completed|depth-limit' "$log"; then
    got=truncated
  fi
  ok=yes
  [ "$got" = "$expected" ] || ok=no
  if [ "$got" = refuted ] && [ "$prop" != "-" ] && [ "$gotprop" != "$prop" ]; then ok=no; fi
  [ "$ok" = yes ] || touch "$run/mismatch"
  printf '%-17s %-22s %-10s %-8s %-8s %10s %7s  %s%s\n' "$model" "$variant" "$mode" "$expected" "$got" \
    "${states:-?}" "$secs" "$gotprop" "$([ "$ok" = yes ] || echo '   <-- MISMATCH')" >"$run/result"
}

runs=()
while IFS='|' read -r model variant mode expected prop; do
  [ -z "$model" ] && continue
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  run="$work/$model.$variant"
  runs+=("$run")
  check_one "$model" "$variant" "$mode" "$expected" "$prop" "$run" &
done <<<"$table"
wait

fail=0
printf '%-17s %-22s %-10s %-8s %-8s %10s %7s  %s\n' model variant mode expected got states seconds property
for run in "${runs[@]}"; do
  cat "$run/result"
  [ ! -e "$run/mismatch" ] || fail=1
done
echo "total ${SECONDS}s"
if [ "$fail" -ne 0 ]; then
  echo "check.sh: at least one verdict differs from the expected table" >&2
  exit 1
fi
echo "check.sh: every verdict matches the expected table"
