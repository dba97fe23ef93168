//! What the engine reports: the status of every proxy, the stream of status changes, and
//! reconcile counters, behind a cheap, cloneable [`ManagerHandle`].
//!
//! This module owns the published view and nothing else: it never decides or starts
//! anything, and its lock is held only to copy a value in or out, never across an await.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, SystemTime};

use tether_state::{ExitReason, ProcessFigures, ProxyId, ReloadOutcome, Revision, ServiceId};
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::backend::{BackendStats, Generation, Meter, ProxyState, ResourceUsage};

/// One proxy's status, as the engine publishes it: what its backend observed of its process,
/// and the engine's own view of it (its state, its update, what it uses, the revision it
/// runs). `tether status --json` and the API show it.
///
/// ```
/// use tether_manager::{ProxyState, ProxyStatus};
/// use tether_state::{ProcessFigures, ServiceId};
///
/// let service = ServiceId::new("web").unwrap();
/// let status = ProxyStatus {
///     id: service.proxy_id(),
///     service,
///     state: ProxyState::Running,
///     figures: ProcessFigures { pid: Some(42), ..ProcessFigures::default() },
///     update: None,
///     generations: None,
///     usage: None,
///     applied_revision: None,
/// };
/// assert!(status.ready());
/// assert_eq!(status.figures.pid, Some(42));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyStatus {
    /// The proxy.
    pub id: ProxyId,
    /// Its service.
    pub service: ServiceId,
    /// Its state.
    pub state: ProxyState,
    /// Its process's pid, restarts, start, last exit, error, own account, failed checks and
    /// reloads, as its backend observed them ([`BackendStatus::figures`]), with the engine's
    /// own part: `restarts` counts those of the instances it replaced too, `error` says why
    /// it is blocked, failed or waiting when the engine decided it, and `status_text` is
    /// shown while a process runs only.
    ///
    /// [`BackendStatus::figures`]: crate::BackendStatus::figures
    pub figures: ProcessFigures,
    /// The new instance of an overlapping update (`update = "overlap"`), or the new
    /// generation of a hot restart (`update = "epoch"`), while it starts beside the instance
    /// described above, which serves until it is ready.
    pub update: Option<UpdateStatus>,
    /// For `update = "epoch"`: every live generation, the current one (described above)
    /// first, then a new one starting and old ones draining. Empty for other proxies.
    /// Boxed: most proxies have none, and the board keeps one status per proxy.
    pub generations: Option<Box<[Generation]>>,
    /// What its running instance uses now, as the engine's [`Meter`] measures it: read when
    /// the status is read through [`ManagerHandle::status`] or [`ManagerHandle::proxy`];
    /// `None` in [`ProxyEvent`]s, whose figures would be stale at once, and while no process
    /// runs.
    /// Boxed: most statuses (every event's) have none, and the board keeps one per proxy.
    pub usage: Option<Box<ResourceUsage>>,
    /// The catalog revision of the service definition that its instance runs: the one it
    /// was started from or last updated in place to (a change of the service that touches
    /// nothing of the proxy counts as applied at once). `None` while no instance runs.
    pub applied_revision: Option<Revision>,
}

/// The new instance of an overlapping update, as the backend observes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpdateStatus {
    /// `starting` until it is ready; anything else ends the update.
    pub state: ProxyState,
    /// Its process id, once it has one.
    pub pid: Option<u32>,
    /// When it started.
    pub started_at: Option<SystemTime>,
}

impl ProxyStatus {
    /// Whether it is ready: `running` means started and ready (its readiness check, if it
    /// has one, passed).
    pub fn ready(&self) -> bool {
        self.state == ProxyState::Running
    }
}

/// A change in what the engine reports.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProxyEvent {
    /// A proxy's status is now this.
    Changed(ProxyStatus),
    /// A proxy left the list: it is no longer wanted and nothing of it runs.
    Removed(ProxyId),
}

/// Upper bounds, in seconds, of the buckets of [`ReconcileStats::pass_buckets`].
pub const PASS_BUCKETS: [f64; 12] = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0];

/// What an action does to a proxy, as counted in [`ReconcileStats::actions_by_kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum ActionKind {
    /// Started a proxy.
    Start,
    /// Stopped a proxy.
    Stop,
    /// Stopped a proxy and started it again from a changed spec.
    Restart,
    /// Applied a change in place.
    Update,
}

impl ActionKind {
    /// The kind's name, as metrics label it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Start => "start",
            Self::Stop => "stop",
            Self::Restart => "restart",
            Self::Update => "update",
        }
    }
}

