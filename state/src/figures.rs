//! What a supervisor counts and records of one process, as every status shape of a proxy
//! carries it: [`ProcessFigures`], observed once and embedded, never copied field by field.

use std::time::SystemTime;

use crate::{ExitReason, Reloads};

/// The figures of one supervised process that pass unchanged from the supervisor's status
/// to the backend's: its pid, restarts, start, last exit, error, own account, failed checks
/// and reloads.
///
/// A figure that a supervisor learns and operators see is added here once; the supervisor's
/// status and the backend seam's both carry this struct.
///
/// ```
/// use tether_state::ProcessFigures;
///
/// let figures = ProcessFigures { pid: Some(42), restarts: 1, ..ProcessFigures::default() };
/// assert_eq!(figures.pid, Some(42));
/// assert!(figures.reloads.is_none());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProcessFigures {
    /// The pid of the current instance, while one exists.
    pub pid: Option<u32>,
    /// Restarts after an exit since supervision began (not reset by a healthy run).
    pub restarts: u64,
    /// When the current (or last) instance started.
    pub started_at: Option<SystemTime>,
    /// How the previous instance ended. `None` before the first exit, and for adopted
    /// processes, whose exit status belongs to their real parent.
    pub last_exit: Option<ExitReason>,
    /// The last error, if the latest operation on the process failed, or why its checks
    /// fail (a readiness probe while it starts, liveness probes that failed or restarted it),
    /// for display.
    pub error: Option<String>,
    /// The instance's own account of itself (sd_notify's `STATUS=`), if it gives one.
    pub status_text: Option<String>,
    /// Failed readiness and liveness checks since supervision began.
    pub probe_failures: u64,
    /// Its reloads since supervision began: the last one and the counts, once there was
    /// one. Boxed: most processes never reload.
    pub reloads: Option<Box<Reloads>>,
}
