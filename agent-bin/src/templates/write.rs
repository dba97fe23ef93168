//! Writing a rendered file at its destination: only when its bytes differ, atomically
//! (a temporary file in the destination's directory, renamed over it), never through a
//! link found at the destination, with the template's mode and the proxy's user as owner.
//!
//! These are the only files the agent writes outside its data dir, and only at the
//! destinations the operator configured.

use std::ffi::OsStr;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nix::unistd::{Gid, Uid};
use tether_state::config::DisplayPath;
use tether_state::persist::{self, Durability, LinkedComponent, PersistError, PrivateDir, UnsafeEntry};

/// Why a rendered file could not be put in place.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WriteError {
    /// A link, a directory, a special file or a file with other hard links is where the
    /// file goes: it is left as it is.
    #[error("{} is not a regular file of its own (a link, a directory or a device?): it is left as it is", DisplayPath(.path))]
    Unsafe { path: PathBuf, source: io::Error },
    /// A directory on the way to the file is a symbolic link: nothing is written through it.
    #[error("nothing is written through a link on the way to {}", DisplayPath(.path))]
    Linked { path: PathBuf, source: LinkedComponent },
    /// The file could not be read or written.
    #[error("cannot write {}", DisplayPath(.path))]
    Io { path: PathBuf, source: io::Error },
}

/// Who owns a rendered file: the proxy's user and group, when the agent runs as root.
pub(crate) type Owner = Option<(Uid, Gid)>;

/// What [`write_if_changed`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Written {
    /// The file held these bytes already: nothing was written.
    Unchanged,
    /// The file was replaced; `previous` is what it held (`None`: there was none), so that a
    /// refused reload can put it back.
    Replaced { previous: Option<Vec<u8>> },
}

/// Puts `bytes` at `destination` unless the file there holds them already.
///
/// The destination's directory is opened once, without following a link at any component
/// of its path, and the file is read, written and renamed relative to it: a directory
/// swapped for a link, anywhere on the way, fails the write instead of redirecting it.
///
/// Durability: a rendered file is derived from the catalog again at each start and each
/// change, so it needs only to survive an agent crash (a rename), not a power loss.
///
/// # Errors
///
/// [`WriteError::Unsafe`] when something other than a regular file of its own is at the
/// destination; [`WriteError::Linked`] when a directory on the way is a link;
/// [`WriteError::Io`] otherwise. The old file is then untouched.
pub(crate) fn write_if_changed(
    destination: &Path,
    bytes: &[u8],
    mode: u32,
    owner: Owner,
) -> Result<Written, WriteError> {
    let (dir, name) = open_directory(destination)?;
    write_in(&dir, name, destination, bytes, mode, owner)
}

fn write_in(
    dir: &PrivateDir,
    name: &OsStr,
    destination: &Path,
    bytes: &[u8],
    mode: u32,
    owner: Owner,
) -> Result<Written, WriteError> {
    let previous = match read_current(dir, name) {
        Ok(Some(current)) if current == bytes => return Ok(Written::Unchanged),
        Ok(current) => current,
        Err(Current::Unsafe(source)) => return Err(WriteError::Unsafe { path: destination.to_owned(), source }),
        Err(Current::Io(source)) => return Err(WriteError::Io { path: destination.to_owned(), source }),
    };
    dir.write_atomic_file(name, Durability::Crash, |file| {
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::fchown(&*file, Some(uid.as_raw()), Some(gid.as_raw()))?;
        }
        file.write_all(bytes)
    })
    .map_err(|err| WriteError::Io { path: destination.to_owned(), source: io::Error::other(err) })?;
    Ok(Written::Replaced { previous })
}

/// Puts `previous` back at `destination` if the file there still holds `written` (a refused
/// reload's file): `Ok(false)`, touching nothing, when a newer render replaced it meanwhile.
///
/// # Errors
///
/// As [`write_if_changed`].
pub(crate) fn put_back(
    destination: &Path,
    written: &[u8],
    previous: &[u8],
    mode: u32,
    owner: Owner,
) -> Result<bool, WriteError> {
    let (dir, name) = open_directory(destination)?;
    match read_current(&dir, name) {
        Ok(Some(current)) if current == written => {}
        Ok(_) => return Ok(false),
        Err(Current::Unsafe(source)) => return Err(WriteError::Unsafe { path: destination.to_owned(), source }),
        Err(Current::Io(source)) => return Err(WriteError::Io { path: destination.to_owned(), source }),
    }
    write_in(&dir, name, destination, previous, mode, owner).map(|_| true)
}

/// The directory of `destination`, reached without following a link, and the file's name.
fn open_directory(destination: &Path) -> Result<(PrivateDir, &OsStr), WriteError> {
    persist::open_parent_no_follow(destination).map_err(|source| {
        match source.get_ref().and_then(|inner| inner.downcast_ref::<LinkedComponent>()) {
            Some(linked) => WriteError::Linked { path: destination.to_owned(), source: linked.clone() },
            None => WriteError::Io { path: destination.to_owned(), source },
        }
    })
}

