//! Private ClickHouse servers, one per tested version per test process, on free loopback ports, data in a scratch
//! directory.
//!
//! - [`Version::V18_16`]: Debian's `clickhouse-server` (18.16.1), a child process of its own.
//! - [`Version::V26_7`], [`Version::V26_9`]: chDB (PyPI `chdb-core`), which embeds clickhouse-local and since 26.7 can
//!   serve HTTP from inside its Python process (see TESTING.md). The server lives until that process's stdin closes;
//!   the harness keeps the pipe open for the life of the test process.
//!
//! [`for_each_version!`](crate::for_each_version) turns one async test body into one test per version.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

const READY_TIMEOUT: Duration = Duration::from_secs(60);
const INSTALL_HINT: &str = "clickhouse-server is not on PATH: install it with \
     `apt-get install -y clickhouse-server clickhouse-client` (run `apt-get update` first if that fails)";

/// A ClickHouse release the live tests run against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Version {
    /// Debian's clickhouse-server: no compression, no RowBinaryWithNamesAndTypes, whole-second clock.
    V18_16,
    /// chDB 26.7.3: a current server that answers compressed requests with LZ4.
    V26_7,
    /// chDB 26.9.0: answers with ZSTD unless the client negotiates.
    V26_9,
}

impl Version {
    pub const ALL: [Version; 3] = [Version::V18_16, Version::V26_7, Version::V26_9];

    /// What `SELECT version()` answers.
    pub fn expected_server_version(self) -> &'static str {
        match self {
            Version::V18_16 => "18.16.1",
            Version::V26_7 => "26.7.2.1",
            Version::V26_9 => "26.9.2.1",
        }
    }

    /// The `chdb-core` release on PyPI, for the chDB-served versions.
    fn chdb_release(self) -> Option<&'static str> {
        match self {
            Version::V18_16 => None,
            Version::V26_7 => Some("26.7.3"),
            Version::V26_9 => Some("26.9.0"),
        }
    }

    pub fn is_modern(self) -> bool {
        self != Version::V18_16
    }
}

pub struct ClickHouseServer {
    pub version: Version,
    pub http_addr: SocketAddr,
    pub dir: PathBuf,
    /// Kept so the child is never reaped by accident; it dies with the process (see the harness doc).
    child: Mutex<Child>,
    /// A chDB server answers until its stdin closes: held open for the life of the process.
    _stdin: Option<ChildStdin>,
    next_database: AtomicU64,
}

impl ClickHouseServer {
    pub fn url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    /// A database name no other test of this process uses: `<prefix>_<n>_<random>`. Not created.
    pub fn fresh_database(&self, prefix: &str) -> String {
        let n = self.next_database.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}_{n}_{:08x}", rand::random::<u32>())
    }

    /// The tables of a catalog as a capstore before schema 6 created them (in an existing database): not
    /// partitioned, `by_id` without `captured_at_ns` (its view not writing it), no `horizons`, stamped `stamp`.
    pub fn create_unpartitioned_tables(&self, tables: &capstore::catalog::Tables, stamp: u32) {
        use capstore::catalog::schema::PARTITION_BY;
        for statement in tables.ddl() {
            if statement.contains(&format!(" IF NOT EXISTS {} ", tables.horizons)) {
                continue;
            }
            let statement = statement
                .replace(&format!("PARTITION BY {PARTITION_BY} "), "")
                .replace(
                    &format!("publish_id FixedString(16), captured_at_ns UInt64 DEFAULT {}", u64::MAX),
                    "publish_id FixedString(16)",
                )
                .replace("AS publish_id, captured_at_ns FROM", "AS publish_id FROM");
            self.query(&statement).unwrap_or_else(|error| panic!("{statement}: {error}"));
        }
        self.query(&format!(
            "INSERT INTO {} (component, version, written_at_ms) VALUES ('catalog', {stamp}, 0)",
            tables.schema
        ))
        .unwrap();
    }

    /// The server's log tail, for assertion messages.
    pub fn log_tail(&self) -> String {
        format!(
            "{}\n{}",
            super::log_tail(&self.dir.join("stderr.log"), 20),
            super::log_tail(&self.dir.join("server.err.log"), 20)
        )
    }

    /// SIGKILL the server and reap it (a replica lost; see [`super::cluster`]).
    pub fn kill(&self) {
        let mut child = self.child.lock().unwrap();
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Run one statement over plain HTTP, independent of the code under test (a direct connection). Results come
    /// as TabSeparated on every version.
    pub fn query(&self, sql: &str) -> Result<String, String> {
        http_post(self.http_addr, sql)
    }
}

