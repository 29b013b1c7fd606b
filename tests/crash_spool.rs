//! Crash tests of the spool: a real `capstore` child process is SIGKILLed at random instants while it appends captures
//! (and while it ingests from the inbox), then the spool is recovered and compared with what was acknowledged.
//!
//! Checked after every restart (I1, I6, I7): every acknowledged capture is in the spool exactly once with the same
//! bytes; no `.open` pack is left after recovery; the inbox holds nothing already captured; nothing dropped is lost.

#![allow(clippy::disallowed_methods, reason = "these tests play producers, which rename files into the inbox")]

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use capstore::config::SpoolConfig;
use capstore::pack::PackFile;
use capstore::spool::{list_packs, PackState, Spool};
use common::daemon::{expected_payload, Daemon, DaemonEnv};
use rand::Rng;
use uuid::Uuid;

const KILLS: usize = 22;

/// Small packs (sealed by bytes too) and fast seals, so kills land in every state of a pack.
fn crash_env(spool_dir: &Path) -> DaemonEnv {
    DaemonEnv::offline(spool_dir)
        .set("CAPSTORE_SPOOL_PACK_MAX_BYTES", "1MiB")
        .set("CAPSTORE_SPOOL_PACK_MAX_AGE", "150ms")
        .set("CAPSTORE_LOG_LEVEL", "warn")
}

fn capstore(spool_dir: &Path) -> Command {
    crash_env(spool_dir).command()
}

fn sigkill(child: &mut Child) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    child.wait().unwrap();
}

/// Every capture in the spool after recovery (the test takes the spool lock, as a restarted daemon would).
struct SpoolContents {
    /// capture_id -> (payload, how many times it appears, source key)
    captures: HashMap<Uuid, (Vec<u8>, usize)>,
    open_packs_left: usize,
}

fn recover_and_read(spool_dir: &Path) -> SpoolContents {
    let config = SpoolConfig {
        dir: spool_dir.to_path_buf(),
        min_free_bytes: capstore::config::ByteSize(0),
        ..Default::default()
    };
    let (spool, _report) = Spool::open(&config).expect("recovery after a crash must succeed");
    let mut captures: HashMap<Uuid, (Vec<u8>, usize)> = HashMap::new();
    let mut open_packs_left = 0;
    for listing in list_packs(spool.paths()).unwrap() {
        if listing.state == PackState::Open {
            open_packs_left += 1;
            continue;
        }
        let pack = PackFile::open(&listing.path).expect("every pack left by recovery reads back");
        pack.verify().expect("every pack left by recovery verifies");
        for index in 0..pack.entries().len() {
            let (meta, payload) = pack.read_capture(index).unwrap();
            let slot = captures.entry(meta.capture_id).or_insert((payload.clone(), 0));
            assert_eq!(slot.0, payload, "capture {} stored twice with different bytes", meta.capture_id);
            slot.1 += 1;
        }
    }
    let quarantined = std::fs::read_dir(spool.paths().quarantine.join("packs")).map(|d| d.count()).unwrap_or(0);
    assert_eq!(quarantined, 0, "a crash must never leave a pack that recovery cannot read");
    SpoolContents { captures, open_packs_left }
}

#[test]
fn appended_captures_survive_sigkill_at_random_instants() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let mut acknowledged: BTreeMap<Uuid, usize> = BTreeMap::new();
    let mut rng = rand::rng();
    for round in 0..KILLS {
        let mut command = capstore(&spool_dir);
        command.args(["debug", "append-stream", "--producers", "8"]).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = common::spawn_tied_to_process(command).unwrap();
        let stdout = child.stdout.take().unwrap();
        let acks: Arc<Mutex<Vec<(Uuid, usize)>>> = Arc::default();
        let reader_acks = acks.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // A line cut by the kill has no trailing length and is skipped by the parse.
                let mut fields = line.split_whitespace();
                if let (Some("ACK"), Some(id), Some(len)) = (fields.next(), fields.next(), fields.next()) {
                    if let (Ok(id), Ok(len)) = (Uuid::parse_str(id), len.parse()) {
                        reader_acks.lock().unwrap().push((id, len));
                    }
                }
            }
        });
        // Wait until this run has acknowledged something, then kill it at a random later instant.
        let started = Instant::now();
        while acks.lock().unwrap().is_empty() {
            assert!(started.elapsed() < Duration::from_secs(30), "round {round}: child acknowledged nothing");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(0..400)));
        sigkill(&mut child);
        reader.join().unwrap();
        for (id, len) in acks.lock().unwrap().drain(..) {
            assert!(acknowledged.insert(id, len).is_none(), "capture id {id} acknowledged twice");
        }

        let contents = recover_and_read(&spool_dir);
        assert_eq!(contents.open_packs_left, 0, "round {round}: recovery must seal every open pack");
        for (id, len) in &acknowledged {
            let (payload, copies) =
                contents.captures.get(id).unwrap_or_else(|| panic!("round {round}: acknowledged capture {id} lost"));
            assert_eq!(*copies, 1, "round {round}: capture {id} stored {copies} times");
            assert_eq!(payload, &expected_payload(*id, *len), "round {round}: capture {id} bytes differ");
        }
        assert!(contents.captures.values().all(|(_, copies)| *copies == 1), "round {round}: a capture is duplicated");
    }
    assert!(acknowledged.len() > KILLS * 10, "too few acknowledgements ({}) to mean anything", acknowledged.len());
}

