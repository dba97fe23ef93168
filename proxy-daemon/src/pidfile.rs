//! Pid files: written atomically on every start, removed on stop.
//!
//! This module owns the one thread that writes and removes pid files, so that the
//! `fsync` each write needs stays off the spawn path and writes to one file stay in
//! order. It never writes a file other than the pid files and their temporary siblings,
//! and never reads them (adoption does, in `supervisor`).

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread;

use tokio::sync::oneshot;

/// Writes `pid` to `path` atomically: a temporary file, fsync, rename; mode 0600.
#[cfg(test)]
pub(crate) fn write_atomically(path: &Path, pid: u32) -> io::Result<()> {
    let (temp, file) = write_temporary(path, pid)?;
    file.sync_all()?;
    drop(file);
    fs::rename(&temp, path)
}

/// Writes `pid` to the temporary sibling of `path` (0600), creating the directory
/// (0700); returns it unsynced.
fn write_temporary(path: &Path, pid: u32) -> io::Result<(PathBuf, fs::File)> {
    let dir = path.parent().unwrap_or(Path::new("."));
    if !dir.is_dir() {
        fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    }
    let mut temp_name = path.file_name().unwrap_or_default().to_owned();
    temp_name.push(".tmp");
    let temp = dir.join(temp_name);
    let mut file = fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&temp)?;
    file.write_all(format!("{pid}\n").as_bytes())?;
    Ok((temp, file))
}

/// Removes `path`; a missing file is not an error.
pub(crate) fn remove(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(error),
        _ => Ok(()),
    }
}

/// The most jobs handled together: one journal commit serves them all.
const MAX_BATCH: usize = 256;

/// Handles a batch of jobs with the effect of handling them one by one, in order.
///
/// Only the last job for each path matters: earlier writes are superseded, and earlier
/// removals are acknowledged once the last job for their path is done. The writes are
/// done in three passes (write every temporary file, fsync each, rename each) so that a
/// burst of starts costs one journal commit rather than one per file, and does not stall
/// the spawner's own file creation behind a queue of commits.
fn run_batch(batch: Vec<Job>) {
    // Per path: the pid of its last write (if the last job is a write) and every removal
    // waiting for an acknowledgement.
    let mut last: HashMap<PathBuf, (Option<u32>, Vec<Ack>)> = HashMap::new();
    for job in batch {
        match job {
            Job::Write { path, pid } => last.entry(path).or_default().0 = Some(pid),
            Job::Remove { path, done } => {
                let entry = last.entry(path).or_default();
                entry.0 = None;
                entry.1.push(done);
            }
        }
    }
    let mut written = Vec::new();
    for (path, (pid, removals)) in last {
        match pid {
            Some(pid) => {
                // A later write superseded these removals; they took effect in between.
                for done in removals {
                    let _receiver_gone = done.send(Ok(()));
                }
                match write_temporary(&path, pid) {
                    Ok((temp, file)) => written.push((path, temp, file)),
                    Err(error) => tracing::warn!(path = %path.display(), pid, %error, "failed to write pid file"),
                }
            }
            None => {
                let result = remove(&path);
                let mut removals = removals.into_iter();
                if let Some(last_removal) = removals.next_back() {
                    for done in removals {
                        let _receiver_gone = done.send(Ok(()));
                    }
                    let _receiver_gone = last_removal.send(result);
                }
            }
        }
    }
    let synced: Vec<_> = written
        .into_iter()
        .filter_map(|(path, temp, file)| match file.sync_all() {
            Ok(()) => Some((path, temp)),
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "failed to sync pid file");
                let _ = fs::remove_file(&temp);
                None
            }
        })
        .collect();
    for (path, temp) in synced {
        if let Err(error) = fs::rename(&temp, &path) {
            tracing::warn!(path = %path.display(), %error, "failed to install pid file");
        }
    }
}

/// Acknowledges a removal.
type Ack = oneshot::Sender<io::Result<()>>;

enum Job {
    Write { path: PathBuf, pid: u32 },
    Remove { path: PathBuf, done: Ack },
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
            while let Ok(first) = queue.recv() {
                let mut batch = vec![first];
                while batch.len() < MAX_BATCH {
                    match queue.try_recv() {
                        Ok(job) => batch.push(job),
                        Err(_empty_or_closed) => break,
                    }
                }
                run_batch(batch);
            }
        })?;
        Ok(Self { jobs: Some(jobs), thread: Some(thread) })
    }

    /// Queues a write of `pid` to `path`; failures are logged.
    pub(crate) fn write(&self, path: &Path, pid: u32) {
        if let Some(jobs) = &self.jobs {
            let _thread_gone = jobs.send(Job::Write { path: path.to_owned(), pid });
        }
    }

    /// Removes `path` after every write queued before.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the removal happens whether or not the future is awaited to the end.
    pub(crate) async fn remove(&self, path: &Path) -> io::Result<()> {
        let (done, result) = oneshot::channel();
        let Some(jobs) = &self.jobs else {
            return remove(path);
        };
        if jobs.send(Job::Remove { path: path.to_owned(), done }).is_err() {
            return remove(path);
        }
        result.await.unwrap_or_else(|_thread_gone| remove(path))
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
    use std::os::unix::fs::PermissionsExt;

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
        remove(&path).unwrap();
        remove(&path).unwrap();
        assert!(!path.exists());
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
            Job::Remove { path: removed.clone(), done: first_done },
            Job::Remove { path: rewritten.clone(), done: second_done },
            Job::Write { path: rewritten.clone(), pid: 12 },
            Job::Write { path: kept.clone(), pid: 13 },
            Job::Remove { path: removed.clone(), done: third_done },
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
    async fn queued_writes_and_removals_stay_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.pid");
        let pid_files = PidFiles::start().unwrap();
        for pid in 2..50 {
            pid_files.write(&path, pid);
        }
        pid_files.remove(&path).await.unwrap();
        assert!(!path.exists());
        pid_files.write(&path, 7);
        drop(pid_files);
        assert_eq!(fs::read_to_string(&path).unwrap(), "7\n");
    }
}
