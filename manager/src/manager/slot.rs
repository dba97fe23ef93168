//! Everything the engine knows of one proxy ([`Slot`]): what it observes, the handle it
//! holds ([`Installed`]), the action running on it, and what an action reports back
//! ([`Outcome`]).

use std::sync::Arc;

use tether_state::{ManagedProxy, Revision, TokenFingerprint};
use tokio::sync::{oneshot, watch};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::{BackendError, BackendStatus, ProxyHandle};
use crate::plan::{Action, Observed};
use crate::snapshot::EncodedService;
use crate::status::RequestError;

/// Where the answer to a restart asked through a handle goes.
pub(super) type RequestDone = oneshot::Sender<Result<(), RequestError>>;

/// A handle the engine holds, with what it needs to report and snapshot it.
pub(super) struct Installed {
    pub(super) handle: Arc<dyn ProxyHandle>,
    /// The handle's status channel, and the task that waits on it, when the backend does not
    /// tell of its changes itself ([`ProxyHandle::on_status_change`]); `None` when it does:
    /// its status is then read from the handle ([`ProxyHandle::status_now`]).
    pub(super) watched: Option<(watch::Receiver<BackendStatus>, AbortHandle)>,
    pub(super) generation: u64,
    /// What the snapshot records the process was started from, encoded once.
    pub(super) service: Option<EncodedService>,
    pub(super) token: Option<TokenFingerprint>,
}

impl Installed {
    /// The handle's status now.
    pub(super) fn status(&self) -> BackendStatus {
        match &self.watched {
            Some((status, _)) => status.borrow().clone(),
            None => self.handle.status_now(),
        }
    }
}

/// Everything the engine knows of one proxy.
pub(super) struct Slot {
    pub(super) observed: Observed,
    pub(super) installed: Option<Installed>,
    /// The action running on it, if any: at most one, always.
    pub(super) busy: Option<Action>,
    /// What was wanted when the running action was launched, and its catalog revision.
    pub(super) launched_for: Option<Arc<ManagedProxy>>,
    pub(super) launched_revision: Option<Revision>,
    /// The catalog revision of the definition the installed instance runs.
    pub(super) applied_revision: Option<Revision>,
    pub(super) error: Option<String>,
    /// Starts that failed in a row; the next retry waits per the restart policy.
    pub(super) start_failures: u32,
    /// When the failed start is tried again, if it is to be.
    pub(super) retry_at: Option<Instant>,
    /// Restarts counted before the current handle: kept across `tether restart`.
    pub(super) restarts_base: u64,
    /// A restart asked through a handle, answered when its action is done, with the
    /// restart count to keep.
    pub(super) requested: Option<Box<(RequestDone, u64)>>,
    /// The new instance of the overlapping update in flight, and the task that publishes
    /// its changes. (Boxed, as is `requested`: the engine holds a slot per proxy, and few
    /// are updated or restarted at any moment.)
    pub(super) overlap: Option<Box<(watch::Receiver<Option<BackendStatus>>, AbortHandle)>>,
    /// Cancelled to give up a hot restart (`update = "epoch"`) that still waits for an old
    /// generation to exit, when what it would start is no longer wanted.
    pub(super) superseded: Option<CancellationToken>,
    /// The last overlapping update was abandoned, and the instance it would have replaced
    /// still serves: shown as it runs, with the error.
    pub(super) old_serves: bool,
    /// Not started because its dependencies have not reached their conditions; `error`
    /// says which.
    pub(super) waiting: bool,
    /// Runs, and must stop because a dependency goes away: its dependents stop first.
    pub(super) draining: bool,
}

impl Slot {
    pub(super) fn new() -> Self {
        Self {
            observed: Observed::Idle,
            installed: None,
            busy: None,
            launched_for: None,
            launched_revision: None,
            applied_revision: None,
            error: None,
            start_failures: 0,
            retry_at: None,
            restarts_base: 0,
            requested: None,
            overlap: None,
            superseded: None,
            old_serves: false,
            waiting: false,
            draining: false,
        }
    }
}

/// What an action task reports back.
pub(super) enum Outcome {
    Started {
        proxy: Arc<ManagedProxy>,
        handle: Box<dyn ProxyHandle>,
    },
    StartFailed {
        error: BackendError,
    },
    Stopped,
    StopFailed {
        error: BackendError,
    },
    Updated {
        proxy: Arc<ManagedProxy>,
    },
    UpdateFailed {
        error: BackendError,
    },
    /// An overlapping update was abandoned: the old instance serves on.
    OverlapFailed {
        reason: String,
    },
}
