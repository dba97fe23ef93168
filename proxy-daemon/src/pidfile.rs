//! Pid files: written atomically on every start, removed on stop.
//!
//! This module owns the one thread that writes and removes pid files, so that writes to
//! one file stay in order and off the spawn path. It never writes a file other than the
//! pid files and their temporary siblings, never follows a symbolic link (each file is
//! opened, renamed and removed relative to its directory, opened without following links),
//! and never removes a file that names another process than the one stopped. Reading pid
//! files for adoption is `supervisor`'s job.
//!
//! Durability class: a pid file describes a process that dies with the machine (the boot
//! id rejects it after a reboot), so it needs to appear whole, also to an agent that crashes
//! while writing it, not an fsync: a new one is an unnamed file linked in once written, one
//! that replaces another a temporary file renamed over it. A write that fails (a full disk, no descriptor) is retried on a backoff, and
//! the file that named the previous instance is removed meanwhile: a stale pid is never
//! left as the only record.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{AT_FDCWD, AtFlags, OFlag, openat, renameat};
use nix::sys::stat::Mode;
use nix::unistd::{UnlinkatFlags, linkat, unlinkat};
use tether_state::Backoff;
use tokio::sync::oneshot;

/// A pid file's directory, opened without following links, and its file name.
struct Place {
    dir: OwnedFd,
    name: OsString,
    temp: OsString,
}

impl Place {
    /// Opens the directory of `path`, creating it (0700) if missing.
    fn open(path: &Path) -> io::Result<Self> {
        let dir = path.parent().filter(|dir| !dir.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name = path.file_name().ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?.to_owned();
        let flags = OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY;
        let dir = match nix::fcntl::open(dir, flags, Mode::empty()) {
            Err(Errno::ENOENT) => {
                std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
                nix::fcntl::open(dir, flags, Mode::empty())?
            }
            opened => opened?,
        };
        let mut temp = name.clone();
        temp.push(".tmp");
        Ok(Self { dir, name, temp })
    }

    /// Makes the file hold `pid` (0600), appearing whole: where there is none yet, an
    /// unnamed file linked in once written; otherwise a temporary file, renamed over.
    fn write(&self, pid: u32) -> io::Result<()> {
        // When it fails: EEXIST, one to replace (or something planted there, which the
        // rename replaces, never follows); otherwise no unnamed files here (an old kernel,
        // a file system without them, no /proc), or a failure the rename meets again.
        if self.link_new(pid).is_ok() {
            return Ok(());
        }
        let written =
            self.write_temporary(pid).and_then(|()| Ok(renameat(&self.dir, &*self.temp, &self.dir, &*self.name)?));
        if written.is_err() {
            let _gone = self.unlink(&self.temp);
        }
        written
    }

    /// Writes `pid` into an unnamed file of the directory (`O_TMPFILE`) and links it in at
    /// the file's name, which must be free: a new file, whole from its first appearance,
    /// with nothing to clean up if the agent dies before the link. One entry of the
    /// directory changes, where a temporary file and a rename change three.
    fn link_new(&self, pid: u32) -> io::Result<()> {
        let flags = OFlag::O_TMPFILE | OFlag::O_WRONLY | OFlag::O_CLOEXEC;
        let fd = openat(&self.dir, ".", flags, Mode::from_bits_truncate(0o600))?;
        let mut file = std::fs::File::from(fd);
        file.write_all(format!("{pid}\n").as_bytes())?;
        // Through /proc rather than AT_EMPTY_PATH, which needs CAP_DAC_READ_SEARCH; this
        // thread's own descriptor table, whatever the process's main thread holds.
        let source = format!("/proc/thread-self/fd/{}", file.as_raw_fd());
        Ok(linkat(AT_FDCWD, source.as_str(), &self.dir, &*self.name, AtFlags::AT_SYMLINK_FOLLOW)?)
    }

    fn write_temporary(&self, pid: u32) -> io::Result<()> {
        // A planted file or link at the temporary name is removed, never written through.
        self.unlink(&self.temp)?;
        let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let fd = openat(&self.dir, &*self.temp, flags, Mode::from_bits_truncate(0o600))?;
        std::fs::File::from(fd).write_all(format!("{pid}\n").as_bytes())
    }

    /// The pid the file names: `Ok(None)` when it is missing, `Err` when it is not a
    /// regular file holding a pid.
    fn read(&self) -> io::Result<Option<u32>> {
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
        let fd = match openat(&self.dir, &*self.name, flags, Mode::empty()) {
            Err(Errno::ENOENT) => return Ok(None),
            opened => opened?,
        };
        let mut file = std::fs::File::from(fd);
        if !file.metadata()?.is_file() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a regular file"));
        }
        let mut text = Vec::new();
        Read::by_ref(&mut file).take(32).read_to_end(&mut text)?;
        crate::proc::parse_pid_file(&text)
            .map(Some)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not a pid file"))
    }

