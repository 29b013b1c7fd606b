//! The inbox as a directory descriptor: every file under it is listed, opened, checked and unlinked relative to that
//! descriptor, and no symbolic link is ever followed. Nothing outside the inbox is read or deleted because of what a
//! producer put into it.
//!
//! - Opening a path under the inbox uses `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` where the kernel has it
//!   (Linux 5.6), else one `openat(O_NOFOLLOW)` per component from the inbox descriptor down: a symlink anywhere on
//!   the way fails with `ELOOP` (or `ENOTDIR`), it is not followed.
//! - Files are opened `O_NONBLOCK`, so a FIFO or a device renamed into the inbox never blocks a reader; only regular
//!   files are read, and only when `fstat` of the opened descriptor shows the device and inode that the listing saw.
//! - A listing reports what each entry is without following it (`d_type`, or `fstatat(AT_SYMLINK_NOFOLLOW)`):
//!   directories are walked, regular files returned, anything else (symlink, FIFO, socket, device) is returned as
//!   [`EntryKind::Special`] for the caller to skip.
//! - Unlink is `unlinkat` in the file's own directory, opened beneath the inbox, after checking that the name still
//!   names the inode that was read.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::dir::{Dir, Type};
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{FileStat, Mode, SFlag};
use nix::unistd::UnlinkatFlags;

/// Where `openat2` turned out to be missing (ENOSYS), so the per-component fallback is used from then on.
static OPENAT2_MISSING: AtomicBool = AtomicBool::new(false);

/// What a listed entry is, seen without following it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    Directory,
    File,
    /// A symlink, FIFO, socket or device: never opened.
    Special,
}

/// Identity of a regular file as listed: the open descriptor must show the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    pub dev: u64,
    pub ino: u64,
    pub len: u64,
    pub mtime_ns: i128,
}

/// Device and inode of a stat result (their C types' widths differ between targets, hence the casts).
#[allow(clippy::unnecessary_cast)]
fn dev_ino(stat: &FileStat) -> (u64, u64) {
    (stat.st_dev as u64, stat.st_ino as u64)
}

impl FileIdentity {
    fn of(stat: &FileStat) -> FileIdentity {
        let (dev, ino) = dev_ino(stat);
        FileIdentity {
            dev,
            ino,
            len: stat.st_size.max(0) as u64,
            mtime_ns: stat.st_mtime as i128 * 1_000_000_000 + stat.st_mtime_nsec as i128,
        }
    }
}

/// One entry of a directory listing: its name, its path relative to the inbox, and what it is.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: OsString,
    pub relative: PathBuf,
    pub kind: EntryKind,
}

/// Why a file could not be read as listed.
#[derive(Debug)]
pub enum ReadRefusal {
    /// Gone since the listing (ingested by another batch, or removed by the producer).
    Gone,
    /// Not a regular file, or a symlink somewhere on its path.
    NotRegular,
    /// A different file (other inode), or one still being written (its size differs): look again later.
    Changed,
    Io(io::Error),
}

/// The inbox directory, opened once.
#[derive(Debug)]
pub struct InboxRoot {
    dir: OwnedFd,
    path: PathBuf,
}

