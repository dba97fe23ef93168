//! The [`Manager`]: the reconcile loop, its coalescing, the actions it runs, restore at
//! start-up and the two shutdowns.
//!
//! This module owns the engine's state and every task it spawns (action tasks, status
//! watchers, the snapshot writer), each in a `JoinSet` held by the manager, so that nothing
//! outlives it. It must never touch a process itself (only through [`ProxyHandle`]), never
//! hold a lock across an await, and never run two actions on one proxy at once.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tether_state::config::{self, Format};
use tether_state::{Catalog, DesiredProxy, ManagedProxy, ProxyId, Revision, Subscription, TokenFingerprint};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::{AbortHandle, JoinError, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::backend::{BackendError, ProcessStatus, ProxyBackend, ProxyHandle, ProxyState};
use crate::plan::{Action, Observed, Origin, Policy, decide};
use crate::snapshot::{
    EncodedRecord, EncodedService, ProxyRecord, SnapshotError, SnapshotStore, WriterMessage, WriterSender, writer,
};
use crate::status::{ActionKind, ManagerHandle, ProxyStatus, Published};
use crate::users::UserLookup;

/// How the engine behaves. `Default` gives SPEC's defaults.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// Sync after this long without a further catalog change (SPEC: 500ms).
    pub sync_quiescent: Duration,
    /// Sync at most this long after the first unsynced change (SPEC: 5s).
    pub sync_max_delay: Duration,
    /// Actions (start, stop, restart, update) running at once, at least 1.
    pub max_concurrent_actions: usize,
    /// Whether the agent runs as uid 0. The agent fills it in; tests set it.
    pub running_as_root: bool,
    /// Whether proxies may run as uid 0 when the agent is root (`--allow-root`).
    pub allow_root: bool,
    /// The uid of a proxy's `user`, for the root policy: when the agent is root and root is
    /// not allowed, a proxy with no `user`, or with a `user` that is uid 0, is blocked.
    pub users: UserLookup,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            sync_quiescent: Duration::from_millis(500),
            sync_max_delay: Duration::from_secs(5),
            max_concurrent_actions: 64,
            running_as_root: false,
            allow_root: false,
            users: UserLookup::default(),
        }
    }
}

/// A shutdown that did not fully succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShutdownError {
    /// The final snapshot could not be written.
    #[error("cannot write the final snapshot")]
    Snapshot {
        /// Why.
        #[source]
        source: SnapshotError,
    },
    /// Some proxies did not stop.
    #[error("{} proxies did not stop: {}", .failed.len(), join_ids(.failed))]
    Stop {
        /// Every proxy that did not stop.
        failed: Vec<ProxyId>,
        /// Why the first of them did not.
        #[source]
        source: BackendError,
    },
}

fn join_ids(ids: &[ProxyId]) -> String {
    ids.iter().map(ProxyId::as_str).collect::<Vec<_>>().join(", ")
}

/// A handle the engine holds, with what it needs to report and snapshot it.
struct Installed {
    handle: Arc<dyn ProxyHandle>,
    status: watch::Receiver<ProcessStatus>,
    generation: u64,
    watcher: AbortHandle,
    /// What the snapshot records the process was started from, encoded once.
    service: Option<EncodedService>,
    token: Option<TokenFingerprint>,
}

/// Everything the engine knows of one proxy.
struct Slot {
    observed: Observed,
    installed: Option<Installed>,
    /// The action running on it, if any: at most one, always.
    busy: Option<Action>,
    /// What was wanted when the running action was launched.
    launched_for: Option<Arc<ManagedProxy>>,
    error: Option<String>,
    /// Starts that failed in a row; the next retry waits per the restart policy.
    start_failures: u32,
    /// When the failed start is tried again, if it is to be.
    retry_at: Option<Instant>,
}

impl Slot {
    fn new() -> Self {
        Self {
            observed: Observed::Idle,
            installed: None,
            busy: None,
            launched_for: None,
            error: None,
            start_failures: 0,
            retry_at: None,
        }
    }
}

/// The shortest wait before a failed start is tried again, free attempts included: a
/// proxy that cannot start at all must not spin the engine.
const MIN_RETRY_DELAY: Duration = Duration::from_millis(100);

/// What an action task reports back.
enum Outcome {
    Started { proxy: Arc<ManagedProxy>, handle: Box<dyn ProxyHandle> },
    StartFailed { error: BackendError },
    Stopped,
    StopFailed { error: BackendError },
    Updated { proxy: Arc<ManagedProxy> },
    UpdateFailed { error: BackendError },
}

