//! The `capstore` binary as operators and producers use it: config checking, `put`, the daemon's inbox ingest
//! (quarantine, quotas, the owner lock) and the offline spool tools.

#![allow(clippy::disallowed_methods, reason = "these tests play producers, which rename files into the inbox")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use capstore::pack::PackFile;
use capstore::spool::{list_packs, PackState, SpoolPaths};
use common::daemon::{Daemon, DaemonEnv};

fn capstore(spool_dir: &Path) -> Command {
    DaemonEnv::offline(spool_dir).command()
}

fn output(command: &mut Command) -> (i32, String, String) {
    let Output { status, stdout, stderr } = command.output().unwrap();
    (status.code().unwrap_or(-1), String::from_utf8_lossy(&stdout).into(), String::from_utf8_lossy(&stderr).into())
}

fn wait_until(what: &str, condition: impl FnMut() -> bool) {
    assert!(common::wait_until(Duration::from_secs(30), condition), "timed out waiting for: {what}");
}

/// `capstore run` on `spool_dir`, once it ingests.
fn start_daemon(spool_dir: &Path, extra_env: &[(&str, &str)]) -> Daemon {
    let env = extra_env.iter().fold(DaemonEnv::offline(spool_dir), |env, (key, value)| env.set(key, *value));
    let mut daemon = env.start(spool_dir.with_extension(format!("{}.log", rand::random::<u32>())));
    daemon.wait_for_log("ingest ready", Duration::from_secs(30));
    daemon
}

/// SIGTERM, which must stop the daemon cleanly; returns its log.
fn stop_daemon(daemon: Daemon) -> String {
    let (code, _, log) = daemon.terminate();
    assert_eq!(code, 0, "SIGTERM must stop cleanly:\n{log}");
    log
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

    let daemon = start_daemon(&spool_dir, &[]);
    wait_until("inbox drained", || inbox_files(&spool_dir).is_empty());
    stop_daemon(daemon);
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
    let daemon = start_daemon(&spool_dir, &[]);
    let started = Instant::now();
    let (code, _, stderr) = output(capstore(&spool_dir).arg("run"));
    assert!(started.elapsed() < Duration::from_secs(10), "the refusal must be immediate");
    assert_eq!(code, 4, "{stderr}");
    assert!(stderr.contains(&format!("pid {}", daemon.pid())), "{stderr}");
    assert!(stderr.contains("host "), "{stderr}");
    stop_daemon(daemon);
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
    let daemon = start_daemon(&spool_dir, &[("CAPSTORE_SPOOL_MAX_CAPTURE_BYTES", "200KiB")]);
    wait_until("good file ingested, bad ones quarantined", || {
        inbox_files(&spool_dir).is_empty() && all_captures(&spool_dir).len() == 1
    });
    let log = stop_daemon(daemon);
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
    let daemon = start_daemon(&spool_dir, &[("CAPSTORE_SPOOL_MAX_BYTES", "100KiB")]);
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
    stop_daemon(daemon);
    let total: usize = all_captures(&spool_dir).len()
        + (0..moved)
            .map(|i| PackFile::open(&dir.path().join(format!("published-{i}"))).unwrap().entries().len())
            .sum::<usize>();
    assert_eq!(total, 6, "every file captured exactly once");
}

/// A spool at `spool_dir` whose one sealed pack holds one inbox file of 5000 bytes, ingested by a daemon now stopped.
fn ingest_one_file(spool_dir: &Path) {
    let stream = spool_dir.join("inbox").join("s");
    std::fs::create_dir_all(&stream).unwrap();
    std::fs::write(stream.join("a"), vec![7u8; 5000]).unwrap();
    let daemon = start_daemon(spool_dir, &[]);
    wait_until("ingested", || inbox_files(spool_dir).is_empty());
    stop_daemon(daemon);
}

#[test]
fn spool_verify_finds_a_damaged_pack_and_inspect_counts_by_state() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    ingest_one_file(&spool_dir);

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

