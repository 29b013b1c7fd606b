//! The publisher lease and the fenced publish against a real ClickHouse (started by the harness), with a TCP fault
//! proxy in front of it where a fault is injected. Timings: TTL 3 s, publish timeout 1 s (the issue's scenario timings).

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use capstore::capture::CaptureMeta;
use capstore::catalog::lease::{
    ClaimOutcome, Identity, LeaseKeeper, LeaseState, LeaseStore, LeaseTimings, PublishPermit, RunningLease, StartError,
};
use capstore::catalog::publish::{PackDescriptor, PublishError, PublishOutcome, Publisher};
use capstore::catalog::query::{CatalogReader, ListQuery, Page};
use capstore::catalog::{CatalogClient, ErrorKind, Tables};
use capstore::config::{Config, HumanDuration};
use capstore::pack::{IndexEntry, PackSummary};
use common::clickhouse::ClickHouseServer;
use common::daemon::DaemonEnv;
use common::proxy::FaultProxy;
use tokio::sync::watch;
use uuid::Uuid;

const TTL: Duration = Duration::from_secs(3);

fn config_for(url: &str, database: &str, catalog: &str) -> Config {
    let mut config = Config { catalog_name: catalog.into(), ..Config::default() };
    config.catalog.url = url.into();
    config.catalog.database = database.into();
    config.catalog.table_prefix = "cs".into();
    config.catalog.request_timeout = HumanDuration(Duration::from_secs(2));
    config.lease.ttl = HumanDuration(TTL);
    config.lease.publish_timeout = HumanDuration(Duration::from_secs(1));
    config.lease.clock_skew = HumanDuration(Duration::ZERO);
    config.validate().expect("test config is valid");
    config
}

/// A catalog database of its own, reached directly or through a fault proxy.
struct Catalog {
    server: &'static ClickHouseServer,
    config: Config,
    client: CatalogClient,
    tables: Tables,
    proxy: Option<FaultProxy>,
}

async fn catalog(server: &'static ClickHouseServer, with_proxy: bool) -> Catalog {
    catalog_with(server, with_proxy, |_| {}).await
}

/// A catalog whose config `adjust` changes from the tests' own (and is validated again).
async fn catalog_with(
    server: &'static ClickHouseServer,
    with_proxy: bool,
    adjust: impl FnOnce(&mut Config),
) -> Catalog {
    let database = server.fresh_database("lease");
    let proxy = with_proxy.then(|| FaultProxy::start(server.http_addr));
    let url = proxy.as_ref().map_or_else(|| server.url(), |proxy| proxy.url());
    let mut config = config_for(&url, &database, &format!("cat-{}", rand::random::<u32>()));
    adjust(&mut config);
    config.validate().expect("adjusted test config is valid");
    let (client, tables) = capstore::catalog::connect(&config).await.expect("catalog schema");
    Catalog { server, config, client, tables, proxy }
}

impl Catalog {
    /// The highest schema version stamped into the catalog's tables.
    fn stamped_schema(&self) -> u32 {
        let sql = format!("SELECT max(version) FROM {} WHERE component = 'catalog' FORMAT TSV", self.tables.schema);
        self.server.query(&sql).unwrap().trim().parse().unwrap()
    }

    fn timings(&self) -> LeaseTimings {
        LeaseTimings::from_config(&self.config.lease, &self.client)
    }

    fn store(&self, catalog_name: &str) -> LeaseStore {
        LeaseStore::new(self.client.clone(), &self.tables, catalog_name, self.timings())
    }

    fn keeper(&self, identity: Identity) -> LeaseKeeper {
        LeaseKeeper::new(self.store(&self.config.catalog_name), identity, &self.config.catalog_name)
    }

    fn reader(&self) -> CatalogReader {
        CatalogReader::new(self.client.clone(), self.tables.clone(), &self.config.catalog_name)
    }

    /// A capture row written straight into `captures` (as a publish's step 3 does; in a pack of its own: a row with
    /// no pack is a deletion), over a direct connection.
    fn insert_capture_row(&self, capture: Uuid, stream: &str, captured_at_ns: u64, version: u64, publish_id: Uuid) {
        self.server
            .query(&format!(
                "INSERT INTO {} (catalog, stream, captured_at_ns, capture_id, pack_id, object_key, version, publish_id) \
                 VALUES ('{}', '{stream}', {captured_at_ns}, '{capture}', '{}', 'packs/{capture}.cpk', {version}, \
                 '{publish_id}')",
                self.tables.captures,
                self.config.catalog_name,
                Uuid::now_v7()
            ))
            .unwrap();
    }

    /// `count` capture rows of stream `s/1` at `version` under `publish_id`, written on the server from
    /// `numbers(count)`, over a direct connection: the n-th (`number`) captured at `captured_at`, labelled
    /// `labels` (`[keys], [values]`), both expressions of `number`.
    fn insert_numbered_captures(&self, count: u64, captured_at: &str, labels: &str, version: u64, publish_id: Uuid) {
        self.server
            .query(&format!(
                "INSERT INTO {} (catalog, stream, captured_at_ns, capture_id, pack_id, version, publish_id, \
                 label_keys, label_values) SELECT '{}', 's/1', {captured_at}, toString(generateUUIDv4()), 'p', \
                 {version}, '{publish_id}', {labels} FROM numbers({count})",
                self.tables.captures, self.config.catalog_name
            ))
            .unwrap();
    }

    /// A row of `horizons` (not its commit), over a direct connection.
    fn insert_horizon_row(&self, version: u64, before_ns: u64, publish_id: Uuid) {
        self.server
            .query(&format!(
                "INSERT INTO {} (catalog, before_ns, version, publish_id, written_at_ms) VALUES ('{}', {before_ns}, \
                 {version}, '{publish_id}', 0)",
                self.tables.horizons, self.config.catalog_name
            ))
            .unwrap();
    }

    /// A count of the statements sent through the proxy from now on.
    fn statements(&self) -> Arc<AtomicU64> {
        self.proxy.as_ref().expect("a catalog behind a proxy").count_requests_containing("POST /")
    }

    /// The `publishes` row that commits `(version, publish_id)`, over a direct connection.
    fn commit_row(&self, version: u64, publish_id: Uuid) {
        self.server
            .query(&format!(
                "INSERT INTO {} (catalog, version, publish_id) VALUES ('{}', {version}, '{publish_id}')",
                self.tables.publishes, self.config.catalog_name
            ))
            .unwrap();
    }

    /// Rows of `publishes` for this catalog, read over a direct connection (not through the proxy).
    fn committed_versions(&self) -> Vec<u64> {
        let text = self
            .server
            .query(&format!(
                "SELECT version FROM {} WHERE catalog = '{}' ORDER BY version FORMAT TSV",
                self.tables.publishes, self.config.catalog_name
            ))
            .unwrap();
        text.lines().map(|line| line.parse().unwrap()).collect()
    }
}

fn identity(host: &str) -> Identity {
    Identity { spool_id: Uuid::new_v4(), host: host.into(), pid: rand::random::<u16>() as u32 }
}

fn pack(captures: &[(Uuid, &str, u64)]) -> PackDescriptor {
    let pack_id = Uuid::now_v7();
    let mut offset = 40;
    let entries: Vec<IndexEntry> = captures
        .iter()
        .map(|(capture_id, stream, captured_at_ns)| {
            let entry = IndexEntry {
                meta: CaptureMeta {
                    capture_id: *capture_id,
                    stream: stream.to_string(),
                    captured_at_ns: *captured_at_ns,
                    labels: BTreeMap::from([("site".to_string(), "berlin".to_string())]),
                    content_type: None,
                    source_name: None,
                },
                record_offset: offset,
                record_len: 100,
                payload_offset: offset + 60,
                payload_len: 40,
                crc32c: 7,
            };
            offset += 100;
            entry
        })
        .collect();
    PackDescriptor {
        summary: PackSummary {
            pack_id,
            bytes: offset + 200,
            records: entries.len() as u64,
            sha256_hex: "00".repeat(32),
            first_captured_at_ns: captures.iter().map(|c| c.2).min().unwrap_or(0),
            last_captured_at_ns: captures.iter().map(|c| c.2).max().unwrap_or(0),
            created_at_ns: 1,
        },
        object_key: format!("prefix/test/{pack_id}.cpk"),
        entries,
    }
}

fn one_capture_pack() -> PackDescriptor {
    pack(&[(Uuid::now_v7(), "s", capstore::util::now_ns())])
}

/// A publish retried on a refused fence, as the daemon's loop does (18.16's whole-second lease times).
macro_rules! retried {
    ($call:expr) => {
        loop {
            match $call {
                Ok(outcome) => break outcome,
                Err(PublishError::NotCommitted | PublishError::NoLease) => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(other) => panic!("{other}"),
            }
        }
    };
}

/// Returns once `handle`'s lease is no longer held, during a cut of the catalog of up to three TTLs.
async fn until_lease_lost_in_the_cut(handle: &capstore::catalog::lease::LeaseHandle) {
    let mut states = handle.subscribe();
    let lost = tokio::time::timeout(TTL * 3, async {
        while *states.borrow_and_update() == LeaseState::Held {
            states.changed().await.unwrap();
        }
    })
    .await;
    assert!(lost.is_ok(), "the lease was never lost during the cut: {:?}", handle.status());
}

async fn wait_for_state(handle: &capstore::catalog::lease::LeaseHandle, wanted: LeaseState, within: Duration) {
    let mut states = handle.subscribe();
    let waited = tokio::time::timeout(within, async {
        while *states.borrow_and_update() != wanted {
            states.changed().await.unwrap();
        }
    })
    .await;
    assert!(waited.is_ok(), "lease never reached {wanted:?}; status {:?}", handle.status());
}

