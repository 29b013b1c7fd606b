//! Test harness: the real services live tests run against, started by the tests themselves on loopback ports.
//!
//! - [`clickhouse::shared_server`]: one private ClickHouse per test process.
//! - [`cluster::ClickHouseCluster`]: ZooKeeper and three replicated ClickHouse 18.16 servers, one per test.
//! - [`s3::shared_s3`]: one SeaweedFS S3 server per test process, stoppable to simulate an outage.
//! - [`azurite::shared_azurite`]: one Azurite (Azure Blob emulator) per test process.
//! - [`gcs::shared_gcs`]: one fake-gcs-server per test process (reads only: it refuses object_store's uploads).
//! - [`proxy::FaultProxy`]: a TCP proxy that passes, cuts, black-holes, delays or swallows replies.
//! - [`small_fs::SmallFilesystem`]: a small tmpfs of its own, for disk-full faults (a real ENOSPC).
//!
//! A missing service fails the test with the command that installs it; nothing is skipped.
//!
//! Child services must never outlive the test process, even when it is SIGKILLed or panics, and statics are never
//! dropped. So every service is spawned by one dedicated spawner thread that lives as long as the process, with
//! `PR_SET_PDEATHSIG = SIGKILL`: the kernel kills the child when that thread (hence the process) is gone. Scratch
//! directories are named after the test process's pid; directories of dead pids are removed at the next start.

#![allow(dead_code)]

pub mod azurite;
pub mod clickhouse;
pub mod cluster;
pub mod daemon;
pub mod gcs;
pub mod packs;
pub mod proxy;
pub mod s3;
pub mod small_fs;

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

struct SpawnRequest {
    command: Command,
    reply_tx: mpsc::Sender<io::Result<Child>>,
}

/// How long a test waits for the server to run a mutation (`ALTER ... DELETE`), which it does in the background when
/// its pool gets to it: CI has seen 18.16 take over 30 s under the load of a whole test run.
pub const MUTATION_PATIENCE: Duration = Duration::from_secs(180);

/// A service binary: `$<env_var>` if set (it must exist), else `name` on PATH, else `cached` (an install under
/// `~/.cache`); panics with `hint` (the install command) when none is there.
pub fn find_service_binary(env_var: &str, name: &str, cached: &str, hint: &str) -> PathBuf {
    if let Some(explicit) = std::env::var_os(env_var) {
        let path = PathBuf::from(explicit);
        assert!(path.is_file(), "{env_var}={} is not a file. {hint}", path.display());
        return path;
    }
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    let on_path = std::env::split_paths(&path_var).map(|dir| dir.join(name)).find(|candidate| candidate.is_file());
    let in_cache = std::env::var_os("HOME")
        .map(|home| PathBuf::from(home).join(".cache").join(cached))
        .filter(|candidate| candidate.is_file());
    on_path.or(in_cache).unwrap_or_else(|| panic!("{hint}"))
}

/// Start a service `binary ARGS` in its own scratch directory (`kind`), its output in `<dir>/<kind>.log`, tied to
/// this process; returns the child and the directory.
pub fn spawn_service(binary: &Path, args: &[String], kind: &str) -> (Child, PathBuf) {
    let dir = scratch_dir(kind);
    let log_file = std::fs::File::create(dir.join(format!("{kind}.log"))).unwrap();
    let mut command = Command::new(binary);
    command
        .args(args)
        .current_dir(&dir)
        .stdin(std::process::Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file);
    let child =
        spawn_tied_to_process(command).unwrap_or_else(|error| panic!("cannot run {}: {error}", binary.display()));
    (child, dir)
}

