//! The `capstore` binary as operators and producers use it: config checking, `put`, the daemon's inbox ingest
//! (quarantine, quotas, the owner lock) and the offline spool tools.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use capstore::pack::PackFile;
use capstore::spool::{list_packs, PackState, SpoolPaths};

fn capstore(spool_dir: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_capstore"));
    command
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CAPSTORE_SPOOL_DIR", spool_dir)
        // Any free port: daemons of parallel tests (and other processes) must not fight over the default one.
        .env("CAPSTORE_HTTP_LISTEN", "127.0.0.1:0")
        // No catalog here (port 1 refuses at once): ingest must work regardless, publishing just waits.
        .env("CAPSTORE_CATALOG_URL", "http://127.0.0.1:1")
        .env("CAPSTORE_BUCKET_URL", format!("file://{}", spool_dir.with_extension("bucket").display()))
        .env("CAPSTORE_SPOOL_PACK_MAX_AGE", "100ms")
        .env("CAPSTORE_SPOOL_MIN_FREE_BYTES", "1MiB")
        .env("CAPSTORE_SPOOL_INBOX_RESCAN_INTERVAL", "200ms")
        .env("CAPSTORE_LOG_LEVEL", "info");
    command
}

fn output(command: &mut Command) -> (i32, String, String) {
    let Output { status, stdout, stderr } = command.output().unwrap();
    (status.code().unwrap_or(-1), String::from_utf8_lossy(&stdout).into(), String::from_utf8_lossy(&stderr).into())
}

fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let started = Instant::now();
    while !condition() {
        assert!(started.elapsed() < Duration::from_secs(30), "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Daemon {
    child: Child,
    stderr_path: PathBuf,
}

impl Drop for Daemon {
    /// A failing test must not leave a daemon running.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    fn start(spool_dir: &Path, extra_env: &[(&str, &str)]) -> Daemon {
        let stderr_path = spool_dir.with_extension(format!("{}.log", rand::random::<u32>()));
        let stderr = std::fs::File::create(&stderr_path).unwrap();
        let mut command = capstore(spool_dir);
        command.envs(extra_env.iter().copied()).arg("run").stderr(stderr).stdout(Stdio::null());
        let daemon = Daemon { child: command.spawn().unwrap(), stderr_path };
        wait_until("daemon ingesting", || daemon.log().contains("ingest ready"));
        daemon
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    fn stop(mut self) -> String {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), nix::sys::signal::Signal::SIGTERM)
            .unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "SIGTERM must stop cleanly: {status}\n{}", self.log());
        self.log()
    }
}

fn inbox_files(spool_dir: &Path) -> Vec<PathBuf> {
    capstore::spool::inbox::walk_inbox(&spool_dir.join("inbox")).unwrap()
}

fn all_captures(spool_dir: &Path) -> Vec<(capstore::pack::CaptureMeta, Vec<u8>)> {
    let mut captures = Vec::new();
    for listing in list_packs(&SpoolPaths::new(spool_dir)).unwrap() {
        if listing.state == PackState::Open {
            continue;
        }
        let pack = PackFile::open(&listing.path).unwrap();
        for index in 0..pack.entries().len() {
            captures.push(pack.read_capture(index).unwrap());
        }
    }
    captures
}

#[test]
fn check_config_prints_the_effective_config_with_secrets_redacted() {
    let dir = tempfile::tempdir().unwrap();
    let (code, stdout, stderr) = output(
        capstore(dir.path())
            .env("CAPSTORE_CATALOG_PASSWORD", "hunter2")
            .env("CAPSTORE_CATALOG_NAME", "edge-3")
            .arg("check-config")
            .arg("--config")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/config/capstore.toml")),
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("catalog_name = \"edge-3\""), "{stdout}");
    assert!(stdout.contains("password = \"<redacted>\""), "{stdout}");
    assert!(stdout.contains("start_wait = \"20s\""), "the resolved default start wait is shown: {stdout}");
    assert!(!stdout.contains("hunter2") && !stderr.contains("hunter2"));
}

#[test]
fn check_config_lists_every_problem_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bad.toml");
    std::fs::write(&config, "[lease]\nttl = \"1500ms\"\npublish_timeout = \"1500ms\"\n[upload]\nconcurrency = 0\n")
        .unwrap();
    let (code, _, stderr) = output(capstore(dir.path()).arg("check-config").arg("--config").arg(&config));
    assert_eq!(code, 2);
    for expected in ["lease.ttl", "lease.publish_timeout", "upload.concurrency"] {
        assert!(stderr.contains(expected), "{expected} missing from: {stderr}");
    }
    std::fs::write(&config, "[spool]\ndirectory = \"/x\"\n").unwrap();
    let (code, _, stderr) = output(capstore(dir.path()).arg("check-config").arg("--config").arg(&config));
    assert_eq!(code, 2);
    assert!(stderr.contains("directory"), "{stderr}");
    let (code, _, stderr) = output(capstore(dir.path()).env("CAPSTORE_LEASE_TTLL", "5s").arg("check-config"));
    assert_eq!(code, 2);
    assert!(stderr.contains("CAPSTORE_LEASE_TTLL"), "{stderr}");
}

