//! Log rotation by copy-and-truncate, driven by inotify.
//!
//! This module owns the one task that watches every supervised log file and rotates a
//! file once it passes its cap: `<file>.N-1` becomes `<file>.N`, …, the file is copied to
//! `<file>.1` and truncated, so the process keeps appending to the same fd. It never
//! polls: a file is watched with `IN_MODIFY | IN_ONESHOT`, so a burst of writes costs one
//! wake-up, the size is checked with `fstat`, and the watch is re-armed a second later.
//! An idle agent therefore never wakes up here. It never opens a log for the process
//! and never deletes a live log file.

use std::collections::{HashMap, VecDeque};
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::spec::LogLimits;

/// How long a file that was just written stays unwatched: the rate limit of the checks.
const REARM_AFTER: Duration = Duration::from_secs(1);

/// One stream of one supervised process.
type FileKey = (u64, u8);

enum Command {
    Watch { process: u64, paths: [PathBuf; 2], limits: LogLimits },
    Limits { process: u64, limits: LogLimits },
    Forget { process: u64 },
}

/// The sending side of the rotation task. Dropping it ends the task.
#[derive(Debug)]
pub(crate) struct Rotator {
    commands: mpsc::UnboundedSender<Command>,
    task: tokio::task::JoinHandle<()>,
}

impl Rotator {
    /// Starts the rotation task. Must be called from within a tokio runtime.
    pub(crate) fn start() -> io::Result<Self> {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
        #[allow(unsafe_code)]
        // SAFETY: the `AsyncFd` owns the `Inotify`, which owns its fd: the fd stays open
        // and unchanged until the `AsyncFd` is dropped, and `as_raw_fd` always returns it.
        let inotify = unsafe { AsyncFd::register_with_interest(InotifyFd(inotify), tokio::io::Interest::READABLE) }?;
        let (commands, receiver) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(inotify, receiver));
        Ok(Self { commands, task })
    }

    /// Watches the two log files of `process`, replacing any earlier registration.
    pub(crate) fn watch(&self, process: u64, stdout: &Path, stderr: &Path, limits: LogLimits) {
        let paths = [stdout.to_owned(), stderr.to_owned()];
        let _task_gone = self.commands.send(Command::Watch { process, paths, limits });
    }

    /// Changes the limits of `process`'s files.
    pub(crate) fn set_limits(&self, process: u64, limits: LogLimits) {
        let _task_gone = self.commands.send(Command::Limits { process, limits });
    }

    /// Stops watching `process`'s files.
    pub(crate) fn forget(&self, process: u64) {
        let _task_gone = self.commands.send(Command::Forget { process });
    }
}

