#!/usr/bin/env bash
# Start-up with many packs in the bucket, before and after a change, in one run on one machine.
#
#   bench/startup-scale.sh PACKS BEFORE_BIN AFTER_BIN [CLICKHOUSE_URL]
#
# Makes a file:// bucket holding PACKS pack objects of one catalog (empty files named like packs, spread over 365
# days of keys) and, for each binary, a catalog database of its own (created by that binary, so at its schema) in
# which all PACKS are published (1,000 packs per publish, rows written on the server with INSERT ... SELECT FROM
# numbers()). Then, per binary, 3 starts: each with a fresh spool and one capture waiting in its inbox, timed from
# the process start to "ingest ready" in its log and to the catalog showing the capture's publish; peak RSS (VmHWM)
# when it has published. The first start of AFTER_BIN on its catalog is reported separately (a catalog it did not
# write has no upload-intent mark, so that start lists the bucket once). Needs curl and python3. Leaves the
# databases in place (capstore_startup_before/_after). RUNS=N changes the number of timed starts per binary;
# SIDES="after" times one side only.
set -euo pipefail
packs=$1 before=$2 after=$3 url=${4:-http://127.0.0.1:18123}
work=$(mktemp -d)
trap 'pkill -P $$ 2>/dev/null || true; rm -rf "$work"' EXIT
q() { curl -sS --fail-with-body "$url/?wait_end_of_query=1" --data-binary "$1"; }

export CAPSTORE_CATALOG_URL=$url CAPSTORE_CATALOG_TABLE_PREFIX=cs CAPSTORE_CATALOG_NAME=main
export CAPSTORE_BUCKET_URL=file://$work/bucket CAPSTORE_LEASE_TTL=10s CAPSTORE_LEASE_START_WAIT=0s
export CAPSTORE_SPOOL_PACK_MAX_AGE=100ms
mkdir -p "$work/bucket"

id() { echo "UUIDNumToString(toFixedString(concat(reinterpretAsString(cityHash64($1, 17)), reinterpretAsString(cityHash64($1, 18))), 16))"; }
key() { echo "concat('capstore/main/', formatDateTime(toDateTime(1700000000 + intDiv(number * 365, $packs) * 86400), '%Y/%m/%d'), '/', $(id number), '.cpk')"; }

echo "== $packs pack objects in the bucket"
start=$(date +%s%N)
q "SELECT $(key) FROM numbers($packs) FORMAT TSV" > "$work/keys"
python3 - "$work/bucket" "$work/keys" <<'EOF'
import os, sys
root, made = sys.argv[1], set()
for line in open(sys.argv[2]):
    path = os.path.join(root, line.strip())
    folder = os.path.dirname(path)
    if folder not in made:
        os.makedirs(folder, exist_ok=True)
        made.add(folder)
    open(path, "wb").close()
EOF
echo "made in $(( ($(date +%s%N) - start) / 1000000 )) ms"

catalog_for() {  # $1 = binary, $2 = database: the binary creates its schema, then every pack is published
    local db=$2
    q "DROP DATABASE IF EXISTS $db"
    CAPSTORE_CATALOG_DATABASE=$db CAPSTORE_SPOOL_DIR=$work/spool-setup "$1" lease show >/dev/null
    q "INSERT INTO $db.cs_packs (catalog, pack_id, object_key, bytes, sha256, records, first_captured_at_ns, last_captured_at_ns, version, publish_id) SELECT 'main', $(id number), $(key), 1, '', 1, 0, 0, intDiv(number, 1000) + 1, $(id "intDiv(number, 1000) + 1000000000") FROM numbers($packs)"
    q "INSERT INTO $db.cs_publishes (catalog, version, publish_id, holder, lease_term, packs, captures, published_at_ms) SELECT 'main', number + 1, $(id "number + 1000000000"), 'bench', 1, 1000, 0, 0 FROM numbers(intDiv($packs + 999, 1000))"
}

one_start() {  # $1 = binary, $2 = database, $3 = bucket; prints "ready_ms published_ms rss_kib"
    local spool=$work/spool-$RANDOM$RANDOM log=$work/log-$RANDOM stream=bench$RANDOM$RANDOM
    mkdir -p "$spool/inbox/$stream"
    printf 'capture' > "$spool/inbox/$stream/one"
    local t0; t0=$(date +%s%N)
    CAPSTORE_CATALOG_DATABASE=$2 CAPSTORE_SPOOL_DIR=$spool CAPSTORE_BUCKET_URL=file://$3 "$1" run 2>"$log" &
    local pid=$! ready="" published="" rss=""
    while [ -z "$published" ]; do
        if [ -z "$ready" ] && grep -q "ingest ready" "$log"; then ready=$(( ($(date +%s%N) - t0) / 1000000 )); fi
        if [ "$(q "SELECT count() FROM $2.cs_captures WHERE catalog = 'main' AND stream = '$stream' AND (version, publish_id) IN (SELECT version, publish_id FROM $2.cs_publishes WHERE catalog = 'main')")" != 0 ]; then
            published=$(( ($(date +%s%N) - t0) / 1000000 ))
            rss=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
        fi
        kill -0 "$pid" 2>/dev/null || { echo "daemon exited:"; tail -20 "$log"; exit 1; }
        sleep 0.01
    done
    kill -TERM "$pid"; wait "$pid" || true
    echo "${ready:-?} $published $rss"
}

for side in ${SIDES:-before after}; do
    bin=$before; [ "$side" = after ] && bin=$after
    db=capstore_startup_$side
    # A bucket of its own per side (hard links of the same objects): one side's packs must not show up in the other's.
    cp -al "$work/bucket" "$work/bucket-$side"
    catalog_for "$bin" "$db"
    if [ "$side" = after ]; then
        echo "after, first start on a catalog without a mark (ready_ms published_ms rss_kib): $(one_start "$bin" "$db" "$work/bucket-$side")"
    fi
    for run in $(seq "${RUNS:-3}"); do
        echo "$side run $run (ready_ms published_ms rss_kib): $(one_start "$bin" "$db" "$work/bucket-$side")"
    done
done