/// Reconcile counters and timings, for metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReconcileStats {
    /// Reconcile passes so far.
    pub passes: u64,
    /// The catalog revision the last pass reflects.
    pub revision: Option<Revision>,
    /// How long the last pass took (reading changes, planning, dispatching).
    pub last_duration: Duration,
    /// How long all passes took.
    pub total_duration: Duration,
    /// Actions (start, stop, restart, in-place update) dispatched so far.
    pub actions: u64,
    /// Actions that failed so far.
    pub failures: u64,
    /// Actions running now.
    pub in_flight: usize,
    /// Actions waiting for a free slot now.
    pub queued: usize,
    /// Proxies whose latest change is held back now, because they keep changing (see
    /// `ManagerConfig::sync_quiescent`).
    pub deferred: usize,
    /// Passes by duration: entry `i` counts the passes that took at most `PASS_BUCKETS[i]`
    /// and more than the bucket before; the last entry counts the longer ones.
    pub pass_buckets: [u64; PASS_BUCKETS.len() + 1],
    /// Finished actions by kind and by success (`true`) or failure.
    pub actions_by_kind: BTreeMap<(ActionKind, bool), u64>,
    /// Process exits observed, by exit code or signal (stops included; the exits of
    /// adopted processes, whose status belongs to their real parent, are not known).
    pub exits: BTreeMap<ExitReason, u64>,
    /// Snapshots written.
    pub snapshot_writes: u64,
    /// Snapshot writes that failed (and are retried on the next change).
    pub snapshot_failures: u64,
    /// Proxies taken over from an earlier agent, proven to be the same process.
    pub adopted: u64,
    /// Snapshot records or candidates dropped because nothing proved their process.
    pub dropped: u64,
}

impl ReconcileStats {
    /// Counts one pass of `duration`.
    pub(crate) fn observe_pass(&mut self, duration: Duration) {
        let seconds = duration.as_secs_f64();
        let bucket = PASS_BUCKETS.iter().position(|&bound| seconds <= bound).unwrap_or(PASS_BUCKETS.len());
        self.pass_buckets[bucket] += 1;
        self.passes += 1;
        self.last_duration = duration;
        self.total_duration += duration;
    }
}

#[derive(Debug, Default)]
pub(crate) struct Board {
    /// Boxed: the tree's nodes keep free slots, each as large as its value.
    pub(crate) proxies: BTreeMap<ProxyId, Box<ProxyStatus>>,
    pub(crate) stats: ReconcileStats,
}

/// Shared between the engine (the only writer) and its handles.
#[derive(Clone)]
pub(crate) struct Published {
    board: Arc<Mutex<Board>>,
    events: broadcast::Sender<ProxyEvent>,
    requests: mpsc::UnboundedSender<Request>,
    /// What measures usage and keeps the backend's own counters, read by handles; set once,
    /// by [`crate::Manager::with_meter`].
    meter: Arc<OnceLock<Arc<dyn Meter>>>,
}

impl std::fmt::Debug for Published {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Published").field("board", &self.board).finish_non_exhaustive()
    }
}

/// What a handle asks of the engine.
#[derive(Debug)]
pub(crate) enum Request {
    /// Restart one proxy now; answered once the new process runs, or why not.
    Restart { id: ProxyId, done: oneshot::Sender<Result<(), RequestError>> },
    /// Reload one proxy in place; answered with the verdict.
    Reload { id: ProxyId, done: oneshot::Sender<Result<ReloadOutcome, RequestError>> },
    /// Hold one proxy down (`hold`), or release it; answered at once.
    Hold { id: ProxyId, hold: bool, done: oneshot::Sender<Result<(), RequestError>> },
}

/// A request to the engine that it did not carry out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// No proxy of that id is wanted.
    #[error("no proxy {0}")]
    NotFound(ProxyId),
    /// Another action runs on the proxy; it may be asked again once that is done.
    #[error("proxy {0} is busy with another action; try again")]
    Busy(ProxyId),
    /// Policy refuses to run the proxy (it is `blocked`).
    #[error("proxy {id} is blocked: {reason}")]
    Blocked {
        /// The proxy.
        id: ProxyId,
        /// Why.
        reason: String,
    },
    /// The action ran and failed.
    #[error("proxy {id} could not be restarted: {reason}")]
    Failed {
        /// The proxy.
        id: ProxyId,
        /// Why.
        reason: String,
    },
    /// The proxy has no `reload` table: it cannot be reloaded in place.
    #[error("proxy {0} has no reload table: it cannot be reloaded in place")]
    NoReload(ProxyId),
    /// The proxy has no process to reload (it is not started, or between two instances).
    #[error("proxy {id} cannot be reloaded now: it is {state}")]
    NotRunning {
        /// The proxy.
        id: ProxyId,
        /// Its state.
        state: ProxyState,
    },
    /// The engine is not running (shutting down, or gone).
    #[error("the engine is not running")]
    Gone,
}