#[test]
fn put_then_run_captures_the_file_with_its_labels() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let payload_path = dir.path().join("frame.bin");
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&payload_path, &payload).unwrap();
    let id = uuid::Uuid::now_v7();
    let (code, stdout, stderr) = output(
        capstore(&spool_dir)
            .args(["put", "--stream", "edge/cam-1", "--label", "site=berlin", "--label", "shift=a=b"])
            .args(["--content-type", "application/octet-stream", "--id", &id.to_string()])
            .arg(&payload_path),
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, format!("{id}\t{}\n", payload_path.display()));
    assert_eq!(inbox_files(&spool_dir).len(), 1, "put works without a daemon: the file waits in the inbox");

    let daemon = Daemon::start(&spool_dir, &[]);
    wait_until("inbox drained", || inbox_files(&spool_dir).is_empty());
    daemon.stop();
    let captures = all_captures(&spool_dir);
    assert_eq!(captures.len(), 1);
    let (meta, bytes) = &captures[0];
    assert_eq!(meta.capture_id, id);
    assert_eq!(meta.stream, "edge/cam-1");
    assert_eq!(meta.labels.get("site").map(String::as_str), Some("berlin"));
    assert_eq!(meta.labels.get("shift").map(String::as_str), Some("a=b"));
    assert_eq!(meta.content_type.as_deref(), Some("application/octet-stream"));
    assert_eq!(bytes, &payload);
}

#[test]
fn put_rejects_bad_arguments_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f");
    std::fs::write(&file, b"x").unwrap();
    let (code, _, stderr) = output(capstore(dir.path()).args(["put", "--stream", "../escape"]).arg(&file));
    assert_eq!(code, 2);
    assert!(stderr.contains("--stream"), "{stderr}");
    let (code, _, stderr) =
        output(capstore(dir.path()).args(["put", "--stream", "s", "--label", "novalue"]).arg(&file));
    assert_eq!(code, 2);
    assert!(stderr.contains("key=value"), "{stderr}");
    let (code, _, stderr) =
        output(capstore(dir.path()).args(["put", "--stream", "s", "--id", "not-a-uuid"]).arg(&file));
    assert_eq!(code, 2);
    assert!(stderr.contains("--id"), "{stderr}");
}

#[test]
fn a_second_daemon_on_the_same_spool_exits_4_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let daemon = Daemon::start(&spool_dir, &[]);
    let started = Instant::now();
    let (code, _, stderr) = output(capstore(&spool_dir).arg("run"));
    assert!(started.elapsed() < Duration::from_secs(10), "the refusal must be immediate");
    assert_eq!(code, 4, "{stderr}");
    assert!(stderr.contains(&format!("pid {}", daemon.child.id())), "{stderr}");
    assert!(stderr.contains("host "), "{stderr}");
    daemon.stop();
}

#[test]
fn bad_inbox_files_are_quarantined_without_blocking_good_ones() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let inbox = spool_dir.join("inbox");
    for sub in ["good", "bad stream", "big"] {
        std::fs::create_dir_all(inbox.join(sub)).unwrap();
    }
    std::fs::write(inbox.join("bad stream").join("a"), b"bad").unwrap();
    std::fs::write(inbox.join("big").join("b"), vec![0u8; 300_000]).unwrap();
    std::fs::write(inbox.join("good").join("broken.capenv"), b"capenv1 {not json}\npayload").unwrap();
    std::fs::write(inbox.join("good").join(".being-written"), b"ignored").unwrap();
    std::fs::write(inbox.join("good").join("half.tmp"), b"ignored").unwrap();
    std::fs::write(inbox.join("good").join("c"), b"good").unwrap();
    let daemon = Daemon::start(&spool_dir, &[("CAPSTORE_SPOOL_MAX_CAPTURE_BYTES", "200KiB")]);
    wait_until("good file ingested, bad ones quarantined", || {
        inbox_files(&spool_dir).is_empty() && all_captures(&spool_dir).len() == 1
    });
    let log = daemon.stop();
    assert_eq!(all_captures(&spool_dir)[0].1, b"good");
    assert!(inbox.join("good").join(".being-written").exists() && inbox.join("good").join("half.tmp").exists());
    let quarantine = spool_dir.join("quarantine").join("inbox");
    let reasons: Vec<String> = std::fs::read_dir(&quarantine)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "reason"))
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    assert_eq!(reasons.len(), 3, "{reasons:?}");
    assert!(reasons.iter().any(|r| r.contains("bad stream")), "{reasons:?}");
    assert!(reasons.iter().any(|r| r.contains("max_capture_bytes")), "{reasons:?}");
    assert!(reasons.iter().any(|r| r.contains("envelope")), "{reasons:?}");
    assert_eq!(log.matches("inbox file quarantined").count(), 3, "one WARN line per file: {log}");
    let kept_bytes: usize = std::fs::read_dir(&quarantine)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_none_or(|e| e != "reason"))
        .map(|p| std::fs::read(p).unwrap().len())
        .sum();
    assert_eq!(kept_bytes, 3 + 300_000 + "capenv1 {not json}\npayload".len(), "quarantined files keep their bytes");
}

