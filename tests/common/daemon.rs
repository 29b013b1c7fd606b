//! The one way tests run the `capstore` binary: an environment block ([`DaemonEnv`]) and a child process that is
//! killed when its handle drops or the test process dies ([`Daemon`]).
//!
//! Every child starts from an empty environment plus `PATH` and the block, so nothing of the developer's shell
//! (a `CAPSTORE_*` variable, a config file) leaks into a test.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use capstore::config::Config;

/// The `CAPSTORE_*` variables of one daemon (or tool) run.
#[derive(Debug, Clone)]
pub struct DaemonEnv {
    vars: BTreeMap<String, String>,
    /// Run as `nobody` when the tests run as root, so file permissions bind the daemon as they bind a real service
    /// account (root's permission override would hide them).
    unprivileged: bool,
}

impl DaemonEnv {
    /// A spool at `spool_dir` with no catalog (port 1 refuses at once: ingest must work regardless, publishing just
    /// waits), a file:// bucket beside it, fast seals and rescans, and any free HTTP port (daemons of parallel tests
    /// must not fight over the default one).
    pub fn offline(spool_dir: &Path) -> DaemonEnv {
        DaemonEnv::from_pairs([
            ("CAPSTORE_SPOOL_DIR", spool_dir.display().to_string()),
            ("CAPSTORE_HTTP_LISTEN", "127.0.0.1:0".into()),
            ("CAPSTORE_CATALOG_URL", "http://127.0.0.1:1".into()),
            ("CAPSTORE_BUCKET_URL", format!("file://{}", spool_dir.with_extension("bucket").display())),
            ("CAPSTORE_SPOOL_PACK_MAX_AGE", "100ms".into()),
            ("CAPSTORE_SPOOL_MIN_FREE_BYTES", "1MiB".into()),
            ("CAPSTORE_SPOOL_INBOX_RESCAN_INTERVAL", "200ms".into()),
            ("CAPSTORE_LOG_LEVEL", "info".into()),
        ])
    }

    /// A daemon on the shared ClickHouse (a fresh database and catalog name, both starting with `kind`), its spool and
    /// file:// bucket under `dir`, with short lease timings (TTL 3 s, publish timeout 1 s) so that a whole fault
    /// scenario fits in seconds.
    pub fn live(kind: &str, dir: &Path) -> DaemonEnv {
        DaemonEnv::live_on(super::clickhouse::shared_server(), kind, dir)
    }

    /// [`DaemonEnv::live`] on the ClickHouse `server`.
    pub fn live_on(server: &super::clickhouse::ClickHouseServer, kind: &str, dir: &Path) -> DaemonEnv {
        DaemonEnv::from_pairs([
            ("CAPSTORE_CATALOG_NAME", format!("{kind}-{}", rand::random::<u32>())),
            ("CAPSTORE_CATALOG_URL", server.url()),
            ("CAPSTORE_CATALOG_DATABASE", server.fresh_database(kind)),
            ("CAPSTORE_CATALOG_TABLE_PREFIX", "cs".into()),
            ("CAPSTORE_CATALOG_REQUEST_TIMEOUT", "2s".into()),
            ("CAPSTORE_LEASE_TTL", "3s".into()),
            ("CAPSTORE_LEASE_PUBLISH_TIMEOUT", "1s".into()),
            ("CAPSTORE_SPOOL_DIR", dir.join("spool").display().to_string()),
            ("CAPSTORE_SPOOL_PACK_MAX_AGE", "200ms".into()),
            ("CAPSTORE_SPOOL_MIN_FREE_BYTES", "1MiB".into()),
            ("CAPSTORE_BUCKET_URL", format!("file://{}", dir.join("bucket").display())),
            ("CAPSTORE_HTTP_LISTEN", "127.0.0.1:0".into()),
            ("CAPSTORE_LOG_LEVEL", "info".into()),
        ])
    }

    fn from_pairs<const N: usize>(pairs: [(&str, String); N]) -> DaemonEnv {
        DaemonEnv {
            vars: pairs.into_iter().map(|(key, value)| (key.to_string(), value)).collect(),
            unprivileged: false,
        }
    }

    /// Set (or replace) one variable.
    pub fn set(mut self, key: &str, value: impl Into<String>) -> DaemonEnv {
        self.vars.insert(key.to_string(), value.into());
        self
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.vars.get(key).map(String::as_str)
    }

    /// The configuration a daemon started with this block would run with (for in-process daemons and for the test's
    /// own view of the catalog and bucket).
    pub fn config(&self) -> Config {
        let pairs: Vec<(String, String)> = self.vars.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        Config::from_sources("", &pairs).expect("the test environment is a valid configuration")
    }

    /// Run the binary as an unprivileged user (see the field). The caller makes the spool that user's: see
    /// [`give_to_daemon_user`].
    pub fn unprivileged(mut self) -> DaemonEnv {
        self.unprivileged = true;
        self
    }

