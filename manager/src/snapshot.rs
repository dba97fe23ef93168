//! The snapshot of what runs: its format, the [`SnapshotStore`] seam, the file store behind
//! `snapshot.json`, an in-memory store for tests, and the task that writes it.
//!
//! This module owns persistence of running proxies and must never hold a secret: tokens
//! appear only as [`TokenFingerprint`]s. It never writes on a timer, and never writes
//! content that equals what was last written. Each record is encoded once, when it
//! changes, and kept only in that form: a write joins the encoded records, shared between
//! the current and the last written content, and copies none of them.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::backend::BackendRecord;
use crate::status::Published;
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tether_state::persist::{self, PersistError};
use tether_state::{Backoff, ProxyId, Service, TokenFingerprint};
use tokio::sync::{mpsc, oneshot, watch};

/// The version of the snapshot format this crate writes. It reads this one and every
/// earlier one ([`OLDEST_SNAPSHOT_VERSION`] on), migrating them.
///
/// Version 2 (this one) holds each service in the schema's own form, in the schema's field
/// order, and each backend record as the backend wrote it, both compact (JSON whitespace
/// aside, a record reads the same either way). Version 1 held services
/// as generic JSON values (keys sorted) and backend records re-encoded by the engine; its
/// services read through the same schema, and its backend records go to the backend
/// unchanged, which migrates its own.
pub const SNAPSHOT_VERSION: u32 = 2;

/// The oldest snapshot format this crate reads.
pub const OLDEST_SNAPSHOT_VERSION: u32 = 1;

/// What the snapshot keeps of one running proxy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyRecord {
    /// The proxy.
    pub id: ProxyId,
    /// The service the process was started from (stored in the register API's schema), or
    /// `None` when unknown (a proxy adopted without a snapshot).
    pub service: Option<Service>,
    /// The fingerprint of the token the process was started with, never the token.
    pub token: Option<TokenFingerprint>,
    /// The backend's own record ([`crate::ProxyHandle::record`]), opaque to the engine.
    pub backend: BackendRecord,
}

/// Every proxy that ran when the snapshot was taken, ordered by id.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// The proxies.
    pub proxies: Vec<ProxyRecord>,
    /// The format version it was read from, when that is older than [`SNAPSHOT_VERSION`]:
    /// the engine then writes it again in the current format once restore is done.
    #[serde(skip)]
    pub migrated_from: Option<u32>,
}

impl Snapshot {
    /// A snapshot of `proxies`, in the current format.
    pub fn new(proxies: Vec<ProxyRecord>) -> Self {
        Self { proxies, migrated_from: None }
    }
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
#[error("unknown snapshot format version {found}, expected {OLDEST_SNAPSHOT_VERSION} to {SNAPSHOT_VERSION}")]
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
    async fn save(&self, snapshot: EncodedSnapshot) -> Result<(), SnapshotError>;
}

/// A [`Snapshot`] in the form it is stored: the text of `snapshot.json`, pretty-printed
/// JSON with a format version, assembled from records that are each encoded once.
///
/// Cloning shares the encoded records; writing one copies none of them.
///
/// ```
/// use tether_manager::{EncodedSnapshot, Snapshot};
///
/// let empty = EncodedSnapshot::encode(&Snapshot::default()).unwrap();
/// assert_eq!(empty.to_bytes(), b"{\n  \"version\": 2,\n  \"proxies\": []\n}");
/// assert_eq!(empty.decode().unwrap(), Snapshot::default());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncodedSnapshot {
    records: Vec<EncodedRecord>,
}

impl EncodedSnapshot {
    /// Encodes `snapshot`, its records in the order given.
    ///
    /// # Errors
    ///
    /// [`SnapshotError::Encode`] when a record cannot be encoded.
    pub fn encode(snapshot: &Snapshot) -> Result<Self, SnapshotError> {
        let records = snapshot.proxies.iter().map(EncodedRecord::from_record).collect::<Result<_, _>>();
        Ok(Self { records: records.map_err(|source| SnapshotError::Encode { source })? })
    }

    /// The number of proxies it holds.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether it holds no proxy.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Writes the text of the file to `out`.
    ///
    /// # Errors
    ///
    /// The errors of `out`.
    pub fn write_to(&self, out: &mut dyn Write) -> io::Result<()> {
        write!(out, "{{\n  \"version\": {SNAPSHOT_VERSION},\n  \"proxies\": ")?;
        if self.records.is_empty() {
            out.write_all(b"[]")?;
        } else {
            out.write_all(b"[\n")?;
            for (index, record) in self.records.iter().enumerate() {
                if index > 0 {
                    out.write_all(b",\n")?;
                }
                record.write_to(out)?;
            }
            out.write_all(b"\n  ]")?;
        }
        out.write_all(b"\n}")
    }

