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
    let (port, env, mut daemon) = start_holding_daemon(&cluster, dir.path()).await;
    let client = reqwest::Client::new();
    let mut posted = Vec::new();
    let post = |index: usize, wait: bool| post_capture(client.clone(), port, index, wait);
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
    // 18.16 keeps `by_time` (replicated like the rest), filled and marked at the first start, so `ls` below reads it.
    let marked = format!("SELECT count() FROM {} WHERE component = 'by_time' FORMAT TSV", tables.schema);
    assert_eq!(cluster.replicas[0].query(&marked).unwrap().trim(), "1", "by_time is kept");
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
    let versions_on = |replica| publish_count(replica, &env);
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

    let published = assert_gapless_versions(&cluster.replicas[2], &env);
    assert!(published > before, "published after the quorum came back");
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
}

/// Retention decides from what it reads which rows go for good, so every read of the purge is sequentially
/// consistent: a replica that lags (its fetches stopped) refuses the checks before a month's drop, where a plain read
/// there answers without a capture a quorum insert has put in. Once it has caught up it answers them.
#[tokio::test(flavor = "multi_thread")]
async fn a_lagging_replica_refuses_the_checks_before_a_months_drop_until_it_has_caught_up() {
    use capstore::catalog::purge::RowPurge;
    use capstore::catalog::query::CatalogReader;
    let cluster = ClickHouseCluster::start();
    let dir = tempfile::tempdir().unwrap();
    let (port, env, daemon) = start_holding_daemon(&cluster, dir.path()).await;
    let client = reqwest::Client::new();
    post_capture(client.clone(), port, 0, true).await;
    cluster.replicas[2].query("SYSTEM STOP FETCHES").unwrap();
    let (missed_id, _) = post_capture(client.clone(), port, 1, true).await;
    let missed_id: uuid::Uuid = missed_id.parse().unwrap();

    let on_lagging = env.clone().set("CAPSTORE_CATALOG_URL", cluster.replicas[2].url());
    let config = on_lagging.config();
    let catalog_client = capstore::catalog::CatalogClient::connect(&config.catalog).await.unwrap();
    let tables = capstore::catalog::Tables::from_config(&config.catalog);
    let reader = CatalogReader::new(catalog_client.clone(), tables.clone(), &config.catalog_name);
    let purge = RowPurge::new(catalog_client, tables, &config.catalog_name).partitioned(true);
    // The lag is real: a plain read there answers, without the second capture.
    assert_eq!(reader.get(missed_id, None).await.unwrap(), None, "the replica is not behind");
    let plain_watermark = reader.watermark().await.unwrap();
    // The purge's reads are refused there (REPLICA_IS_NOT_IN_QUORUM).
    let refused = purge.watermark().await.unwrap_err();
    assert_eq!(refused.server_code, Some(289), "{refused}");
    let refused = purge.superseded_across(300_001, 0).await.unwrap_err();
    assert_eq!(refused.server_code, Some(289), "{refused}");

    cluster.replicas[2].query("SYSTEM START FETCHES").unwrap();
    let started = Instant::now();
    let caught_up = loop {
        if let Ok(watermark) = purge.watermark().await {
            break watermark;
        }
        assert!(started.elapsed() < REPLICATION_PATIENCE, "the replica never caught up:\n{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(caught_up > plain_watermark, "{caught_up} after catching up, {plain_watermark} behind");
    purge.superseded_across(300_001, 0).await.unwrap();
    assert!(reader.get(missed_id, None).await.unwrap().is_some());
}

/// A daemon on `cluster` (see [`cluster_env`]) in `dir`, once it holds the lease: its HTTP port, environment and
/// process.
async fn start_holding_daemon(
    cluster: &ClickHouseCluster,
    dir: &std::path::Path,
) -> (u16, DaemonEnv, common::daemon::Daemon) {
    let port = common::free_port(false);
    let env = cluster_env(cluster, dir, port);
    let mut daemon = env.start(dir.join("daemon.log"));
    daemon.wait_for_log_async("lease held", Duration::from_secs(180)).await;
    (port, env, daemon)
}

/// A daemon on `cluster` (through replica 0) listening on `port`.
fn cluster_env(cluster: &ClickHouseCluster, dir: &std::path::Path, port: u16) -> DaemonEnv {
    DaemonEnv::live_on(&cluster.replicas[0], "cluster", dir)
        .set("CAPSTORE_CATALOG_CLUSTER", CLUSTER)
        // `ON CLUSTER` statements wait for every replica to run them.
        .set("CAPSTORE_CATALOG_REQUEST_TIMEOUT", "20s")
        // A quorum insert waits for a second replica (about 50 ms here): more room than the 3 s of the other tests,
        // whose renewals take milliseconds, so the fence's margin is not eaten by renewal latency.
        .set("CAPSTORE_LEASE_TTL", LEASE_TTL_TEXT)
        .set("CAPSTORE_HTTP_LISTEN", format!("127.0.0.1:{port}"))
}

const LEASE_TTL_TEXT: &str = "10s";
const LEASE_TTL: Duration = Duration::from_secs(10);

/// Captures posted every 50 ms (not waiting for publishing) until stopped: the continuous load the faults happen
/// under. Every post must be answered 201 (in the spool), whatever the catalog is going through.
/// Capture ids and bodies, in the order posted.
type Posted = Vec<(String, Vec<u8>)>;

struct Load {
    posted: std::sync::Arc<std::sync::Mutex<Posted>>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Load {
    fn start(port: u16, first_index: usize) -> Load {
        let posted = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let task_posted = std::sync::Arc::clone(&posted);
        let task = tokio::spawn(async move {
            let client = reqwest::Client::new();
            for index in first_index.. {
                let capture = post_capture(client.clone(), port, index, false).await;
                task_posted.lock().unwrap().push(capture);
                tokio::select! {
                    _ = stopped.changed() => return,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        });
        Load { posted, stop, task }
    }

    fn count(&self) -> usize {
        self.posted.lock().unwrap().len()
    }

    async fn finish(self) -> Posted {
        self.stop.send_replace(true);
        self.task.await.expect("every capture of the load was accepted");
        std::mem::take(&mut *self.posted.lock().unwrap())
    }
}

/// Under continuous load: the replica the daemon talks to is cut off right after a publish landed on it and before
/// its reply came back; the daemon fails over (`catalog.replica_urls`), reads the publish back through another
/// replica and publishes nothing twice. Then ZooKeeper is stopped for 2 x TTL: publishing waits, ingest goes on,
/// everything lands once it is back. Then the daemon is SIGKILLed and started again with a replica down (it creates
/// nothing its replica has already, so no `ON CLUSTER` statement waits for the missing one).
#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_fails_over_between_replicas_waits_out_zookeeper_and_starts_with_a_replica_down() {
    let mut cluster = ClickHouseCluster::start();
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port(false);
    let proxy = common::proxy::FaultProxy::start(cluster.replicas[0].http_addr);
    let env = cluster_env(&cluster, dir.path(), port)
        .set("CAPSTORE_CATALOG_URL", proxy.url())
        .set("CAPSTORE_CATALOG_REPLICA_URLS", format!("{},{}", cluster.replicas[1].url(), cluster.replicas[2].url()));
    let tables = capstore::catalog::Tables::from_config(&env.config().catalog);
    let mut daemon = env.start(dir.path().join("daemon.log"));
    daemon.wait_for_log_async("lease held", Duration::from_secs(180)).await;
    let load = Load::start(port, 0);
    let publishing = common::wait_until(Duration::from_secs(60), || publish_count(&cluster.replicas[1], &env) >= 3);
    assert!(publishing, "publishing through replica 0:\n{}", daemon.log());

    // A publish runs on replica 0 and loses its reply; once it has landed there, replica 0 is cut off.
    let landed_before = publish_count(&cluster.replicas[0], &env);
    let publishes_sent = proxy.count_requests_containing(&format!("INSERT INTO {} ", tables.publishes));
    proxy.blackhole_replies_matching(&format!("INSERT INTO {} ", tables.publishes));
    let landed = common::wait_until(Duration::from_secs(60), || {
        publishes_sent.load(std::sync::atomic::Ordering::SeqCst) > 0
            && publish_count(&cluster.replicas[0], &env) > landed_before
    });
    assert!(landed, "a publish went through the proxy and landed:\n{}", daemon.log());
    proxy.cut();
    daemon.wait_for_log_async("catalog failover", Duration::from_secs(60)).await;
    daemon.wait_for_log_async("earlier publish of unknown outcome had committed", LEASE_TTL * 6).await;
    let after_failover = publish_count(&cluster.replicas[1], &env);
    let going_on = common::wait_until(LEASE_TTL * 6, || publish_count(&cluster.replicas[1], &env) > after_failover + 2);
    assert!(going_on, "publishing goes on through the other replicas:\n{}", daemon.log());

    // ZooKeeper gone for 2 x TTL: nothing can be published (every table is replicated), ingest goes on.
    let posted_before_outage = load.count();
    let quarantines = |daemon: &common::daemon::Daemon| daemon.log().matches("lease quarantined").count();
    let quarantined_before = quarantines(&daemon);
    cluster.stop_zookeeper();
    // The renewal after the outage began fails with an unknown outcome: from then on nothing is in flight.
    let noticed = common::wait_until(LEASE_TTL * 2, || quarantines(&daemon) > quarantined_before);
    assert!(noticed, "the lease is quarantined without ZooKeeper:\n{}", daemon.log());
    let published_in_outage = publish_count(&cluster.replicas[1], &env);
    // The outage itself is the fault being injected: its length is the point, not a stand-in for a condition.
    tokio::time::sleep(LEASE_TTL * 2).await;
    assert_eq!(publish_count(&cluster.replicas[1], &env), published_in_outage, "nothing published without ZooKeeper");
    assert!(load.count() > posted_before_outage + 20, "ingest went on without ZooKeeper");
    cluster.start_zookeeper();
    let resumed =
        common::wait_until(LEASE_TTL * 9, || publish_count(&cluster.replicas[1], &env) > published_in_outage + 2);
    assert!(resumed, "publishing resumed after ZooKeeper came back:\n{}", daemon.log());

    // SIGKILLed, and started again while replica 2 is down: its tables are all there, so the start runs no DDL.
    let posted = load.finish().await;
    daemon.kill();
    cluster.replicas[2].kill();
    proxy.pass();
    let mut daemon = env.start(dir.path().join("daemon-2.log"));
    daemon.wait_for_log_async("lease held", Duration::from_secs(120)).await;
    for index in [0, 1] {
        assert_replica_serves(&cluster, index, &env, &posted).await;
    }
    cluster.restart(2);
    assert_replica_serves(&cluster, 2, &env, &posted).await;
    assert_gapless_versions(&cluster.replicas[2], &env);
    assert_published_once(&cluster.replicas[2], &env, posted.len());
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
    let first_log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
    assert!(!first_log.contains("latched") && !log.contains("latched"), "no latch:\n{first_log}\n{log}");
}

/// POST capture `index` to the daemon on `port` (`wait`: answer once published); 201 either way, once the capture is
/// in the spool. Returns its id and body.
async fn post_capture(client: reqwest::Client, port: u16, index: usize, wait: bool) -> (String, Vec<u8>) {
    let capture_id = uuid::Uuid::now_v7();
    let body = format!("capture {index} of the cluster test").into_bytes();
    let wait = if wait { "&wait=published" } else { "" };
    let url = format!("http://127.0.0.1:{port}/v1/captures?stream=cl/{}&id={capture_id}{wait}", index % 2);
    let response = client.post(url).body(body.clone()).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED, "{}", response.text().await.unwrap());
    (capture_id.to_string(), body)
}

/// The publishes of `env`'s catalog that `replica` holds.
fn publish_count(replica: &common::clickhouse::ClickHouseServer, env: &DaemonEnv) -> u64 {
    let tables = capstore::catalog::Tables::from_config(&env.config().catalog);
    let catalog = env.get("CAPSTORE_CATALOG_NAME").unwrap();
    let sql = format!("SELECT count() FROM {} WHERE catalog = '{catalog}' FORMAT TSV", tables.publishes);
    replica.query(&sql).unwrap().trim().parse().unwrap()
}

/// Versions 1..=N, each published once, on `replica`: returns N.
fn assert_gapless_versions(replica: &common::clickhouse::ClickHouseServer, env: &DaemonEnv) -> u64 {
    let tables = capstore::catalog::Tables::from_config(&env.config().catalog);
    let catalog = env.get("CAPSTORE_CATALOG_NAME").unwrap();
    let answer = replica
        .query(&format!(
            "SELECT count(), uniqExact(version), max(version), min(version) FROM {} WHERE catalog = '{catalog}' \
             FORMAT TSV",
            tables.publishes
        ))
        .unwrap();
    let counts: Vec<u64> = answer.split_whitespace().map(|n| n.parse().unwrap()).collect();
    assert!(
        counts[0] == counts[1] && counts[1] == counts[2] && counts[3] == 1,
        "gapless versions, each once: {answer}"
    );
    counts[0]
}

/// Nothing was published twice: every committed pack at one version only, and the committed publishes count each
/// of the `posted` captures once.
fn assert_published_once(replica: &common::clickhouse::ClickHouseServer, env: &DaemonEnv, posted: usize) {
    let tables = capstore::catalog::Tables::from_config(&env.config().catalog);
    let catalog = env.get("CAPSTORE_CATALOG_NAME").unwrap();
    let committed = format!(
        "(version, publish_id) IN (SELECT version, publish_id FROM {} WHERE catalog = '{catalog}')",
        tables.publishes
    );
    let twice = replica
        .query(&format!(
            "SELECT pack_id, count() AS times FROM {} WHERE catalog = '{catalog}' AND {committed} GROUP BY pack_id \
             HAVING times > 1 FORMAT TSV",
            tables.packs
        ))
        .unwrap();
    assert_eq!(twice, "", "packs committed at more than one version");
    let counted = replica
        .query(&format!("SELECT sum(captures) FROM {} WHERE catalog = '{catalog}' FORMAT TSV", tables.publishes))
        .unwrap();
    assert_eq!(counted.trim(), posted.to_string(), "the committed publishes count every capture once");
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
    let on_replica = env.clone().set("CAPSTORE_CATALOG_URL", replica.url()).set("CAPSTORE_CATALOG_REPLICA_URLS", "");
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
