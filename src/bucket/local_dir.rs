//! Uploads to a `file://` bucket: a local directory, written here rather than through object_store's
//! `LocalFileSystem`, which never fsyncs. The spool deletes a pack once its index is published, so the bucket's copy
//! must be on disk before the upload reports success, or a power cut could lose acknowledged captures.
//!
//! # Protocol ([`place_pack`])
//!
//! 1. The key's directories are created; each one created is fsynced into its parent.
//! 2. On the spool's filesystem the sealed pack is hard-linked to the key: no byte is copied or written again. A
//!    sealed pack is already fsynced and is never modified (the spool only renames and deletes it), so the shared
//!    inode is as durable and as immutable as a copy. (So an operator must not edit a spool pack in place, quarantined
//!    ones included: a linked object would change with it. Copy it first.)
//! 3. Where a link is impossible (another filesystem: `EXDEV`; a filesystem without links: `EPERM`; `EMLINK`), the
//!    pack is copied in the kernel (`copy_file_range`) into a staged `<key>#<n>` file, fsynced, and linked to the
//!    key. object_store's listing skips `#<digits>` names, so a staged file left by a crash never shows as an object.
//! 4. link(2) never replaces an existing name: an object already at the key is [`Placed::AlreadyExists`], which the
//!    caller compares with the pack, as it does for `PutMode::Create` on every other backend.
//! 5. The key's directory is fsynced, so the new name survives a power cut.
//!
//! Reads, listing and deletes still go through `LocalFileSystem`, whose key -> path mapping
//! ([`LocalFileSystem::path_to_filesystem`]) this module uses too.

use std::fs::File;
use std::io::ErrorKind;
use std::path::{Path as FsPath, PathBuf};

use object_store::local::LocalFileSystem;
use object_store::path::Path;

use crate::durable::fsync_dir;

/// What [`place_pack`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    /// The pack's own file is now also the object (same filesystem).
    Linked,
    /// The pack was copied into a new file, fsynced and linked into place.
    Copied,
    /// Something already sits at the key; nothing was written.
    AlreadyExists,
}

/// Puts the sealed pack at `pack` under `key` in the directory bucket `store`, durably. See the module doc.
pub fn place_pack(store: &LocalFileSystem, key: &Path, pack: &FsPath) -> std::io::Result<Placed> {
    let target = store.path_to_filesystem(key).map_err(std::io::Error::other)?;
    let directory = target.parent().ok_or_else(|| std::io::Error::other(format!("key {key} has no directory")))?;
    create_dirs_durably(directory)?;
    let placed = match std::fs::hard_link(pack, &target) {
        Ok(()) => Placed::Linked,
        Err(error) if error.kind() == ErrorKind::AlreadyExists => return Ok(Placed::AlreadyExists),
        Err(error) if link_impossible(&error) => copy_into_place(pack, &target)?,
        Err(error) => return Err(error),
    };
    if placed != Placed::AlreadyExists {
        fsync_dir(directory)?;
    }
    Ok(placed)
}

/// The copy path of [`place_pack`], for a pack on another filesystem: staged copy, fsync, link, unlink the stage.
fn copy_into_place(pack: &FsPath, target: &FsPath) -> std::io::Result<Placed> {
    let mut source = File::open(pack)?;
    let (mut staged, staged_path) = create_staged(target)?;
    let linked = std::io::copy(&mut source, &mut staged)
        .and_then(|_| staged.sync_all())
        .and_then(|()| std::fs::hard_link(&staged_path, target));
    // The stage is removed whatever happened: on success the target holds the inode.
    let _ = std::fs::remove_file(&staged_path);
    match linked {
        Ok(()) => Ok(Placed::Copied),
        Err(error) if error.kind() == ErrorKind::AlreadyExists => Ok(Placed::AlreadyExists),
        Err(error) => Err(error),
    }
}

/// `EXDEV`, `EPERM` (a filesystem without hard links) or `EMLINK`: the copy path can still place the pack.
fn link_impossible(error: &std::io::Error) -> bool {
    error.kind() == ErrorKind::CrossesDevices
        || matches!(error.raw_os_error(), Some(code) if code == libc::EPERM || code == libc::EMLINK)
}

/// A new `<target>#<n>` file, the staging name object_store's listing skips.
fn create_staged(target: &FsPath) -> std::io::Result<(File, PathBuf)> {
    for suffix in 1u32.. {
        let mut staged_path = target.as_os_str().to_owned();
        staged_path.push(format!("#{suffix}"));
        let staged_path = PathBuf::from(staged_path);
        match crate::durable::new_file_options().write(true).create_new(true).open(&staged_path) {
            Ok(file) => return Ok((file, staged_path)),
            Err(error) if error.kind() == ErrorKind::AlreadyExists => continue,
            Err(error) => return Err(error),
        }
    }
    unreachable!("u32 staging suffixes exhausted")
}