    /// The text of the file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes =
            Vec::with_capacity(self.records.iter().map(|record| record.len_guess() + 2).sum::<usize>() + 64);
        self.write_to(&mut bytes).unwrap_or_else(|_| unreachable!("writing to a Vec cannot fail"));
        bytes
    }

    /// Decodes the text back into a [`Snapshot`].
    ///
    /// # Errors
    ///
    /// When the text is not a snapshot of this format version (it always is, unless the
    /// records it was assembled from were not encoded by this crate).
    pub fn decode(&self) -> Result<Snapshot, BoxedCause> {
        decode(&self.to_bytes())
    }
}

/// One [`ProxyRecord`] as it appears in `snapshot.json`: pretty-printed and indented for its
/// place in the list of proxies. Shared, never copied, between the writer's current and
/// last written content.
///
/// Its service is the value the engine runs the proxy from ([`EncodedService`]), shared
/// rather than kept as text: it is encoded when the record is written, so that the engine
/// holds no second form of every service (at 10 000 proxies its text would be 4 MiB).
#[derive(Debug, Clone)]
pub(crate) struct EncodedRecord {
    /// The record's text but for its service's value: up to `split` what comes before it
    /// (or the whole record), then what comes after. One allocation: every proxy has one.
    text: Arc<str>,
    split: usize,
    service: Option<EncodedService>,
}

/// The indentation of a record in the file: it is an element of the list in `proxies`.
const RECORD_INDENT: &str = "    ";

/// The indentation of a record's fields.
const FIELD_INDENT: &str = "      ";

/// Room for a service's compact text when the size of a file is guessed ahead of a write.
const SERVICE_TEXT_GUESS: usize = 512;

impl EncodedRecord {
    /// The encoding of `record`.
    pub(crate) fn from_record(record: &ProxyRecord) -> Result<Self, serde_json::Error> {
        let service = record.service.as_ref().map(|service| EncodedService::new(Arc::new(service.clone())));
        Self::new(&record.id, service.as_ref(), record.token.as_ref(), &record.backend)
    }

    /// The encoding of `ProxyRecord { id, service, token, backend }`, the service shared:
    /// the record pretty-printed, its service and backend record compact.
    pub(crate) fn new(
        id: &ProxyId,
        service: Option<&EncodedService>,
        token: Option<&TokenFingerprint>,
        backend: &BackendRecord,
    ) -> Result<Self, serde_json::Error> {
        let field = FIELD_INDENT;
        let token = serde_json::to_string(&token)?;
        let mut text =
            format!("{RECORD_INDENT}{{\n{field}\"id\": {},\n{field}\"service\": ", serde_json::to_string(id)?);
        if service.is_none() {
            text.push_str("null");
        }
        let split = text.len();
        // As the backend wrote it: raw JSON is copied, never re-formatted.
        let backend = backend.as_json();
        // Writing into a `String` cannot fail.
        let _infallible =
            write!(text, ",\n{field}\"token\": {token},\n{field}\"backend\": {backend}\n{RECORD_INDENT}}}");
        Ok(Self { text: text.into(), split, service: service.cloned() })
    }

    /// Up to the service's value (or the whole record).
    fn head(&self) -> &str {
        &self.text[..self.split]
    }

    /// After the service's value.
    fn tail(&self) -> &str {
        &self.text[self.split..]
    }

    /// About how long its text is: exact but for the service's.
    fn len_guess(&self) -> usize {
        self.text.len() + self.service.as_ref().map_or(0, |_| SERVICE_TEXT_GUESS)
    }

    fn write_to(&self, out: &mut dyn Write) -> io::Result<()> {
        out.write_all(self.head().as_bytes())?;
        if let Some(service) = &self.service {
            serde_json::to_writer(&mut *out, &*service.0)?;
        }
        out.write_all(self.tail().as_bytes())
    }
}

impl PartialEq for EncodedRecord {
    /// The same text: the same pieces around the same service.
    fn eq(&self, other: &Self) -> bool {
        self.split == other.split && self.text == other.text && self.service == other.service
    }
}

impl Eq for EncodedRecord {}

/// The service of a record: the engine's own value, shared, and encoded (compact: every
/// field of the schema is written out, and indentation would double its size) each time the
/// record is written. Its record can thus be encoded again, when its process changes,
/// without the service's value, and costs the engine no copy of it.
#[derive(Debug, Clone)]
pub(crate) struct EncodedService(Arc<Service>);

impl EncodedService {
    pub(crate) fn new(service: Arc<Service>) -> Self {
        Self(service)
    }
}