/// The server of `version` shared by every test of this process, started on first use.
pub fn server(version: Version) -> &'static ClickHouseServer {
    static SERVERS: [OnceLock<ClickHouseServer>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let slot = Version::ALL.iter().position(|v| *v == version).expect("every version has a slot");
    SERVERS[slot].get_or_init(|| start_server(version))
}

/// The 18.16 server, for tests that are not about server versions.
pub fn shared_server() -> &'static ClickHouseServer {
    server(Version::V18_16)
}

/// One `#[tokio::test]` per ClickHouse version for an async test function `name(server: &'static
/// ClickHouseServer)`: `for_each_version!(name)` makes `name::v18_16`, `name::v26_7` and `name::v26_9` (a module and a
/// function may share a name). `flavor = "multi_thread"` picks the runtime. `versions = [v18_16 => V18_16, ...]` runs
/// it on some versions only: for long tests whose subject is not the catalog, the oldest and the newest release.
#[macro_export]
macro_rules! for_each_version {
    ($name:ident) => {
        $crate::for_each_version!($name, flavor = "current_thread");
    };
    ($name:ident, flavor = $flavor:literal) => {
        $crate::for_each_version!(
            $name,
            flavor = $flavor,
            versions = [v18_16 => V18_16, v26_7 => V26_7, v26_9 => V26_9]
        );
    };
    ($name:ident, flavor = $flavor:literal, versions = [$($test:ident => $version:ident),+ $(,)?]) => {
        mod $name {
            use super::common::clickhouse::{server, Version};
            $(
                #[tokio::test(flavor = $flavor)]
                async fn $test() {
                    super::$name(server(Version::$version)).await
                }
            )+
        }
    };
}

pub fn find_server_binary() -> PathBuf {
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    // Debian puts it in /usr/sbin, which a non-root PATH may lack.
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path_var).collect();
    dirs.push(PathBuf::from("/usr/sbin"));
    dirs.push(PathBuf::from("/usr/bin"));
    dirs.into_iter()
        .map(|dir| dir.join("clickhouse-server"))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| panic!("{INSTALL_HINT}"))
}

fn start_server(version: Version) -> ClickHouseServer {
    let mut failures = Vec::new();
    // A port can be taken between choosing and binding it: try a few times with fresh ports.
    for _attempt in 0..3 {
        let started = match version.chdb_release() {
            None => try_start(&find_server_binary()),
            Some(release) => try_start_chdb(version, &find_chdb_python(release)),
        };
        match started {
            Ok(server) => {
                let answered = server.query("SELECT version()").map(|text| text.trim().to_string());
                assert_eq!(
                    answered.as_deref(),
                    Ok(version.expected_server_version()),
                    "the {version:?} test server reports another version: pin the install (see TESTING.md)"
                );
                return server;
            }
            Err(failure) => failures.push(failure),
        }
    }
    panic!("ClickHouse {version:?} did not start:\n{}", failures.join("\n\n"));
}