/// Events a slow subscriber may fall behind by before it sees `Lagged`.
const EVENT_CAPACITY: usize = 1024;

impl Published {
    /// A board whose handles send their requests to `requests`.
    pub(crate) fn with_requests(requests: mpsc::UnboundedSender<Request>) -> Self {
        Self { board: Arc::default(), events: broadcast::Sender::new(EVENT_CAPACITY), requests, meter: Arc::default() }
    }

    /// A board whose handles' requests go nowhere (answered `Gone`).
    #[cfg(test)]
    pub(crate) fn new() -> Self {
        Self::with_requests(mpsc::unbounded_channel().0)
    }

    /// Measures with `meter` from now on; `false` if a meter was set already.
    pub(crate) fn set_meter(&self, meter: Arc<dyn Meter>) -> bool {
        self.meter.set(meter).is_ok()
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Board> {
        // Every critical section copies whole values in or out, so a panic inside one
        // cannot leave the board half-updated.
        tether_state::lock(&self.board)
    }

    /// Publishes `status` if it differs from what is shown.
    pub(crate) fn set(&self, status: ProxyStatus) {
        let mut board = self.lock();
        let shown = board.proxies.get(&status.id).map(|shown| &**shown);
        if shown == Some(&status) {
            return;
        }
        // Exits seen so far: one per restart, and one more while the last process is gone.
        // Counting the growth of that number catches an exit even when the restart that
        // followed it is already shown.
        let exits_seen =
            |s: &ProxyStatus| s.figures.restarts + u64::from(s.figures.pid.is_none() && s.figures.last_exit.is_some());
        let grown = exits_seen(&status).saturating_sub(shown.map_or(0, exits_seen));
        if let (true, Some(exit)) = (grown > 0, status.figures.last_exit) {
            *board.stats.exits.entry(exit).or_default() += grown;
        }
        board.proxies.insert(status.id.clone(), Box::new(status.clone()));
        drop(board);
        // No subscriber is not an error: the API and metrics may not have started yet.
        let _ = self.events.send(ProxyEvent::Changed(status));
    }

    pub(crate) fn remove(&self, id: &ProxyId) {
        if self.lock().proxies.remove(id).is_some() {
            let _ = self.events.send(ProxyEvent::Removed(id.clone()));
        }
    }

    pub(crate) fn handle(&self) -> ManagerHandle {
        ManagerHandle { published: self.clone() }
    }
}

/// A read-only view of a running [`crate::Manager`]: statuses, events and counters.
/// Cheap to clone; it stays valid after the manager is gone (showing its last state).
#[derive(Debug, Clone)]
pub struct ManagerHandle {
    published: Published,
}

impl ManagerHandle {
    /// The status of every proxy, ordered by id, with what each one uses now.
    pub fn status(&self) -> Vec<ProxyStatus> {
        let mut statuses: Vec<ProxyStatus> =
            self.published.lock().proxies.values().map(|status| (**status).clone()).collect();
        // Measured outside the lock: the engine never waits for a reader's measurements.
        for status in &mut statuses {
            self.measure(status);
        }
        statuses
    }

    /// The status of every proxy, ordered by id, as the engine last published it: without
    /// `usage`, which takes a read of each proxy's accounting (for a cgroup, a flush of the
    /// kernel's counters). For readers that only want states, pids and errors, often.
    pub fn status_unmeasured(&self) -> Vec<ProxyStatus> {
        self.published.lock().proxies.values().map(|status| (**status).clone()).collect()
    }

    /// The status of one proxy, with what it uses now.
    pub fn proxy(&self, id: &ProxyId) -> Option<ProxyStatus> {
        let mut status = self.published.lock().proxies.get(id).map(|status| (**status).clone())?;
        self.measure(&mut status);
        Some(status)
    }

    fn measure(&self, status: &mut ProxyStatus) {
        let Some(meter) = self.published.meter.get() else { return };
        status.usage = status.figures.pid.and_then(|pid| meter.usage(&status.id, pid)).map(Box::new);
    }

    /// The backend's own counters ([`Meter::stats`]); none without a meter.
    pub fn backend_stats(&self) -> BackendStats {
        self.published.meter.get().map(|meter| meter.stats()).unwrap_or_default()
    }

    /// Reconcile counters and timings.
    pub fn stats(&self) -> ReconcileStats {
        self.published.lock().stats.clone()
    }

    /// Every status change from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<ProxyEvent> {
        self.published.events.subscribe()
    }