/// What is left to do of the restore that precedes the first reconcile.
enum RestoreStage {
    Load,
    Adopt {
        queue: VecDeque<(ProxyRecord, Option<Origin>)>,
        wanted: HashMap<ProxyId, Arc<ManagedProxy>>,
        /// The records of the snapshot as loaded, encoded: what the file says now.
        saved: Option<BTreeMap<ProxyId, EncodedRecord>>,
    },
    Done,
}

/// A catalog change the engine has not synced yet.
#[derive(Clone, Copy)]
struct Unsynced {
    first: Instant,
    last: Instant,
}

/// The reconcile engine: keeps the proxies that run equal to the proxies the catalog wants.
///
/// Build it with [`Manager::new`], call [`Manager::run`] until shutdown, then
/// [`Manager::close`] (proxies keep running, for the next agent) or [`Manager::kill`]
/// (every proxy stops). Watch it through [`Manager::handle`].
pub struct Manager {
    catalog: Arc<dyn Catalog>,
    backend: Arc<dyn ProxyBackend>,
    store: Arc<dyn SnapshotStore>,
    config: ManagerConfig,
    policy: Policy,
    subscription: Subscription,
    catalog_open: bool,
    seen: Option<Revision>,
    unsynced: Option<Unsynced>,
    desired: HashMap<ProxyId, DesiredProxy>,
    slots: HashMap<ProxyId, Slot>,
    dirty: HashSet<ProxyId>,
    backlog: VecDeque<ProxyId>,
    in_backlog: HashSet<ProxyId>,
    /// Failed starts to try again, earliest first; an entry whose slot no longer has that
    /// `retry_at` is stale and skipped.
    retries: BinaryHeap<Reverse<(Instant, ProxyId)>>,
    actions: JoinSet<Outcome>,
    action_ids: HashMap<tokio::task::Id, ProxyId>,
    background: JoinSet<()>,
    status_tx: mpsc::UnboundedSender<(ProxyId, u64)>,
    status_rx: mpsc::UnboundedReceiver<(ProxyId, u64)>,
    generation: u64,
    restore: RestoreStage,
    writer: Option<WriterSender>,
    closing: bool,
    published: Published,
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager")
            .field("config", &self.config)
            .field("seen", &self.seen)
            .field("desired", &self.desired.len())
            .field("proxies", &self.slots.len())
            .field("in_flight", &self.actions.len())
            .finish_non_exhaustive()
    }
}

impl Manager {
    /// An engine that reads `catalog`, drives `backend` and keeps its snapshot in `store`.
    /// It does nothing until [`Manager::run`].
    pub fn new(
        catalog: Arc<dyn Catalog>,
        backend: Arc<dyn ProxyBackend>,
        store: Arc<dyn SnapshotStore>,
        config: ManagerConfig,
    ) -> Self {
        // Subscribe now, so that no change made after construction is missed.
        let subscription = catalog.subscribe();
        let (status_tx, status_rx) = mpsc::unbounded_channel();
        let policy = Policy { refuse_root: config.running_as_root && !config.allow_root, ..Policy::default() };
        Self {
            catalog,
            backend,
            store,
            config,
            policy,
            subscription,
            catalog_open: true,
            seen: None,
            unsynced: None,
            desired: HashMap::new(),
            slots: HashMap::new(),
            dirty: HashSet::new(),
            backlog: VecDeque::new(),
            in_backlog: HashSet::new(),
            retries: BinaryHeap::new(),
            actions: JoinSet::new(),
            action_ids: HashMap::new(),
            background: JoinSet::new(),
            status_tx,
            status_rx,
            generation: 0,
            restore: RestoreStage::Load,
            writer: None,
            closing: false,
            published: Published::new(),
        }
    }

    /// A view of the engine's statuses, events and counters.
    pub fn handle(&self) -> ManagerHandle {
        self.published.handle()
    }

