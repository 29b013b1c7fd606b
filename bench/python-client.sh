#!/usr/bin/env bash
# The Python client's put and get beside curl doing the same requests, in one run.
#
#   bench/python-client.sh COUNT SIZE [CAPSTORE_BIN] [CLICKHOUSE_URL]
#
# Starts a daemon (file:// bucket in a scratch directory, a fresh catalog in database capstore_pyclient_bench on the
# ClickHouse at CLICKHOUSE_URL), then times with farm-bench (RUNS pairs, default 5; medians): COUNT puts of SIZE
# bytes by one Python process (`capstore.Client.put`, one kept-alive connection) vs one curl process posting the same
# COUNT requests on one kept-alive connection (a curl config of COUNT requests joined by `next`); then COUNT gets of
# published captures, the same way. Python is CAPSTORE_PYTHON (default the test venv, ~/.cache/capstore-python-venv),
# with clients/python/src on its path.
set -euo pipefail
count=$1 size=$2
bin=${3:-$PWD/target/release/capstore}
url=${4:-http://127.0.0.1:18123}
runs=${RUNS:-5}
python=${CAPSTORE_PYTHON:-$HOME/.cache/capstore-python-venv/bin/python}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null; rm -rf "$work"' EXIT
q() { curl -sS --fail-with-body "$url/?wait_end_of_query=1" --data-binary "$1"; }
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
base=http://127.0.0.1:$port

db=capstore_pyclient_bench
q "DROP DATABASE IF EXISTS $db"
export CAPSTORE_CATALOG_URL=$url CAPSTORE_CATALOG_DATABASE=$db CAPSTORE_CATALOG_TABLE_PREFIX=cs
export CAPSTORE_CATALOG_NAME=main CAPSTORE_LEASE_TTL=10s CAPSTORE_LEASE_START_WAIT=0s CAPSTORE_LOG_LEVEL=warn
export CAPSTORE_SPOOL_DIR=$work/spool CAPSTORE_BUCKET_URL=file://$work/bucket CAPSTORE_HTTP_LISTEN=127.0.0.1:$port
"$bin" run 2>"$work/daemon.log" &
until curl -sf "$base/v1/captures?limit=1" >/dev/null; do sleep 0.1; done

head -c "$size" /dev/urandom > "$work/payload"
export PYTHONPATH=$PWD/clients/python/src
cat > "$work/put.py" <<EOF
import capstore
client = capstore.Client("$base")
payload = open("$work/payload", "rb").read()
for _ in range($count):
    client.put("bench/py", payload)
EOF
# (`next` between requests, not after the last: a trailing one is a request without a URL.)
for index in $(seq "$count"); do
    [ "$index" -gt 1 ] && echo next
    printf 'url = "%s/v1/captures?stream=bench/curl"\ndata-binary = "@%s"\noutput = "/dev/null"\nfail\n' "$base" "$work/payload"
done > "$work/put.curl"

echo "== $count puts of $size bytes: Python client vs curl"
farm-bench -n "$runs" --timeout 3000 --vs "curl -sS -K $work/put.curl" -- "$python" "$work/put.py"

# COUNT published captures to read back, the same ids for both.
"$python" - <<EOF
import capstore
client = capstore.Client("$base")
payload = open("$work/payload", "rb").read()
ids = [client.put("bench/get", payload).capture_id for _ in range($count)]
client.put("bench/get", payload, wait="published")
open("$work/ids", "w").write("\n".join(ids))
EOF
until [ "$(q "SELECT uniqExact(capture_id) FROM $db.cs_captures WHERE stream = 'bench/get'")" -ge $(( count + 1 )) ]; do
    sleep 0.3
done
cat > "$work/get.py" <<EOF
import capstore
client = capstore.Client("$base")
for capture_id in open("$work/ids").read().split():
    assert len(client.get(capture_id).payload) == $size
EOF
first=1
while read -r id; do
    [ -n "$first" ] || echo next
    first=""
    printf 'url = "%s/v1/captures/%s"\noutput = "/dev/null"\nfail\n' "$base" "$id"
done < "$work/ids" > "$work/get.curl"

echo "== $count gets of $size bytes: Python client vs curl"
farm-bench -n "$runs" --timeout 3000 --vs "curl -sS -K $work/get.curl" -- "$python" "$work/get.py"
