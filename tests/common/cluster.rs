//! A replicated ClickHouse cluster on loopback: one ZooKeeper (Debian's `zookeeper` package) and three ClickHouse
//! 18.16 servers, one shard of three replicas named [`CLUSTER`], each with its own HTTP, native and interserver port
//! on 127.0.0.1, `macros` (`{shard}`, `{replica}`) and the distributed DDL queue that `ON CLUSTER` statements use.
//! Every process is a child tied to the test process (see [`super::spawn_tied_to_process`]).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::clickhouse::ClickHouseServer;

/// The cluster's name in every server's `remote_servers` (what `catalog.cluster` names).
pub const CLUSTER: &str = "capstore_test";
const REPLICAS: usize = 3;
const ZOOKEEPER_HINT: &str =
    "ZooKeeper is not installed: `apt-get install -y zookeeper` (Debian's package, with a JRE)";

pub struct ClickHouseCluster {
    pub replicas: Vec<ClickHouseServer>,
    /// How each replica was started (ports and configuration), to start it again on the same data.
    starts: Vec<ReplicaStart>,
    /// `None` while stopped ([`ClickHouseCluster::stop_zookeeper`]).
    zookeeper: Option<Child>,
    zookeeper_dir: PathBuf,
    zookeeper_port: u16,
}

struct ReplicaStart {
    http_port: u16,
    tcp_port: u16,
    extra: String,
}

impl ClickHouseCluster {
    /// Start ZooKeeper and the three replicas; panics with the install hint when ZooKeeper is missing.
    pub fn start() -> ClickHouseCluster {
        let zookeeper_dir = super::scratch_dir("zookeeper");
        let zookeeper_port = super::free_port(false);
        let zookeeper = start_zookeeper(&zookeeper_dir, zookeeper_port);
        let ports = super::free_ports(3 * REPLICAS, false);
        let tcp_port = |replica: usize| ports[3 * replica + 1];
        let shard_replicas: String = (0..REPLICAS)
            .map(|replica| format!("<replica><host>127.0.0.1</host><port>{}</port></replica>", tcp_port(replica)))
            .collect();
        let starts: Vec<ReplicaStart> = (0..REPLICAS)
            .map(|replica| {
                let extra = format!(
                    r#"    <interserver_http_port>{interserver}</interserver_http_port>
    <interserver_http_host>127.0.0.1</interserver_http_host>
    <zookeeper><node><host>127.0.0.1</host><port>{zookeeper_port}</port></node><session_timeout_ms>3000</session_timeout_ms></zookeeper>
    <remote_servers><{CLUSTER}><shard><internal_replication>true</internal_replication>{shard_replicas}</shard></{CLUSTER}></remote_servers>
    <macros><shard>01</shard><replica>r{replica}</replica></macros>
    <distributed_ddl><path>/clickhouse/task_queue/ddl</path></distributed_ddl>"#,
                    interserver = ports[3 * replica + 2],
                );
                ReplicaStart { http_port: ports[3 * replica], tcp_port: tcp_port(replica), extra }
            })
            .collect();
        let replicas = starts
            .iter()
            .enumerate()
            .map(|(replica, start)| start_replica(replica, start, super::scratch_dir("clickhouse-replica")))
            .collect();
        ClickHouseCluster { replicas, starts, zookeeper: Some(zookeeper), zookeeper_dir, zookeeper_port }
    }

    /// SIGKILL ZooKeeper: every replica loses its session, and its replicated tables turn read-only.
    pub fn stop_zookeeper(&mut self) {
        let mut zookeeper = self.zookeeper.take().expect("ZooKeeper is running");
        zookeeper.kill().unwrap();
        zookeeper.wait().unwrap();
        assert!(!serving(self.zookeeper_port), "ZooKeeper still serves after SIGKILL");
    }

    /// Start ZooKeeper again on its data and port, once it serves.
    pub fn start_zookeeper(&mut self) {
        assert!(self.zookeeper.is_none(), "ZooKeeper is running already");
        self.zookeeper = Some(start_zookeeper(&self.zookeeper_dir, self.zookeeper_port));
    }

    /// SIGKILL replica `index` and start it again on its data and ports, once it answers.
    pub fn restart(&mut self, index: usize) {
        self.replicas[index].kill();
        let dir = self.replicas[index].dir.clone();
        self.replicas[index] = start_replica(index, &self.starts[index], dir);
    }

    /// ZooKeeper's log tail, for assertion messages.
    pub fn zookeeper_log(&self) -> String {
        super::log_tail(&self.zookeeper_dir.join("stdout.log"), 20)
    }
}

fn start_replica(replica: usize, start: &ReplicaStart, dir: PathBuf) -> ClickHouseServer {
    let binary = super::clickhouse::find_server_binary();
    super::clickhouse::start_18_16(&binary, dir, start.http_port, start.tcp_port, &start.extra)
        .unwrap_or_else(|error| panic!("replica {replica} of the test cluster did not start: {error}"))
}

/// ZooKeeper in the foreground on `port`, data in `dir` (kept across a restart), serving before this returns. Run as
/// its Java main class: Debian's `zkServer.sh` overrides the configuration and log directories, and logs nothing
/// without an SLF4J binding on the class path (`slf4j-simple` comes with the package's dependencies).
fn start_zookeeper(dir: &Path, port: u16) -> Child {
    let jars = std::env::var("CAPSTORE_ZOOKEEPER_CLASSPATH")
        .unwrap_or_else(|_| "/usr/share/java/zookeeper.jar:/usr/share/java/slf4j-simple.jar".to_string());
    assert!(jars.split(':').all(|jar| Path::new(jar).is_file()), "{ZOOKEEPER_HINT} (class path {jars})");
    let config = dir.join("zoo.cfg");
    // A short tick: sessions of killed servers expire in seconds (each server asks for 3 s), so the others see a
    // replica gone when a quorum is counted. No fsync (scratch data). No admin server (it would take port 8080).
    std::fs::write(
        &config,
        format!(
            "tickTime=500\ninitLimit=10\nsyncLimit=5\ndataDir={data}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
             forceSync=no\nadmin.enableServer=false\n4lw.commands.whitelist=srvr\n",
            data = dir.join("data").display()
        ),
    )
    .unwrap();
    // Appended to, so a restart keeps the log of the first run.
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("stdout.log")).unwrap();
    let mut command = Command::new("java");
    command
        .args(["-cp", &jars, "org.apache.zookeeper.server.ZooKeeperServerMain", &config.display().to_string()])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    let mut child = super::spawn_tied_to_process(command).unwrap_or_else(|error| panic!("{ZOOKEEPER_HINT}: {error}"));
    let ready = super::wait_until(Duration::from_secs(60), || {
        assert!(
            child.try_wait().unwrap().is_none(),
            "ZooKeeper exited:\n{}",
            super::log_tail(&dir.join("stdout.log"), 30)
        );
        serving(port)
    });
    assert!(ready, "ZooKeeper is not serving on 127.0.0.1:{port}:\n{}", super::log_tail(&dir.join("stdout.log"), 30));
    child
}

/// ZooKeeper's `srvr` command answers with its mode once it serves requests.
fn serving(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1)) else {
        return false;
    };
    let mut answer = String::new();
    stream.set_read_timeout(Some(Duration::from_secs(2))).is_ok()
        && stream.write_all(b"srvr").is_ok()
        && stream.read_to_string(&mut answer).is_ok()
        && answer.contains("Mode: standalone")
}
