//! Live tests of the catalog client against a real ClickHouse (and the S3 harness smoke test).

mod common;

use std::time::{Duration, Instant};

use capstore::catalog::client::{sql_string_literal, CatalogClient, CatalogError, ErrorKind};
use capstore::config::{CatalogConfig, HumanDuration, Secret};
use common::clickhouse::{ClickHouseServer, Version};
use common::proxy::FaultProxy;
use serde::{Deserialize, Serialize};

fn config_for(url: String, request_timeout: Duration) -> CatalogConfig {
    CatalogConfig { url, request_timeout: HumanDuration(request_timeout), ..CatalogConfig::default() }
}

async fn connect_direct(server: &ClickHouseServer) -> CatalogClient {
    CatalogClient::connect(&config_for(server.url(), Duration::from_secs(10)))
        .await
        .unwrap_or_else(|error| panic!("{error}\n{}", server.log_tail()))
}

/// A fresh database with one table `t (id UInt64, note String)`, created over a direct connection.
fn fresh_table(server: &ClickHouseServer, prefix: &str) -> String {
    let database = server.fresh_database(prefix);
    server.query(&format!("CREATE DATABASE {database}")).unwrap();
    server
        .query(&format!("CREATE TABLE {database}.t (id UInt64, note String) ENGINE = MergeTree ORDER BY id"))
        .unwrap();
    format!("{database}.t")
}

#[derive(Debug, Clone, PartialEq, clickhouse::Row, Serialize, Deserialize)]
struct CaptureRow {
    #[serde(with = "clickhouse::serde::uuid")]
    capture_id: uuid::Uuid,
    stream: String,
    captured_at_ns: u64,
    label_keys: Vec<String>,
    label_values: Vec<String>,
}

fn labels(pairs: &[(&str, &str)]) -> (Vec<String>, Vec<String>) {
    pairs.iter().map(|(key, value)| (key.to_string(), value.to_string())).unzip()
}

#[derive(Debug, Clone, PartialEq, clickhouse::Row, Serialize, Deserialize)]
struct NoteRow {
    id: u64,
    note: String,
}

for_each_version!(the_server_version_is_detected_and_old_servers_get_a_coarse_clock);
async fn the_server_version_is_detected_and_old_servers_get_a_coarse_clock(server: &'static ClickHouseServer) {
    let client = connect_direct(server).await;
    let version = client.server_version();
    assert_eq!(version.text, server.version.expected_server_version());
    assert_eq!(version.is_modern(), server.version.is_modern());
    let expected_extra = if server.version == Version::V18_16 { Duration::from_secs(1) } else { Duration::ZERO };
    assert_eq!(client.clock_resolution_extra(), expected_extra);
}

for_each_version!(ddl_insert_and_fetch_round_trip_uuid_strings_numbers_and_labels);
async fn ddl_insert_and_fetch_round_trip_uuid_strings_numbers_and_labels(server: &'static ClickHouseServer) {
    let client = connect_direct(server).await;
    let database = server.fresh_database("round_trip");
    client.execute(&format!("CREATE DATABASE {database}")).await.unwrap();
    client
        .execute(&format!(
            "CREATE TABLE {database}.captures (capture_id UUID, stream String, captured_at_ns UInt64, \
             label_keys Array(String), label_values Array(String)) ENGINE = MergeTree ORDER BY (stream, captured_at_ns)"
        ))
        .await
        .unwrap();
    let (site_keys, site_values) = labels(&[("quote", "it's \\ \"x\""), ("site", "edge-7")]);
    let (empty_keys, empty_values) = labels(&[("k", "")]);
    let rows = vec![
        CaptureRow {
            capture_id: uuid::Uuid::new_v4(),
            stream: "cam/1".into(),
            captured_at_ns: 1,
            label_keys: site_keys,
            label_values: site_values,
        },
        CaptureRow {
            capture_id: uuid::Uuid::new_v4(),
            stream: "cam/2".into(),
            captured_at_ns: u64::MAX,
            label_keys: vec![],
            label_values: vec![],
        },
        CaptureRow {
            capture_id: uuid::Uuid::new_v4(),
            stream: "ünïcode/\0nul".into(),
            captured_at_ns: 1_700_000_000_123_456_789,
            label_keys: empty_keys,
            label_values: empty_values,
        },
    ];
    client.insert_rows(&format!("{database}.captures"), &rows).await.unwrap();
    let fetched: Vec<CaptureRow> = client
        .fetch_all(&format!(
            "SELECT capture_id, stream, captured_at_ns, label_keys, label_values FROM {database}.captures \
             ORDER BY stream, captured_at_ns"
        ))
        .await
        .unwrap();
    assert_eq!(fetched, rows);

    // The server sees the same UUID text and label pairs (not just our own decoder agreeing with our encoder).
    let server_view = server
        .query(&format!(
            "SELECT toString(capture_id), label_keys, label_values FROM {database}.captures \
             WHERE stream = 'cam/1' FORMAT TSV"
        ))
        .unwrap();
    assert!(server_view.starts_with(&format!("{}\t['quote','site']\t[", rows[0].capture_id)), "{server_view}");
}