impl PartialEq for EncodedService {
    /// The same value; the same one shared, without a look at its fields.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

impl Eq for EncodedService {}

/// Reads the text of a snapshot file.
///
/// Every version from [`OLDEST_SNAPSHOT_VERSION`] has the same envelope and record fields;
/// what differs is how their values were written (see [`SNAPSHOT_VERSION`]), and the
/// schema reads a service in either form. A version this crate does not know is refused
/// before its records are read.
fn decode(bytes: &[u8]) -> Result<Snapshot, BoxedCause> {
    let known = OLDEST_SNAPSHOT_VERSION..=SNAPSHOT_VERSION;
    match serde_json::from_slice::<VersionOnly>(bytes) {
        Ok(VersionOnly { version }) if !known.contains(&version) => Err(Box::new(UnknownVersion { found: version })),
        Ok(_) => match serde_json::from_slice::<FileIn>(bytes) {
            Ok(file) => {
                let migrated_from = (file.version != SNAPSHOT_VERSION).then_some(file.version);
                Ok(Snapshot { proxies: file.proxies, migrated_from })
            }
            Err(err) => Err(Box::new(err)),
        },
        Err(err) => Err(Box::new(err)),
    }
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

/// The snapshot as a file (`snapshot.json` in the data dir), mode 0600, replaced whole
/// through [`persist::write_atomic_with`] (renamed into place, not fsynced), with a format
/// version.
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
        // Not through a link planted at the snapshot's name: that is reported and moved aside.
        let problem = match persist::read_no_follow(path) {
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(err) => Box::new(err),
            Ok(bytes) => match decode(&bytes) {
                Ok(snapshot) => return Ok(Some(snapshot)),
                Err(problem) => problem,
            },
        };
        let moved_to = persist::quarantine(path).ok();
        Err(SnapshotError::Corrupt { path: path.to_owned(), moved_to, source: problem })
    }

    fn save_blocking(path: &Path, snapshot: &EncodedSnapshot) -> Result<(), SnapshotError> {
        // Streamed into the file: the whole text never exists in memory at once. Durability
        // class: the snapshot describes processes that die with the machine (the boot id
        // rejects its records after a reboot), so the rename protects it against an agent
        // crash and no fsync is needed.
        persist::write_atomic_with(path, persist::Durability::Crash, |out| snapshot.write_to(out))
            .map_err(|source| SnapshotError::Write { source })
    }
}

#[async_trait]
impl SnapshotStore for FileSnapshotStore {
    async fn load(&self) -> Result<Option<Snapshot>, SnapshotError> {
        let path = self.path.clone();
        // File I/O blocks: keep it off the engine's worker threads.
        match tokio::task::spawn_blocking(move || Self::load_blocking(&path)).await {
            Ok(result) => result,
            Err(join) => std::panic::resume_unwind(join.into_panic()),
        }
    }