/// Why the file at a destination could not be compared.
enum Current {
    /// Something other than a regular file is there.
    Unsafe(io::Error),
    /// It could not be read.
    Io(io::Error),
}

/// The bytes of the regular file `name` of `dir`, `None` if there is none; a link there is
/// not followed. Its mode and owner are left as they are: the file is the operator's until
/// it is replaced.
fn read_current(dir: &PrivateDir, name: &OsStr) -> Result<Option<Vec<u8>>, Current> {
    match dir.read_as_found(name) {
        Ok(bytes) => Ok(bytes),
        Err(PersistError::Read { source, .. }) => {
            if source.get_ref().is_some_and(|inner| inner.is::<UnsafeEntry>()) {
                Err(Current::Unsafe(source))
            } else {
                Err(Current::Io(source))
            }
        }
        Err(other) => Err(Current::Io(io::Error::other(other))),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn a_file_is_written_with_its_mode_and_unchanged_bytes_are_not_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("haproxy.cfg");
        assert_eq!(write_if_changed(&path, b"one\n", 0o640, None).unwrap(), Written::Replaced { previous: None });
        assert_eq!(std::fs::read(&path).unwrap(), b"one\n");
        let first = std::fs::metadata(&path).unwrap();
        assert_eq!(first.mode() & 0o7777, 0o640);

        // The same bytes: nothing is written, the file keeps its inode and its mode.
        assert_eq!(write_if_changed(&path, b"one\n", 0o640, None).unwrap(), Written::Unchanged);
        let again = std::fs::metadata(&path).unwrap();
        assert_eq!((again.ino(), again.mode() & 0o7777), (first.ino(), 0o640));

        // New bytes: a new file renamed into place, nothing else left in the directory.
        assert_eq!(
            write_if_changed(&path, b"two\n", 0o600, None).unwrap(),
            Written::Replaced { previous: Some(b"one\n".to_vec()) }
        );
        let second = std::fs::metadata(&path).unwrap();
        assert_ne!(second.ino(), first.ino(), "replaced by a rename, not written in place");
        assert_eq!(second.mode() & 0o7777, 0o600);
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["haproxy.cfg"]);

        // A directory at the destination is left alone.
        let error = write_if_changed(dir.path(), b"x", 0o644, None).unwrap_err();
        assert!(matches!(error, WriteError::Unsafe { .. }), "{error:?}");
    }

    #[test]
    fn a_file_is_put_back_only_while_it_holds_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("haproxy.cfg");
        std::fs::write(&path, b"new\n").unwrap();
        assert!(put_back(&path, b"new\n", b"old\n", 0o644, None).unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), b"old\n");
        // A newer render replaced it meanwhile: it stands.
        std::fs::write(&path, b"newer\n").unwrap();
        assert!(!put_back(&path, b"new\n", b"old\n", 0o644, None).unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), b"newer\n");
    }

    #[test]
    fn a_link_at_the_destination_is_refused_and_its_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, "precious\n").unwrap();
        let link = dir.path().join("haproxy.cfg");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let error = write_if_changed(&link, b"rendered\n", 0o644, None).unwrap_err();
        assert!(matches!(error, WriteError::Unsafe { .. }), "{error:?}");
        assert!(error.to_string().contains("haproxy.cfg is not a regular file of its own"), "{error}");
        assert_eq!(std::fs::read(&target).unwrap(), b"precious\n");
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link stays");
    }

    #[test]
    fn the_owner_is_set_when_given() {
        if !nix::unistd::geteuid().is_root() {
            #[allow(clippy::print_stderr, reason = "a skipped test says why")]
            {
                eprintln!("skipped: needs root to give a file away");
            }
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("owned");
        let owner = Some((Uid::from_raw(65534), Gid::from_raw(65534)));
        assert_eq!(write_if_changed(&path, b"x", 0o644, owner).unwrap(), Written::Replaced { previous: None });
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (65534, 65534));
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_the_file() {
        let error = write_if_changed(Path::new("/nonexistent-tether-dir/x.cfg"), b"x", 0o644, None).unwrap_err();
        assert!(matches!(error, WriteError::Io { .. }));
        assert!(error.to_string().contains("/nonexistent-tether-dir/x.cfg"), "{error}");
    }

    #[test]
    fn a_directory_on_the_way_that_is_a_link_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::create_dir(&victim).unwrap();
        let linked = dir.path().join("pd");
        std::os::unix::fs::symlink(&victim, &linked).unwrap();
        let error = write_if_changed(&linked.join("sub").join("p.cfg"), b"x", 0o644, None).unwrap_err();
        assert!(matches!(&error, WriteError::Linked { source, .. } if source.path == linked), "{error:?}");
        let chain = crate::error::error_chain(&error);
        assert!(chain.contains(&format!("{} is a symbolic link", linked.display())), "{chain}");
        assert_eq!(std::fs::read_dir(&victim).unwrap().count(), 0, "nothing written through the link");
    }
}