impl InboxRoot {
    pub fn open(path: &Path) -> io::Result<InboxRoot> {
        let dir = nix::fcntl::open(path, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(io::Error::from)?;
        Ok(InboxRoot { dir, path: path.to_path_buf() })
    }

    /// The inbox's own path (for messages and for mapping watcher events to relative paths).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `absolute` relative to the inbox, if it lies under it and names no `..` or root.
    pub fn relative_of(&self, absolute: &Path) -> Option<PathBuf> {
        let relative = absolute.strip_prefix(&self.path).ok()?;
        is_plain_relative(relative).then(|| relative.to_path_buf())
    }

    /// Open `relative` beneath the inbox without following any symlink.
    fn open_beneath(&self, relative: &Path, flags: OFlag) -> io::Result<OwnedFd> {
        if !is_plain_relative(relative) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a plain path under the inbox"));
        }
        let flags = flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        if relative.as_os_str().is_empty() {
            return nix::fcntl::openat(self.dir.as_fd(), ".", flags, Mode::empty()).map_err(io::Error::from);
        }
        if !OPENAT2_MISSING.load(Ordering::Relaxed) {
            use nix::fcntl::{OpenHow, ResolveFlag};
            let how =
                OpenHow::new().flags(flags).resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
            match nix::fcntl::openat2(self.dir.as_fd(), relative, how) {
                Err(Errno::ENOSYS) => OPENAT2_MISSING.store(true, Ordering::Relaxed),
                opened => return opened.map_err(io::Error::from),
            }
        }
        self.open_by_components(relative, flags)
    }

