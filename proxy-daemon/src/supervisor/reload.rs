//! One process's reloads in place (the rules are in `docs/reference.md`, "Reload"): the
//! check, the signal or program that asks for the reload, and the verdict — sd_notify's
//! `RELOADING=1` then `READY=1`, else the readiness probe passing again, else `signalled` —
//! within the reload's timeout.
//!
//! This module owns the steps of one reload and the pure rules of its verdict; the
//! supervising task runs one reload at a time, signals its instance when told to
//! ([`Step::Ask`]), hands it the instance's notices, and ends it on an exit or a stop.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tether_state::persist::Durability;
use tether_state::{CommandLine, Probe, ReloadAction, ReloadOutcome, ReloadPolicy, ReloadResult};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::notify::Notice;
use crate::probe;
use crate::spec::{LogFile, ProcessSpec};

/// Where a reload's verdict is answered: `None` when the process has no `reload` table.
pub(crate) type ReloadReply = oneshot::Sender<Option<ReloadOutcome>>;

/// The most of a check's (or a reload program's) output kept as the reload's error.
pub(crate) const MAX_OUTPUT: usize = 4096;

/// The verdict of a proxy that speaks systemd's notify-reload protocol: `RELOADING=1`, then
/// `READY=1`. A `RELOADING=1` stamped (`MONOTONIC_USEC`) before the reload was asked is an
/// earlier reload's, and a `READY=1` before this reload's `RELOADING=1` says nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NotifyVerdict {
    /// `CLOCK_MONOTONIC`, in microseconds, when the reload was asked.
    asked_usec: u64,
    reloading: bool,
}

impl NotifyVerdict {
    pub(crate) fn new(asked_usec: u64) -> Self {
        Self { asked_usec, reloading: false }
    }

    /// Takes `notice` in; `true` once the reload is applied.
    pub(crate) fn noticed(&mut self, notice: &Notice) -> bool {
        match notice {
            Notice::Reloading(Some(at)) if *at < self.asked_usec => false,
            Notice::Reloading(_) => {
                self.reloading = true;
                false
            }
            Notice::Ready => self.reloading,
            _ => false,
        }
    }
}

/// A boxed step that runs a program or probes: allocated only while a reload runs.
type Running = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// Where one reload is.
enum Stage {
    /// The check runs; then the reload is asked.
    Check(Running),
    /// The check passed (or there is none): the task asks the reload now.
    Ask,
    /// The `exec` that asks the reload runs; then the verdict is awaited.
    Exec(Running),
    /// The verdict is awaited until `deadline`.
    Verdict { how: Verdict, deadline: Instant },
}

enum Verdict {
    /// The proxy's notices say.
    Notify(NotifyVerdict),
    /// The readiness probe, run until it passes.
    Probe(Running),
}

/// What the task does next for a reload.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Signal the instance with the reload's signal, then call [`Reload::asked`].
    Ask,
    /// The reload is over.
    Done(ReloadResult, Option<String>),
}

/// One reload in flight, and the callers that wait for its verdict.
pub(crate) struct Reload {
    pub(crate) replies: Vec<ReloadReply>,
    policy: ReloadPolicy,
    stage: Stage,
    /// `CLOCK_MONOTONIC`, in microseconds, when it was asked.
    asked_usec: u64,
}

impl Reload {
    /// Begins a reload of `spec`'s process as `policy` says, for `replies`: its check first.
    pub(crate) fn new(policy: ReloadPolicy, spec: &ProcessSpec, replies: Vec<ReloadReply>) -> Self {
        let asked_usec = crate::proc::monotonic_usec();
        let stage = match &policy.check {
            Some(check) => Stage::Check(Box::pin(run_program(check.clone(), spec.clone(), policy.timeout, "check"))),
            None => after_check(&policy, spec),
        };
        Self { replies, policy, stage, asked_usec }
    }

