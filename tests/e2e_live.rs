//! `capstore run` end to end: a real daemon process, a real ClickHouse and a real S3 server (SeaweedFS) or a file://
//! bucket, producers dropping files into the inbox; faults injected for real (SIGKILL at random and at named points,
//! a ClickHouse cut, an S3 outage, a lost spool, SIGTERM under load).

#![allow(clippy::disallowed_methods, reason = "these tests play producers, which rename files into the inbox")]

mod common;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use capstore::bucket::Bucket;
use capstore::catalog::lease::{LeaseStore, LeaseTimings};
use capstore::catalog::query::{CatalogReader, ListQuery};
use capstore::catalog::{CatalogClient, Tables};
use capstore::config::Config;
use capstore::reader::Reader;
use capstore::spool::{list_packs, SpoolPaths};
use common::clickhouse::ClickHouseServer;
use common::daemon::{expected_payload, Daemon, DaemonEnv};
use common::proxy::FaultProxy;
use rand::Rng;
use uuid::Uuid;

const TTL: Duration = Duration::from_secs(3);

enum BucketKind<'a> {
    File,
    S3(&'a common::s3::S3Server),
    Azure(&'a common::azurite::AzuriteServer),
}

/// One daemon's world: its spool, bucket, catalog database and name, and (optionally) a fault proxy to ClickHouse.
struct World {
    server: &'static ClickHouseServer,
    dir: tempfile::TempDir,
    env: DaemonEnv,
    proxy: Option<FaultProxy>,
    config: Config,
}

impl World {
    fn new(server: &'static ClickHouseServer, bucket: BucketKind<'_>, with_proxy: bool) -> World {
        let dir = tempfile::tempdir().unwrap();
        let proxy = with_proxy.then(|| FaultProxy::start(server.http_addr));
        let catalog_url = proxy.as_ref().map_or_else(|| server.url(), |proxy| proxy.url());
        let mut env = DaemonEnv::live_on(server, "e2e", dir.path())
            .set("CAPSTORE_CATALOG_URL", catalog_url)
            .set("CAPSTORE_SPOOL_PACK_MAX_BYTES", "2MiB")
            .set("CAPSTORE_SPOOL_INBOX_RESCAN_INTERVAL", "250ms")
            .set("CAPSTORE_UPLOAD_PART_SIZE", "5MiB")
            .set("CAPSTORE_SHUTDOWN_GRACE", "20s");
        if let BucketKind::S3(s3) = bucket {
            env = env
                .set("CAPSTORE_BUCKET_URL", format!("s3://{}", s3.bucket))
                .set("CAPSTORE_BUCKET_ENDPOINT", s3.endpoint())
                .set("CAPSTORE_BUCKET_REGION", "us-east-1")
                .set("CAPSTORE_BUCKET_ALLOW_HTTP", "true")
                .set("CAPSTORE_BUCKET_ACCESS_KEY_ID", s3.access_key.clone())
                .set("CAPSTORE_BUCKET_SECRET_ACCESS_KEY", s3.secret_key.clone())
                // Every test uses its own prefix in the shared bucket.
                .set("CAPSTORE_BUCKET_PREFIX", format!("t{}", rand::random::<u32>()));
        }
        let azure = matches!(bucket, BucketKind::Azure(_));
        if let BucketKind::Azure(azurite) = bucket {
            // The account through the environment object_store's Azure builder reads, as a deployment would.
            env = env
                .set("CAPSTORE_BUCKET_URL", format!("az://{}", azurite.container))
                .set("CAPSTORE_BUCKET_ENDPOINT", azurite.endpoint())
                .set("CAPSTORE_BUCKET_ALLOW_HTTP", "true")
                .set("CAPSTORE_BUCKET_PREFIX", format!("t{}", rand::random::<u32>()))
                .set("AZURE_STORAGE_ACCOUNT_NAME", common::azurite::ACCOUNT)
                .set("AZURE_STORAGE_ACCOUNT_KEY", common::azurite::ACCOUNT_KEY);
        }
        let mut config = env.config();
        if azure {
            config.bucket.options.insert("account_name".into(), common::azurite::ACCOUNT.into());
            config.bucket.options.insert("access_key".into(), common::azurite::ACCOUNT_KEY.into());
        }
        // The test process reaches ClickHouse directly, never through the proxy it cuts.
        config.catalog.url = server.url();
        World { server, dir, env, proxy, config }
    }

    fn spool_dir(&self) -> PathBuf {
        self.config.spool.dir.clone()
    }

    fn inbox_stream(&self) -> PathBuf {
        let stream = self.spool_dir().join("inbox").join("cam").join("1");
        std::fs::create_dir_all(&stream).unwrap();
        stream
    }

    fn start(&self, extra_env: &[(&str, &str)]) -> Daemon {
        let log_path = self.dir.path().join(format!("daemon-{}.log", rand::random::<u32>()));
        let env = extra_env.iter().fold(self.env.clone(), |env, (key, value)| env.set(key, *value));
        env.start(log_path)
    }

    async fn catalog(&self) -> (CatalogClient, Tables) {
        let client = CatalogClient::connect(&self.config.catalog).await.unwrap();
        let tables = Tables::from_config(&self.config.catalog);
        (client, tables)
    }

    async fn reader(&self) -> Reader {
        let (client, tables) = self.catalog().await;
        let catalog = CatalogReader::new(client, tables, &self.config.catalog_name);
        Reader::new(catalog, Arc::new(Bucket::from_config(&self.config).unwrap()), None)
    }

    /// Every published capture id with how often the listing shows it.
    async fn listed(&self) -> Vec<(Uuid, u64)> {
        let reader = self.reader().await;
        let mut query = ListQuery { limit: 10_000, ..Default::default() };
        let mut listed = Vec::new();
        loop {
            let page = reader.catalog().list(&query).await.unwrap();
            listed.extend(page.captures.iter().map(|c| (Uuid::parse_str(&c.capture_id).unwrap(), c.payload_len)));
            match page.next_cursor {
                Some(cursor) => query.cursor = Some(cursor),
                None => return listed,
            }
        }
    }

    fn committed_versions(&self) -> Vec<u64> {
        let text = self
            .server
            .query(&format!(
                "SELECT version FROM {}.cs_publishes WHERE catalog = '{}' ORDER BY version FORMAT TSV",
                self.config.catalog.database, self.config.catalog_name
            ))
            .unwrap();
        text.lines().map(|line| line.parse().unwrap()).collect()
    }

    /// Rows of this catalog in the table `cs_<table>` matching `filter`.
    fn count_rows(&self, table: &str, filter: &str) -> u64 {
        let sql = format!(
            "SELECT count() FROM {}.cs_{table} WHERE catalog = '{}' AND {filter} FORMAT TSV",
            self.config.catalog.database, self.config.catalog_name
        );
        self.server.query(&sql).unwrap().trim().parse().unwrap()
    }

    fn assert_versions_gapless(&self) {
        let versions = self.committed_versions();
        let gapless: Vec<u64> = (1..=versions.len() as u64).collect();
        assert_eq!(versions, gapless, "versions must be gapless and used once");
    }

    fn spool_pack_count(&self) -> usize {
        list_packs(&SpoolPaths::new(&self.spool_dir())).map(|packs| packs.len()).unwrap_or(0)
    }

    async fn bucket_objects(&self) -> Vec<(String, u64)> {
        use futures::TryStreamExt;
        let bucket = Bucket::from_config(&self.config).unwrap();
        let mut objects: Vec<_> = bucket.list_objects(None).try_collect().await.unwrap();
        objects.sort();
        objects
    }

    /// Wait until everything dropped so far is published: inbox empty, spool empty, all listed.
    async fn wait_for_drain(&self, producer: &Producer, within: Duration) {
        let started = Instant::now();
        loop {
            let inbox_empty = inbox_ids(&producer.stream).is_empty();
            let spool_empty = self.spool_pack_count() == 0;
            if inbox_empty && spool_empty && self.listed().await.len() >= producer.dropped.len() {
                return;
            }
            assert!(
                started.elapsed() < within,
                "not drained after {within:?}: inbox {}, spool packs {}, listed {} of {}",
                inbox_ids(&producer.stream).len(),
                self.spool_pack_count(),
                self.listed().await.len(),
                producer.dropped.len()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The end state every test wants (I1, I2, I4, I5): every dropped capture listed once, bytes identical, versions
    /// gapless, nothing owed, every object under the prefix in the catalog.
    async fn assert_complete(&self, producer: &Producer) {
        let listed = self.listed().await;
        let ids: Vec<Uuid> = listed.iter().map(|(id, _)| *id).collect();
        let unique: HashSet<Uuid> = ids.iter().copied().collect();
        assert_eq!(unique.len(), ids.len(), "a capture is listed twice");
        let dropped: HashSet<Uuid> = producer.dropped.keys().copied().collect();
        assert_eq!(unique, dropped, "listed captures differ from the dropped ones");
        let reader = self.reader().await;
        for (id, len) in &producer.dropped {
            let capture = reader.get(*id).await.unwrap().unwrap_or_else(|| panic!("{id} does not read back"));
            assert_eq!(capture.payload.len(), *len, "{id}: length");
            assert!(capture.payload == expected_payload(*id, *len), "{id}: bytes differ");
        }
        self.assert_versions_gapless();
        let owed = list_packs(&SpoolPaths::new(&self.spool_dir())).unwrap();
        assert!(owed.is_empty(), "packs left in the spool: {owed:?}");
        let (client, tables) = self.catalog().await;
        let catalog = CatalogReader::new(client, tables, &self.config.catalog_name);
        let committed: HashSet<String> =
            catalog.committed_packs().await.unwrap().into_iter().map(|pack| pack.object_key).collect();
        for (key, _) in self.bucket_objects().await {
            assert!(committed.contains(&key), "object {key} in the bucket has no catalog rows");
        }
    }
}

/// Drops files into the inbox as a well-behaved producer does: hidden temp name, then rename.
struct Producer {
    stream: PathBuf,
    dropped: BTreeMap<Uuid, usize>,
    sizes: Vec<usize>,
}

impl Producer {
    fn new(stream: PathBuf, sizes: Vec<usize>) -> Producer {
        Producer { stream, dropped: BTreeMap::new(), sizes }
    }

    fn drop_one(&mut self) {
        let id = Uuid::now_v7();
        let len = self.sizes[self.dropped.len() % self.sizes.len()];
        let temp = self.stream.join(format!(".{id}"));
        std::fs::write(&temp, expected_payload(id, len)).unwrap();
        std::fs::rename(&temp, self.stream.join(id.to_string())).unwrap();
        self.dropped.insert(id, len);
    }

    fn drop_many(&mut self, count: usize) {
        for _ in 0..count {
            self.drop_one();
        }
    }

    /// Drops a capture id again with other bytes, as a producer posting it again does. Only an id whose earlier file
    /// is gone from the inbox (captured: a file is unlinked only once its record is durable), so the posts reach the
    /// spool in the order they were made and the last one must be the capture in the end.
    fn post_again(&mut self, rng: &mut impl Rng) {
        let waiting = inbox_ids(&self.stream);
        let captured: Vec<Uuid> = self.dropped.keys().filter(|id| !waiting.contains(id)).copied().collect();
        if captured.is_empty() {
            return;
        }
        let id = captured[rng.random_range(0..captured.len())];
        let len = self.dropped[&id] + 1 + rng.random_range(0..100);
        let temp = self.stream.join(format!(".{id}"));
        std::fs::write(&temp, expected_payload(id, len)).unwrap();
        std::fs::rename(&temp, self.stream.join(id.to_string())).unwrap();
        self.dropped.insert(id, len);
    }
}

fn inbox_ids(stream: &Path) -> HashSet<Uuid> {
    std::fs::read_dir(stream)
        .map(|entries| {
            entries.filter_map(|entry| Uuid::parse_str(&entry.ok()?.file_name().to_string_lossy()).ok()).collect()
        })
        .unwrap_or_default()
}

/// 0 B to 8 MiB, mostly small.
fn mixed_sizes() -> Vec<usize> {
    let mut sizes = vec![0, 1, 100, 1000, 4096, 10_000, 65_536, 100_000];
    sizes.extend(std::iter::repeat_n(2000, 90));
    sizes.extend([1 << 20, 3 << 20, 8 << 20]);
    sizes
}

for_each_version!(
    two_thousand_mixed_captures_through_s3_are_listed_once_and_read_back_identical,
    flavor = "multi_thread"
);
async fn two_thousand_mixed_captures_through_s3_are_listed_once_and_read_back_identical(
    server: &'static ClickHouseServer,
) {
    let world = World::new(server, BucketKind::S3(common::s3::shared_s3()), false);
    let mut producer = Producer::new(world.inbox_stream(), mixed_sizes());
    let mut daemon = world.start(&[]);
    daemon.wait_for_log_async("capstore running", Duration::from_secs(30)).await;
    producer.drop_many(2000);
    world.wait_for_drain(&producer, Duration::from_secs(180)).await;
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
    world.assert_complete(&producer).await;
}

/// The end-to-end subset on Azure Blob (Azurite): captures of every size, packs larger than a part (block uploads),
/// published, listed once and read back identical, and `capstore verify` finds every pack whole in the container.
#[tokio::test(flavor = "multi_thread")]
async fn captures_through_azure_blob_are_published_read_back_identical_and_verify() {
    let world =
        World::new(common::clickhouse::shared_server(), BucketKind::Azure(common::azurite::shared_azurite()), false);
    let mut producer = Producer::new(world.inbox_stream(), mixed_sizes());
    let mut daemon = world.start(&[]);
    daemon.wait_for_log_async("capstore running", Duration::from_secs(30)).await;
    producer.drop_many(300);
    world.wait_for_drain(&producer, Duration::from_secs(120)).await;
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
    world.assert_complete(&producer).await;
    let largest = world.bucket_objects().await.into_iter().map(|(_, size)| size).max().unwrap();
    assert!(largest > 5 << 20, "no pack larger than the 5 MiB part size: {largest}");
    let verify = world.env.command().args(["verify", "--json"]).output().unwrap();
    let report: serde_json::Value = serde_json::from_slice(&verify.stdout)
        .unwrap_or_else(|error| panic!("{error}: {}", String::from_utf8_lossy(&verify.stderr)));
    assert!(verify.status.success(), "{report}");
    assert!(
        report["checked_packs"].as_u64().unwrap() > 0 && report["problems"].as_array().unwrap().is_empty(),
        "{report}"
    );
}

// About 2.5 minutes each: the oldest and the newest release (the catalog statements it crashes between are the same).
for_each_version!(
    crash_matrix_sigkill_at_random_and_named_points_then_one_clean_run,
    flavor = "multi_thread",
    versions = [v18_16 => V18_16, v26_9 => V26_9]
);
async fn crash_matrix_sigkill_at_random_and_named_points_then_one_clean_run(server: &'static ClickHouseServer) {
    let world = World::new(server, BucketKind::File, false);
    let mut producer = Producer::new(world.inbox_stream(), vec![0, 10, 1000, 20_000, 300_000]);
    let mut rng = rand::rng();
    for round in 0..30 {
        let daemon = world.start(&[]);
        let kill_at = Instant::now() + Duration::from_millis(rng.random_range(100..1500));
        while Instant::now() < kill_at {
            producer.drop_many(5);
            // Some ids posted again, before or after their first post is published, with other bytes: each must be
            // listed once in the end, reading back its last post (I2).
            producer.post_again(&mut rng);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        daemon.kill();
        assert!(round < 30);
    }
    for point in [
        "after_append_before_ack",
        "after_seal",
        "after_intents_before_upload",
        "mid_upload",
        "after_upload_before_rename",
        "after_publish_before_delete",
    ] {
        let mut daemon = world.start(&[("CAPSTORE_FAILPOINTS", point)]);
        let started = Instant::now();
        let status = loop {
            producer.drop_many(3);
            if let Some(status) = daemon.child_mut().try_wait().unwrap() {
                break status;
            }
            assert!(started.elapsed() < Duration::from_secs(60), "failpoint {point} never reached:\n{}", daemon.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(daemon.log().contains(&format!("failpoint {point} reached")), "{point}: {status}\n{}", daemon.log());
    }
    let daemon = world.start(&[]);
    world.wait_for_drain(&producer, Duration::from_secs(120)).await;
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
    world.assert_complete(&producer).await;
}

for_each_version!(
    a_clickhouse_cut_of_three_ttls_never_stops_ingest_and_uploads_nothing_without_the_lease,
    flavor = "multi_thread"
);
async fn a_clickhouse_cut_of_three_ttls_never_stops_ingest_and_uploads_nothing_without_the_lease(
    server: &'static ClickHouseServer,
) {
    let world = World::new(server, BucketKind::File, true);
    let proxy = world.proxy.as_ref().unwrap();
    let mut producer = Producer::new(world.inbox_stream(), vec![100, 5000, 50_000]);
    let mut daemon = world.start(&[]);
    daemon.wait_for_log_async("capstore running", Duration::from_secs(30)).await;
    producer.drop_many(50);
    world.wait_for_drain(&producer, Duration::from_secs(60)).await;

    proxy.cut();
    let cut_started = Instant::now();
    // Once the lease's local deadline has passed, nothing may be uploaded until the cut ends.
    let mut objects_at_lease_end = None;
    while cut_started.elapsed() < TTL * 3 {
        producer.drop_many(5);
        tokio::time::sleep(Duration::from_millis(100)).await;
        if objects_at_lease_end.is_none() && cut_started.elapsed() > TTL {
            objects_at_lease_end = Some(world.bucket_objects().await.len());
        }
        let waiting = inbox_ids(&producer.stream).len();
        assert!(waiting < 200, "ingest stopped during the cut: {waiting} files waiting");
    }
    let objects_at_cut_end = world.bucket_objects().await.len();
    assert_eq!(Some(objects_at_cut_end), objects_at_lease_end, "packs were uploaded without the lease");
    assert!(world.spool_pack_count() > 0, "captures kept arriving, so the spool must hold packs");
    proxy.pass();
    world.wait_for_drain(&producer, Duration::from_secs(60)).await;
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "no latch after a cut: {log}");
    assert!(!log.contains("latched"), "{log}");
    world.assert_complete(&producer).await;
}

for_each_version!(
    rows_sent_by_a_daemon_killed_before_their_commit_stay_below_what_the_next_start_publishes,
    flavor = "multi_thread"
);
async fn rows_sent_by_a_daemon_killed_before_their_commit_stay_below_what_the_next_start_publishes(
    server: &'static ClickHouseServer,
) {
    let world = World::new(server, BucketKind::File, true);
    let proxy = world.proxy.as_ref().unwrap();
    let (database, name) = (&world.config.catalog.database, &world.config.catalog_name);
    let attempts_at_1 = || {
        let sql = format!(
            "SELECT DISTINCT publish_id FROM {database}.cs_by_version WHERE catalog = '{name}' AND version = 1 \
             ORDER BY publish_id FORMAT TSV"
        );
        world.server.query(&sql).unwrap().lines().map(str::to_string).collect::<Vec<String>>()
    };
    let mut producer = Producer::new(world.inbox_stream(), vec![100, 5000]);
    // The inserts of `captures` rows land, and their replies are lost (the crate sends an INSERT's statement in the
    // URL: `captures(` is `captures%28` there), so nothing is committed.
    proxy.blackhole_replies_matching(&format!("{database}.cs_captures%28"));
    let mut daemon = world.start(&[]);
    daemon.wait_for_log_async("capstore running", Duration::from_secs(30)).await;
    producer.drop_many(5);
    let started = Instant::now();
    while attempts_at_1().is_empty() {
        assert!(started.elapsed() < Duration::from_secs(60), "no rows landed:\n{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Killed with rows sent and nothing committed: one of its inserts might still be on its way to the server.
    daemon.kill();
    let first_attempt = attempts_at_1();
    assert_eq!(first_attempt.len(), 1, "{first_attempt:?}");
    assert!(world.committed_versions().is_empty());
    proxy.pass();

    let daemon = world.start(&[]);
    world.wait_for_drain(&producer, Duration::from_secs(60)).await;
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
    // The next start's first publish followed another process's lease: it committed version 1 empty, and the
    // captures went to version 2 and on, above every row the killed daemon sent.
    assert!(log.contains("committing a version empty first"), "{log}");
    assert_eq!(attempts_at_1(), first_attempt, "version 1 holds no rows but the killed daemon's");
    assert_eq!(world.count_rows("publishes", "version = 1 AND captures = 0 AND packs = 0"), 1);
    // Committed rows only: on 18.16 (whole-second server clock, TTL 3 s) a fence may refuse a publish whose rows
    // are written, and its retry commits the same rows under a publish_id of its own.
    let committed_above_1 = format!(
        "version >= 2 AND (version, publish_id) IN (SELECT version, publish_id FROM {database}.cs_publishes \
         WHERE catalog = '{name}')"
    );
    assert_eq!(world.count_rows("by_version", &committed_above_1), producer.dropped.len() as u64, "{log}");

    // The killed daemon's insert lands once more, after the commit (a part newer than the committed rows), and a
    // merge keeps the last copy of each capture: the same rows, so every capture is still listed.
    let captures = format!("{database}.cs_captures");
    world
        .server
        .query(&format!(
            "INSERT INTO {captures} SELECT * FROM {captures} WHERE catalog = '{name}' AND version = 1 AND \
             publish_id = '{}'",
            first_attempt[0]
        ))
        .unwrap();
    world.server.query(&format!("OPTIMIZE TABLE {captures} FINAL")).unwrap();
    // (18.16 lists across streams from `by_time`, which its view filled with the copy too.)
    let kept = format!("SELECT count() FROM system.tables WHERE database = '{database}' AND name = 'cs_by_time'");
    if world.server.query(&kept).unwrap().trim() == "1" {
        world.server.query(&format!("OPTIMIZE TABLE {database}.cs_by_time FINAL")).unwrap();
    }
    world.assert_complete(&producer).await;
}

// A bucket fault: the catalog only has to be there, so the newest release only.
for_each_version!(an_s3_outage_under_load_retries_and_drains_after, flavor = "multi_thread", versions = [v26_9 => V26_9]);
async fn an_s3_outage_under_load_retries_and_drains_after(server: &'static ClickHouseServer) {
    // A server of its own: the outage must not reach the other tests.
    let s3 = common::s3::private_s3();
    let world = World::new(server, BucketKind::S3(&s3), false);
    let mut producer = Producer::new(world.inbox_stream(), vec![100, 5000, 200_000]);
    let mut daemon = world.start(&[]);
    daemon.wait_for_log_async("capstore running", Duration::from_secs(30)).await;
    producer.drop_many(30);
    s3.stop();
    let outage_started = Instant::now();
    while outage_started.elapsed() < Duration::from_secs(10) {
        producer.drop_many(5);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let spool_during_outage = world.spool_pack_count();
    s3.start();
    assert!(spool_during_outage > 0, "the spool must grow while the bucket is away");
    world.wait_for_drain(&producer, Duration::from_secs(90)).await;
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
    world.assert_complete(&producer).await;
}

for_each_version!(a_lost_spool_is_repaired_from_upload_intents_without_a_listing, flavor = "multi_thread");
async fn a_lost_spool_is_repaired_from_upload_intents_without_a_listing(server: &'static ClickHouseServer) {
    let world = World::new(server, BucketKind::File, false);
    let mut producer = Producer::new(world.inbox_stream(), vec![100, 7000]);
    producer.drop_many(20);
    let mut daemon = world.start(&[("CAPSTORE_FAILPOINTS", "after_upload_before_rename")]);
    let started = Instant::now();
    while daemon.child_mut().try_wait().unwrap().is_none() {
        assert!(started.elapsed() < Duration::from_secs(60), "never uploaded:\n{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let uploaded = world.bucket_objects().await;
    assert!(!uploaded.is_empty(), "the failpoint fires after an upload");
    assert!(world.listed().await.is_empty(), "nothing was published before the crash");
    // The disk is lost: the spool is gone, with everything in it. What was still in the inbox is lost too.
    std::fs::remove_dir_all(world.spool_dir()).unwrap();
    // Objects no intent names: a start must not find them (it does not list the bucket); `capstore reconcile` does.
    let invalid_key = world.plant_invalid_object(&uploaded[0].0);
    let stray = world.plant_valid_pack(STRAY_DAY_NS).await;

    let mut daemon = world.start(&[]);
    daemon.wait_for_log_async("reconcile done", Duration::from_secs(60)).await;
    let log = daemon.log();
    assert!(log.contains("source=Intents"), "the start reconciled by intents:\n{log}");
    assert!(!log.contains("listing the bucket"), "the start did not list the bucket:\n{log}");
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
    assert!(!log.contains("not a valid pack"), "a start never reads objects no intent names:\n{log}");
    let listed = world.listed().await;
    assert!(!listed.is_empty(), "the uploaded packs were published from their intents");
    let reader = world.reader().await;
    for (id, len) in &listed {
        let capture = reader.get(*id).await.unwrap().unwrap();
        assert_eq!(capture.payload, expected_payload(*id, *len as usize));
        assert_eq!(producer.dropped.get(id), Some(&(*len as usize)), "only the producer's captures so far");
    }

    // The explicit repair, limited to the stray pack's day: publishes it, never sees the invalid object (today's).
    let day = humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_nanos(STRAY_DAY_NS));
    let day = &day.to_string()[..10];
    let report = world.reconcile(&["--since", day, "--until", day], 0);
    assert_eq!((report["examined"].as_u64(), report["published"].as_u64()), (Some(1), Some(1)), "{report}");
    let reader = world.reader().await;
    for (meta, payload) in &stray {
        assert_eq!(&reader.get(meta.capture_id).await.unwrap().unwrap().payload, payload);
    }
    // The whole prefix: the invalid object is reported (exit 1) and nothing is published twice.
    let report = world.reconcile(&[], 1);
    assert_eq!(report["published"].as_u64(), Some(0), "{report}");
    assert_eq!(report["invalid"], serde_json::json!([invalid_key]), "{report}");
    assert_eq!(world.listed().await.len(), listed.len() + stray.len());
    world.assert_versions_gapless();
}

// The order is the bucket listing's and reconcile's own: one catalog release, and S3, which lists in key order.
for_each_version!(
    reconcile_publishes_the_packs_it_finds_in_pack_order_across_its_whole_listing,
    flavor = "multi_thread",
    versions = [v18_16 => V18_16]
);
async fn reconcile_publishes_the_packs_it_finds_in_pack_order_across_its_whole_listing(
    server: &'static ClickHouseServer,
) {
    let world = World::new(server, BucketKind::S3(common::s3::shared_s3()), false);
    let mut daemon = world.start(&[]);
    daemon.wait_for_log_async("capstore running", Duration::from_secs(30)).await;
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
    // A capture posted twice, and the spool lost before either pack was published. The first post's pack was made
    // first, but its capture is a day later, so its key (dated by capture day) is listed after the second's; 2,000
    // objects not named like packs between the two keys put them in different slices of the listing.
    let c = Uuid::now_v7();
    let capture = |captured_at_ns: u64, body: &str| {
        let meta = capstore::capture::CaptureMeta {
            capture_id: c,
            stream: "reposted".into(),
            captured_at_ns,
            labels: Default::default(),
            content_type: None,
            source_name: None,
        };
        (meta, body.as_bytes().to_vec())
    };
    let (first_pack, second_pack) = (Uuid::now_v7(), Uuid::now_v7());
    let first_key = world.plant_pack(first_pack, vec![capture(STRAY_DAY_NS + 86_400_000_000_000, "c, first")]).await;
    let second_key = world.plant_pack(second_pack, vec![capture(STRAY_DAY_NS, "c, again")]).await;
    assert!(second_key < first_key, "{second_key} is listed before {first_key}");
    let bucket = Bucket::from_config(&world.config).unwrap();
    let day = second_key.rsplit_once('/').unwrap().0.to_string();
    use futures::StreamExt;
    futures::stream::iter(0..2000)
        .for_each_concurrent(32, |n| {
            let (store, key) = (bucket.store().clone(), format!("{day}/zz-not-a-pack-{n:04}"));
            async move {
                store.put(&key.as_str().into(), b"x".to_vec().into()).await.unwrap();
            }
        })
        .await;

    let report = world.reconcile(&[], 1);
    assert_eq!((report["published"].as_u64(), report["invalid_count"].as_u64()), (Some(2), Some(2000)), "{report}");
    let reader = world.reader().await;
    let capture = reader.get(c).await.unwrap().unwrap();
    assert_eq!(capture.payload, b"c, again", "the later pack's post is the capture");
    world.assert_versions_gapless();
}

for_each_version!(a_start_reads_only_the_intents_since_the_newest_mark, flavor = "multi_thread");
async fn a_start_reads_only_the_intents_since_the_newest_mark(server: &'static ClickHouseServer) {
    let world = World::new(server, BucketKind::File, false);
    let mut producer = Producer::new(world.inbox_stream(), vec![100, 5000]);
    let daemon = world.start(&[("CAPSTORE_SPOOL_PACK_MAX_AGE", "200ms")]);
    // Rounds one after another: each drop is sealed, uploaded and published before the next.
    for _ in 0..6 {
        producer.drop_many(3);
        world.wait_for_drain(&producer, Duration::from_secs(60)).await;
    }
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
    let intents: u64 = world.count_rows("intents", "kind = 'pack'");
    assert!(intents >= 6, "one intent per uploaded pack: {intents}");

    let mut daemon = world.start(&[]);
    daemon.wait_for_log_async("capstore running", Duration::from_secs(30)).await;
    let status_file = world.spool_dir().join("status.json");
    let report = loop {
        let status: serde_json::Value =
            std::fs::read(&status_file).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok()).unwrap_or_default();
        if !status["reconcile"].is_null() {
            break status["reconcile"].clone();
        }
        assert!(daemon.child_mut().try_wait().unwrap().is_none(), "{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    daemon.terminate();
    assert_eq!(report["source"], "intents", "{report}");
    let examined = report["examined"].as_u64().unwrap();
    // The newest mark came with the last round's intents: only those are read again, all published already.
    assert!(examined >= 1 && examined < intents, "read {examined} of {intents} intents: {report}");
    assert_eq!(report["already_published"].as_u64(), Some(examined), "{report}");
    assert_eq!(report["published"].as_u64(), Some(0), "{report}");
}

for_each_version!(
    a_pack_uploaded_while_an_older_one_fails_waits_for_it_so_a_re_posted_id_ends_as_its_last_post,
    flavor = "multi_thread",
    versions = [v18_16 => V18_16]
);
async fn a_pack_uploaded_while_an_older_one_fails_waits_for_it_so_a_re_posted_id_ends_as_its_last_post(
    server: &'static ClickHouseServer,
) {
    let world = World::new(server, BucketKind::File, false);
    let paths = SpoolPaths::new(&world.spool_dir());
    // Two sealed packs, as the spool leaves them when the catalog was away: x posted, then posted again with other
    // bytes. Their captures are a day apart, so their objects go to different day directories.
    let (x, other) = (Uuid::now_v7(), Uuid::now_v7());
    let first_day_ns = 1_704_067_200 * 1_000_000_000; // 2024-01-01T00:00:00Z
    let seal = |captured_at_ns, captures: &[(Uuid, &[u8])]| {
        common::packs::seal_into_spool(&paths, "cam/1", captured_at_ns, captures)
    };
    let older = seal(first_day_ns, &[(x, b"first post"), (other, b"other")]);
    let newer = seal(first_day_ns + 86_400 * 1_000_000_000, &[(x, b"second post")]);
    let bucket = Bucket::from_config(&world.config).unwrap();
    let newer_key = bucket.pack_key(&newer).to_string();
    // A file where the older pack's day directory goes: its upload fails (retried) until the file is removed.
    let older_key = bucket.pack_key(&older).to_string();
    let blocker = world.dir.path().join("bucket").join(older_key.rsplit_once('/').unwrap().0);
    std::fs::create_dir_all(blocker.parent().unwrap()).unwrap();
    std::fs::write(&blocker, b"not a directory").unwrap();

    let mut daemon = world.start(&[("CAPSTORE_UPLOAD_CONCURRENCY", "2")]);
    let status_file = world.spool_dir().join("status.json");
    let upload_failures = || {
        let status: serde_json::Value =
            std::fs::read(&status_file).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok()).unwrap_or_default();
        status["pipeline"]["upload_failures"].as_u64().unwrap_or(0)
    };
    // A second failed round: an upload round runs only once nothing is owed, so had the newer pack become
    // `.uploaded` in the first round, it would have been published before this one.
    let deadline = Instant::now() + Duration::from_secs(60);
    while upload_failures() < 2 {
        assert!(Instant::now() < deadline, "the older upload never failed twice: {}", daemon.log());
        assert!(daemon.exited().is_none(), "{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let objects: Vec<String> = world.bucket_objects().await.into_iter().map(|(key, _)| key).collect();
    assert!(objects.contains(&newer_key), "the newer pack was uploaded in the meantime: {objects:?}");
    assert_eq!(world.committed_versions(), Vec::<u64>::new(), "nothing is published while the older pack is not");
    let states: Vec<_> = list_packs(&paths).unwrap().into_iter().map(|pack| (pack.pack_id, pack.state)).collect();
    let sealed = capstore::spool::PackState::Sealed;
    assert_eq!(states, [(older.pack_id, sealed), (newer.pack_id, sealed)]);

    std::fs::remove_file(&blocker).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while world.spool_pack_count() > 0 {
        assert!(Instant::now() < deadline, "not published after the bucket healed: {}", daemon.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
    // (Both go in the next round and are published together: the publish keeps x's last post.)
    world.assert_versions_gapless();
    let reader = world.reader().await;
    assert_eq!(reader.get(x).await.unwrap().expect("x is published").payload, b"second post");
    let mut listed: Vec<Uuid> = world.listed().await.into_iter().map(|(id, _)| id).collect();
    listed.sort();
    let mut expected = vec![x, other];
    expected.sort();
    assert_eq!(listed, expected, "x once, at its last post");
}

/// A day long before the tests run, for a stray pack's key.
const STRAY_DAY_NS: u64 = 1_577_934_000 * 1_000_000_000; // 2020-01-02T03:00:00Z

impl World {
    /// An object named like a pack in the directory of `beside`, holding no pack. Returns its key.
    fn plant_invalid_object(&self, beside: &str) -> String {
        let key = format!("{}/{}.cpk", beside.rsplit_once('/').unwrap().0, Uuid::now_v7());
        std::fs::write(self.dir.path().join("bucket").join(&key), b"this is not a pack").unwrap();
        key
    }

    /// The pack `pack_id` of `captures` put straight into the bucket (no intent, no catalog row); returns its key.
    async fn plant_pack(&self, pack_id: Uuid, captures: Vec<(capstore::capture::CaptureMeta, Vec<u8>)>) -> String {
        let first_captured_at_ns = captures.iter().map(|(meta, _)| meta.captured_at_ns).min().unwrap();
        let bucket = Bucket::from_config(&self.config).unwrap();
        let scratch = self.dir.path().join(format!("{pack_id}.cpk"));
        let written = common::packs::write_pack(&scratch, pack_id, first_captured_at_ns, captures);
        let key = bucket.pack_key(&written.summary);
        bucket.store().put(&key, std::fs::read(&scratch).unwrap().into()).await.unwrap();
        key.to_string()
    }

    /// A valid pack put straight into the bucket (no intent, no catalog row), its first capture at `captured_at_ns`.
    async fn plant_valid_pack(&self, captured_at_ns: u64) -> Vec<(capstore::capture::CaptureMeta, Vec<u8>)> {
        let captures: Vec<_> = (0..3u64)
            .map(|index| {
                let meta = capstore::capture::CaptureMeta {
                    capture_id: Uuid::now_v7(),
                    stream: "stray".into(),
                    captured_at_ns: captured_at_ns + index,
                    labels: Default::default(),
                    content_type: None,
                    source_name: None,
                };
                (meta, format!("stray capture {index}").into_bytes())
            })
            .collect();
        self.plant_pack(Uuid::now_v7(), captures.clone()).await;
        captures
    }

    /// Runs `capstore reconcile ARGS` (the daemon stopped) and returns its JSON report; asserts its exit code.
    fn reconcile(&self, args: &[&str], expected_code: i32) -> serde_json::Value {
        let output = self.env.command().arg("reconcile").args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(expected_code), "reconcile {args:?}: {stderr}");
        serde_json::from_slice(&output.stdout).unwrap_or_else(|error| panic!("{error}: {stderr}"))
    }
}

for_each_version!(sigterm_under_load_exits_cleanly_and_frees_the_lease, flavor = "multi_thread");
async fn sigterm_under_load_exits_cleanly_and_frees_the_lease(server: &'static ClickHouseServer) {
    let world = World::new(server, BucketKind::File, false);
    let mut producer = Producer::new(world.inbox_stream(), vec![100, 5000, 100_000]);
    let mut daemon = world.start(&[]);
    daemon.wait_for_log_async("capstore running", Duration::from_secs(30)).await;
    for _ in 0..20 {
        producer.drop_many(10);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (code, took, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
    assert!(took <= world.config.shutdown_grace.0 + Duration::from_secs(5), "stop took {took:?}");
    assert!(log.contains("lease released"), "{log}");
    let (client, tables) = world.catalog().await;
    let timings = LeaseTimings::from_config(&world.config.lease, &client);
    let head = LeaseStore::new(client, &tables, &world.config.catalog_name, timings).read_head().await.unwrap();
    assert!(!head.is_live(), "the lease is tombstoned: {head:?}");
    // Another identity (a new spool) with no start wait takes the lease at once.
    let other_spool = world.dir.path().join("other-spool");
    let mut daemon =
        world.start(&[("CAPSTORE_SPOOL_DIR", other_spool.to_str().unwrap()), ("CAPSTORE_LEASE_START_WAIT", "0s")]);
    daemon.wait_for_log_async("capstore running", Duration::from_secs(30)).await;
    assert!(daemon.child_mut().try_wait().unwrap().is_none(), "the new holder must not be refused");
    let (code, _, _) = daemon.terminate();
    assert_eq!(code, 0);
    // Whatever did not fit in the grace is still in the first spool; a last run publishes it.
    let daemon = world.start(&[]);
    world.wait_for_drain(&producer, Duration::from_secs(60)).await;
    daemon.terminate();
    world.assert_complete(&producer).await;
}
