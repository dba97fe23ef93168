//! What the supervisor observed about a process: [`ProcessStatus`], and the list of what it
//! supervises ([`SupervisedProcess`]).
//!
//! This module owns the observation types published through the status channel. It
//! never decides anything: the supervisor task writes these values, callers read them.

use std::fmt;
use std::time::SystemTime;

use crate::proc::Identity;
use crate::spec::ProcessName;

/// The lifecycle state of a supervised process.
///
/// Its own type, not the engine's, because it says what a supervisor alone knows: this
/// crate's [`Supervisor`](crate::Supervisor) is used without the engine (default features
/// off), and a process it supervises has no `pending` (it exists from its spawn) but ends in
/// `stopped` or `failed`, after which nothing restarts it ([`is_final`](Self::is_final)).
/// The engine's states `pending`, `waiting`, `blocked` and a `stopped` held down by the
/// operator are decisions no supervisor makes. With the `manager` feature, one `From` maps
/// it to the backend seam's `BackendState` (`stopped` becomes `stopping`: the engine drops
/// the handle once its stop returns); its names are those of the engine's states, which a
/// test of that mapping pins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProcessState {
    /// A new instance is being spawned, or runs and is not ready yet (its readiness check
    /// has not passed).
    Starting,
    /// The process exists, and is ready.
    Running,
    /// The process exited, or its restart failed (`error` says why), and it waits for its
    /// restart delay.
    Backoff,
    /// A stop is in progress.
    Stopping,
    /// The process was stopped; it will not be restarted.
    Stopped,
    /// The process can no longer be watched; `error` says why. Supervision has ended.
    Failed,
}

impl ProcessState {
    /// Whether supervision has ended in this state.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Stopped | Self::Failed)
    }

    /// The lowercase name that the CLI and the API show (`running`, `backoff`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Backoff => "backoff",
            Self::Stopping => "stopping",
            Self::Stopped => "stopped",
            Self::Failed => "failed",
        }
    }
}

impl fmt::Display for ProcessState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

pub use tether_state::{ExitReason, ProcessFigures};

/// The last observed status of a supervised process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessStatus {
    /// The lifecycle state.
    pub state: ProcessState,
    /// What proves, after a restart of the supervising side, that the current instance is
    /// still this process: what a snapshot records. `None` while no instance exists.
    pub identity: Option<Identity>,
    /// Whether the current instance counts as ready: it runs, and its readiness check (if
    /// any) passed. `starting` with a pid means "runs, not ready yet". Always `false` while
    /// no instance runs (`backoff`, `stopped`, `failed`) and once a stop has begun
    /// (`stopping`): a process told to exit no longer takes work.
    pub ready: bool,
    /// Its pid, restarts, start, last exit, error, own account, failed checks and reloads:
    /// what the backend passes on unchanged.
    pub figures: ProcessFigures,
}

impl ProcessStatus {
    /// A new instance: `running` and ready, or `starting` until its readiness passes.
    pub(crate) fn running(pid: u32, started_at: SystemTime, identity: Option<Identity>, ready: bool) -> Self {
        Self {
            state: if ready { ProcessState::Running } else { ProcessState::Starting },
            ready,
            identity,
            figures: ProcessFigures { pid: Some(pid), started_at: Some(started_at), ..ProcessFigures::default() },
        }
    }
}

/// A process that a [`Supervisor`](crate::Supervisor) supervises, as
/// [`Supervisor::processes`](crate::Supervisor::processes) lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SupervisedProcess {
    /// Its name, from its spec.
    pub name: ProcessName,
    /// Its last observed status: its state, the pid of its current instance (none while it
    /// waits to restart), whether it is ready, …
    pub status: ProcessStatus,
}
