//! The seam through which the engine drives whatever runs proxies: [`ProxyBackend`] builds
//! and restores [`ProxyHandle`]s, and a handle starts, stops, detaches and observes one
//! proxy.
//!
//! This module owns the vocabulary of that seam (states, exit reports, [`BackendError`]).
//! It must never know how a proxy runs: no process ids are signalled here, no `nix`, no
//! `tokio::process`. Restarting a proxy that exited is the backend's job; the engine only
//! decides what should run.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tether_state::{ManagedProxy, ProcessFigures, ProxyId, ReloadOutcome};
use tokio::sync::watch;

/// A boxed error from a backend's own layer, kept as the `source` of a [`BackendError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The state of a proxy, as `tether status`, the API and the metrics name it.
///
/// The engine's own states beside those a backend observes ([`BackendState`], converted by
/// `From`): `waiting` (for its `depends_on`), `stopped` (held down by the operator) and
/// `blocked` (refused by policy) are decisions of the engine, and it shows `pending`,
/// `starting` and `stopping` by itself while its actions run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum ProxyState {
    /// Wanted, not started yet.
    #[default]
    Pending,
    /// Wanted, and not started yet because what it depends on (`depends_on`) has not reached
    /// its condition; the error names what it waits for.
    Waiting,
    /// Being started, or started and not ready yet (its readiness check has not passed).
    Starting,
    /// Running, and ready: a backend that checks readiness reports `Starting` until then.
    Running,
    /// Exited, waiting to be restarted by the backend.
    Backoff,
    /// Being stopped.
    Stopping,
    /// Held down by the operator (`tether stop`) until released (`tether start`).
    Stopped,
    /// Refused by policy (running as root); the error says why.
    Blocked,
    /// Cannot be started or stopped; the error says why, and the next change retries it.
    Failed,
}

impl ProxyState {
    /// The state's name, as the CLI, the API and the metrics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Waiting => "waiting",
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Backoff => "backoff",
            Self::Stopping => "stopping",
            Self::Stopped => "stopped",
            Self::Blocked => "blocked",
            Self::Failed => "failed",
        }
    }
}

impl fmt::Display for ProxyState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The state of one proxy's process as its backend observes it: the part of [`ProxyState`]
/// that a backend reports.
///
/// Its own type so that a backend (the process supervisor's adapter, the built-in proxy's,
/// a test's mock, another project's) cannot report a decision of the engine. A supervisor's
/// own states map to it in that backend's adapter (for tether's process backend, one
/// `From` in `tether-proxy-daemon`): a supervisor's `stopped` is reported as `stopping`.
/// The other states are the engine's own: `blocked` (refused by policy), `stopped` (held
/// down by the operator) and `waiting` (for its dependencies) are decisions, not
/// observations, and the engine shows `pending`,
/// `starting` and `stopping` by itself while its actions run. What a backend reports is shown
/// as the engine's [`ProxyState`] of the same name, converted by `From` in one place.
///
/// ```
/// use tether_manager::{BackendState, ProxyState};
///
/// assert_eq!(ProxyState::from(BackendState::Backoff), ProxyState::Backoff);
/// assert_eq!(BackendState::default(), BackendState::Pending);
/// assert_eq!(BackendState::Running.to_string(), "running");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum BackendState {
    /// Not started: the state of a new handle until its start sets another one.
    #[default]
    Pending,
    /// Being started, or started and not ready yet (its readiness check has not passed).
    Starting,
    /// Running, and ready.
    Running,
    /// Exited, waiting for the backend to restart it on its backoff.
    Backoff,
    /// Being stopped, or stopped: the engine drops the handle once its stop returns.
    Stopping,
    /// The backend can no longer run or watch the process; its figures'
    /// [`error`](ProcessFigures::error) say why.
    Failed,
}

impl From<BackendState> for ProxyState {
    fn from(state: BackendState) -> Self {
        match state {
            BackendState::Pending => Self::Pending,
            BackendState::Starting => Self::Starting,
            BackendState::Running => Self::Running,
            BackendState::Backoff => Self::Backoff,
            BackendState::Stopping => Self::Stopping,
            BackendState::Failed => Self::Failed,
        }
    }
}

