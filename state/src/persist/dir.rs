//! [`PrivateDir`]: a directory of the data dir, opened once, and the files in it, always
//! reached relative to that descriptor without following symbolic links.
//!
//! The data dir is hostile ground: anything may have been planted in it.
//! This module owns the rules for what is found inside it. A symbolic link, a file with
//! other hard links or a special file where tether expects its own file is reported and
//! replaced (or refused, when reading), never followed or written through, and whatever it
//! points to is never touched. Modes looser than 0700 (directories) and 0600 (files) are
//! tightened. Only the data dir's root is opened by path, following links: the operator
//! chose that path. Nothing below it is ever resolved by path again.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, FcntlArg, OFlag, fcntl, openat, readlinkat, renameat};
use nix::sys::stat::{FileStat, Mode, SFlag, fchmod, fstat, fstatat, mkdirat};
use nix::unistd::{UnlinkatFlags, fsync, unlinkat};

use super::{DIR_MODE, FILE_MODE, PersistError};
use crate::config::DisplayPath;

/// How often an open retries when the entry changes under it (a link replaced, a file
/// created or removed by someone else) before it gives up.
const ATTEMPTS: usize = 8;

/// How much a replaced file must survive. Durability has classes: what nothing else can
/// rebuild must survive a power loss; what describes processes that die with the machine
/// needs only to survive a crash of the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// A power loss: the file is fsynced before the rename, the directory after it.
    /// Registrations and tokens, which nothing else can rebuild.
    PowerLoss,
    /// An agent crash: the rename alone makes the write atomic, nothing is fsynced. Files
    /// that describe processes which die with the machine (pid files), and rotated logs.
    Crash,
}

/// Why an entry of a [`PrivateDir`] was not used as it was found.
///
/// It is the source (inside an [`io::Error`]) of the error of an operation that refused
/// the entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UnsafeEntry {
    /// A symbolic link: tether never follows one inside the data dir.
    #[error("a symbolic link, which tether does not follow")]
    SymbolicLink,
    /// A file with other hard links: a write would change the other names too.
    #[error("a file with other hard links")]
    HardLink,
    /// A directory, FIFO, socket or device where a regular file belongs.
    #[error("not a regular file")]
    NotRegular,
    /// Something other than a directory where a directory belongs.
    #[error("not a directory")]
    NotDirectory,
}

/// A directory of the data dir, opened once without following links; cheap to clone.
///
/// Every operation takes a plain file name (no `/`, not `.` or `..`) and works relative to
/// the descriptor: renaming or replacing the directory's path later does not redirect it.
/// Files it creates are mode 0600. A subdirectory that is removed while open (an
/// operator's `rm -r`) is made again through its parent's handle when a file is next
/// created in it, so that the removal does not stop every later write.
#[derive(Clone)]
pub struct PrivateDir {
    inner: Arc<Inner>,
}

struct Inner {
    /// The directory as opened; replaced only when it was removed and made again.
    opened: RwLock<Arc<Opened>>,
    /// Where the directory was when it was opened: for messages only.
    path: PathBuf,
    /// The handle of its parent and its name there, to make it again; `None` for a root.
    parent: Option<(PrivateDir, OsString)>,
}

struct Opened {
    fd: OwnedFd,
    /// Device and inode: which directory this is.
    id: (nix::libc::dev_t, nix::libc::ino_t),
}

impl AsFd for Opened {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl fmt::Debug for PrivateDir {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PrivateDir").field(&self.inner.path).finish()
    }
}

/// Two handles are equal when they hold the same directory.
impl PartialEq for PrivateDir {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner) || self.fd().id == other.fd().id
    }
}

impl Eq for PrivateDir {}

/// What [`PrivateDir::open_existing`] found at a name.
enum Existing {
    Missing,
    Found(OwnedFd),
    Unsafe(UnsafeEntry),
}