    /// `capstore` with exactly this environment (and `PATH`); add the arguments.
    pub fn command(&self) -> Command {
        let binary = env!("CARGO_BIN_EXE_capstore");
        let mut command = if self.unprivileged && running_as_root() {
            let mut setpriv = Command::new("setpriv");
            setpriv.args(["--reuid", NOBODY, "--regid", NOBODY, "--clear-groups", binary]);
            setpriv
        } else {
            Command::new(binary)
        };
        command.env_clear().env("PATH", std::env::var_os("PATH").unwrap_or_default()).envs(&self.vars);
        command
    }

    /// `sh -c SCRIPT` with exactly this environment, the binary's path in `$0`: for what a service manager does
    /// between fork and exec (systemd sets `WATCHDOG_PID` to the pid it is about to exec).
    pub fn shell(&self, script: &str) -> Command {
        let mut command = Command::new("sh");
        command
            .args(["-c", script, env!("CARGO_BIN_EXE_capstore")])
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(&self.vars);
        command
    }

    /// Start `capstore run`, its stderr (the log) in `log_path`.
    pub fn start(&self, log_path: PathBuf) -> Daemon {
        self.spawn(&["run"], log_path)
    }

    /// Start `capstore ARGS...`, its stderr (the log) in `log_path`, stdout discarded.
    pub fn spawn(&self, args: &[&str], log_path: PathBuf) -> Daemon {
        let mut command = self.command();
        command.args(args).stdout(Stdio::null()).stderr(std::fs::File::create(&log_path).expect("create the log"));
        Daemon::spawn(command, log_path)
    }
}

/// The uid and gid an unprivileged daemon runs as when the tests run as root (Debian's `nobody`/`nogroup`).
const NOBODY: &str = "65534";

fn running_as_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Makes `dir` (created if missing) and everything under it owned by the user an [`DaemonEnv::unprivileged`] daemon
/// runs as; a no-op when the tests do not run as root (the daemon then runs as the same user).
pub fn give_to_daemon_user(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    if !running_as_root() {
        return;
    }
    let status = Command::new("chown").args(["-R", &format!("{NOBODY}:{NOBODY}")]).arg(dir).status().unwrap();
    assert!(status.success(), "chown of {} failed", dir.display());
}

/// A `capstore` child process. Dropping it SIGKILLs it (a failing test must not leave a daemon running), and it dies
/// with the test process however that ends (see [`super::spawn_tied_to_process`]).
pub struct Daemon {
    child: Child,
    log_path: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    /// Spawn an already prepared command (stdout and stderr set by the caller); `log_path` is where its log goes.
    pub fn spawn(command: Command, log_path: PathBuf) -> Daemon {
        let child = super::spawn_tied_to_process(command).expect("start capstore");
        Daemon { child, log_path }
    }

    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Whether the process has exited (and its status if so).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("poll the child")
    }

    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), signal).unwrap();
    }

    /// SIGKILL and reap.
    pub fn kill(mut self) {
        self.signal(nix::sys::signal::Signal::SIGKILL);
        self.child.wait().unwrap();
    }

    /// SIGTERM and wait; returns the exit code, how long the stop took, and the log.
    pub fn terminate(mut self) -> (i32, Duration, String) {
        let started = Instant::now();
        self.signal(nix::sys::signal::Signal::SIGTERM);
        let status = self.child.wait().unwrap();
        (status.code().unwrap_or(-1), started.elapsed(), self.log())
    }

    /// Poll the log until it contains `needle`; panics with the log after `within`, or at once if the process exits.
    pub fn wait_for_log(&mut self, needle: &str, within: Duration) {
        let started = Instant::now();
        while !self.log().contains(needle) {
            if let Some(status) = self.exited() {
                panic!("capstore exited ({status}) before it logged {needle:?}:\n{}", self.log());
            }
            assert!(started.elapsed() < within, "capstore never logged {needle:?} within {within:?}:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// [`Daemon::wait_for_log`] for async tests: the same polling without blocking the runtime.
    pub async fn wait_for_log_async(&mut self, needle: &str, within: Duration) {
        let started = Instant::now();
        while !self.log().contains(needle) {
            if let Some(status) = self.exited() {
                panic!("capstore exited ({status}) before it logged {needle:?}:\n{}", self.log());
            }
            assert!(started.elapsed() < within, "capstore never logged {needle:?} within {within:?}:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Payload derived from the capture id, so a test can check bytes without remembering them. `capstore debug
/// append-stream` writes the same bytes (`deterministic_payload` in the binary): the crash tests compare the two.
pub fn expected_payload(capture_id: uuid::Uuid, len: usize) -> Vec<u8> {
    let seed = capture_id.as_bytes();
    (0..len).map(|i| seed[i % 16].wrapping_add((i / 16) as u8)).collect()
}