impl Drop for Rotator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `Inotify` with the `AsRawFd` that `AsyncFd` needs.
struct InotifyFd(Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

struct Watched {
    path: PathBuf,
    limits: LogLimits,
    watch: Option<WatchDescriptor>,
}

struct State {
    inotify: AsyncFd<InotifyFd>,
    files: HashMap<FileKey, Watched>,
    by_watch: HashMap<WatchDescriptor, FileKey>,
    /// Files to watch again, in deadline order (every delay is the same).
    rearm: VecDeque<(Instant, FileKey)>,
}

async fn run(inotify: AsyncFd<InotifyFd>, mut commands: mpsc::UnboundedReceiver<Command>) {
    let mut state = State { inotify, files: HashMap::new(), by_watch: HashMap::new(), rearm: VecDeque::new() };
    loop {
        let next_rearm = state.rearm.front().map(|(deadline, _)| *deadline);
        tokio::select! {
            // Every branch is cancel-safe: `recv` and `readable` lose nothing, and the
            // sleep is rebuilt from the queue's front every time round.
            command = commands.recv() => match command {
                Some(command) => state.apply(command).await,
                None => return,
            },
            ready = state.inotify.readable() => match ready {
                Ok(mut guard) => {
                    let events = match guard.try_io(|fd| fd.get_ref().0.read_events().map_err(io::Error::from)) {
                        Ok(Ok(events)) => events,
                        Ok(Err(error)) => {
                            tracing::warn!(%error, "failed to read inotify events");
                            continue;
                        }
                        Err(_would_block) => continue,
                    };
                    drop(guard);
                    for event in events {
                        state.on_event(event.wd, event.mask).await;
                    }
                }
                Err(error) => {
                    tracing::error!(%error, "inotify failed; log rotation stopped");
                    return;
                }
            },
            () = sleep_until(next_rearm) => {
                let now = Instant::now();
                while let Some(&(deadline, key)) = state.rearm.front() {
                    if deadline > now {
                        break;
                    }
                    state.rearm.pop_front();
                    state.arm(key).await;
                }
            }
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

impl State {
    async fn apply(&mut self, command: Command) {
        match command {
            Command::Watch { process, paths, limits } => {
                for (stream, path) in (0u8..).zip(paths) {
                    let key = (process, stream);
                    let watch = self.files.remove(&key).and_then(|old| old.watch);
                    self.files.insert(key, Watched { path, limits, watch });
                    self.arm(key).await;
                }
            }
            Command::Limits { process, limits } => {
                for stream in 0..2 {
                    if let Some(file) = self.files.get_mut(&(process, stream)) {
                        file.limits = limits;
                    }
                }
                for stream in 0..2 {
                    self.check((process, stream)).await;
                }
            }
            Command::Forget { process } => {
                for stream in 0..2 {
                    if let Some(Watched { watch: Some(watch), .. }) = self.files.remove(&(process, stream)) {
                        self.by_watch.remove(&watch);
                        // A one-shot watch that already fired is gone: EINVAL is expected.
                        let _already_removed = self.inotify.get_ref().0.rm_watch(watch);
                    }
                }
            }
        }
    }

    async fn on_event(&mut self, watch: WatchDescriptor, mask: AddWatchFlags) {
        let Some(key) = self.by_watch.remove(&watch) else {
            return; // the IN_IGNORED that follows every one-shot event, or a forgotten file
        };
        if let Some(file) = self.files.get_mut(&key) {
            if file.watch == Some(watch) {
                file.watch = None;
            }
        }
        if mask.contains(AddWatchFlags::IN_IGNORED) {
            // The file was deleted or its file system unmounted: the next start of the
            // process creates it again and registers it anew.
            return;
        }
        self.check(key).await;
        self.rearm.push_back((Instant::now() + REARM_AFTER, key));
    }

    /// Watches `key`'s file (again), then checks it: writes since the last event may
    /// already have taken it past its cap.
    async fn arm(&mut self, key: FileKey) {
        let Some(file) = self.files.get_mut(&key) else {
            return; // forgotten while it waited to be re-armed
        };
        match self.inotify.get_ref().0.add_watch(&file.path, AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_ONESHOT) {
            Ok(watch) => {
                file.watch = Some(watch);
                self.by_watch.insert(watch, key);
            }
            Err(error) => {
                tracing::warn!(path = %file.path.display(), %error, "failed to watch log file");
                return;
            }
        }
        self.check(key).await;
    }

    async fn check(&mut self, key: FileKey) {
        let Some(file) = self.files.get(&key) else {
            return;
        };
        let (path, limits) = (file.path.clone(), file.limits);
        let size = match File::open(&path).and_then(|opened| opened.metadata()) {
            Ok(metadata) => metadata.len(),
            Err(error) => {
                tracing::debug!(path = %path.display(), %error, "cannot check log file size");
                return;
            }
        };
        if size <= limits.max_size {
            return;
        }
        // Copying up to `max_size` bytes blocks: keep it off the runtime's threads.
        let rotated = tokio::task::spawn_blocking(move || rotate(&path, limits.keep).map(|()| path)).await;
        match rotated {
            Ok(Ok(path)) => tracing::info!(path = %path.display(), size, "log file rotated"),
            Ok(Err(error)) => tracing::warn!(%error, "failed to rotate log file"),
            Err(error) => tracing::warn!(%error, "log rotation task failed"),
        }
    }
}

/// The name of the `index`-th rotated copy of `path`.
pub(crate) fn rotated_name(path: &Path, index: u32) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{index}"));
    PathBuf::from(name)
}

/// Shifts the rotated copies, copies `path` to `<path>.1` and truncates `path`.
pub(crate) fn rotate(path: &Path, keep: u32) -> io::Result<()> {
    if keep > 0 {
        for index in (1..keep).rev() {
            match fs::rename(rotated_name(path, index), rotated_name(path, index + 1)) {
                Err(error) if error.kind() != io::ErrorKind::NotFound => return Err(error),
                _ => {}
            }
        }
        // `fs::copy` keeps the source's 0600 mode.
        fs::copy(path, rotated_name(path, 1))?;
    }
    fs::OpenOptions::new().write(true).open(path)?.set_len(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_shifts_copies_and_drops_the_oldest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p-stdout.log");
        for generation in 1..=4 {
            fs::write(&path, format!("generation {generation}")).unwrap();
            rotate(&path, 2).unwrap();
        }
        assert_eq!(fs::read_to_string(&path).unwrap(), "");
        assert_eq!(fs::read_to_string(rotated_name(&path, 1)).unwrap(), "generation 4");
        assert_eq!(fs::read_to_string(rotated_name(&path, 2)).unwrap(), "generation 3");
        assert!(!rotated_name(&path, 3).exists());
    }

    #[test]
    fn keeping_nothing_only_truncates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p-stdout.log");
        fs::write(&path, "data").unwrap();
        rotate(&path, 0).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "");
        assert!(!rotated_name(&path, 1).exists());
    }
}
