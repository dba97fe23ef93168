//! The snapshot of what runs: its format, the [`SnapshotStore`] seam, the file store behind
//! `snapshot.json`, an in-memory store for tests, and the task that writes it.
//!
//! This module owns persistence of running proxies and must never hold a secret: tokens
//! appear only as [`TokenFingerprint`]s. It never writes on a timer, and never writes
//! content that equals what was last written.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::status::Published;
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tether_state::persist::{self, PersistError};
use tether_state::{ProxyId, TokenFingerprint};
use tokio::sync::{mpsc, oneshot, watch};

/// The version of the snapshot format this crate writes and reads.
pub const SNAPSHOT_VERSION: u32 = 1;

/// What the snapshot keeps of one running proxy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyRecord {
    /// The proxy.
    pub id: ProxyId,
    /// The service the process was started from, in the register API's JSON schema, or
    /// `None` when unknown (a proxy adopted without a snapshot).
    pub service: Option<serde_json::Value>,
    /// The fingerprint of the token the process was started with, never the token.
    pub token: Option<TokenFingerprint>,
    /// The backend's own record ([`crate::ProxyHandle::record`]), opaque to the engine.
    pub backend: serde_json::Value,
}

/// Every proxy that ran when the snapshot was taken, ordered by id.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// The proxies.
    pub proxies: Vec<ProxyRecord>,
}

/// A snapshot that could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// The snapshot could not be read, or held something else than a snapshot; it was moved
    /// aside (to `moved_to`, when that worked).
    #[error("the snapshot {} is unusable", .path.display())]
    Corrupt {
        /// Where it was.
        path: PathBuf,
        /// Where it is now.
        moved_to: Option<PathBuf>,
        /// What was wrong with it.
        #[source]
        source: BoxedCause,
    },
    /// The snapshot could not be encoded.
    #[error("cannot encode the snapshot")]
    Encode {
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The snapshot could not be written; the previous one, if any, is intact.
    #[error("cannot write the snapshot")]
    Write {
        /// Why.
        #[source]
        source: PersistError,
    },
    /// The task writing the snapshot is gone.
    #[error("the snapshot writer stopped")]
    WriterGone,
}

/// The cause of a [`SnapshotError::Corrupt`].
pub type BoxedCause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A snapshot written by a format this crate does not read.
#[derive(Debug, thiserror::Error)]
#[error("unknown snapshot format version {found}, expected {SNAPSHOT_VERSION}")]
pub struct UnknownVersion {
    /// The version found.
    pub found: u32,
}

/// Where the engine keeps its [`Snapshot`].
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait SnapshotStore: Send + Sync {
    /// Reads the snapshot back; `Ok(None)` when there is none.
    ///
    /// # Errors
    ///
    /// [`SnapshotError::Corrupt`] after moving an unreadable snapshot aside.
    async fn load(&self) -> Result<Option<Snapshot>, SnapshotError>;

    /// Replaces the snapshot, atomically.
    ///
    /// # Errors
    ///
    /// [`SnapshotError::Encode`] or [`SnapshotError::Write`]; the old snapshot is then intact.
    async fn save(&self, snapshot: Snapshot) -> Result<(), SnapshotError>;
}

#[derive(Serialize)]
struct FileOut<'a> {
    version: u32,
    proxies: &'a [ProxyRecord],
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileIn {
    version: u32,
    proxies: Vec<ProxyRecord>,
}

#[derive(Deserialize)]
struct VersionOnly {
    version: u32,
}

/// The snapshot as a file (`snapshot.json` in the data dir), mode 0600, written through
/// [`persist::write_atomic`], with a format version.
#[derive(Debug, Clone)]
pub struct FileSnapshotStore {
    path: PathBuf,
}