#[test]
fn a_full_spool_leaves_files_in_the_inbox_and_resumes_when_space_returns() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let stream = spool_dir.join("inbox").join("s");
    std::fs::create_dir_all(&stream).unwrap();
    let daemon = Daemon::start(&spool_dir, &[("CAPSTORE_SPOOL_MAX_BYTES", "100KiB")]);
    for i in 0..6 {
        std::fs::write(stream.join(format!(".f{i}")), vec![i as u8; 30_000]).unwrap();
        std::fs::rename(stream.join(format!(".f{i}")), stream.join(format!("f{i}"))).unwrap();
    }
    wait_until("spool fills up", || inbox_files(&spool_dir).len() <= 3 && !all_captures(&spool_dir).is_empty());
    let captured_before = all_captures(&spool_dir).len();
    assert!(captured_before < 6, "quota must refuse some files");
    assert!(
        std::fs::read_dir(spool_dir.join("quarantine").join("inbox")).is_err(),
        "refused files are not quarantined"
    );
    // Space returns, as when the uploader and indexer finish with sealed packs.
    wait_until("captured packs sealed", || {
        list_packs(&SpoolPaths::new(&spool_dir)).unwrap().iter().all(|p| p.state == PackState::Sealed)
    });
    let mut moved = 0;
    for listing in list_packs(&SpoolPaths::new(&spool_dir)).unwrap() {
        std::fs::rename(&listing.path, dir.path().join(format!("published-{moved}"))).unwrap();
        moved += 1;
    }
    wait_until("inbox drains once space returns", || inbox_files(&spool_dir).is_empty());
    daemon.stop();
    let total: usize = all_captures(&spool_dir).len()
        + (0..moved)
            .map(|i| PackFile::open(&dir.path().join(format!("published-{i}"))).unwrap().entries().len())
            .sum::<usize>();
    assert_eq!(total, 6, "every file captured exactly once");
}

#[test]
fn spool_verify_finds_a_damaged_pack_and_inspect_counts_by_state() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let stream = spool_dir.join("inbox").join("s");
    std::fs::create_dir_all(&stream).unwrap();
    std::fs::write(stream.join("a"), vec![7u8; 5000]).unwrap();
    let daemon = Daemon::start(&spool_dir, &[]);
    wait_until("ingested", || inbox_files(&spool_dir).is_empty());
    daemon.stop();

    let (code, stdout, stderr) = output(capstore(&spool_dir).args(["spool", "inspect", "--json"]));
    assert_eq!(code, 0, "{stderr}");
    let inventory: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let sealed = inventory["totals"].as_array().unwrap().iter().find(|t| t["state"] == "sealed").unwrap();
    assert_eq!(sealed["packs"], 1);
    assert_eq!(sealed["records"], 1);
    let (code, stdout, _) = output(capstore(&spool_dir).args(["spool", "verify"]));
    assert_eq!(code, 0, "{stdout}");

    // Flip one payload byte of the sealed pack: verify must notice.
    let pack_path = list_packs(&SpoolPaths::new(&spool_dir)).unwrap()[0].path.clone();
    let mut bytes = std::fs::read(&pack_path).unwrap();
    let entry = PackFile::open(&pack_path).unwrap().entries()[0].clone();
    bytes[entry.payload_offset as usize + 100] ^= 0x01;
    std::fs::write(&pack_path, bytes).unwrap();
    let (code, stdout, _) = output(capstore(&spool_dir).args(["spool", "verify"]));
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.contains("BAD"), "{stdout}");
}