    /// Restores the snapshot (once), reconciles at once, then reconciles on every catalog
    /// change, coalesced, until `shutdown` is cancelled or the catalog is gone.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe. Dropping the future leaves no half-applied state: running actions keep
    /// running in tasks the manager owns, their results are applied by the next `run`,
    /// [`Manager::close`] or [`Manager::kill`], and a restore in progress resumes.
    pub async fn run(&mut self, shutdown: CancellationToken) {
        if !self.restore_snapshot(&shutdown).await {
            return;
        }
        if self.seen.is_none() {
            self.sync();
        }
        while !shutdown.is_cancelled() {
            let deadline =
                self.unsynced.map(|u| (u.last + self.config.sync_quiescent).min(u.first + self.config.sync_max_delay));
            let retry = self.retries.peek().map(|Reverse((at, _))| *at);
            if deadline.is_some_and(|deadline| deadline <= Instant::now()) {
                // Due already (a zero window): sync now rather than wait for the timer wheel's
                // next millisecond.
                self.sync();
                continue;
            }
            tokio::select! {
                // Every branch is cancel safe; the sleep's deadline is absolute and kept in
                // `self.unsynced`, so re-creating it each turn moves nothing.
                () = shutdown.cancelled() => break,
                Some(done) = self.actions.join_next_with_id(), if !self.actions.is_empty() => self.on_done(done),
                Some((id, generation)) = self.status_rx.recv() => self.on_status(&id, generation),
                changed = self.subscription.changed(), if self.catalog_open => match changed {
                    Some(_) => self.note_change(),
                    None => self.catalog_open = false,
                },
                () = sleep_until(deadline), if deadline.is_some() => self.sync(),
                () = sleep_until(retry), if retry.is_some() => self.retry_due(),
                else => break,
            }
        }
    }

    /// Shuts down without stopping proxies: waits for running actions, detaches every
    /// proxy (they keep running, for the next agent to adopt) and writes the snapshot.
    ///
    /// # Errors
    ///
    /// [`ShutdownError::Snapshot`] if the snapshot cannot be written.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a dropped call may leave some proxies detached and others not; the
    /// processes keep running either way.
    pub async fn close(mut self) -> Result<(), ShutdownError> {
        self.finish_actions().await;
        let mut detaching = JoinSet::new();
        for installed in self.slots.values().filter_map(|slot| slot.installed.as_ref()) {
            let handle = installed.handle.clone();
            detaching.spawn(async move { handle.detach().await });
        }
        while detaching.join_next().await.is_some() {}
        tracing::info!(proxies = self.slots.len(), "manager closed; proxies left running");
        self.flush().await
    }

    /// Shuts down and stops every proxy, all in parallel, each with its own kill policy;
    /// the snapshot is then written empty.
    ///
    /// # Errors
    ///
    /// [`ShutdownError::Stop`] if some proxies did not stop (named in it; they stay in the snapshot),
    /// [`ShutdownError::Snapshot`] if the snapshot cannot be written.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a dropped call abandons the stops it started.
    pub async fn kill(mut self) -> Result<(), ShutdownError> {
        self.finish_actions().await;
        let mut stopping = JoinSet::new();
        for (id, slot) in &mut self.slots {
            if let Some(installed) = &slot.installed {
                let (id, handle) = (id.clone(), installed.handle.clone());
                slot.busy = Some(Action::Stop);
                stopping.spawn(async move { (id, handle.stop().await) });
            }
        }
        for id in self.slots.keys().cloned().collect::<Vec<_>>() {
            self.publish(&id);
        }
        let mut failed = Vec::new();
        let mut first_error = None;
        while let Some(joined) = stopping.join_next().await {
            let Ok((id, result)) = joined else { continue };
            match result {
                Ok(()) => {
                    self.uninstall(&id);
                    self.slots.remove(&id);
                    self.published.remove(&id);
                }
                Err(error) => {
                    tracing::warn!(proxy = %id, error = %crate::error_chain(&error), "proxy did not stop");
                    failed.push(id);
                    first_error.get_or_insert(error);
                }
            }
        }
        let flushed = self.flush().await;
        if let Some(source) = first_error {
            failed.sort();
            return Err(ShutdownError::Stop { failed, source });
        }
        tracing::info!("manager killed; every proxy stopped");
        flushed
    }

    /// Waits for every running action and applies its result; starts no new one.
    async fn finish_actions(&mut self) {
        self.closing = true;
        while let Some(done) = self.actions.join_next_with_id().await {
            self.on_done(done);
        }
    }

    async fn flush(&mut self) -> Result<(), ShutdownError> {
        let Some(writer) = &self.writer else {
            // Nothing was restored, so nothing may overwrite the snapshot.
            return Ok(());
        };
        let (reply, answer) = oneshot::channel();
        let result = match writer.send(WriterMessage::Flush(reply)) {
            Ok(()) => answer.await.unwrap_or(Err(SnapshotError::WriterGone)),
            Err(_) => Err(SnapshotError::WriterGone),
        };
        result.map_err(|source| ShutdownError::Snapshot { source })
    }