impl PrivateDir {
    /// Opens the directory at `path`, creating it (mode 0700) if it is missing, and sets
    /// its mode to 0700.
    ///
    /// This is the one open that follows a symbolic link: `path` is the operator's
    /// choice (`--data-dir`), not an entry of the data dir.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`] if it cannot be created, opened or restricted.
    pub fn open_root(path: impl Into<PathBuf>) -> Result<Self, PersistError> {
        let path = path.into();
        let write_error = |source: io::Error| PersistError::Write { path: path.clone(), source };
        match std::fs::DirBuilder::new().mode(DIR_MODE).create(&path) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
            Err(err) => return Err(write_error(err)),
        }
        let fd = nix::fcntl::open(&path, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|errno| write_error(errno.into()))?;
        Self::private(fd, path, None)
    }

    /// The directory at `path`, opened as it is (following links, creating and changing
    /// nothing): the directory of a file named by a caller's path.
    pub(super) fn open_parent_of(path: &Path) -> io::Result<(Self, &OsStr)> {
        let name = path.file_name().ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let fd = nix::fcntl::open(dir, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())?;
        let stat = fstat(&fd)?;
        Ok((Self::from_parts(fd, dir.to_owned(), &stat, None), name))
    }

    /// The directory at the absolute `path`, opened without following a symbolic link at
    /// any of its components, creating and changing nothing: the directory of a file
    /// outside the data dir that tether must never write through a link.
    ///
    /// The whole path is resolved in one `openat2` with `RESOLVE_NO_SYMLINKS` where the
    /// kernel has it, else one component at a time from `/`, each opened relative to the
    /// one before with `O_NOFOLLOW | O_DIRECTORY`: no component can be swapped for a link
    /// between two steps.
    ///
    /// # Errors
    ///
    /// When a component is a symbolic link, the error's source is a [`LinkedComponent`]
    /// naming it; [`io::ErrorKind::InvalidInput`] for a path that is not absolute or has a
    /// `.` or `..` component; otherwise the error of the open.
    pub fn open_no_follow(path: &Path) -> io::Result<Self> {
        let mut components = path.components();
        if components.next() != Some(std::path::Component::RootDir)
            || components.any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not an absolute path without `.` or `..`"));
        }
        let fd = match open_resolved(path) {
            Ok(fd) => fd,
            // Not in this kernel (or refused by a filter), or a link somewhere: the walk
            // opens the same way, and names the component that is a link.
            Err(Errno::ENOSYS | Errno::EPERM | Errno::EINVAL | Errno::E2BIG | Errno::ELOOP) => walk_no_follow(path)?,
            Err(errno) => return Err(errno.into()),
        };
        let stat = fstat(&fd)?;
        Ok(Self::from_parts(fd, path.to_owned(), &stat, None))
    }

    fn from_parts(fd: OwnedFd, path: PathBuf, stat: &FileStat, parent: Option<(PrivateDir, OsString)>) -> Self {
        let opened = RwLock::new(Arc::new(Opened { fd, id: (stat.st_dev, stat.st_ino) }));
        Self { inner: Arc::new(Inner { opened, path, parent }) }
    }

    /// Wraps a freshly opened directory, setting its mode to 0700.
    fn private(fd: OwnedFd, path: PathBuf, parent: Option<(PrivateDir, OsString)>) -> Result<Self, PersistError> {
        let stat = fstat(&fd).map_err(|errno| PersistError::Write { path: path.clone(), source: errno.into() })?;
        set_mode(fd.as_fd(), &stat, DIR_MODE, &path)
            .map_err(|source| PersistError::Write { path: path.clone(), source })?;
        Ok(Self::from_parts(fd, path, &stat, parent))
    }

    /// Where the directory was when it was opened, for messages.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The directory's descriptor, as currently opened.
    fn fd(&self) -> Arc<Opened> {
        Arc::clone(&self.inner.opened.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Makes the directory again through its parent's handle if it was removed while open.
    /// Returns whether it did.
    fn recreate_if_removed(&self) -> bool {
        let Some((parent, name)) = &self.inner.parent else {
            return false;
        };
        if !fstat(self.fd()).is_ok_and(|stat| stat.st_nlink == 0) {
            return false;
        }
        match parent.subdir(name) {
            Ok(fresh) => {
                *self.inner.opened.write().unwrap_or_else(PoisonError::into_inner) = fresh.fd();
                tracing::warn!(path = %DisplayPath(self.path()), "made a removed directory of the data dir again");
                true
            }
            Err(err) => {
                tracing::warn!(path = %DisplayPath(self.path()), error = %err, "cannot make a removed directory of the data dir again");
                false
            }
        }
    }

    /// The subdirectory `name`, created (mode 0700) if missing, its mode set to 0700.
    ///
    /// A symbolic link at `name` is reported and removed, and a directory made in its
    /// place: what it pointed to is not touched.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`] if it cannot be created or opened, or if something other
    /// than a directory or a link is in the way ([`UnsafeEntry::NotDirectory`]).
    pub fn subdir(&self, name: impl AsRef<OsStr>) -> Result<Self, PersistError> {
        let name = name.as_ref();
        let path = self.path().join(name);
        let write_error = |source: io::Error| PersistError::Write { path: path.clone(), source };
        check_name(name).map_err(write_error)?;
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        for _ in 0..ATTEMPTS {
            match openat(self.fd(), name, flags, Mode::empty()) {
                Ok(fd) => return Self::private(fd, path, Some((self.clone(), name.to_owned()))),
                Err(Errno::ENOENT) => match mkdirat(self.fd(), name, Mode::from_bits_truncate(DIR_MODE)) {
                    Ok(()) | Err(Errno::EEXIST) => {}
                    Err(errno) => return Err(write_error(errno.into())),
                },
                Err(Errno::ELOOP | Errno::ENOTDIR) => {
                    let stat = match fstatat(self.fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
                        Ok(stat) => stat,
                        Err(Errno::ENOENT) => continue,
                        Err(errno) => return Err(write_error(errno.into())),
                    };
                    match file_type(&stat) {
                        SFlag::S_IFLNK => {
                            self.remove_planted(name, UnsafeEntry::SymbolicLink).map_err(write_error)?;
                        }
                        SFlag::S_IFDIR => {} // replaced by a directory meanwhile: open it
                        _ => return Err(write_error(io::Error::other(UnsafeEntry::NotDirectory))),
                    }
                }
                Err(errno) => return Err(write_error(errno.into())),
            }
        }
        Err(write_error(kept_changing()))
    }

    /// Opens `name` for appending, creating it (mode 0600) if missing; an existing file's
    /// mode is set to 0600.
    ///
    /// A symbolic link, a file with other hard links or a special file at `name` is
    /// reported and removed, and a new file created in its place: what it pointed to is
    /// not touched. The returned file is blocking, close-on-exec, and safe to hand to a
    /// child process as its output.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`], also when a directory is in the way.
    pub fn open_append(&self, name: impl AsRef<OsStr>) -> Result<File, PersistError> {
        let name = name.as_ref();
        let path = self.path().join(name);
        let write_error = |source: io::Error| PersistError::Write { path: path.clone(), source };
        check_name(name).map_err(write_error)?;
        for _ in 0..ATTEMPTS {
            // O_EXCL: a link at `name` makes the create fail rather than be followed.
            match self.create(name, OFlag::O_WRONLY | OFlag::O_APPEND) {
                Ok(fd) => return Ok(File::from(fd)),
                Err(Errno::EEXIST) => {}
                Err(errno) => return Err(write_error(errno.into())),
            }
            match self.open_existing(name, OFlag::O_WRONLY | OFlag::O_APPEND).map_err(write_error)? {
                Existing::Found(fd) => return Ok(File::from(fd)),
                Existing::Missing => {}
                Existing::Unsafe(why) => self.remove_planted(name, why).map_err(write_error)?,
            }
        }
        Err(write_error(kept_changing()))
    }

    /// Opens the existing regular file `name` for reading and writing, without following
    /// a link; `None` if there is none. Its mode is set to 0600.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`]; when the entry is a link, a file with other hard links or
    /// a special file, the source is an [`UnsafeEntry`] and the entry is left as it is.
    pub fn open_regular(&self, name: impl AsRef<OsStr>) -> Result<Option<File>, PersistError> {
        let name = name.as_ref();
        let write_error = |source: io::Error| PersistError::Write { path: self.path().join(name), source };
        check_name(name).map_err(write_error)?;
        match self.open_existing(name, OFlag::O_RDWR).map_err(write_error)? {
            Existing::Found(fd) => Ok(Some(File::from(fd))),
            Existing::Missing => Ok(None),
            Existing::Unsafe(why) => Err(write_error(io::Error::other(why))),
        }
    }

    /// The size of `name` if it is a plain regular file (one link, not a link itself), read
    /// without opening it; `None` for anything else, or nothing. A cheap look before
    /// [`PrivateDir::open_regular`], which checks again what it opens.
    pub fn regular_size(&self, name: impl AsRef<OsStr>) -> Option<u64> {
        let name = name.as_ref();
        check_name(name).ok()?;
        let stat = fstatat(self.fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW).ok()?;
        (file_type(&stat) == SFlag::S_IFREG && stat.st_nlink == 1).then(|| u64::try_from(stat.st_size).unwrap_or(0))
    }

    /// Opens the existing regular file `name` for reading only, without following a link;
    /// `None` if there is none.
    ///
    /// # Errors
    ///
    /// [`PersistError::Read`]; when the entry is a link, a file with other hard links or a
    /// special file, the source is an [`UnsafeEntry`] and the entry is left as it is.
    pub fn open_read(&self, name: impl AsRef<OsStr>) -> Result<Option<File>, PersistError> {
        let name = name.as_ref();
        let read_error = |source: io::Error| PersistError::Read { path: self.path().join(name), source };
        check_name(name).map_err(read_error)?;
        match self.open_existing(name, OFlag::O_RDONLY).map_err(read_error)? {
            Existing::Found(fd) => Ok(Some(File::from(fd))),
            Existing::Missing => Ok(None),
            Existing::Unsafe(why) => Err(read_error(io::Error::other(why))),
        }
    }

    /// Creates the new file `name` (mode 0600) for writing; it must not exist yet, not
    /// even as a link.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`]; its source is [`io::ErrorKind::AlreadyExists`] when
    /// something is at `name`.
    pub fn create_new(&self, name: impl AsRef<OsStr>) -> Result<File, PersistError> {
        let name = name.as_ref();
        let write_error = |source: io::Error| PersistError::Write { path: self.path().join(name), source };
        check_name(name).map_err(write_error)?;
        self.create(name, OFlag::O_WRONLY).map(File::from).map_err(|errno| write_error(errno.into()))
    }

    /// Reads the whole regular file `name`, without following a link; `None` if there is
    /// none. Its mode is set to 0600.
    ///
    /// # Errors
    ///
    /// [`PersistError::Read`]; when the entry is a link, a file with other hard links or a
    /// special file, the source is an [`UnsafeEntry`] and the entry is left as it is.
    pub fn read(&self, name: impl AsRef<OsStr>) -> Result<Option<Vec<u8>>, PersistError> {
        let name = name.as_ref();
        let read_error = |source: io::Error| PersistError::Read { path: self.path().join(name), source };
        check_name(name).map_err(read_error)?;
        match self.open_existing(name, OFlag::O_RDONLY).map_err(read_error)? {
            Existing::Found(fd) => {
                let mut bytes = Vec::new();
                File::from(fd).read_to_end(&mut bytes).map_err(read_error)?;
                Ok(Some(bytes))
            }
            Existing::Missing => Ok(None),
            Existing::Unsafe(why) => Err(read_error(io::Error::other(why))),
        }
    }

    /// Reads the whole regular file `name` as it is, without following a link and changing
    /// nothing (its mode and links are its owner's): a file outside the data dir that
    /// tether is about to replace. `None` if there is none.
    ///
    /// # Errors
    ///
    /// [`PersistError::Read`]; when the entry is a link or not a regular file, the source
    /// is an [`UnsafeEntry`] and the entry is left as it is.
    pub fn read_as_found(&self, name: impl AsRef<OsStr>) -> Result<Option<Vec<u8>>, PersistError> {
        let name = name.as_ref();
        let read_error = |source: io::Error| PersistError::Read { path: self.path().join(name), source };
        check_name(name).map_err(read_error)?;
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
        let fd = match openat(self.fd(), name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Ok(None),
            Err(Errno::ELOOP) => return Err(read_error(io::Error::other(UnsafeEntry::SymbolicLink))),
            Err(Errno::ENXIO) => return Err(read_error(io::Error::other(UnsafeEntry::NotRegular))),
            Err(errno) => return Err(read_error(errno.into())),
        };
        let stat = fstat(&fd).map_err(|errno| read_error(errno.into()))?;
        if file_type(&stat) != SFlag::S_IFREG {
            return Err(read_error(io::Error::other(UnsafeEntry::NotRegular)));
        }
        let mut bytes = Vec::new();
        File::from(fd).read_to_end(&mut bytes).map_err(read_error)?;
        Ok(Some(bytes))
    }

    /// Replaces `name` atomically with `contents` (mode 0600): see
    /// [`PrivateDir::write_atomic_file`].
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`]; the old content of `name`, if any, is then untouched.
    pub fn write_atomic(
        &self,
        name: impl AsRef<OsStr>,
        durability: Durability,
        contents: &[u8],
    ) -> Result<(), PersistError> {
        self.write_atomic_file(name, durability, |file| file.write_all(contents))
    }

    /// Like [`PrivateDir::write_atomic`], but the contents come from `write`, through a
    /// buffer: a large file need not be assembled in memory first.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`], also when `write` fails; the old content of `name`, if any,
    /// is then untouched.
    pub fn write_atomic_with(
        &self,
        name: impl AsRef<OsStr>,
        durability: Durability,
        write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
    ) -> Result<(), PersistError> {
        self.write_atomic_file(name, durability, |file| {
            let mut out = io::BufWriter::new(file);
            write(&mut out)?;
            out.flush()
        })
    }

    /// Replaces `name` atomically with a file that `write` fills: a new temporary file
    /// (mode 0600) in this directory, fsynced if `durability` asks for it, renamed over
    /// `name`, then the directory fsynced if `durability` asks for it. A crash leaves the
    /// old content or the new, never a mix.
    ///
    /// A symbolic link at `name` is replaced by the rename, never written through.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`], also when `write` fails; the old content of `name`, if any,
    /// is then untouched and the temporary file removed.
    pub fn write_atomic_file(
        &self,
        name: impl AsRef<OsStr>,
        durability: Durability,
        write: impl FnOnce(&mut File) -> io::Result<()>,
    ) -> Result<(), PersistError> {
        let name = name.as_ref();
        let mut temporary = self.create_temporary(name)?;
        write(&mut temporary.file).map_err(|source| PersistError::Write { path: self.path().join(name), source })?;
        temporary.persist(durability)
    }

    /// Creates an empty file (mode 0600) under a temporary name of this directory, to become
    /// `name` once written ([`Temporary::persist`]). Its name, `.<name>.tmp.<pid>.<n>`, is
    /// the one that [`PrivateDir::remove_temporaries`] finds after a crash; dropped before
    /// it is persisted, it is removed.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`], naming `name`.
    pub fn create_temporary(&self, name: impl AsRef<OsStr>) -> Result<Temporary, PersistError> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let name = name.as_ref();
        let write_error = |source: io::Error| PersistError::Write { path: self.path().join(name), source };
        check_name(name).map_err(write_error)?;
        let mut temp = OsString::from(".");
        temp.push(name);
        temp.push(format!(".tmp.{}.{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
        let file = File::from(self.create(&temp, OFlag::O_WRONLY).map_err(|errno| write_error(errno.into()))?);
        Ok(Temporary { dir: self.clone(), name: name.to_owned(), temp, file, persisted: false })
    }

    /// Removes `name` (a link is removed, not its target); `false` if there was nothing.
    /// With [`Durability::PowerLoss`], the directory is fsynced after a removal.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`], also when `name` is a directory.
    pub fn remove(&self, name: impl AsRef<OsStr>, durability: Durability) -> Result<bool, PersistError> {
        let name = name.as_ref();
        let write_error = |source: io::Error| PersistError::Write { path: self.path().join(name), source };
        check_name(name).map_err(write_error)?;
        match unlinkat(self.fd(), name, UnlinkatFlags::NoRemoveDir) {
            Ok(()) => {}
            Err(Errno::ENOENT) => return Ok(false),
            Err(errno) => return Err(write_error(errno.into())),
        }
        if durability == Durability::PowerLoss {
            fsync(self.fd())
                .map_err(|errno| PersistError::Write { path: self.path().to_owned(), source: errno.into() })?;
        }
        Ok(true)
    }

    /// Renames `from` to `to`, replacing whatever is at `to` (a link there is replaced,
    /// not followed); `false` if there was no `from`.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`] naming `to`.
    pub fn rename(&self, from: impl AsRef<OsStr>, to: impl AsRef<OsStr>) -> Result<bool, PersistError> {
        let (from, to) = (from.as_ref(), to.as_ref());
        let write_error = |source: io::Error| PersistError::Write { path: self.path().join(to), source };
        check_name(from).and_then(|_| check_name(to)).map_err(write_error)?;
        match renameat(self.fd(), from, self.fd(), to) {
            Ok(()) => Ok(true),
            Err(Errno::ENOENT) => Ok(false),
            Err(errno) => Err(write_error(errno.into())),
        }
    }

    /// Moves a damaged `name` aside to `<name>.corrupt`, replacing an older one, and
    /// returns the new path.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`], also when there is no `name`.
    pub fn quarantine(&self, name: impl AsRef<OsStr>) -> Result<PathBuf, PersistError> {
        let name = name.as_ref();
        let mut target = name.to_owned();
        target.push(".corrupt");
        if !self.rename(name, &target)? {
            let source = io::Error::from(io::ErrorKind::NotFound);
            return Err(PersistError::Write { path: self.path().join(name), source });
        }
        Ok(self.path().join(target))
    }

    /// Removes the temporary files that atomic writes in this directory left behind (a
    /// crash between a temporary's creation and its rename): the entries named
    /// `.<name>.tmp.<pid>.<n>`, of `name` only when `of` is given, whose writer `abandoned`
    /// says is gone. Returns the names removed. A directory of such a name is left alone,
    /// and a link is removed, not followed.
    pub fn remove_temporaries(&self, of: Option<&OsStr>, abandoned: impl Fn(u32) -> bool) -> Vec<OsString> {
        let Ok(names) = self.names() else { return Vec::new() };
        let mut removed = Vec::new();
        for entry in names {
            let Some((name, pid)) = temporary_of(&entry) else { continue };
            if of.is_some_and(|of| of.as_bytes() != name) || !abandoned(pid) {
                continue;
            }
            match unlinkat(self.fd(), entry.as_os_str(), UnlinkatFlags::NoRemoveDir) {
                Ok(()) => removed.push(entry),
                Err(errno) => {
                    tracing::debug!(path = %DisplayPath(&self.path().join(&entry)), %errno, "a temporary file stays")
                }
            }
        }
        removed
    }

    /// The names of the directory's entries, in no particular order.
    ///
    /// # Errors
    ///
    /// [`PersistError::Read`] if the directory cannot be listed.
    pub fn names(&self) -> Result<Vec<OsString>, PersistError> {
        let read_error = |errno: Errno| PersistError::Read { path: self.path().to_owned(), source: errno.into() };
        // A new descriptor of the same directory: the listing has its own position.
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
        let mut dir = nix::dir::Dir::openat(self.fd(), ".", flags, Mode::empty()).map_err(read_error)?;
        let mut names = Vec::new();
        for entry in dir.iter() {
            let name = entry.map_err(read_error)?.file_name().to_bytes().to_owned();
            if name != b"." && name != b".." {
                names.push(OsString::from(std::ffi::OsStr::from_bytes(&name)));
            }
        }
        Ok(names)
    }

    /// Fsyncs the directory: renames and removals in it survive a power loss.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`].
    pub fn sync(&self) -> Result<(), PersistError> {
        fsync(self.fd()).map_err(|errno| PersistError::Write { path: self.path().to_owned(), source: errno.into() })
    }

    /// Sets the mode of every regular file of the directory that has no other hard link to
    /// 0600. Failures are logged, not returned: a file that cannot be restricted now is
    /// restricted again when it is next opened.
    pub(super) fn restrict_files(&self) {
        let names = match self.names() {
            Ok(names) => names,
            Err(err) => {
                tracing::warn!(error = %err, "cannot restrict the files of a data dir directory");
                return;
            }
        };
        for name in names {
            let Ok(stat) = fstatat(self.fd(), name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) else { continue };
            if file_type(&stat) != SFlag::S_IFREG || stat.st_nlink != 1 || stat.st_mode & 0o7777 == FILE_MODE {
                continue;
            }
            // Opening sets the mode and checks again what the entry is.
            if let Err(err) = self.open_existing(&name, OFlag::O_RDONLY) {
                tracing::warn!(path = %DisplayPath(&self.path().join(&name)), error = %err, "cannot restrict a file of the data dir");
            }
        }
    }

    /// Creates `name` exclusively with mode 0600: `O_EXCL` fails on any existing entry,
    /// a dangling link included, so nothing is ever followed.
    fn create(&self, name: &OsStr, access: OFlag) -> Result<OwnedFd, Errno> {
        let flags = access | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let mode = Mode::from_bits_truncate(FILE_MODE);
        let fd = match openat(self.fd(), name, flags, mode) {
            // With a single component, ENOENT means that the directory itself is gone.
            Err(Errno::ENOENT) if self.recreate_if_removed() => openat(self.fd(), name, flags, mode)?,
            opened => opened?,
        };
        // The umask may have taken bits away; every file of the data dir is exactly 0600.
        let stat = fstat(&fd)?;
        if stat.st_mode & 0o7777 != FILE_MODE {
            fchmod(&fd, Mode::from_bits_truncate(FILE_MODE))?;
        }
        Ok(fd)
    }

    /// Opens the existing `name` with `access`, without following a link and without
    /// blocking on a FIFO; returns it only if it is a regular file with no other hard
    /// link, its mode set to 0600 and its descriptor blocking.
    fn open_existing(&self, name: &OsStr, access: OFlag) -> io::Result<Existing> {
        let flags = access | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
        let fd = match openat(self.fd(), name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Ok(Existing::Missing),
            Err(Errno::ELOOP) => return Ok(Existing::Unsafe(UnsafeEntry::SymbolicLink)),
            // A socket, or a FIFO opened for writing that nobody reads.
            Err(Errno::ENXIO) => return Ok(Existing::Unsafe(UnsafeEntry::NotRegular)),
            Err(errno) => return Err(errno.into()),
        };
        let stat = fstat(&fd)?;
        if file_type(&stat) != SFlag::S_IFREG {
            return Ok(Existing::Unsafe(UnsafeEntry::NotRegular));
        }
        if stat.st_nlink != 1 {
            return Ok(Existing::Unsafe(UnsafeEntry::HardLink));
        }
        set_mode(fd.as_fd(), &stat, FILE_MODE, &self.path().join(name))?;
        let status = OFlag::from_bits_retain(fcntl(&fd, FcntlArg::F_GETFL)?);
        fcntl(&fd, FcntlArg::F_SETFL(status - OFlag::O_NONBLOCK))?;
        Ok(Existing::Found(fd))
    }

    /// Removes an entry that is not what tether expects at `name`, and says so.
    fn remove_planted(&self, name: &OsStr, why: UnsafeEntry) -> io::Result<()> {
        let target = match why {
            UnsafeEntry::SymbolicLink => readlinkat(self.fd(), name).ok(),
            _ => None,
        };
        match unlinkat(self.fd(), name, UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => {}
            Err(errno) => return Err(errno.into()),
        }
        let target = target.as_deref().map(|target| DisplayPath(Path::new(target)).to_string());
        tracing::warn!(
            path = %DisplayPath(&self.path().join(name)),
            problem = %why,
            target = target.as_deref().unwrap_or(""),
            "replaced an entry of the data dir that tether does not use as it is; what it points to is untouched"
        );
        Ok(())
    }
}

/// Flags of a directory opened on the way to a file.
const DIR_FLAGS: OFlag = OFlag::O_RDONLY.union(OFlag::O_DIRECTORY).union(OFlag::O_CLOEXEC);

/// Opens the directory at `path` in one system call that fails with `ELOOP` at any
/// symbolic link on the way.
#[cfg(target_os = "linux")]
fn open_resolved(path: &Path) -> Result<OwnedFd, Errno> {
    use nix::fcntl::{OpenHow, ResolveFlag, openat2};
    let how = OpenHow::new().flags(DIR_FLAGS).resolve(ResolveFlag::RESOLVE_NO_SYMLINKS);
    openat2(nix::fcntl::AT_FDCWD, path, how)
}

#[cfg(not(target_os = "linux"))]
fn open_resolved(_path: &Path) -> Result<OwnedFd, Errno> {
    Err(Errno::ENOSYS)
}

/// Opens the directory at the absolute `path` one component at a time from `/`, each
/// relative to the one before and without following a link.
pub(super) fn walk_no_follow(path: &Path) -> io::Result<OwnedFd> {
    let mut fd = nix::fcntl::open("/", DIR_FLAGS, Mode::empty())?;
    let mut reached = PathBuf::from("/");
    for component in path.components().skip(1) {
        let name = component.as_os_str();
        reached.push(name);
        fd = match openat(&fd, name, DIR_FLAGS | OFlag::O_NOFOLLOW, Mode::empty()) {
            Ok(next) => next,
            Err(Errno::ELOOP | Errno::ENOTDIR) => {
                let linked = fstatat(&fd, name, AtFlags::AT_SYMLINK_NOFOLLOW)
                    .is_ok_and(|stat| file_type(&stat) == SFlag::S_IFLNK);
                if linked {
                    return Err(io::Error::other(LinkedComponent { path: reached }));
                }
                return Err(Errno::ENOTDIR.into());
            }
            Err(errno) => return Err(errno.into()),
        };
    }
    Ok(fd)
}

/// A component of a path that is a symbolic link, where tether follows none.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} is a symbolic link, which tether does not follow", DisplayPath(.path))]
pub struct LinkedComponent {
    /// The path up to and including the link.
    pub path: PathBuf,
}

/// Rejects anything but one plain component: every operation stays in its directory.
fn check_name(name: &OsStr) -> io::Result<()> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes == b"." || bytes == b".." || bytes.contains(&b'/') || bytes.contains(&0) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a plain file name"));
    }
    Ok(())
}