    /// The fallback of [`InboxRoot::open_beneath`]: one `openat(O_NOFOLLOW)` per component.
    fn open_by_components(&self, relative: &Path, flags: OFlag) -> io::Result<OwnedFd> {
        let components: Vec<&OsStr> = relative.iter().collect();
        let (last, parents) = components.split_last().expect("a non-empty relative path");
        let mut current: Option<OwnedFd> = None;
        for parent in parents {
            let base = current.as_ref().map_or(self.dir.as_fd(), |fd| fd.as_fd());
            let next = nix::fcntl::openat(
                base,
                *parent,
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(io::Error::from)?;
            current = Some(next);
        }
        let base = current.as_ref().map_or(self.dir.as_fd(), |fd| fd.as_fd());
        nix::fcntl::openat(base, *last, flags, Mode::empty()).map_err(io::Error::from)
    }

    /// Lists the directory `relative` (empty: the inbox itself). A symlink in place of the directory is an error
    /// (`ELOOP`/`ENOTDIR`), never followed. Hidden and temporary names are the caller's to skip.
    pub fn list(&self, relative: &Path) -> io::Result<Vec<Entry>> {
        let fd = self.open_beneath(relative, OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
        let mut dir = Dir::from_fd(fd).map_err(io::Error::from)?;
        let dir_fd = nix::unistd::dup(dir.as_fd()).map_err(io::Error::from)?;
        let mut entries = Vec::new();
        for entry in dir.iter() {
            let entry = entry.map_err(io::Error::from)?;
            let name_bytes = entry.file_name().to_bytes();
            if name_bytes == b"." || name_bytes == b".." {
                continue;
            }
            let name = OsStr::from_bytes(name_bytes).to_os_string();
            let kind = match entry.file_type() {
                Some(Type::Directory) => EntryKind::Directory,
                Some(Type::File) => EntryKind::File,
                Some(_) => EntryKind::Special,
                // The filesystem does not fill d_type: ask without following.
                None => match nix::sys::stat::fstatat(&dir_fd, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                    Ok(stat) => kind_of(&stat),
                    Err(Errno::ENOENT) => continue,
                    Err(errno) => return Err(io::Error::from(errno)),
                },
            };
            entries.push(Entry { relative: relative.join(&name), name, kind });
        }
        Ok(entries)
    }

    /// What `relative` is and, for a regular file, its identity, without following a symlink (the last component
    /// included). `Ok(None)`: gone.
    pub fn stat(&self, relative: &Path) -> io::Result<Option<(EntryKind, FileIdentity)>> {
        let (parent, name) = split(relative)?;
        let parent_fd = match self.open_beneath(parent, OFlag::O_RDONLY | OFlag::O_DIRECTORY) {
            Ok(fd) => fd,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(error),
        };
        match nix::sys::stat::fstatat(&parent_fd, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(stat) => Ok(Some((kind_of(&stat), FileIdentity::of(&stat)))),
            Err(Errno::ENOENT) => Ok(None),
            Err(errno) => Err(io::Error::from(errno)),
        }
    }

    /// Reads the regular file `relative`, checking that it is the file `listed` (same device, inode and size) and
    /// reading at most `listed.len + 1` bytes, so a file that grows is noticed without reading it whole.
    pub fn read(&self, relative: &Path, listed: &FileIdentity) -> Result<Vec<u8>, ReadRefusal> {
        let fd = match self.open_beneath(relative, OFlag::O_RDONLY | OFlag::O_NONBLOCK) {
            Ok(fd) => fd,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Err(ReadRefusal::Gone),
            Err(error) if is_symlink_refusal(&error) => return Err(ReadRefusal::NotRegular),
            Err(error) => return Err(ReadRefusal::Io(error)),
        };
        let stat = nix::sys::stat::fstat(&fd).map_err(|errno| ReadRefusal::Io(errno.into()))?;
        if kind_of(&stat) != EntryKind::File {
            return Err(ReadRefusal::NotRegular);
        }
        let opened = FileIdentity::of(&stat);
        if (opened.dev, opened.ino, opened.len) != (listed.dev, listed.ino, listed.len) {
            return Err(ReadRefusal::Changed);
        }
        let mut contents = Vec::with_capacity(listed.len as usize);
        File::from(fd).take(listed.len + 1).read_to_end(&mut contents).map_err(ReadRefusal::Io)?;
        if contents.len() as u64 != listed.len {
            // Still being written in place (the producer did not rename in); the next event or rescan sees it whole.
            return Err(ReadRefusal::Changed);
        }
        Ok(contents)
    }

    /// Unlinks `relative` in its own directory if it is still the file `read` (same device and inode). `Ok(false)`:
    /// it was gone or replaced, and nothing was removed.
    pub fn unlink(&self, relative: &Path, read: &FileIdentity) -> io::Result<bool> {
        let (parent, name) = split(relative)?;
        let parent_fd = match self.open_beneath(parent, OFlag::O_RDONLY | OFlag::O_DIRECTORY) {
            Ok(fd) => fd,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(error) => return Err(error),
        };
        match nix::sys::stat::fstatat(&parent_fd, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(stat) if dev_ino(&stat) == (read.dev, read.ino) => {}
            Ok(_) | Err(Errno::ENOENT) => return Ok(false),
            Err(errno) => return Err(errno.into()),
        }
        match nix::unistd::unlinkat(&parent_fd, name, UnlinkatFlags::NoRemoveDir) {
            Ok(()) => Ok(true),
            Err(Errno::ENOENT) => Ok(false),
            Err(errno) => Err(errno.into()),
        }
    }

    /// Moves `relative` (if it is still the file `listed`) to `target`, a path in a directory the spool owns (the
    /// quarantine), with `renameat` from the file's own directory, and fsyncs both directories.
    pub fn move_out(&self, relative: &Path, listed: &FileIdentity, target: &Path) -> io::Result<()> {
        let (parent, name) = split(relative)?;
        let parent_fd = self.open_beneath(parent, OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
        let stat = nix::sys::stat::fstatat(&parent_fd, name, AtFlags::AT_SYMLINK_NOFOLLOW)?;
        if dev_ino(&stat) != (listed.dev, listed.ino) {
            return Err(io::Error::other("the file was replaced since it was listed"));
        }
        let (target_dir, target_name) = match (target.parent(), target.file_name()) {
            (Some(dir), Some(name)) => (dir, name),
            _ => return Err(io::Error::new(io::ErrorKind::InvalidInput, "no target file name")),
        };
        let target_dir_fd =
            nix::fcntl::open(target_dir, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())?;
        nix::fcntl::renameat(&parent_fd, name, &target_dir_fd, target_name)?;
        nix::unistd::fsync(&target_dir_fd)?;
        nix::unistd::fsync(&parent_fd)?;
        Ok(())
    }

    /// fsync the directory `relative` (empty: the inbox), opened beneath the inbox: makes its unlinks durable.
    pub fn sync_dir(&self, relative: &Path) -> io::Result<()> {
        let fd = self.open_beneath(relative, OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
        nix::unistd::fsync(&fd).map_err(io::Error::from)
    }

    /// Every regular file under `relative` (depth first, sorted), at most `limit`, and the directories that could not
    /// be listed with their errors (the caller warns once per directory and moves on). Symlinks are never followed;
    /// special files are returned as well, for the caller to skip with a warning.
    pub fn walk(&self, relative: &Path, limit: usize, skip_name: impl Fn(&OsStr) -> bool) -> Walk {
        let mut walk = Walk::default();
        let mut dirs = vec![relative.to_path_buf()];
        'walk: while let Some(dir) = dirs.pop() {
            let entries = match self.list(&dir) {
                Ok(entries) => entries,
                Err(error) if error.kind() == io::ErrorKind::NotFound => continue,
                Err(error) => {
                    walk.unreadable.push((dir, error));
                    continue;
                }
            };
            for entry in entries {
                if skip_name(&entry.name) {
                    continue;
                }
                match entry.kind {
                    EntryKind::Directory => dirs.push(entry.relative),
                    EntryKind::File => {
                        walk.files.push(entry.relative);
                        if walk.files.len() >= limit {
                            walk.truncated = true;
                            break 'walk;
                        }
                    }
                    EntryKind::Special => walk.special.push(entry.relative),
                }
            }
        }
        walk.files.sort();
        walk
    }
}

/// What [`InboxRoot::walk`] found.
#[derive(Debug, Default)]
pub struct Walk {
    pub files: Vec<PathBuf>,
    /// Symlinks, FIFOs, sockets, devices: never opened.
    pub special: Vec<PathBuf>,
    /// Directories that could not be listed, with why.
    pub unreadable: Vec<(PathBuf, io::Error)>,
    /// The walk stopped at the limit: there may be more files.
    pub truncated: bool,
}

fn kind_of(stat: &FileStat) -> EntryKind {
    match SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT {
        SFlag::S_IFDIR => EntryKind::Directory,
        SFlag::S_IFREG => EntryKind::File,
        _ => EntryKind::Special,
    }
}

/// A relative path of plain names only: no root, no `.` or `..`.
fn is_plain_relative(path: &Path) -> bool {
    path.components().all(|component| matches!(component, Component::Normal(_)))
}

fn split(relative: &Path) -> io::Result<(&Path, &OsStr)> {
    match (relative.parent(), relative.file_name()) {
        (Some(parent), Some(name)) => Ok((parent, name)),
        _ => Err(io::Error::new(io::ErrorKind::InvalidInput, "no file name under the inbox")),
    }
}

/// The errors a symlink on the path gives under `O_NOFOLLOW` / `RESOLVE_NO_SYMLINKS`.
fn is_symlink_refusal(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(code) if code == libc::ELOOP || code == libc::ENOTDIR || code == libc::EXDEV)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn inbox() -> (tempfile::TempDir, InboxRoot) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("inbox/s")).unwrap();
        let root = InboxRoot::open(&dir.path().join("inbox")).unwrap();
        (dir, root)
    }