    /// Removes the file if it names one of `pids`, or is not a pid file at all.
    fn remove_if(&self, pids: &[u32]) -> io::Result<()> {
        self.remove_where(|named| pids.contains(&named))
    }

    /// Removes the file if `names(pid)` holds for the pid it names, or if it is not a pid
    /// file at all.
    fn remove_where(&self, names: impl Fn(u32) -> bool) -> io::Result<()> {
        match self.read() {
            Ok(None) => Ok(()),
            Ok(Some(pid)) if !names(pid) => Ok(()),
            Ok(Some(_)) | Err(_) => self.unlink(&self.name),
        }
    }

    fn unlink(&self, name: &OsString) -> io::Result<()> {
        match unlinkat(&self.dir, &**name, UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => Ok(()),
            Err(errno) => Err(errno.into()),
        }
    }
}

/// The pid that the pid file at `path` names: `None` when it is missing, is not a regular
/// file holding a pid, or lies behind a link.
pub(crate) fn read(path: &Path) -> Option<u32> {
    let dir = path.parent().filter(|dir| !dir.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let flags = OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY;
    let dir = nix::fcntl::open(dir, flags, Mode::empty()).ok()?;
    let name = path.file_name()?.to_owned();
    let mut temp = name.clone();
    temp.push(".tmp");
    Place { dir, name, temp }.read().ok().flatten()
}

/// Writes `pid` to `path` atomically: a temporary file, then a rename; mode 0600.
#[cfg(test)]
pub(crate) fn write_atomically(path: &Path, pid: u32) -> io::Result<()> {
    Place::open(path)?.write(pid)
}

/// Removes `path` if it names `pid` (or no pid at all); a missing file is not an error.
pub(crate) fn remove(path: &Path, pid: u32) -> io::Result<()> {
    Place::open(path)?.remove_if(&[pid])
}

/// The most jobs handled together.
const MAX_BATCH: usize = 256;

/// The waits before a failed write is tried again: [`FIRST_RETRY`], doubling up to 30 s.
const RETRY_BACKOFF: Backoff = Backoff::new(FIRST_RETRY, Duration::from_secs(30));
/// The first wait before a failed write is tried again.
const FIRST_RETRY: Duration = Duration::from_millis(250);

/// What a batch leaves a path with, once its jobs are folded in order.
#[derive(Debug, Default)]
enum Outcome {
    /// No job for this path changes the file.
    #[default]
    Untouched,
    /// The file must hold this pid.
    Write(u32),
    /// The file must go: it was written in this batch, then its process stopped.
    Remove,
    /// The file must go if it names one of these pids (processes stopped since they were
    /// written in an earlier batch); a file that names another process is that process's.
    RemoveIf(Vec<u32>),
}

/// A write that failed, waiting for its next try.
struct Retry {
    pid: u32,
    at: Instant,
    backoff: Backoff,
}

/// The pid-file thread's state: the writes it still owes.
#[derive(Default)]
struct Writer {
    retries: HashMap<PathBuf, Retry>,
}

impl Writer {
    /// Handles a batch of jobs with the effect of handling them one by one, in order.
    fn run_batch(&mut self, batch: Vec<Job>) {
        let mut last: HashMap<PathBuf, (Outcome, Vec<Ack>)> = HashMap::new();
        for job in batch {
            match job {
                Job::Write { path, pid } => last.entry(path).or_default().0 = Outcome::Write(pid),
                Job::Remove { path, pid, done } => {
                    let (outcome, acks) = last.entry(path).or_default();
                    *outcome = match std::mem::take(outcome) {
                        Outcome::Write(written) if written == pid => Outcome::Remove,
                        Outcome::Write(other) => Outcome::Write(other),
                        Outcome::Remove => Outcome::Remove,
                        Outcome::Untouched => Outcome::RemoveIf(vec![pid]),
                        Outcome::RemoveIf(mut pids) => {
                            pids.push(pid);
                            Outcome::RemoveIf(pids)
                        }
                    };
                    acks.push(done);
                }
            }
        }
        for (path, (outcome, acks)) in last {
            let result = self.apply(&path, outcome);
            let error = result.as_ref().err().map(|error| (error.kind(), error.to_string()));
            for done in acks {
                let answer = match &error {
                    None => Ok(()),
                    Some((kind, message)) => Err(io::Error::new(*kind, message.clone())),
                };
                let _receiver_gone = done.send(answer);
            }
        }
    }

    /// Brings `path` to `outcome`; a failed write is queued for a retry.
    fn apply(&mut self, path: &Path, outcome: Outcome) -> io::Result<()> {
        match outcome {
            Outcome::Untouched => Ok(()),
            Outcome::Write(pid) => {
                let backoff = self.retries.remove(path).map_or(RETRY_BACKOFF, |retry| retry.backoff);
                self.write(path, pid, backoff);
                Ok(())
            }
            Outcome::Remove => {
                self.retries.remove(path);
                let place = Place::open(path)?;
                place.unlink(&place.name)
            }
            Outcome::RemoveIf(pids) => {
                if self.retries.get(path).is_some_and(|retry| pids.contains(&retry.pid)) {
                    self.retries.remove(path);
                }
                Place::open(path)?.remove_if(&pids)
            }
        }
    }

    /// Writes `pid` to `path`; on failure removes the file (it names an earlier
    /// instance) and schedules a retry after the next wait of `backoff`.
    fn write(&mut self, path: &Path, pid: u32, mut backoff: Backoff) {
        let place = Place::open(path);
        let written = match &place {
            Ok(place) => place.write(pid),
            Err(error) => Err(io::Error::new(error.kind(), error.to_string())),
        };
        let Err(error) = written else {
            if backoff.retries() > 0 {
                tracing::info!(path = %path.display(), pid, "pid file written after earlier failures");
            }
            return;
        };
        // The file still names the previous instance: without it, the next agent finds the
        // running one by its environment rather than trusting a stale pid.
        let stale_removed = place.and_then(|place| place.remove_where(|named| named != pid)).is_ok();
        let wait = backoff.next();
        tracing::warn!(
            path = %path.display(),
            pid,
            %error,
            stale_removed,
            retry_ms = wait.as_millis() as u64,
            "failed to write pid file; retrying"
        );
        self.retries.insert(path.to_owned(), Retry { pid, at: Instant::now() + wait, backoff });
    }

    /// The retries that are due, as write jobs.
    fn due(&mut self) -> Vec<Job> {
        let now = Instant::now();
        let due: Vec<PathBuf> =
            self.retries.iter().filter(|(_, retry)| retry.at <= now).map(|(path, _)| path.clone()).collect();
        due.into_iter()
            .filter_map(|path| {
                let pid = self.retries.get(&path)?.pid;
                Some(Job::Write { path, pid })
            })
            .collect()
    }

    /// How long the thread may wait for a job before a retry is due.
    fn idle_wait(&self) -> Option<Duration> {
        let next = self.retries.values().map(|retry| retry.at).min()?;
        Some(next.saturating_duration_since(Instant::now()))
    }
}

/// Acknowledges a removal.
type Ack = oneshot::Sender<io::Result<()>>;

enum Job {
    Write { path: PathBuf, pid: u32 },
    Remove { path: PathBuf, pid: u32, done: Ack },
}

/// The queue in front of the pid-file thread. Dropping it lets the thread finish the
/// queue and joins it.
pub(crate) struct PidFiles {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl PidFiles {
    pub(crate) fn start() -> io::Result<Self> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread = thread::Builder::new().name("tether-pidfiles".into()).spawn(move || {
            let mut writer = Writer::default();
            loop {
                let first = match writer.idle_wait() {
                    None => queue.recv().ok(),
                    Some(wait) => match queue.recv_timeout(wait) {
                        Ok(job) => Some(job),
                        Err(mpsc::RecvTimeoutError::Timeout) => None,
                        // The owner is gone: the writes it owed end with it.
                        Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    },
                };
                if first.is_none() && writer.idle_wait().is_none() {
                    break; // closed and nothing owed
                }
                let mut batch = writer.due();
                batch.extend(first);
                while batch.len() < MAX_BATCH {
                    match queue.try_recv() {
                        Ok(job) => batch.push(job),
                        Err(_empty_or_closed) => break,
                    }
                }
                writer.run_batch(batch);
            }
        })?;
        Ok(Self { jobs: Some(jobs), thread: Some(thread) })
    }

    /// Queues a write of `pid` to `path`; failures are logged and retried.
    pub(crate) fn write(&self, path: &Path, pid: u32) {
        if let Some(jobs) = &self.jobs {
            let _thread_gone = jobs.send(Job::Write { path: path.to_owned(), pid });
        }
    }

    /// Queues the removal of `path`, if it names `pid`, after every write queued before;
    /// failures are logged.
    pub(crate) fn forget(&self, path: &Path, pid: u32) {
        if let Some(jobs) = &self.jobs {
            let (done, _not_awaited) = oneshot::channel();
            let _thread_gone = jobs.send(Job::Remove { path: path.to_owned(), pid, done });
        }
    }

    /// Removes `path`, if it names `pid`, after every write queued before.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the removal happens whether or not the future is awaited to the end.
    pub(crate) async fn remove(&self, path: &Path, pid: u32) -> io::Result<()> {
        let (done, result) = oneshot::channel();
        let Some(jobs) = &self.jobs else {
            return remove(path, pid);
        };
        if jobs.send(Job::Remove { path: path.to_owned(), pid, done }).is_err() {
            return remove(path, pid);
        }
        result.await.unwrap_or_else(|_thread_gone| remove(path, pid))
    }
}

impl Drop for PidFiles {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _panicked = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::PermissionsExt;

    fn run_batch(batch: Vec<Job>) {
        Writer::default().run_batch(batch);
    }

    #[test]
    fn pid_files_are_private_and_replaced_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pids").join("web-proxy.pid");
        write_atomically(&path, 41).unwrap();
        write_atomically(&path, 42).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "42\n");
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(fs::metadata(path.parent().unwrap()).unwrap().permissions().mode() & 0o777, 0o700);
        let names: Vec<_> = fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["web-proxy.pid"], "no temporary file is left behind");
        remove(&path, 41).unwrap();
        assert!(path.exists(), "a file that names another process is that process's");
        remove(&path, 42).unwrap();
        remove(&path, 42).unwrap();
        assert!(!path.exists());
    }

    #[test]
    fn a_new_pid_file_is_linked_in_whole_without_a_temporary_name() {
        let dir = tempfile::tempdir().unwrap();
        let pids = dir.path().join("pids");
        fs::create_dir(&pids).unwrap();
        // The temporary name is taken by something that cannot be removed as a file: the
        // first write must not need it; the second, which replaces, does.
        fs::create_dir(pids.join("web-proxy.pid.tmp")).unwrap();
        write_atomically(&pids.join("web-proxy.pid"), 41).unwrap();
        assert_eq!(fs::read_to_string(pids.join("web-proxy.pid")).unwrap(), "41\n");
        assert_eq!(fs::metadata(pids.join("web-proxy.pid")).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(write_atomically(&pids.join("web-proxy.pid"), 42).is_err());
        assert_eq!(fs::read_to_string(pids.join("web-proxy.pid")).unwrap(), "41\n", "a failed replace leaves it whole");
    }

    #[test]
    fn a_planted_link_is_replaced_and_its_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        fs::write(&target, "precious\n").unwrap();
        let pids = dir.path().join("pids");
        fs::create_dir(&pids).unwrap();
        std::os::unix::fs::symlink(&target, pids.join("web-proxy.pid")).unwrap();
        std::os::unix::fs::symlink(&target, pids.join("web-proxy.pid.tmp")).unwrap();
        write_atomically(&pids.join("web-proxy.pid"), 7).unwrap();
        assert_eq!(fs::read_to_string(&target).unwrap(), "precious\n");
        assert!(fs::symlink_metadata(pids.join("web-proxy.pid")).unwrap().is_file());
        assert_eq!(fs::read_to_string(pids.join("web-proxy.pid")).unwrap(), "7\n");
        // A link in place of the file is removed on stop, not followed.
        fs::remove_file(pids.join("web-proxy.pid")).unwrap();
        std::os::unix::fs::symlink(&target, pids.join("web-proxy.pid")).unwrap();
        remove(&pids.join("web-proxy.pid"), 7).unwrap();
        assert!(fs::symlink_metadata(pids.join("web-proxy.pid")).is_err());
        assert_eq!(fs::read_to_string(&target).unwrap(), "precious\n");
        // A linked directory is refused.
        let elsewhere = dir.path().join("elsewhere");
        fs::create_dir(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, dir.path().join("linked")).unwrap();
        assert!(write_atomically(&dir.path().join("linked").join("x.pid"), 1).is_err());
        assert_eq!(fs::read_dir(&elsewhere).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn a_batch_has_the_effect_of_its_jobs_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let (kept, removed, rewritten) = (dir.path().join("k.pid"), dir.path().join("r.pid"), dir.path().join("w.pid"));
        let (first_done, first) = oneshot::channel();
        let (second_done, second) = oneshot::channel();
        let (third_done, third) = oneshot::channel();
        run_batch(vec![
            Job::Write { path: kept.clone(), pid: 10 },
            Job::Write { path: removed.clone(), pid: 11 },
            Job::Remove { path: removed.clone(), pid: 11, done: first_done },
            Job::Remove { path: rewritten.clone(), pid: 9, done: second_done },
            Job::Write { path: rewritten.clone(), pid: 12 },
            Job::Write { path: kept.clone(), pid: 13 },
            Job::Remove { path: removed.clone(), pid: 11, done: third_done },
        ]);
        assert_eq!(fs::read_to_string(&kept).unwrap(), "13\n");
        assert!(!removed.exists());
        assert_eq!(fs::read_to_string(&rewritten).unwrap(), "12\n");
        for done in [first, second, third] {
            done.await.unwrap().unwrap();
        }
        let mut names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["k.pid", "w.pid"], "no temporary file is left behind");
    }

    #[tokio::test]
    async fn stopping_one_instance_keeps_the_file_of_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.pid");
        let (done, removed) = oneshot::channel();
        // The kept instance's write comes first; the duplicate's stop must not undo it.
        run_batch(vec![Job::Write { path: path.clone(), pid: 20 }, Job::Remove { path: path.clone(), pid: 21, done }]);
        removed.await.unwrap().unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "20\n");
        let (done, removed) = oneshot::channel();
        run_batch(vec![Job::Remove { path: path.clone(), pid: 21, done }]);
        removed.await.unwrap().unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "20\n");
    }

    #[test]
    fn a_failed_write_removes_the_stale_file_and_is_retried() {
        let dir = tempfile::tempdir().unwrap();
        let pids = dir.path().join("pids");
        let path = pids.join("web-proxy.pid");
        write_atomically(&path, 5).unwrap();
        // A directory at the temporary name makes the write fail, as a full disk would.
        fs::create_dir(pids.join("web-proxy.pid.tmp")).unwrap();
        let mut writer = Writer::default();
        writer.run_batch(vec![Job::Write { path: path.clone(), pid: 6 }]);
        assert!(!path.exists(), "the pid of the previous instance is not left behind");
        assert_eq!(writer.retries.get(&path).map(|retry| retry.pid), Some(6));
        assert!(writer.idle_wait().is_some_and(|wait| wait <= FIRST_RETRY));
        fs::remove_dir(pids.join("web-proxy.pid.tmp")).unwrap();
        std::thread::sleep(FIRST_RETRY);
        let due = writer.due();
        assert_eq!(due.len(), 1);
        writer.run_batch(due);
        assert_eq!(fs::read_to_string(&path).unwrap(), "6\n");
        assert!(writer.retries.is_empty());
    }

    #[tokio::test]
    async fn queued_writes_and_removals_stay_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.pid");
        let pid_files = PidFiles::start().unwrap();
        for pid in 2..50 {
            pid_files.write(&path, pid);
        }
        pid_files.remove(&path, 49).await.unwrap();
        assert!(!path.exists());
        pid_files.write(&path, 7);
        drop(pid_files);
        assert_eq!(fs::read_to_string(&path).unwrap(), "7\n");
    }
}