    /// Restores what the snapshot (or the backend's candidates) says runs. Returns false if
    /// `shutdown` was cancelled first.
    async fn restore_snapshot(&mut self, shutdown: &CancellationToken) -> bool {
        if let RestoreStage::Load = self.restore {
            let loaded = tokio::select! {
                () = shutdown.cancelled() => return false,
                loaded = self.store.load() => loaded,
            };
            let (mut records, saved) = match loaded {
                Ok(Some(snapshot)) => {
                    // Kept encoded, as the writer compares it: the records are moved, not copied.
                    let saved: BTreeMap<ProxyId, EncodedRecord> = snapshot
                        .proxies
                        .iter()
                        .filter_map(|record| Some((record.id.clone(), encode(record)?)))
                        .collect();
                    (snapshot.proxies, Some(saved))
                }
                Ok(None) => (Vec::new(), None),
                Err(err) => {
                    tracing::warn!(error = %crate::error_chain(&err), "snapshot unusable; adopting the backend's candidates instead");
                    (Vec::new(), None)
                }
            };
            let mut seen = HashSet::new();
            records.retain(|record| seen.insert(record.id.clone()));
            // The backend's candidates come after the snapshot's records: they cover a
            // proxy started after the last snapshot write (an agent killed in between), and
            // one whose record cannot be proven any more. A candidate of an id already
            // adopted is skipped, so nothing is taken over twice.
            let mut candidate_ids = HashSet::new();
            let candidates = self.candidates(shutdown).await;
            records.extend(candidates.into_iter().filter(|record| candidate_ids.insert(record.id.clone())));
            seen.extend(candidate_ids);
            let queue: VecDeque<_> = records
                .into_iter()
                .map(|record| {
                    let origin = origin_of(&record);
                    (record, origin)
                })
                .collect();
            // What the catalog wants of those proxies: the backend restarts an adopted
            // process from it, and proves candidates with its token.
            let wanted = if queue.is_empty() {
                HashMap::new()
            } else {
                self.catalog
                    .changes_since(None)
                    .upserted
                    .into_iter()
                    .filter(|desired| seen.contains(desired.proxy.id()))
                    .map(|desired| (desired.proxy.id().clone(), desired.proxy))
                    .collect()
            };
            self.restore = RestoreStage::Adopt { queue, wanted, saved };
        }
        // One record per turn, so that a cancelled turn leaves the record queued.
        while matches!(&self.restore, RestoreStage::Adopt { queue, .. } if !queue.is_empty()) {
            if !self.restore_one(shutdown).await {
                return false;
            }
        }
        if let RestoreStage::Adopt { saved, .. } = std::mem::replace(&mut self.restore, RestoreStage::Done) {
            self.start_writer(saved);
        }
        true
    }

    async fn restore_one(&mut self, shutdown: &CancellationToken) -> bool {
        let RestoreStage::Adopt { queue, wanted, .. } = &mut self.restore else { return true };
        let Some((record, _)) = queue.front() else { return true };
        if self.slots.contains_key(&record.id) {
            // Its snapshot record was adopted: the candidate of the same id is that process.
            queue.pop_front();
            return true;
        }
        let (id, backend_record) = (record.id.clone(), record.backend.clone());
        let desired = wanted.get(&id).cloned();
        let restored = tokio::select! {
            () = shutdown.cancelled() => return false,
            restored = self.backend.restore(id.clone(), backend_record, desired) => restored,
        };
        let RestoreStage::Adopt { queue, wanted, .. } = &mut self.restore else { return true };
        let Some((mut record, mut origin)) = queue.pop_front() else { return true };
        match restored {
            Some(handle) => {
                tracing::info!(proxy = %id, "proxy adopted");
                self.published.lock().stats.adopted += 1;
                // A candidate without a snapshot record that the backend proved against the
                // wanted proxy runs that proxy, by the backend's contract.
                if record.service.is_none() && record.token.is_none() {
                    if let Some(proxy) = wanted.get(&id) {
                        record.service = service_value(proxy);
                        record.token = Some(proxy.token().fingerprint());
                        origin = origin_of(&record);
                    }
                }
                let service = record.service.as_ref().and_then(|service| EncodedService::new(service).ok());
                let mut slot = Slot::new();
                slot.observed = Observed::Adopted { origin };
                self.slots.insert(id.clone(), slot);
                self.install(&id, handle.into(), service, record.token);
                self.publish(&id);
            }
            None => {
                tracing::info!(proxy = %id, "snapshot record dropped: its process cannot be proven to be the same");
                self.published.lock().stats.dropped += 1;
            }
        }
        true
    }