/// Spawn `command` so that the kernel SIGKILLs it when this test process dies, however it dies.
pub fn spawn_tied_to_process(command: Command) -> io::Result<Child> {
    static SPAWNER_TX: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let spawner_tx = SPAWNER_TX.get_or_init(|| {
        let (request_tx, request_rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("test-service-spawner".into())
            .spawn(move || {
                // The sender lives in a static, so this loop (and the thread the death signal is tied to) ends only
                // with the process.
                for mut request in request_rx {
                    let parent_pid = std::process::id() as i32;
                    #[allow(unsafe_code, reason = "pre_exec: only async-signal-safe calls between fork and exec")]
                    unsafe {
                        use std::os::unix::process::CommandExt;
                        request.command.pre_exec(move || {
                            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                                .map_err(io::Error::from)?;
                            // The parent may have died between fork and prctl: then nobody will signal us.
                            if nix::unistd::getppid().as_raw() != parent_pid {
                                return Err(io::Error::other("test process already gone"));
                            }
                            Ok(())
                        });
                    }
                    let _ = request.reply_tx.send(request.command.spawn());
                }
            })
            .expect("start the spawner thread");
        Mutex::new(request_tx)
    });
    let (reply_tx, reply_rx) = mpsc::channel();
    spawner_tx.lock().unwrap().send(SpawnRequest { command, reply_tx }).expect("spawner thread alive");
    reply_rx.recv().expect("spawner thread replies")
}

/// A fresh scratch directory `<tmp>/capstore-test-<kind>-<pid>-<n>`, after removing those of dead test processes.
pub fn scratch_dir(kind: &str) -> PathBuf {
    let temp_root = std::env::temp_dir();
    let prefix = format!("capstore-test-{kind}-");
    if let Ok(entries) = std::fs::read_dir(&temp_root) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(&prefix) else {
                continue;
            };
            let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    for attempt in 0.. {
        let dir = temp_root.join(format!("{prefix}{}-{attempt}", std::process::id()));
        if std::fs::create_dir(&dir).is_ok() {
            return dir;
        }
    }
    unreachable!()
}

/// A loopback port that is free now, below the kernel's ephemeral range (so outgoing connections do not take it
/// before the service binds it), such that `port + 10000` is free too when `with_grpc_twin` (SeaweedFS).
pub fn free_port(with_grpc_twin: bool) -> u16 {
    use rand::Rng;
    let mut rng = rand::rng();
    for _ in 0..1000 {
        let port: u16 = rng.random_range(10_000..22_000);
        let is_free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if is_free(port) && (!with_grpc_twin || is_free(port + 10_000)) {
            return port;
        }
    }
    panic!("no free loopback port found");
}

/// The LD_PRELOAD library of libfaketime (Debian's `faketime`), which sets a child's wall clock (`FAKETIME`) for real:
/// the tests that step the clock run `capstore` under it. Panics, saying how to install it, when it is missing.
pub fn libfaketime() -> String {
    let candidates = ["/usr/lib/x86_64-linux-gnu/faketime", "/usr/lib/aarch64-linux-gnu/faketime", "/usr/lib/faketime"];
    candidates
        .iter()
        .map(|dir| std::path::Path::new(dir).join("libfaketime.so.1"))
        .find(|path| path.is_file())
        .map(|path| path.display().to_string())
        .unwrap_or_else(|| {
            panic!("libfaketime is missing: install it with `apt-get install faketime` (or run .ci/run)")
        })
}

/// Several distinct free ports.
pub fn free_ports(count: usize, with_grpc_twin: bool) -> Vec<u16> {
    let mut ports: Vec<u16> = Vec::with_capacity(count);
    while ports.len() < count {
        let port = free_port(with_grpc_twin);
        let clashes =
            ports.iter().any(|p| *p == port || (with_grpc_twin && (*p + 10_000 == port || port + 10_000 == *p)));
        if !clashes {
            ports.push(port);
        }
    }
    ports
}

/// The last `max_lines` lines of a log file, for failure messages.
pub fn log_tail(path: &Path, max_lines: usize) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            let start = lines.len().saturating_sub(max_lines);
            format!("--- {} (last {} lines)\n{}", path.display(), max_lines, lines[start..].join("\n"))
        }
        Err(error) => format!("--- {}: {error}", path.display()),
    }
}

/// Poll `condition` every 50 ms until it holds or `timeout` passes.
pub fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Send SIGTERM, wait up to `grace`, then SIGKILL; reap the child.
pub fn terminate(child: &mut Child, grace: Duration) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let exited = wait_until(grace, || matches!(child.try_wait(), Ok(Some(_))));
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
    }
}