impl fmt::Display for BackendState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(ProxyState::from(*self).as_str())
    }
}

/// What a backend observes of one proxy's process.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BackendStatus {
    /// The process's state; [`BackendState::Pending`] until the handle is started.
    pub state: BackendState,
    /// The process's pid, restarts, start, last exit, error, own account, failed checks and
    /// reloads ([`ProxyHandle::reload`]), as the supervisor observes them: `error` says why
    /// the backend gave up or is backing off, or why the proxy's checks fail.
    pub figures: ProcessFigures,
    /// For a proxy that hands over by itself (`update = "epoch"`): every live generation of
    /// it, this handle's own first, then the others (a new one starting beside it, old ones
    /// draining). Empty for other proxies.
    pub generations: Vec<Generation>,
}

/// One live generation of a proxy that hands over by itself (`update = "epoch"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Generation {
    /// Its restart epoch: 0 at a cold start, one more at each hot restart.
    pub epoch: u32,
    /// Its process id, while it has a process.
    pub pid: Option<u32>,
    /// It handed over to a newer generation and is draining: it exits on its own, and is
    /// stopped after the proxy's `drain_timeout`.
    pub draining: bool,
}

/// What a proxy's running instance uses now (with whatever it started), as a backend
/// measures it; [`Meter::usage`] reads it when a status is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResourceUsage {
    /// CPU time, user and system.
    pub cpu: Duration,
    /// Memory in use, where the backend measures it.
    pub memory_bytes: Option<u64>,
    /// Processes and threads, where the backend counts them.
    pub tasks: Option<u64>,
}

/// Durations as a histogram: counts per bucket of `bounds` (upper bounds in seconds, not
/// cumulative; one more count than bounds, for those over the last), and their sum.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Histogram {
    /// The buckets' upper bounds, in seconds, ascending.
    pub bounds: &'static [f64],
    /// Observations per bucket: `counts[i]` took at most `bounds[i]` and more than the
    /// bound before; the last one counts those over every bound.
    pub counts: Vec<u64>,
    /// The sum of every observation, in seconds.
    pub sum_seconds: f64,
}

impl Histogram {
    /// How many observations it holds.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
}

/// A backend's own counters, beside the per-proxy ones of [`BackendStatus`]; read at each
/// metrics scrape through [`ManagerHandle::backend_stats`](crate::ManagerHandle::backend_stats)
/// from the engine's [`Meter`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BackendStats {
    /// How long the health probes of every proxy took; `None` for a backend that runs none.
    pub probe_durations: Option<Histogram>,
    /// Notifications (sd_notify datagrams, say) that the backend ignored because their
    /// sender was no proxy's instance.
    pub foreign_notifications: u64,
}

/// A backend's own record of one proxy in the snapshot: JSON text that the engine stores
/// and hands back to [`ProxyBackend::restore`] byte for byte, and never reads.
///
/// The backend gives it a type of its own ([`BackendRecord::new`], [`BackendRecord::parse`]);
/// what it records is its business, as long as it holds no secret. [`BackendRecord::none`]
/// (`null`) records nothing.
///
/// ```
/// use tether_manager::BackendRecord;
///
/// #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
/// struct Mine { pid: u32 }
///
/// let record = BackendRecord::new(&Mine { pid: 42 }).unwrap();
/// assert_eq!(record.as_json(), r#"{"pid":42}"#);
/// assert_eq!(record.parse::<Mine>().unwrap(), Mine { pid: 42 });
/// assert!(BackendRecord::none().is_none());
/// ```
#[derive(Debug, Clone, Serialize)]
#[serde(transparent)]
pub struct BackendRecord(Box<serde_json::value::RawValue>);