    async fn candidates(&self, shutdown: &CancellationToken) -> Vec<ProxyRecord> {
        let found = tokio::select! {
            () = shutdown.cancelled() => return Vec::new(),
            found = self.backend.adoption_candidates() => found,
        };
        found.into_iter().map(|(id, backend)| ProxyRecord { id, service: None, token: None, backend }).collect()
    }

    fn start_writer(&mut self, saved: Option<BTreeMap<ProxyId, EncodedRecord>>) {
        let records: BTreeMap<ProxyId, EncodedRecord> =
            self.slots.keys().filter_map(|id| Some((id.clone(), self.record_of(id)?))).collect();
        let (sender, messages) = mpsc::unbounded_channel();
        let store = self.store.clone();
        let published = self.published.clone();
        self.background
            .spawn(writer(store, messages, records, saved, published).instrument(tracing::info_span!("snapshot")));
        self.writer = Some(sender);
    }

    fn record_of(&self, id: &ProxyId) -> Option<EncodedRecord> {
        let installed = self.slots.get(id)?.installed.as_ref()?;
        let backend = installed.handle.record();
        match EncodedRecord::new(id, installed.service.as_ref(), installed.token.as_ref(), &backend) {
            Ok(record) => Some(record),
            Err(err) => {
                tracing::warn!(proxy = %id, error = %err, "cannot encode the snapshot record; it is left out");
                None
            }
        }
    }

    fn send_record(&self, id: &ProxyId) {
        let Some(writer) = &self.writer else { return };
        let message = match self.record_of(id) {
            Some(record) => WriterMessage::Put(id.clone(), record),
            None => WriterMessage::Remove(id.clone()),
        };
        // A gone writer is reported by the next flush.
        let _ = writer.send(message);
    }

    fn note_change(&mut self) {
        let now = Instant::now();
        let first = self.unsynced.map_or(now, |u| u.first);
        self.unsynced = Some(Unsynced { first, last: now });
    }

    /// One reconcile pass: reads what changed, plans the proxies it touches, dispatches.
    fn sync(&mut self) {
        let started = std::time::Instant::now();
        self.unsynced = None;
        let changes = self.catalog.changes_since(self.seen);
        let span = tracing::debug_span!("reconcile", revision = %changes.revision, complete = changes.complete);
        let _entered = span.enter();
        self.seen = Some(changes.revision);
        if changes.complete {
            // A complete answer is the whole desired set: compare it with everything known.
            let wanted: HashSet<ProxyId> = changes.upserted.iter().map(|d| d.proxy.id().clone()).collect();
            let gone: Vec<ProxyId> =
                self.desired.keys().chain(self.slots.keys()).filter(|id| !wanted.contains(*id)).cloned().collect();
            for id in gone {
                self.desired.remove(&id);
                self.dirty.insert(id);
            }
        }
        for desired in changes.upserted {
            let id = desired.proxy.id().clone();
            // Unchanged entries are skipped by revision, without a deep comparison.
            if self.desired.get(&id).is_some_and(|old| old.revision == desired.revision) {
                continue;
            }
            self.resolve_user(&desired.proxy);
            self.desired.insert(id.clone(), desired);
            self.dirty.insert(id);
        }
        for id in changes.removed {
            self.desired.remove(&id);
            self.dirty.insert(id);
        }
        // `take`, not `drain`: draining walks the set's whole capacity, which grows with the
        // largest pass ever made, and a one-change pass must not pay for it.
        let dirty = std::mem::take(&mut self.dirty);
        tracing::debug!(touched = dirty.len(), "reconciling");
        for id in dirty {
            self.consider(&id);
        }
        let elapsed = started.elapsed();
        let mut board = self.published.lock();
        board.stats.observe_pass(elapsed);
        board.stats.revision = self.seen;
        board.stats.in_flight = self.actions.len();
        board.stats.queued = self.backlog.len();
    }

