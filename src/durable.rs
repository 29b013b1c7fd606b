//! Crash-safe file operations. Every spool state change goes through these: a new file is written under a temporary
//! name, fsynced and renamed into place; a rename is followed by an fsync of the directory, so after a crash the file
//! is either wholly in its old state or wholly in its new one.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Suffix of temporary files; recovery removes any left behind by a crash.
pub const TEMP_SUFFIX: &str = ".tmp";

/// Mode of every file capstore creates: its owner reads and writes, its group (say, a readers' group) reads, others
/// get nothing: captures are not world-readable.
pub const FILE_MODE: u32 = 0o640;
/// Mode of every directory capstore creates.
pub const DIR_MODE: u32 = 0o750;
/// Mode of the inbox: producers of the spool's group drop files there.
pub const INBOX_DIR_MODE: u32 = 0o770;

/// Options for a new file with [`FILE_MODE`] (the process umask may take more away).
pub fn new_file_options() -> OpenOptions {
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = OpenOptions::new();
    options.mode(FILE_MODE);
    options
}

/// `create_dir_all` with [`DIR_MODE`] for every directory it creates.
pub fn create_dirs(path: &Path) -> io::Result<()> {
    create_dirs_with_mode(path, DIR_MODE)
}

/// `create_dir_all` with `mode` for every directory it creates.
pub fn create_dirs_with_mode(path: &Path, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new().recursive(true).mode(mode).create(path)
}

/// Make a directory entry change (create, rename, unlink) durable.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Make the directory entry of `path` (just created or renamed) durable: fsync its parent directory.
pub fn fsync_parent_dir(path: &Path) -> io::Result<()> {
    fsync_dir(&parent_of(path))
}

/// Rename and fsync the destination directory (and the source directory when it differs).
pub fn rename_durable(from: &Path, to: &Path) -> io::Result<()> {
    #[allow(clippy::disallowed_methods, reason = "this is the durable rename: the fsyncs follow")]
    fs::rename(from, to)?;
    let to_dir = parent_of(to);
    fsync_dir(&to_dir)?;
    let from_dir = parent_of(from);
    if from_dir != to_dir {
        fsync_dir(&from_dir)?;
    }
    Ok(())
}

/// Write `contents` to `path` atomically: temp file, fsync, rename, fsync the directory.
pub fn write_file_durable(path: &Path, contents: &[u8]) -> io::Result<()> {
    let temp = temp_path_for(path);
    let mut file = new_file_options().write(true).create(true).truncate(true).open(&temp)?;
    file.write_all(contents)?;
    file.sync_all()?;
    drop(file);
    rename_durable(&temp, path)
}

/// Remove a file and fsync its directory; a file already gone is not an error (every step must be idempotent).
pub fn remove_durable(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Ok(()) => fsync_dir(&parent_of(path)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// `dir/.name.<random>.tmp`: hidden and suffixed, so neither the inbox watcher nor recovery mistakes it for data.
pub fn temp_path_for(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let nonce: u64 = rand::random();
    parent_of(path).join(format!(".{name}.{nonce:016x}{TEMP_SUFFIX}"))
}

fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Names of filesystems on which flock is not trustworthy across hosts, by statfs magic number.
pub fn shared_filesystem_name(path: &Path) -> io::Result<Option<&'static str>> {
    let stat = nix::sys::statfs::statfs(path).map_err(io::Error::from)?;
    // The magic numbers are from linux/magic.h; the type's width differs between targets, so compare as u64.
    let magic = stat.filesystem_type().0 as u64;
    let name = match magic {
        0x6969 => "nfs",
        0x517b => "smb",
        0xff53_4d42 => "cifs",
        0xfe53_4d42 => "smb2",
        0x6573_5546 => "fuse",
        0x00c3_6400 => "ceph",
        0x0102_1997 => "9p",
        0x5346_414f => "afs",
        0x0116_1970 => "gfs2",
        0x7461_636f => "ocfs2",
        0x0bd0_0bd0 => "lustre",
        _ => return Ok(None),
    };
    Ok(Some(name))
}

/// Bytes available to unprivileged users on the filesystem holding `path`.
pub fn free_bytes(path: &Path) -> io::Result<u64> {
    let stat = nix::sys::statvfs::statvfs(path).map_err(io::Error::from)?;
    Ok(stat.blocks_available() as u64 * stat.fragment_size() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_file_durable_replaces_contents_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        write_file_durable(&path, b"one").unwrap();
        write_file_durable(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state")]);
    }

    #[test]
    fn remove_durable_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        fs::write(&path, b"x").unwrap();
        remove_durable(&path).unwrap();
        remove_durable(&path).unwrap();
        assert!(!path.exists());
    }

    #[test]
    fn a_local_filesystem_is_not_shared() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(shared_filesystem_name(dir.path()).unwrap(), None);
        assert!(free_bytes(dir.path()).unwrap() > 0);
    }
}
