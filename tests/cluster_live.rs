//! The replicated catalog on a live ClickHouse cluster: ZooKeeper and three 18.16 replicas of one shard (see
//! `common::cluster`), with `catalog.cluster` set, so every table is created `ON CLUSTER` with a Replicated engine.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{ClickHouseCluster, CLUSTER};
use common::daemon::DaemonEnv;
use reqwest::StatusCode;

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_on_a_cluster_replicates_its_tables_and_a_replica_killed_and_restarted_catches_up() {
    let mut cluster = ClickHouseCluster::start();
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port(false);
    let env = DaemonEnv::live_on(&cluster.replicas[0], "cluster", dir.path())
        .set("CAPSTORE_CATALOG_CLUSTER", CLUSTER)
        // `ON CLUSTER` statements wait for every replica to run them.
        .set("CAPSTORE_CATALOG_REQUEST_TIMEOUT", "20s")
        .set("CAPSTORE_HTTP_LISTEN", format!("127.0.0.1:{port}"));
    let mut daemon = env.start(dir.path().join("daemon.log"));
    daemon.wait_for_log_async("lease held", Duration::from_secs(60)).await;
    let client = reqwest::Client::new();
    let mut posted = Vec::new();
    let post = |index: usize| {
        let client = client.clone();
        async move {
            let capture_id = uuid::Uuid::now_v7();
            let body = format!("capture {index} of the cluster test").into_bytes();
            let url =
                format!("http://127.0.0.1:{port}/v1/captures?stream=cl/{}&id={capture_id}&wait=published", index % 2);
            let response = client.post(url).body(body.clone()).send().await.unwrap();
            assert_eq!(response.status(), StatusCode::CREATED, "{}", response.text().await.unwrap());
            (capture_id.to_string(), body)
        }
    };
    for index in 0..20 {
        posted.push(post(index).await);
    }
    let tables = capstore::catalog::Tables::from_config(&env.config().catalog);
    for (index, replica) in cluster.replicas.iter().enumerate() {
        // Created on every replica by the one daemon's `ON CLUSTER` DDL, each table replicated.
        let engines = replica
            .query(&format!(
                "SELECT name, engine FROM system.tables WHERE database = '{}' AND engine != 'MaterializedView' \
                 ORDER BY name",
                tables.database
            ))
            .unwrap();
        assert!(engines.lines().count() >= 6, "replica {index}: {engines}");
        assert!(engines.lines().all(|line| line.contains("\tReplicated")), "replica {index}: {engines}");
        assert_replica_serves(index, replica, &env, &posted).await;
    }

    // A replica lost (SIGKILL): publishing goes on through the others; restarted, it catches up and serves reads.
    cluster.replicas[2].kill();
    assert!(cluster.replicas[2].query("SELECT 1").is_err(), "replica 2 is down");
    for index in 20..40 {
        posted.push(post(index).await);
    }
    cluster.restart(2);
    for (index, replica) in cluster.replicas.iter().enumerate() {
        assert_replica_serves(index, replica, &env, &posted).await;
    }
    let watermark = cluster.replicas[2]
        .query(&format!(
            "SELECT count(), uniqExact(version), max(version) FROM {} WHERE catalog = '{}' FORMAT TSV",
            tables.publishes,
            env.get("CAPSTORE_CATALOG_NAME").unwrap()
        ))
        .unwrap();
    let counts: Vec<u64> = watermark.split_whitespace().map(|n| n.parse().unwrap()).collect();
    assert!(counts[0] == counts[1] && counts[1] == counts[2] && counts[2] >= 40, "gapless versions: {watermark}");
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
}

/// `replica` lists each of `posted` once and reads it back byte-identical (`capstore ls` and `get` pointed at it).
/// Replication is asynchronous: polls until the replica has caught up, for a minute at most.
async fn assert_replica_serves(
    index: usize,
    replica: &common::clickhouse::ClickHouseServer,
    env: &DaemonEnv,
    posted: &[(String, Vec<u8>)],
) {
    let mut expected: Vec<String> = posted.iter().map(|(id, _)| id.clone()).collect();
    expected.sort();
    let on_replica = env.clone().set("CAPSTORE_CATALOG_URL", replica.url());
    let started = Instant::now();
    let listed = loop {
        let output = on_replica.command().args(["ls", "--json"]).output().unwrap();
        let mut listed: Vec<String> = String::from_utf8(output.stdout)
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap()["capture_id"].as_str().unwrap().into())
            .collect();
        listed.sort();
        if (output.status.success() && listed == expected) || started.elapsed() > Duration::from_secs(60) {
            assert!(output.status.success(), "replica {index}: {}", String::from_utf8_lossy(&output.stderr));
            break listed;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(listed, expected, "replica {index} lists every capture once\n{}", replica.log_tail());
    for (capture_id, body) in posted {
        let output = on_replica.command().args(["get", capture_id]).output().unwrap();
        assert!(output.status.success(), "replica {index}: {}", String::from_utf8_lossy(&output.stderr));
        assert_eq!(&output.stdout, body, "replica {index}, capture {capture_id}");
    }
}