    /// Asks the user lookup again for the uid of `proxy`'s `user`, when root is refused: a
    /// change to the proxy is when its user may have become, or stopped being, uid 0.
    fn resolve_user(&mut self, proxy: &ManagedProxy) {
        if !self.policy.refuse_root {
            return;
        }
        if let Some(user) = proxy.spec().user.as_deref() {
            let uid = self.config.users.uid(user);
            self.policy.note_uid(user, uid);
        }
    }

    /// Plans one proxy and carries out the decision, or queues it when every action slot is
    /// taken. A proxy with an action running is left alone: its completion plans it again.
    fn consider(&mut self, id: &ProxyId) {
        let slot = self.slots.get(id);
        if slot.is_some_and(|slot| slot.busy.is_some()) {
            return;
        }
        let desired = self.desired.get(id).map(|d| &d.proxy);
        let Some(action) = decide(desired, slot.map(|slot| &slot.observed), &self.policy) else { return };
        tracing::debug!(proxy = %id, ?action, "decided");
        match action {
            Action::Forget => {
                self.uninstall(id);
                self.slots.remove(id);
                self.published.remove(id);
                self.send_record(id);
            }
            Action::Block => {
                let Some(wanted) = desired.cloned() else { return };
                let error = self.policy.refusal(&wanted).map(|refusal| refusal.to_string());
                tracing::warn!(proxy = %id, reason = error.as_deref(), "proxy blocked: it would run as root");
                let slot = self.slots.entry(id.clone()).or_insert_with(Slot::new);
                slot.observed = Observed::Blocked { wanted };
                slot.error = error;
                self.publish(id);
            }
            Action::Start | Action::Stop | Action::Restart | Action::Update => {
                self.slots.entry(id.clone()).or_insert_with(Slot::new);
                if self.closing {
                    return;
                }
                if self.actions.len() >= self.config.max_concurrent_actions.max(1) {
                    if self.in_backlog.insert(id.clone()) {
                        self.backlog.push_back(id.clone());
                    }
                    self.publish(id);
                    return;
                }
                self.launch(id, action);
            }
        }
    }

    fn launch(&mut self, id: &ProxyId, action: Action) {
        let wanted = self.desired.get(id).map(|d| d.proxy.clone());
        let Some(slot) = self.slots.get_mut(id) else { return };
        let handle = slot.installed.as_ref().map(|installed| installed.handle.clone());
        slot.busy = Some(action);
        slot.launched_for = wanted.clone();
        let backend = self.backend.clone();
        let task = async move {
            match (action, wanted, handle) {
                (Action::Start, Some(proxy), _) => start(&*backend, proxy).await,
                (Action::Restart, Some(proxy), Some(handle)) => match handle.stop().await {
                    Ok(()) => start(&*backend, proxy).await,
                    Err(error) => Outcome::StopFailed { error },
                },
                (Action::Restart, Some(proxy), None) => start(&*backend, proxy).await,
                (Action::Update, Some(proxy), Some(handle)) => match handle.update(proxy.clone()).await {
                    Ok(()) => Outcome::Updated { proxy },
                    Err(error) => Outcome::UpdateFailed { error },
                },
                (_, _, Some(handle)) => match handle.stop().await {
                    Ok(()) => Outcome::Stopped,
                    Err(error) => Outcome::StopFailed { error },
                },
                (_, _, None) => Outcome::Stopped,
            }
        };
        let span = tracing::info_span!("proxy", proxy = %id, action = ?action);
        let abort = self.actions.spawn(task.instrument(span));
        self.action_ids.insert(abort.id(), id.clone());
        let mut board = self.published.lock();
        board.stats.actions += 1;
        board.stats.in_flight = self.actions.len();
        drop(board);
        self.publish(id);
    }

