//! Waiting for cgroups to empty: one inotify instance that tells waiters when a
//! `cgroup.events` file changes.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::{Arc, Mutex};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

use super::lock;

/// One inotify instance that tells waiters when a `cgroup.events` file changes.
pub(super) struct Events {
    inotify: Arc<AsyncFd<InotifyFd>>,
    waiting: Arc<Mutex<HashMap<WatchDescriptor, Vec<oneshot::Sender<()>>>>>,
}

struct InotifyFd(Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        use std::os::fd::AsFd;
        self.0.as_fd().as_raw_fd()
    }
}

impl Events {
    pub(super) fn start() -> io::Result<Self> {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
        #[allow(unsafe_code)]
        // SAFETY: the `AsyncFd` owns the `Inotify`, which owns its fd: the fd stays open
        // and unchanged until the `AsyncFd` is dropped, and `as_raw_fd` always returns it.
        let inotify = unsafe { AsyncFd::register_with_interest(InotifyFd(inotify), tokio::io::Interest::READABLE) }?;
        let inotify = Arc::new(inotify);
        let waiting: Arc<Mutex<HashMap<WatchDescriptor, Vec<oneshot::Sender<()>>>>> = Arc::default();
        let (reader, woken) = (Arc::clone(&inotify), Arc::clone(&waiting));
        tokio::spawn(async move {
            loop {
                let mut ready = match reader.readable().await {
                    Ok(ready) => ready,
                    Err(error) => {
                        tracing::error!(%error, "inotify failed; cgroups are no longer watched");
                        return;
                    }
                };
                match ready.try_io(|inner| inner.get_ref().0.read_events().map_err(io::Error::from)) {
                    Ok(Ok(events)) => {
                        let mut waiting = lock(&woken);
                        for event in events {
                            for waiter in waiting.remove(&event.wd).unwrap_or_default() {
                                let _gone = waiter.send(());
                            }
                        }
                    }
                    Ok(Err(error)) => tracing::warn!(%error, "failed to read inotify events"),
                    Err(_would_block) => {}
                }
            }
        });
        Ok(Self { inotify, waiting })
    }

    /// A receiver that completes at the next change of `file`.
    pub(super) fn watch(&self, file: &Path) -> io::Result<oneshot::Receiver<()>> {
        let (sender, receiver) = oneshot::channel();
        let mut waiting = lock(&self.waiting);
        let wd = self.inotify.get_ref().0.add_watch(file, AddWatchFlags::IN_MODIFY)?;
        waiting.entry(wd).or_default().push(sender);
        Ok(receiver)
    }
}
