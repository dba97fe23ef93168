//! The [`Manager`]: the reconcile loop, its coalescing, what it publishes, and the two
//! shutdowns; the actions it runs are in `actions`, restore at start-up in `restore`, the
//! snapshot's bookkeeping in `records`.
//!
//! This module owns the engine's state and every task it spawns (action tasks, status
//! watchers of backends that do not tell of changes themselves, the snapshot writer), each
//! in a `JoinSet` held by the manager, so that nothing outlives it. It must never touch a
//! process itself (only through [`ProxyHandle`]), never hold a lock across an await, and
//! never run two actions on one proxy at once.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tether_state::{
    Catalog, DesiredProxy, ManagedProxy, ProcessFigures, ProxyId, Revision, Subscription, TokenFingerprint,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::{BackendError, ProxyBackend, ProxyHandle, ProxyState};
use crate::plan::{Action, Observed, Policy, decide};
use crate::snapshot::{EncodedService, SnapshotError, SnapshotStore, WriterMessage, WriterSender};
use crate::status::{ManagerHandle, ProxyStatus, Published, Request, UpdateStatus};
use crate::users::UserLookup;
use slot::{Installed, Outcome, Slot};

/// How the engine behaves. `Default` gives the agent's defaults (those of `tether agent`'s
/// flags).
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// Coalescing, per proxy: a change to a proxy that has not changed for this long applies
    /// at once; a further change of the same proxy within it is held until the proxy has not
    /// changed for this long (default 500ms, as `--sync-quiescent`).
    pub sync_quiescent: Duration,
    /// A held change applies at most this long after the first held change of its proxy
    /// (default 5s, as `--sync-max-delay`).
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
    /// Proxies held down by the operator when the engine starts (kept by the agent across
    /// restarts); [`ManagerHandle::hold`] changes the set afterwards.
    pub held: BTreeSet<ProxyId>,
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
            held: BTreeSet::new(),
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
    coalescing: Coalescing,
    desired: HashMap<ProxyId, DesiredProxy>,
    /// Boxed: the table keeps spare room for a quarter to a half of its entries, which
    /// would otherwise each be a whole slot.
    slots: HashMap<ProxyId, Box<Slot>>,
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
    requests: mpsc::UnboundedReceiver<Request>,
    /// Proxies held down by the operator: stopped, and shown `stopped`, while wanted.
    held: BTreeSet<ProxyId>,
    /// For each proxy a `depends_on` may name, the proxies that name it (`ordering`).
    dependents: HashMap<ProxyId, Vec<ProxyId>>,
    /// Proxies to plan again because something they are ordered with changed.
    woken: Vec<ProxyId>,
    generation: u64,
    restore: RestoreStage,
    writer: Option<WriterSender>,
    closing: bool,
    /// Cancelled when the engine shuts down: an overlapping update in flight then gives up
    /// at once rather than at its `update_timeout`, and the old instance is kept.
    shutting_down: CancellationToken,
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
        let (requests_tx, requests) = mpsc::unbounded_channel();
        let held = config.held.clone();
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
            coalescing: Coalescing::default(),
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
            requests,
            held,
            dependents: HashMap::new(),
            woken: Vec::new(),
            generation: 0,
            restore: RestoreStage::Load,
            writer: None,
            closing: false,
            shutting_down: CancellationToken::new(),
            published: Published::with_requests(requests_tx),
        }
    }

    /// Measures proxies' usage and the backend's counters with `meter` (usually the backend
    /// itself, when it implements [`Meter`](crate::Meter)): the statuses read through every
    /// [`ManagerHandle`] carry it from then on. Set once: a second meter is ignored.
    #[must_use]
    pub fn with_meter(self, meter: Arc<dyn crate::Meter>) -> Self {
        if !self.published.set_meter(meter) {
            tracing::warn!("the engine has a meter already: the second one is ignored");
        }
        self
    }

    /// A view of the engine's statuses, events and counters.
    pub fn handle(&self) -> ManagerHandle {
        self.published.handle()
    }

    /// Restores the snapshot (once), reconciles at once, then reconciles on every catalog
    /// change, coalesced, until `shutdown` is cancelled or the catalog is gone.
    ///
    /// # Panics
    ///
    /// With the `testing` feature (tests; `mock` turns it on), when an action panicked, such as
    /// a mock's unmet expectation or a panic of a test's own callback: raised again here, so
    /// that a test fails rather than waits. Without it, the proxy is marked failed and the
    /// engine goes on.
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
            let deadline = self.coalescing.deadline();
            let retry = self.retries.peek().map(|Reverse((at, _))| *at);
            if deadline.is_some_and(|deadline| deadline <= Instant::now()) {
                // Due already (a zero window): release now rather than wait for the timer
                // wheel's next millisecond.
                self.release_due();
                continue;
            }
            tokio::select! {
                // Every branch is cancel safe; the sleep's deadline is absolute and kept in
                // `self.coalescing`, so re-creating it each turn moves nothing.
                () = shutdown.cancelled() => break,
                Some(done) = self.actions.join_next_with_id(), if !self.actions.is_empty() => self.on_done(done),
                Some((id, generation)) = self.status_rx.recv() => self.on_status(&id, generation),
                Some(request) = self.requests.recv() => self.on_request(request),
                changed = self.subscription.changed(), if self.catalog_open => match changed {
                    Some(_) => self.sync(),
                    None => self.catalog_open = false,
                },
                () = sleep_until(deadline), if deadline.is_some() => self.release_due(),
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
    /// # Panics
    ///
    /// With the `testing` feature (tests), when an action or a detach panicked, such as a
    /// mock's unmet expectation: raised again here, as by [`Manager::run`].
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
        while let Some(joined) = detaching.join_next().await {
            if let Err(join) = joined {
                ended_abnormally("detach", join);
            }
        }
        tracing::info!(proxies = self.slots.len(), "manager closed; proxies left running");
        self.flush().await
    }

    /// Shuts down and stops every proxy, in parallel, each with its own kill policy, but a
    /// proxy that others depend on (`depends_on`) only once they are down; the snapshot is
    /// then written empty.
    ///
    /// # Errors
    ///
    /// [`ShutdownError::Stop`] if some proxies did not stop (named in it; they stay in the snapshot),
    /// [`ShutdownError::Snapshot`] if the snapshot cannot be written.
    ///
    /// # Panics
    ///
    /// With the `testing` feature (tests), when an action or a stop panicked, such as a mock's
    /// unmet expectation: raised again here, as by [`Manager::run`].
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a dropped call abandons the stops it started.
    pub async fn kill(mut self) -> Result<(), ShutdownError> {
        self.finish_actions().await;
        // Dependents stop first: a proxy is stopped once every proxy that depends on it is
        // down; proxies that nothing orders are all stopped at once.
        let installed: HashSet<ProxyId> =
            self.slots.iter().filter(|(_, slot)| slot.installed.is_some()).map(|(id, _)| id.clone()).collect();
        let mut order = StopOrder::new(installed.iter().map(|id| {
            let mut dependencies = self.dependencies_of(id);
            dependencies.retain(|dependency| installed.contains(dependency) && dependency != id);
            (id.clone(), dependencies)
        }));
        let mut stopping = JoinSet::new();
        let mut stopping_ids = HashMap::new();
        // Each stop publishes its proxy as it starts; the others' statuses do not change.
        self.launch_stops(order.ready(0), &mut stopping, &mut stopping_ids);
        let mut failed = Vec::new();
        let mut first_error = None;
        while let Some(joined) = stopping.join_next_with_id().await {
            let (id, result) = match joined {
                Ok((task, stopped)) => {
                    stopping_ids.remove(&task);
                    stopped
                }
                Err(join) => {
                    if let Some(id) = stopping_ids.remove(&join.id()) {
                        order.done(&id);
                    }
                    ended_abnormally("stop", join);
                    let next = order.ready(stopping.len());
                    self.launch_stops(next, &mut stopping, &mut stopping_ids);
                    continue;
                }
            };
            order.done(&id);
            let next = order.ready(stopping.len());
            self.launch_stops(next, &mut stopping, &mut stopping_ids);
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

    /// Starts the stops of a kill for `ids`, each in its own task.
    fn launch_stops(
        &mut self,
        ids: Vec<ProxyId>,
        stopping: &mut JoinSet<(ProxyId, Result<(), BackendError>)>,
        stopping_ids: &mut HashMap<tokio::task::Id, ProxyId>,
    ) {
        for id in ids {
            let Some(slot) = self.slots.get_mut(&id) else { continue };
            let Some(installed) = &slot.installed else { continue };
            let handle = installed.handle.clone();
            slot.busy = Some(Action::Stop);
            let stopped = id.clone();
            let task = stopping.spawn(async move { (stopped, handle.stop().await) });
            stopping_ids.insert(task.id(), id.clone());
            self.publish(&id);
        }
    }

    /// Waits for every running action and applies its result; starts no new one.
    ///
    /// # Panics
    ///
    /// With the `testing` feature, as [`Manager::run`].
    async fn finish_actions(&mut self) {
        self.closing = true;
        self.shutting_down.cancel();
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

    /// One reconcile pass over what the catalog changed: a proxy's change applies now, or is
    /// held while the proxy keeps changing (see [`Coalescing`]).
    fn sync(&mut self) {
        let started = std::time::Instant::now();
        let changes = self.catalog.changes_since(self.seen);
        let span = tracing::debug_span!("reconcile", revision = %changes.revision, complete = changes.complete);
        let _entered = span.enter();
        // The first read is where the engine starts from, not a change: nothing it reads is
        // held, and nothing in it holds a later change back.
        let now = self.seen.is_some().then(Instant::now);
        self.seen = Some(changes.revision);
        if changes.complete {
            // A complete answer is the whole desired set: compare it with everything known.
            let wanted: HashSet<ProxyId> = changes.upserted.iter().map(|d| d.proxy.id().clone()).collect();
            let deferred = self.coalescing.held_wanted();
            let gone: Vec<ProxyId> = self
                .desired
                .keys()
                .chain(self.slots.keys())
                .chain(deferred)
                .filter(|id| !wanted.contains(*id))
                .cloned()
                .collect::<HashSet<_>>()
                .into_iter()
                .collect();
            for id in gone {
                self.note(id, None, now);
            }
        }
        for desired in changes.upserted {
            let id = desired.proxy.id().clone();
            // Unchanged entries are skipped by revision, without a deep comparison.
            let known = match self.coalescing.held_revision(&id) {
                Some(held) => held,
                None => self.desired.get(&id).map(|d| d.revision),
            };
            if known == Some(desired.revision) {
                continue;
            }
            self.note(id, Some(desired), now);
        }
        for id in changes.removed {
            self.note(id, None, now);
        }
        if let Some(now) = now {
            self.coalescing.forget_stale(now);
        }
        self.pass(started);
    }

    /// Applies the deferred changes that are due, then plans what they touched.
    fn release_due(&mut self) {
        let started = std::time::Instant::now();
        let now = Instant::now();
        let window = self.window();
        for (id, change) in self.coalescing.take_due(now, window) {
            self.apply(id, change);
        }
        self.coalescing.forget_stale(now);
        if !self.dirty.is_empty() {
            self.pass(started);
        }
    }

    /// Records a change of `id` at `now`: applies it, or holds it while `id` keeps changing.
    /// Without `now` (the engine's first read) it applies at once and is not remembered.
    fn note(&mut self, id: ProxyId, change: Option<DesiredProxy>, now: Option<Instant>) {
        let Some(now) = now else {
            self.apply(id, change);
            return;
        };
        let window = self.window();
        if let Offered::Now(change) = self.coalescing.offer(id.clone(), change, now, window) {
            self.apply(id, change);
        }
    }

    /// The coalescing window of the engine's config.
    fn window(&self) -> Window {
        Window { quiescent: self.config.sync_quiescent, max_delay: self.config.sync_max_delay }
    }

    /// Makes `change` the desired definition of `id` (`None`: unwanted) and marks it.
    fn apply(&mut self, id: ProxyId, change: Option<DesiredProxy>) {
        match change {
            Some(desired) => {
                self.resolve_user(&desired.proxy);
                if !desired.proxy.spec().depends_on.is_empty() {
                    self.index_dependencies(&id, &desired.proxy.spec().depends_on);
                }
                self.desired.insert(id.clone(), desired);
            }
            None => {
                self.desired.remove(&id);
            }
        }
        self.dirty.insert(id);
    }

    /// Plans every marked proxy and what is ordered with them, and dispatches.
    fn pass(&mut self, started: std::time::Instant) {
        // `take`, not `drain`: draining walks the set's whole capacity, which grows with the
        // largest pass ever made, and a one-change pass must not pay for it.
        let dirty = std::mem::take(&mut self.dirty);
        tracing::debug!(touched = dirty.len(), "reconciling");
        for id in dirty {
            self.consider(&id);
        }
        self.plan_woken();
        let elapsed = started.elapsed();
        let mut board = self.published.lock();
        board.stats.observe_pass(elapsed);
        board.stats.revision = self.seen;
        board.stats.in_flight = self.actions.len();
        board.stats.queued = self.backlog.len();
        board.stats.deferred = self.coalescing.held();
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
        if let Some(slot) = slot.filter(|slot| slot.busy.is_some()) {
            self.supersede_waiting(id, slot);
            return;
        }
        let desired = self.desired.get(id).map(|d| &d.proxy);
        let held = desired.is_some() && self.held.contains(id);
        let action = if held {
            // Held down by the operator: what runs is stopped, nothing starts.
            if slot.is_some_and(|slot| slot.observed.has_process() || slot.installed.is_some()) {
                Action::Stop
            } else {
                let slot = self.slots.entry(id.clone()).or_insert_with(|| Box::new(Slot::new()));
                slot.observed = Observed::Idle;
                slot.error = None;
                slot.retry_at = None;
                slot.waiting = false;
                slot.draining = false;
                self.publish(id);
                return;
            }
        } else if let Some(slot) =
            slot.filter(|slot| slot.observed.has_process() || slot.installed.is_some() || slot.draining)
        {
            // A dependency that goes away stops its dependents first.
            let going_away = if self.dependents.is_empty() { None } else { self.dependency_going_away(id) };
            let up = slot.observed.has_process() || slot.installed.is_some();
            let draining = up && desired.is_some() && going_away.is_some();
            if slot.draining != draining {
                if let Some(slot) = self.slots.get_mut(id) {
                    slot.draining = draining;
                }
            }
            let slot = self.slots.get(id).map(|slot| &slot.observed);
            match going_away {
                Some(dependency) if draining && up => {
                    tracing::info!(proxy = %id, %dependency, "stopping before what it depends on");
                    Action::Stop
                }
                _ => {
                    let Some(action) = decide(desired, slot, &self.policy) else { return };
                    action
                }
            }
        } else {
            let Some(action) = decide(desired, slot.map(|slot| &slot.observed), &self.policy) else {
                self.note_applied(id);
                return;
            };
            action
        };
        tracing::debug!(proxy = %id, ?action, "decided");
        if action == Action::Start {
            if let Some(waits) = self.unmet_dependencies(id) {
                let slot = self.slots.entry(id.clone()).or_insert_with(|| Box::new(Slot::new()));
                slot.observed = Observed::Idle;
                slot.retry_at = None;
                let changed = !slot.waiting || slot.error.as_deref() != Some(waits.as_str());
                slot.waiting = true;
                if changed {
                    tracing::debug!(proxy = %id, reason = %waits, "waiting for its dependencies");
                    slot.error = Some(waits);
                    self.publish(id);
                    // Those waiting for it say what it is now.
                    let dependents = self.dependents_of(id);
                    self.wake(dependents);
                }
                return;
            }
        }
        if action == Action::Stop && !self.dependents.is_empty() {
            let up = self.dependents_up(id);
            if !up.is_empty() {
                // Its dependents stop first; the last of them to stop plans it again.
                tracing::debug!(proxy = %id, dependents = up.len(), "stopping once its dependents are down");
                self.wake(up);
                return;
            }
        }
        match action {
            Action::Forget => {
                // While it is still known: what it depended on may stop now, and its
                // dependents wait for it by name.
                self.wake_around(id);
                self.uninstall(id);
                self.slots.remove(id);
                self.published.remove(id);
                self.send_record(id);
                self.unindex_dependencies(id);
            }
            Action::Block => {
                let Some(wanted) = desired.cloned() else { return };
                let error = self.policy.refusal(&wanted).map(|refusal| refusal.to_string());
                tracing::warn!(proxy = %id, reason = error.as_deref(), "proxy blocked: it would run as root");
                let slot = self.slots.entry(id.clone()).or_insert_with(|| Box::new(Slot::new()));
                slot.observed = Observed::Blocked { wanted };
                slot.error = error;
                self.publish(id);
            }
            Action::Start | Action::Stop | Action::Restart | Action::Update => {
                self.slots.entry(id.clone()).or_insert_with(|| Box::new(Slot::new()));
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

    /// Gives up the hot restart of `id` that waits for an old generation to exit
    /// (`max_generations`) when what it would start is no longer what is wanted (changed
    /// again, gone, or held down): nothing has started yet, and the change that superseded
    /// it is planned once it has given up.
    fn supersede_waiting(&self, id: &ProxyId, slot: &Slot) {
        let Some(superseded) = &slot.superseded else { return };
        let waits = slot.overlap.as_deref().is_some_and(|(next, _)| {
            next.borrow().as_ref().is_some_and(|next| next.state == crate::backend::BackendState::Pending)
        });
        let wanted = self.desired.get(id).map(|desired| &desired.proxy);
        let same =
            matches!((wanted, &slot.launched_for), (Some(wanted), Some(launched)) if Arc::ptr_eq(wanted, launched));
        if waits && (!same || self.held.contains(id)) {
            superseded.cancel();
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
        let notify = self.status_tx.clone();
        let watched = id.clone();
        // Told by the backend, if it can: no task of the engine's per proxy, and no channel.
        let told = handle.on_status_change(Box::new(move || {
            let _engine_gone = notify.send((watched.clone(), generation));
        }));
        let watched = (!told).then(|| {
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
            (status, watcher)
        });
        if let Some(slot) = self.slots.get_mut(id) {
            slot.installed = Some(Installed { handle, watched, generation, service, token });
        }
        self.send_record(id);
    }

    fn uninstall(&mut self, id: &ProxyId) {
        let Some(slot) = self.slots.get_mut(id) else { return };
        if let Some(installed) = slot.installed.take() {
            if let Some((_, watcher)) = installed.watched {
                watcher.abort();
            }
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
            // Its dependents may be waiting for what it just reached.
            self.wake_around(id);
            self.plan_woken();
        }
    }

    /// Nothing to do for `id`: if its instance runs what is wanted (a change of the service
    /// that touches nothing of the proxy), the wanted revision is the one it applies.
    fn note_applied(&mut self, id: &ProxyId) {
        let Some(wanted) = self.desired.get(id) else { return };
        let Some(slot) = self.slots.get_mut(id) else { return };
        let runs_it = matches!(&slot.observed, Observed::Running { applied } if Arc::ptr_eq(applied, &wanted.proxy)
            || applied.change_to(&wanted.proxy) == tether_state::ProxyChange::Unchanged);
        if runs_it && slot.installed.is_some() && slot.applied_revision != Some(wanted.revision) {
            slot.applied_revision = Some(wanted.revision);
            self.publish(id);
        }
    }

    fn publish(&self, id: &ProxyId) {
        let Some(slot) = self.slots.get(id) else { return };
        let process = slot.installed.as_ref().map(Installed::status).unwrap_or_default();
        let queued = self.in_backlog.contains(id);
        let update = slot.overlap.as_deref().and_then(|(next, _)| next.borrow().clone()).map(|next| UpdateStatus {
            state: next.state.into(),
            pid: next.figures.pid,
            started_at: next.figures.started_at,
        });
        let (state, error) = match (&slot.busy, &slot.observed) {
            // The old instance serves while the new one starts beside it.
            (Some(Action::Restart), _) if slot.overlap.is_some() => {
                // A hot restart that waits for an old generation to exit says so.
                let waits = slot.overlap.as_deref().and_then(|(next, _)| {
                    next.borrow()
                        .as_ref()
                        .filter(|next| next.state == crate::backend::BackendState::Pending)?
                        .figures
                        .error
                        .clone()
                });
                (process.state.into(), waits.or_else(|| process.figures.error.clone()))
            }
            (Some(Action::Start), _) => (ProxyState::Starting, None),
            (Some(Action::Stop | Action::Restart), _) => (ProxyState::Stopping, None),
            (_, Observed::Blocked { .. }) => (ProxyState::Blocked, slot.error.clone()),
            (_, Observed::Failed { .. }) if slot.old_serves && slot.installed.is_some() => {
                (process.state.into(), slot.error.clone())
            }
            (_, Observed::Failed { .. }) => (ProxyState::Failed, slot.error.clone()),
            (_, Observed::Idle) if slot.installed.is_none() && self.held.contains(id) => (ProxyState::Stopped, None),
            (_, Observed::Idle) if slot.waiting => (ProxyState::Waiting, slot.error.clone()),
            (_, Observed::Idle) => (ProxyState::Pending, None),
            _ if queued && slot.installed.is_none() => (ProxyState::Pending, None),
            _ => (process.state.into(), process.figures.error.clone()),
        };
        self.published.set(ProxyStatus {
            id: id.clone(),
            service: id.service_id(),
            state,
            figures: ProcessFigures {
                restarts: process.figures.restarts.saturating_add(slot.restarts_base),
                error,
                status_text: process.figures.pid.and(process.figures.status_text),
                ..process.figures
            },
            update,
            generations: (!process.generations.is_empty()).then(|| process.generations.into_boxed_slice()),
            usage: None,
            applied_revision: slot.installed.as_ref().and(slot.applied_revision),
        });
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

mod actions;
mod coalescing;
mod ordering;
mod records;
mod restore;
mod slot;

use coalescing::{Coalescing, Offered, Window};
use ordering::StopOrder;
use records::encoded_service;
use restore::RestoreStage;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;

/// A backend call of a shutdown that ended without an answer. In tests a panic there is most
/// often a mock's unmet expectation: raised again, so that the test fails instead of passing
/// with the complaint in its output. An agent logs it and goes on with the other proxies.
fn ended_abnormally(call: &'static str, join: tokio::task::JoinError) {
    #[cfg(any(test, feature = "testing"))]
    if join.is_panic() {
        std::panic::resume_unwind(join.into_panic());
    }
    tracing::error!(call, error = %join, "a backend call ended abnormally during shutdown");
}