for_each_version!(a_hundred_thousand_rows_go_in_one_insert);
async fn a_hundred_thousand_rows_go_in_one_insert(server: &'static ClickHouseServer) {
    let client = connect_direct(server).await;
    let table = fresh_table(server, "bulk");
    let rows: Vec<NoteRow> = (0..100_000).map(|id| NoteRow { id, note: format!("note {id}") }).collect();
    let started = Instant::now();
    client.insert_rows(&table, &rows).await.unwrap();
    // Printed, not asserted: speed belongs to benchmarks on these shared machines.
    eprintln!("inserted 100000 rows in {:?}", started.elapsed());
    let counts: Vec<(u64, u64)> = client.fetch_all(&format!("SELECT count(), sum(id) FROM {table}")).await.unwrap();
    assert_eq!(counts, vec![(100_000, (0..100_000u64).sum())]);
}

for_each_version!(inserts_say_whether_they_are_asynchronous_where_the_server_has_them_and_are_seen_once_acked);
async fn inserts_say_whether_they_are_asynchronous_where_the_server_has_them_and_are_seen_once_acked(
    server: &'static ClickHouseServer,
) {
    const INSERTS: u64 = 20;
    for async_insert in [false, true] {
        let config = CatalogConfig { async_insert, ..config_for(server.url(), Duration::from_secs(10)) };
        let client = CatalogClient::connect(&config).await.unwrap();
        // What the server applies to capstore's requests. 18.16 has neither setting (and would refuse one sent);
        // chDB 26.x turns asynchronous inserts on by default, which capstore overrides unless asked for them.
        let applied: Vec<(String, String)> = client
            .fetch_all(
                "SELECT name, value FROM system.settings WHERE name IN ('async_insert', 'wait_for_async_insert') \
                 ORDER BY name",
            )
            .await
            .unwrap();
        let expected: Vec<(String, String)> = match (server.version.is_modern(), async_insert) {
            (false, _) => vec![],
            (true, false) => vec![("async_insert".into(), "0".into()), ("wait_for_async_insert".into(), "1".into())],
            (true, true) => vec![("async_insert".into(), "1".into()), ("wait_for_async_insert".into(), "1".into())],
        };
        assert_eq!(applied, expected, "async_insert={async_insert}");

        let table = fresh_table(server, "async_insert");
        server.query(&format!("SYSTEM STOP MERGES {table}")).unwrap();
        let inserts = (0..INSERTS).map(|id| {
            let client = client.clone();
            let table = table.clone();
            async move {
                client.insert_rows(&table, &[NoteRow { id, note: format!("row {id}") }]).await.unwrap();
                // Acknowledged means flushed: the row is there for the next read, on another connection.
                let seen: Vec<u64> =
                    client.fetch_all(&format!("SELECT count() FROM {table} WHERE id = {id}")).await.unwrap();
                assert_eq!(seen, vec![1], "row {id} unseen once its insert returned (async_insert={async_insert})");
            }
        });
        futures::future::join_all(inserts).await;
        if !async_insert {
            let (database, name) = table.split_once('.').unwrap();
            let parts = server
                .query(&format!(
                    "SELECT count() FROM system.parts WHERE database = '{database}' AND table = '{name}' AND active"
                ))
                .unwrap();
            assert_eq!(parts.trim(), INSERTS.to_string(), "a synchronous insert makes a part of its own");
        }
    }
}

