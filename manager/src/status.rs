//! What the engine reports: the status of every proxy, the stream of status changes, and
//! reconcile counters, behind a cheap, cloneable [`ManagerHandle`].
//!
//! This module owns the published view and nothing else: it never decides or starts
//! anything, and its lock is held only to copy a value in or out, never across an await.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use tether_state::{ProxyId, Revision, ServiceId};
use tokio::sync::broadcast;

use crate::backend::{LastExit, ProxyState};

/// One proxy's status, as `tether status --json` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyStatus {
    /// The proxy.
    pub id: ProxyId,
    /// Its service.
    pub service: ServiceId,
    /// Its state.
    pub state: ProxyState,
    /// The pid of its process, while there is one.
    pub pid: Option<u32>,
    /// Restarts after exits.
    pub restarts: u32,
    /// When its current process started.
    pub started_at: Option<SystemTime>,
    /// How its previous process ended.
    pub last_exit: Option<LastExit>,
    /// Why it is blocked, failed or backing off.
    pub error: Option<String>,
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
}

#[derive(Debug, Default)]
pub(crate) struct Board {
    pub(crate) proxies: BTreeMap<ProxyId, ProxyStatus>,
    pub(crate) stats: ReconcileStats,
}

/// Shared between the engine (the only writer) and its handles.
#[derive(Debug, Clone)]
pub(crate) struct Published {
    board: Arc<Mutex<Board>>,
    events: broadcast::Sender<ProxyEvent>,
}

/// Events a slow subscriber may fall behind by before it sees `Lagged`.
const EVENT_CAPACITY: usize = 1024;

impl Published {
    pub(crate) fn new() -> Self {
        Self { board: Arc::default(), events: broadcast::Sender::new(EVENT_CAPACITY) }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Board> {
        // Every critical section copies whole values in or out, so a panic inside one
        // cannot leave the board half-updated.
        self.board.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Publishes `status` if it differs from what is shown.
    pub(crate) fn set(&self, status: ProxyStatus) {
        let mut board = self.lock();
        if board.proxies.get(&status.id) == Some(&status) {
            return;
        }
        board.proxies.insert(status.id.clone(), status.clone());
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
    /// The status of every proxy, ordered by id.
    pub fn status(&self) -> Vec<ProxyStatus> {
        self.published.lock().proxies.values().cloned().collect()
    }

    /// The status of one proxy.
    pub fn proxy(&self, id: &ProxyId) -> Option<ProxyStatus> {
        self.published.lock().proxies.get(id).cloned()
    }

    /// Reconcile counters and timings.
    pub fn stats(&self) -> ReconcileStats {
        self.published.lock().stats.clone()
    }

    /// Every status change from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<ProxyEvent> {
        self.published.events.subscribe()
    }
}