impl<'de> Deserialize<'de> for BackendRecord {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let raw = Box::<serde_json::value::RawValue>::deserialize(deserializer)?;
        // Compact JSON holds no line break (strings escape theirs): this one was written
        // pretty (snapshot format 1). It is kept compact, as records are written now, so
        // that it reads back byte for byte after the next write.
        if raw.get().contains('\n') {
            let value: serde_json::Value = serde_json::from_str(raw.get()).map_err(D::Error::custom)?;
            return Self::new(&value).map_err(D::Error::custom);
        }
        Ok(Self(raw))
    }
}

impl BackendRecord {
    /// The record of `value`, encoded once.
    ///
    /// # Errors
    ///
    /// When `value` cannot be encoded as JSON (a map with non-string keys, for example).
    pub fn new<T: Serialize + ?Sized>(value: &T) -> Result<Self, serde_json::Error> {
        serde_json::value::to_raw_value(value).map(Self)
    }

    /// The record that records nothing: `null`.
    pub fn none() -> Self {
        Self::new(&()).unwrap_or_else(|_| unreachable!("null is JSON"))
    }

    /// Whether this is [`BackendRecord::none`].
    pub fn is_none(&self) -> bool {
        self.0.get() == "null"
    }

    /// Reads the record as the backend's own type.
    ///
    /// # Errors
    ///
    /// When the text is not a `T` (written by another backend, or another version of it).
    pub fn parse<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(self.0.get())
    }

    /// The JSON text, compact, as the snapshot holds it.
    pub fn as_json(&self) -> &str {
        self.0.get()
    }
}

impl Default for BackendRecord {
    fn default() -> Self {
        Self::none()
    }
}

impl PartialEq for BackendRecord {
    fn eq(&self, other: &Self) -> bool {
        self.as_json() == other.as_json()
    }
}

impl Eq for BackendRecord {}

/// What the process behind a handle that [`ProxyBackend::restore`] returned runs, as far as
/// the backend proved it: what the engine then keeps, or replaces.
///
/// After a crash the record a proxy is restored from may name another process than the one
/// that serves (an overlapping update was under way, or the snapshot could not be written),
/// and the backend keeps the process that serves; this says what that one runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Adopted {
    /// What it was restored as: the service and token of its snapshot record, or, for an
    /// adoption candidate, the `desired` proxy it was restored with (which the backend
    /// proved it runs).
    #[default]
    AsRecorded,
    /// The `desired` proxy it was restored with, whatever its record says: the backend kept
    /// another process than the record's, and proved that it runs `desired`.
    Desired,
    /// Neither is proven: the engine replaces it as it replaces a proxy whose spec changed
    /// (a restart, or an overlapping update, before which it keeps serving).
    Unknown,
}