/// At a start, a pack (open, sealed or uploaded) that cannot be read for an I/O error (here: a directory named like a
/// pack, on any filesystem) is tried again a few times before it goes to quarantine, and the daemon starts; one whose
/// bytes are bad (a damaged trailer) goes to quarantine at once.
#[test]
fn a_start_tries_a_pack_it_cannot_read_again_before_quarantine_and_quarantines_bad_bytes_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    ingest_one_file(&spool_dir);
    let packs = list_packs(&SpoolPaths::new(&spool_dir)).unwrap();
    assert_eq!(packs.len(), 1, "{packs:?}");
    let pack_path = packs[0].path.clone();
    let quarantined = || -> Vec<(String, String)> {
        let Ok(entries) = std::fs::read_dir(spool_dir.join("quarantine").join("packs")) else { return Vec::new() };
        let mut names: Vec<String> =
            entries.map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        let quarantine = spool_dir.join("quarantine").join("packs");
        let reason = |name: &String| std::fs::read_to_string(quarantine.join(format!("{name}.reason"))).unwrap();
        names.iter().filter(|name| !name.ends_with(".reason")).map(|name| (name.clone(), reason(name))).collect()
    };

    // Damaged bytes in the pack, and a directory named like a pack in each state.
    let mut bytes = std::fs::read(&pack_path).unwrap();
    *bytes.last_mut().unwrap() ^= 0x01;
    std::fs::write(&pack_path, bytes).unwrap();
    let unreadable: Vec<PathBuf> = ["open", "sealed", "uploaded"]
        .iter()
        .map(|state| spool_dir.join("packs").join(format!("{}.{state}", uuid::Uuid::now_v7())))
        .collect();
    for path in &unreadable {
        std::fs::create_dir(path).unwrap();
    }
    // (The status the daemon that ingested the file left is removed: the one read below is this start's.)
    let status_path = spool_dir.join("status.json");
    std::fs::remove_file(&status_path).unwrap();
    let daemon = start_daemon(&spool_dir, &[]);
    // The status counts the packs waiting in quarantine (as the gauge `capstore_packs_in_quarantine` does).
    wait_until("status written", || status_path.exists());
    let status: serde_json::Value = serde_json::from_slice(&std::fs::read(&status_path).unwrap()).unwrap();
    assert_eq!(status["spool_packs"]["packs_in_quarantine"], 4, "{status}");
    let log = stop_daemon(daemon);
    assert!(list_packs(&SpoolPaths::new(&spool_dir)).unwrap().is_empty(), "{log}");
    let moved = quarantined();
    assert_eq!(moved.len(), 4, "{moved:?}");
    let damaged = pack_path.file_name().unwrap().to_string_lossy().into_owned();
    for (name, reason) in &moved {
        if name.ends_with(&damaged) {
            assert!(reason.contains("checksum") || reason.contains("magic"), "bad bytes: {reason}");
        } else {
            assert!(reason.contains("is not a regular file"), "{name}: {reason}");
        }
    }
    for path in &unreadable {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(moved.iter().any(|(moved, _)| moved.ends_with(&name)), "{name} in quarantine: {moved:?}");
        // Tried again before it was given up on; the damaged pack was not.
        let retries = log.lines().filter(|line| line.contains("trying it again") && line.contains(&name)).count();
        assert_eq!(retries, 4, "{name}:\n{log}");
    }
    assert!(!log.lines().any(|line| line.contains("trying it again") && line.contains(&damaged)), "{log}");
}

#[test]
fn an_unreachable_catalog_is_warned_about_once_while_the_daemon_keeps_retrying() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    // Debug logging shows every retry; the WARN level must show the outage once (then every 30 s).
    let daemon = start_daemon(&spool_dir, &[("CAPSTORE_LOG_LEVEL", "info,capstore=debug")]);
    wait_until("six failed catalog connects", || {
        daemon.log().lines().any(|line| line.contains("catalog unreachable") && line.contains("failures=6"))
    });
    let log = stop_daemon(daemon);
    let warnings: Vec<&str> =
        log.lines().filter(|line| line.contains("WARN") && line.contains("catalog unreachable")).collect();
    assert_eq!(warnings.len(), 1, "one WARN line for the outage, not one per retry:\n{log}");
}