    #[test]
    fn a_symlinked_directory_is_neither_walked_nor_read_and_its_files_survive() {
        let (dir, root) = inbox();
        let outside = dir.path().join("secrets");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("token"), b"secret").unwrap();
        symlink(&outside, root.path().join("s/linked")).unwrap();
        symlink(outside.join("token"), root.path().join("s/file-link")).unwrap();
        std::fs::write(root.path().join("s/real"), b"real").unwrap();

        let walk = root.walk(Path::new(""), usize::MAX, |_| false);
        assert_eq!(walk.files, vec![PathBuf::from("s/real")]);
        assert_eq!(walk.special.len(), 2, "both symlinks are reported, neither followed: {walk:?}");

        let (kind, identity) = root.stat(Path::new("s/file-link")).unwrap().unwrap();
        assert_eq!(kind, EntryKind::Special);
        assert!(matches!(root.read(Path::new("s/file-link"), &identity), Err(ReadRefusal::NotRegular)));
        // Through the linked directory: the path has a symlink on the way.
        let (_, outside_identity) = InboxRoot::open(&outside).unwrap().stat(Path::new("token")).unwrap().unwrap();
        assert!(matches!(root.read(Path::new("s/linked/token"), &outside_identity), Err(ReadRefusal::NotRegular)));
        assert!(root.unlink(Path::new("s/linked/token"), &outside_identity).is_err());
        assert_eq!(std::fs::read(outside.join("token")).unwrap(), b"secret", "nothing outside was touched");
    }

    #[test]
    fn a_fifo_is_reported_special_and_never_blocks_a_read() {
        let (_dir, root) = inbox();
        nix::unistd::mkfifo(&root.path().join("s/pipe"), Mode::from_bits_truncate(0o600)).unwrap();
        let walk = root.walk(Path::new(""), usize::MAX, |_| false);
        assert_eq!(walk.special, vec![PathBuf::from("s/pipe")]);
        let (kind, identity) = root.stat(Path::new("s/pipe")).unwrap().unwrap();
        assert_eq!(kind, EntryKind::Special);
        // O_NONBLOCK: returns at once even though no writer has the FIFO open.
        assert!(matches!(root.read(Path::new("s/pipe"), &identity), Err(ReadRefusal::NotRegular)));
    }

    #[test]
    fn a_file_is_read_only_as_listed_and_unlinked_only_if_unchanged() {
        let (_dir, root) = inbox();
        let path = root.path().join("s/f");
        std::fs::write(&path, b"hello").unwrap();
        let (_, listed) = root.stat(Path::new("s/f")).unwrap().unwrap();
        assert_eq!(root.read(Path::new("s/f"), &listed).unwrap(), b"hello");
        // Grown since the listing: refused, not read whole.
        std::fs::write(&path, b"hello, world").unwrap();
        assert!(matches!(root.read(Path::new("s/f"), &listed), Err(ReadRefusal::Changed)));
        // Replaced by another file under the same name (created first, so it cannot reuse the inode): not unlinked.
        std::fs::write(root.path().join("s/.other"), b"other").unwrap();
        #[allow(clippy::disallowed_methods, reason = "the test plays a producer renaming into the inbox")]
        std::fs::rename(root.path().join("s/.other"), &path).unwrap();
        assert!(!root.unlink(Path::new("s/f"), &listed).unwrap());
        assert!(path.exists());
        let (_, current) = root.stat(Path::new("s/f")).unwrap().unwrap();
        assert!(root.unlink(Path::new("s/f"), &current).unwrap());
        assert!(!path.exists());
        assert!(matches!(root.read(Path::new("s/f"), &current), Err(ReadRefusal::Gone)));
    }

    #[test]
    fn paths_that_leave_the_inbox_are_refused() {
        let (_dir, root) = inbox();
        assert!(root.list(Path::new("../")).is_err());
        assert_eq!(root.relative_of(&root.path().join("s/x")), Some(PathBuf::from("s/x")));
        assert_eq!(root.relative_of(Path::new("/etc/passwd")), None);
        assert_eq!(root.relative_of(&root.path().join("s/../../x")), None);
    }

    #[test]
    fn the_per_component_fallback_refuses_symlinks_too() {
        let (dir, root) = inbox();
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("f"), b"x").unwrap();
        symlink(&outside, root.path().join("s/l")).unwrap();
        let error = root.open_by_components(Path::new("s/l/f"), OFlag::O_RDONLY | OFlag::O_NOFOLLOW).unwrap_err();
        assert!(is_symlink_refusal(&error), "{error}");
        std::fs::write(root.path().join("s/ok"), b"x").unwrap();
        root.open_by_components(Path::new("s/ok"), OFlag::O_RDONLY | OFlag::O_NOFOLLOW).unwrap();
    }
}