/// An operation on a proxy that the backend could not carry out.
///
/// A proxy that exits non-zero is not an error: it shows up in [`BackendStatus`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The proxy could not be started.
    #[error("cannot start proxy {id}")]
    Start {
        /// The proxy.
        id: ProxyId,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// The proxy could not be stopped; it may still run.
    #[error("cannot stop proxy {id}")]
    Stop {
        /// The proxy.
        id: ProxyId,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// A change could not be applied to the running proxy.
    #[error("cannot apply a change to proxy {id} in place")]
    Update {
        /// The proxy.
        id: ProxyId,
        /// Why.
        #[source]
        source: BoxError,
    },
}

impl BackendError {
    /// The proxy the operation was for.
    pub fn id(&self) -> &ProxyId {
        match self {
            Self::Start { id, .. } | Self::Stop { id, .. } | Self::Update { id, .. } => id,
        }
    }
}

/// One proxy as the backend runs it. The engine never runs two operations on one handle at
/// once, and holds it as `Arc<dyn ProxyHandle>`.
///
/// # Contract
///
/// - A handle is started at most once, and only a handle fresh from
///   [`ProxyBackend::create`]: a failed start is retried with a new handle, and a restart
///   creates a new handle too. A handle from [`ProxyBackend::restore`] is never started; it
///   is updated, stopped or detached.
/// - Once [`ProxyHandle::start`] has returned `Ok`, the handle's [`BackendStatus`] is what the
///   engine shows of the proxy, and the backend keeps it current. Restarting the process after
///   an exit is the handle's job (`backoff`, then `starting` or `running`, with `restarts`
///   counted): the engine never starts it again on its own.
/// - Two handles of one proxy may exist at once, during a restart: see
///   [`ProxyBackend::create`].
/// - [`ProxyHandle::stop`] may be called again after it failed. [`ProxyHandle::detach`] is
///   the last call a handle gets.
/// - Dropping a handle must leave its process running, like [`ProxyHandle::detach`]: the
///   engine drops handles when it is dropped without a shutdown, and a crash of the agent
///   must not become a restart of every proxy.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait ProxyHandle: Send + Sync {
    /// Starts the proxy. Returns once the process exists, not once it is ready; from then
    /// on the backend restarts it when it exits, with its backoff.
    ///
    /// The engine shows what [`ProxyHandle::status`] says: the backend itself sets the
    /// status to [`BackendState::Running`] (or `Starting`, until it counts the proxy as
    /// running) when this returns `Ok`. A backend that never does leaves the proxy listed
    /// as `pending`.
    ///
    /// # Errors
    ///
    /// [`BackendError::Start`] when nothing runs (bad command, unknown user, …).
    async fn start(&self) -> Result<(), BackendError>;

    /// Stops the proxy gracefully (its kill signal, then SIGKILL after its kill timeout) and
    /// returns once nothing of it runs.
    ///
    /// # Errors
    ///
    /// [`BackendError::Stop`] when the proxy may still run.
    async fn stop(&self) -> Result<(), BackendError>;

    /// Stops supervising the proxy and leaves its process running, for the next agent.
    async fn detach(&self);

    /// Applies a change that needs no restart (`config`, policies, service address, …).
    ///
    /// # Errors
    ///
    /// [`BackendError::Update`]; the proxy then runs as before.
    async fn update(&self, proxy: Arc<ManagedProxy>) -> Result<(), BackendError>;

    /// The proxy's status, which changes whenever the backend observes something.
    fn status(&self) -> watch::Receiver<BackendStatus>;

    /// The proxy's status now: what a receiver of [`ProxyHandle::status`] would read.
    ///
    /// The engine reads the status of a handle that tells it of each change
    /// ([`ProxyHandle::on_status_change`]) with this, and never asks such a handle for its
    /// channel: a backend may then hold the status without one (a `watch` channel costs
    /// about 480 bytes a proxy). The default reads the channel.
    fn status_now(&self) -> BackendStatus {
        self.status().borrow().clone()
    }

    /// Asks the backend to call `changed` after every change of [`ProxyHandle::status`]
    /// from now on, for as long as it holds the handle's status; returns whether it will.
    ///
    /// A backend that can tell spares the engine a task per proxy that waits on the status
    /// channel (about 400 bytes a proxy), and the channel itself: the engine then reads
    /// [`ProxyHandle::status_now`]. One that cannot returns `false`, the default, and the
    /// engine then waits on the channel. `changed` is called after the new status is
    /// readable, and must not be called from inside a borrow of the channel.
    fn on_status_change(&self, changed: StatusChanged) -> bool {
        let _ = changed;
        false
    }

    /// Lets the proxy's process drain and exit on its own: called instead of
    /// [`ProxyHandle::stop`] on the old handle of a hot restart by the proxy itself
    /// (`update = "epoch"`), once the new generation, which took its listeners, is ready.
    /// The process is not signalled; the backend awaits its exit up to the proxy's
    /// `drain_timeout`, then stops it as [`ProxyHandle::stop`] does, and no longer
    /// restarts it. Returns once the backend has taken it over for that: the engine then
    /// drops the handle, and the backend reports the draining generation in the status of
    /// the proxy's newer handles ([`BackendStatus::generations`]).
    ///
    /// # Errors
    ///
    /// [`BackendError::Stop`] when the backend cannot take the process over; the engine
    /// keeps the new generation either way.
    ///
    /// The default stops the proxy, for a backend whose proxies cannot hand over.
    async fn drain(&self) -> Result<(), BackendError> {
        self.stop().await
    }

    /// Reloads the proxy in place, as its `reload` table says, and returns the verdict; the
    /// status's figures ([`reloads`](ProcessFigures::reloads)) show it too. `None` when the
    /// proxy cannot be reloaded (it has no `reload` table).
    ///
    /// Unlike the other calls, a reload may run beside them: it never stops the process,
    /// and the backend runs the reloads of one proxy one after another.
    ///
    /// The default reloads nothing (`None`), for a backend whose proxies cannot reload.
    async fn reload(&self) -> Option<ReloadOutcome> {
        None
    }

    /// The backend's record of this proxy for the snapshot: whatever it needs to prove,
    /// after an agent restart, that a process is this one (pid, start time, boot id, …),
    /// in a type of its own. Never a secret.
    ///
    /// The default records nothing ([`BackendRecord::none`]), for a backend whose proxies
    /// do not outlive the agent.
    fn record(&self) -> BackendRecord {
        BackendRecord::none()
    }

    /// For a handle that [`ProxyBackend::restore`] returned: what its process runs. Asked
    /// once, right after the restore; the engine then keeps the process, or replaces it.
    ///
    /// The default, [`Adopted::AsRecorded`], is right for a backend that only ever takes
    /// over the process a record names.
    fn adopted(&self) -> Adopted {
        Adopted::AsRecorded
    }
}

