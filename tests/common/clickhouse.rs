//! One private ClickHouse server per test process, on free loopback ports, data in a scratch directory.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const INSTALL_HINT: &str = "clickhouse-server is not on PATH: install it with \
     `apt-get install -y clickhouse-server clickhouse-client` (run `apt-get update` first if that fails)";

pub struct ClickHouseServer {
    pub http_addr: SocketAddr,
    pub tcp_port: u16,
    pub dir: PathBuf,
    /// Kept so the child is never reaped by accident; it dies with the process (see the harness doc).
    child: Mutex<Child>,
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

    /// The server's log tail, for assertion messages.
    pub fn log_tail(&self) -> String {
        format!(
            "{}\n{}",
            super::log_tail(&self.dir.join("stderr.log"), 20),
            super::log_tail(&self.dir.join("server.err.log"), 20)
        )
    }

    /// Run one statement over plain HTTP, independent of the code under test (a direct connection).
    pub fn query(&self, sql: &str) -> Result<String, String> {
        http_post(self.http_addr, sql)
    }
}

/// The server shared by every test of this process, started on first use.
pub fn shared_server() -> &'static ClickHouseServer {
    static SERVER: OnceLock<ClickHouseServer> = OnceLock::new();
    SERVER.get_or_init(start_server)
}

fn find_server_binary() -> PathBuf {
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

fn start_server() -> ClickHouseServer {
    let binary = find_server_binary();
    let mut failures = Vec::new();
    // A port can be taken between choosing and binding it: try a few times with fresh ports.
    for _attempt in 0..3 {
        match try_start(&binary) {
            Ok(server) => return server,
            Err(failure) => failures.push(failure),
        }
    }
    panic!("clickhouse-server did not start:\n{}", failures.join("\n\n"));
}

fn try_start(binary: &Path) -> Result<ClickHouseServer, String> {
    let dir = super::scratch_dir("clickhouse");
    let ports = super::free_ports(2, false);
    let (http_port, tcp_port) = (ports[0], ports[1]);
    let config_path = dir.join("config.xml");
    std::fs::write(&config_path, server_config(&dir, http_port, tcp_port)).unwrap();
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
    let deadline = std::time::Instant::now() + READY_TIMEOUT;
    loop {
        if let Ok(body) = http_get(http_addr, "/?query=SELECT%201") {
            if body.trim() == "1" {
                break;
            }
        }
        let tails = || {
            format!(
                "{}\n{}",
                super::log_tail(&dir.join("stderr.log"), 30),
                super::log_tail(&dir.join("server.err.log"), 30)
            )
        };
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("clickhouse-server exited with {status}\n{}", tails()));
        }
        if std::time::Instant::now() >= deadline {
            super::terminate(&mut child, Duration::from_secs(2));
            return Err(format!("clickhouse-server not answering on {http_addr} after {READY_TIMEOUT:?}\n{}", tails()));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(ClickHouseServer { http_addr, tcp_port, dir, child: Mutex::new(child), next_database: AtomicU64::new(0) })
}

fn server_config(dir: &Path, http_port: u16, tcp_port: u16) -> String {
    let dir = dir.display();
    // No interserver_http_port: a single server replicates nothing, and an unset port is not opened.
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
        &format!("POST /?wait_end_of_query=1 HTTP/1.0\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n{sql}", sql.len()),
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
