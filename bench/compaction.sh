#!/usr/bin/env bash
# Compaction's cost and effect, in one run: objects in the bucket before and after, bytes rewritten, how long it
# took, and the latency of reads (GET /v1/captures/{id}, one keep-alive connection) before, during and after.
#
#   bench/compaction.sh COUNT SIZE [PER_PACK] [CAPSTORE_BIN] [CLICKHOUSE_URL]
#
# A daemon with compaction off ingests COUNT captures of SIZE random bytes through its inbox into packs of PER_PACK
# captures (default 10: the small packs a daemon sealing every pack_max_age leaves), file:// bucket, fresh catalog
# (database capstore_compaction_bench, dropped first). Reads are timed (READS random ids, default 2000), then the
# daemon is restarted with compaction on (interval 1 s, min age 0 s, read grace 5 s) while reads keep being timed
# until every small pack is replaced, then once more after the old objects are removed. Every read of a capture is
# checked byte-identical with its reads in the other phases. Needs curl and python3.
set -euo pipefail
count=$1 size=$2 per_pack=${3:-10}
bin=${4:-$PWD/target/release/capstore}
url=${5:-http://127.0.0.1:18123}
reads=${READS:-2000}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null; rm -rf "$work"' EXIT
q() { curl -sS --fail-with-body "$url/?wait_end_of_query=1" --data-binary "$1"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
db=capstore_compaction_bench
export CAPSTORE_CATALOG_URL=$url CAPSTORE_CATALOG_DATABASE=$db CAPSTORE_CATALOG_TABLE_PREFIX=cs
export CAPSTORE_CATALOG_NAME=main CAPSTORE_LEASE_TTL=10s CAPSTORE_LEASE_START_WAIT=0s
export CAPSTORE_SPOOL_DIR=$work/spool CAPSTORE_LOG_LEVEL=warn CAPSTORE_BUCKET_URL=file://$work/bucket
export CAPSTORE_SPOOL_PACK_MAX_RECORDS=$per_pack
http_port=$(free_port)
export CAPSTORE_HTTP_LISTEN=127.0.0.1:$http_port
q "DROP DATABASE IF EXISTS $db"
mkdir -p "$work/bucket" "$work/spool/inbox/bench"

python3 - "$work/files" "$count" "$size" <<'EOF'
import os, sys
root, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(root)
for index in range(count):
    with open(os.path.join(root, f"c{index:07d}"), "wb") as file:
        file.write(os.urandom(size))
EOF

metric() { curl -sf "http://127.0.0.1:$http_port/metrics" | awk -v name="$1" '$1 == name {print $2}'; }
start_daemon() {
    "$bin" run 2>>"$work/daemon.log" &
    daemon=$!
    until curl -sf "http://127.0.0.1:$http_port/healthz" >/dev/null; do sleep 0.1; done
}
objects() { find "$work/bucket" -name '*.cpk' | wc -l; }
bucket_bytes() { du -sb "$work/bucket" | cut -f1; }

echo "== $count captures of $size bytes, $per_pack per pack"
CAPSTORE_LIFECYCLE_COMPACTION=false start_daemon
started=$(date +%s)
mv "$work/files" "$work/spool/inbox/bench/cmp"
published() { local n; n=$(q "SELECT sum(captures) FROM $db.cs_publishes WHERE catalog = 'main'" 2>/dev/null) || n=0; echo "${n:-0}"; }
until [ "$(published)" -ge "$count" ]; do
    kill -0 $daemon || { tail -20 "$work/daemon.log"; exit 1; }
    [ $(( $(date +%s) - started )) -lt 1800 ] || { echo "not published within 1800 s"; exit 1; }
    sleep 0.5
done
echo "ingested and published in $(( $(date +%s) - started )) s"
before_objects=$(objects)
before_bytes=$(bucket_bytes)

# Reads: random ids of the listing, each GET timed; a capture's bytes must be the same in every phase (the digest of
# its first read is kept and every later read compared with it).
python3 - "$http_port" "$work" <<'EOF'
import http.client, json, sys
port, work = int(sys.argv[1]), sys.argv[2]
conn = http.client.HTTPConnection("127.0.0.1", port)
ids, cursor = [], None
while True:
    path = "/v1/captures?stream=bench/cmp&limit=10000" + (f"&cursor={cursor}" if cursor else "")
    conn.request("GET", path)
    page = json.loads(conn.getresponse().read())
    ids += [capture["capture_id"] for capture in page["captures"]]
    cursor = page.get("next_cursor")
    if not cursor:
        break
with open(f"{work}/ids", "w") as out:
    out.write("\n".join(ids))
EOF
cat > "$work/reads.py" <<'EOF'
import hashlib, http.client, json, os, random, sys, time
port, work, phase, reads, until = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
ids = open(f"{work}/ids").read().split()
digests_path = f"{work}/digests.json"
digests = json.load(open(digests_path)) if os.path.exists(digests_path) else {}
conn = http.client.HTTPConnection("127.0.0.1", port)
latencies, done = [], 0
random.seed(phase)
while True:
    if until == "count" and done >= reads:
        break
    if until != "count" and os.path.exists(until):
        break
    capture_id = random.choice(ids)
    began = time.perf_counter()
    conn.request("GET", f"/v1/captures/{capture_id}")
    response = conn.getresponse()
    body = response.read()
    latencies.append(time.perf_counter() - began)
    assert response.status == 200, (response.status, body[:200])
    digest = hashlib.sha256(body).hexdigest()
    assert digests.setdefault(capture_id, digest) == digest, f"{capture_id} changed"
    done += 1
json.dump(digests, open(digests_path, "w"))
latencies.sort()
pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000
print(f"reads {phase}: {len(latencies)} GETs, p50 {pick(0.5):.2f} ms, p99 {pick(0.99):.2f} ms, byte-identical")
EOF
python3 "$work/reads.py" "$http_port" "$work" before "$reads" count
kill -TERM $daemon && wait $daemon || true

echo "== compaction on"
export CAPSTORE_LIFECYCLE_COMPACTION_INTERVAL=1s CAPSTORE_LIFECYCLE_COMPACTION_MIN_AGE=0s
export CAPSTORE_LIFECYCLE_READ_GRACE=5s
start_daemon
began=$(date +%s.%N)
python3 "$work/reads.py" "$http_port" "$work" during "$reads" "$work/compacted" &
readers=$!
until [ "$(metric capstore_packs_compacted_total)" -ge "$before_objects" ]; do
    kill -0 $daemon || { tail -20 "$work/daemon.log"; exit 1; }
    sleep 0.2
done
ended=$(date +%s.%N)
touch "$work/compacted"
wait $readers
until [ "$(metric capstore_objects_removed_total)" -ge "$before_objects" ]; do sleep 0.2; done
python3 "$work/reads.py" "$http_port" "$work" after "$reads" count
rewritten=$(metric capstore_compaction_rewritten_bytes_total)
after_objects=$(objects)
after_bytes=$(bucket_bytes)
kill -TERM $daemon && wait $daemon || true
awk -v b="$began" -v e="$ended" -v bo="$before_objects" -v ao="$after_objects" -v bb="$before_bytes" \
    -v ab="$after_bytes" -v rw="$rewritten" 'BEGIN {
    printf "objects: %d before, %d after (%.0fx fewer)\n", bo, ao, bo / ao
    printf "bucket bytes: %d before, %d after\n", bb, ab
    printf "rewritten: %d bytes in %.1f s (%.1f MB/s, %.0f packs/s replaced)\n", rw, e - b, rw / (e - b) / 1e6, bo / (e - b)
}'
grep -E "ERROR|WARN" "$work/daemon.log" | head -5 || true