/// What a backend calls after each change of a handle's status
/// ([`ProxyHandle::on_status_change`]).
pub type StatusChanged = Box<dyn Fn() + Send + Sync>;

/// Builds [`ProxyHandle`]s: the engine's only way to make something run.
///
/// The engine calls [`ProxyBackend::adoption_candidates`] once when its first
/// [`Manager::run`](crate::Manager::run) begins, then [`ProxyBackend::restore`] for each
/// snapshot record and candidate, then [`ProxyBackend::restored`] once; only then does it
/// [create](ProxyBackend::create) handles, one for every start. Of each handle it holds, it
/// reads [`ProxyHandle::status`] once, when it takes the handle in, and
/// [`ProxyHandle::record`] whenever the snapshot needs the proxy's record.
///
/// `tether-proxy-daemon` provides the production implementation. Tests use
/// `testing::RecordingBackend` (feature `testing`), or `MockProxyBackend` (feature `mock`),
/// which `testing::mock_backend` gives defaults for every method but `create` and `restore`.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait ProxyBackend: Send + Sync {
    /// A handle for `proxy`, not started yet.
    ///
    /// The engine calls it for every start: the first one of a proxy, each retry of a failed
    /// start, and each restart. A restart creates the new handle *before* it stops the old
    /// one, so that what the new handle takes when it is created (the proxy's listeners, for
    /// example) stays held in between; two handles of one proxy id then exist at once:
    ///
    /// - A restart (a change that needs one, as `ManagedProxy::change_to` classifies it;
    ///   [`ManagerHandle::restart`](crate::ManagerHandle::restart); an adopted proxy that
    ///   cannot be updated in place; a changed proxy whose failed update or stop left its
    ///   process running): `create` (new), `stop` (old), and `start` (new) once the old one
    ///   has stopped. When the stop fails, the new handle is dropped without being started
    ///   and the old one stays.
    /// - An overlapping update (`update = "overlap"`): `create` (new), `start` (new), and
    ///   `stop` (old) once the new one reports [`BackendState::Running`]: both run side by side
    ///   until then. When the new one fails to get ready in time, it is stopped instead and the
    ///   old one stays.
    /// - A hot restart by the proxy itself (`update = "epoch"`), when the old handle's status
    ///   lists generations ([`BackendStatus::generations`]): as an overlapping update, but
    ///   [`ProxyHandle::drain`] (old) instead of `stop`; before `create`, the engine waits while
    ///   the old handle's status lists `max_generations` live generations. An old handle that
    ///   lists none cannot hand over, and is restarted.
    ///
    /// Either way the old handle is dropped once the restart is over. So `create` must not
    /// disturb a live handle of the same id, and whatever a backend keeps per proxy id must
    /// allow for two handles.
    fn create(&self, proxy: Arc<ManagedProxy>) -> Box<dyn ProxyHandle>;

    /// Takes over the proxy described by `record` (what [`ProxyHandle::record`] returned
    /// before an agent restart, or an adoption candidate), leaving its process running.
    ///
    /// `desired` is the catalog's proxy of that id, if it still wants one: the spec a
    /// backend restarts the process from should it exit, and what proves an adoption
    /// candidate (its token). Whether the process must be restarted or stopped because it
    /// differs from `desired` is the engine's decision, taken after the restore.
    ///
    /// Returns `None` unless the backend can prove that a live process is that proxy's
    /// (a pid alone proves nothing); the engine then forgets the record. The process taken
    /// over need not be the one the record names, when that one is gone or no longer serves:
    /// [`ProxyHandle::adopted`] then says what it runs.
    ///
    /// # Cancel safety
    ///
    /// Must be cancel safe: a dropped call takes over nothing, and the engine asks again.
    ///
    /// The default adopts nothing: every proxy is started afresh after an agent restart.
    async fn restore(
        &self,
        id: ProxyId,
        record: BackendRecord,
        desired: Option<Arc<ManagedProxy>>,
    ) -> Option<Box<dyn ProxyHandle>> {
        let _unused = (id, record, desired);
        None
    }

    /// Proxies that may still run from an earlier agent, found without the snapshot (for
    /// example from pid files), as records for [`ProxyBackend::restore`]. Asked at every
    /// restore: they cover a proxy started after the last snapshot write, and one whose
    /// snapshot record cannot be proven; a candidate of an id already adopted through the
    /// snapshot is not restored.
    ///
    /// Restoring a candidate with a `desired` proxy must prove that the process runs that
    /// proxy (its token, command and environment), not merely that it is alive: the engine
    /// then keeps it as started from `desired`. A candidate restored without `desired` is
    /// stopped.
    ///
    /// The default finds none.
    async fn adoption_candidates(&self) -> Vec<(ProxyId, BackendRecord)> {
        Vec::new()
    }

    /// Called once per engine, when the restore has ended: every record and candidate has
    /// been handed to [`ProxyBackend::restore`], and no proxy has been started yet. A
    /// backend may now clean up what belongs to none of the proxies it took over (left by
    /// an agent that lost its state).
    ///
    /// The default does nothing.
    async fn restored(&self) {}
}