    fn on_done(&mut self, done: Result<(tokio::task::Id, Outcome), JoinError>) {
        let (task, outcome) = match done {
            Ok((task, outcome)) => (task, Ok(outcome)),
            Err(join) => (join.id(), Err(join)),
        };
        let Some(id) = self.action_ids.remove(&task) else { return };
        let Some(slot) = self.slots.get_mut(&id) else { return };
        let action = slot.busy.take();
        let wanted = slot.launched_for.take();
        let mut failed = None;
        let succeeded = matches!(outcome, Ok(Outcome::Started { .. } | Outcome::Stopped | Outcome::Updated { .. }));
        if let Some(kind) = action.and_then(action_kind) {
            *self.published.lock().stats.actions_by_kind.entry((kind, succeeded)).or_default() += 1;
        }
        match outcome {
            Ok(Outcome::Started { proxy, handle }) => {
                tracing::info!(proxy = %id, "proxy started");
                slot.observed = Observed::Running { applied: proxy.clone() };
                slot.error = None;
                slot.start_failures = 0;
                slot.retry_at = None;
                self.uninstall(&id);
                self.install(&id, handle.into(), encoded_service(&proxy), Some(proxy.token().fingerprint()));
            }
            Ok(Outcome::StartFailed { error }) => {
                let had_process = slot.installed.is_some() && action == Some(Action::Restart);
                // A restart whose start failed has already stopped the old process.
                // The start is tried again on the restart backoff: a descriptor, memory or
                // the program itself may be back by then.
                slot.start_failures = slot.start_failures.saturating_add(1);
                let delay = wanted
                    .as_ref()
                    .map_or(Duration::ZERO, |proxy| proxy.spec().restart.delay_before(slot.start_failures))
                    .max(MIN_RETRY_DELAY);
                let at = Instant::now() + delay;
                slot.retry_at = Some(at);
                self.retries.push(Reverse((at, id.clone())));
                tracing::warn!(
                    proxy = %id,
                    error = %crate::error_chain(&error),
                    attempt = slot.start_failures,
                    backoff_ms = delay.as_millis() as u64,
                    "start failed; retrying"
                );
                slot.observed = Observed::Failed { wanted, has_process: false };
                failed = Some(error);
                if had_process || slot.installed.is_some() {
                    self.uninstall(&id);
                }
            }
            Ok(Outcome::Stopped) => {
                tracing::info!(proxy = %id, "proxy stopped");
                slot.observed = Observed::Idle;
                slot.error = None;
                self.uninstall(&id);
            }
            Ok(Outcome::StopFailed { error }) => {
                slot.observed = Observed::Failed { wanted, has_process: true };
                failed = Some(error);
            }
            Ok(Outcome::Updated { proxy }) => {
                tracing::info!(proxy = %id, "change applied in place");
                slot.observed = Observed::Running { applied: proxy.clone() };
                slot.error = None;
                if let Some(installed) = &mut slot.installed {
                    installed.service = encoded_service(&proxy);
                    installed.token = Some(proxy.token().fingerprint());
                }
                self.send_record(&id);
            }
            Ok(Outcome::UpdateFailed { error }) => {
                slot.observed = Observed::Failed { wanted, has_process: true };
                failed = Some(error);
            }
            Err(join) => {
                let has_process = slot.installed.is_some();
                slot.observed = Observed::Failed { wanted, has_process };
                slot.error = Some(format!("the {action:?} action ended abnormally: {join}").to_lowercase());
                self.published.lock().stats.failures += 1;
            }
        }
        if let Some(error) = failed {
            let message = crate::error_chain(&error);
            if !matches!(error, BackendError::Start { .. }) {
                tracing::warn!(proxy = %id, error = %message, "action failed; retried on the next change");
            }
            if let Some(slot) = self.slots.get_mut(&id) {
                slot.error = Some(message);
            }
            self.published.lock().stats.failures += 1;
        }
        self.publish(&id);
        // Level-triggered: plan the proxy again against what is wanted now.
        self.consider(&id);
        while self.actions.len() < self.config.max_concurrent_actions.max(1) && !self.closing {
            let Some(next) = self.backlog.pop_front() else { break };
            self.in_backlog.remove(&next);
            self.consider(&next);
        }
        let mut board = self.published.lock();
        board.stats.in_flight = self.actions.len();
        board.stats.queued = self.backlog.len();
    }

