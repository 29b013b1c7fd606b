#!/usr/bin/env bash
# Catalog reads at scale, before and after an upgrade, in one run on one machine.
#
#   bench/catalog-scale.sh ROWS BEFORE_BIN AFTER_BIN [CLICKHOUSE_URL]
#
# Loads ROWS synthetic captures (100 streams, 100 captures per publish, one label) into a schema 1 catalog in a
# database of its own (capstore_scale_<ROWS>), written on the server with INSERT ... SELECT FROM numbers(). Then times
# the same reads with BEFORE_BIN (a capstore that reads schema 1), upgrades the catalog by starting AFTER_BIN once
# (timed), and times the reads again with AFTER_BIN. Each time is the median of 5 runs of the whole command (process
# start included). "ideal" is one primary-key read answering the same question on a table ordered for it, sent with
# curl (process start included as well). BEFORE_BIN = AFTER_BIN measures a catalog that is already current.
#
# The upgrade includes its settle wait (3 x catalog.request_timeout: 3 minutes here) and its catch-up copy.
# `get` has no pack in the bucket to read, so it ends with a bucket error after its catalog lookup: the time is the
# lookup's. Needs curl. Leaves the database in place (drop it with DROP DATABASE capstore_scale_<ROWS>).
set -euo pipefail
rows=$1 before=$2 after=$3 url=${4:-http://127.0.0.1:18123}
db=capstore_scale_$rows
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
q() { curl -sS --fail-with-body "$url/?wait_end_of_query=1" --data-binary "$1"; }

export CAPSTORE_CATALOG_URL=$url CAPSTORE_CATALOG_DATABASE=$db CAPSTORE_CATALOG_TABLE_PREFIX=cs
export CAPSTORE_CATALOG_NAME=main CAPSTORE_CATALOG_REQUEST_TIMEOUT=60s CAPSTORE_LEASE_PUBLISH_TIMEOUT=30s
export CAPSTORE_LEASE_TTL=60s CAPSTORE_SPOOL_DIR=$work/spool CAPSTORE_BUCKET_URL=file://$work/bucket
mkdir -p "$work/bucket"

echo "== loading $rows captures into $db (schema 1)"
q "DROP DATABASE IF EXISTS $db"
q "CREATE DATABASE $db"
q "CREATE TABLE $db.cs_captures (catalog String, stream String, captured_at_ns UInt64, capture_id String, pack_id String, object_key String, record_offset UInt64, record_len UInt64, payload_offset UInt64, payload_len UInt64, crc32c UInt32, label_keys Array(String), label_values Array(String), content_type String, version UInt64, publish_id String) ENGINE = ReplacingMergeTree(version) ORDER BY (catalog, stream, captured_at_ns, capture_id)"
q "CREATE TABLE $db.cs_packs (catalog String, pack_id String, object_key String, bytes UInt64, sha256 String, records UInt64, first_captured_at_ns UInt64, last_captured_at_ns UInt64, version UInt64, publish_id String) ENGINE = ReplacingMergeTree(version) ORDER BY (catalog, pack_id)"
q "CREATE TABLE $db.cs_publishes (catalog String, version UInt64, publish_id String, holder String, lease_term UInt64, packs UInt64, captures UInt64, published_at_ms UInt64) ENGINE = MergeTree() ORDER BY (catalog, version, publish_id)"
q "CREATE TABLE $db.cs_lease (catalog String, term UInt64, lease_id String, holder String, written_at_ms UInt64, expires_at_ms UInt64, kind String) ENGINE = MergeTree() ORDER BY (catalog, term, lease_id)"
q "CREATE TABLE $db.cs_schema (component String, version UInt32, written_at_ms UInt64) ENGINE = MergeTree() ORDER BY component"
q "INSERT INTO $db.cs_schema VALUES ('catalog', 1, 0)"
# Deterministic ids: capture n, publish v and pack v are UUID texts of two hashes each.
id() { echo "UUIDNumToString(toFixedString(concat(reinterpretAsString(cityHash64($1, $2)), reinterpretAsString(cityHash64($1, $2 + 1))), 16))"; }
step=$((60 * 86400 * 1000000000 / rows))
src="SELECT number, intDiv(number, 100) + 1 AS v, toUInt64(1700000000000000000 + number * $step) AS at FROM numbers($rows)"
start=$(date +%s%N)
q "INSERT INTO $db.cs_captures SELECT 'main', concat('sensor/', toString(number % 100)), at, $(id number 1), $(id v 5), concat('p/', $(id v 5), '.cpk'), (number % 100) * 4200 + 64, 4200, (number % 100) * 4200 + 200, 4000, toUInt32(cityHash64(number) % 4294967296), ['site'], [concat('s', toString(number % 7))], '', v, $(id v 3) FROM ($src)"
q "INSERT INTO $db.cs_publishes SELECT 'main', v, $(id v 3), 'bench', 1, 1, 100, intDiv(at, 1000000) FROM ($src) WHERE number % 100 = 0"
q "INSERT INTO $db.cs_packs SELECT 'main', $(id v 5), concat('p/', $(id v 5), '.cpk'), 420000, '', 100, at, at, v, $(id v 3) FROM ($src) WHERE number % 100 = 0"
echo "loaded in $(( ($(date +%s%N) - start) / 1000000 )) ms"
watermark=$(q "SELECT max(version) FROM $db.cs_publishes")
middle=$(q "SELECT $(id "toUInt64($rows / 2)" 1)")

median_ms() {  # median of 5 runs of "$@", in ms
    local times=()
    for _ in 1 2 3 4 5; do
        local t0; t0=$(date +%s%N)
        "$@" >/dev/null 2>&1 || true
        times+=($(( ($(date +%s%N) - t0) / 1000000 )))
    done
    printf '%s\n' "${times[@]}" | sort -n | sed -n 3p
}
ideal() { curl -sS "$url/?wait_end_of_query=1" --data-binary "$1" >/dev/null; }

declare -A reads=(
    [get]="get $middle -o /dev/null"
    [ls_stream]="ls --stream sensor/7 --limit 100"
    [ls_all]="ls --limit 100"
    [ls_label]="ls --stream sensor/7 --label site=s3 --limit 100"
    [tail_w5]="tail --after $((watermark - 5))"
)
declare -A ideals=(
    [get]="SELECT * FROM $db.cs_by_version WHERE catalog = 'main' AND version = $((rows / 200 + 1)) AND capture_id = '$middle'"
    [ls_stream]="SELECT * FROM $db.cs_captures WHERE catalog = 'main' AND stream = 'sensor/7' ORDER BY captured_at_ns LIMIT 100"
    [tail_w5]="SELECT * FROM $db.cs_by_version WHERE catalog = 'main' AND version > $((watermark - 5))"
)
order="get ls_stream ls_all ls_label tail_w5"
declare -A before_ms
for read in $order; do before_ms[$read]=$(median_ms "$before" ${reads[$read]}); done

echo "== upgrading with $after (first start)"
t0=$(date +%s%N)
"$after" lease show >/dev/null
echo "upgrade: $(( ($(date +%s%N) - t0) / 1000000 )) ms"

printf '\n%-10s %10s %10s %10s\n' read before_ms after_ms ideal_ms
for read in $order; do
    after_ms=$(median_ms "$after" ${reads[$read]})
    ideal_ms=-
    [ -n "${ideals[$read]:-}" ] && ideal_ms=$(median_ms ideal "${ideals[$read]}")
    printf '%-10s %10s %10s %10s\n' "$read" "${before_ms[$read]}" "$after_ms" "$ideal_ms"
done
printf 'tail --after 0 (%s lines): ' "$rows"
median_ms_once() { local t0; t0=$(date +%s%N); "$@" | wc -l | tr -d '\n'; echo " lines in $(( ($(date +%s%N) - t0) / 1000000 )) ms"; }
median_ms_once "$after" tail --after 0
q "SELECT table, sum(rows), round(sum(data_compressed_bytes) / sum(rows), 1) AS bytes_per_row FROM system.parts WHERE database = '$db' AND active GROUP BY table ORDER BY table FORMAT PrettyCompactMonoBlock"