for_each_version!(quoted_literals_survive_hostile_strings);
async fn quoted_literals_survive_hostile_strings(server: &'static ClickHouseServer) {
    let client = connect_direct(server).await;
    let hostile = "a'b\\c\n\t\0 ?? ' OR 1=1 --";
    let by_literal: Vec<String> = client.fetch_all(&format!("SELECT {}", sql_string_literal(hostile))).await.unwrap();
    assert_eq!(by_literal, vec![hostile.to_string()]);
}

fn assert_kind(error: &CatalogError, kind: ErrorKind, code: Option<u32>) {
    assert_eq!(error.kind, kind, "{error}");
    assert_eq!(error.server_code, code, "{error}");
}

for_each_version!(statements_rejected_before_execution_are_definitely_failed);
async fn statements_rejected_before_execution_are_definitely_failed(server: &'static ClickHouseServer) {
    let client = connect_direct(server).await;
    let syntax = client.execute("SELEC 1").await.unwrap_err();
    assert_kind(&syntax, ErrorKind::DefinitelyFailed, Some(62));
    let unknown_table = client.fetch_all::<u64>("SELECT count() FROM default.no_such_table").await.unwrap_err();
    assert_kind(&unknown_table, ErrorKind::DefinitelyFailed, Some(60));
    let unknown_database =
        client.insert_rows("no_such_database.t", &[NoteRow { id: 1, note: "x".into() }]).await.unwrap_err();
    assert_kind(&unknown_database, ErrorKind::DefinitelyFailed, Some(81));
    let unknown_identifier = client.execute("SELECT no_such_column").await.unwrap_err();
    assert_kind(&unknown_identifier, ErrorKind::DefinitelyFailed, Some(47));
}

for_each_version!(a_wrong_password_is_definitely_failed);
async fn a_wrong_password_is_definitely_failed(server: &'static ClickHouseServer) {
    let mut config = config_for(server.url(), Duration::from_secs(10));
    config.password = Some(Secret::new("not-the-password"));
    let error = CatalogClient::connect(&config).await.unwrap_err();
    // 193 WRONG_PASSWORD on 18.16; current servers say 194 REQUIRED_PASSWORD for a user without one.
    let code = if server.version == Version::V18_16 { 193 } else { 194 };
    assert_kind(&error, ErrorKind::DefinitelyFailed, Some(code));
    assert!(!error.to_string().contains("not-the-password"), "{error}");
}

for_each_version!(an_error_in_mid_stream_is_an_error_not_a_short_result);
async fn an_error_in_mid_stream_is_an_error_not_a_short_result(server: &'static ClickHouseServer) {
    let client = connect_direct(server).await;
    // Fails after ~900k rows have been produced; without wait_end_of_query=1, 18.16 answers 200 and streams them.
    let error = client
        .fetch_all::<u64>("SELECT number FROM numbers(1000000) WHERE throwIf(number = 900000) = 0")
        .await
        .unwrap_err();
    // 395 FUNCTION_THROW_IF_VALUE_IS_NON_ZERO: raised while executing, so the outcome is unknown.
    assert_kind(&error, ErrorKind::OutcomeUnknown, Some(395));
}