#[test]
fn json_logs_are_one_object_per_line_with_the_documented_fields() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let daemon = start_daemon(&spool_dir, &[("CAPSTORE_LOG_FORMAT", "json")]);
    wait_until("the catalog outage warning", || daemon.log().contains("catalog unreachable"));
    let log = stop_daemon(daemon);
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str(line).unwrap_or_else(|error| panic!("not JSON ({error}): {line}")))
        .collect();
    assert!(lines.len() >= 3, "{log}");
    for line in &lines {
        for field in ["timestamp", "level", "target"] {
            assert!(line[field].is_string(), "no {field}: {line}");
        }
        assert!(line["fields"]["message"].is_string(), "no fields.message: {line}");
    }
    let warning = lines
        .iter()
        .find(|line| {
            line["level"] == "WARN" && line["fields"]["message"].as_str().unwrap().contains("catalog unreachable")
        })
        .unwrap_or_else(|| panic!("no outage WARN: {log}"));
    assert!(warning["fields"]["error"].is_string(), "the error is a field of its own: {warning}");
}

/// Waits until the daemon has walked the whole inbox `count` more times (each walk logs "inbox walked" at debug).
fn wait_for_walks(daemon: &Daemon, count: usize) {
    let walks = |log: &str| log.lines().filter(|line| line.contains("inbox walked") && line.contains("dir=")).count();
    let before = walks(&daemon.log());
    wait_until("inbox rescans", || walks(&daemon.log()) >= before + count);
}

#[test]
fn the_inbox_never_follows_a_symlink_and_skips_special_files_with_one_warning() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let stream = spool_dir.join("inbox").join("s");
    std::fs::create_dir_all(&stream).unwrap();
    // What a hostile producer points at: a directory of secrets outside the inbox.
    let outside = dir.path().join("secrets");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("token"), b"do not capture me").unwrap();
    // A directory symlink made under a dot-name and renamed in, a file symlink, and a FIFO.
    std::os::unix::fs::symlink(&outside, stream.join(".linked")).unwrap();
    std::fs::rename(stream.join(".linked"), stream.join("linked")).unwrap();
    std::os::unix::fs::symlink(outside.join("token"), stream.join("token-link")).unwrap();
    nix::unistd::mkfifo(&stream.join("pipe"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    std::fs::write(stream.join("good"), b"good").unwrap();

    let daemon = start_daemon(&spool_dir, &[("CAPSTORE_LOG_LEVEL", "info,capstore::spool::inbox=debug")]);
    wait_until("the good file ingested", || !stream.join("good").exists());
    wait_for_walks(&daemon, 3);
    std::fs::write(stream.join(".later"), b"later").unwrap();
    std::fs::rename(stream.join(".later"), stream.join("later")).unwrap();
    wait_until("a later file ingested: the FIFO blocked nothing", || !stream.join("later").exists());
    let log = stop_daemon(daemon);

    assert_eq!(std::fs::read(outside.join("token")).unwrap(), b"do not capture me", "a file outside was touched");
    let payloads: Vec<Vec<u8>> = all_captures(&spool_dir).into_iter().map(|(_, payload)| payload).collect();
    assert_eq!(payloads, vec![b"good".to_vec(), b"later".to_vec()], "only the regular files were captured");
    for entry in ["linked", "token-link", "pipe"] {
        assert!(std::fs::symlink_metadata(stream.join(entry)).is_ok(), "{entry} was removed");
        let field = format!("file=s/{entry}");
        let names_it = |line: &str| line.split_whitespace().any(|word| word == field);
        let warnings = log.lines().filter(|line| line.contains("WARN") && names_it(line)).count();
        assert_eq!(warnings, 1, "one WARN for {entry} over several rescans:\n{log}");
    }
}

#[test]
fn a_captured_file_that_cannot_be_unlinked_is_captured_once_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let locked = spool_dir.join("inbox").join("locked");
    std::fs::create_dir_all(&locked).unwrap();
    std::fs::write(locked.join("frame"), b"locked frame").unwrap();
    common::daemon::give_to_daemon_user(dir.path());
    // A stream directory the daemon may read but not change (as a root-owned one would be).
    let mode = |bits| std::fs::set_permissions(&locked, std::os::unix::fs::PermissionsExt::from_mode(bits)).unwrap();
    mode(0o555);
    let env = DaemonEnv::offline(&spool_dir).set("CAPSTORE_LOG_LEVEL", "info,capstore::spool::inbox=debug");
    let start = |env: &DaemonEnv| {
        let mut daemon = env.clone().unprivileged().start(dir.path().join(format!("{}.log", rand::random::<u32>())));
        daemon.wait_for_log("ingest ready", Duration::from_secs(30));
        daemon
    };
    let captured_frames = || all_captures(&spool_dir).iter().filter(|(_, payload)| payload == b"locked frame").count();

    let daemon = start(&env);
    wait_until("the locked file captured", || captured_frames() == 1);
    wait_for_walks(&daemon, 4);
    let log = stop_daemon(daemon);
    assert_eq!(captured_frames(), 1, "captured again on a rescan:\n{log}");
    assert_eq!(log.matches("cannot be removed").count(), 1, "said once:\n{log}");
    assert!(locked.join("frame").exists());

    let daemon = start(&env);
    wait_for_walks(&daemon, 3);
    stop_daemon(daemon);
    assert_eq!(captured_frames(), 1, "captured again after a restart");

    // Once the directory may be changed, the next start removes the file and forgets it.
    mode(0o755);
    let daemon = start(&env);
    wait_for_walks(&daemon, 1);
    stop_daemon(daemon);
    assert!(!locked.join("frame").exists());
    assert_eq!(captured_frames(), 1);
    let ledger = std::fs::read_to_string(spool_dir.join("inbox-captured")).unwrap_or_default();
    assert!(ledger.trim().is_empty(), "the ledger forgets removed files: {ledger:?}");
}