/// The Python of the venv that holds `chdb-core==<release>`: `$CAPSTORE_CHDB_<release>` (dots as underscores) or
/// `$HOME/.cache/capstore-chdb-<release>/bin/python`, where `.ci/run` installs it.
fn find_chdb_python(release: &str) -> PathBuf {
    let variable = format!("CAPSTORE_CHDB_{}", release.replace('.', "_"));
    let python = match std::env::var_os(&variable) {
        Some(path) => PathBuf::from(path),
        None => {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            PathBuf::from(home).join(format!(".cache/capstore-chdb-{release}/bin/python"))
        }
    };
    let has_chdb = python.is_file()
        && Command::new(&python)
            .args(["-c", "import chdb._chdb"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
    if !has_chdb {
        let venv = python.parent().and_then(Path::parent).unwrap_or(Path::new("VENV")).display().to_string();
        panic!(
            "ClickHouse {release} (chDB) is not installed at {}: run .ci/run, or `python3 -m venv {venv} && \
             {venv}/bin/pip install --no-deps chdb-core=={release}` (or set {variable} to such a venv's python)",
            python.display()
        );
    }
    python
}

/// A chDB server of its own (not shared with other tests) whose users are `users_xml`: the elements of a users file
/// (`<profiles>`, `<users>`, `<quotas>`), which replace the built-in `default` user (define it there too). For
/// tests of what a user's settings profile does to capstore: constraints need a current server.
pub fn start_chdb_with_users(version: Version, users_xml: &str) -> ClickHouseServer {
    let release = version.chdb_release().expect("a chDB-served version");
    try_start_chdb_with(version, &find_chdb_python(release), users_xml)
        .unwrap_or_else(|error| panic!("ClickHouse {version:?} (chDB) with users did not start: {error}"))
}

fn try_start_chdb(version: Version, python: &Path) -> Result<ClickHouseServer, String> {
    try_start_chdb_with(version, python, "")
}

/// chDB serving HTTP from inside its Python process: `SYSTEM START LISTEN HTTP`, the port written to a file, then a
/// read of stdin that returns only when the pipe closes (see TESTING.md).
/// With `users_xml`, its users are those (see [`start_chdb_with_users`]).
fn try_start_chdb_with(version: Version, python: &Path, users_xml: &str) -> Result<ClickHouseServer, String> {
    let dir = super::scratch_dir("chdb");
    let http_port = super::free_port(false);
    let config_path = dir.join("config.xml");
    let users = match users_xml {
        "" => String::new(),
        // The server reads the users from its own configuration file.
        users => format!(
            "{users}\n    <user_directories><users_xml><path>{}</path></users_xml></user_directories>",
            config_path.display()
        ),
    };
    std::fs::write(&config_path, chdb_config(&dir, http_port, &users)).unwrap();
    let port_file = dir.join("http_port");
    let script = format!(
        "import chdb._chdb as c\n\
         c.query(\"SYSTEM START LISTEN HTTP; SELECT getServerPort('http_port') INTO OUTFILE '{}' TRUNCATE FORMAT TSV; \
         SELECT count() FROM file('/dev/stdin', 'LineAsString')\", 'CSV')\n",
        port_file.display()
    );
    let stderr_file = std::fs::File::create(dir.join("stderr.log")).unwrap();
    let mut command = Command::new(python);
    command
        .args(["-c", &script])
        .current_dir(&dir)
        .stdin(Stdio::piped())
        .stdout(stderr_file.try_clone().unwrap())
        .stderr(stderr_file);
    let mut child =
        super::spawn_tied_to_process(command).map_err(|error| format!("cannot run {}: {error}", python.display()))?;
    let stdin = child.stdin.take();
    let http_addr: SocketAddr = ([127, 0, 0, 1], http_port).into();
    wait_ready(&mut child, http_addr, &dir, || {
        std::fs::read_to_string(&port_file).is_ok_and(|p| !p.trim().is_empty())
    })?;
    Ok(ClickHouseServer {
        version,
        http_addr,
        dir,
        child: Mutex::new(child),
        _stdin: stdin,
        next_database: AtomicU64::new(0),
    })
}

fn chdb_config(dir: &Path, http_port: u16, extra: &str) -> String {
    let dir = dir.display();
    format!(
        r#"<?xml version="1.0"?>
<clickhouse>
    <http_port>{http_port}</http_port>
    <listen_host>127.0.0.1</listen_host>
    <path>{dir}/data/</path>
    <tmp_path>{dir}/tmp/</tmp_path>
    <max_concurrent_queries>100</max_concurrent_queries>
    {extra}
</clickhouse>
"#
    )
}

/// Poll `SELECT 1` until it answers `1` (and `extra_ready` holds), the child exits, or [`READY_TIMEOUT`] passes.
fn wait_ready(
    child: &mut Child,
    http_addr: SocketAddr,
    dir: &Path,
    mut extra_ready: impl FnMut() -> bool,
) -> Result<(), String> {
    let deadline = std::time::Instant::now() + READY_TIMEOUT;
    let tails = || {
        format!(
            "{}\n{}",
            super::log_tail(&dir.join("stderr.log"), 30),
            super::log_tail(&dir.join("server.err.log"), 30)
        )
    };
    loop {
        if extra_ready() && http_get(http_addr, "/?query=SELECT%201").is_ok_and(|body| body.trim() == "1") {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("the server exited with {status}\n{}", tails()));
        }
        if std::time::Instant::now() >= deadline {
            super::terminate(child, Duration::from_secs(2));
            return Err(format!("the server is not answering on {http_addr} after {READY_TIMEOUT:?}\n{}", tails()));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn try_start(binary: &Path) -> Result<ClickHouseServer, String> {
    let ports = super::free_ports(2, false);
    start_18_16(binary, super::scratch_dir("clickhouse"), ports[0], ports[1], "")
}

/// Debian's server on the given ports, its data in `dir`, with `extra` (XML elements) added to its configuration.
pub fn start_18_16(
    binary: &Path,
    dir: PathBuf,
    http_port: u16,
    tcp_port: u16,
    extra: &str,
) -> Result<ClickHouseServer, String> {
    let config_path = dir.join("config.xml");
    std::fs::write(&config_path, server_config(&dir, http_port, tcp_port, extra)).unwrap();
    let stderr_file = std::fs::File::create(dir.join("stderr.log")).unwrap();
    let mut command = Command::new(binary);
    command
        .arg(format!("--config-file={}", config_path.display()))
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(stderr_file.try_clone().unwrap())
        .stderr(stderr_file);
    let mut child =
        super::spawn_tied_to_process(command).map_err(|error| format!("cannot run {}: {error}", binary.display()))?;
    let http_addr: SocketAddr = ([127, 0, 0, 1], http_port).into();
    wait_ready(&mut child, http_addr, &dir, || true)?;
    Ok(ClickHouseServer {
        version: Version::V18_16,
        http_addr,
        dir,
        child: Mutex::new(child),
        _stdin: None,
        next_database: AtomicU64::new(0),
    })
}

fn server_config(dir: &Path, http_port: u16, tcp_port: u16, extra: &str) -> String {
    let dir = dir.display();
    // No interserver_http_port unless `extra` sets one: a single server replicates nothing, and an unset port is not
    // opened.
    format!(
        r#"<?xml version="1.0"?>
<yandex>
    <logger>
        <level>information</level>
        <log>{dir}/server.log</log>
        <errorlog>{dir}/server.err.log</errorlog>
        <console>0</console>
    </logger>
    <http_port>{http_port}</http_port>
    <tcp_port>{tcp_port}</tcp_port>
    <listen_host>127.0.0.1</listen_host>
    <path>{dir}/data/</path>
    <tmp_path>{dir}/tmp/</tmp_path>
    <users_config>/etc/clickhouse-server/users.xml</users_config>
    <default_profile>default</default_profile>
    <default_database>default</default_database>
    <mark_cache_size>5368709120</mark_cache_size>
    <max_concurrent_queries>100</max_concurrent_queries>
{extra}
</yandex>
"#
    )
}

fn http_get(addr: SocketAddr, path_and_query: &str) -> Result<String, String> {
    http_request(addr, &format!("GET {path_and_query} HTTP/1.0\r\nHost: {addr}\r\n\r\n"))
}

fn http_post(addr: SocketAddr, sql: &str) -> Result<String, String> {
    http_request(
        addr,
        &format!("POST /?wait_end_of_query=1&default_format=TabSeparated HTTP/1.0\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n{sql}", sql.len()),
    )
}

/// A minimal HTTP/1.0 exchange: the body on 200, else the status line and body as the error.
fn http_request(addr: SocketAddr, request: &str) -> Result<String, String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).map_err(|error| error.to_string())?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).map_err(|error| error.to_string())?;
    stream.write_all(request.as_bytes()).map_err(|error| error.to_string())?;
    let mut response = String::new();
    stream.read_to_string(&mut response).map_err(|error| error.to_string())?;
    let (head, body) = response.split_once("\r\n\r\n").ok_or_else(|| format!("malformed reply: {response:?}"))?;
    let status_line = head.lines().next().unwrap_or_default();
    if status_line.split_whitespace().nth(1) == Some("200") {
        Ok(body.to_string())
    } else {
        Err(format!("{status_line}: {}", body.trim()))
    }
}