#[tokio::test]
async fn a_closed_port_is_definitely_failed() {
    let closed_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    // The listener is dropped: nothing listens there now.
    let error =
        CatalogClient::connect(&config_for(format!("http://{closed_port}"), Duration::from_secs(5))).await.unwrap_err();
    assert_kind(&error, ErrorKind::DefinitelyFailed, None);
    // Nothing listens there, so nothing sent there before still runs (what a wait for a statement's end relies on).
    assert!(error.is_refused(), "{error:?}");
}

for_each_version!(a_statement_run_to_its_end_comes_back_only_once_the_server_has_finished_it);
async fn a_statement_run_to_its_end_comes_back_only_once_the_server_has_finished_it(server: &'static ClickHouseServer) {
    let table = fresh_table(server, "to_its_end");
    let client = CatalogClient::connect(&config_for(server.url(), Duration::from_secs(1))).await.unwrap();
    // About 4 s on the server, past the 1 s request timeout: not read-only, so the server runs it on after its
    // client has given up.
    let insert = |first: u64| {
        format!(
            "INSERT INTO {table} SELECT number + {first}, toString(sleepEachRow(0.5)) FROM numbers(8) SETTINGS \
             max_block_size = 1"
        )
    };
    let running = |first: u64| {
        server
            .query(&format!(
                "SELECT count() FROM system.processes WHERE query LIKE '%number + {first},%' AND query NOT LIKE \
                 '%system.processes%'"
            ))
            .unwrap()
    };
    let ended = client.execute_to_its_end(&insert(0), Duration::from_secs(30)).await.unwrap_err();
    assert!(ended.error.reply_lost() && !ended.may_still_run, "{ended:?}");
    assert_eq!(running(0), "0\n", "still running after its end was waited for");
    assert_eq!(server.query(&format!("SELECT count() FROM {table} WHERE id < 100")).unwrap(), "8\n");
    // The same statement through `execute` comes back at the timeout, while the server still runs it.
    let error = client.execute(&insert(100)).await.unwrap_err();
    assert!(error.reply_lost(), "{error:?}");
    assert_eq!(running(100), "1\n", "the control statement ended within its request timeout");
}