    /// What the reload's `signal` is, if it asks by signal.
    pub(crate) fn signal(&self) -> Option<tether_state::KillSignal> {
        match self.policy.action {
            ReloadAction::Signal(signal) => Some(signal),
            ReloadAction::Exec(_) => None,
        }
    }

    /// Waits for the reload's next step.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a running program or probe is kept in the reload, and the deadline is
    /// absolute.
    pub(crate) async fn next(&mut self, spec: &ProcessSpec) -> Step {
        loop {
            match &mut self.stage {
                Stage::Ask => return Step::Ask,
                Stage::Check(running) => match running.await {
                    Ok(()) => self.stage = after_check(&self.policy, spec),
                    Err(output) => {
                        self.stage = Stage::Ask;
                        return Step::Done(ReloadResult::Refused, Some(output));
                    }
                },
                Stage::Exec(running) => match running.await {
                    Ok(()) => match self.verdict(spec) {
                        Some(stage) => self.stage = stage,
                        None => return Step::Done(ReloadResult::Signalled, None),
                    },
                    Err(output) => return Step::Done(ReloadResult::Failed, Some(output)),
                },
                Stage::Verdict { how, deadline } => {
                    let deadline = *deadline;
                    let waited = async {
                        match how {
                            Verdict::Notify(_) => std::future::pending().await,
                            Verdict::Probe(probing) => probing.await,
                        }
                    };
                    return match tokio::time::timeout_at(deadline, waited).await {
                        Ok(_passed) => Step::Done(ReloadResult::Applied, None),
                        Err(_elapsed) => Step::Done(ReloadResult::TimedOut, Some(self.no_verdict())),
                    };
                }
            }
        }
    }

    /// The task sent the reload's signal: the verdict is awaited from now. `Some` when the
    /// reload is over already (nothing tells more than that the signal was sent).
    pub(crate) fn asked(&mut self, spec: &ProcessSpec) -> Option<Step> {
        match self.verdict(spec) {
            Some(stage) => {
                self.stage = stage;
                None
            }
            None => Some(Step::Done(ReloadResult::Signalled, None)),
        }
    }

    /// How the verdict comes; `None` when nothing can tell (no readiness check, or one that
    /// passes only once per instance).
    fn verdict(&self, spec: &ProcessSpec) -> Option<Stage> {
        let deadline = Instant::now() + self.policy.timeout;
        let readiness = spec.health.readiness.as_ref()?;
        let how = match &readiness.probe {
            Probe::Notify => Verdict::Notify(NotifyVerdict::new(self.asked_usec)),
            Probe::Tcp(_) | Probe::Http(_) | Probe::Exec(_) => Verdict::Probe(Box::pin(probe_until_passed(
                readiness.probe.clone(),
                readiness.interval,
                readiness.timeout,
                spec.clone(),
            ))),
            _ => return None,
        };
        Some(Stage::Verdict { how, deadline })
    }

    /// Takes one of the instance's notices in; `Some` when it ends the reload.
    pub(crate) fn noticed(&mut self, notice: &Notice) -> Option<Step> {
        let Stage::Verdict { how: Verdict::Notify(verdict), .. } = &mut self.stage else { return None };
        verdict.noticed(notice).then_some(Step::Done(ReloadResult::Applied, None))
    }

    /// Why a reload timed out.
    fn no_verdict(&self) -> String {
        let timeout = humantime::format_duration(self.policy.timeout);
        match &self.stage {
            Stage::Verdict { how: Verdict::Notify(verdict), .. } if verdict.reloading => {
                format!("the proxy sent RELOADING=1 but no READY=1 within {timeout}")
            }
            Stage::Verdict { how: Verdict::Notify(_), .. } => {
                format!("the proxy sent no RELOADING=1 then READY=1 within {timeout}")
            }
            _ => format!("the readiness probe did not pass again within {timeout}"),
        }
    }