    /// Restarts proxy `id` now: stops it and starts it again from what the catalog wants,
    /// as a change that needs a restart does. It keeps its restart count. Returns once the
    /// new process runs.
    ///
    /// # Errors
    ///
    /// [`RequestError`]: no such proxy, another action runs on it, it is blocked, the
    /// restart failed, or the engine is not running.
    pub async fn restart(&self, id: &ProxyId) -> Result<(), RequestError> {
        let (done, answer) = oneshot::channel();
        let request = Request::Restart { id: id.clone(), done };
        self.published.requests.send(request).map_err(|_| RequestError::Gone)?;
        answer.await.unwrap_or(Err(RequestError::Gone))
    }

    /// Reloads proxy `id` in place, as its `reload` table says, and returns the verdict
    /// (applied, signalled, refused, failed or timed out); it also shows in the proxy's
    /// status. A reload asked while another of the same proxy runs runs after it.
    ///
    /// # Errors
    ///
    /// [`RequestError`]: no such proxy, it has no `reload` table, it has no process, or the
    /// engine is not running.
    pub async fn reload(&self, id: &ProxyId) -> Result<ReloadOutcome, RequestError> {
        let (done, answer) = oneshot::channel();
        let request = Request::Reload { id: id.clone(), done };
        self.published.requests.send(request).map_err(|_| RequestError::Gone)?;
        answer.await.unwrap_or(Err(RequestError::Gone))
    }

    /// Returns once the engine is gone (dropped, closed or killed): nothing will change any
    /// more. A test's waits end on it rather than at their deadline.
    #[cfg(feature = "testing")]
    pub(crate) async fn engine_gone(&self) {
        self.published.requests.closed().await;
    }

    /// Holds proxy `id` down (`hold`: it is stopped, and stays `stopped` through catalog
    /// changes until released), or releases it (it starts again). Returns once the engine
    /// has taken the request, not once the proxy has stopped or started: watch its status.
    ///
    /// # Errors
    ///
    /// [`RequestError::NotFound`] when no proxy of that id is wanted, or
    /// [`RequestError::Gone`].
    pub async fn hold(&self, id: &ProxyId, hold: bool) -> Result<(), RequestError> {
        let (done, answer) = oneshot::channel();
        let request = Request::Hold { id: id.clone(), hold, done };
        self.published.requests.send(request).map_err(|_| RequestError::Gone)?;
        answer.await.unwrap_or(Err(RequestError::Gone))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(pid: Option<u32>, last_exit: Option<ExitReason>) -> ProxyStatus {
        ProxyStatus {
            update: None,
            generations: None,
            id: ServiceId::new("web").unwrap().proxy_id(),
            service: ServiceId::new("web").unwrap(),
            state: ProxyState::Running,
            figures: ProcessFigures { pid, last_exit, ..ProcessFigures::default() },
            usage: None,
            applied_revision: None,
        }
    }

    #[test]
    fn an_exit_is_counted_once_when_a_process_goes_away() {
        let published = Published::new();
        let restarted = |restarts, pid, exit| {
            let status = status(pid, exit);
            ProxyStatus { figures: ProcessFigures { restarts, ..status.figures }, ..status }
        };
        published.set(status(Some(1), None));
        published.set(status(None, Some(ExitReason::Code(3))));
        // The same status again, and the restart of that exit, count nothing.
        published.set(status(None, Some(ExitReason::Code(3))));
        published.set(restarted(1, Some(2), Some(ExitReason::Code(3))));
        // An exit whose restart is already shown when it is published still counts.
        published.set(restarted(2, Some(3), Some(ExitReason::Signal(9))));
        // A stop: the process is gone and says how it ended.
        published.set(restarted(2, None, Some(ExitReason::Code(0))));
        let exits = published.handle().stats().exits;
        assert_eq!(
            exits,
            BTreeMap::from([(ExitReason::Code(0), 1), (ExitReason::Code(3), 1), (ExitReason::Signal(9), 1)])
        );
    }

    #[test]
    fn passes_fall_into_their_buckets() {
        let mut stats = ReconcileStats::default();
        stats.observe_pass(Duration::from_micros(50));
        stats.observe_pass(Duration::from_micros(100));
        stats.observe_pass(Duration::from_millis(3));
        stats.observe_pass(Duration::from_secs(2));
        assert_eq!(stats.pass_buckets[0], 2, "a bound is inclusive");
        assert_eq!(stats.pass_buckets[5], 1, "3 ms is in the 5 ms bucket");
        assert_eq!(stats.pass_buckets[PASS_BUCKETS.len()], 1, "longer than every bound");
        assert_eq!(stats.passes, 4);
    }
}