fn file_type(stat: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(stat.st_mode & SFlag::S_IFMT.bits())
}

/// Sets the mode of `fd` to `mode` if it is anything else, and reports the change.
fn set_mode(fd: BorrowedFd<'_>, stat: &FileStat, mode: u32, path: &Path) -> io::Result<()> {
    let found = stat.st_mode & 0o7777;
    if found == mode {
        return Ok(());
    }
    fchmod(fd, Mode::from_bits_truncate(mode))?;
    tracing::warn!(
        path = %DisplayPath(path),
        found = %format_args!("{found:04o}"),
        mode = %format_args!("{mode:04o}"),
        "restricted the mode of an entry of the data dir"
    );
    Ok(())
}

fn kept_changing() -> io::Error {
    io::Error::other("the entry kept changing while it was opened")
}

/// The name and writer's pid of a temporary file of [`PrivateDir::write_atomic_file`]
/// (`.<name>.tmp.<pid>.<n>`), or `None` for any other entry.
fn temporary_of(entry: &OsStr) -> Option<(&[u8], u32)> {
    fn split_last_dot(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
        let dot = bytes.iter().rposition(|b| *b == b'.')?;
        Some((&bytes[..dot], &bytes[dot + 1..]))
    }
    let digits = |part: &[u8]| !part.is_empty() && part.iter().all(u8::is_ascii_digit);
    let bytes = entry.as_bytes().strip_prefix(b".")?;
    let (rest, counter) = split_last_dot(bytes)?;
    let (rest, pid) = split_last_dot(rest)?;
    let name = rest.strip_suffix(b".tmp")?;
    if name.is_empty() || !digits(counter) || !digits(pid) {
        return None;
    }
    Some((name, std::str::from_utf8(pid).ok()?.parse().ok()?))
}

