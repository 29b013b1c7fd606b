//! What an operator's tools see of a real daemon: the systemd notification protocol on a real datagram socket
//! (readiness, status lines, watchdog pings and what stops them, stopping and stop-timeout extensions), and a live
//! `/metrics` scrape checked by `promtool check metrics` and against every metric the shipped alerting rules and
//! dashboard query.

mod common;

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::clickhouse::ClickHouseServer;
use common::daemon::{Daemon, DaemonEnv};

const PROMTOOL_HINT: &str = "promtool is missing: `apt-get install -y prometheus` (Debian/Ubuntu ship it there)";

/// Every datagram the daemon sends to its `NOTIFY_SOCKET`, with the moment it arrived.
#[derive(Clone, Default)]
struct Notifications {
    received: Arc<Mutex<Vec<(Instant, String)>>>,
}

impl Notifications {
    /// Bind `path` and collect what arrives on a thread of its own.
    fn listen(path: &Path) -> Notifications {
        let socket = UnixDatagram::bind(path).expect("bind the notify socket");
        let notifications = Notifications::default();
        let received = notifications.received.clone();
        std::thread::spawn(move || {
            let mut buffer = vec![0u8; 4096];
            while let Ok(len) = socket.recv(&mut buffer) {
                let text = String::from_utf8_lossy(&buffer[..len]).into_owned();
                received.lock().unwrap().push((Instant::now(), text));
            }
        });
        notifications
    }

    fn all(&self) -> Vec<(Instant, String)> {
        self.received.lock().unwrap().clone()
    }

    /// Every line (a datagram may carry several assignments) with its arrival time.
    fn lines(&self) -> Vec<(Instant, String)> {
        self.all()
            .into_iter()
            .flat_map(|(at, text)| text.lines().map(move |line| (at, line.to_string())).collect::<Vec<_>>())
            .collect()
    }