for_each_version!(a_statement_whose_server_cannot_be_asked_is_given_up_as_one_that_may_still_run);
async fn a_statement_whose_server_cannot_be_asked_is_given_up_as_one_that_may_still_run(
    server: &'static ClickHouseServer,
) {
    let table = fresh_table(server, "unended");
    let proxy = FaultProxy::start(server.http_addr);
    let client = CatalogClient::connect(&config_for(proxy.url(), Duration::from_secs(1))).await.unwrap();
    let sql = format!(
        "INSERT INTO {table} SELECT number, toString(sleepEachRow(0.5)) FROM numbers(20) SETTINGS max_block_size = 1"
    );
    let running = || {
        server
            .query(&format!(
                "SELECT count() FROM system.processes WHERE query LIKE '%INSERT INTO {table} SELECT%' AND query NOT \
                 LIKE '%system.processes%'"
            ))
            .unwrap()
    };
    let sent = tokio::spawn(async move { client.execute_to_its_end(&sql, Duration::from_secs(2)).await });
    // Once the server runs it, nothing more gets through: its reply is lost, and so is every question about it.
    let started = Instant::now();
    while running() != "1\n" {
        assert!(started.elapsed() < Duration::from_secs(10), "the statement never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.blackhole();
    let unended = tokio::time::timeout(Duration::from_secs(30), sent).await.expect("given up").unwrap().unwrap_err();
    assert!(unended.may_still_run, "{unended:?}");
    assert_eq!(running(), "1\n", "given up while the server runs it: it may still run, as it says");
}

for_each_version!(a_cut_connection_is_outcome_unknown_and_pass_recovers);
async fn a_cut_connection_is_outcome_unknown_and_pass_recovers(server: &'static ClickHouseServer) {
    let proxy = FaultProxy::start(server.http_addr);
    let client = CatalogClient::connect(&config_for(proxy.url(), Duration::from_secs(5))).await.unwrap();
    proxy.cut();
    let started = Instant::now();
    let error = client.execute("SELECT 1").await.unwrap_err();
    // The proxy accepted the connection and then closed it: from the client's side that is indistinguishable from a
    // server that received the statement and died, so it must not be called a definite failure.
    assert_kind(&error, ErrorKind::OutcomeUnknown, None);
    assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
    proxy.pass();
    client.execute("SELECT 1").await.unwrap();
}

for_each_version!(a_black_holed_server_is_outcome_unknown_after_the_request_timeout);
async fn a_black_holed_server_is_outcome_unknown_after_the_request_timeout(server: &'static ClickHouseServer) {
    let request_timeout = Duration::from_secs(1);
    let proxy = FaultProxy::start(server.http_addr);
    let client = CatalogClient::connect(&config_for(proxy.url(), request_timeout)).await.unwrap();
    proxy.blackhole();
    let started = Instant::now();
    let error = client.execute("SELECT 1").await.unwrap_err();
    let elapsed = started.elapsed();
    assert_kind(&error, ErrorKind::OutcomeUnknown, None);
    assert!(elapsed >= request_timeout && elapsed < request_timeout + Duration::from_secs(2), "{elapsed:?}");
    // A connect through the black hole is bounded the same way.
    let started = Instant::now();
    let error = CatalogClient::connect(&config_for(proxy.url(), request_timeout)).await.unwrap_err();
    assert_kind(&error, ErrorKind::OutcomeUnknown, None);
    assert!(started.elapsed() < request_timeout + Duration::from_secs(2));
}

for_each_version!(an_insert_whose_reply_is_lost_is_outcome_unknown_and_did_land);
async fn an_insert_whose_reply_is_lost_is_outcome_unknown_and_did_land(server: &'static ClickHouseServer) {
    let table = fresh_table(server, "lost_reply");
    let proxy = FaultProxy::start(server.http_addr);
    let client = CatalogClient::connect(&config_for(proxy.url(), Duration::from_secs(1))).await.unwrap();
    // Only the INSERT's reply: on current servers the client first asks for the table's schema (DESCRIBE), and a
    // lost reply to that would stop the INSERT from being sent at all.
    proxy.blackhole_replies_matching("INSERT");
    let row = NoteRow { id: 42, note: "landed".into() };
    let error = client.insert_rows(&table, &[row]).await.unwrap_err();
    assert_kind(&error, ErrorKind::OutcomeUnknown, None);
    // Read back over a direct connection: the statement ran although its client gave up.
    let landed = common::wait_until(Duration::from_secs(5), || {
        server.query(&format!("SELECT note FROM {table} WHERE id = 42")).as_deref() == Ok("landed\n")
    });
    assert!(landed, "the row never appeared\n{}", server.log_tail());
}

for_each_version!(a_deciding_statement_over_its_execution_time_fails_with_code_159);
async fn a_deciding_statement_over_its_execution_time_fails_with_code_159(server: &'static ClickHouseServer) {
    let client = connect_direct(server).await;
    let started = Instant::now();
    let error = client.execute_deciding("SELECT sleep(3)", Duration::from_secs(1)).await.unwrap_err();
    // TIMEOUT_EXCEEDED is raised by the server while executing: for an INSERT ... SELECT, blocks before the check may
    // have been written, so it is an unknown outcome. 18.16 checks between blocks: sleep(3) is one block, so the
    // statement runs its full 3 s before the check fires.
    assert_kind(&error, ErrorKind::OutcomeUnknown, Some(159));
    assert!(started.elapsed() < Duration::from_secs(8), "{:?}", started.elapsed());
    // Within the cap the same path succeeds.
    client.execute_deciding("SELECT 1", Duration::from_secs(1)).await.unwrap();
}

#[tokio::test]
async fn the_s3_server_stores_reads_and_refuses_a_second_create() {
    use object_store::{path::Path, ObjectStore, PutMode, PutOptions, PutPayload};
    let s3 = common::s3::shared_s3();
    let store = s3.store();
    let key = Path::from(format!("smoke/{}", uuid::Uuid::new_v4()));
    let payload = PutPayload::from_static(b"hello capstore");
    store.put(&key, payload.clone()).await.unwrap();
    let read = store.get(&key).await.unwrap().bytes().await.unwrap();
    assert_eq!(&read[..], b"hello capstore");
    let meta = store.head(&key).await.unwrap();
    assert_eq!(meta.size, 14);

    let create_key = Path::from(format!("smoke/create-{}", uuid::Uuid::new_v4()));
    let create = || PutOptions { mode: PutMode::Create, ..Default::default() };
    store.put_opts(&create_key, payload.clone(), create()).await.unwrap();
    let second = store.put_opts(&create_key, payload, create()).await;
    assert!(matches!(second, Err(object_store::Error::AlreadyExists { .. })), "{second:?}");
}

for_each_version!(a_delaying_proxy_slows_requests_without_failing_them);
async fn a_delaying_proxy_slows_requests_without_failing_them(server: &'static ClickHouseServer) {
    let proxy = FaultProxy::start(server.http_addr);
    let client = CatalogClient::connect(&config_for(proxy.url(), Duration::from_secs(5))).await.unwrap();
    proxy.delay(Duration::from_millis(300));
    let started = Instant::now();
    let answer: Vec<u8> = client.fetch_all("SELECT 7").await.unwrap();
    assert_eq!(answer, vec![7]);
    // At least one chunk each way is held back.
    assert!(started.elapsed() >= Duration::from_millis(600), "{:?}", started.elapsed());
}

// Failover between the servers of `catalog.url` and `catalog.replica_urls` (the client on its own; a cluster is not
// needed for the mechanism, and without `catalog.cluster` the client does not check shards): a server that cannot
// be connected to is passed over at once, the same request is answered by the next one; a request whose reply is
// lost is not sent again (its error is an unknown outcome), but the next one goes to the next server.
for_each_version!(requests_fail_over_at_once_when_a_server_is_unreachable_and_move_on_after_a_lost_reply);
async fn requests_fail_over_at_once_when_a_server_is_unreachable_and_move_on_after_a_lost_reply(
    server: &'static ClickHouseServer,
) {
    // Nothing listens on a port we just bound and released.
    let closed = format!("http://127.0.0.1:{}", common::free_port(false));
    let mut config = config_for(closed, Duration::from_secs(2));
    config.replica_urls = vec![server.url()];
    let client = CatalogClient::connect(&config).await.unwrap_or_else(|error| panic!("{error}"));
    let answer: Vec<u8> = client.fetch_all("SELECT 7").await.unwrap();
    assert_eq!(answer, vec![7]);

    let table = fresh_table(server, "failover");
    let proxy = FaultProxy::start(server.http_addr);
    let mut config = config_for(proxy.url(), Duration::from_secs(1));
    config.replica_urls = vec![server.url()];
    let client = CatalogClient::connect(&config).await.unwrap();
    proxy.blackhole_replies_matching("INSERT");
    let error = client.insert_rows(&table, &[NoteRow { id: 1, note: "through the proxy".into() }]).await.unwrap_err();
    assert_kind(&error, ErrorKind::OutcomeUnknown, None);
    assert!(error.reply_lost(), "{error}");
    // The proxy still swallows every INSERT's reply; the next insert goes straight to the server and is answered.
    client.insert_rows(&table, &[NoteRow { id: 2, note: "direct".into() }]).await.unwrap();
    let direct: Vec<u64> = client.fetch_all(&format!("SELECT id FROM {table} WHERE id = 2")).await.unwrap();
    assert_eq!(direct, vec![2]);
    // The first landed too, although its reply was lost.
    let landed = common::wait_until(Duration::from_secs(5), || {
        server.query(&format!("SELECT count() FROM {table}")).as_deref() == Ok("2\n")
    });
    assert!(landed, "{}", server.log_tail());
}