impl FileSnapshotStore {
    /// A store at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// The store at the data dir's `snapshot.json`.
    pub fn in_data_dir(dir: &persist::DataDir) -> Self {
        Self::new(dir.snapshot_path())
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn load_blocking(path: &Path) -> Result<Option<Snapshot>, SnapshotError> {
        let problem: BoxedCause = match fs::read(path) {
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(err) => Box::new(err),
            Ok(bytes) => match serde_json::from_slice::<VersionOnly>(&bytes) {
                Ok(VersionOnly { version }) if version != SNAPSHOT_VERSION => {
                    Box::new(UnknownVersion { found: version })
                }
                Ok(_) => match serde_json::from_slice::<FileIn>(&bytes) {
                    Ok(file) if file.version == SNAPSHOT_VERSION => {
                        return Ok(Some(Snapshot { proxies: file.proxies }));
                    }
                    Ok(file) => Box::new(UnknownVersion { found: file.version }),
                    Err(err) => Box::new(err),
                },
                Err(err) => Box::new(err),
            },
        };
        let moved_to = persist::quarantine(path).ok();
        Err(SnapshotError::Corrupt { path: path.to_owned(), moved_to, source: problem })
    }

    fn save_blocking(path: &Path, snapshot: &Snapshot) -> Result<(), SnapshotError> {
        let file = FileOut { version: SNAPSHOT_VERSION, proxies: &snapshot.proxies };
        let bytes = serde_json::to_vec_pretty(&file).map_err(|source| SnapshotError::Encode { source })?;
        persist::write_atomic(path, &bytes).map_err(|source| SnapshotError::Write { source })
    }
}

#[async_trait]
impl SnapshotStore for FileSnapshotStore {
    async fn load(&self) -> Result<Option<Snapshot>, SnapshotError> {
        let path = self.path.clone();
        // File I/O and fsync block: keep them off the engine's worker threads.
        match tokio::task::spawn_blocking(move || Self::load_blocking(&path)).await {
            Ok(result) => result,
            Err(join) => std::panic::resume_unwind(join.into_panic()),
        }
    }

    async fn save(&self, snapshot: Snapshot) -> Result<(), SnapshotError> {
        let path = self.path.clone();
        match tokio::task::spawn_blocking(move || Self::save_blocking(&path, &snapshot)).await {
            Ok(result) => result,
            Err(join) => std::panic::resume_unwind(join.into_panic()),
        }
    }
}

/// A snapshot store in memory, for tests and for agents that persist nothing (`--dev`).
#[derive(Debug)]
pub struct MemorySnapshotStore {
    content: Mutex<MemoryContent>,
    saves: watch::Sender<usize>,
}

#[derive(Debug, Default)]
struct MemoryContent {
    snapshot: Option<Snapshot>,
    corrupt: bool,
}

impl Default for MemorySnapshotStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemorySnapshotStore {
    /// An empty store.
    pub fn new() -> Self {
        Self { content: Mutex::new(MemoryContent::default()), saves: watch::Sender::new(0) }
    }

    /// A store that holds `snapshot`.
    pub fn with_snapshot(snapshot: Snapshot) -> Self {
        let store = Self::new();
        store.lock().snapshot = Some(snapshot);
        store
    }