#[test]
fn an_unlistable_inbox_directory_is_warned_about_once_and_stops_neither_ingest_nor_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let closed = spool_dir.join("inbox").join("closed");
    let open = spool_dir.join("inbox").join("open");
    std::fs::create_dir_all(&closed).unwrap();
    std::fs::create_dir_all(&open).unwrap();
    std::fs::write(closed.join("hidden-away"), b"x").unwrap();
    common::daemon::give_to_daemon_user(dir.path());
    std::fs::set_permissions(&closed, std::os::unix::fs::PermissionsExt::from_mode(0o000)).unwrap();
    let env = DaemonEnv::offline(&spool_dir).set("CAPSTORE_LOG_LEVEL", "info,capstore::spool::inbox=debug");
    for run in 0..2 {
        let log_path = dir.path().join(format!("run-{run}.log"));
        let mut daemon = env.clone().unprivileged().start(log_path);
        daemon.wait_for_log("ingest ready", Duration::from_secs(30));
        let name = format!("good-{run}");
        std::fs::write(open.join(format!(".{name}")), b"good").unwrap();
        std::fs::rename(open.join(format!(".{name}")), open.join(&name)).unwrap();
        wait_until("the good file ingested", || !open.join(&name).exists());
        wait_for_walks(&daemon, 4);
        let log = stop_daemon(daemon);
        let warnings = log.lines().filter(|line| line.contains("WARN") && line.contains("cannot be listed")).count();
        assert_eq!(warnings, 1, "run {run}: one WARN for the directory, not one per rescan:\n{log}");
    }
    assert_eq!(all_captures(&spool_dir).len(), 2);
}

#[test]
fn spool_files_and_directories_are_not_readable_by_other_users() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let daemon = start_daemon(&spool_dir, &[]);
    let stream = spool_dir.join("inbox").join("s");
    std::fs::create_dir_all(&stream).unwrap();
    std::fs::write(stream.join(".c"), b"a capture").unwrap();
    std::fs::rename(stream.join(".c"), stream.join("c")).unwrap();
    wait_until("ingested and sealed", || {
        !stream.join("c").exists()
            && list_packs(&SpoolPaths::new(&spool_dir)).unwrap().iter().any(|p| p.state == PackState::Sealed)
    });
    wait_until("status written", || spool_dir.join("status.json").exists());
    stop_daemon(daemon);
    let mut checked = 0;
    let mut pending = vec![spool_dir.clone()];
    while let Some(path) = pending.pop() {
        let metadata = std::fs::symlink_metadata(&path).unwrap();
        let mode = metadata.permissions().mode() & 0o777;
        // The producer made inbox/s itself; everything else is the daemon's.
        if path != stream {
            assert_eq!(mode & 0o007, 0, "{} is mode {mode:o}: open to other users", path.display());
            if metadata.is_file() {
                assert_eq!(mode & 0o022, 0, "{} is mode {mode:o}: writable by others than its owner", path.display());
            }
            checked += 1;
        }
        if metadata.is_dir() {
            pending.extend(std::fs::read_dir(&path).unwrap().map(|entry| entry.unwrap().path()));
        }
    }
    assert!(checked >= 8, "spool root, inbox, packs, quarantine, a pack, LOCK, SPOOL_ID, status.json: {checked}");
}
