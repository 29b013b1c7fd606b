//! The Python client (`clients/python`) against a real daemon: it is installed as a package (pip, from the
//! checkout), type-checked with mypy --strict, and its pytest suite runs live against a `capstore run` with a real
//! ClickHouse and a file:// bucket.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::daemon::DaemonEnv;

const INSTALL_HINT: &str = "python3 -m venv ~/.cache/capstore-python-venv && ~/.cache/capstore-python-venv/bin/pip \
     install pytest numpy mypy setuptools (or run .ci/run, which does it)";

/// The Python of the test venv: `CAPSTORE_PYTHON`, or the venv `.ci/run` makes.
fn python() -> PathBuf {
    let python = common::find_service_binary(
        "CAPSTORE_PYTHON",
        "capstore-python",
        "capstore-python-venv/bin/python",
        INSTALL_HINT,
    );
    let check = Command::new(&python)
        .args(["-c", "import pytest, numpy, mypy, setuptools"])
        .output()
        .unwrap_or_else(|error| panic!("cannot run {}: {error}; {INSTALL_HINT}", python.display()));
    assert!(
        check.status.success(),
        "{} lacks a test dependency: {}\ninstall: {INSTALL_HINT}",
        python.display(),
        String::from_utf8_lossy(&check.stderr)
    );
    python
}

fn client_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python")
}

/// `from` copied to `to`, without build output or caches.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == "build" || name.ends_with(".egg-info") || name == "__pycache__" || name.starts_with('.') {
            continue;
        }
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &to.join(&name));
        } else {
            std::fs::copy(entry.path(), to.join(&name)).unwrap();
        }
    }
}

fn run(command: &mut Command, what: &str) -> String {
    let output = command.output().unwrap_or_else(|error| panic!("{what}: {error}"));
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{what} failed:\n{text}");
    text
}

#[tokio::test]
async fn the_python_client_installs_type_checks_and_passes_its_live_tests() {
    let python = python();
    let dir = tempfile::tempdir().unwrap();
    // Installed as a user would (`pip install ./clients/python`), into a directory of this test, from a copy of the
    // package (a build leaves `build/` and `*.egg-info` beside the sources).
    let source = dir.path().join("source");
    copy_tree(&client_dir(), &source);
    let site = dir.path().join("site");
    run(
        Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target"])
            .arg(&site)
            .arg(&source),
        "pip install ./clients/python",
    );
    assert!(site.join("capstore/py.typed").exists(), "the package ships its type marker");
    run(
        Command::new(&python)
            .args(["-m", "mypy", "--cache-dir"])
            .arg(dir.path().join("mypy-cache"))
            .args(["src", "examples"])
            .current_dir(client_dir()),
        "mypy --strict",
    );

    let port = common::free_port(false);
    let env = DaemonEnv::live("pyclient", dir.path())
        .set("CAPSTORE_SPOOL_MAX_CAPTURE_BYTES", "3MiB")
        .set("CAPSTORE_HTTP_LISTEN", format!("127.0.0.1:{port}"))
        .set("CAPSTORE_SHUTDOWN_GRACE", "5s");
    let mut daemon = env.start(dir.path().join("daemon.log"));
    let url = format!("http://127.0.0.1:{port}");
    // Ready for the suite once the catalog answers a listing.
    let started = Instant::now();
    let http = reqwest::Client::new();
    while !http.get(format!("{url}/v1/captures?limit=1")).send().await.is_ok_and(|response| response.status() == 200) {
        assert!(daemon.exited().is_none(), "daemon exited:\n{}", daemon.log());
        assert!(started.elapsed() < Duration::from_secs(30), "the catalog never connected:\n{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let output = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"])
        .current_dir(client_dir())
        .env("PYTHONPATH", &site)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("CAPSTORE_URL", &url)
        .env("CAPSTORE_MAX_CAPTURE_BYTES", (3 << 20).to_string())
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "pytest failed:\n{text}\ndaemon log:\n{}", daemon.log());
    assert!(text.contains(" passed"), "{text}");
    assert!(!text.contains("skipped"), "no test may skip: {text}");
    daemon.terminate();
}
