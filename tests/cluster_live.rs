//! The replicated catalog on a live ClickHouse cluster: ZooKeeper and three 18.16 replicas of one shard (see
//! `common::cluster`), with `catalog.cluster` set, so every table is created `ON CLUSTER` with a Replicated engine.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{ClickHouseCluster, CLUSTER};
use common::daemon::DaemonEnv;
use reqwest::StatusCode;

/// How long a replica may take to catch up: a restarted one first waits for ZooKeeper to expire the session of the
/// process that was killed (3 s here), then fetches every part it missed, table by table.
const REPLICATION_PATIENCE: Duration = Duration::from_secs(180);

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_on_a_cluster_replicates_its_tables_survives_a_lost_replica_and_waits_out_a_lost_quorum() {
    let mut cluster = ClickHouseCluster::start();
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port(false);
    let env = DaemonEnv::live_on(&cluster.replicas[0], "cluster", dir.path())
        .set("CAPSTORE_CATALOG_CLUSTER", CLUSTER)
        // `ON CLUSTER` statements wait for every replica to run them.
        .set("CAPSTORE_CATALOG_REQUEST_TIMEOUT", "20s")
        // A quorum insert waits for a second replica (about 50 ms here): more room than the 3 s of the other tests,
        // whose renewals take milliseconds, so the fence's margin is not eaten by renewal latency.
        .set("CAPSTORE_LEASE_TTL", "10s")
        .set("CAPSTORE_HTTP_LISTEN", format!("127.0.0.1:{port}"));
    let mut daemon = env.start(dir.path().join("daemon.log"));
    daemon.wait_for_log_async("lease held", Duration::from_secs(180)).await;
    let client = reqwest::Client::new();
    let mut posted = Vec::new();
    // `wait`: answer once published (201 either way: the capture is in the spool).
    let post = |index: usize, wait: bool| {
        let client = client.clone();
        async move {
            let capture_id = uuid::Uuid::now_v7();
            let body = format!("capture {index} of the cluster test").into_bytes();
            let wait = if wait { "&wait=published" } else { "" };
            let url = format!("http://127.0.0.1:{port}/v1/captures?stream=cl/{}&id={capture_id}{wait}", index % 2);
            let response = client.post(url).body(body.clone()).send().await.unwrap();
            assert_eq!(response.status(), StatusCode::CREATED, "{}", response.text().await.unwrap());
            (capture_id.to_string(), body)
        }
    };
    for index in 0..20 {
        posted.push(post(index, true).await);
    }
    let tables = capstore::catalog::Tables::from_config(&env.config().catalog);
    let tables_on = |replica: &common::clickhouse::ClickHouseServer| {
        replica
            .query(&format!(
                "SELECT name, engine FROM system.tables WHERE database = '{}' ORDER BY name",
                tables.database
            ))
            .unwrap()
    };
    let on_first = tables_on(&cluster.replicas[0]);
    let stored: Vec<&str> = on_first.lines().filter(|line| !line.ends_with("\tMaterializedView")).collect();
    assert!(stored.len() >= 12 && stored.iter().all(|line| line.contains("\tReplicated")), "{on_first}");
    for (index, replica) in cluster.replicas.iter().enumerate() {
        // Created on every replica by the one daemon's `ON CLUSTER` DDL (views too), each table replicated on all
        // three.
        assert_eq!(tables_on(replica), on_first, "replica {index} has the same tables");
        let replication = replica
            .query(&format!(
                "SELECT count(), min(total_replicas), min(active_replicas) FROM system.replicas WHERE database = '{}' \
                 FORMAT TSV",
                tables.database
            ))
            .unwrap();
        assert_eq!(replication.trim(), format!("{}\t3\t3", stored.len()), "replica {index}: system.replicas");
        assert_replica_serves(&cluster, index, &env, &posted).await;
    }

    // A replica lost (SIGKILL): publishing goes on through the others; restarted, it catches up and serves reads.
    cluster.replicas[2].kill();
    assert!(cluster.replicas[2].query("SELECT 1").is_err(), "replica 2 is down");
    for index in 20..40 {
        posted.push(post(index, true).await);
    }
    cluster.restart(2);
    for index in 0..cluster.replicas.len() {
        assert_replica_serves(&cluster, index, &env, &posted).await;
    }

    // Two replicas down: no insert can reach a quorum (2 of 3), so nothing is published, while ingest goes on; one
    // back, and everything owed is published.
    let versions_on = |replica: &common::clickhouse::ClickHouseServer| {
        replica
            .query(&format!(
                "SELECT count() FROM {} WHERE catalog = '{}' FORMAT TSV",
                tables.publishes,
                env.get("CAPSTORE_CATALOG_NAME").unwrap()
            ))
            .unwrap()
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    let before = versions_on(&cluster.replicas[0]);
    cluster.replicas[1].kill();
    cluster.replicas[2].kill();
    let mut owed = Vec::new();
    for index in 40..45 {
        owed.push(post(index, false).await);
    }
    daemon.wait_for_log_async("less than requested quorum", Duration::from_secs(60)).await;
    assert_eq!(versions_on(&cluster.replicas[0]), before, "nothing published without a quorum:\n{}", daemon.log());
    cluster.restart(1);
    posted.extend(owed);
    for index in [0, 1] {
        assert_replica_serves(&cluster, index, &env, &posted).await;
    }
    cluster.restart(2);
    assert_replica_serves(&cluster, 2, &env, &posted).await;

    let watermark = cluster.replicas[2]
        .query(&format!(
            "SELECT count(), uniqExact(version), max(version) FROM {} WHERE catalog = '{}' FORMAT TSV",
            tables.publishes,
            env.get("CAPSTORE_CATALOG_NAME").unwrap()
        ))
        .unwrap();
    let counts: Vec<u64> = watermark.split_whitespace().map(|n| n.parse().unwrap()).collect();
    assert!(counts[0] == counts[1] && counts[1] == counts[2] && counts[2] > before, "gapless versions: {watermark}");
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
}

/// `replica` lists each of `posted` once and reads it back byte-identical (`capstore ls` and `get` pointed at it).
/// Replication is asynchronous, table by table: polls the whole check until the replica has caught up.
async fn assert_replica_serves(
    cluster: &ClickHouseCluster,
    index: usize,
    env: &DaemonEnv,
    posted: &[(String, Vec<u8>)],
) {
    let replica = &cluster.replicas[index];
    let mut expected: Vec<String> = posted.iter().map(|(id, _)| id.clone()).collect();
    expected.sort();
    let on_replica = env.clone().set("CAPSTORE_CATALOG_URL", replica.url());
    let check = || -> Result<(), String> {
        let output = on_replica.command().args(["ls", "--json"]).output().unwrap();
        if !output.status.success() {
            return Err(format!("ls: {}", String::from_utf8_lossy(&output.stderr)));
        }
        let mut listed: Vec<String> = String::from_utf8(output.stdout)
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap()["capture_id"].as_str().unwrap().into())
            .collect();
        listed.sort();
        if listed != expected {
            return Err(format!("listed {listed:?}, expected each of {expected:?} once"));
        }
        for (capture_id, body) in posted {
            let output = on_replica.command().args(["get", capture_id]).output().unwrap();
            if !output.status.success() || &output.stdout != body {
                return Err(format!("get {capture_id}: {}", String::from_utf8_lossy(&output.stderr)));
            }
        }
        Ok(())
    };
    let started = Instant::now();
    loop {
        match check() {
            Ok(()) => return,
            Err(failure) if started.elapsed() > REPLICATION_PATIENCE => {
                let queue = replica
                    .query("SELECT database, table, type, last_exception FROM system.replication_queue")
                    .unwrap_or_else(|error| error);
                panic!(
                    "replica {index}: {failure}\nreplication queue:\n{queue}\n{}\n{}",
                    replica.log_tail(),
                    cluster.zookeeper_log()
                );
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}
