#!/usr/bin/env bash
# Run capstore from a checkout on the embedded default: a file:// bucket and a private ClickHouse started for you,
# everything under ./capstore-data. Installs clickhouse-server (Debian/Ubuntu, apt) when it is missing.
#
#   deploy/local/run.sh            # build, start ClickHouse if needed, run the daemon in the foreground
#   deploy/local/run.sh stop       # stop the private ClickHouse
#
# Environment: CAPSTORE_LOCAL_CLICKHOUSE_PORT (HTTP port, default 18123; the native port is the next one).
set -euo pipefail
cd "$(dirname "$0")/../.."
data="$PWD/capstore-data"
http_port="${CAPSTORE_LOCAL_CLICKHOUSE_PORT:-18123}"
tcp_port=$((http_port + 1))
ch_dir="$data/clickhouse"

clickhouse_up() { curl -sf "http://127.0.0.1:$http_port/?query=SELECT%201" >/dev/null 2>&1; }

if [ "${1:-}" = "stop" ]; then
    [ -f "$ch_dir/pid" ] && kill "$(cat "$ch_dir/pid")" 2>/dev/null && echo "private ClickHouse stopped"
    exit 0
fi

if ! command -v clickhouse-server >/dev/null && [ ! -x /usr/sbin/clickhouse-server ]; then
    echo "installing clickhouse-server (apt)"
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq clickhouse-server clickhouse-client \
        || { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq clickhouse-server clickhouse-client; }
fi
server_bin="$(command -v clickhouse-server || echo /usr/sbin/clickhouse-server)"

if ! clickhouse_up; then
    mkdir -p "$ch_dir/data" "$ch_dir/tmp"
    cat > "$ch_dir/config.xml" <<XML
<?xml version="1.0"?>
<yandex>
    <logger><level>warning</level><log>$ch_dir/server.log</log><errorlog>$ch_dir/server.err.log</errorlog></logger>
    <http_port>$http_port</http_port>
    <tcp_port>$tcp_port</tcp_port>
    <listen_host>127.0.0.1</listen_host>
    <path>$ch_dir/data/</path>
    <tmp_path>$ch_dir/tmp/</tmp_path>
    <users_config>/etc/clickhouse-server/users.xml</users_config>
    <default_profile>default</default_profile>
    <default_database>default</default_database>
    <mark_cache_size>1073741824</mark_cache_size>
</yandex>
XML
    "$server_bin" --config-file="$ch_dir/config.xml" >"$ch_dir/stdout.log" 2>&1 &
    echo $! >"$ch_dir/pid"
    for _ in $(seq 1 150); do clickhouse_up && break; sleep 0.2; done
    clickhouse_up || { echo "private ClickHouse did not start; see $ch_dir/server.err.log"; exit 1; }
    echo "private ClickHouse on 127.0.0.1:$http_port (stop it with: deploy/local/run.sh stop)"
fi

cargo build --release --quiet
export CAPSTORE_CATALOG_URL="http://127.0.0.1:$http_port"
export CAPSTORE_SPOOL_DIR="$data/spool"
export CAPSTORE_BUCKET_URL="file://$data/bucket"
exec ./target/release/capstore --config config/local.toml run