    /// Tries again every failed start whose backoff is over.
    fn retry_due(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((at, _))) = self.retries.peek() {
            if *at > now {
                break;
            }
            let Some(Reverse((at, id))) = self.retries.pop() else { break };
            let Some(slot) = self.slots.get_mut(&id) else { continue };
            if slot.retry_at != Some(at) || slot.busy.is_some() {
                continue; // stale: started, changed or forgotten since
            }
            slot.retry_at = None;
            if let Observed::Failed { has_process: false, .. } = slot.observed {
                tracing::info!(proxy = %id, attempt = slot.start_failures + 1, "retrying the failed start");
                slot.observed = Observed::Idle;
                self.consider(&id);
            }
        }
    }

    fn install(
        &mut self,
        id: &ProxyId,
        handle: Arc<dyn ProxyHandle>,
        service: Option<EncodedService>,
        token: Option<TokenFingerprint>,
    ) {
        self.generation += 1;
        let generation = self.generation;
        let status = handle.status();
        let mut changes = status.clone();
        let notify = self.status_tx.clone();
        let watched = id.clone();
        let watcher = self.background.spawn(async move {
            while changes.changed().await.is_ok() {
                if notify.send((watched.clone(), generation)).is_err() {
                    break;
                }
            }
        });
        if let Some(slot) = self.slots.get_mut(id) {
            slot.installed = Some(Installed { handle, status, generation, watcher, service, token });
        }
        self.send_record(id);
    }

    fn uninstall(&mut self, id: &ProxyId) {
        let Some(slot) = self.slots.get_mut(id) else { return };
        if let Some(installed) = slot.installed.take() {
            installed.watcher.abort();
            self.send_record(id);
        }
    }

    fn on_status(&mut self, id: &ProxyId, generation: u64) {
        let current = self.slots.get(id).and_then(|slot| slot.installed.as_ref()).map(|i| i.generation);
        if current == Some(generation) {
            self.publish(id);
            // A restart by the backend changes the process: keep the snapshot in step (the
            // writer drops records that did not change).
            self.send_record(id);
        }
    }

    fn publish(&self, id: &ProxyId) {
        let Some(slot) = self.slots.get(id) else { return };
        let process = slot.installed.as_ref().map(|installed| installed.status.borrow().clone()).unwrap_or_default();
        let queued = self.in_backlog.contains(id);
        let (state, error) = match (&slot.busy, &slot.observed) {
            (Some(Action::Start), _) => (ProxyState::Starting, None),
            (Some(Action::Stop | Action::Restart), _) => (ProxyState::Stopping, None),
            (_, Observed::Blocked { .. }) => (ProxyState::Blocked, slot.error.clone()),
            (_, Observed::Failed { .. }) => (ProxyState::Failed, slot.error.clone()),
            (_, Observed::Idle) => (ProxyState::Pending, None),
            _ if queued && slot.installed.is_none() => (ProxyState::Pending, None),
            _ => (process.state, process.error.clone()),
        };
        self.published.set(ProxyStatus {
            id: id.clone(),
            service: id.service_id(),
            state,
            pid: process.pid,
            restarts: process.restarts,
            started_at: process.started_at,
            last_exit: process.last_exit,
            error,
        });
    }
}

async fn start(backend: &dyn ProxyBackend, proxy: Arc<ManagedProxy>) -> Outcome {
    let handle = backend.create(proxy.clone());
    match handle.start().await {
        Ok(()) => Outcome::Started { proxy, handle },
        Err(error) => Outcome::StartFailed { error },
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The kind of a backend action, for counting; `None` for decisions that are not actions.
fn action_kind(action: Action) -> Option<ActionKind> {
    match action {
        Action::Start => Some(ActionKind::Start),
        Action::Stop => Some(ActionKind::Stop),
        Action::Restart => Some(ActionKind::Restart),
        Action::Update => Some(ActionKind::Update),
        Action::Block | Action::Forget => None,
    }
}

/// The service of `proxy` as the snapshot records it.
fn service_value(proxy: &ManagedProxy) -> Option<serde_json::Value> {
    let text = config::to_service_text(proxy.service(), Format::Json).ok()?;
    serde_json::from_str(&text).ok()
}

/// The service of `proxy`, encoded as the snapshot records it.
fn encoded_service(proxy: &ManagedProxy) -> Option<EncodedService> {
    EncodedService::new(&service_value(proxy)?).ok()
}

/// `record` encoded as the snapshot holds it; `None`, with a warning, if it cannot be.
fn encode(record: &ProxyRecord) -> Option<EncodedRecord> {
    EncodedRecord::from_record(record)
        .inspect_err(|err| tracing::warn!(proxy = %record.id, error = %err, "cannot encode a snapshot record"))
        .ok()
}

/// What a snapshot record says its process was started from, if it says so readably.
fn origin_of(record: &ProxyRecord) -> Option<Origin> {
    let text = record.service.as_ref()?.to_string();
    let service = config::parse_service(&text, Format::Json, &config::Origin::Body).ok()?;
    if service.id.proxy_id() != record.id || service.proxy.is_none() {
        return None;
    }
    Some(Origin { service: Arc::new(service), token: record.token.clone()? })
}

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;
