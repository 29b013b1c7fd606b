//! The spool owner lock: `<spool>/LOCK`, held with `flock(LOCK_EX | LOCK_NB)` for the whole life of the process.
//!
//! States: unlocked (no process owns the spool) or owned (one process holds the flock; the file names it as
//! `pid host started_at`). The kernel drops the flock when the owner dies, however it dies, so a SIGKILLed owner never
//! leaves a stale lock behind. That is also what makes same-spool lease takeover safe: a process holding this lock
//! knows every earlier process of the same spool is dead.
//!
//! The holder text is informational only (it is written after the flock is taken); the flock alone decides ownership.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

pub const LOCK_FILE: &str = "LOCK";

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("spool {dir} is owned by another process: pid {pid} on host {host} (started {started_at})")]
    Held { dir: PathBuf, pid: String, host: String, started_at: String },
    #[error("cannot lock spool {dir}: {source}")]
    Io { dir: PathBuf, source: io::Error },
}

/// Holding this value means owning the spool; dropping it (or dying) releases the flock.
#[derive(Debug)]
pub struct SpoolLock {
    _flock: Flock<File>,
}

impl SpoolLock {
    pub fn acquire(spool_dir: &Path) -> Result<SpoolLock, LockError> {
        let io_error = |source| LockError::Io { dir: spool_dir.to_path_buf(), source };
        let path = spool_dir.join(LOCK_FILE);
        let file = crate::durable::new_file_options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_error)?;
        let mut flock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(flock) => flock,
            Err((mut file, errno)) if errno == nix::errno::Errno::EWOULDBLOCK => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let mut fields = holder.split_whitespace();
                let mut next = || fields.next().unwrap_or("unknown").to_string();
                return Err(LockError::Held {
                    dir: spool_dir.to_path_buf(),
                    pid: next(),
                    host: next(),
                    started_at: next(),
                });
            }
            Err((_, errno)) => return Err(io_error(io::Error::from(errno))),
        };
        let holder = format!("{} {} {}\n", std::process::id(), crate::util::host_name(), crate::util::now_rfc3339());
        flock.set_len(0).map_err(io_error)?;
        flock.seek(SeekFrom::Start(0)).map_err(io_error)?;
        flock.write_all(holder.as_bytes()).map_err(io_error)?;
        flock.sync_all().map_err(io_error)?;
        Ok(SpoolLock { _flock: flock })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_spool_fails_naming_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let _held = SpoolLock::acquire(dir.path()).unwrap();
        let error = SpoolLock::acquire(dir.path()).unwrap_err();
        let text = error.to_string();
        assert!(text.contains(&format!("pid {}", std::process::id())), "{text}");
        assert!(text.contains(&crate::util::host_name()), "{text}");
    }

    #[test]
    fn the_lock_is_released_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        drop(SpoolLock::acquire(dir.path()).unwrap());
        SpoolLock::acquire(dir.path()).unwrap();
    }
}