    /// A store whose snapshot is damaged: the first load reports it corrupt and empties it.
    pub fn corrupt() -> Self {
        let store = Self::new();
        store.lock().corrupt = true;
        store
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoryContent> {
        self.content.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The snapshot last saved (or given).
    pub fn snapshot(&self) -> Option<Snapshot> {
        self.lock().snapshot.clone()
    }

    /// The number of saves so far, updated on every save.
    pub fn saves(&self) -> watch::Receiver<usize> {
        self.saves.subscribe()
    }
}

#[async_trait]
impl SnapshotStore for MemorySnapshotStore {
    async fn load(&self) -> Result<Option<Snapshot>, SnapshotError> {
        let mut content = self.lock();
        if std::mem::take(&mut content.corrupt) {
            content.snapshot = None;
            let source = Box::new(UnknownVersion { found: 0 });
            return Err(SnapshotError::Corrupt { path: PathBuf::from("memory"), moved_to: None, source });
        }
        Ok(content.snapshot.clone())
    }

    async fn save(&self, snapshot: Snapshot) -> Result<(), SnapshotError> {
        self.lock().snapshot = Some(snapshot);
        self.saves.send_modify(|saves| *saves += 1);
        Ok(())
    }
}

/// A change for the [`writer`] task.
#[derive(Debug)]
pub(crate) enum WriterMessage {
    /// A proxy runs, as this record says.
    Put(ProxyRecord),
    /// Nothing runs for this proxy any more.
    Remove(ProxyId),
    /// Write now if anything changed, and report how that went.
    Flush(oneshot::Sender<Result<(), SnapshotError>>),
}

/// The sending half of the snapshot writer.
pub(crate) type WriterSender = mpsc::UnboundedSender<WriterMessage>;

/// Keeps the snapshot equal to `records` as changes arrive, writing once per burst of
/// changes and only when the content differs from what was last written. Ends when every
/// sender is gone.
///
/// The engine sends changes and never waits for a write, so a write of a large snapshot
/// costs the engine nothing per change.
pub(crate) async fn writer(
    store: Arc<dyn SnapshotStore>,
    mut messages: mpsc::UnboundedReceiver<WriterMessage>,
    mut records: BTreeMap<ProxyId, ProxyRecord>,
    saved: Option<Snapshot>,
    published: Published,
) {
    let mut saved = saved.unwrap_or_default();
    let mut dirty = true;
    let mut retry = Retry::default();
    retry.after(save_if_changed(&*store, &records, &mut saved, &mut dirty, &published).await);
    loop {
        let first = tokio::select! {
            message = messages.recv() => match message {
                Some(message) => Some(message),
                None => break,
            },
            // A failed write is retried on its own, so that a snapshot that names a dead
            // pid does not wait for the next change (the disk may be full for a while).
            () = retry.wait(), if retry.pending() => None,
        };
        let mut next = first;
        while let Some(message) = next.take().or_else(|| messages.try_recv().ok()) {
            match message {
                WriterMessage::Put(record) => {
                    if records.get(&record.id) != Some(&record) {
                        records.insert(record.id.clone(), record);
                        dirty = true;
                    }
                }
                WriterMessage::Remove(id) => dirty |= records.remove(&id).is_some(),
                WriterMessage::Flush(reply) => {
                    let result = save_if_changed(&*store, &records, &mut saved, &mut dirty, &published).await;
                    let _ = reply.send(result);
                }
            }
        }
        retry.after(save_if_changed(&*store, &records, &mut saved, &mut dirty, &published).await);
    }
}

/// When to try a failed snapshot write again: 1 s after the first failure, doubling up to
/// [`MAX_RETRY`], and not at all once a write succeeded.
#[derive(Default)]
struct Retry {
    at: Option<tokio::time::Instant>,
    delay: Duration,
}

/// The longest wait between two attempts to write a snapshot that failed.
const MAX_RETRY: Duration = Duration::from_secs(30);

impl Retry {
    fn after(&mut self, result: Result<(), SnapshotError>) {
        if result.is_ok() {
            *self = Self::default();
            return;
        }
        self.delay = if self.delay.is_zero() { Duration::from_secs(1) } else { (self.delay * 2).min(MAX_RETRY) };
        self.at = Some(tokio::time::Instant::now() + self.delay);
    }

    fn pending(&self) -> bool {
        self.at.is_some()
    }

    async fn wait(&self) {
        match self.at {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    }
}

async fn save_if_changed(
    store: &dyn SnapshotStore,
    records: &BTreeMap<ProxyId, ProxyRecord>,
    saved: &mut Snapshot,
    dirty: &mut bool,
    published: &Published,
) -> Result<(), SnapshotError> {
    if !*dirty {
        return Ok(());
    }
    let snapshot = Snapshot { proxies: records.values().cloned().collect() };
    if snapshot == *saved {
        *dirty = false;
        return Ok(());
    }
    match store.save(snapshot.clone()).await {
        Ok(()) => {
            tracing::debug!(proxies = snapshot.proxies.len(), "snapshot written");
            published.lock().stats.snapshot_writes += 1;
            *saved = snapshot;
            *dirty = false;
            Ok(())
        }
        Err(err) => {
            // Stay dirty: the next change or flush tries again.
            tracing::warn!(error = %crate::error_chain(&err), "cannot write the snapshot");
            published.lock().stats.snapshot_failures += 1;
            Err(err)
        }
    }
}

#[cfg(test)]
mod tests;
