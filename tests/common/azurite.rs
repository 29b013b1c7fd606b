//! One Azurite blob server (Azure Blob Storage's emulator, from npm) per test process, with one container.
//!
//! object_store cannot create a container, and Azurite refuses unsigned requests, so the harness signs the few
//! management requests it sends itself (SharedKey, with the emulator's well-known account key): creating the
//! container and reading a blob's committed block list (proof that a large pack went up in blocks).

use std::path::PathBuf;
use std::process::Child;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use base64::Engine;

pub const ACCOUNT: &str = "devstoreaccount1";
/// Azurite's documented development key (public, identical in every installation).
pub const ACCOUNT_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";
/// The x-ms-version of the signed management requests.
const API_VERSION: &str = "2021-08-06";
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const INSTALL_HINT: &str = "Azurite not found (looked in $CAPSTORE_AZURITE, PATH and \
     $HOME/.cache/capstore-azurite/node_modules/.bin/azurite-blob): install it with `apt-get install -y nodejs npm && \
     mkdir -p ~/.cache/capstore-azurite && npm install --prefix ~/.cache/capstore-azurite azurite@3.35.0`";

pub struct AzuriteServer {
    pub port: u16,
    pub container: String,
    pub dir: PathBuf,
    _child: Mutex<Child>,
}

impl AzuriteServer {
    /// `http://127.0.0.1:PORT/devstoreaccount1`: the account's blob endpoint (path style, as the emulator serves it).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}/{ACCOUNT}", self.port)
    }

    /// A SharedKey-signed request on `path` (below the account, e.g. `/container/key`) with `query` pairs, blocking.
    pub fn signed(&self, method: &str, path: &str, query: &[(&str, &str)]) -> (u16, String) {
        let date = httpdate::fmt_http_date(std::time::SystemTime::now());
        let mut canonical_query: Vec<String> = query.iter().map(|(key, value)| format!("\n{key}:{value}")).collect();
        canonical_query.sort();
        // VERB, then 11 standard headers (all empty: no body, x-ms-date instead of Date), then the x-ms headers and
        // the resource: /account/account/path for the emulator's path-style URLs.
        let string_to_sign = format!(
            "{method}\n\n\n\n\n\n\n\n\n\n\n\nx-ms-date:{date}\nx-ms-version:{API_VERSION}\n/{ACCOUNT}/{ACCOUNT}{path}{}",
            canonical_query.concat()
        );
        let key = base64::engine::general_purpose::STANDARD.decode(ACCOUNT_KEY).unwrap();
        let signature =
            ring::hmac::sign(&ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key), string_to_sign.as_bytes());
        let authorization =
            format!("SharedKey {ACCOUNT}:{}", base64::engine::general_purpose::STANDARD.encode(signature.as_ref()));
        let query_text: Vec<String> = query.iter().map(|(key, value)| format!("{key}={value}")).collect();
        let url = format!("{}{path}?{}", self.endpoint(), query_text.join("&"));
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        // Own thread and runtime: the caller may be inside an async test.
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async move {
                let response = reqwest::Client::new()
                    .request(method, url)
                    .header("x-ms-date", date)
                    .header("x-ms-version", API_VERSION)
                    .header("authorization", authorization)
                    .header("content-length", "0")
                    .send()
                    .await
                    .map_err(|error| error.to_string())?;
                let status = response.status().as_u16();
                Ok::<_, String>((status, response.text().await.unwrap_or_default()))
            })
        })
        .join()
        .unwrap()
        .unwrap_or_else(|error| (0, error))
    }

    /// How many committed blocks the blob at `key` (below the container) has.
    pub fn committed_blocks(&self, key: &str) -> usize {
        let path = format!("/{}/{key}", self.container);
        let (status, body) = self.signed("GET", &path, &[("blocklisttype", "committed"), ("comp", "blocklist")]);
        assert_eq!(status, 200, "get block list of {key}: {body}");
        body.matches("<Block>").count()
    }
}

fn find_azurite() -> PathBuf {
    super::find_service_binary(
        "CAPSTORE_AZURITE",
        "azurite-blob",
        "capstore-azurite/node_modules/.bin/azurite-blob",
        INSTALL_HINT,
    )
}

/// The server shared by every test of this process, started on first use, its container created.
pub fn shared_azurite() -> &'static AzuriteServer {
    static SERVER: OnceLock<AzuriteServer> = OnceLock::new();
    SERVER.get_or_init(start_server)
}

fn start_server() -> AzuriteServer {
    let port = super::free_port(false);
    let args = ["--blobHost", "127.0.0.1", "--blobPort", &port.to_string(), "--inMemoryPersistence"]
        .into_iter()
        // Without --disableTelemetry Azurite tries to reach the internet.
        .chain(["--disableTelemetry"])
        .map(str::to_string)
        .collect::<Vec<_>>();
    let (child, dir) = super::spawn_service(&find_azurite(), &args, "azurite");
    let server = AzuriteServer { port, container: "capstore-test".into(), dir: dir.clone(), _child: Mutex::new(child) };
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let (status, body) = server.signed("PUT", &format!("/{}", server.container), &[("restype", "container")]);
        let exited = server._child.lock().unwrap().try_wait().ok().flatten();
        match status {
            201 | 409 => return server,
            _ if exited.is_some() => {
                panic!("Azurite exited ({}):\n{}", exited.unwrap(), super::log_tail(&dir.join("azurite.log"), 30))
            }
            _ if Instant::now() >= deadline => {
                panic!(
                    "Azurite not ready after {READY_TIMEOUT:?} ({status} {body})\n{}",
                    super::log_tail(&dir.join("azurite.log"), 30)
                )
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}