    /// Poll until a line matches; returns its arrival time.
    async fn wait_for(
        &self,
        what: &str,
        within: Duration,
        daemon: &mut Daemon,
        matches: impl Fn(&str) -> bool,
    ) -> Instant {
        let started = Instant::now();
        loop {
            if let Some((at, _)) = self.lines().into_iter().find(|(_, line)| matches(line)) {
                return at;
            }
            assert!(daemon.exited().is_none(), "daemon exited before {what}:\n{}", daemon.log());
            assert!(
                started.elapsed() < within,
                "no {what} within {within:?}; got {:?}\n{}",
                self.lines(),
                daemon.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn pings_between(&self, from: Instant, to: Instant) -> Vec<Instant> {
        self.lines()
            .into_iter()
            .filter(|(at, line)| line == "WATCHDOG=1" && *at >= from && *at <= to)
            .map(|(at, _)| at)
            .collect()
    }
}

fn median_interval(pings: &[Instant]) -> Duration {
    let mut gaps: Vec<Duration> = pings.windows(2).map(|pair| pair[1] - pair[0]).collect();
    gaps.sort();
    gaps[gaps.len() / 2]
}

/// A live daemon under a notify socket, with the watchdog at `WATCHDOG_USEC` = 1 s and `WATCHDOG_PID` set to the
/// pid that execs the daemon, as systemd does.
fn start_under_systemd(dir: &Path, env: DaemonEnv) -> (Daemon, Notifications, String) {
    let socket = dir.join("notify.sock");
    let notifications = Notifications::listen(&socket);
    let port = common::free_port(false);
    let env = env
        .set("NOTIFY_SOCKET", socket.display().to_string())
        .set("WATCHDOG_USEC", "1000000")
        .set("CAPSTORE_HTTP_LISTEN", format!("127.0.0.1:{port}"));
    let log_path = dir.join("daemon.log");
    let mut command = env.shell("WATCHDOG_PID=$$ exec \"$0\" run");
    command.stdout(Stdio::null()).stderr(std::fs::File::create(&log_path).unwrap());
    (Daemon::spawn(command, log_path), notifications, format!("http://127.0.0.1:{port}"))
}

/// READY=1 on the socket, then the HTTP listener (it follows READY=1 within moments); returns when READY=1 came.
async fn wait_for_ready(daemon: &mut Daemon, notifications: &Notifications, base: &str) -> Instant {
    let ready_at = notifications.wait_for("READY=1", Duration::from_secs(20), daemon, |l| l == "READY=1").await;
    let client = reqwest::Client::new();
    let started = Instant::now();
    while client.get(format!("{base}/healthz")).send().await.is_err() {
        assert!(started.elapsed() < Duration::from_secs(10), "HTTP never came up after READY=1:\n{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ready_at
}

async fn post_capture(client: &reqwest::Client, base: &str, stream: &str) -> reqwest::StatusCode {
    let url = format!("{base}/v1/captures?stream={stream}");
    client.post(url).body(vec![7u8; 1000]).send().await.unwrap().status()
}

#[tokio::test]
async fn under_systemd_the_daemon_is_ready_reports_status_pings_the_watchdog_and_extends_its_stop_while_draining() {
    let dir = tempfile::tempdir().unwrap();
    // A long pack age keeps the captures in the open pack until the stop, so the drain has work to extend for.
    let env = DaemonEnv::live("systemd", dir.path())
        .set("CAPSTORE_SPOOL_PACK_MAX_AGE", "1h")
        .set("CAPSTORE_SHUTDOWN_GRACE", "20s");
    let (mut daemon, notifications, base) = start_under_systemd(dir.path(), env);
    // READY=1 means ingest is up: the spool accepts captures.
    let ready_at = wait_for_ready(&mut daemon, &notifications, &base).await;
    let client = reqwest::Client::new();
    for _ in 0..3 {
        assert_eq!(post_capture(&client, &base, "cam/1").await, reqwest::StatusCode::CREATED, "{}", daemon.log());
    }
    let publishing = |line: &str| line.starts_with("STATUS=publishing") && line.contains("lease held (term");
    notifications.wait_for("a publishing STATUS line", Duration::from_secs(20), &mut daemon, publishing).await;

    // The watchdog: pings at half of WATCHDOG_USEC, from READY on.
    let window_end = ready_at.max(Instant::now()) + Duration::from_secs(3);
    while Instant::now() < window_end {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pings = notifications.pings_between(window_end - Duration::from_secs(3), window_end);
    assert!(pings.len() >= 4, "{} pings in 3 s at WATCHDOG_USEC=1s: {:?}", pings.len(), notifications.lines());
    let period = median_interval(&pings);
    assert!(
        period >= Duration::from_millis(350) && period <= Duration::from_millis(800),
        "median ping interval {period:?}, expected about 500 ms"
    );

    // SIGTERM: STOPPING=1, then more stop time for every drain step that moved packs, then exit 0.
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "{log}");
    let lines = notifications.lines();
    let stopping =
        lines.iter().position(|(_, line)| line == "STOPPING=1").unwrap_or_else(|| panic!("no STOPPING=1: {lines:?}"));
    let extensions: Vec<u64> = lines[stopping..]
        .iter()
        .filter_map(|(_, line)| line.strip_prefix("EXTEND_TIMEOUT_USEC="))
        .map(|usec| usec.parse().unwrap())
        .collect();
    assert!(
        !extensions.is_empty(),
        "no EXTEND_TIMEOUT_USEC after STOPPING=1 though the drain published: {lines:?}\n{log}"
    );
    assert!(
        extensions.iter().all(|usec| *usec > 0 && *usec <= 15_000_000),
        "extensions beyond window + margin: {extensions:?}"
    );
    assert!(log.contains("spool drained"), "{log}");
}

#[tokio::test]
async fn the_watchdog_stops_pinging_once_the_pipeline_hangs_in_an_upload() {
    let dir = tempfile::tempdir().unwrap();
    let env = DaemonEnv::live("watchdog", dir.path()).set("CAPSTORE_FAILPOINTS", "stall_upload");
    let (mut daemon, notifications, base) = start_under_systemd(dir.path(), env);
    wait_for_ready(&mut daemon, &notifications, &base).await;
    let client = reqwest::Client::new();
    let publishing = |line: &str| line.starts_with("STATUS=publishing");
    let publishing_at = notifications.wait_for("publishing", Duration::from_secs(20), &mut daemon, publishing).await;
    // Appends still work (ingest is not the pipeline); the first upload hangs.
    assert_eq!(post_capture(&client, &base, "cam/1").await, reqwest::StatusCode::CREATED);
    let stalled = |line: &str| line.starts_with("STATUS=") && line.contains("watchdog: pipeline stalled for");
    let stalled_at =
        notifications.wait_for("a stalled STATUS line", Duration::from_secs(15), &mut daemon, stalled).await;
    assert!(!notifications.pings_between(publishing_at, stalled_at).is_empty(), "pings while healthy");
    let quiet_until = stalled_at + Duration::from_secs(3);
    while Instant::now() < quiet_until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let late_pings = notifications.pings_between(stalled_at, quiet_until);
    assert!(late_pings.is_empty(), "{} pings after the upload hung: {:?}", late_pings.len(), notifications.lines());
    daemon.kill();
}

#[tokio::test]
async fn the_watchdog_stops_pinging_once_the_spool_writer_wedges_and_not_before() {
    let dir = tempfile::tempdir().unwrap();
    // The second append's fsync never returns: a wedged disk.
    let env = DaemonEnv::live("watchdog", dir.path()).set("CAPSTORE_FAILPOINTS", "stall_before_fsync@2");
    let (mut daemon, notifications, base) = start_under_systemd(dir.path(), env);
    wait_for_ready(&mut daemon, &notifications, &base).await;
    let client = reqwest::Client::new();
    assert_eq!(post_capture(&client, &base, "cam/1").await, reqwest::StatusCode::CREATED);
    // Healthy and idle for 2 s after the first append: pings go on.
    let healthy_from = Instant::now();
    while healthy_from.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let healthy_pings = notifications.pings_between(healthy_from, Instant::now());
    assert!(healthy_pings.len() >= 2, "an idle writer is healthy: {:?}", notifications.lines());

    let wedged = {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move { post_capture(&client, &base, "cam/1").await })
    };
    let stalled = |line: &str| line.starts_with("STATUS=") && line.contains("watchdog: spool writer stalled for");
    let stalled_at =
        notifications.wait_for("a stalled STATUS line", Duration::from_secs(15), &mut daemon, stalled).await;
    // Producers that give up on their appends (client timeouts) must not make the wedged writer look alive.
    let impatient = reqwest::Client::builder().timeout(Duration::from_millis(300)).build().unwrap();
    let quiet_until = stalled_at + Duration::from_secs(3);
    while Instant::now() < quiet_until {
        let _ = impatient.post(format!("{base}/v1/captures?stream=cam/2")).body(vec![1u8; 10]).send().await;
    }
    let late_pings = notifications.pings_between(stalled_at, quiet_until);
    assert!(late_pings.is_empty(), "{} pings after the writer wedged: {:?}", late_pings.len(), notifications.lines());
    assert!(!wedged.is_finished(), "the append behind the wedged fsync was answered");
    assert!(daemon.log().contains("watchdog pings stop"), "{}", daemon.log());
    daemon.kill();
}

/// `promtool` with `args`, `input` on stdin; returns success and everything it printed.
fn promtool(args: &[&str], input: &str) -> (bool, String) {
    let mut child = Command::new("promtool")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("{PROMTOOL_HINT} ({error})"));
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), input.as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output.status.success(), text)
}

/// The series names a classic-format scrape exposes (`# TYPE name kind` lines, with a histogram's sample suffixes).
fn exposed_series(scrape: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in scrape.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else { continue };
        let mut words = rest.split_whitespace();
        let (Some(name), Some(kind)) = (words.next(), words.next()) else { continue };
        let suffixes: &[&str] = match kind {
            "histogram" => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        names.extend(suffixes.iter().map(|suffix| format!("{name}{suffix}")));
    }
    names
}

/// Every `capstore_...` series name in a PromQL text.
fn queried_series(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("capstore_") {
        let tail = &rest[start..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        names.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

#[tokio::test]
async fn a_live_scrape_passes_promtool_and_has_every_metric_the_rules_and_dashboard_query() {
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port(false);
    let env = DaemonEnv::live("metrics", dir.path()).set("CAPSTORE_HTTP_LISTEN", format!("127.0.0.1:{port}"));
    let mut daemon = env.start(dir.path().join("daemon.log"));
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    // Publish one capture so every histogram has a sample and the pipeline's families exist.
    let started = Instant::now();
    loop {
        if let Ok(response) =
            client.post(format!("{base}/v1/captures?stream=cam/1&wait=published")).body(vec![1u8; 100]).send().await
        {
            if response.status() == reqwest::StatusCode::CREATED {
                break;
            }
        }
        assert!(daemon.exited().is_none(), "{}", daemon.log());
        assert!(started.elapsed() < Duration::from_secs(30), "no published capture:\n{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let scrape = client.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    let (ok, lint) = promtool(&["check", "metrics"], &scrape);
    assert!(ok, "promtool check metrics:\n{lint}\n{scrape}");
    // Prometheus itself asks for OpenMetrics and gets it, with the same samples.
    let open_metrics = client
        .get(format!("{base}/metrics"))
        .header("accept", "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(open_metrics.ends_with("# EOF\n"), "{open_metrics}");
    assert!(open_metrics.contains("# TYPE capstore_captures_appended counter\n"), "{open_metrics}");
    assert!(scrape.contains("# TYPE capstore_captures_appended_total counter\n"), "{scrape}");
    for histogram in
        ["append_to_ack", "publish_duration", "ack_to_published", "upload_duration", "lease_renew_duration"]
    {
        let count = format!("capstore_{histogram}_seconds_count ");
        let line =
            scrape.lines().find(|line| line.starts_with(&count)).unwrap_or_else(|| panic!("no {count}:\n{scrape}"));
        let samples: f64 = line[count.len()..].trim().parse().unwrap();
        assert!(samples >= 1.0, "{line}");
    }

    let exposed = exposed_series(&scrape);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    for file in ["prometheus/capstore.rules.yml", "grafana/capstore.json"] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let queried = queried_series(&text);
        assert!(queried.len() >= 8, "{file} queries only {queried:?}");
        let missing: Vec<&String> = queried.iter().filter(|name| !exposed.contains(name)).collect();
        assert!(
            missing.is_empty(),
            "{file} queries series a live daemon does not expose: {missing:?}\nexposed: {exposed:?}"
        );
    }
    daemon.kill();
}

fn check_config_online(env: &DaemonEnv) -> (i32, String) {
    let output = env.command().args(["check-config", "--online"]).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output.status.code().unwrap_or(-1), text)
}

fn line_of<'a>(report: &'a str, check: &str) -> &'a str {
    report
        .lines()
        .find(|line| line[4..].trim_start().starts_with(&format!("{check}:")))
        .unwrap_or_else(|| panic!("no {check} line:\n{report}"))
}

async fn check_config_online_passes_a_working_setup_and_leaves_nothing_behind(server: &'static ClickHouseServer) {
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port(false);
    let env =
        DaemonEnv::live_on(server, "checkconfig", dir.path()).set("CAPSTORE_HTTP_LISTEN", format!("127.0.0.1:{port}"));
    let database = env.get("CAPSTORE_CATALOG_DATABASE").unwrap().to_string();

    // Before the first start the database does not exist: reported, not created.
    let (code, report) = check_config_online(&env);
    assert_eq!(code, 0, "{report}");
    assert!(line_of(&report, "catalog grants").contains("does not exist yet"), "{report}");
    let databases = server.query(&format!("SELECT count() FROM system.databases WHERE name = '{database}'")).unwrap();
    assert_eq!(databases.trim(), "0", "check-config created the database");

    server.query(&format!("CREATE DATABASE {database}")).unwrap();
    let (code, report) = check_config_online(&env);
    assert_eq!(code, 0, "{report}");
    for check in [
        "catalog reachable",
        "catalog version",
        "catalog read settings",
        "catalog grants",
        "catalog schema",
        "bucket",
        "spool directory",
        "spool free space",
        "http listen",
    ] {
        assert!(line_of(&report, check).starts_with("ok  "), "{check}:\n{report}");
    }
    assert!(line_of(&report, "catalog version").contains(server.version.expected_server_version()), "{report}");
    assert!(
        line_of(&report, "catalog grants").contains("create view, insert, select and alter delete work"),
        "{report}"
    );
    assert!(line_of(&report, "catalog schema").contains("no tables yet"), "{report}");
    assert!(line_of(&report, "catalog read settings").contains("max_threads = 1 for reads of a few"), "{report}");
    assert!(line_of(&report, "bucket").contains("refused a second create"), "{report}");
    // The probes leave nothing behind: no scratch table or view, no probe object.
    let leftovers = server.query(&format!("SELECT count() FROM system.tables WHERE database = '{database}'")).unwrap();
    assert_eq!(leftovers.trim(), "0");
    let bucket_files: Vec<_> = walk(&dir.path().join("bucket"));
    assert!(bucket_files.is_empty(), "probe objects left: {bucket_files:?}");
}

for_each_version!(check_config_online_passes_a_working_setup_and_leaves_nothing_behind);

/// Users of a chDB server: one whose settings profile pins `max_threads` with a constraint, one with a read-only
/// profile (which lets a request change no setting), `default`, and four whose profiles bound the limits every read
/// sets: below the configured ones (`limits_capped`, for a `catalog.request_timeout` of 10 s and the default
/// `catalog.read_max_memory` of 1 GiB), not at all (`memory_fixed`, and `memory_unbounded`, whose fixed value is no
/// limit), and above them (`time_floor`, which refuses a publish's `max_execution_time` too).
const PROFILED_USERS: &str = r#"<profiles>
        <default/>
        <threads_pinned>
            <max_threads>2</max_threads>
            <constraints><max_threads><readonly/></max_threads></constraints>
        </threads_pinned>
        <read_only><readonly>1</readonly></read_only>
        <limits_capped>
            <constraints>
                <max_memory_usage><max>500000000</max></max_memory_usage>
                <max_execution_time><max>5</max></max_execution_time>
            </constraints>
        </limits_capped>
        <memory_fixed>
            <max_memory_usage>400000000</max_memory_usage>
            <constraints><max_memory_usage><readonly/></max_memory_usage></constraints>
        </memory_fixed>
        <memory_unbounded>
            <max_memory_usage>0</max_memory_usage>
            <constraints><max_memory_usage><readonly/></max_memory_usage></constraints>
        </memory_unbounded>
        <time_floor>
            <constraints><max_execution_time><min>60</min></max_execution_time></constraints>
        </time_floor>
    </profiles>
    <users>
        <default><password/><networks><ip>127.0.0.1</ip></networks><profile>default</profile><quota>default</quota></default>
        <threads_pinned><password/><networks><ip>127.0.0.1</ip></networks><profile>threads_pinned</profile><quota>default</quota></threads_pinned>
        <read_only><password/><networks><ip>127.0.0.1</ip></networks><profile>read_only</profile><quota>default</quota></read_only>
        <limits_capped><password/><networks><ip>127.0.0.1</ip></networks><profile>limits_capped</profile><quota>default</quota></limits_capped>
        <memory_fixed><password/><networks><ip>127.0.0.1</ip></networks><profile>memory_fixed</profile><quota>default</quota></memory_fixed>
        <memory_unbounded><password/><networks><ip>127.0.0.1</ip></networks><profile>memory_unbounded</profile><quota>default</quota></memory_unbounded>
        <time_floor><password/><networks><ip>127.0.0.1</ip></networks><profile>time_floor</profile><quota>default</quota></time_floor>
    </users>
    <quotas><default/></quotas>"#;

/// A catalog user whose settings profile does not let a request set `max_threads` (a constraint: 20.x and later)
/// gets a daemon that publishes and reads all the same (its reads of a few granules run with the profile's threads),
/// and `check-config --online` says so; one whose profile lets a read set nothing is told which settings to allow;
/// ones whose profiles bound the time and memory limits every read sets read within those bounds.
#[tokio::test]
async fn settings_profiles_that_constrain_what_reads_set_slow_or_bound_them_and_break_nothing() {
    let server = common::clickhouse::start_chdb_with_users(common::clickhouse::Version::V26_9, PROFILED_USERS);
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port(false);
    let env =
        DaemonEnv::live_on(&server, "pinned", dir.path()).set("CAPSTORE_HTTP_LISTEN", format!("127.0.0.1:{port}"));
    let pinned = env.clone().set("CAPSTORE_CATALOG_USER", "threads_pinned");

    let (code, report) = check_config_online(&env);
    assert_eq!(code, 0, "{report}");
    assert!(line_of(&report, "catalog read settings").contains("max_threads = 1 for reads of a few"), "{report}");
    let (code, report) = check_config_online(&pinned);
    assert_eq!(code, 0, "{report}");
    let line = line_of(&report, "catalog read settings");
    assert!(line.starts_with("ok  ") && line.contains("does not let them set max_threads"), "{report}");
    let (code, report) = check_config_online(&env.clone().set("CAPSTORE_CATALOG_USER", "read_only"));
    assert_eq!(code, 2, "{report}");
    let line = line_of(&report, "catalog read settings");
    assert!(line.starts_with("FAIL") && line.contains("settings profile must let a request change them"), "{report}");

    // The daemon, as the pinned user, publishes a capture; the CLI reads it back by id and lists it.
    let mut daemon = pinned.start(dir.path().join("daemon.log"));
    let client = reqwest::Client::new();
    let payload = b"pinned threads".to_vec();
    let started = Instant::now();
    let capture_id = loop {
        let posted = client
            .post(format!("http://127.0.0.1:{port}/v1/captures?stream=cam/1&wait=published"))
            .body(payload.clone())
            .send()
            .await;
        if let Ok(response) = posted {
            if response.status() == reqwest::StatusCode::CREATED {
                let answer: serde_json::Value = response.json().await.unwrap();
                break answer["capture_id"].as_str().unwrap().to_string();
            }
        }
        assert!(daemon.exited().is_none(), "{}", daemon.log());
        assert!(started.elapsed() < Duration::from_secs(30), "no published capture:\n{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let read = pinned.command().args(["get", &capture_id]).output().unwrap();
    assert!(read.status.success(), "{}", String::from_utf8_lossy(&read.stderr));
    assert_eq!(read.stdout, payload);
    let listed = pinned.command().args(["ls", "--stream", "cam/1"]).output().unwrap();
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    assert!(
        String::from_utf8_lossy(&listed.stdout).contains(&capture_id),
        "{}",
        String::from_utf8_lossy(&listed.stdout)
    );
    assert!(daemon.log().contains("does not let reads set max_threads"), "{}", daemon.log());
    daemon.kill();

    // Users whose profiles bound the limits every read sets read the capture back all the same, within the
    // profile's bounds, and `check-config` says what bounds their reads; it fails a profile that leaves reads
    // without a memory limit, and one that refuses what a lease claim or a publish sends (whose timing the fence
    // rests on: never bounded otherwise than configured).
    for (user, read_ok, read_bound, publish_ok) in [
        ("limits_capped", true, "lets a read set max_memory_usage to at most 500000000: reads are bounded there", true),
        (
            "limits_capped",
            true,
            "max_execution_time to at most 5: reads are bounded there, below catalog.request_timeout",
            true,
        ),
        (
            "memory_fixed",
            true,
            "does not let a read set max_memory_usage: reads are bounded by the profile's value",
            true,
        ),
        ("memory_unbounded", false, "does not let a read set max_memory_usage and sets it to 0 (no limit)", true),
        ("time_floor", true, "lets a read set max_execution_time to no less than 60: reads are bounded there", false),
    ] {
        let bounded = env.clone().set("CAPSTORE_CATALOG_USER", user).set("CAPSTORE_CATALOG_REQUEST_TIMEOUT", "10s");
        let (code, report) = check_config_online(&bounded);
        let (line, publish) = (line_of(&report, "catalog read settings"), line_of(&report, "catalog publish settings"));
        assert!(
            line.starts_with(if read_ok { "ok  " } else { "FAIL" }) && line.contains(read_bound),
            "{user}: {report}"
        );
        assert_eq!(publish.starts_with("ok  "), publish_ok, "{user}: {report}");
        assert!(publish_ok || publish.contains("lease.publish_timeout"), "{user}: {report}");
        assert_eq!(code == 0, read_ok && publish_ok, "{user}: {report}");
        let read = bounded.command().args(["get", &capture_id]).output().unwrap();
        assert!(read.status.success(), "{user}: {}", String::from_utf8_lossy(&read.stderr));
        assert_eq!(read.stdout, payload, "{user}");
        let listed = bounded.command().args(["ls", "--stream", "cam/1"]).output().unwrap();
        assert!(listed.status.success(), "{user}: {}", String::from_utf8_lossy(&listed.stderr));
        assert!(String::from_utf8_lossy(&listed.stdout).contains(&capture_id), "{user}");
    }
}

#[test]
fn check_config_online_names_every_broken_part_and_exits_2() {
    // Nothing answers on the catalog port, the bucket and the spool are under a file, and the HTTP address is taken.
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    std::fs::write(dir.path().join("not-a-dir"), b"x").unwrap();
    let broken = DaemonEnv::offline(&dir.path().join("spool"))
        .set("CAPSTORE_CATALOG_URL", "http://127.0.0.1:1")
        .set("CAPSTORE_BUCKET_URL", format!("file://{}", dir.path().join("not-a-dir/bucket").display()))
        .set("CAPSTORE_SPOOL_DIR", dir.path().join("not-a-dir/spool").display().to_string())
        .set("CAPSTORE_HTTP_LISTEN", taken.local_addr().unwrap().to_string());
    let (code, report) = check_config_online(&broken);
    assert_eq!(code, 2, "{report}");
    for check in ["catalog reachable", "bucket", "spool directory", "http listen"] {
        assert!(line_of(&report, check).starts_with("FAIL"), "{check}:\n{report}");
    }
    assert!(line_of(&report, "catalog reachable").contains("127.0.0.1:1"), "{report}");
    assert!(line_of(&report, "spool directory").contains("is not a directory"), "{report}");
    assert!(line_of(&report, "http listen").contains("in use"), "{report}");
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries
        .flatten()
        .flat_map(|entry| if entry.path().is_dir() { walk(&entry.path()) } else { vec![entry.path()] })
        .collect()
}
