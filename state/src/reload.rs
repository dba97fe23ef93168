//! Reloading a proxy in place: how ([`ReloadPolicy`], the `[service.proxy.reload]` table)
//! and how it went ([`ReloadResult`], [`ReloadOutcome`]), the one reload vocabulary of
//! every tether crate (the supervisor runs a reload, the engine publishes its outcome, the
//! API, the events and the metrics show it).

use std::fmt;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use crate::service::{CommandLine, KillSignal};

/// How a proxy takes new configuration files without a restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReloadPolicy {
    /// What asks the proxy to reload.
    pub action: ReloadAction,
    /// Run first, started like the proxy: a non-zero exit refuses the reload, and nothing is
    /// signalled.
    pub check: Option<CommandLine>,
    /// Absolute files or directories: a change to one (written in place, or renamed into
    /// place) reloads the proxy, once the changes have been quiet for [`WATCH_DEBOUNCE`].
    pub watch: Vec<PathBuf>,
    /// How long the verdict may take after the signal (default 10s).
    pub timeout: Duration,
}

impl ReloadPolicy {
    /// The default of `timeout`.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

    /// A policy that does `action`, with no check, no watched file and the default timeout.
    pub fn new(action: ReloadAction) -> Self {
        Self { action, check: None, watch: Vec::new(), timeout: Self::DEFAULT_TIMEOUT }
    }
}

/// How long the changes to watched files must be quiet before they reload the proxy: an
/// editor or a deployment that writes several files reloads it once.
pub const WATCH_DEBOUNCE: Duration = Duration::from_millis(200);

/// What asks a proxy to reload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadAction {
    /// This signal, sent to the proxy's main process.
    Signal(KillSignal),
    /// This program, started like the proxy (its user, working dir and environment); it
    /// must exit 0.
    Exec(CommandLine),
}

/// How a reload ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ReloadResult {
    /// The proxy said that it reloaded (sd_notify's `RELOADING=1` then `READY=1`), or its
    /// readiness probe passed again after the signal.
    Applied,
    /// The signal was sent (or the `exec` exited 0), and the proxy has no way to say more.
    Signalled,
    /// The check failed: nothing was signalled.
    Refused,
    /// The reload could not be asked (the signal or the `exec` failed), or the proxy exited
    /// during it (its restart rules apply).
    Failed,
    /// No verdict within the timeout: the proxy keeps running, and is not restarted.
    TimedOut,
}

impl ReloadResult {
    /// Every result, in the order of the metrics.
    pub const ALL: [ReloadResult; 5] = [Self::Applied, Self::Signalled, Self::Refused, Self::Failed, Self::TimedOut];

    /// How it is written: `applied`, `signalled`, `refused`, `failed`, `timed out`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Signalled => "signalled",
            Self::Refused => "refused",
            Self::Failed => "failed",
            Self::TimedOut => "timed out",
        }
    }

    /// Whether the reload did what was asked, as far as can be known: applied or signalled.
    pub fn succeeded(self) -> bool {
        matches!(self, Self::Applied | Self::Signalled)
    }
}

impl fmt::Display for ReloadResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One reload's end: when, how, and why when it did not succeed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReloadOutcome {
    /// When its verdict came.
    pub at: SystemTime,
    /// The verdict.
    pub result: ReloadResult,
    /// What went wrong (the check's output, the exit, the missing verdict), if anything did.
    pub error: Option<String>,
}

impl ReloadOutcome {
    /// An outcome of now.
    pub fn now(result: ReloadResult, error: Option<String>) -> Self {
        Self { at: SystemTime::now(), result, error }
    }
}

/// Reloads of one proxy so far, by result: how the metrics count them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReloadCounts([u64; ReloadResult::ALL.len()]);

impl ReloadCounts {
    /// Counts one reload that ended with `result`.
    pub fn count(&mut self, result: ReloadResult) {
        let slot = &mut self.0[result as usize];
        *slot = slot.saturating_add(1);
    }

    /// The reloads that ended with `result`.
    ///
    /// ```
    /// use tether_state::{ReloadCounts, ReloadResult};
    ///
    /// let mut counts = ReloadCounts::default();
    /// counts.count(ReloadResult::Refused);
    /// assert_eq!(counts.get(ReloadResult::Refused), 1);
    /// assert_eq!(counts.get(ReloadResult::Applied), 0);
    /// ```
    pub fn get(&self, result: ReloadResult) -> u64 {
        self.0[result as usize]
    }

    /// Whether no reload was counted.
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|&n| n == 0)
    }
}

/// What is known of a proxy's reloads: the last one, the count by result, and when the
/// last successful one ended. Kept by whoever runs them, shown in status and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reloads {
    /// The last reload's outcome.
    pub last: ReloadOutcome,
    /// Every reload so far, by result.
    pub counts: ReloadCounts,
    /// When the last reload that succeeded (applied or signalled) ended.
    pub last_success: Option<SystemTime>,
}

impl Reloads {
    /// The history of `earlier` (none yet when `None`) followed by `outcome`.
    ///
    /// ```
    /// use tether_state::{ReloadOutcome, ReloadResult, Reloads};
    ///
    /// let first = Reloads::after(None, ReloadOutcome::now(ReloadResult::Applied, None));
    /// let second = Reloads::after(Some(&first), ReloadOutcome::now(ReloadResult::Refused, Some("bad".into())));
    /// assert_eq!(second.last.result, ReloadResult::Refused);
    /// assert_eq!(second.last_success, Some(first.last.at));
    /// assert_eq!((second.counts.get(ReloadResult::Applied), second.counts.get(ReloadResult::Refused)), (1, 1));
    /// ```
    pub fn after(earlier: Option<&Reloads>, outcome: ReloadOutcome) -> Self {
        let mut counts = earlier.map(|e| e.counts).unwrap_or_default();
        counts.count(outcome.result);
        let last_success =
            if outcome.result.succeeded() { Some(outcome.at) } else { earlier.and_then(|e| e.last_success) };
        Self { last: outcome, counts, last_success }
    }
}
