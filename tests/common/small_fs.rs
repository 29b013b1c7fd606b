//! A small filesystem of its own (a tmpfs mounted for one test), for disk-full faults: [`SmallFilesystem::fill`] takes
//! every free byte, so the next write that needs space fails with a real ENOSPC, and dropping the [`Filler`] gives
//! the space back. Mounting needs root (or CAP_SYS_ADMIN), as these machines have; the mount goes with the value.

use std::fs::File;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

pub struct SmallFilesystem {
    dir: tempfile::TempDir,
}

/// The file that holds a [`SmallFilesystem`]'s free space while it lives.
pub struct Filler {
    path: PathBuf,
    pub bytes: u64,
}

impl SmallFilesystem {
    /// A fresh tmpfs of `mib` MiB.
    pub fn mount(mib: u64) -> SmallFilesystem {
        let dir = tempfile::tempdir().unwrap();
        let outcome = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m,mode=0755"), "tmpfs"])
            .arg(dir.path())
            .output();
        match outcome {
            Ok(output) if output.status.success() => SmallFilesystem { dir },
            other => panic!(
                "mounting a {mib} MiB tmpfs at {} failed ({other:?}): disk-full tests mount a small filesystem of \
                 their own and need root or CAP_SYS_ADMIN (run the tests as root, or with `sudo -E cargo test`)",
                dir.path().display()
            ),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Writes a file until the filesystem refuses with ENOSPC: nothing that needs another block can be written
    /// while the returned filler lives.
    pub fn fill(&self) -> Filler {
        let path = self.path().join("filler");
        let mut file = File::create(&path).unwrap();
        let mut bytes = 0u64;
        for chunk in [1 << 20, 4096, 1] {
            let block = vec![0xAAu8; chunk];
            loop {
                #[allow(clippy::disallowed_methods, reason = "a short write is counted, and the loop writes on")]
                match file.write(&block) {
                    Ok(written) => bytes += written as u64,
                    Err(error) if error.raw_os_error() == Some(nix::libc::ENOSPC) => break,
                    Err(error) if error.kind() == ErrorKind::Interrupted => continue,
                    Err(error) => panic!("filling {}: {error}", path.display()),
                }
            }
        }
        Filler { path, bytes }
    }
}

impl Filler {
    /// Gives the space back.
    pub fn remove(self) {}
}

impl Drop for Filler {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for SmallFilesystem {
    fn drop(&mut self) {
        // Lazy: a daemon of a failed test may still hold files in it.
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}
