//! The files and directories whose change reloads a process (`reload.watch`): one inotify
//! instance per process that watches any, on the directories that hold them, so that a file
//! written in place (`IN_CLOSE_WRITE`) and one renamed into place (`IN_MOVED_TO`, which
//! replaces the inode a watch on the file itself would follow) both count. Changes are
//! debounced: the reload is asked once they have been quiet for [`WATCH_DEBOUNCE`].
//!
//! This module owns that instance and the debounce, nothing else: the supervising task asks
//! the reload when [`Watch::changed`] returns.

use std::ffi::OsString;
use std::io;
use std::path::PathBuf;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use tokio::io::unix::AsyncFd;
use tokio::time::Instant;

use crate::rotate::InotifyFd;
use crate::spec::{ProcessSpec, WATCH_DEBOUNCE};

/// The watched paths of one process.
pub(crate) struct Watch {
    inotify: AsyncFd<InotifyFd>,
    /// Each watched directory, with the name in it that matters (`None`: any, for a watched
    /// directory itself).
    targets: Vec<(WatchDescriptor, Option<OsString>)>,
    /// When the changes seen so far will have been quiet long enough.
    due: Option<Instant>,
}

impl Watch {
    /// The watch of `spec`'s `reload.watch`; `None` when it watches nothing, or when no
    /// path could be watched (each failure is logged, naming the path).
    pub(crate) fn of(spec: &ProcessSpec) -> Option<Box<Self>> {
        let paths = spec.reload.as_ref().map(|reload| reload.watch.as_slice()).unwrap_or_default();
        if paths.is_empty() {
            return None;
        }
        match Self::new(paths) {
            Ok(watch) if !watch.targets.is_empty() => Some(Box::new(watch)),
            Ok(_) => None,
            Err(error) => {
                tracing::warn!(%error, "cannot watch the reload's files; they reload nothing");
                None
            }
        }
    }

    fn new(paths: &[PathBuf]) -> io::Result<Self> {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
        let mut targets = Vec::with_capacity(paths.len());
        for path in paths {
            // A directory is watched itself, for any change of its entries; a file (or a path
            // that does not exist yet) through its directory, for its own name.
            let (dir, name) = if path.is_dir() {
                (path.clone(), None)
            } else {
                match (path.parent(), path.file_name()) {
                    (Some(dir), Some(name)) => (dir.to_owned(), Some(name.to_owned())),
                    _ => (path.clone(), None),
                }
            };
            let flags = AddWatchFlags::IN_CLOSE_WRITE
                | AddWatchFlags::IN_MOVED_TO
                | AddWatchFlags::IN_MOVED_FROM
                | AddWatchFlags::IN_DELETE
                | AddWatchFlags::IN_ONLYDIR;
            match inotify.add_watch(&dir, flags) {
                Ok(descriptor) => targets.push((descriptor, name)),
                Err(error) => tracing::warn!(path = %path.display(), %error, "cannot watch a reload's path"),
            }
        }
        #[allow(unsafe_code)]
        // SAFETY: the `AsyncFd` owns the `Inotify`, which owns its fd: the fd stays open and
        // unchanged until the `AsyncFd` is dropped, and `as_raw_fd` always returns it.
        let inotify = unsafe { AsyncFd::register_with_interest(InotifyFd(inotify), tokio::io::Interest::READABLE) }?;
        Ok(Self { inotify, targets, due: None })
    }

    /// Returns once a watched path changed and the changes have been quiet for
    /// [`WATCH_DEBOUNCE`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: events are read in the poll that takes them, and the debounce's
    /// deadline is kept in the watch.
    pub(crate) async fn changed(&mut self) {
        loop {
            let due = self.due;
            tokio::select! {
                () = async {
                    match due {
                        Some(due) => tokio::time::sleep_until(due).await,
                        None => std::future::pending().await,
                    }
                } => {
                    self.due = None;
                    return;
                }
                ready = self.inotify.readable() => {
                    let Ok(mut guard) = ready else { return std::future::pending().await };
                    let events = match guard.try_io(|fd| fd.get_ref().0.read_events().map_err(io::Error::from)) {
                        Ok(Ok(events)) => events,
                        Ok(Err(error)) => {
                            tracing::warn!(%error, "cannot read the reload's watched changes");
                            continue;
                        }
                        Err(_would_block) => continue,
                    };
                    let relevant = events.iter().any(|event| {
                        event.mask.contains(AddWatchFlags::IN_Q_OVERFLOW)
                            || self.targets.iter().any(|(descriptor, name)| {
                                *descriptor == event.wd && name.as_ref().is_none_or(|name| event.name.as_ref() == Some(name))
                            })
                    });
                    if relevant {
                        self.due = Some(Instant::now() + WATCH_DEBOUNCE);
                    }
                }
            }
        }
    }
}