    /// Answers every caller with `outcome`.
    pub(crate) fn answer(self, outcome: &ReloadOutcome) {
        for reply in self.replies {
            let _caller_gone = reply.send(Some(outcome.clone()));
        }
    }
}

/// The stage after a passed check (or none): a signal is the task's to send; an `exec`
/// starts here.
fn after_check(policy: &ReloadPolicy, spec: &ProcessSpec) -> Stage {
    match &policy.action {
        ReloadAction::Signal(_) => Stage::Ask,
        ReloadAction::Exec(command) => {
            Stage::Exec(Box::pin(run_program(command.clone(), spec.clone(), policy.timeout, "reload")))
        }
    }
}

/// Runs the readiness `probe` every `interval`, the first one an interval after the reload
/// was asked (a proxy that reloads keeps serving the old configuration meanwhile, so a probe
/// at once would pass before the reload), until one passes.
async fn probe_until_passed(
    probe: Probe,
    interval: Duration,
    timeout: Duration,
    spec: ProcessSpec,
) -> Result<(), String> {
    let mut next = Instant::now() + interval;
    loop {
        tokio::time::sleep_until(next).await;
        next += interval;
        if probe::run(&probe, timeout, &spec).await.is_ok() {
            return Ok(());
        }
    }
}

/// Runs `words` (a check, or the `exec` that asks a reload) started like the process, with
/// its output in the process's reload log (`<name>-reload.log` beside its logs, written anew
/// by each program); `Err` with the last [`MAX_OUTPUT`] bytes of that output, and how it
/// ended, when it does not exit 0 within `timeout`.
async fn run_program(
    command: CommandLine,
    mut spec: ProcessSpec,
    timeout: Duration,
    what: &'static str,
) -> Result<(), String> {
    let log = reload_log(&spec);
    // Only this program's output is read back as the error.
    let _absent = log.dir().remove(log.name(), Durability::Crash);
    spec.logs.stdout = log.clone();
    spec.logs.stderr = log.clone();
    probe::run(&Probe::Exec(command), timeout, &spec).await.map_err(|how| {
        let output = read_tail(&log);
        let output = output.trim_end();
        if output.is_empty() { format!("{what} failed: {how}") } else { format!("{what} failed ({how}): {output}") }
    })
}

/// The file a process's reload programs write to.
pub(crate) fn reload_log(spec: &ProcessSpec) -> LogFile {
    LogFile::new(spec.logs.stdout.dir().clone(), format!("{}-reload.log", spec.name))
}

/// The last [`MAX_OUTPUT`] bytes of `log`, as text.
fn read_tail(log: &LogFile) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(Some(mut file)) = log.dir().open_read(log.name()) else { return String::new() };
    let length = file.metadata().map_or(0, |m| m.len());
    let _at = file.seek(SeekFrom::Start(length.saturating_sub(MAX_OUTPUT as u64)));
    let mut tail = Vec::with_capacity(MAX_OUTPUT);
    let _read = file.take(MAX_OUTPUT as u64).read_to_end(&mut tail);
    String::from_utf8_lossy(&tail).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notify_reload_is_applied_by_its_own_reloading_then_ready() {
        let mut verdict = NotifyVerdict::new(1_000);
        assert!(!verdict.noticed(&Notice::Ready), "a READY=1 before RELOADING=1 is the old state's");
        assert!(!verdict.noticed(&Notice::Reloading(Some(999))), "stamped before the request: an earlier reload's");
        assert!(!verdict.noticed(&Notice::Ready), "still no RELOADING=1 of this reload");
        assert!(!verdict.noticed(&Notice::Status("loading".into())));
        assert!(!verdict.noticed(&Notice::Reloading(Some(1_000))));
        assert!(verdict.noticed(&Notice::Ready));
        let mut unstamped = NotifyVerdict::new(5_000);
        assert!(!unstamped.noticed(&Notice::Reloading(None)));
        assert!(unstamped.noticed(&Notice::Ready), "a RELOADING=1 without MONOTONIC_USEC counts");
    }
}