    async fn save(&self, snapshot: EncodedSnapshot) -> Result<(), SnapshotError> {
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
    snapshot: Option<EncodedSnapshot>,
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
    ///
    /// # Panics
    ///
    /// When `snapshot` cannot be encoded.
    pub fn with_snapshot(snapshot: Snapshot) -> Self {
        let store = Self::new();
        store.lock().snapshot = Some(EncodedSnapshot::encode(&snapshot).expect("a snapshot can be encoded"));
        store
    }

    /// A store whose snapshot is damaged: the first load reports it corrupt and empties it.
    pub fn corrupt() -> Self {
        let store = Self::new();
        store.lock().corrupt = true;
        store
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoryContent> {
        tether_state::lock(&self.content)
    }

    /// The snapshot last saved (or given), decoded.
    ///
    /// # Panics
    ///
    /// When what was saved does not decode: it was not encoded by this crate.
    pub fn snapshot(&self) -> Option<Snapshot> {
        let saved = self.lock().snapshot.clone();
        saved.map(|saved| saved.decode().expect("a saved snapshot decodes"))
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
        let saved = content.snapshot.clone();
        drop(content);
        saved.map(|saved| saved.decode()).transpose().map_err(|source| SnapshotError::Corrupt {
            path: PathBuf::from("memory"),
            moved_to: None,
            source,
        })
    }

    async fn save(&self, snapshot: EncodedSnapshot) -> Result<(), SnapshotError> {
        self.lock().snapshot = Some(snapshot);
        self.saves.send_modify(|saves| *saves += 1);
        Ok(())
    }
}

/// A change for the [`writer`] task.
#[derive(Debug)]
pub(crate) enum WriterMessage {
    /// A proxy runs, as this record says.
    Put(ProxyId, EncodedRecord),
    /// Nothing runs for this proxy any more.
    Remove(ProxyId),
    /// Write now if anything changed, and report how that went.
    Flush(oneshot::Sender<Result<(), SnapshotError>>),
}

/// The sending half of the snapshot writer.
pub(crate) type WriterSender = mpsc::UnboundedSender<WriterMessage>;

/// What the writer knows of one proxy: what the snapshot should say of it, and what the
/// last write said. Both share one encoding while they are equal.
#[derive(Debug, Default)]
struct Written {
    current: Option<EncodedRecord>,
    saved: Option<EncodedRecord>,
}

impl Written {
    fn changed(&self) -> bool {
        self.current != self.saved
    }
}

/// Keeps the snapshot equal to `records` as changes arrive, writing once per burst of
/// changes and only when the content differs from what was last written (`saved`, the
/// snapshot found at start-up). Ends when every sender is gone.
///
/// The engine sends changes and never waits for a write, so a write of a large snapshot
/// costs the engine nothing per change.
pub(crate) async fn writer(
    store: Arc<dyn SnapshotStore>,
    mut messages: mpsc::UnboundedReceiver<WriterMessage>,
    records: BTreeMap<ProxyId, EncodedRecord>,
    saved: Option<BTreeMap<ProxyId, EncodedRecord>>,
    published: Published,
) {
    let mut known: BTreeMap<ProxyId, Written> = BTreeMap::new();
    for (id, record) in saved.unwrap_or_default() {
        known.entry(id).or_default().saved = Some(record);
    }
    for (id, record) in records {
        known.entry(id).or_default().current = Some(record);
    }
    let mut dirty = true;
    let mut retry = Retry::default();
    retry.after(save_if_changed(&*store, &mut known, &mut dirty, &published).await);
    let mut rest_until = None;
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
            take(message, &*store, &mut known, &mut dirty, &published).await;
        }
        // After a write, a rest in proportion to its length, changes taken meanwhile: a
        // long burst of changes (a bring-up) is written every few write lengths rather
        // than in writes back to back, each of every record.
        if let Some(until) = rest_until.take().filter(|_| dirty) {
            let rest = tokio::time::sleep_until(until);
            tokio::pin!(rest);
            loop {
                tokio::select! {
                    () = &mut rest => break,
                    message = messages.recv() => match message {
                        Some(message) => take(message, &*store, &mut known, &mut dirty, &published).await,
                        None => return,
                    },
                }
            }
        }
        let (started, writes) = (tokio::time::Instant::now(), dirty);
        retry.after(save_if_changed(&*store, &mut known, &mut dirty, &published).await);
        if writes {
            rest_until = Some(tokio::time::Instant::now() + started.elapsed() * REST_PER_WRITE);
        }
    }
}

/// How long the writer rests after a write, as a multiple of the write's length: during a
/// burst of changes, writes take at most a tenth of its time.
const REST_PER_WRITE: u32 = 9;

/// Applies one message to what the snapshot should say; a flush writes at once.
async fn take(
    message: WriterMessage,
    store: &dyn SnapshotStore,
    known: &mut BTreeMap<ProxyId, Written>,
    dirty: &mut bool,
    published: &Published,
) {
    match message {
        WriterMessage::Put(id, record) => {
            let written = known.entry(id).or_default();
            // An equal record keeps the encoding it shares with the last write.
            if written.current.as_ref() != Some(&record) {
                written.current = Some(record);
                *dirty = true;
            }
        }
        WriterMessage::Remove(id) => {
            if let Some(written) = known.get_mut(&id) {
                *dirty |= written.current.take().is_some();
                if written.saved.is_none() {
                    known.remove(&id);
                }
            }
        }
        WriterMessage::Flush(reply) => {
            let result = save_if_changed(store, known, dirty, published).await;
            let _ = reply.send(result);
        }
    }
}

/// When to try a failed snapshot write again: on [`RETRY_BACKOFF`] from the first failure,
/// and not at all once a write succeeded.
struct Retry {
    at: Option<tokio::time::Instant>,
    backoff: Backoff,
}

/// The waits between attempts to write a snapshot that failed: 1 s, doubling up to 30 s.
const RETRY_BACKOFF: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));

impl Default for Retry {
    fn default() -> Self {
        Self { at: None, backoff: RETRY_BACKOFF }
    }
}

impl Retry {
    fn after(&mut self, result: Result<(), SnapshotError>) {
        if result.is_ok() {
            *self = Self::default();
            return;
        }
        self.at = Some(tokio::time::Instant::now() + self.backoff.next());
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
    known: &mut BTreeMap<ProxyId, Written>,
    dirty: &mut bool,
    published: &Published,
) -> Result<(), SnapshotError> {
    if !*dirty {
        return Ok(());
    }
    if !known.values().any(Written::changed) {
        *dirty = false;
        return Ok(());
    }
    let records: Vec<EncodedRecord> = known.values().filter_map(|written| written.current.clone()).collect();
    let proxies = records.len();
    match store.save(EncodedSnapshot { records }).await {
        Ok(()) => {
            tracing::debug!(proxies, "snapshot written");
            published.lock().stats.snapshot_writes += 1;
            known.retain(|_, written| {
                written.saved.clone_from(&written.current);
                written.current.is_some()
            });
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