/// `create_dir_all`, then an fsync of the parent of every directory it created, so each new entry is durable.
fn create_dirs_durably(directory: &FsPath) -> std::io::Result<()> {
    let mut missing = Vec::new();
    let mut current = directory;
    while !current.is_dir() {
        missing.push(current);
        current = current.parent().ok_or_else(|| std::io::Error::other("no existing ancestor directory"))?;
    }
    if missing.is_empty() {
        return Ok(());
    }
    crate::durable::create_dirs(directory)?;
    for created in missing {
        if let Some(parent) = created.parent() {
            fsync_dir(parent)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn store(root: &FsPath) -> LocalFileSystem {
        LocalFileSystem::new_with_prefix(root).unwrap()
    }

    #[test]
    fn on_one_filesystem_the_pack_itself_becomes_the_object() {
        let scratch = tempfile::tempdir().unwrap();
        let pack = scratch.path().join("pack.sealed");
        std::fs::write(&pack, b"sealed pack bytes").unwrap();
        let root = scratch.path().join("bucket");
        std::fs::create_dir(&root).unwrap();
        let key = Path::from("catalog/2026/11/30/pack.cpk");

        assert_eq!(place_pack(&store(&root), &key, &pack).unwrap(), Placed::Linked);
        let object = root.join("catalog/2026/11/30/pack.cpk");
        assert_eq!(std::fs::metadata(&object).unwrap().ino(), std::fs::metadata(&pack).unwrap().ino());
        // The spool deleting its pack leaves the object whole.
        std::fs::remove_file(&pack).unwrap();
        assert_eq!(std::fs::read(&object).unwrap(), b"sealed pack bytes");
    }

    #[test]
    fn an_existing_object_is_never_replaced() {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path().join("bucket");
        std::fs::create_dir_all(root.join("c")).unwrap();
        std::fs::write(root.join("c/pack.cpk"), b"first").unwrap();
        let pack = scratch.path().join("pack.sealed");
        std::fs::write(&pack, b"second").unwrap();
        let key = Path::from("c/pack.cpk");

        assert_eq!(place_pack(&store(&root), &key, &pack).unwrap(), Placed::AlreadyExists);
        assert_eq!(copy_into_place(&pack, &root.join("c/pack.cpk")).unwrap(), Placed::AlreadyExists);
        assert_eq!(std::fs::read(root.join("c/pack.cpk")).unwrap(), b"first");
        let names: Vec<_> =
            std::fs::read_dir(root.join("c")).unwrap().map(|entry| entry.unwrap().file_name()).collect();
        assert_eq!(names, vec!["pack.cpk"], "the staged copy was not removed");
    }

    #[test]
    fn the_copy_path_writes_a_separate_file_and_leaves_no_stage() {
        let scratch = tempfile::tempdir().unwrap();
        let pack = scratch.path().join("pack.sealed");
        let bytes: Vec<u8> = (0..3 * 1024 * 1024u32).map(|index| (index % 251) as u8).collect();
        std::fs::write(&pack, &bytes).unwrap();
        let target = scratch.path().join("object.cpk");
        // A stale stage from a crashed attempt is skipped over, not reused.
        std::fs::write(scratch.path().join("object.cpk#1"), b"stale").unwrap();

        assert_eq!(copy_into_place(&pack, &target).unwrap(), Placed::Copied);
        assert_ne!(std::fs::metadata(&target).unwrap().ino(), std::fs::metadata(&pack).unwrap().ino());
        assert!(std::fs::read(&target).unwrap() == bytes);
        assert!(!scratch.path().join("object.cpk#2").exists());
    }

    #[test]
    fn across_filesystems_the_pack_is_copied() {
        // /dev/shm is a tmpfs on every Linux this runs on: another filesystem than the temp dir's.
        let shm = FsPath::new("/dev/shm");
        let scratch = tempfile::tempdir().unwrap();
        let bucket_root =
            tempfile::tempdir_in(shm).expect("/dev/shm (a tmpfs) is needed for the cross-filesystem case");
        assert_ne!(
            std::fs::metadata(scratch.path()).unwrap().dev(),
            std::fs::metadata(bucket_root.path()).unwrap().dev(),
            "the temp dir must not be on /dev/shm for this test: set TMPDIR to a disk directory"
        );
        let pack = scratch.path().join("pack.sealed");
        std::fs::write(&pack, b"across filesystems").unwrap();
        let key = Path::from("c/2026/pack.cpk");

        assert_eq!(place_pack(&store(bucket_root.path()), &key, &pack).unwrap(), Placed::Copied);
        assert_eq!(std::fs::read(bucket_root.path().join("c/2026/pack.cpk")).unwrap(), b"across filesystems");
    }
}