/// What measures proxies' usage and keeps a backend's own counters, for the status reads
/// and metrics of [`ManagerHandle`](crate::ManagerHandle): given to the engine with
/// [`Manager::with_meter`](crate::Manager::with_meter), usually by the backend itself.
///
/// It is a trait of its own, not part of [`ProxyBackend`], so that a backend that measures
/// nothing (and its mocks) need say nothing about it.
pub trait Meter: Send + Sync {
    /// What the running instance of proxy `id`, process `pid`, uses now. Asked whenever a
    /// status is read through [`ManagerHandle`](crate::ManagerHandle) (the API, the metrics),
    /// on the reader's thread and never by the engine: it must be quick.
    fn usage(&self, id: &ProxyId, pid: u32) -> Option<ResourceUsage>;

    /// The backend's own counters, for metrics. The default counts nothing.
    fn stats(&self) -> BackendStats {
        BackendStats::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_backend_state_is_shown_as_the_engine_state_of_its_name() {
        let all = [
            BackendState::Pending,
            BackendState::Starting,
            BackendState::Running,
            BackendState::Backoff,
            BackendState::Stopping,
            BackendState::Failed,
        ];
        for state in all {
            let shown = ProxyState::from(state);
            assert_eq!(shown.as_str(), state.to_string());
            // The engine's decisions are never a backend's to report.
            assert!(
                !matches!(shown, ProxyState::Blocked | ProxyState::Stopped | ProxyState::Waiting),
                "{state} is shown as {shown}"
            );
        }
    }
}