/// A file being written under a temporary name of its directory, which becomes its name
/// once written ([`PrivateDir::create_temporary`]); removed if dropped before.
#[derive(Debug)]
pub struct Temporary {
    dir: PrivateDir,
    name: OsString,
    temp: OsString,
    file: File,
    persisted: bool,
}

impl Temporary {
    /// The file, to write into.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The name it will have.
    pub fn name(&self) -> &OsStr {
        &self.name
    }

    /// Renames it to its name, replacing what is there (a link is replaced, never
    /// followed): fsynced first, and the directory after, if `durability` asks for it.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`], naming its name; the temporary file is then removed.
    pub fn persist(mut self, durability: Durability) -> Result<(), PersistError> {
        let result = (|| {
            if durability == Durability::PowerLoss {
                self.file.sync_all()?;
            }
            renameat(self.dir.fd(), self.temp.as_os_str(), self.dir.fd(), self.name.as_os_str())?;
            self.persisted = true;
            if durability == Durability::PowerLoss {
                fsync(self.dir.fd())?;
            }
            Ok(())
        })();
        result.map_err(|source: io::Error| PersistError::Write { path: self.dir.path().join(&self.name), source })
    }
}

impl Drop for Temporary {
    fn drop(&mut self) {
        if !self.persisted {
            let _ = unlinkat(self.dir.fd(), self.temp.as_os_str(), UnlinkatFlags::NoRemoveDir);
        }
    }
}