/// Drops files into the inbox the way a well-behaved producer does: write a hidden temp file, then rename it in.
struct Producer {
    inbox_stream: PathBuf,
    dropped: BTreeMap<Uuid, usize>,
    counter: usize,
}

impl Producer {
    fn drop_one(&mut self) {
        let id = Uuid::now_v7();
        let len = [0usize, 10, 1000, 50_000][self.counter % 4];
        self.counter += 1;
        let temp = self.inbox_stream.join(format!(".{id}.partial"));
        std::fs::write(&temp, expected_payload(id, len)).unwrap();
        std::fs::rename(&temp, self.inbox_stream.join(id.to_string())).unwrap();
        self.dropped.insert(id, len);
    }
}

fn inbox_ids(inbox_stream: &Path) -> HashSet<Uuid> {
    std::fs::read_dir(inbox_stream)
        .unwrap()
        .filter_map(|entry| Uuid::parse_str(&entry.unwrap().file_name().to_string_lossy()).ok())
        .collect()
}

#[test]
fn inbox_ingest_is_exactly_once_across_sigkills() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let inbox_stream = spool_dir.join("inbox").join("cam").join("1");
    std::fs::create_dir_all(&inbox_stream).unwrap();
    let mut producer = Producer { inbox_stream: inbox_stream.clone(), dropped: BTreeMap::new(), counter: 0 };
    let mut rng = rand::rng();
    let check = |producer: &Producer, round: usize| {
        let contents = recover_and_read(&spool_dir);
        let waiting = inbox_ids(&inbox_stream);
        for (id, len) in &producer.dropped {
            match (contents.captures.get(id), waiting.contains(id)) {
                (Some(_), true) => panic!("round {round}: {id} is both captured and still in the inbox"),
                (None, false) => panic!("round {round}: {id} was dropped but is neither in the inbox nor the spool"),
                (Some((payload, copies)), false) => {
                    assert_eq!(*copies, 1, "round {round}: {id} captured {copies} times");
                    assert_eq!(payload, &expected_payload(*id, *len), "round {round}: {id} bytes differ");
                }
                (None, true) => {}
            }
        }
        (contents.captures.len(), waiting.len())
    };
    for round in 0..KILLS {
        let mut command = capstore(&spool_dir);
        command.arg("run").stderr(Stdio::inherit());
        let mut child = common::spawn_tied_to_process(command).unwrap();
        let kill_at = Instant::now() + Duration::from_millis(rng.random_range(50..500));
        while Instant::now() < kill_at {
            producer.drop_one();
            std::thread::sleep(Duration::from_millis(2));
        }
        sigkill(&mut child);
        check(&producer, round);
    }
    // A last clean run drains the inbox; SIGTERM stops it cleanly (once it is up: a signal before the handlers are
    // installed would kill it by default action).
    let mut last_run: Daemon =
        crash_env(&spool_dir).set("CAPSTORE_LOG_LEVEL", "info").start(dir.path().join("last-run.log"));
    let started = Instant::now();
    last_run.wait_for_log("ingest ready", Duration::from_secs(30));
    while !inbox_ids(&inbox_stream).is_empty() {
        assert!(started.elapsed() < Duration::from_secs(60), "inbox did not drain");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, _, log) = last_run.terminate();
    assert_eq!(code, 0, "SIGTERM must stop the daemon cleanly:\n{log}");
    let (captured, waiting) = check(&producer, KILLS);
    assert_eq!(waiting, 0);
    assert_eq!(captured, producer.dropped.len(), "every dropped file is captured exactly once");
    assert!(producer.dropped.len() > KILLS * 10, "too few files ({}) to mean anything", producer.dropped.len());
}

#[test]
fn a_start_removes_the_temporary_files_a_crash_left_in_quarantine_and_keeps_everything_else() {
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = dir.path().join("spool");
    let config =
        SpoolConfig { dir: spool_dir.clone(), min_free_bytes: capstore::config::ByteSize(0), ..Default::default() };
    drop(Spool::open(&config).unwrap());
    let quarantine = spool_dir.join("quarantine");
    // What a crash leaves while a `.reason` file is written (`.<name>.<nonce>.tmp`), in quarantine's directories,
    // one of them an operator's; beside a quarantined pack with its reason, and an operator's files.
    let leftovers = [
        quarantine.join("packs").join(".1-a.sealed.reason.00000000000000aa.tmp"),
        quarantine.join("inbox").join(".2-b.reason.00000000000000bb.tmp"),
        quarantine.join("handled").join(".3-c.sealed.reason.00000000000000cc.tmp"),
    ];
    let kept = [
        quarantine.join("packs").join("1-a.sealed"),
        quarantine.join("packs").join("1-a.sealed.reason"),
        quarantine.join("packs").join("notes.tmp"),
        quarantine.join("handled").join("3-c.sealed"),
    ];
    for path in leftovers.iter().chain(&kept) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"bytes").unwrap();
    }
    let (_spool, report) = Spool::open(&config).unwrap();
    assert_eq!(report.temp_files_removed, 3, "{report:?}");
    for path in &leftovers {
        assert!(!path.exists(), "{} left", path.display());
    }
    for path in &kept {
        assert!(path.exists(), "{} removed", path.display());
    }
}