for_each_version!(claim_renew_release_refusal_and_takeover);
async fn claim_renew_release_refusal_and_takeover(server: &'static ClickHouseServer) {
    let catalog = catalog(server, false).await;
    let store = catalog.store(&catalog.config.catalog_name);
    let (alice, bob, carol) = (identity("alice"), identity("bob"), identity("carol"));
    let (alice_id, bob_id, carol_id) = ("lease-a".to_string(), "lease-b".to_string(), "lease-c".to_string());

    let ClaimOutcome::Held { term: first, .. } = store.claim(&alice_id, &alice).await.unwrap() else { panic!() };
    assert_eq!(first, 1);
    let ClaimOutcome::Held { term: renewed, .. } = store.renew(&alice_id, &alice, first).await.unwrap() else {
        panic!()
    };
    assert_eq!(renewed, 2);

    match store.claim(&bob_id, &bob).await.unwrap() {
        ClaimOutcome::Refused { holder, time_left } => {
            assert_eq!(holder, alice.holder(), "the refusal names the holder");
            assert!(time_left > Duration::from_millis(500) && time_left <= TTL, "time left {time_left:?}");
        }
        other => panic!("bob must be refused while alice holds: {other:?}"),
    }

    store.release(&alice_id, &alice, renewed).await.unwrap();
    let ClaimOutcome::Held { term: bob_term, .. } = store.claim(&bob_id, &bob).await.unwrap() else {
        panic!("a released lease is free at once")
    };
    assert_eq!(bob_term, 3);

    // A late tombstone of alice's, at her own term, never revokes bob's later term.
    store.release(&alice_id, &alice, renewed).await.unwrap();
    let head = store.read_head().await.unwrap();
    assert!(head.is_live() && head.entries[0].holder == bob.holder(), "{head:?}");
    assert!(matches!(store.renew(&bob_id, &bob, bob_term).await.unwrap(), ClaimOutcome::Held { term: 4, .. }));

    // Takeover after expiry: bob stops renewing; carol gets the next term once it has expired.
    let started = Instant::now();
    let carol_term = loop {
        match store.claim(&carol_id, &carol).await.unwrap() {
            ClaimOutcome::Held { term, .. } => break term,
            ClaimOutcome::Refused { .. } | ClaimOutcome::Raced => {
                assert!(started.elapsed() < TTL * 3, "bob's lease never expired");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(carol_term, 5);
    assert!(started.elapsed() >= Duration::from_millis(1500), "carol must wait for bob's expiry");
}

for_each_version!(concurrent_claimers_never_overlap);
async fn concurrent_claimers_never_overlap(server: &'static ClickHouseServer) {
    // No lease here is waited out, so the lease's timings can be roomy: eight claims at once on a loaded machine
    // (chDB answers them one after another) may take past the tests' 1 s statement cap, and a claim cut off by it has
    // no outcome to compare.
    let catalog = catalog_with(server, false, |config| {
        config.lease.ttl = HumanDuration(Duration::from_secs(30));
        config.lease.publish_timeout = HumanDuration(Duration::from_secs(10));
        config.catalog.request_timeout = HumanDuration(Duration::from_secs(20));
    })
    .await;
    let mut rounds_with_holder = 0;
    let mut contested_after_hold = 0;
    for round in 0..50 {
        let name = format!("race-{round}-{}", rand::random::<u32>());
        let mut tasks = Vec::new();
        for claimer in 0..8 {
            let store = catalog.store(&name);
            tasks.push(tokio::spawn(async move {
                let who = identity(&format!("claimer-{claimer}"));
                let lease_id = format!("lease-{claimer}");
                let started = Instant::now();
                let outcome = store.claim(&lease_id, &who).await.unwrap();
                (lease_id, started, outcome)
            }));
        }
        let mut holders = Vec::new();
        for task in tasks {
            let (lease_id, started, outcome) = task.await.unwrap();
            if let ClaimOutcome::Held { term, deadline, .. } = outcome {
                holders.push((lease_id, term, started, deadline));
            }
        }
        assert!(holders.len() <= 1, "round {round}: two holders with overlapping deadlines: {holders:?}");
        if let Some((lease_id, term, _, _)) = holders.first() {
            rounds_with_holder += 1;
            // The head is the holder's term. A rival's row whose condition was read before the holder's row landed
            // can still land at that term after the holder's read-back: the term is then contested, the rival
            // (who reads back two rows) abandons, and the fence (exactly one lease_id at the head) keeps the holder
            // from publishing until its next renewal makes the head its own again.
            let store = catalog.store(&name);
            let head = store.read_head().await.unwrap();
            assert_eq!(head.term, *term, "round {round}: {head:?}");
            assert!(head.entries.iter().any(|entry| &entry.lease_id == lease_id), "round {round}: {head:?}");
            if head.entries.len() > 1 {
                contested_after_hold += 1;
            }
        }
    }
    assert!(rounds_with_holder > 0, "no round produced a holder at all");
    eprintln!(
        "{rounds_with_holder} of 50 rounds produced a holder; {contested_after_hold} were contested after the hold"
    );
}

for_each_version!(a_paused_holder_lands_nothing_after_a_takeover_and_an_empty_table_fails_the_fence);
async fn a_paused_holder_lands_nothing_after_a_takeover_and_an_empty_table_fails_the_fence(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, false).await;
    let paused = catalog.keeper(identity("paused"));
    let (_shutdown_tx, mut shutdown_rx) = watch::channel(false);
    paused.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
    let handle = paused.handle();
    let publisher =
        Publisher::new(catalog.client.clone(), catalog.tables.clone(), &catalog.config.catalog_name, handle.clone());
    // One publish while its keeper renews (retried on a refused fence, as the daemon's loop does: 18.16's
    // whole-second lease times).
    let (_keeper_shutdown_tx, keeper_shutdown_rx) = watch::channel(false);
    let keeper_task = tokio::spawn(paused.run(keeper_shutdown_rx));
    let published = loop {
        match publisher.publish_batch(&[one_capture_pack()]).await {
            Err(PublishError::NotCommitted | PublishError::NoLease) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => break other.unwrap(),
        }
    };
    assert!(matches!(published, PublishOutcome::Committed { version: 1, .. }), "{published:?}");
    let stale_permit = loop {
        match handle.permit() {
            Some(permit) => break permit,
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    // Then it is paused: its keeper renews nothing more (and releases nothing); a rival waits for the expiry and
    // takes over.
    keeper_task.abort();
    let rival = catalog.keeper(identity("rival"));
    rival.acquire_at_start(TTL * 3, &mut shutdown_rx).await.unwrap();

    // Its next version follows its own last commit: the rows are sent, and the fence refuses the commit.
    let result = publisher.publish_with_permit(&stale_permit, &[one_capture_pack()]).await;
    assert!(matches!(result, Err(PublishError::NotCommitted)), "{result:?}");
    assert_eq!(catalog.committed_versions(), vec![1], "the paused holder's publish must land nothing");
    let page = catalog.reader().list(&ListQuery { limit: 10, ..Default::default() }).await.unwrap();
    assert_eq!(page.captures.len(), 1, "nothing of the paused publish is visible: {page:?}");
    // A version it would read from the watermark now, past its permit's deadline, is not used: nothing is sent.
    let fresh =
        Publisher::new(catalog.client.clone(), catalog.tables.clone(), &catalog.config.catalog_name, handle.clone());
    let result = fresh.publish_with_permit(&stale_permit, &[one_capture_pack()]).await;
    assert!(matches!(result, Err(PublishError::NoLease)), "{result:?}");
    let sent_at_2 = format!(
        "SELECT count() FROM {} WHERE catalog = '{}' AND version = 2 FORMAT TSV",
        catalog.tables.by_version, catalog.config.catalog_name
    );
    assert_eq!(catalog.server.query(&sent_at_2).unwrap().trim(), "1", "only the first stale publish's row");

    // A catalog name with no lease rows at all: the fence fails.
    let empty_name = format!("empty-{}", rand::random::<u32>());
    let store = catalog.store(&empty_name);
    let lease_id = "no-such-lease";
    let permit = PublishPermit {
        lease_id: lease_id.into(),
        tenure: 1,
        term: 1,
        holder: "nobody".into(),
        deadline: Instant::now() + TTL,
        fence: store.fence_condition(lease_id),
    };
    let keeper = LeaseKeeper::new(store, identity("nobody"), &empty_name);
    let publisher = Publisher::new(catalog.client.clone(), catalog.tables.clone(), &empty_name, keeper.handle());
    let result = publisher.publish_with_permit(&permit, &[one_capture_pack()]).await;
    assert!(matches!(result, Err(PublishError::NotCommitted)), "{result:?}");
}

for_each_version!(publish_and_read_back_with_dedup_labels_pagination_and_tailing);
async fn publish_and_read_back_with_dedup_labels_pagination_and_tailing(server: &'static ClickHouseServer) {
    let catalog = catalog(server, false).await;
    let keeper = catalog.keeper(identity("writer"));
    let (shutdown_tx, mut shutdown_rx) = watch::channel(false);
    keeper.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
    let handle = keeper.handle();
    let keeper_task = tokio::spawn(keeper.run(shutdown_rx));
    let publisher =
        Publisher::new(catalog.client.clone(), catalog.tables.clone(), &catalog.config.catalog_name, handle.clone());

    let retried = Uuid::now_v7();
    let ids: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    let first = pack(&[(ids[0], "cam/1", 100), (ids[1], "cam/1", 200), (retried, "cam/1", 300)]);
    let second = pack(&[(ids[2], "cam/1", 400), (ids[3], "cam/2", 500), (retried, "cam/1", 300)]);
    let mut versions = Vec::new();
    for batch in [vec![first.clone()], vec![second.clone()]] {
        let outcome = loop {
            match publisher.publish_batch(&batch).await {
                Ok(outcome) => break outcome,
                Err(PublishError::NotCommitted | PublishError::NoLease) => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(other) => panic!("{other}"),
            }
        };
        let PublishOutcome::Committed { version, .. } = outcome else { panic!("{outcome:?}") };
        versions.push(version);
    }
    assert_eq!(versions, vec![1, 2]);
    // The replay guard: a pack already published is never published twice.
    assert_eq!(publisher.publish_batch(std::slice::from_ref(&first)).await.unwrap(), PublishOutcome::AlreadyPublished);
    assert_eq!(catalog.committed_versions(), vec![1, 2]);

    let reader = catalog.reader();
    let location = reader.get(ids[0], None).await.unwrap().expect("published capture is found");
    assert_eq!((location.stream.as_str(), location.captured_at_ns, location.version), ("cam/1", 100, 1));
    assert_eq!(location.labels_map().get("site").map(String::as_str), Some("berlin"));
    assert_eq!(location.pack_id, first.summary.pack_id.to_string());
    let retried_location = reader.get(retried, None).await.unwrap().unwrap();
    assert_eq!(retried_location.version, 2, "a capture published twice shows its latest version");
    assert!(reader.get(ids[4], None).await.unwrap().is_none());

    let mut seen = Vec::new();
    let mut query = ListQuery { stream: Some("cam/1".into()), limit: 2, ..Default::default() };
    loop {
        let page = reader.list(&query).await.unwrap();
        seen.extend(page.captures.iter().map(|c| c.capture_id.clone()));
        match page.next_cursor {
            Some(cursor) => query.cursor = Some(cursor),
            None => break,
        }
    }
    let expected: Vec<String> = [ids[0], ids[1], retried, ids[2]].iter().map(Uuid::to_string).collect();
    assert_eq!(seen, expected, "stream listing in time order, the retried capture once");
    let ranged = reader
        .list(&ListQuery { since_ns: Some(200), until_ns: Some(500), limit: 100, ..Default::default() })
        .await
        .unwrap();
    assert_eq!(ranged.captures.len(), 3);
    let labelled = reader
        .list(&ListQuery {
            labels: BTreeMap::from([("site".to_string(), "paris".to_string())]),
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(labelled.captures.is_empty());

    let publishes = reader.publishes_after(1, 100).await.unwrap();
    assert_eq!(publishes.iter().map(|p| p.version).collect::<Vec<_>>(), vec![2]);
    assert_eq!(reader.captures_of_version(2).await.unwrap().len(), 3);
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();
    assert_eq!(handle.state(), LeaseState::Released);
    let head = catalog.store(&catalog.config.catalog_name).read_head().await.unwrap();
    assert!(!head.is_live(), "a clean shutdown tombstones the lease: {head:?}");
}

for_each_version!(a_cut_spanning_a_renewal_and_a_publish_quarantines_then_recovers);
async fn a_cut_spanning_a_renewal_and_a_publish_quarantines_then_recovers(server: &'static ClickHouseServer) {
    let catalog = catalog(server, true).await;
    let proxy = catalog.proxy.as_ref().unwrap();
    let keeper = catalog.keeper(identity("cut"));
    let (_shutdown_tx, mut shutdown_rx) = watch::channel(false);
    keeper.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
    let handle = keeper.handle();
    let mut states = handle.subscribe();
    let observed: Arc<Mutex<Vec<LeaseState>>> = Arc::default();
    let observed_writer = observed.clone();
    tokio::spawn(async move {
        while states.changed().await.is_ok() {
            observed_writer.lock().unwrap().push(*states.borrow_and_update());
        }
    });
    tokio::spawn(keeper.run(shutdown_rx));
    let publisher =
        Publisher::new(catalog.client.clone(), catalog.tables.clone(), &catalog.config.catalog_name, handle.clone());

    proxy.cut();
    let owed = vec![one_capture_pack()];
    let during_cut = publisher.publish_batch(&owed).await;
    assert!(during_cut.is_err(), "nothing can be published during the cut");
    tokio::time::sleep(Duration::from_millis(2500)).await; // the cut lasts 2.5 s: it spans at least one renewal
    proxy.pass();

    let started = Instant::now();
    let version = loop {
        match publisher.publish_batch(&owed).await {
            Ok(PublishOutcome::Committed { version, .. }) => break version,
            Ok(PublishOutcome::AlreadyPublished) => panic!("the batch could not have landed during the cut"),
            Err(_) => {
                assert!(started.elapsed() < TTL * 4, "the owed batch was never published; {:?}", handle.status());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(version, 1);
    let status = handle.status();
    let observed = observed.lock().unwrap().clone();
    assert!(observed.contains(&LeaseState::Quarantined), "states seen: {observed:?}");
    assert_eq!(status.lease_state, LeaseState::Held, "{status:?}");
    assert!(status.lease_reacquisitions >= 1, "{status:?}");
    assert!(!status.failed);
}

/// Collects log lines of the code under test (current-thread runtime: every task logs on this thread).
fn capture_logs() -> (Arc<Mutex<Vec<u8>>>, tracing::subscriber::DefaultGuard) {
    let buffer: Arc<Mutex<Vec<u8>>> = Arc::default();
    let writer = buffer.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || LogWriter(writer.clone()))
        .finish();
    (buffer, tracing::subscriber::set_default(subscriber))
}

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A rival publisher: claims with its own identity and renews every ttl/6 until `renew_for` has passed, then either
/// releases (a clean stop) or simply stops renewing.
async fn run_rival(store: LeaseStore, renew_for: Duration, release_at_end: bool) -> String {
    let rival = identity("rival-publisher");
    let lease_id = Uuid::new_v4().to_string();
    let started = Instant::now();
    let mut term = loop {
        match store.claim(&lease_id, &rival).await.unwrap() {
            ClaimOutcome::Held { term, .. } => break term,
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    while started.elapsed() < renew_for {
        tokio::time::sleep(TTL / 6).await;
        if let ClaimOutcome::Held { term: next, .. } = store.renew(&lease_id, &rival, term).await.unwrap() {
            term = next;
        }
    }
    if release_at_end {
        store.release(&lease_id, &rival, term).await.unwrap();
    }
    rival.holder()
}

for_each_version!(a_rival_that_stops_within_two_ttls_does_not_latch);
async fn a_rival_that_stops_within_two_ttls_does_not_latch(server: &'static ClickHouseServer) {
    let (logs, _guard) = capture_logs();
    let catalog = catalog(server, false).await;
    let rival = tokio::spawn(run_rival(catalog.store(&catalog.config.catalog_name), TTL, true));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let keeper = catalog.keeper(identity("patient"));
    let handle = keeper.handle();
    let (_shutdown_tx, shutdown_rx) = watch::channel(false);
    tokio::spawn(keeper.run(shutdown_rx));
    rival.await.unwrap();
    wait_for_state(&handle, LeaseState::Held, TTL * 2).await;
    let status = handle.status();
    assert!(!status.failed, "{status:?}");
    let logs = String::from_utf8_lossy(&logs.lock().unwrap()).to_string();
    assert!(!logs.contains("ERROR"), "no latch, no ERROR line: {logs}");
}

for_each_version!(a_rival_that_keeps_renewing_latches_after_two_ttls_with_one_error_line);
async fn a_rival_that_keeps_renewing_latches_after_two_ttls_with_one_error_line(server: &'static ClickHouseServer) {
    let (logs, _guard) = capture_logs();
    let catalog = catalog(server, false).await;
    let rival_started = Instant::now();
    let rival = tokio::spawn(run_rival(catalog.store(&catalog.config.catalog_name), TTL * 4, false));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let keeper = catalog.keeper(identity("loser"));
    let handle = keeper.handle();
    let (_shutdown_tx, shutdown_rx) = watch::channel(false);
    let keeper_task = tokio::spawn(keeper.run(shutdown_rx));
    wait_for_state(&handle, LeaseState::Failed, TTL * 4).await;
    let latched_after = rival_started.elapsed();
    assert!(latched_after >= TTL * 2, "latched after {latched_after:?}, sooner than 2 x TTL");
    keeper_task.await.unwrap();
    let rival_holder = rival.await.unwrap();
    let status = handle.status();
    assert!(status.failed && status.lease_state == LeaseState::Failed, "{status:?}");
    let logs = String::from_utf8_lossy(&logs.lock().unwrap()).to_string();
    let error_lines: Vec<&str> = logs.lines().filter(|line| line.contains("ERROR")).collect();
    assert_eq!(error_lines.len(), 1, "exactly one ERROR line: {logs}");
    assert!(error_lines[0].contains(&rival_holder), "the ERROR line names the rival: {}", error_lines[0]);
}

/// A `capstore debug hold-lease` child process: owns `spool_dir` and holds the catalog's lease until killed.
struct Holder {
    child: Child,
    term: u64,
    holder: String,
}

impl Drop for Holder {
    /// A failing test must not leave a lease holder running.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_holder(config: &Config, spool_dir: &std::path::Path, start_wait: &str) -> Holder {
    let holder_env = DaemonEnv::live("holder", spool_dir.parent().unwrap())
        .set("CAPSTORE_CATALOG_NAME", config.catalog_name.clone())
        .set("CAPSTORE_CATALOG_URL", config.catalog.url.clone())
        .set("CAPSTORE_CATALOG_DATABASE", config.catalog.database.clone())
        .set("CAPSTORE_CATALOG_TABLE_PREFIX", config.catalog.table_prefix.clone())
        .set("CAPSTORE_LEASE_START_WAIT", start_wait)
        .set("CAPSTORE_SPOOL_DIR", spool_dir.display().to_string())
        .set("CAPSTORE_LOG_LEVEL", "warn");
    let mut command = holder_env.command();
    command.args(["debug", "hold-lease"]).stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut child = common::spawn_tied_to_process(command).unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let mut fields = line.split_whitespace();
    assert_eq!(fields.next(), Some("HELD"), "holder did not take the lease: {line:?}");
    let term = fields.next().unwrap().parse().unwrap();
    Holder { child, term, holder: fields.next().unwrap().to_string() }
}

fn sigkill(child: &mut Child) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    child.wait().unwrap();
}

for_each_version!(start_wait_for_a_killed_holder_and_same_spool_takeover, flavor = "multi_thread");
async fn start_wait_for_a_killed_holder_and_same_spool_takeover(server: &'static ClickHouseServer) {
    let catalog = catalog(server, false).await;
    let dir = tempfile::tempdir().unwrap();
    let spool_a = dir.path().join("spool-a");
    let store = catalog.store(&catalog.config.catalog_name);

    // Another identity waits for a SIGKILLed holder's lease, within the start wait.
    let mut first = spawn_holder(&catalog.config, &spool_a, "0s");
    sigkill(&mut first.child);
    let waiter = catalog.keeper(identity("successor"));
    let (_shutdown_tx, mut shutdown_rx) = watch::channel(false);
    let started = Instant::now();
    waiter.acquire_at_start(catalog.config.start_wait(), &mut shutdown_rx).await.unwrap();
    let waited = started.elapsed();
    let bound = catalog.config.start_wait() + Duration::from_secs(2);
    assert!(waited >= Duration::from_millis(500) && waited <= bound, "waited {waited:?}, expected 0.5 s..{bound:?}");
    let successor_status = waiter.handle().status();
    store
        .release(&waiter.handle().permit().unwrap().lease_id, waiter.handle().identity(), successor_status.lease_term)
        .await
        .unwrap();

    // With start_wait = 0 a live holder refuses at once, naming itself.
    let mut live = spawn_holder(&catalog.config, &spool_a, "0s");
    let impatient = catalog.keeper(identity("impatient"));
    let started = Instant::now();
    let error = impatient.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap_err();
    assert!(started.elapsed() < TTL, "start_wait = 0 must refuse at once");
    match &error {
        StartError::Refused { holder, .. } => assert_eq!(holder, &live.holder, "{error}"),
        other => panic!("{other}"),
    }
    assert!(error.to_string().contains(&live.holder), "{error}");

    // The same spool's restart takes over at once: the new term is written while the old one is still live. (A
    // renewal the dead process sent just before the kill may still land, so the predecessor's last term is read
    // from the table, not taken from what it printed.)
    sigkill(&mut live.child);
    let mut restarted = spawn_holder(&catalog.config, &spool_a, "0s");
    let number = |sql: String| -> u64 { catalog.server.query(&sql).unwrap().trim().parse().unwrap() };
    let lease_table = &catalog.tables.lease;
    let catalog_name = &catalog.config.catalog_name;
    let predecessor_term = restarted.term - 1;
    let predecessor_holder = catalog.server
        .query(&format!(
            "SELECT any(holder) FROM {lease_table} WHERE catalog = '{catalog_name}' AND term = {predecessor_term} FORMAT TSV"
        ))
        .unwrap();
    assert_eq!(predecessor_holder.trim(), live.holder, "the restart took over from its own spool's predecessor");
    let predecessor_expiry = number(format!(
        "SELECT min(expires_at_ms) FROM {lease_table} WHERE catalog = '{catalog_name}' AND term = {predecessor_term} FORMAT TSV"
    ));
    let written_at = number(format!(
        "SELECT min(written_at_ms) FROM {lease_table} WHERE catalog = '{catalog_name}' AND term = {} FORMAT TSV",
        restarted.term
    ));
    assert!(written_at < predecessor_expiry, "the takeover did not wait for the old lease to expire");
    let old_lease_id: String = catalog.server
        .query(&format!(
            "SELECT any(lease_id) FROM {lease_table} WHERE catalog = '{catalog_name}' AND term = {predecessor_term} FORMAT TSV"
        ))
        .unwrap()
        .trim()
        .to_string();

    // Safe: a late statement of the dead predecessor (its old lease_id) cannot land.
    let stale = PublishPermit {
        lease_id: old_lease_id.clone(),
        tenure: 1,
        term: predecessor_term,
        holder: live.holder.clone(),
        deadline: Instant::now() + TTL,
        fence: store.fence_condition(&old_lease_id),
    };
    let publisher = Publisher::new(
        catalog.client.clone(),
        catalog.tables.clone(),
        &catalog.config.catalog_name,
        impatient.handle(),
    );
    let result = publisher.publish_with_permit(&stale, &[one_capture_pack()]).await;
    assert!(matches!(result, Err(PublishError::NotCommitted)), "{result:?}");
    assert!(catalog.committed_versions().is_empty());
    sigkill(&mut restarted.child);
}

for_each_version!(a_start_whose_takeover_claim_went_unanswered_waits_out_the_embargo_after_its_retry);
async fn a_start_whose_takeover_claim_went_unanswered_waits_out_the_embargo_after_its_retry(
    server: &'static ClickHouseServer,
) {
    let mut catalog = catalog(server, true).await;
    // Long enough that the unanswered claim's row is still live when the retry reads the head, after the claim's
    // request timeout (2 s) on a server whose clock has whole seconds.
    catalog.config.lease.ttl = HumanDuration(Duration::from_secs(6));
    let proxy = catalog.proxy.as_ref().unwrap();
    let name = &catalog.config.catalog_name;
    // The spool's previous process holds a live lease and is dead: its last commit may still be running.
    let spool_id = Uuid::new_v4();
    let predecessor = Identity { spool_id, host: "before".into(), pid: 1 };
    let store = catalog.store(name);
    assert!(matches!(store.claim("lease-before", &predecessor).await.unwrap(), ClaimOutcome::Held { term: 1, .. }));

    // The restart's takeover claim lands, but its reply is lost; the start retries with a fresh lease_id and finds
    // that row live at the head.
    let keeper = catalog.keeper(Identity { spool_id, host: "after".into(), pid: 2 });
    let handle = keeper.handle();
    proxy.blackhole_replies_matching("claim");
    let (_shutdown_tx, mut shutdown_rx) = watch::channel(false);
    let start = tokio::spawn(async move {
        keeper.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
        (keeper, shutdown_rx)
    });
    let heads_written_after = format!(
        "SELECT count() FROM {} WHERE catalog = '{name}' AND holder LIKE '%@after:2' FORMAT TSV",
        catalog.tables.lease
    );
    let landed = tokio::time::timeout(TTL * 3, async {
        while catalog.server.query(&heads_written_after).unwrap().trim() == "0" {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(landed.is_ok(), "the unanswered takeover claim never landed");
    proxy.pass();
    let (keeper, shutdown_rx) = start.await.unwrap();
    let held_at = Instant::now();
    // Renewing, so that the embargo (longer than a claim's local lifetime on 18.16) can end while the lease is held.
    tokio::spawn(keeper.run(shutdown_rx));
    assert_eq!(handle.state(), LeaseState::Held);
    let lease_ids = catalog.server.query(&heads_written_after.replace("count()", "uniqExact(lease_id)")).unwrap();
    assert!(lease_ids.trim().parse::<u64>().unwrap() >= 2, "the retry claimed over the first claim: {lease_ids}");

    // Nothing is published until publish_timeout + clock_skew after the claim that answered: the predecessor's
    // commit may have passed its fence just before the first claim landed.
    assert!(handle.permit().is_none(), "a claim over its own unanswered takeover must wait out the embargo");
    let embargo = catalog.timings().fence_margin();
    let permitted = tokio::time::timeout(TTL, async {
        while handle.permit().is_none() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(permitted.is_ok(), "the embargo never ended");
    assert!(held_at.elapsed() >= embargo, "permitted {:?} after the claim, before the embargo", held_at.elapsed());
}

for_each_version!(a_contested_head_of_this_spools_lease_ids_is_taken_over_with_the_embargo);
async fn a_contested_head_of_this_spools_lease_ids_is_taken_over_with_the_embargo(server: &'static ClickHouseServer) {
    let catalog = catalog(server, false).await;
    let name = &catalog.config.catalog_name;
    let store = catalog.store(name);
    let spool_id = Uuid::new_v4();
    let process = |pid: u32| Identity { spool_id, host: "vm".into(), pid };
    assert!(matches!(store.claim("lease-a", &process(1)).await.unwrap(), ClaimOutcome::Held { term: 1, .. }));
    // A second lease_id of the same spool at that term (a start's retry landing beside its own unanswered claim).
    catalog
        .server
        .query(&format!(
            "INSERT INTO {} (catalog, term, lease_id, holder, written_at_ms, expires_at_ms, kind) SELECT '{name}', 1, \
             'lease-b', '{}', toUInt64(now()) * 1000, toUInt64(now()) * 1000 + 60000, 'claim'",
            catalog.tables.lease,
            process(2).holder()
        ))
        .unwrap();
    let head = store.read_head().await.unwrap();
    assert!(head.is_live() && head.entries.len() == 2, "{head:?}");

    let other_spool = identity("elsewhere");
    let refused = store.claim("lease-x", &other_spool).await.unwrap();
    assert!(matches!(refused, ClaimOutcome::Refused { .. }), "{refused:?}");
    match store.claim("lease-c", &process(3)).await.unwrap() {
        ClaimOutcome::Held { term: 2, publish_not_before: Some(_), .. } => {}
        other => panic!("this spool's contested head is taken over, with the embargo: {other:?}"),
    }
}

for_each_version!(a_release_that_cut_off_a_commit_keeps_the_lease_until_the_commit_has_ended, flavor = "multi_thread");
async fn a_release_that_cut_off_a_commit_keeps_the_lease_until_the_commit_has_ended(server: &'static ClickHouseServer) {
    let catalog = catalog(server, true).await;
    let proxy = catalog.proxy.as_ref().unwrap();
    let name = &catalog.config.catalog_name;
    let rival_store = catalog.store(name);
    let rival = identity("rival");
    let start = |host: &str| {
        let keeper = catalog.keeper(identity(host));
        async move {
            let (_shutdown_tx, mut shutdown_rx) = watch::channel(false);
            keeper.start(Duration::ZERO, &mut shutdown_rx).await.unwrap()
        }
    };
    let publisher_for = |lease: &RunningLease| {
        Publisher::new(catalog.client.clone(), catalog.tables.clone(), name, lease.handle().clone())
    };

    // Every commit answered: the release's tombstone ends the lease at once.
    let running = start("answered").await;
    let publisher = publisher_for(&running);
    retried!(publisher.publish_batch(&[one_capture_pack()]).await);
    let permit = loop {
        match running.handle().permit() {
            Some(permit) => break permit,
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    running.stop().await;
    // A publish that took its permit before the release (a compaction's, on a task of its own) sends no commit after
    // the release has decided how to end the lease.
    let late = publisher.publish_with_permit(&permit, &[one_capture_pack()]).await;
    assert!(matches!(late, Err(PublishError::NoLease)), "{late:?}");
    let ClaimOutcome::Held { term, .. } = rival_store.claim("lease-rival", &rival).await.unwrap() else {
        panic!("a release after answered commits must free the lease at once")
    };
    rival_store.release("lease-rival", &rival, term).await.unwrap();

    // A commit sent and cut off before its answer (as the drain's timeout cuts one): the server may still run it.
    let running = start("cut").await;
    let publisher = Arc::new(publisher_for(&running));
    retried!(publisher.publish_batch(&[one_capture_pack()]).await);
    let commit = format!("INSERT INTO {} ", catalog.tables.publishes);
    let commits_sent = proxy.count_requests_containing(&commit);
    proxy.blackhole_replies_matching(&commit);
    let cut = tokio::spawn({
        let publisher = Arc::clone(&publisher);
        async move { publisher.publish_batch(&[one_capture_pack()]).await }
    });
    let sent = tokio::time::timeout(TTL, async {
        while commits_sent.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(sent.is_ok(), "the commit was never sent");
    cut.abort();
    assert!(cut.await.unwrap_err().is_cancelled());
    proxy.pass();
    running.stop().await;

    // No tombstone: the lease ends at its last renewal's expiry, which is later than anything that passed the fence.
    let tombstones = format!(
        "SELECT count() FROM {} WHERE catalog = '{name}' AND kind = 'release' AND holder LIKE '%@cut:%' FORMAT TSV",
        catalog.tables.lease
    );
    assert_eq!(catalog.server.query(&tombstones).unwrap().trim(), "0");
    let refused = rival_store.claim("lease-rival-2", &rival).await.unwrap();
    assert!(
        matches!(refused, ClaimOutcome::Refused { .. }),
        "the lease was free at once after a cut commit: {refused:?}"
    );
    let claimed = tokio::time::timeout(TTL * 2, async {
        loop {
            match rival_store.claim("lease-rival-2", &rival).await.unwrap() {
                ClaimOutcome::Held { .. } => break,
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await;
    assert!(claimed.is_ok(), "the lease left to expire never did");
}

/// A stand-in for a month's drop of `catalog`'s catalog that runs on the server for `half_seconds` / 2 s: a statement
/// with a drop's text, which is what a publish looks for (in a comment the server keeps: 18.16 cuts a trailing one).
/// A real drop cannot be made to wait that long on every version. `round` tells stand-ins apart.
fn start_drop_stand_in(catalog: &Catalog, round: u32, half_seconds: u32) -> std::thread::JoinHandle<String> {
    let marker = format!(
        "ALTER TABLE {}.stand_in DROP PARTITION ('{}', 197001)",
        catalog.tables.database, catalog.config.catalog_name
    );
    let sql = format!(
        "SELECT /* {marker} */ sum(sleepEachRow(0.5)) + {round} FROM numbers({half_seconds}) SETTINGS max_block_size = 1"
    );
    let server = catalog.server;
    std::thread::spawn(move || server.query(&sql).unwrap())
}

fn drop_stand_in_runs(catalog: &Catalog, round: u32) -> bool {
    let sql = format!(
        "SELECT count() FROM system.processes WHERE position(query, 'sleepEachRow(0.5)) + {round} ') > 0 AND \
         position(query, 'system.processes') = 0"
    );
    catalog.server.query(&sql).unwrap() == "1\n"
}

async fn until_drop_stand_in_runs(catalog: &Catalog, round: u32) {
    let started = Instant::now();
    while !drop_stand_in_runs(catalog, round) {
        assert!(started.elapsed() < Duration::from_secs(10), "the stand-in never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

for_each_version!(a_publish_waits_until_no_server_runs_a_months_drop_of_its_catalog);
async fn a_publish_waits_until_no_server_runs_a_months_drop_of_its_catalog(server: &'static ClickHouseServer) {
    let catalog = catalog(server, false).await;
    let name = &catalog.config.catalog_name;
    let keeper = catalog.keeper(identity("dropper"));
    let (_shutdown_tx, mut shutdown_rx) = watch::channel(false);
    let running = keeper.start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
    let publisher = Publisher::new(catalog.client.clone(), catalog.tables.clone(), name, running.handle().clone());
    retried!(publisher.publish_batch(&[one_capture_pack()]).await);

    // Drops cut off in the turn (the shutdown aborts a pass): the next publish of the process waits them out.
    let first = start_drop_stand_in(&catalog, 1, 8);
    until_drop_stand_in_runs(&catalog, 1).await;
    {
        let turn = publisher.exclusive_turn().await.expect("the lease is held");
        let in_flight = turn.unfenced_sent().expect("the lease is not being released");
        drop(in_flight);
    }
    retried!(publisher.publish_batch(&[one_capture_pack()]).await);
    assert!(!drop_stand_in_runs(&catalog, 1), "published beside a drop cut off in the turn");
    first.join().unwrap();

    // A process that starts while an earlier one's drop runs (killed mid-drop) waits it out before its first publish.
    let second = start_drop_stand_in(&catalog, 2, 8);
    until_drop_stand_in_runs(&catalog, 2).await;
    let started = Publisher::new(catalog.client.clone(), catalog.tables.clone(), name, running.handle().clone());
    retried!(started.publish_batch(&[one_capture_pack()]).await);
    assert!(!drop_stand_in_runs(&catalog, 2), "a new process published beside an earlier one's drop");
    second.join().unwrap();

    // The release after drops cut off leaves the lease to expire, as after a commit cut off.
    running.stop().await;
    let rival = identity("rival");
    let refused = catalog.store(name).claim("lease-rival", &rival).await.unwrap();
    assert!(matches!(refused, ClaimOutcome::Refused { .. }), "the lease was free at once after cut drops: {refused:?}");
}

for_each_version!(a_holder_that_takes_the_lease_back_from_another_waits_out_the_others_drop);
async fn a_holder_that_takes_the_lease_back_from_another_waits_out_the_others_drop(server: &'static ClickHouseServer) {
    let catalog = catalog(server, true).await;
    let proxy = catalog.proxy.as_ref().unwrap();
    let name = &catalog.config.catalog_name;
    let keeper = catalog.keeper(identity("back"));
    let (shutdown_tx, mut shutdown_rx) = watch::channel(false);
    keeper.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
    let handle = keeper.handle();
    let keeper_task = tokio::spawn(keeper.run(shutdown_rx));
    let publisher = Publisher::new(catalog.client.clone(), catalog.tables.clone(), name, handle.clone());
    retried!(publisher.publish_batch(&[one_capture_pack()]).await);
    assert!(!handle.owes_empty_commit());

    // Cut off for longer than the lease: another holder takes it, and dies while its drop runs on the server.
    proxy.cut();
    until_lease_lost_in_the_cut(&handle).await;
    let other = identity("other");
    let mut direct = catalog.config.catalog.clone();
    direct.url = server.url();
    let direct = CatalogClient::connect(&direct).await.unwrap();
    let store = LeaseStore::new(direct, &catalog.tables, name, catalog.timings());
    let term = tokio::time::timeout(TTL * 3, async {
        loop {
            match store.claim("lease-other", &other).await.unwrap() {
                ClaimOutcome::Held { term, .. } => break term,
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await
    .expect("the other holder never took the lease");
    let dropping = start_drop_stand_in(&catalog, 3, 20);
    until_drop_stand_in_runs(&catalog, 3).await;
    store.release("lease-other", &other, term).await.unwrap();

    // The first holder takes the lease back: a claim that follows another holder, whose drop it waits out.
    proxy.pass();
    wait_for_state(&handle, LeaseState::Held, TTL * 4).await;
    assert!(handle.owes_empty_commit(), "the claim did not follow another holder");
    assert!(drop_stand_in_runs(&catalog, 3), "the stand-in ended before the lease was taken back");
    retried!(publisher.publish_batch(&[one_capture_pack()]).await);
    assert!(!drop_stand_in_runs(&catalog, 3), "published beside the other holder's drop");
    dropping.join().unwrap();
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();
}

for_each_version!(a_claim_over_a_written_catalog_whose_lease_rows_were_removed_owes_an_empty_commit);
async fn a_claim_over_a_written_catalog_whose_lease_rows_were_removed_owes_an_empty_commit(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, false).await;
    let name = &catalog.config.catalog_name;
    let holder = |keeper: LeaseKeeper, client: &CatalogClient, tables: &Tables| {
        let handle = keeper.handle();
        let publisher = Publisher::new(client.clone(), tables.clone(), name, handle.clone());
        (keeper, handle, publisher)
    };
    let (first, handle, publisher) = holder(catalog.keeper(identity("first")), &catalog.client, &catalog.tables);
    let (shutdown_tx, mut shutdown_rx) = watch::channel(false);
    first.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
    assert!(!handle.owes_empty_commit(), "the first claim of a catalog nothing was written into follows nobody");
    let keeper_task = tokio::spawn(first.run(shutdown_rx));
    let outcome = retried!(publisher.publish_batch(&[one_capture_pack()]).await);
    assert!(matches!(outcome, PublishOutcome::Committed { version: 1, .. }), "{outcome:?}");
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();

    // An operator drops the lease table (to unstick a lease, say), and the next start makes it again, empty. The
    // holders before may have attempts that still land: the claim owes an empty commit, as after any other holder.
    catalog.server.query(&format!("DROP TABLE {}", catalog.tables.lease)).unwrap();
    let (client, tables) = capstore::catalog::connect(&catalog.config).await.expect("the lease table made again");
    let store = LeaseStore::new(client.clone(), &tables, name, catalog.timings());
    let (next, handle, publisher) = holder(LeaseKeeper::new(store, identity("next"), name), &client, &tables);
    let (shutdown_tx, mut shutdown_rx) = watch::channel(false);
    next.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
    assert_eq!(handle.status().lease_term, 1, "the lease table was not emptied");
    assert!(handle.owes_empty_commit(), "a claim over a written catalog without lease rows owes nothing");
    let keeper_task = tokio::spawn(next.run(shutdown_rx));
    let outcome = retried!(publisher.publish_batch(&[one_capture_pack()]).await);
    assert!(matches!(outcome, PublishOutcome::Committed { version: 3, .. }), "{outcome:?}");
    let empty = format!(
        "SELECT count() FROM {} WHERE catalog = '{name}' AND version = 2 AND packs = 0 AND captures = 0",
        tables.publishes
    );
    assert_eq!(server.query(&empty).unwrap().trim(), "1", "version 2 is not the empty commit");
    assert!(!handle.owes_empty_commit());
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();
}

for_each_version!(a_publish_whose_reply_is_lost_is_decided_by_read_back_with_gapless_versions);
async fn a_publish_whose_reply_is_lost_is_decided_by_read_back_with_gapless_versions(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, true).await;
    let proxy = catalog.proxy.as_ref().unwrap();
    let keeper = catalog.keeper(identity("blackholed"));
    let (_shutdown_tx, mut shutdown_rx) = watch::channel(false);
    keeper.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
    let handle = keeper.handle();
    tokio::spawn(keeper.run(shutdown_rx));
    let publisher =
        Publisher::new(catalog.client.clone(), catalog.tables.clone(), &catalog.config.catalog_name, handle.clone());

    let batch = vec![one_capture_pack()];
    proxy.blackhole_replies_matching(&format!("INSERT INTO {} ", catalog.tables.publishes));
    let result = publisher.publish_batch(&batch).await;
    assert!(matches!(result, Err(PublishError::OutcomeUnknown(_))), "{result:?}");
    assert_eq!(handle.state(), LeaseState::Quarantined, "an unknown outcome quarantines the lease");
    proxy.pass();
    // The reply was lost, not the statement: on a loaded server it may still be finishing when the client gives up.
    // It runs under `max_execution_time = publish_timeout` (1 s here), so on a server loaded enough (the whole suite
    // on two cores) the server may also stop it: then it never lands, and read-back must find nothing.
    let landed = tokio::time::timeout(TTL * 3, async {
        while catalog.committed_versions().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .is_ok();
    if landed {
        assert_eq!(catalog.committed_versions(), vec![1], "the statement ran although its reply was lost");
    }

    wait_for_state(&handle, LeaseState::Held, TTL * 3).await;
    let outcome = loop {
        match publisher.publish_batch(&batch).await {
            Ok(outcome) => break outcome,
            Err(PublishError::NotCommitted | PublishError::NoLease) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(other) => panic!("{other}"),
        }
    };
    // A renewal in flight when the quarantine began may have landed unconfirmed, and a claim that follows a term this
    // process did not confirm owes an empty commit before its next publish of rows: before the batch where the batch
    // is published again, after it where read-back finds it.
    let batch_version = if landed {
        assert_eq!(outcome, PublishOutcome::AlreadyPublished, "read-back found the earlier publish");
        1
    } else {
        match outcome {
            PublishOutcome::Committed { version, .. } if version <= 2 => version,
            other => panic!("read-back found no earlier publish, and the batch took version 1 or 2: {other:?}"),
        }
    };
    assert_eq!(catalog.committed_versions(), (1..=batch_version).collect::<Vec<u64>>());
    let (next, _) = committed_within(&publisher, &[one_capture_pack()], TTL * 6).await;
    assert_eq!(catalog.committed_versions(), (1..=next).collect::<Vec<u64>>(), "no version used twice, none skipped");
    assert!(next <= 3, "{next}");
    // Every version below the next batch's but the first batch's is that empty commit.
    let empty = format!(
        "SELECT count() FROM {} WHERE catalog = '{}' AND version < {next} AND version != {batch_version} AND packs = 0 \
         AND captures = 0",
        catalog.tables.publishes, catalog.config.catalog_name
    );
    assert_eq!(catalog.server.query(&empty).unwrap().trim(), (next - 2).to_string());
}

/// Publish `batch` until it commits, through any error (a quarantine, a refused fence), within `within`: its version
/// and publish_id. Any other outcome fails the test.
async fn committed_within(publisher: &Publisher, batch: &[PackDescriptor], within: Duration) -> (u64, Uuid) {
    let committed = tokio::time::timeout(within, async {
        loop {
            match publisher.publish_batch(batch).await {
                Ok(PublishOutcome::Committed { version, publish_id }) => break (version, publish_id),
                Ok(other) => panic!("{other:?}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await;
    committed.expect("the batch was never published")
}

/// The publish_ids of the rows at `version` in `by_version`, whether committed or not.
fn attempts_at(catalog: &Catalog, version: u64) -> Vec<String> {
    let sql = format!(
        "SELECT DISTINCT publish_id FROM {} WHERE catalog = '{}' AND version = {version} FORMAT TSV",
        catalog.tables.by_version, catalog.config.catalog_name
    );
    catalog.server.query(&sql).unwrap().lines().map(str::to_string).collect()
}

/// Publish `batch` with the replies to its `captures` insert swallowed: the call fails and its rows land at version 1.
/// Returns the publish_ids at version 1 once they have.
async fn publish_losing_the_captures_reply(
    catalog: &Catalog,
    publisher: &Publisher,
    batch: &[PackDescriptor],
) -> Vec<String> {
    let proxy = catalog.proxy.as_ref().unwrap();
    // The crate sends an INSERT's statement in the URL: `captures(` is `captures%28` there.
    proxy.blackhole_replies_matching(&format!("{}%28", catalog.tables.captures));
    let result = publisher.publish_batch(batch).await;
    assert!(result.is_err(), "{result:?}");
    proxy.pass();
    let landed = tokio::time::timeout(TTL * 3, async {
        while attempts_at(catalog, 1).is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(landed.is_ok(), "the rows whose reply was lost never landed");
    attempts_at(catalog, 1)
}

/// The rows of the attempt `publish_id` at `version` land once more (a part newer than every row before), and the
/// tables listings read are merged: each capture keeps one row. (18.16 lists across streams from `by_time`, which
/// its view filled with the copy too.)
fn land_again_and_merge(catalog: &Catalog, version: u64, publish_id: &str) {
    let (captures, name) = (&catalog.tables.captures, &catalog.config.catalog_name);
    catalog
        .server
        .query(&format!(
            "INSERT INTO {captures} SELECT * FROM {captures} WHERE catalog = '{name}' AND version = {version} AND \
             publish_id = '{publish_id}'"
        ))
        .unwrap();
    catalog.server.query(&format!("OPTIMIZE TABLE {captures} FINAL")).unwrap();
    let (database, by_time) = catalog.tables.by_time.split_once('.').unwrap();
    let kept = format!("SELECT count() FROM system.tables WHERE database = '{database}' AND name = '{by_time}'");
    if catalog.server.query(&kept).unwrap().trim() == "1" {
        catalog.server.query(&format!("OPTIMIZE TABLE {} FINAL", catalog.tables.by_time)).unwrap();
    }
}

/// The capture ids of the first page (of 10) of `stream`, or across streams.
async fn listed(catalog: &Catalog, stream: Option<&str>) -> Vec<String> {
    let query = ListQuery { stream: stream.map(str::to_string), limit: 10, ..Default::default() };
    let page = catalog.reader().list(&query).await.unwrap();
    page.captures.iter().map(|capture| capture.capture_id.clone()).collect()
}

for_each_version!(rows_whose_insert_lost_its_reply_are_sent_again_as_the_same_attempt);
/// A publish whose insert of `captures` rows loses its reply (the rows landed; on a loaded server they could land
/// later still) sends them again at the same version under the same publish_id: so a copy of the first attempt's
/// rows landing after the commit only repeats committed rows, and a merge that keeps the last copy of each capture
/// keeps a committed one. Under a new publish_id, that merge would keep the orphan, and the captures would drop out
/// of the listing.
async fn rows_whose_insert_lost_its_reply_are_sent_again_as_the_same_attempt(server: &'static ClickHouseServer) {
    let catalog = catalog(server, true).await;
    let lost_rows = publishing(&catalog, "lost-rows").await;
    let publisher = &lost_rows.publisher;
    let now = capstore::util::now_ns();
    let ids: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    let batch = vec![pack(&ids.iter().enumerate().map(|(at, id)| (*id, "s", now + at as u64)).collect::<Vec<_>>())];
    let first_attempt = publish_losing_the_captures_reply(&catalog, publisher, &batch).await;
    assert_eq!(first_attempt.len(), 1, "{first_attempt:?}");

    let (version, publish_id) = committed_within(publisher, &batch, TTL * 6).await;
    assert_eq!(version, 1);
    assert_eq!(attempts_at(&catalog, 1), vec![publish_id.to_string()], "the retry was a second attempt at version 1");

    // The first attempt's insert lands once more, after the commit, and a merge keeps the last copy of each capture.
    land_again_and_merge(&catalog, 1, &first_attempt[0]);
    let expected: Vec<String> = ids.iter().map(Uuid::to_string).collect();
    assert_eq!(listed(&catalog, Some("s")).await, expected);
    assert_eq!(listed(&catalog, None).await, expected);
}

for_each_version!(rows_sharing_captures_with_an_attempt_in_doubt_go_to_the_next_version_after_an_empty_commit);
async fn rows_sharing_captures_with_an_attempt_in_doubt_go_to_the_next_version_after_an_empty_commit(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, true).await;
    let publishing = publishing(&catalog, "reshaped").await;
    let publisher = &publishing.publisher;
    let now = capstore::util::now_ns();
    let ids: Vec<Uuid> = (0..6).map(|_| Uuid::now_v7()).collect();
    let first = pack(&ids[..3].iter().enumerate().map(|(at, id)| (*id, "s", now + at as u64)).collect::<Vec<_>>());
    let second =
        pack(&ids[3..].iter().enumerate().map(|(at, id)| (*id, "s", now + 10 + at as u64)).collect::<Vec<_>>());
    // A batch of two packs whose rows land with their reply lost: in doubt at version 1.
    let in_doubt = publish_losing_the_captures_reply(&catalog, publisher, &[first.clone(), second.clone()]).await;

    // The first pack alone (a smaller batch, as after `batch_max_rows` was lowered): it cannot be that attempt, so
    // version 1 is committed empty and the pack goes to version 2.
    let (committed, _) = committed_within(publisher, std::slice::from_ref(&first), TTL * 6).await;
    assert_eq!(committed, 2);
    let publishes = catalog
        .server
        .query(&format!(
            "SELECT version, publish_id, packs, captures FROM {} WHERE catalog = '{}' ORDER BY version FORMAT TSV",
            catalog.tables.publishes, catalog.config.catalog_name
        ))
        .unwrap();
    let publishes: Vec<Vec<&str>> = publishes.lines().map(|line| line.split('\t').collect()).collect();
    assert_eq!(publishes.len(), 2, "{publishes:?}");
    assert_eq!((publishes[0][0], publishes[0][2], publishes[0][3]), ("1", "0", "0"), "{publishes:?}");
    assert_ne!(vec![publishes[0][1].to_string()], in_doubt, "the empty commit is not the attempt in doubt");

    // The attempt in doubt lands once more, after both commits, and a merge keeps one row of each capture: the
    // first pack's captures are listed from version 2, the second's from nowhere until it is published.
    land_again_and_merge(&catalog, 1, &in_doubt[0]);
    let expected: Vec<String> = ids[..3].iter().map(Uuid::to_string).collect();
    assert_eq!(listed(&catalog, Some("s")).await, expected);
    assert_eq!(listed(&catalog, None).await, expected);
    let published = loop {
        match publisher.publish_batch(std::slice::from_ref(&second)).await {
            Err(PublishError::NotCommitted | PublishError::NoLease) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => break other.unwrap(),
        }
    };
    assert!(matches!(published, PublishOutcome::Committed { version: 3, .. }), "{published:?}");
    let expected: Vec<String> = ids.iter().map(Uuid::to_string).collect();
    assert_eq!(listed(&catalog, Some("s")).await, expected);
    assert_eq!(listed(&catalog, None).await, expected);
}

for_each_version!(rows_in_doubt_of_a_holder_on_another_spool_stay_below_what_its_successor_publishes);
async fn rows_in_doubt_of_a_holder_on_another_spool_stay_below_what_its_successor_publishes(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, true).await;
    let now = capstore::util::now_ns();
    let ids: Vec<Uuid> = (0..4).map(|_| Uuid::now_v7()).collect();
    let batch = vec![pack(&ids.iter().enumerate().map(|(at, id)| (*id, "s", now + at as u64)).collect::<Vec<_>>())];
    // The first holder's rows land with their reply lost; it stops (its insert might still be on its way).
    let first = publishing(&catalog, "first").await;
    let in_doubt = publish_losing_the_captures_reply(&catalog, &first.publisher, &batch).await;
    assert_eq!(in_doubt.len(), 1, "{in_doubt:?}");
    first.shutdown_tx.send(true).unwrap();
    first.keeper_task.await.unwrap();

    // A holder on another spool publishes the same pack (as from the first one's upload intent): its first publish
    // commits version 1 empty, and the pack goes to version 2.
    let Publishing { publisher, shutdown_tx, keeper_task } = publishing(&catalog, "second").await;
    let published = loop {
        match publisher.publish_batch(&batch).await {
            Err(PublishError::NotCommitted | PublishError::NoLease) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => break other.unwrap(),
        }
    };
    assert!(matches!(published, PublishOutcome::Committed { version: 2, .. }), "{published:?}");
    assert_eq!(catalog.committed_versions(), vec![1, 2]);
    assert_eq!(attempts_at(&catalog, 1), in_doubt, "version 1 holds no rows but the first holder's");

    // The first holder's insert lands once more, after the successor's commits, and a merge keeps one row of each
    // capture: the successor's, at the higher version.
    land_again_and_merge(&catalog, 1, &in_doubt[0]);
    let kept = format!(
        "SELECT count() FROM {} FINAL WHERE catalog = '{}' AND version = 2 AND capture_id IN ({})",
        catalog.tables.captures,
        catalog.config.catalog_name,
        ids.iter().map(|id| format!("'{id}'")).collect::<Vec<_>>().join(", ")
    );
    assert_eq!(catalog.server.query(&kept).unwrap().trim(), ids.len().to_string(), "the merge kept the orphans");
    let expected: Vec<String> = ids.iter().map(Uuid::to_string).collect();
    assert_eq!(listed(&catalog, Some("s")).await, expected);
    assert_eq!(listed(&catalog, None).await, expected);
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();
}

for_each_version!(an_empty_commit_owed_to_an_earlier_holder_is_still_owed_after_the_lease_was_lost_before_it);
async fn an_empty_commit_owed_to_an_earlier_holder_is_still_owed_after_the_lease_was_lost_before_it(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, true).await;
    let proxy = catalog.proxy.as_ref().unwrap();
    let batch = vec![one_capture_pack()];
    let first = publishing(&catalog, "first").await;
    first.shutdown_tx.send(true).unwrap();
    first.keeper_task.await.unwrap();

    // The second holder follows the first: it owes an empty commit. The catalog is cut before its first publish,
    // for longer than the lease: the tenure ends with nothing committed, and the next claim follows its own term.
    let keeper = catalog.keeper(identity("second"));
    let (shutdown_tx, mut shutdown_rx) = watch::channel(false);
    keeper.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
    let handle = keeper.handle();
    assert!(handle.owes_empty_commit());
    let keeper_task = tokio::spawn(keeper.run(shutdown_rx));
    let publisher =
        Publisher::new(catalog.client.clone(), catalog.tables.clone(), &catalog.config.catalog_name, handle.clone());
    proxy.cut();
    assert!(publisher.publish_batch(&batch).await.is_err());
    until_lease_lost_in_the_cut(&handle).await;
    proxy.pass();
    wait_for_state(&handle, LeaseState::Held, TTL * 4).await;
    assert!(handle.owes_empty_commit(), "the empty commit is still owed");
    let published = loop {
        match publisher.publish_batch(&batch).await {
            Ok(outcome) => break outcome,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    assert!(matches!(published, PublishOutcome::Committed { version: 2, .. }), "{published:?}");
    assert!(!handle.owes_empty_commit());
    let empty = format!(
        "SELECT count() FROM {} WHERE catalog = '{}' AND version = 1 AND packs = 0 AND captures = 0",
        catalog.tables.publishes, catalog.config.catalog_name
    );
    assert_eq!(catalog.server.query(&empty).unwrap().trim(), "1");
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();
}

for_each_version!(a_black_holed_clickhouse_ends_every_lease_request_at_its_timeout);
async fn a_black_holed_clickhouse_ends_every_lease_request_at_its_timeout(server: &'static ClickHouseServer) {
    let catalog = catalog(server, true).await;
    let proxy = catalog.proxy.as_ref().unwrap();
    let store = catalog.store(&catalog.config.catalog_name);
    let who = identity("stuck");
    proxy.blackhole();
    let request_timeout = catalog.config.catalog.request_timeout.0;
    let bound = request_timeout + Duration::from_secs(2);
    for attempt in 0..3 {
        let started = Instant::now();
        let outcome = tokio::time::timeout(bound, store.claim("lease-x", &who)).await;
        let elapsed = started.elapsed();
        let error = outcome.expect("the claim hung past its request timeout").unwrap_err();
        assert_eq!(error.kind, ErrorKind::OutcomeUnknown, "attempt {attempt}: {error}");
        assert!(elapsed >= request_timeout, "attempt {attempt} ended before the timeout: {elapsed:?}");
        let started = Instant::now();
        let renewal = tokio::time::timeout(bound, store.renew("lease-x", &who, 1)).await;
        assert!(renewal.expect("the renewal hung").is_err());
        assert!(started.elapsed() >= request_timeout);
    }
    let keeper = catalog.keeper(who.clone());
    let (_shutdown_tx, mut shutdown_rx) = watch::channel(false);
    let started = Instant::now();
    let start =
        tokio::time::timeout(Duration::from_secs(8), keeper.acquire_at_start(Duration::ZERO, &mut shutdown_rx)).await;
    assert!(start.is_err(), "an unreachable catalog is not a refusal: the start keeps retrying");
    assert!(started.elapsed() < Duration::from_secs(9));
    proxy.pass();
}

for_each_version!(schema_is_idempotent_and_a_newer_schema_is_refused);
async fn schema_is_idempotent_and_a_newer_schema_is_refused(server: &'static ClickHouseServer) {
    let catalog = catalog(server, false).await;
    capstore::catalog::schema::ensure_schema(&catalog.client, &catalog.tables).await.unwrap();
    catalog
        .server
        .query(&format!(
            "INSERT INTO {} (component, version, written_at_ms) VALUES ('catalog', 99, 0)",
            catalog.tables.schema
        ))
        .unwrap();
    let error = capstore::catalog::schema::ensure_schema(&catalog.client, &catalog.tables).await.unwrap_err();
    let text = error.to_string();
    assert!(text.contains("99") && text.contains("newer"), "{text}");
    // A reader's check (the stamp and the repartition mark in one statement) refuses it the same way.
    let error = capstore::catalog::schema::check_schema(&catalog.client, &catalog.tables).await.unwrap_err();
    let text = error.to_string();
    assert!(text.contains("99") && text.contains("newer"), "{text}");
}

/// The tables of a schema 1 catalog, as the first wave created them (no index tables, no views).
fn schema_1_ddl(tables: &Tables) -> Vec<String> {
    vec![
        format!("CREATE DATABASE IF NOT EXISTS {}", tables.database),
        format!(
            "CREATE TABLE {} (catalog String, stream String, captured_at_ns UInt64, capture_id String, \
             pack_id String, object_key String, record_offset UInt64, record_len UInt64, payload_offset UInt64, \
             payload_len UInt64, crc32c UInt32, label_keys Array(String), label_values Array(String), \
             content_type String, version UInt64, publish_id String) \
             ENGINE = ReplacingMergeTree(version) ORDER BY (catalog, stream, captured_at_ns, capture_id)",
            tables.captures
        ),
        format!(
            "CREATE TABLE {} (catalog String, pack_id String, object_key String, bytes UInt64, sha256 String, \
             records UInt64, first_captured_at_ns UInt64, last_captured_at_ns UInt64, version UInt64, \
             publish_id String) ENGINE = ReplacingMergeTree(version) ORDER BY (catalog, pack_id)",
            tables.packs
        ),
        format!(
            "CREATE TABLE {} (catalog String, version UInt64, publish_id String, holder String, lease_term UInt64, \
             packs UInt64, captures UInt64, published_at_ms UInt64) ENGINE = MergeTree() \
             ORDER BY (catalog, version, publish_id)",
            tables.publishes
        ),
        format!(
            "CREATE TABLE {} (catalog String, term UInt64, lease_id String, holder String, written_at_ms UInt64, \
             expires_at_ms UInt64, kind String) ENGINE = MergeTree() ORDER BY (catalog, term, lease_id)",
            tables.lease
        ),
        format!(
            "CREATE TABLE {} (component String, version UInt32, written_at_ms UInt64) ENGINE = MergeTree() \
             ORDER BY component",
            tables.schema
        ),
        format!("INSERT INTO {} VALUES ('catalog', 1, 0)", tables.schema),
    ]
}

/// What a schema 1 publisher writes for one capture at `version`: its row, then (when `commit`) the publishes row.
fn schema_1_publish(tables: &Tables, catalog: &str, id: Uuid, version: u64, commit: bool) -> Vec<String> {
    let publish_id = Uuid::now_v7();
    let mut statements = vec![format!(
        "INSERT INTO {} (catalog, stream, captured_at_ns, capture_id, pack_id, object_key, record_offset, \
         record_len, payload_offset, payload_len, crc32c, label_keys, label_values, content_type, version, \
         publish_id) VALUES ('{catalog}', 'old/stream', {at}, '{id}', '{pack}', 'k/{pack}.cpk', 40, 100, 100, 40, 7, \
         ['site'], ['berlin'], '', {version}, '{publish_id}')",
        tables.captures,
        at = 1_000 + version,
        pack = Uuid::now_v7(),
    )];
    if commit {
        statements.push(format!(
            "INSERT INTO {} VALUES ('{catalog}', {version}, '{publish_id}', 'old', 1, 1, 1, 0)",
            tables.publishes
        ));
    }
    statements
}

for_each_version!(a_schema_1_catalog_is_upgraded_and_its_captures_are_found_by_id_and_by_version);
async fn a_schema_1_catalog_is_upgraded_and_its_captures_are_found_by_id_and_by_version(
    server: &'static ClickHouseServer,
) {
    let database = server.fresh_database("upgrade");
    let config = config_for(&server.url(), &database, "old-catalog");
    let tables = Tables::from_config(&config.catalog);
    let (before, orphan, while_running) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let mut statements = schema_1_ddl(&tables);
    statements.extend(schema_1_publish(&tables, "old-catalog", before, 1, true));
    statements.extend(schema_1_publish(&tables, "old-catalog", orphan, 2, false));
    for statement in &statements {
        server.query(statement).unwrap_or_else(|error| panic!("{statement}: {error}"));
    }

    let (client, tables) = capstore::catalog::connect(&config).await.expect("the upgrade");
    let stamps = server.query(&format!("SELECT max(version) FROM {} FORMAT TSV", tables.schema)).unwrap();
    assert_eq!(stamps.trim(), capstore::catalog::schema::STAMPED_AT_START.to_string());
    let reader = CatalogReader::new(client.clone(), tables.clone(), "old-catalog");
    assert_eq!(reader.watermark().await.unwrap(), 1, "the watermark table was filled from the old publishes");
    let found = reader.get(before, None).await.unwrap().expect("a capture published before the upgrade");
    assert_eq!((found.stream.as_str(), found.captured_at_ns, found.version), ("old/stream", 1_001, 1));
    assert_eq!(found.labels_map().get("site").map(String::as_str), Some("berlin"));
    assert!(reader.get(orphan, None).await.unwrap().is_none(), "an orphan row is indexed but never visible");
    let of_version: Vec<String> =
        reader.captures_of_version(1).await.unwrap().into_iter().map(|c| c.capture_id).collect();
    assert_eq!(of_version, vec![before.to_string()]);

    // A schema 1 daemon that was already running goes on writing into `captures` and `publishes` only: the views
    // index its rows (version 2 here; the orphan's uncommitted version 2 stays invisible beside it).
    for statement in schema_1_publish(&tables, "old-catalog", while_running, 2, true) {
        server.query(&statement).unwrap();
    }
    assert_eq!(reader.watermark().await.unwrap(), 2);
    assert_eq!(reader.get(while_running, None).await.unwrap().expect("indexed by the views").version, 2);
    assert!(reader.get(orphan, None).await.unwrap().is_none());
    assert_eq!(reader.captures_of_version(2).await.unwrap().len(), 1);
    // Pinned reads: at watermark 1 the later capture does not exist yet.
    assert!(reader.get(while_running, Some(1)).await.unwrap().is_none());
    assert_eq!(reader.get(before, Some(1)).await.unwrap().unwrap().version, 1);

    // A second start (or a second daemon upgrading at the same time) copies nothing it would show twice.
    capstore::catalog::schema::ensure_schema(&client, &tables).await.unwrap();
    assert_eq!(reader.captures_of_version(1).await.unwrap().len(), 1);
}

for_each_version!(the_watermark_is_exact_whether_its_lower_bound_lags_or_runs_ahead);
async fn the_watermark_is_exact_whether_its_lower_bound_lags_or_runs_ahead(server: &'static ClickHouseServer) {
    let catalog = catalog(server, false).await;
    let name = &catalog.config.catalog_name;
    for version in 1..=3 {
        let publish_id = Uuid::now_v7();
        catalog.insert_capture_row(Uuid::now_v7(), "s", 1_000 + version, version, publish_id);
        catalog.commit_row(version, publish_id);
    }
    let reader = catalog.reader();
    // A listing reads the watermark inside its setup statement: it must agree with `watermark()` every time.
    let listed = || async {
        let page = reader.list(&ListQuery { limit: 10, ..Default::default() }).await.unwrap();
        (page.watermark, page.captures.len())
    };
    assert_eq!(reader.watermark().await.unwrap(), 3);
    assert_eq!(listed().await, (3, 3));
    let bound = |sql: &str| server.query(&format!("{sql} FORMAT TSV")).unwrap().trim().to_string();
    let bound_sql = format!("SELECT maxMerge(version) FROM {} WHERE catalog = '{name}'", catalog.tables.watermark);
    assert_eq!(bound(&bound_sql), "3", "the view keeps the lower bound current");

    server.query(&format!("TRUNCATE TABLE {}", catalog.tables.watermark)).unwrap();
    assert_eq!(reader.watermark().await.unwrap(), 3, "a lagging bound only widens the range read");
    assert_eq!(listed().await, (3, 3));
    server.query(&format!("INSERT INTO {} SELECT '{name}', maxState(toUInt64(99))", catalog.tables.watermark)).unwrap();
    assert_eq!(bound(&bound_sql), "99");
    assert_eq!(reader.watermark().await.unwrap(), 3, "a bound beyond the publishes falls back to reading them all");
    assert_eq!(listed().await, (3, 3));
}

for_each_version!(a_reader_of_tables_without_horizons_lists_them_in_separate_statements);
/// A page's setup is one statement that reads `horizons`, which tables made before schema 6 lack until a daemon of
/// this build starts on them: a reader (`capstore ls`) of such tables lists them all the same.
async fn a_reader_of_tables_without_horizons_lists_them_in_separate_statements(server: &'static ClickHouseServer) {
    let catalog = catalog(server, false).await;
    let mut ids = Vec::new();
    for version in 1..=3 {
        let (capture, publish_id) = (Uuid::now_v7(), Uuid::now_v7());
        catalog.insert_capture_row(capture, "s", 1_000 + version, version, publish_id);
        catalog.commit_row(version, publish_id);
        ids.push(capture.to_string());
    }
    server.query(&format!("DROP TABLE {}", catalog.tables.horizons)).unwrap();
    let reader = catalog.reader();
    for stream in [None, Some("s".to_string())] {
        let mut listed = Vec::new();
        let mut cursor = None;
        loop {
            let query = ListQuery { stream: stream.clone(), limit: 2, cursor, ..Default::default() };
            let page = reader.list(&query).await.unwrap();
            assert_eq!(page.watermark, 3);
            listed.extend(page.captures.into_iter().map(|capture| capture.capture_id));
            cursor = page.next_cursor;
            if cursor.is_none() {
                break;
            }
        }
        assert_eq!(listed, ids, "every capture in time order, over two pages ({stream:?})");
    }
}

for_each_version!(a_read_over_read_max_memory_fails_naming_the_key_and_the_server_stays_up);
async fn a_read_over_read_max_memory_fails_naming_the_key_and_the_server_stays_up(server: &'static ClickHouseServer) {
    let database = server.fresh_database("memory");
    let mut config = config_for(&server.url(), &database, "big");
    config.catalog.read_max_memory = capstore::config::ByteSize(64 * 1024 * 1024);
    config.validate().unwrap();
    let (client, tables) = capstore::catalog::connect(&config).await.unwrap();
    // 300,000 committed captures in one version at the same instant (no time window can split them), and ten more
    // at instants of their own; written on the server.
    let publish_id = Uuid::now_v7();
    server
        .query(&format!(
            "INSERT INTO {} (catalog, stream, captured_at_ns, capture_id, version, publish_id, label_keys, label_values) \
             SELECT 'big', if(number < 300000, concat('s/', toString(number % 10)), 'small'), \
             if(number < 300000, 5, number), toString(generateUUIDv4()), 1, '{publish_id}', \
             ['site'], [concat('site-', toString(number))] FROM numbers(300010)",
            tables.captures
        ))
        .unwrap();
    server
        .query(&format!("INSERT INTO {} VALUES ('big', 1, '{publish_id}', 'h', 1, 1, 300010, 0)", tables.publishes))
        .unwrap();
    let reader = CatalogReader::new(client, tables, "big");
    let error = reader.list(&ListQuery { limit: 10, ..Default::default() }).await.unwrap_err();
    assert!(error.to_string().contains("catalog.read_max_memory"), "{error}");
    // Reads that stay within the limit go on working.
    assert_eq!(reader.watermark().await.unwrap(), 1);
    let small = ListQuery { stream: Some("small".into()), limit: 100, ..Default::default() };
    let page = reader.list(&small).await.unwrap();
    let times: Vec<u64> = page.captures.iter().map(|c| c.captured_at_ns).collect();
    assert_eq!(times, (300_000..300_010).collect::<Vec<u64>>());
}

for_each_version!(reads_of_a_few_granules_run_on_one_server_thread_and_reads_that_grow_do_not);
async fn reads_of_a_few_granules_run_on_one_server_thread_and_reads_that_grow_do_not(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, true).await;
    let publish_id = Uuid::now_v7();
    let capture = Uuid::now_v7();
    catalog.insert_capture_row(capture, "s/1", 1_000, 1, publish_id);
    catalog.commit_row(1, publish_id);
    let reader = catalog.reader();
    let proxy = catalog.proxy.as_ref().unwrap();
    // (The setting is in the request's URL, which travels in one chunk with the request's head.)
    let one_thread = proxy.count_requests_containing("max_threads=1");
    let requests = proxy.count_requests_containing("POST /");
    let count = |counter: &Arc<AtomicU64>| counter.load(Ordering::SeqCst);

    // Reads whose rows read grow with the catalog keep the server's threads.
    let (one_thread_before, requests_before) = (count(&one_thread), count(&requests));
    assert_eq!(reader.committed_packs().await.unwrap().len(), 0);
    assert_eq!(reader.streams().await.unwrap().len(), 1);
    assert_eq!(count(&one_thread), one_thread_before, "a read that grows ran on one thread");
    assert_eq!(count(&requests), requests_before + 2, "the reads did not go through the proxy");

    // The watermark, a lookup by id (and the horizons beside it), a page's setup and the lease head each read a few
    // granules, on one thread.
    let before = count(&one_thread);
    assert_eq!(reader.watermark().await.unwrap(), 1);
    assert_eq!(count(&one_thread), before + 1, "the watermark did not run on one thread");
    let before = count(&one_thread);
    assert!(reader.get(capture, None).await.unwrap().is_some());
    assert_eq!(count(&one_thread), before + 2, "a lookup and its horizons did not run on one thread");
    // A small page of a stream: its setup and its window on one thread, the window's check in `by_id` beside it not.
    let (before, requests_before) = (count(&one_thread), count(&requests));
    let page = reader.list(&ListQuery { stream: Some("s/1".into()), limit: 10, ..Default::default() }).await.unwrap();
    assert_eq!(page.captures.len(), 1);
    assert_eq!(count(&requests), requests_before + 3, "a first page is its setup, a window and its check");
    assert_eq!(count(&one_thread), before + 2, "a small page's setup and window did not run on one thread");
    // A label filter's window grows with how rare the label is, and a page of more than FEW_ROWS_PAGE captures
    // with its size: each keeps the server's threads (as the check in `by_id` does); their setups do not.
    let labelled = ListQuery {
        stream: Some("s/1".into()),
        labels: BTreeMap::from([("site".to_string(), "a".to_string())]),
        limit: 10,
        ..Default::default()
    };
    let big = ListQuery { stream: Some("s/1".into()), limit: 5000, ..Default::default() };
    for query in [labelled, big] {
        let (before, requests_before) = (count(&one_thread), count(&requests));
        reader.list(&query).await.unwrap();
        assert_eq!(count(&requests), requests_before + 3, "{query:?}: not a setup, a window and its check");
        assert_eq!(count(&one_thread), before + 1, "{query:?}: a window that grows ran on one thread");
    }
    let before = count(&one_thread);
    catalog.store(&catalog.config.catalog_name).read_head().await.unwrap();
    assert_eq!(count(&one_thread), before + 1, "the lease head was not read on one thread");
}

for_each_version!(a_statement_works_its_scalar_subqueries_out_from_left_to_right, flavor = "current_thread", versions = [v26_7 => V26_7, v26_9 => V26_9]);
/// A page's setup and a short range's count read the watermark first in their statement, and rely on the server
/// working its scalar subqueries out from left to right: what they read after the watermark holds everything up to it
/// (the setup's time bounds, and the count that ends an empty range's page). 18.16 does so, and no release of it will
/// change; this checks the releases that may, by the order of UUIDv7s made in three subqueries (18.16 has no
/// `generateUUIDv7`).
async fn a_statement_works_its_scalar_subqueries_out_from_left_to_right(server: &'static ClickHouseServer) {
    for _ in 0..20 {
        let made = server
            .query(
                "SELECT (SELECT toString(generateUUIDv7(1)) FROM system.one), (SELECT toString(generateUUIDv7(2)) FROM \
                 system.one), (SELECT toString(generateUUIDv7(3)) FROM system.one) FORMAT TSV",
            )
            .unwrap();
        let ids: Vec<&str> = made.trim().split('\t').collect();
        assert_eq!(ids.len(), 3, "{made}");
        // A UUIDv7's text sorts by the time and then the counter it was made with.
        assert!(ids[0] < ids[1] && ids[1] < ids[2], "not worked out from left to right: {ids:?}");
    }
}

for_each_version!(a_short_range_without_rows_is_answered_by_its_count_alone);
/// The first page of a range with both ends that holds no row (a quiet stream's 10 s) is the one statement that reads
/// the watermark and counts the range: empty, at that watermark, with no cursor. A range whose rows are all
/// uncommitted is counted, so it is read and checked as before, and shows nothing either.
async fn a_short_range_without_rows_is_answered_by_its_count_alone(server: &'static ClickHouseServer) {
    let catalog = catalog(server, true).await;
    let (committed, orphan) = (Uuid::now_v7(), Uuid::now_v7());
    let (capture, orphan_capture) = (Uuid::now_v7(), Uuid::now_v7());
    catalog.insert_capture_row(capture, "s/1", 1_000, 1, committed);
    catalog.commit_row(1, committed);
    // An attempt at version 1 that lost it: its row is in the tables, and no reader may show it.
    catalog.insert_capture_row(orphan_capture, "s/1", 5_000, 1, orphan);
    let reader = catalog.reader();
    let requests = catalog.statements();
    let count = || requests.load(Ordering::SeqCst);
    let range = |stream: Option<&str>, since: u64, until: u64| ListQuery {
        stream: stream.map(str::to_string),
        since_ns: Some(since),
        until_ns: Some(until),
        limit: 10,
        ..Default::default()
    };
    // Across streams too, once the reader knows the listing's table (a first listing tells it).
    reader.list(&range(None, 0, 10_000)).await.unwrap();

    for stream in [Some("s/1"), None] {
        let before = count();
        let page = reader.list(&range(stream, 2_000, 4_000)).await.unwrap();
        assert_eq!(count(), before + 1, "{stream:?}: an empty range took more than its count");
        assert!(page.captures.is_empty() && page.next_cursor.is_none(), "{stream:?}: {page:?}");
        assert_eq!(page.watermark, 1);
        let before = count();
        let pinned = reader.list(&ListQuery { watermark: Some(1), ..range(stream, 2_000, 4_000) }).await.unwrap();
        assert_eq!(count(), before + 1, "{stream:?}: an empty range at a pinned watermark took more than its count");
        assert!(pinned.captures.is_empty() && pinned.next_cursor.is_none());
        assert_eq!(pinned.watermark, 1);

        // The orphan's range has a row: read in a window, checked against the publishes, and shows nothing.
        let before = count();
        let page = reader.list(&range(stream, 4_000, 6_000)).await.unwrap();
        assert!(count() > before + 1, "{stream:?}: a range with a row was answered by its count");
        assert!(page.captures.is_empty(), "{stream:?}: an uncommitted row was listed: {page:?}");
        // The committed capture's range lists it.
        let page = reader.list(&range(stream, 500, 1_500)).await.unwrap();
        let listed: Vec<&str> = page.captures.iter().map(|c| c.capture_id.as_str()).collect();
        assert_eq!(listed, [capture.to_string().as_str()], "{stream:?}");
    }
}

for_each_version!(a_short_range_is_read_in_one_window_beside_its_horizons_and_a_longer_one_from_its_setup);
/// The first page of a range with both ends (`ls --since --until`) holding no more than four pages' rows reads the
/// whole range in one window at the watermark, its horizons beside it, without the page's setup; a range holding
/// more is read from its setup, in windows sized by its density. Either way the pages are the same.
async fn a_short_range_is_read_in_one_window_beside_its_horizons_and_a_longer_one_from_its_setup(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, false).await;
    let name = &catalog.config.catalog_name;
    // 30,000 captures of s/1, one µs apart from 1 s on, at version 1.
    let publish_id = Uuid::now_v7();
    server
        .query(&format!(
            "INSERT INTO {} (catalog, stream, captured_at_ns, capture_id, version, publish_id) SELECT '{name}', 's/1', \
             1000000000 + number * 1000, toString(generateUUIDv4()), 1, '{publish_id}' FROM numbers(30000)",
            catalog.tables.captures
        ))
        .unwrap();
    catalog.commit_row(1, publish_id);
    let reader = catalog.reader();
    let everything = list_all(&reader, ListQuery { limit: 10_000, ..Default::default() }).await;
    assert_eq!(everything.len(), 30_000);
    let in_range = |since: u64, until: u64| -> Vec<(u64, String)> {
        everything.iter().filter(|(at, _)| (since..until).contains(at)).cloned().collect()
    };

    // 50 captures in the range: one window, the whole range.
    let (since, until) = (1_000_000_000 + 10_000_000, 1_000_000_000 + 10_050_000);
    let query = ListQuery {
        stream: Some("s/1".into()),
        since_ns: Some(since),
        until_ns: Some(until),
        limit: 100,
        ..Default::default()
    };
    let page = reader.list(&query).await.unwrap();
    let listed = positions(&page);
    assert_eq!(listed, in_range(since, until));
    assert_eq!(page.first_window_ns(), until - since, "not read in one window of the whole range");
    assert!(page.next_cursor.is_none());
    // 40 of them, pages of 10: four pages' rows, still one window; the cursor goes on after the tenth.
    let query = ListQuery { limit: 10, until_ns: Some(since + 40_000), ..query };
    let page = reader.list(&query).await.unwrap();
    assert_eq!(page.first_window_ns(), 40_000);
    assert_eq!(page.captures.len(), 10);
    assert_eq!(list_all(&reader, query.clone()).await, in_range(since, since + 40_000));

    // Across streams: the listing's table (`by_time`, where the server keeps it) is known after a first listing.
    let across = ListQuery { stream: None, ..query.clone() };
    let first = reader.list(&across).await.unwrap();
    let again = reader.list(&across).await.unwrap();
    for page in [&first, &again] {
        let listed = positions(page);
        assert_eq!(listed, in_range(since, since + 40_000)[..10]);
    }
    assert_eq!(again.first_window_ns(), 40_000, "across streams not read in one window of the whole range");

    // All 30,000 with a page of 10: more than four pages, so the page is read from its setup, in a window sized by
    // the stream's density; the pages still list every capture once.
    let (since, until) = (0, 1_000_000_000 + 30_000_000);
    let query = ListQuery {
        stream: Some("s/1".into()),
        since_ns: Some(since),
        until_ns: Some(until),
        limit: 10,
        ..Default::default()
    };
    let page = reader.list(&query).await.unwrap();
    assert!(page.first_window_ns() < until - since, "read in one window of {} ns", page.first_window_ns());
    let listed = positions(&page);
    assert_eq!(listed, everything[..10]);
    assert_eq!(list_all(&reader, ListQuery { limit: 5000, ..query }).await, everything);

    // A retention horizon in the middle of a short range, committed at version 2: a page at the watermark lists
    // from the horizon on; one pinned at version 1, below it, lists the whole range.
    let horizon_id = Uuid::now_v7();
    let before_ns = 1_000_000_000 + 10_025_000;
    catalog.insert_horizon_row(2, before_ns, horizon_id);
    catalog.commit_row(2, horizon_id);
    let (since, until) = (1_000_000_000 + 10_000_000, 1_000_000_000 + 10_050_000);
    let query = ListQuery {
        stream: Some("s/1".into()),
        since_ns: Some(since),
        until_ns: Some(until),
        limit: 100,
        ..Default::default()
    };
    let page = reader.list(&query).await.unwrap();
    let listed = positions(&page);
    assert_eq!(listed, in_range(before_ns, until), "the horizon read beside the window hides what is before it");
    let pinned = reader.list(&ListQuery { watermark: Some(1), ..query }).await.unwrap();
    let listed = positions(&pinned);
    assert_eq!(listed, in_range(since, until), "a page pinned below the horizon lists the whole range");
    assert_eq!(pinned.watermark, 1);
}

for_each_version!(a_horizon_row_hides_captures_only_once_its_own_publish_is_committed);
/// A reader takes a row of `horizons` as a horizon only once `publishes` commits its `(version, publish_id)`: not
/// while its version is uncommitted (and it asks again later, when the version may have been committed), never when
/// another publish was committed at its version. A listing's setup, `get` and a read of the horizons agree, on a
/// reader that has met the rows before and on a fresh one.
async fn a_horizon_row_hides_captures_only_once_its_own_publish_is_committed(server: &'static ClickHouseServer) {
    let catalog = catalog(server, true).await;
    // 30 captures of s/1, one a second from 1 s on, at version 1.
    let publish_id = Uuid::now_v7();
    let captures: Vec<Uuid> = (0..30).map(|_| Uuid::now_v7()).collect();
    for (n, capture) in captures.iter().enumerate() {
        catalog.insert_capture_row(*capture, "s/1", (n as u64 + 1) * 1_000_000_000, 1, publish_id);
    }
    catalog.commit_row(1, publish_id);
    let query = ListQuery { limit: 100, ..Default::default() };
    let warm = catalog.reader();
    let listed = |page: &Page| page.captures.iter().map(|c| c.capture_id.clone()).collect::<Vec<_>>();
    let from = |first: usize| captures[first..].iter().map(Uuid::to_string).collect::<Vec<_>>();
    assert_eq!(listed(&warm.list(&query).await.unwrap()), from(0));

    // A horizon before 10 s at version 2, its publish not committed (yet): it hides nothing.
    let horizon = Uuid::now_v7();
    catalog.insert_horizon_row(2, 10_000_000_000, horizon);
    for reader in [&warm, &catalog.reader()] {
        assert_eq!(listed(&reader.list(&query).await.unwrap()), from(0), "an uncommitted horizon hid captures");
        assert!(reader.get(captures[0], None).await.unwrap().is_some());
        assert_eq!(reader.horizons(u64::MAX).await.unwrap().before_at(u64::MAX), 0);
    }
    // Committed: from then on it hides what was captured before 10 s, on the reader that met it uncommitted too.
    catalog.commit_row(2, horizon);
    for reader in [&warm, &catalog.reader()] {
        let page = reader.list(&query).await.unwrap();
        assert_eq!(listed(&page), from(9), "a committed horizon hid nothing");
        assert_eq!(page.watermark, 2);
        assert!(reader.get(captures[0], None).await.unwrap().is_none(), "get found a capture below the horizon");
        assert_eq!(reader.horizons(u64::MAX).await.unwrap().before_at(u64::MAX), 10_000_000_000);
        let pinned = reader.list(&ListQuery { watermark: Some(1), ..query.clone() }).await.unwrap();
        assert_eq!(listed(&pinned), from(0), "a page pinned below the horizon lost captures");
    }
    // A horizon before 20 s at version 3, where another publish is committed: never a horizon.
    catalog.insert_horizon_row(3, 20_000_000_000, Uuid::now_v7());
    catalog.commit_row(3, Uuid::now_v7());
    for reader in [&warm, &catalog.reader()] {
        for _ in 0..2 {
            let page = reader.list(&query).await.unwrap();
            assert_eq!(listed(&page), from(9), "a horizon row of an uncommitted publish hid captures");
            assert_eq!(page.watermark, 3);
            assert!(reader.get(captures[15], None).await.unwrap().is_some());
            assert_eq!(reader.horizons(u64::MAX).await.unwrap().before_at(u64::MAX), 10_000_000_000);
        }
    }
    // A reader checks a row against `publishes` once: a fresh one reads `horizons` and `publishes`, then `horizons`
    // alone.
    let requests = catalog.statements();
    let fresh = catalog.reader();
    for expected in [2, 1, 1] {
        let before = requests.load(Ordering::SeqCst);
        assert_eq!(fresh.horizons(u64::MAX).await.unwrap().before_at(u64::MAX), 10_000_000_000);
        assert_eq!(requests.load(Ordering::SeqCst), before + expected, "statements for the horizons");
    }
}

for_each_version!(a_reader_starts_a_first_page_at_a_horizon_it_has_not_checked_yet);
/// A first page's setup takes a horizon row it has no verdict on as committed (it is, but for a failed publish's
/// orphan), so its first window starts at the horizon and is sized by the time after it: the time bounds still
/// reach back to captures the horizon hides. The check beside that window confirms it.
async fn a_reader_starts_a_first_page_at_a_horizon_it_has_not_checked_yet(server: &'static ClickHouseServer) {
    let catalog = catalog(server, true).await;
    // 3000 captures of s/1, 10 ms apart, from 10 ms to 30 s, at version 1; a horizon before 10 s at version 2.
    let publish_id = Uuid::now_v7();
    catalog.insert_numbered_captures(3000, "(number + 1) * 10000000", "[], []", 1, publish_id);
    catalog.commit_row(1, publish_id);
    let horizon = Uuid::now_v7();
    catalog.insert_horizon_row(2, 10_000_000_000, horizon);
    catalog.commit_row(2, horizon);
    let query = ListQuery { stream: Some("s/1".into()), limit: 100, ..Default::default() };
    let requests = catalog.statements();
    for reader in [catalog.reader(), catalog.reader()] {
        // Twice on one reader: without a verdict, then with it. The same windows either way (the first, 1/64 of the
        // time from the horizon to the last capture, holds 32 captures, and the next, eight times as wide, the rest
        // of the page), each with its check in `by_id`, after the setup; without a verdict, beside the first window,
        // the horizons and their check. (Started at the first capture, a page reads more: a window before the
        // horizon, or the page again once the horizon is checked.)
        for statements in [7, 5] {
            let before = requests.load(Ordering::SeqCst);
            let page = reader.list(&query).await.unwrap();
            let times: Vec<u64> = page.captures.iter().map(|c| c.captured_at_ns).collect();
            assert_eq!(times, (1000..1100u64).map(|n| n * 10_000_000).collect::<Vec<_>>());
            assert_eq!(page.first_window_ns(), (30_000_000_000 + 1 - 10_000_000_000) / 64);
            assert_eq!(requests.load(Ordering::SeqCst), before + statements, "statements of a first page");
        }
    }
    // A listing across catalogs makes a reader of each of its catalogs for every page: those made from one reader
    // (the HTTP API's, here one of another catalog) learn as one reader does.
    let fleet_reader = CatalogReader::new(catalog.client.clone(), catalog.tables.clone(), "another");
    let catalogs = [catalog.config.catalog_name.clone()];
    for statements in [7, 5] {
        let before = requests.load(Ordering::SeqCst);
        let page = capstore::catalog::fleet::list(&fleet_reader, &catalogs, &query, usize::MAX, |_| 1).await.unwrap();
        let times: Vec<u64> = page.captures.iter().map(|c| c.capture.captured_at_ns).collect();
        assert_eq!(times, (1000..1100u64).map(|n| n * 10_000_000).collect::<Vec<_>>());
        assert_eq!(requests.load(Ordering::SeqCst), before + statements, "statements of a fleet's first page");
    }
}

for_each_version!(a_reader_uses_its_density_sample_again_for_the_next_first_pages_of_a_listing);
/// A first page sizes its window by the catalog's density, sampled in its setup; the next first pages of the same
/// listing on one reader (the HTTP API's) use that sample again for a while instead of reading it in every setup. A
/// window sized by an older sample is wider or narrower, never wrong: the pages list the same captures.
async fn a_reader_uses_its_density_sample_again_for_the_next_first_pages_of_a_listing(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, false).await;
    let publish_id = Uuid::now_v7();
    // `count` captures of s/1 over the same 100 s, from 1 s on, at version 1.
    let insert = |count: u64| {
        let captured_at = format!("1000000000 + intDiv(number * 100000000000, {count})");
        catalog.insert_numbered_captures(count, &captured_at, "[], []", 1, publish_id);
    };
    insert(100_000);
    catalog.commit_row(1, publish_id);
    let query = ListQuery { limit: 10, ..Default::default() };
    let warm = catalog.reader();
    let sampled_once = warm.list(&query).await.unwrap();
    // Five times the captures in the same span: a fresh sample sizes a window about a fifth as wide.
    insert(400_000);
    let fresh = catalog.reader().list(&query).await.unwrap();
    let reused = warm.list(&query).await.unwrap();
    assert!(
        fresh.first_window_ns() * 4 < sampled_once.first_window_ns(),
        "a fresh sample did not narrow the window: {} then {}",
        sampled_once.first_window_ns(),
        fresh.first_window_ns()
    );
    // (Equal but for the span, whose last capture moved by a few µs.)
    let (reused_ns, once_ns) = (reused.first_window_ns(), sampled_once.first_window_ns());
    assert!(
        reused_ns.abs_diff(once_ns) * 1000 < once_ns,
        "the reader sampled again at once: {once_ns} then {reused_ns}"
    );
    assert_eq!(positions(&reused), positions(&fresh), "a window sized by the older sample listed otherwise");
    assert_eq!(reused.captures.len(), 10);
}

for_each_version!(a_label_filter_in_a_small_stream_reads_its_first_page_in_one_window);
/// A label filter's first window holds at least 16 pages of the stream's rows at its sampled density: in a stream
/// of 10,000 captures, a label on one capture in seven fills a page of 100 from one window (a setup, one window and
/// its check in `by_id`), where 1/64 of the stream's span held about 20 matches. The page is the stream's first 100
/// captures with the label.
async fn a_label_filter_in_a_small_stream_reads_its_first_page_in_one_window(server: &'static ClickHouseServer) {
    let catalog = catalog(server, true).await;
    let publish_id = Uuid::now_v7();
    let labels = "['site'], [concat('s', toString(number % 7))]";
    catalog.insert_numbered_captures(10_000, "1000000000 + number * 10000000", labels, 1, publish_id);
    catalog.commit_row(1, publish_id);
    let reader = catalog.reader();
    let requests = catalog.statements();
    let before = requests.load(Ordering::SeqCst);
    let query = ListQuery {
        stream: Some("s/1".into()),
        labels: BTreeMap::from([("site".to_string(), "s3".to_string())]),
        limit: 100,
        ..Default::default()
    };
    let page = reader.list(&query).await.unwrap();
    assert_eq!(requests.load(Ordering::SeqCst), before + 3, "not a setup, one window and its check");
    let times: Vec<u64> = page.captures.iter().map(|c| c.captured_at_ns).collect();
    let expected: Vec<u64> =
        (0..10_000u64).filter(|n| n % 7 == 3).take(100).map(|n| 1_000_000_000 + n * 10_000_000).collect();
    assert_eq!(times, expected);
    assert!(page.captures.iter().all(|c| c.labels_map()["site"] == "s3"));
    assert!(page.next_cursor.is_some());
}

/// Where a page's captures are in listing order: (captured_at_ns, capture_id).
fn positions(page: &Page) -> Vec<(u64, String)> {
    page.captures.iter().map(|c| (c.captured_at_ns, c.capture_id.clone())).collect()
}

/// Every page of a listing, following the cursors.
async fn list_all(reader: &CatalogReader, mut query: ListQuery) -> Vec<(u64, String)> {
    let mut seen = Vec::new();
    loop {
        let page = reader.list(&query).await.unwrap();
        seen.extend(positions(&page));
        match page.next_cursor {
            Some(cursor) => query.cursor = Some(cursor),
            None => return seen,
        }
    }
}

for_each_version!(listings_page_through_dense_sparse_and_empty_stretches_of_time_in_order_exactly_once);
async fn listings_page_through_dense_sparse_and_empty_stretches_of_time_in_order_exactly_once(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, false).await;
    let name = &catalog.config.catalog_name;
    // Three streams over a long, uneven history: a burst of 2,000 captures within 2 µs, a year of nothing, then one
    // capture a day for 100 days; 50 of them share one instant (ties broken by id).
    let publish_id = Uuid::now_v7();
    server
        .query(&format!(
            "INSERT INTO {} (catalog, stream, captured_at_ns, capture_id, version, publish_id) \
             SELECT '{name}', concat('s/', toString(number % 3)), \
             multiIf(number < 2000, toUInt64(1000000 + number), number < 2050, toUInt64(40000000000000000), \
                     toUInt64(40000000000000000 + (number - 2050) * 86400000000000)), \
             toString(generateUUIDv4()), 1, '{publish_id}' FROM numbers(2150)",
            catalog.tables.captures
        ))
        .unwrap();
    catalog.commit_row(1, publish_id);
    let reader = catalog.reader();
    let mut expected: Vec<(u64, String)> = server
        .query(&format!(
            "SELECT captured_at_ns, capture_id FROM {} WHERE catalog = '{name}' FORMAT TSV",
            catalog.tables.captures
        ))
        .unwrap()
        .lines()
        .map(|line| {
            let (at, id) = line.split_once('\t').unwrap();
            (at.parse().unwrap(), id.to_string())
        })
        .collect();
    expected.sort();
    for limit in [7, 100, 5000] {
        let listed = list_all(&reader, ListQuery { limit, ..Default::default() }).await;
        assert_eq!(listed, expected, "limit {limit}: every capture once, in (captured_at_ns, capture_id) order");
    }
    let stream_1: Vec<(u64, String)> =
        list_all(&reader, ListQuery { stream: Some("s/1".into()), limit: 9, ..Default::default() }).await;
    assert_eq!(stream_1.len(), expected.len() / 3 + usize::from(expected.len() % 3 > 1));
    assert!(stream_1.windows(2).all(|pair| pair[0] < pair[1]));
    let since = 40_000_000_000_000_000;
    let until = since + 10 * 86_400_000_000_000;
    let window =
        list_all(&reader, ListQuery { since_ns: Some(since), until_ns: Some(until), limit: 3, ..Default::default() })
            .await;
    let expected_window: Vec<(u64, String)> =
        expected.iter().filter(|(at, _)| (since..until).contains(at)).cloned().collect();
    assert_eq!(window, expected_window);
    assert_eq!(window.len(), 50 + 10, "the 50 at the shared instant and the first ten days");
    // A page of an hour around the shared instant is read in one window, a fraction of the whole history's span
    // (13 hours here), not in windows growing from a fraction of the hour (3.5 s, 28 s, 4 min, 30 min).
    let (since, until) = (40_000_000_000_000_000 - 1_800_000_000_000, 40_000_000_000_000_000 + 1_800_000_000_000);
    let hour_query = ListQuery { since_ns: Some(since), until_ns: Some(until), limit: 10, ..Default::default() };
    let hour = reader.list(&hour_query).await.unwrap();
    assert_eq!(hour.captures.len(), 10);
    assert!(hour.first_window_ns() >= until - since, "read in more than one window: {}", hour.first_window_ns());
    // Those ten share one instant, so they took no time: the next page's window is still at least an eighth of the
    // window that filled the page, not 2 ns.
    assert!(hour.captures.iter().all(|capture| capture.captured_at_ns == 40_000_000_000_000_000));
    assert!(hour.window_ns() >= hour.first_window_ns() / 8, "{} ns", hour.window_ns());
}

for_each_version!(a_first_page_of_a_dense_stream_reads_a_window_of_about_four_pages_not_a_fraction_of_its_span);
async fn a_first_page_of_a_dense_stream_reads_a_window_of_about_four_pages_not_a_fraction_of_its_span(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, false).await;
    let name = &catalog.config.catalog_name;
    // `dense`: 100,000 captures one µs apart, labelled site=a. `late`: ten captures spread over 99 ms, then 10,000 in
    // the last millisecond, so its end is a thousand times as dense as its start.
    let publish_id = Uuid::now_v7();
    server
        .query(&format!(
            "INSERT INTO {} (catalog, stream, captured_at_ns, capture_id, version, publish_id, label_keys, label_values) \
             SELECT '{name}', 'dense', 1000000000 + number * 1000, toString(generateUUIDv4()), 1, '{publish_id}', \
             ['site'], ['a'] FROM numbers(100000)",
            catalog.tables.captures
        ))
        .unwrap();
    server
        .query(&format!(
            "INSERT INTO {} (catalog, stream, captured_at_ns, capture_id, version, publish_id) \
             SELECT '{name}', 'late', if(number < 10, 1000000000 + number * 10000000, 1100000000 + number * 100), \
             toString(generateUUIDv4()), 1, '{publish_id}' FROM numbers(10010)",
            catalog.tables.captures
        ))
        .unwrap();
    catalog.commit_row(1, publish_id);
    let reader = catalog.reader();

    // The stream's span is 100 ms, so 1/64 of it (the first window without a density sample) holds 1,563 captures.
    // Its last 1/1024 holds 98: the first window is sized to about 400 (4 pages), and the next page's window to
    // twice the time this page's 100 took.
    let dense = ListQuery { stream: Some("dense".into()), limit: 100, ..Default::default() };
    let page = reader.list(&dense).await.unwrap();
    let times: Vec<u64> = page.captures.iter().map(|c| c.captured_at_ns).collect();
    assert_eq!(times, (0..100).map(|n| 1_000_000_000 + n * 1000).collect::<Vec<u64>>());
    assert!(
        (200_000..500_000).contains(&page.first_window_ns()),
        "the first window held about four pages, not 1/64 of the span: {} ns",
        page.first_window_ns()
    );
    assert_eq!(page.window_ns(), 2 * 99_001, "the next window holds two pages at the density just read");
    // A label's matches may be any part of the stream's rows: its first window is not narrowed to four pages of
    // rows. It holds 16 pages of rows at the sampled density (98 rows in the last 97,657 ns) where that is more than
    // 1/64 of the span (1,563 rows), and no more than eight times 1/64.
    let labelled = ListQuery { labels: BTreeMap::from([("site".into(), "a".into())]), ..dense.clone() };
    for (limit, first_window_ns) in
        [(10, 99_999_001 / 64), (500, (99_999_001 / 1024 + 1) * 8000 / 98), (1000, 99_999_001 / 64 * 8)]
    {
        let page = reader.list(&ListQuery { limit, ..labelled.clone() }).await.unwrap();
        assert_eq!(page.captures.len() as u64, limit);
        assert_eq!(page.first_window_ns(), first_window_ns, "a label filter's first window of a page of {limit}");
    }

    // Sized by its dense end, the first window of `late` holds none of its start: windows grow until the page is
    // full, and every capture is listed once, in order.
    let expected: Vec<u64> =
        (0..10).map(|n| 1_000_000_000 + n * 10_000_000).chain((10..10_010).map(|n| 1_100_000_000 + n * 100)).collect();
    let late = ListQuery { stream: Some("late".into()), limit: 20, ..Default::default() };
    let page = reader.list(&late).await.unwrap();
    let times: Vec<u64> = page.captures.iter().map(|c| c.captured_at_ns).collect();
    assert_eq!(times, expected[..20]);
    let listed: Vec<u64> =
        list_all(&reader, ListQuery { limit: 7, ..late }).await.into_iter().map(|(at, _)| at).collect();
    assert_eq!(listed, expected);
}

for_each_version!(tail_without_follow_prints_every_committed_capture_once_past_a_thousand_publishes);
async fn tail_without_follow_prints_every_committed_capture_once_past_a_thousand_publishes(
    server: &'static ClickHouseServer,
) {
    let dir = tempfile::tempdir().unwrap();
    let env = DaemonEnv::live_on(server, "tail", dir.path());
    let config = env.config();
    let (_client, tables) = capstore::catalog::connect(&config).await.unwrap();
    let name = &config.catalog_name;
    // 1,500 publishes of two captures each, and an orphan row at version 7 (its publish never committed).
    let capture = "toString(generateUUIDv4())";
    let publish_id = "UUIDNumToString(toFixedString(concat(reinterpretAsString(cityHash64(v, 1)), \
                      reinterpretAsString(cityHash64(v, 2))), 16))";
    server
        .query(&format!(
            "INSERT INTO {captures} (catalog, stream, captured_at_ns, capture_id, version, publish_id) \
             SELECT '{name}', 's', number, {capture}, v, {publish_id} FROM \
             (SELECT number, intDiv(number, 2) + 1 AS v FROM numbers(3000))",
            captures = tables.captures
        ))
        .unwrap();
    server
        .query(&format!(
            "INSERT INTO {publishes} (catalog, version, publish_id, captures) \
             SELECT '{name}', v, {publish_id}, 2 FROM (SELECT number + 1 AS v FROM numbers(1500))",
            publishes = tables.publishes
        ))
        .unwrap();
    server
        .query(&format!(
            "INSERT INTO {} (catalog, stream, captured_at_ns, capture_id, version, publish_id) \
             VALUES ('{name}', 's', 1, 'orphan', 7, 'never-committed')",
            tables.captures
        ))
        .unwrap();
    // The rows of versions 5 to 9 written again (a retried insert), into a part of their own.
    server
        .query(&format!(
            "INSERT INTO {captures} SELECT * FROM {captures} WHERE catalog = '{name}' AND version >= 5 AND \
             version <= 9 AND capture_id != 'orphan'",
            captures = tables.captures
        ))
        .unwrap();

    let tail = |after: &str| {
        let output = env.command().args(["tail", "--after", after]).output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout)
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
            .map(|line| (line["version"].as_u64().unwrap(), line["capture_id"].as_str().unwrap().to_string()))
            .collect::<Vec<(u64, String)>>()
    };
    let everything = tail("0");
    assert_eq!(everything.len(), 3000, "every committed capture, past the first 1,000 publishes");
    assert!(everything.windows(2).all(|pair| pair[0] < pair[1]), "in (version, capture_id) order, each once");
    let ids: std::collections::HashSet<&String> = everything.iter().map(|(_, id)| id).collect();
    assert_eq!(ids.len(), 3000, "each once");
    assert!(!ids.contains(&"orphan".to_string()));
    let versions: Vec<u64> = tail("1495").iter().map(|(version, _)| *version).collect();
    assert_eq!(versions, vec![1496, 1496, 1497, 1497, 1498, 1498, 1499, 1499, 1500, 1500]);
}

for_each_version!(a_tail_read_ahead_hands_out_the_same_log_as_one_page_at_a_time_through_versions_larger_than_a_page);
/// `TailPages` asks for pages before the ones before them are back; a version of more captures than a page cuts a
/// page short, and the pages asked for after it must be asked for again from the cut.
async fn a_tail_read_ahead_hands_out_the_same_log_as_one_page_at_a_time_through_versions_larger_than_a_page(
    server: &'static ClickHouseServer,
) {
    use capstore::catalog::query::TailPosition;
    use capstore::catalog::tail::TailPages;
    let catalog = catalog(server, false).await;
    let name = &catalog.config.catalog_name;
    let size = |version: u64| if version.is_multiple_of(13) { 25 } else { version % 4 + 1 };
    let publish_versions = |versions: std::ops::RangeInclusive<u64>| {
        let (mut rows, mut publishes, mut expected) = (Vec::new(), Vec::new(), Vec::new());
        for version in versions {
            let publish_id = Uuid::new_v4();
            for _ in 0..size(version) {
                let capture = Uuid::now_v7();
                rows.push(format!("('{name}', 's', {version}, '{capture}', 'p', 'k', {version}, '{publish_id}')"));
                expected.push((version, capture.to_string()));
            }
            publishes.push(format!("('{name}', {version}, '{publish_id}', 1, {})", size(version)));
        }
        catalog
            .server
            .query(&format!(
                "INSERT INTO {} (catalog, stream, captured_at_ns, capture_id, pack_id, object_key, version, \
                 publish_id) VALUES {}",
                catalog.tables.captures,
                rows.join(", ")
            ))
            .unwrap();
        catalog
            .server
            .query(&format!(
                "INSERT INTO {} (catalog, version, publish_id, packs, captures) VALUES {}",
                catalog.tables.publishes,
                publishes.join(", ")
            ))
            .unwrap();
        expected.sort();
        expected
    };
    let mut expected = publish_versions(1..=60);
    let reader = catalog.reader();
    let entries = |pages: &[capstore::catalog::query::TailPage]| {
        pages.iter().flat_map(|page| &page.captures).map(|c| (c.version, c.capture_id.clone())).collect::<Vec<_>>()
    };
    // A page that holds its span exactly (version 1: two captures) ends after the span, not inside it: the pages
    // read ahead after it start where it ends.
    let exact = reader.tail_page(TailPosition::after_version(0), None, 2).await.unwrap();
    assert_eq!((exact.captures.len(), exact.next), (2, TailPosition::after_version(1)));
    // One page at a time, as before.
    let mut one_at_a_time = Vec::new();
    let mut position = TailPosition::after_version(0);
    loop {
        let page = reader.tail_page(position, None, 10).await.unwrap();
        if page.caught_up() {
            break;
        }
        position = page.next;
        one_at_a_time.push(page);
    }
    assert_eq!(entries(&one_at_a_time), expected, "every capture of the log once, in (version, id) order");
    // Read ahead: the same pages, each starting where the one before it ended.
    let mut pages = TailPages::new(reader.clone(), TailPosition::after_version(0), None, 10);
    let mut ahead = Vec::new();
    loop {
        let page = pages.next_page().await.unwrap();
        if page.caught_up() {
            break;
        }
        ahead.push(page);
    }
    assert_eq!(entries(&ahead), expected);
    assert!(ahead.iter().all(|page| page.captures.len() <= 10), "no page over its size");
    assert_eq!(ahead[0].from, TailPosition::after_version(0));
    assert!(ahead.windows(2).all(|pair| pair[1].from == pair[0].next), "each page starts where the one before ended");
    let cut = ahead.iter().filter(|page| page.next.after_id.is_some()).count();
    assert!(cut >= 4, "versions of 25 captures are read in pages cut inside them ({cut} cut)");
    // Caught up, the same reader reads on once more is published.
    expected = publish_versions(61..=66);
    let page = pages.next_page().await.unwrap();
    assert_eq!(page.from, TailPosition::after_version(60));
    let mut more = vec![page];
    loop {
        let page = pages.next_page().await.unwrap();
        if page.caught_up() {
            break;
        }
        more.push(page);
    }
    assert_eq!(entries(&more), expected, "what was published after it caught up");
    // Up to a version: nothing after it, from the middle of a version on.
    let middle = ahead.iter().find(|page| page.next.after_id.is_some()).unwrap().next;
    let mut pages = TailPages::new(reader.clone(), middle, Some(40), 10);
    let mut upto = Vec::new();
    loop {
        let page = pages.next_page().await.unwrap();
        if page.caught_up() {
            break;
        }
        upto.push(page);
    }
    let all: Vec<(u64, String)> = entries(&one_at_a_time);
    let start = all.iter().position(|(version, id)| {
        *version == middle.version + 1 && Some(id.as_str()) == middle.after_id.map(|id| id.to_string()).as_deref()
    });
    let from_middle: Vec<(u64, String)> =
        all[start.unwrap() + 1..].iter().filter(|(version, _)| *version <= 40).cloned().collect();
    assert_eq!(entries(&upto), from_middle);
}

for_each_version!(a_capture_re_posted_into_another_stream_is_listed_only_where_its_newest_version_is);
async fn a_capture_re_posted_into_another_stream_is_listed_only_where_its_newest_version_is(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, false).await;
    let (moved, stays) = (Uuid::now_v7(), Uuid::now_v7());
    // (capture, stream, version, committed): `moved` is re-posted into cam/b at version 2; a re-post of `stays`
    // at version 3 never committed.
    let rows =
        [(moved, "cam/a", 1, true), (stays, "cam/a", 1, true), (moved, "cam/b", 2, true), (stays, "cam/b", 3, false)];
    let mut publish_ids = BTreeMap::new();
    for (capture, stream, version, committed) in rows {
        let publish_id = *publish_ids.entry((version, committed)).or_insert_with(Uuid::now_v7);
        catalog.insert_capture_row(capture, stream, 100 + version, version, publish_id);
    }
    for ((version, committed), publish_id) in &publish_ids {
        if *committed {
            catalog.commit_row(*version, *publish_id);
        }
    }
    let reader = catalog.reader();
    let listed = |stream: &'static str| {
        let reader = reader.clone();
        async move {
            let query = ListQuery { stream: Some(stream.into()), limit: 100, ..Default::default() };
            let page = reader.list(&query).await.unwrap();
            page.captures.iter().map(|c| (c.capture_id.clone(), c.version)).collect::<Vec<_>>()
        }
    };
    assert_eq!(listed("cam/a").await, vec![(stays.to_string(), 1)], "the moved capture left cam/a");
    assert_eq!(listed("cam/b").await, vec![(moved.to_string(), 2)], "an uncommitted re-post hides nothing");
    assert_eq!(reader.get(moved, None).await.unwrap().unwrap().stream, "cam/b");
    assert_eq!(reader.get(moved, Some(1)).await.unwrap().unwrap().stream, "cam/a", "pinned before the re-post");
    assert_eq!(reader.get(stays, None).await.unwrap().unwrap().stream, "cam/a");
    let everything = reader.list(&ListQuery { limit: 100, ..Default::default() }).await.unwrap();
    assert_eq!(everything.captures.len(), 2, "each capture once without a stream filter too");
}

for_each_version!(a_re_post_past_the_rows_by_id_is_asked_about_beside_the_window_is_still_found);
/// `by_id` is asked beside a window about its first rows only, as many as the page needs and a margin: a capture
/// further on (here behind the rows of a publish that never committed, which are no captures) whose newest version is
/// elsewhere must still be left out, by the check after the window.
async fn a_re_post_past_the_rows_by_id_is_asked_about_beside_the_window_is_still_found(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, false).await;
    let mut all: Vec<Uuid> = (0..100).map(|_| Uuid::now_v7()).collect();
    all.sort_by_key(|id| id.to_string());
    // Every row at one instant (one window), in capture_id order: 60 of an orphan publish at version 1, then the 40
    // captures of the one that committed it.
    let (orphans, ids) = all.split_at(60);
    let (committed, orphan, re_post) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    for id in orphans {
        catalog.insert_capture_row(*id, "cam/a", 100, 1, orphan);
    }
    for id in ids {
        catalog.insert_capture_row(*id, "cam/a", 100, 1, committed);
    }
    catalog.commit_row(1, committed);
    // The 34th capture is re-posted into cam/b: 93 rows come before it in cam/a, past the 35 + 8 + 16 asked about.
    let moved = ids[33];
    catalog.insert_capture_row(moved, "cam/b", 100, 2, re_post);
    catalog.commit_row(2, re_post);
    let reader = catalog.reader();
    let query = ListQuery { stream: Some("cam/a".into()), limit: 35, ..Default::default() };
    let page = reader.list(&query).await.unwrap();
    let listed: Vec<(String, u64)> = page.captures.iter().map(|c| (c.capture_id.clone(), c.version)).collect();
    // (The page is the first 35 in cam/a's rows, less the one whose newest version is elsewhere.)
    let expected: Vec<(String, u64)> =
        ids.iter().take(35).filter(|id| **id != moved).map(|id| (id.to_string(), 1)).collect();
    assert_eq!(listed, expected, "the re-posted capture left cam/a; the others are listed, the orphans are not");
    let rest = reader.list(&ListQuery { cursor: page.next_cursor.clone(), ..query }).await.unwrap();
    let rest: Vec<String> = rest.captures.iter().map(|c| c.capture_id.clone()).collect();
    let expected_rest: Vec<String> = ids.iter().skip(35).map(Uuid::to_string).collect();
    assert_eq!(rest, expected_rest);
    let in_b =
        reader.list(&ListQuery { stream: Some("cam/b".into()), limit: 100, ..Default::default() }).await.unwrap();
    assert_eq!(in_b.captures.iter().map(|c| c.capture_id.clone()).collect::<Vec<_>>(), vec![moved.to_string()]);
}

for_each_version!(gc_removes_orphan_rows_from_every_table_and_keeps_every_committed_capture_readable);
async fn gc_removes_orphan_rows_from_every_table_and_keeps_every_committed_capture_readable(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, false).await;
    let tables = &catalog.tables;
    let (committed, orphan) = (Uuid::now_v7(), Uuid::now_v7());
    let (publish_id, orphan_publish_id) = (Uuid::now_v7(), Uuid::now_v7());
    for (capture, publish) in [(committed, publish_id), (orphan, orphan_publish_id)] {
        catalog.insert_capture_row(capture, "s", 1, 1, publish);
    }
    catalog.commit_row(1, publish_id);
    let reader = catalog.reader();
    assert_eq!(reader.gc_orphans().await.unwrap(), 1);
    // The deletes are mutations, applied in the background: wait for them.
    let pending = format!(
        "SELECT count() FROM system.mutations WHERE database = '{}' AND is_done = 0 FORMAT TSV",
        tables.database
    );
    let deadline = Instant::now() + common::MUTATION_PATIENCE;
    while server.query(&pending).unwrap().trim() != "0" {
        assert!(Instant::now() < deadline, "mutations still pending after {:?}", common::MUTATION_PATIENCE);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rows_of = |table: &str, capture: Uuid| {
        let id = if table == tables.by_id { format!("UUIDStringToNum('{capture}')") } else { format!("'{capture}'") };
        server
            .query(&format!("SELECT count() FROM {table} WHERE capture_id = {id} FORMAT TSV"))
            .unwrap()
            .trim()
            .to_string()
    };
    for table in [&tables.captures, &tables.by_version, &tables.by_id] {
        assert_eq!(rows_of(table, orphan), "0", "orphan left in {table}");
        assert_eq!(rows_of(table, committed), "1", "committed row deleted from {table}");
    }
    assert_eq!(reader.get(committed, None).await.unwrap().expect("still readable after gc").version, 1);
}

for_each_version!(a_deletion_is_a_fenced_version_that_hides_the_capture_from_every_read_from_then_on);
async fn a_deletion_is_a_fenced_version_that_hides_the_capture_from_every_read_from_then_on(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, false).await;
    let keeper = catalog.keeper(identity("writer"));
    let (shutdown_tx, mut shutdown_rx) = watch::channel(false);
    keeper.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
    let handle = keeper.handle();
    let keeper_task = tokio::spawn(keeper.run(shutdown_rx));
    let publisher =
        Publisher::new(catalog.client.clone(), catalog.tables.clone(), &catalog.config.catalog_name, handle.clone());
    let [a, b, c, d, unknown] = [(); 5].map(|_| Uuid::now_v7());
    // (On 18.16 a fresh claim's whole-second times can leave too little time for the fence: retried, as the
    // daemon's loop does.)
    let publish = |packs: Vec<PackDescriptor>| {
        let publisher = &publisher;
        async move {
            loop {
                match publisher.publish_batch(&packs).await {
                    Ok(outcome) => return outcome,
                    Err(PublishError::NotCommitted | PublishError::NoLease) => {
                        tokio::time::sleep(Duration::from_millis(50)).await
                    }
                    Err(other) => panic!("{other}"),
                }
            }
        }
    };
    let delete = |ids: Vec<Uuid>| {
        let publisher = &publisher;
        async move {
            loop {
                match publisher.publish_deletions(&ids, None).await {
                    Ok(report) => return report,
                    Err(PublishError::NotCommitted | PublishError::NoLease) => {
                        tokio::time::sleep(Duration::from_millis(50)).await
                    }
                    Err(other) => panic!("{other}"),
                }
            }
        }
    };
    for batch in [pack(&[(a, "cam/1", 100), (b, "cam/1", 200), (c, "cam/1", 300)]), pack(&[(d, "cam/2", 400)])] {
        assert!(matches!(publish(vec![batch]).await, PublishOutcome::Committed { .. }));
    }
    // A listing taken before the deletion, paged on after it.
    let first_page = catalog
        .reader()
        .list(&ListQuery { stream: Some("cam/1".into()), limit: 1, ..Default::default() })
        .await
        .unwrap();
    let report = delete(vec![a, c, unknown, a]).await;
    let rest = catalog
        .reader()
        .list(&ListQuery {
            stream: Some("cam/1".into()),
            limit: 100,
            cursor: first_page.next_cursor.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        rest.captures.iter().map(|c| c.capture_id.clone()).collect::<Vec<_>>(),
        [b.to_string(), c.to_string()],
        "a listing paged on with a cursor from before the deletion keeps its snapshot"
    );
    assert_eq!((report.deleted, report.not_found, report.version), (vec![a, c], vec![unknown], Some(3)));
    // A deletion as large as one may be plans in statements the server accepts (each under its max_query_size).
    let many: Vec<Uuid> = (0..capstore::catalog::publish::DELETION_MAX_IDS).map(|_| Uuid::now_v7()).collect();
    let unknown_many = delete(many.clone()).await;
    assert_eq!((unknown_many.not_found.len(), unknown_many.version), (many.len(), None));
    // Deleting again is a no-op: no version is published for it.
    let again = delete(vec![a]).await;
    assert_eq!((again.already_deleted, again.version), (vec![a], None));
    assert_eq!(catalog.committed_versions(), vec![1, 2, 3]);
    assert_eq!(catalog.stamped_schema(), 6, "a new (partitioned) catalog is stamped 6 from its first start on");

    let reader = catalog.reader();
    let ids = |page: capstore::catalog::query::Page| {
        page.captures.iter().map(|capture| capture.capture_id.clone()).collect::<Vec<_>>()
    };
    let (b_text, d_text) = (b.to_string(), d.to_string());
    assert!(reader.get(a, None).await.unwrap().is_none(), "a deleted capture is not found");
    assert_eq!(reader.get(a, Some(2)).await.unwrap().unwrap().version, 1, "a reader pinned before still sees it");
    let stream = ListQuery { stream: Some("cam/1".into()), limit: 100, ..Default::default() };
    assert_eq!(ids(reader.list(&stream).await.unwrap()), [b_text.as_str()]);
    let labelled = ListQuery { labels: BTreeMap::from([("site".into(), "berlin".into())]), ..stream.clone() };
    assert_eq!(ids(reader.list(&labelled).await.unwrap()), [b_text.as_str()], "with a label filter too");
    let everything = ListQuery { limit: 100, ..Default::default() };
    assert_eq!(ids(reader.list(&everything).await.unwrap()), [b_text.clone(), d_text.clone()]);
    let before = ListQuery { watermark: Some(2), ..everything.clone() };
    assert_eq!(reader.list(&before).await.unwrap().captures.len(), 4, "a listing pinned before the deletion");
    let many = reader.get_many(&[a, b, c]).await.unwrap();
    assert_eq!(many.keys().copied().collect::<Vec<_>>(), [b]);
    // The log of publishes shows the deletion at its version, in capture id order.
    let page = reader.tail_page(capstore::catalog::query::TailPosition::after_version(2), None, 100).await.unwrap();
    let deletions: Vec<(String, u64, bool)> =
        page.captures.iter().map(|entry| (entry.capture_id.clone(), entry.version, entry.is_deletion())).collect();
    assert_eq!(deletions, [(a.to_string(), 3, true), (c.to_string(), 3, true)]);
    assert_eq!(serde_json::to_value(page.captures[0].tail_entry()).unwrap()["deleted"], true);

    // Posted again, the capture is back, at its new version.
    let reposted = publish(vec![pack(&[(a, "cam/1", 100)])]).await;
    assert!(matches!(reposted, PublishOutcome::Committed { version: 4, .. }), "{reposted:?}");
    assert_eq!(reader.get(a, None).await.unwrap().unwrap().version, 4);
    // A deletion planned on a listing at version 3 leaves the capture posted again since alone.
    let stale = publisher.publish_deletions(&[a], Some(3)).await.unwrap();
    assert_eq!((stale.changed, stale.deleted, stale.version), (vec![a], vec![], None));
    assert_eq!(ids(reader.list(&stream).await.unwrap()), [a.to_string(), b_text.clone()]);

    // A holder whose lease has ended (released here) deletes nothing, whatever permit it kept: its commit is not
    // sent once the release has decided (the fence would refuse it too, see the paused holder's test).
    let stale_permit = handle.permit().expect("held with time left");
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();
    assert_eq!(handle.state(), LeaseState::Released);
    let result = publisher.delete_with_permit(&stale_permit, &[b]).await;
    assert!(matches!(result, Err(PublishError::NoLease)), "{result:?}");
    assert_eq!(catalog.committed_versions(), vec![1, 2, 3, 4]);
    assert!(reader.get(b, None).await.unwrap().is_some(), "the refused deletion hides nothing");
}

/// A lease held on `catalog` by `host`, kept by its keeper task, and a publisher under it.
struct Publishing {
    publisher: Publisher,
    shutdown_tx: watch::Sender<bool>,
    keeper_task: tokio::task::JoinHandle<()>,
}

async fn publishing(catalog: &Catalog, host: &str) -> Publishing {
    let keeper = catalog.keeper(identity(host));
    let (shutdown_tx, mut shutdown_rx) = watch::channel(false);
    keeper.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
    let publisher =
        Publisher::new(catalog.client.clone(), catalog.tables.clone(), &catalog.config.catalog_name, keeper.handle());
    let keeper_task = tokio::spawn(keeper.run(shutdown_rx));
    Publishing { publisher, shutdown_tx, keeper_task }
}

for_each_version!(an_id_posted_twice_into_one_publish_is_read_and_listed_once_as_its_last_post);
async fn an_id_posted_twice_into_one_publish_is_read_and_listed_once_as_its_last_post(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, false).await;
    let Publishing { publisher, shutdown_tx, keeper_task } = publishing(&catalog, "writer").await;
    let [a, b, x, y] = [(); 4].map(|_| Uuid::now_v7());
    // A producer that posts an id again before its pack is published (a retry after a lost reply, or after an error
    // that left the first record on disk, without a capture time of its own): x twice in the first pack and once
    // more in the second, y moved to another stream by the second; both packs in one publish, one version.
    let first = pack(&[(x, "cam/1", 300), (a, "cam/1", 100), (y, "cam/1", 400), (x, "cam/1", 500)]);
    let second = pack(&[(b, "cam/1", 200), (x, "cam/1", 900), (y, "cam/2", 600)]);
    let last_x = second.entries[1].clone();
    let outcome = retried!(publisher.publish_batch(&[first.clone(), second.clone()]).await);
    assert!(matches!(outcome, PublishOutcome::Committed { version: 1, .. }), "{outcome:?}");
    let reader = catalog.reader();
    let got = reader.get(x, None).await.unwrap().expect("x is published");
    assert_eq!(
        (got.pack_id, got.record_offset, got.captured_at_ns),
        (second.summary.pack_id.to_string(), last_x.record_offset, 900),
        "get reads the last post"
    );
    assert_eq!(reader.get(y, None).await.unwrap().unwrap().stream, "cam/2");
    let mut listed = Vec::new();
    let mut query = ListQuery { stream: Some("cam/1".into()), limit: 1, ..Default::default() };
    loop {
        let page = reader.list(&query).await.unwrap();
        listed.extend(page.captures.iter().map(|c| (c.capture_id.clone(), c.captured_at_ns)));
        match page.next_cursor {
            Some(cursor) => query.cursor = Some(cursor),
            None => break,
        }
    }
    assert_eq!(listed, [(a.to_string(), 100), (b.to_string(), 200), (x.to_string(), 900)], "each once, as last posted");
    let everything = reader.list(&ListQuery { limit: 100, ..Default::default() }).await.unwrap();
    let everything: Vec<String> = everything.captures.iter().map(|c| c.capture_id.clone()).collect();
    assert_eq!(everything, [a.to_string(), b.to_string(), y.to_string(), x.to_string()]);
    let mut logged: Vec<String> =
        reader.captures_of_version(1).await.unwrap().iter().map(|c| c.capture_id.clone()).collect();
    logged.sort();
    let mut expected: Vec<String> = [a, b, x, y].iter().map(Uuid::to_string).collect();
    expected.sort();
    assert_eq!(logged, expected, "the log holds each id once at its version");
    let published = reader.publishes_after(0, 10).await.unwrap();
    assert_eq!(published.iter().map(|p| p.captures).collect::<Vec<_>>(), [4], "the publish counts captures, not posts");
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();
}

for_each_version!(an_id_posted_again_far_apart_in_time_is_listed_once_when_one_page_reads_several_windows);
async fn an_id_posted_again_far_apart_in_time_is_listed_once_when_one_page_reads_several_windows(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, false).await;
    let Publishing { publisher, shutdown_tx, keeper_task } = publishing(&catalog, "writer").await;
    let x = Uuid::now_v7();
    let dense: Vec<Uuid> = (0..10).map(|_| Uuid::now_v7()).collect();
    let last = Uuid::now_v7();
    // Ten captures close together, then x posted three times, each ten times further away than the one before, then
    // one more capture: the page after the first ten reads windows that grow, and x's posts fall into three of them.
    let mut batches =
        vec![dense.iter().enumerate().map(|(at, id)| (*id, "cam/1", 1_000 + at as u64)).collect::<Vec<_>>()];
    batches.extend([100_000, 1_000_000, 10_000_000].map(|time| vec![(x, "cam/1", time)]));
    batches.push(vec![(last, "cam/1", 20_000_000)]);
    for captures in batches {
        let outcome = retried!(publisher.publish_batch(&[pack(&captures)]).await);
        assert!(matches!(outcome, PublishOutcome::Committed { .. }), "{outcome:?}");
    }
    let reader = catalog.reader();
    for stream in [Some("cam/1".to_string()), None] {
        let first = ListQuery { stream: stream.clone(), limit: 10, ..Default::default() };
        let first = reader.list(&first).await.unwrap();
        assert_eq!(
            first.captures.iter().map(|c| c.capture_id.clone()).collect::<Vec<_>>(),
            dense.iter().map(Uuid::to_string).collect::<Vec<_>>()
        );
        let rest = ListQuery { stream: stream.clone(), limit: 100, cursor: first.next_cursor, ..Default::default() };
        let rest: Vec<(String, u64)> = reader
            .list(&rest)
            .await
            .unwrap()
            .captures
            .iter()
            .map(|c| (c.capture_id.clone(), c.captured_at_ns))
            .collect();
        assert_eq!(rest, [(x.to_string(), 10_000_000), (last.to_string(), 20_000_000)], "stream {stream:?}");
    }
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();
}

for_each_version!(a_relocation_moves_captures_in_one_fenced_version_and_every_reader_sees_each_once);
async fn a_relocation_moves_captures_in_one_fenced_version_and_every_reader_sees_each_once(
    server: &'static ClickHouseServer,
) {
    use capstore::catalog::publish::{Relocation, RelocationOutcome, SourcePack};
    let catalog = catalog(server, false).await;
    let Publishing { publisher, shutdown_tx, keeper_task } = publishing(&catalog, "compactor").await;
    let [a, b, c] = [(); 3].map(|_| Uuid::now_v7());
    let (first, second) = (pack(&[(a, "cam/1", 100), (b, "cam/1", 200)]), pack(&[(c, "cam/1", 300)]));
    for batch in [&first, &second] {
        let outcome = retried!(publisher.publish_batch(std::slice::from_ref(batch)).await);
        assert!(matches!(outcome, PublishOutcome::Committed { .. }));
    }
    // The merged pack: the same records (same CRCs) at new offsets.
    let merged = |sources: &[&PackDescriptor], keep: &[Uuid]| {
        let mut pack = pack(&[]);
        let mut offset = 40;
        for source in sources {
            for entry in source.entries.iter().filter(|entry| keep.contains(&entry.meta.capture_id)) {
                pack.entries.push(IndexEntry { record_offset: offset, payload_offset: offset + 60, ..entry.clone() });
                offset += 100;
            }
        }
        pack.summary.records = pack.entries.len() as u64;
        pack.object_key = format!("prefix/test/{}.compacted.cpk", pack.summary.pack_id);
        pack
    };
    let source =
        |pack: &PackDescriptor| SourcePack { pack_id: pack.summary.pack_id, object_key: pack.object_key.clone() };
    let reader = catalog.reader();
    let stream = ListQuery { stream: Some("cam/1".into()), limit: 100, ..Default::default() };
    let first_page = reader.list(&ListQuery { limit: 1, ..stream.clone() }).await.unwrap();

    // A relocation whose records are not what the catalog holds (a CRC differs: changed since) writes nothing.
    let mut stale = merged(&[&first, &second], &[a, b, c]);
    stale.entries[1].crc32c += 1;
    let sources = vec![source(&first), source(&second)];
    let relocation = Relocation { new_pack: Some(stale), sources: sources.clone(), source_captures: vec![a, b, c] };
    let changed = retried!(publisher.publish_relocation(&relocation).await);
    assert_eq!(changed, RelocationOutcome::Changed { changed: vec![b] });
    // One that would retire a source still holding a capture it does not move writes nothing either.
    let partial = merged(&[&first, &second], &[a, c]);
    let relocation = Relocation { new_pack: Some(partial), sources: sources.clone(), source_captures: vec![a, b, c] };
    let changed = retried!(publisher.publish_relocation(&relocation).await);
    assert_eq!(changed, RelocationOutcome::Changed { changed: vec![b] }, "b would be left in a retired pack");
    let retire_only = Relocation { new_pack: None, sources: sources.clone(), source_captures: vec![a, b, c] };
    let changed = retried!(publisher.publish_relocation(&retire_only).await);
    assert!(matches!(changed, RelocationOutcome::Changed { .. }), "{changed:?}");
    assert_eq!(catalog.committed_versions(), vec![1, 2]);

    let new_pack = merged(&[&first, &second], &[a, b, c]);
    let new_id = new_pack.summary.pack_id.to_string();
    let relocation = Relocation { new_pack: Some(new_pack.clone()), sources, source_captures: vec![a, b, c] };
    let switched = retried!(publisher.publish_relocation(&relocation).await);
    assert_eq!(switched, RelocationOutcome::Switched { version: 3, moved: 3 });
    let again = retried!(publisher.publish_relocation(&relocation).await);
    assert_eq!(again, RelocationOutcome::AlreadySwitched, "a switch asked again is found made");
    assert_eq!(catalog.committed_versions(), vec![1, 2, 3]);
    assert_eq!(catalog.stamped_schema(), 6, "a new (partitioned) catalog is stamped 6 from its first start on");

    // Every read at or above the switch sees each capture once, at its new place; a reader pinned below, at its old.
    let places = |page: capstore::catalog::query::Page| {
        page.captures.iter().map(|c| (c.capture_id.clone(), c.pack_id.clone())).collect::<Vec<_>>()
    };
    let at_new: Vec<(String, String)> = [a, b, c].iter().map(|id| (id.to_string(), new_id.clone())).collect();
    assert_eq!(places(reader.list(&stream).await.unwrap()), at_new);
    let labelled = ListQuery { labels: BTreeMap::from([("site".into(), "berlin".into())]), ..stream.clone() };
    assert_eq!(places(reader.list(&labelled).await.unwrap()), at_new, "with a label filter");
    let everything = ListQuery { limit: 100, ..Default::default() };
    assert_eq!(places(reader.list(&everything).await.unwrap()), at_new, "without a stream");
    // Paged one capture at a time, by cursors (a later page reads its window at once, `by_id` asked beside it about
    // the window's ids, past the page's one included): each at its new place, once.
    for query in [&stream, &everything] {
        let mut query = ListQuery { limit: 1, ..query.clone() };
        let mut paged = Vec::new();
        loop {
            let page = reader.list(&query).await.unwrap();
            let next_cursor = page.next_cursor.clone();
            paged.extend(places(page));
            match next_cursor {
                Some(cursor) => query.cursor = Some(cursor),
                None => break,
            }
        }
        assert_eq!(paged, at_new, "paged by cursors, {:?}", query.stream);
    }
    let old_places = vec![
        (a.to_string(), first.summary.pack_id.to_string()),
        (b.to_string(), first.summary.pack_id.to_string()),
        (c.to_string(), second.summary.pack_id.to_string()),
    ];
    let pinned = ListQuery { watermark: Some(2), ..everything.clone() };
    assert_eq!(places(reader.list(&pinned).await.unwrap()), old_places, "a listing pinned below the switch");
    let rest = reader.list(&ListQuery { cursor: first_page.next_cursor.clone(), ..stream.clone() }).await.unwrap();
    assert_eq!(places(rest), old_places[1..].to_vec(), "a listing paged on with a cursor from before the switch");
    let got = reader.get(b, None).await.unwrap().unwrap();
    assert_eq!((got.pack_id.as_str(), got.record_offset, got.version), (new_id.as_str(), 140, 3));
    assert_eq!(reader.get(b, Some(2)).await.unwrap().unwrap().pack_id, first.summary.pack_id.to_string());
    assert_eq!(reader.get_many(&[a, b, c]).await.unwrap().values().filter(|row| row.pack_id == new_id).count(), 3);
    // A move is not an entry of the log: tail and exports by version skip it (version 3 is passed over).
    let tail = reader.tail_page(capstore::catalog::query::TailPosition::after_version(2), None, 100).await.unwrap();
    assert!(tail.captures.is_empty(), "{:?}", tail.captures);
    assert_eq!(tail.next.to_string(), capstore::catalog::query::TailPosition::after_version(3).to_string());
    assert_eq!(reader.captures_of_versions(0, 3).await.unwrap().len(), 3, "the three captures, once each");

    // The sources are retired at version 3; with no grace they are due, and once marked removed, no longer.
    let retired = reader.retired_packs();
    let ids = [first.summary.pack_id, second.summary.pack_id];
    assert_eq!(retired.committed_among(&ids).await.unwrap().len(), 2);
    let due = retired.due(Duration::ZERO, 0, 10).await.unwrap();
    assert_eq!(due.iter().map(|pack| pack.version).collect::<Vec<_>>(), [3, 3]);
    assert!(retired.due(Duration::from_secs(3600), 0, 10).await.unwrap().is_empty(), "not before the grace");
    retired.mark_removed(&due).await.unwrap();
    assert!(retired.due(Duration::ZERO, 0, 10).await.unwrap().is_empty());

    // Erasure: b deleted, the merged pack rewritten without it.
    let deleted = retried!(publisher.publish_deletions(&[b], None).await);
    assert_eq!(deleted.version, Some(4));
    assert_eq!(reader.deleted_after(0, 100).await.unwrap(), (vec![b], 4));
    // Every object any version of b was in: its first pack (retired already) and the merged one.
    let holding = reader.objects_holding(&[b]).await.unwrap();
    assert_eq!(holding, [first.object_key.clone(), new_pack.object_key.clone()].into_iter().collect());
    let rewritten = merged(&[&new_pack], &[a, c]);
    let relocation = Relocation {
        new_pack: Some(rewritten.clone()),
        sources: vec![source(&new_pack)],
        source_captures: vec![a, b, c],
    };
    let switched = retried!(publisher.publish_relocation(&relocation).await);
    assert_eq!(switched, RelocationOutcome::Switched { version: 5, moved: 2 });
    let rewritten_id = rewritten.summary.pack_id.to_string();
    let at_rewritten: Vec<(String, String)> = [a, c].iter().map(|id| (id.to_string(), rewritten_id.clone())).collect();
    assert_eq!(places(reader.list(&stream).await.unwrap()), at_rewritten);
    assert!(reader.get(b, None).await.unwrap().is_none(), "the deleted capture stays deleted");
    let tail = reader.tail_page(capstore::catalog::query::TailPosition::after_version(3), None, 100).await.unwrap();
    let entries: Vec<(String, bool)> = tail.captures.iter().map(|e| (e.capture_id.clone(), e.is_deletion())).collect();
    assert_eq!(entries, [(b.to_string(), true)], "the log shows the deletion, not the moves");

    // A holder whose lease has ended relocates nothing.
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();
    let retire = Relocation { new_pack: None, sources: vec![source(&rewritten)], source_captures: vec![] };
    let ended = publisher.publish_relocation(&retire).await;
    assert!(matches!(ended, Err(PublishError::NoLease)), "{ended:?}");
    assert_eq!(catalog.committed_versions(), vec![1, 2, 3, 4, 5]);
}

for_each_version!(an_older_catalog_is_stamped_4_by_its_first_deletion_and_5_by_its_first_compaction);
/// On tables a capstore before deletions made (unpartitioned, stamped 3, which a schema 3 capstore still reads), the
/// first deletion stamps 4 and the first compaction 5 before writing a row such a capstore would misread; a start
/// stamps neither.
async fn an_older_catalog_is_stamped_4_by_its_first_deletion_and_5_by_its_first_compaction(
    server: &'static ClickHouseServer,
) {
    use capstore::catalog::publish::{Relocation, RelocationOutcome, SourcePack};
    let database = server.fresh_database("older");
    let config = config_for(&server.url(), &database, "older");
    let tables = Tables::from_config(&config.catalog);
    server.query(&format!("CREATE DATABASE {database}")).unwrap();
    server.create_unpartitioned_tables(&tables, 3);
    let (client, tables) = capstore::catalog::connect(&config).await.expect("catalog schema");
    let catalog = Catalog { server, config, client, tables, proxy: None };
    assert_eq!(catalog.stamped_schema(), 3, "a start leaves an unpartitioned catalog at 3");
    let Publishing { publisher, shutdown_tx, keeper_task } = publishing(&catalog, "upgrader").await;
    let [a, b] = [(); 2].map(|_| Uuid::now_v7());
    let first = pack(&[(a, "cam/1", 100), (b, "cam/1", 200)]);
    let outcome = retried!(publisher.publish_batch(std::slice::from_ref(&first)).await);
    assert!(matches!(outcome, PublishOutcome::Committed { version: 1, .. }), "{outcome:?}");
    assert_eq!(catalog.stamped_schema(), 3, "a publish stamps nothing");

    assert_eq!(retried!(publisher.publish_deletions(&[b], None).await).version, Some(2));
    assert_eq!(catalog.stamped_schema(), 4, "the first deletion stamps schema 4");

    let mut merged = pack(&[(a, "cam/1", 100)]);
    merged.object_key = format!("prefix/test/{}.compacted.cpk", merged.summary.pack_id);
    let relocation = Relocation {
        new_pack: Some(merged.clone()),
        sources: vec![SourcePack { pack_id: first.summary.pack_id, object_key: first.object_key.clone() }],
        source_captures: vec![a, b],
    };
    let switched = retried!(publisher.publish_relocation(&relocation).await);
    assert_eq!(switched, RelocationOutcome::Switched { version: 3, moved: 1 });
    assert_eq!(catalog.stamped_schema(), 5, "the first compaction stamps schema 5");
    let got = catalog.reader().get(a, None).await.unwrap().unwrap();
    assert_eq!(got.pack_id, merged.summary.pack_id.to_string(), "the capture reads from its new pack");
    assert!(catalog.reader().get(b, None).await.unwrap().is_none(), "the deleted capture stays deleted");
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();
}

for_each_version!(the_rows_of_captures_deleted_longer_ago_than_the_grace_are_removed_and_nothing_else);
async fn the_rows_of_captures_deleted_longer_ago_than_the_grace_are_removed_and_nothing_else(
    server: &'static ClickHouseServer,
) {
    use capstore::catalog::publish::{Relocation, RelocationOutcome, SourcePack};
    use capstore::catalog::purge::{PurgeBatch, RowPurge};
    use capstore::catalog::query::TailPosition;
    let catalog = catalog(server, false).await;
    let Publishing { publisher, shutdown_tx, keeper_task } = publishing(&catalog, "purger").await;
    let [a, b, c, d] = [(); 4].map(|_| Uuid::now_v7());
    let first = pack(&[(a, "cam/1", 100), (b, "cam/1", 200), (c, "cam/1", 300)]);
    for batch in [first.clone(), pack(&[(d, "cam/2", 400)])] {
        let outcome = retried!(publisher.publish_batch(std::slice::from_ref(&batch)).await);
        assert!(matches!(outcome, PublishOutcome::Committed { .. }));
    }
    // Version 3 moves the three (a compaction), 4 deletes all three, 5 posts a again, 6 posts c again, 7 deletes
    // c again (two tombstones of c, one in the batch's versions).
    let mut merged = pack(&[(a, "cam/1", 100), (b, "cam/1", 200), (c, "cam/1", 300)]);
    merged.object_key = format!("prefix/test/{}.compacted.cpk", merged.summary.pack_id);
    let relocation = Relocation {
        new_pack: Some(merged),
        sources: vec![SourcePack { pack_id: first.summary.pack_id, object_key: first.object_key.clone() }],
        source_captures: vec![a, b, c],
    };
    let switched = retried!(publisher.publish_relocation(&relocation).await);
    assert_eq!(switched, RelocationOutcome::Switched { version: 3, moved: 3 });
    assert_eq!(retried!(publisher.publish_deletions(&[a, b, c], None).await).version, Some(4));
    let reposted = retried!(publisher.publish_batch(&[pack(&[(a, "cam/1", 100)])]).await);
    assert!(matches!(reposted, PublishOutcome::Committed { version: 5, .. }), "{reposted:?}");
    let reposted = retried!(publisher.publish_batch(&[pack(&[(c, "cam/1", 300)])]).await);
    assert!(matches!(reposted, PublishOutcome::Committed { version: 6, .. }), "{reposted:?}");
    assert_eq!(retried!(publisher.publish_deletions(&[c], None).await).version, Some(7));
    // Another catalog sharing the tables holds the same ids, never deleted there.
    let other_keeper = LeaseKeeper::new(catalog.store("other"), identity("other"), "other");
    let (other_tx, mut other_rx) = watch::channel(false);
    other_keeper.acquire_at_start(Duration::ZERO, &mut other_rx).await.unwrap();
    let other = Publisher::new(catalog.client.clone(), catalog.tables.clone(), "other", other_keeper.handle());
    let other_task = tokio::spawn(other_keeper.run(other_rx));
    let outcome = retried!(other.publish_batch(&[pack(&[(b, "cam/1", 200), (c, "cam/1", 300)])]).await);
    assert!(matches!(outcome, PublishOutcome::Committed { version: 1, .. }), "{outcome:?}");
    other_tx.send(true).unwrap();
    other_task.await.unwrap();

    let purge = RowPurge::new(catalog.client.clone(), catalog.tables.clone(), &catalog.config.catalog_name);
    assert_eq!(purge.next_batch(0, 7, Duration::from_secs(3600)).await.unwrap(), None, "nothing before the grace");
    // Only up to the version it is allowed to reach (erasure's progress).
    let upto_4 = purge.next_batch(0, 4, Duration::ZERO).await.unwrap();
    assert_eq!(upto_4, Some(PurgeBatch { through: 4, captures: vec![(b.to_string(), 4)] }));
    // a was posted again after its deletion: its newest row is no tombstone, and it is left alone.
    let batch = purge.next_batch(0, 7, Duration::ZERO).await.unwrap().unwrap();
    let mut expected = vec![(b.to_string(), 4), (c.to_string(), 7)];
    expected.sort();
    assert_eq!(batch, PurgeBatch { through: 7, captures: expected });
    let rows_of = |catalog_name: &str, table: &str, id: Uuid| {
        let id_column = if table == catalog.tables.by_id { "UUIDNumToString(capture_id)" } else { "capture_id" };
        catalog
            .server
            .query(&format!(
                "SELECT DISTINCT version FROM {table} WHERE catalog = '{catalog_name}' AND {id_column} = '{id}' \
                 ORDER BY version FORMAT TSV"
            ))
            .unwrap()
            .lines()
            .map(|line| line.parse::<u64>().unwrap())
            .collect::<Vec<_>>()
    };
    let tables = [&catalog.tables.captures, &catalog.tables.by_version, &catalog.tables.by_id];
    let snapshot_of = |catalog_name: &str, ids: &[Uuid]| {
        ids.iter()
            .map(|id| tables.iter().map(|table| rows_of(catalog_name, table, *id)).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    };
    let snapshot = |ids: &[Uuid]| snapshot_of(&catalog.config.catalog_name, ids);
    let kept_before = snapshot(&[a, d]);
    let other_before = snapshot_of("other", &[b, c]);
    assert_eq!(other_before[0], vec![vec![1], vec![1], vec![1]]);
    assert_eq!(snapshot(&[b])[0], vec![vec![1], vec![1, 3, 4], vec![1, 3, 4]], "b's rows before the removal");

    let between = std::sync::atomic::AtomicU32::new(0);
    purge
        .remove(&batch, || {
            between.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        })
        .await
        .unwrap();
    assert_eq!(between.into_inner(), 1, "the hook runs once, between the first statement and the others");
    let deadline = Instant::now() + common::MUTATION_PATIENCE;
    while purge.in_flight().await.unwrap() {
        assert!(Instant::now() < deadline, "the mutations did not finish within {:?}", common::MUTATION_PATIENCE);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        snapshot(&[b, c]),
        vec![vec![vec![], vec![4], vec![4]], vec![vec![], vec![7], vec![7]]],
        "only the newest tombstones are left of b and c (c's at 4 goes: each capture is bounded by its own)"
    );
    assert_eq!(snapshot(&[a, d]), kept_before, "a (posted again) and d (never deleted) keep every row");
    assert_eq!(snapshot_of("other", &[b, c]), other_before, "another catalog's rows of the same ids stay");
    if catalog.client.server_version().keeps_time_table() {
        // by_time (18.16) loses the rows captures loses, and only those.
        let merged_rows_of = |table: &str, id: Uuid| {
            let sql = format!(
                "SELECT DISTINCT catalog, version FROM {table} FINAL WHERE capture_id = '{id}' ORDER BY catalog, \
                 version FORMAT TSV"
            );
            catalog.server.query(&sql).unwrap()
        };
        for id in [a, b, c, d] {
            assert_eq!(merged_rows_of(&catalog.tables.by_time, id), merged_rows_of(&catalog.tables.captures, id));
        }
        assert!(merged_rows_of(&catalog.tables.by_time, a).contains(&catalog.config.catalog_name));
    }

    // Every read answers as before.
    let reader = catalog.reader();
    assert!(reader.get(b, None).await.unwrap().is_none());
    assert!(reader.lookup(b, None).await.unwrap().unwrap().is_deletion(), "b is still known deleted");
    assert_eq!(reader.get(a, None).await.unwrap().unwrap().version, 5);
    let ids = |page: capstore::catalog::query::Page| {
        page.captures.iter().map(|capture| capture.capture_id.clone()).collect::<Vec<_>>()
    };
    let everything = ListQuery { limit: 100, ..Default::default() };
    assert_eq!(ids(reader.list(&everything).await.unwrap()), [a.to_string(), d.to_string()]);
    let stream = ListQuery { stream: Some("cam/1".into()), limit: 100, ..Default::default() };
    assert_eq!(ids(reader.list(&stream).await.unwrap()), [a.to_string()]);
    // The log still delivers every deletion at its version (and a's post at 5).
    let tail = reader.tail_page(TailPosition::after_version(3), None, 100).await.unwrap();
    let entries: Vec<(String, u64, bool)> =
        tail.captures.iter().map(|entry| (entry.capture_id.clone(), entry.version, entry.is_deletion())).collect();
    let mut deleted_at_4 = vec![(a.to_string(), 4, true), (b.to_string(), 4, true)];
    deleted_at_4.sort();
    let expected: Vec<(String, u64, bool)> =
        deleted_at_4.into_iter().chain([(a.to_string(), 5, false), (c.to_string(), 7, true)]).collect();
    assert_eq!(entries, expected, "the log keeps each capture's last deletion (c's history below it is gone)");
    // Found purged: the next look finds the batch with nothing left to remove.
    assert_eq!(
        purge.next_batch(0, 7, Duration::ZERO).await.unwrap(),
        Some(PurgeBatch { through: 7, captures: vec![] })
    );
    assert_eq!(purge.next_batch(7, 7, Duration::ZERO).await.unwrap(), None);
    // A stale batch (a read that missed a's post at 5) removes nothing at or above a's tombstone: a stays.
    purge.remove(&PurgeBatch { through: 7, captures: vec![(a.to_string(), 4)] }, || {}).await.unwrap();
    let deadline = Instant::now() + common::MUTATION_PATIENCE;
    while purge.in_flight().await.unwrap() {
        assert!(Instant::now() < deadline, "the mutations did not finish within {:?}", common::MUTATION_PATIENCE);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(snapshot(&[a])[0], vec![vec![5], vec![4, 5], vec![4, 5]], "a keeps its tombstone and its post");
    assert_eq!(reader.get(a, None).await.unwrap().unwrap().version, 5);
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();
}

for_each_version!(the_holder_trims_its_lease_history_below_the_head_and_leaves_other_catalogs_alone);
async fn the_holder_trims_its_lease_history_below_the_head_and_leaves_other_catalogs_alone(
    server: &'static ClickHouseServer,
) {
    const EVERY: u64 = 4;
    let catalog = catalog(server, false).await;
    // Another catalog in the same tables, with a history of six terms.
    let other = catalog.store("other-catalog");
    let neighbour = identity("neighbour");
    let ClaimOutcome::Held { mut term, .. } = other.claim("lease-n", &neighbour).await.unwrap() else { panic!() };
    for _ in 0..5 {
        let ClaimOutcome::Held { term: renewed, .. } = other.renew("lease-n", &neighbour, term).await.unwrap() else {
            panic!()
        };
        term = renewed;
    }
    other.release("lease-n", &neighbour, term).await.unwrap();
    let history = |name: &str| -> (u64, u64, u64) {
        let text = catalog
            .server
            .query(&format!(
                "SELECT min(term), max(term), count() FROM {} WHERE catalog = '{name}' FORMAT TSV",
                catalog.tables.lease
            ))
            .unwrap();
        let fields: Vec<u64> = text.split_whitespace().map(|field| field.parse().unwrap()).collect();
        (fields[0], fields[1], fields[2])
    };
    let neighbour_history = history("other-catalog");
    assert_eq!(neighbour_history, (1, 6, 7), "six terms and a tombstone");

    let keeper = catalog.keeper(identity("trimmer")).trim_history_every(EVERY);
    let (shutdown_tx, mut shutdown_rx) = watch::channel(false);
    keeper.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
    let handle = keeper.handle();
    let publisher =
        Publisher::new(catalog.client.clone(), catalog.tables.clone(), &catalog.config.catalog_name, handle.clone());
    let keeper_task = tokio::spawn(keeper.run(shutdown_rx));

    // Renewals every ttl/6 (0.5 s): a trim at term 4 and at each 4 terms after it deletes the rows below it. Wait
    // for a trim past term 8, so at least two have run, and then for the history to be shorter than the terms.
    let ours = catalog.config.catalog_name.clone();
    let started = Instant::now();
    let (lowest, head, rows) = loop {
        let (lowest, head, rows) = history(&ours);
        if lowest >= 2 * EVERY && rows < head {
            break (lowest, head, rows);
        }
        assert!(
            started.elapsed() < common::MUTATION_PATIENCE,
            "the lease history was not trimmed: terms {lowest}..={head} in {rows} rows"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("lease history after trims: terms {lowest}..={head} in {rows} rows");
    assert_eq!(
        history("other-catalog"),
        neighbour_history,
        "another catalog's lease rows are not the holder's to trim"
    );

    // Nothing a decision reads went: the holder still renews, and its publishes pass the fence.
    assert_eq!(handle.state(), LeaseState::Held, "{:?}", handle.status());
    let outcome = retried!(publisher.publish_batch(&[one_capture_pack()]).await);
    assert!(matches!(outcome, PublishOutcome::Committed { .. }), "{outcome:?}");
    let renewals = handle.status().lease_renewals;
    let started = Instant::now();
    while handle.status().lease_renewals < renewals + 2 {
        assert!(started.elapsed() < TTL * 2, "renewals stopped after a trim: {:?}", handle.status());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(handle.state(), LeaseState::Held, "{:?}", handle.status());
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();
}

for_each_version!(a_publisher_guesses_its_next_version_within_a_tenure_and_a_wrong_guess_is_refused_not_reused);
async fn a_publisher_guesses_its_next_version_within_a_tenure_and_a_wrong_guess_is_refused_not_reused(
    server: &'static ClickHouseServer,
) {
    let catalog = catalog(server, false).await;
    let keeper = catalog.keeper(identity("two-publishers"));
    let (shutdown_tx, mut shutdown_rx) = watch::channel(false);
    keeper.acquire_at_start(Duration::ZERO, &mut shutdown_rx).await.unwrap();
    let handle = keeper.handle();
    let keeper_task = tokio::spawn(keeper.run(shutdown_rx));
    let new_publisher =
        || Publisher::new(catalog.client.clone(), catalog.tables.clone(), &catalog.config.catalog_name, handle.clone());
    // Production has one publisher per process; two on one lease handle make the first one's guess wrong.
    let (first, second) = (new_publisher(), new_publisher());
    let committed = |outcome: PublishOutcome| match outcome {
        PublishOutcome::Committed { version, .. } => version,
        other => panic!("{other:?}"),
    };
    assert_eq!(committed(retried!(first.publish_batch(&[one_capture_pack()]).await)), 1);
    assert_eq!(committed(retried!(first.publish_batch(&[one_capture_pack()]).await)), 2, "the guess after its commit");
    assert_eq!(committed(retried!(second.publish_batch(&[one_capture_pack()]).await)), 3, "read from the watermark");
    // The first guesses 3, which is taken: the version check refuses it, and the retry reads the watermark.
    let mut refusals = 0;
    let version = loop {
        match first.publish_batch(&[one_capture_pack()]).await {
            Ok(outcome) => break committed(outcome),
            Err(PublishError::NotCommitted) => refusals += 1,
            Err(PublishError::NoLease) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(other) => panic!("{other}"),
        }
    };
    assert_eq!(version, 4);
    assert!(refusals >= 1, "the stale guess must have been sent and refused");
    assert_eq!(catalog.committed_versions(), vec![1, 2, 3, 4], "gapless, none twice");
    shutdown_tx.send(true).unwrap();
    keeper_task.await.unwrap();
}

for_each_version!(no_lease_is_claimed_while_the_tables_are_being_repartitioned);
async fn no_lease_is_claimed_while_the_tables_are_being_repartitioned(server: &'static ClickHouseServer) {
    let catalog = catalog(server, false).await;
    let store = catalog.store(&catalog.config.catalog_name);
    let mark = |version: u32| {
        server
            .query(&format!(
                "INSERT INTO {} (component, version, written_at_ms) VALUES ('repartition', {version}, 0)",
                catalog.tables.schema
            ))
            .unwrap();
    };
    // A run under way (odd): a daemon that passed its start check just before cannot claim.
    mark(1);
    let outcome = store.claim("during", &identity("early")).await.unwrap();
    assert!(!matches!(outcome, ClaimOutcome::Held { .. }), "claimed during a repartition: {outcome:?}");
    assert_eq!(store.read_head().await.unwrap().term, 0, "no lease row was written");
    let refused = capstore::catalog::schema::ensure_schema(&catalog.client, &catalog.tables).await.unwrap_err();
    assert!(refused.to_string().contains("capstore repartition"), "{refused}");
    let refused = capstore::catalog::schema::check_schema(&catalog.client, &catalog.tables).await.unwrap_err();
    assert!(refused.to_string().contains("capstore repartition"), "a reader: {refused}");
    // Done (even): claims go through again, and readers read.
    mark(2);
    capstore::catalog::schema::check_schema(&catalog.client, &catalog.tables).await.unwrap();
    let outcome = store.claim("after", &identity("late")).await.unwrap();
    assert!(matches!(outcome, ClaimOutcome::Held { term: 1, .. }), "{outcome:?}");
}

for_each_version!(newer_servers_keep_captures_in_time_order_and_filters_of_ids_and_labels_and_older_tables_get_them);
async fn newer_servers_keep_captures_in_time_order_and_filters_of_ids_and_labels_and_older_tables_get_them(
    server: &'static ClickHouseServer,
) {
    use capstore::catalog::schema::{
        ensure_schema, missing_server_indexes, ID_FILTER_INDEX, LABEL_FILTER_INDEX, LABEL_PAIRS, TIME_ORDER_PROJECTION,
    };
    let catalog = catalog(server, false).await;
    let (captures, by_id) = (&catalog.tables.captures, &catalog.tables.by_id);
    let name = &catalog.config.catalog_name;
    // 100k captures, one a second round 100 streams, each labelled with its own run number, committed at version 1.
    let first_ns: u64 = 1_700_000_000_000_000_000;
    let publish_id = Uuid::now_v7();
    let fill = format!(
        "INSERT INTO {captures} (catalog, stream, captured_at_ns, capture_id, pack_id, object_key, label_keys, \
         label_values, version, publish_id) SELECT '{name}', concat('s', toString(number % 100)), \
         {first_ns} + number * 1000000000, toString(generateUUIDv4()), 'p', 'k', ['run'], [toString(number)], 1, \
         '{publish_id}' FROM numbers(100000)"
    );
    server.query(&fill).unwrap();
    catalog.commit_row(1, publish_id);
    let since_ns = first_ns + 50_000 * 1_000_000_000;
    let some_id = server
        .query(&format!("SELECT capture_id FROM {captures} WHERE captured_at_ns = {since_ns} FORMAT TSV"))
        .unwrap();
    let some_id = Uuid::parse_str(some_id.trim()).unwrap();
    // What each index is for: a window across streams, a lookup by id, a rare label inside a stream.
    let window = format!(
        "SELECT count() FROM {captures} WHERE catalog = '{name}' AND captured_at_ns >= {since_ns} AND \
         captured_at_ns < {since_ns} + 100000000000"
    );
    let lookup = format!(
        "SELECT max(version) FROM {by_id} WHERE catalog = '{name}' AND capture_id = UUIDStringToNum('{some_id}')"
    );
    let by_label = format!(
        "SELECT count() FROM {captures} WHERE catalog = '{name}' AND stream = 's0' AND \
         has({LABEL_PAIRS}, 'run=50000')"
    );
    // Whether the server's plan for `sql` reads through `index` (searched on the server: a plan may hold bytes).
    let plan_uses = |sql: &str, index: &str| {
        let sql = format!(
            "SELECT count() FROM (EXPLAIN indexes = 1 {sql}) WHERE explain LIKE '%ReadFromMergeTree ({index})%' OR \
             explain LIKE '%Name: {index}%' FORMAT TSV"
        );
        server.query(&sql).unwrap().trim() != "0"
    };
    let (database, _) = captures.split_once('.').unwrap();
    let indexed = |table: &str, index: &str| {
        let table = table.split_once('.').unwrap().1;
        let sql = format!(
            "SELECT (SELECT sum(data_compressed_bytes) FROM system.data_skipping_indices WHERE database = \
             '{database}' AND table = '{table}' AND name = '{index}') + (SELECT sum(rows) FROM \
             system.projection_parts WHERE database = '{database}' AND table = '{table}' AND name = '{index}' AND \
             active) FORMAT TSV"
        );
        server.query(&sql).unwrap().trim().parse::<u64>().unwrap_or(0) > 0
    };
    let missing = || async { missing_server_indexes(&catalog.client, &catalog.tables).await.unwrap() };
    // `by_id`'s compression blocks are made small with its filter, for lookups.
    let small_blocks = || {
        let sql = format!("SHOW CREATE TABLE {by_id} FORMAT TSVRaw");
        server.query(&sql).unwrap().contains("max_compress_block_size = 8192")
    };
    let expected = [
        (captures, TIME_ORDER_PROJECTION, &window),
        (by_id, ID_FILTER_INDEX, &lookup),
        (captures, LABEL_FILTER_INDEX, &by_label),
    ];
    if server.version.is_modern() {
        assert!(missing().await.is_empty(), "a new catalog's tables have them all");
        assert!(small_blocks());
        for (table, index, read) in expected {
            assert!(indexed(table, index), "{index}: rows inserted after it was added are in it");
            assert!(plan_uses(read, index), "{index}: the read it is for does not use it");
        }
        // Tables without them (made before this capstore, or on a server since upgraded) get them at a start, and
        // the rows written before are indexed in the background.
        server.query(&format!("ALTER TABLE {captures} DROP PROJECTION {TIME_ORDER_PROJECTION}")).unwrap();
        server.query(&format!("ALTER TABLE {by_id} DROP INDEX {ID_FILTER_INDEX}")).unwrap();
        let reset = format!("ALTER TABLE {by_id} RESET SETTING min_compress_block_size, max_compress_block_size");
        server.query(&reset).unwrap();
        assert!(!small_blocks());
        server.query(&format!("ALTER TABLE {captures} DROP INDEX {LABEL_FILTER_INDEX}")).unwrap();
        assert_eq!(missing().await.len(), 3);
        for (table, index, _) in expected {
            assert!(!indexed(table, index), "{index} dropped");
        }
        ensure_schema(&catalog.client, &catalog.tables).await.unwrap();
        assert!(missing().await.is_empty());
        assert!(small_blocks());
        for (table, index, read) in expected {
            assert!(
                common::wait_until(Duration::from_secs(60), || indexed(table, index)),
                "{index}: the rows written before it were never indexed"
            );
            assert!(plan_uses(read, index), "{index}: the read it is for does not use it");
        }
        let by_time_tables = format!(
            "SELECT count() FROM system.tables WHERE database = '{database}' AND name LIKE '%by_time%' FORMAT TSV"
        );
        assert_eq!(server.query(&by_time_tables).unwrap().trim(), "0", "the projection does by_time's work");
    } else {
        assert!(catalog.tables.server_indexes(catalog.client.server_version()).is_empty(), "18.16 keeps none");
        assert!(!small_blocks());
        time_ordered_table_is_kept_read_across_streams_and_added_to_older_tables(&catalog, since_ns, some_id).await;
    }
    // Either way a listing across streams from the middle of the range is the next hundred captures by time, a
    // lookup by id finds its capture, and a listing by a label finds the one capture that has it.
    let query = ListQuery { since_ns: Some(since_ns), limit: 100, ..ListQuery::default() };
    let page = catalog.reader().list(&query).await.unwrap();
    let times: Vec<u64> = page.captures.iter().map(|capture| capture.captured_at_ns).collect();
    let expected: Vec<u64> = (0..100).map(|n| since_ns + n * 1_000_000_000).collect();
    assert_eq!(times, expected);
    let found = catalog.reader().get(some_id, None).await.unwrap().expect("the capture is found by its id");
    assert_eq!(found.captured_at_ns, since_ns);
    let labels = BTreeMap::from([("run".to_string(), "50000".to_string())]);
    let query = ListQuery { stream: Some("s0".into()), labels, limit: 100, ..ListQuery::default() };
    let page = catalog.reader().list(&query).await.unwrap();
    let ids: Vec<&str> = page.captures.iter().map(|capture| capture.capture_id.as_str()).collect();
    assert_eq!(ids, vec![some_id.to_string().as_str()]);
}

/// On a server without projections (18.16) the catalog keeps `by_time`: every row of `captures` in time order, which
/// a listing across streams reads (and a listing of one stream does not). A catalog made before it gets it at a
/// start, with the rows written before copied in. `catalog` holds 100k captures round 100 streams, `some_id` at
/// `since_ns` in `s0`.
async fn time_ordered_table_is_kept_read_across_streams_and_added_to_older_tables(
    catalog: &Catalog,
    since_ns: u64,
    some_id: Uuid,
) {
    use capstore::catalog::schema::{ensure_schema, time_table_kept, TIME_TABLE_COMPONENT};
    let (server, tables) = (catalog.server, &catalog.tables);
    let (captures, by_time, schema) = (&tables.captures, &tables.by_time, &tables.schema);
    let count = |sql: &str| server.query(&format!("{sql} FORMAT TSV")).unwrap().trim().parse::<u64>().unwrap();
    let mutations_done = || {
        let (database, table) = by_time.split_once('.').unwrap();
        let (_, schema_table) = schema.split_once('.').unwrap();
        count(&format!(
            "SELECT count() FROM system.mutations WHERE database = '{database}' AND table IN ('{table}', \
             '{schema_table}') AND is_done = 0"
        )) == 0
    };
    let kept = || async { time_table_kept(&catalog.client, tables).await.unwrap() };
    let page_from = |stream: Option<&str>, since_ns: u64| {
        let query =
            ListQuery { stream: stream.map(str::to_string), since_ns: Some(since_ns), limit: 3, ..Default::default() };
        // A reader of its own: a reader learns once which table it lists from.
        let reader = catalog.reader();
        async move {
            let page = reader.list(&query).await.unwrap();
            page.captures.iter().map(|capture| (capture.captured_at_ns, capture.capture_id.clone())).collect::<Vec<_>>()
        }
    };
    let page_times = |stream: Option<&str>| page_from(stream, since_ns);
    let second = 1_000_000_000;
    let across_all = page_times(None).await;
    let in_s0 = page_times(Some("s0")).await;
    assert_eq!(across_all[0], (since_ns, some_id.to_string()));
    assert_eq!(in_s0[0], (since_ns, some_id.to_string()));
    assert_eq!(count(&format!("SELECT count() FROM {by_time}")), 100_000, "the view wrote every inserted row");
    assert!(kept().await, "a new catalog keeps it from the first");

    // Listings across streams read it (a row missing from it only is missing from them), listings of a stream don't.
    server.query(&format!("ALTER TABLE {by_time} DELETE WHERE capture_id = '{some_id}'")).unwrap();
    assert!(common::wait_until(common::MUTATION_PATIENCE, mutations_done), "the deletion from by_time never ended");
    let without = page_times(None).await;
    assert_eq!(without[0].0, since_ns + second, "a listing across streams reads by_time");
    assert_eq!(page_times(Some("s0")).await, in_s0, "a listing of a stream reads captures");

    // A catalog made before it (no table, no view, no mark) is listed from `captures`, then gets it at a start.
    server.query(&format!("DROP TABLE {by_time}_view")).unwrap();
    server.query(&format!("DROP TABLE {by_time}")).unwrap();
    server.query(&format!("ALTER TABLE {schema} DELETE WHERE component = '{TIME_TABLE_COMPONENT}'")).unwrap();
    assert!(common::wait_until(common::MUTATION_PATIENCE, mutations_done), "the mark's deletion never ended");
    assert!(!kept().await);
    assert_eq!(page_times(None).await, across_all, "without by_time a listing across streams reads captures");
    ensure_schema(&catalog.client, tables).await.unwrap();
    assert!(kept().await, "the start that added it marked it filled");
    assert_eq!(count(&format!("SELECT count() FROM {by_time}")), count(&format!("SELECT count() FROM {captures}")));
    assert_eq!(page_times(None).await, across_all, "by_time holds the rows written before it");
    // And the view writes what is published from then on (before `since_ns`: the caller lists from there).
    let at = since_ns - second / 2;
    let late = Uuid::now_v7();
    let publish_id = Uuid::now_v7();
    catalog.insert_capture_row(late, "s7", at, 2, publish_id);
    catalog.commit_row(2, publish_id);
    let times = |page: Vec<(u64, String)>| page.into_iter().map(|(at, _)| at).collect::<Vec<_>>();
    assert_eq!(times(page_from(None, since_ns - second).await), [since_ns - second, at, since_ns]);

    // Its view dropped by hand while it is kept: what is inserted meanwhile misses it, and a start makes the view
    // again and copies again.
    server.query(&format!("DROP TABLE {by_time}_view")).unwrap();
    let (missed, missed_at, publish_id) = (Uuid::now_v7(), since_ns - second / 4, Uuid::now_v7());
    catalog.insert_capture_row(missed, "s8", missed_at, 3, publish_id);
    catalog.commit_row(3, publish_id);
    let rows_of_missed = || count(&format!("SELECT count() FROM {by_time} WHERE capture_id = '{missed}'"));
    assert_eq!(rows_of_missed(), 0);
    ensure_schema(&catalog.client, tables).await.unwrap();
    assert!(rows_of_missed() > 0, "the start copied what the missing view did not write");
    assert_eq!(times(page_from(None, since_ns - second).await), [since_ns - second, at, missed_at]);
}
