//! When to probe an instance, and what the results mean: its readiness until the first
//! pass, then its liveness, with a failure count (the rules are in `docs/reference.md`,
//! "Health checks"). Polled probes
//! (`tcp`, `http`, `exec`) run on a timer; `notify` checks wait for the instance's own
//! notices (`READY=1`, and `WATCHDOG=1` at least once per interval).
//!
//! This module owns the schedule of one instance's checks and nothing else: the supervising
//! task turns a [`Checked`] into a status or a restart. An instance without checks costs
//! nothing: [`Checks::next`] then never wakes.

use std::sync::Arc;
use std::time::Duration;

use tether_state::{Liveness, Probe, Readiness};
use tokio::time::Instant;

use std::os::fd::OwnedFd;

use tokio::io::unix::AsyncFd;

use super::lines::LineWatch;
use super::{Instance, Shared};
use crate::notify::{Notice, Route};
use crate::probe;
use crate::probe::ProbeStats;
use crate::spec::ProcessSpec;

/// What a check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Checked {
    /// The readiness check passed: the instance is ready.
    Ready,
    /// A readiness probe failed; checking goes on.
    NotReady(String),
    /// A liveness check passed; `recovered` when failures preceded it.
    Alive { recovered: bool },
    /// A liveness check failed, `failures` in a row, fewer than the threshold.
    Unhealthy { failures: u32, message: String },
    /// Liveness failed `failures` times in a row: the instance must be restarted. The
    /// message says which check and what it saw.
    Dead(String),
    /// The instance says this of itself (`STATUS=`).
    StatusText(String),
    /// A notice that may end a reload: `RELOADING=1`, or a `READY=1` once it is ready.
    Reload(Notice),
}

/// The checks of one instance. An instance without any costs no allocation: the state
/// lives in its supervising task's future as long as the instance runs, and most have none.
pub(super) struct Checks {
    /// Spreads the probes of many instances over their interval (from its pid).
    seed: u64,
    active: Option<Box<Active>>,
}

impl Checks {
    /// The checks of a new instance of `spec` in the process group `pgid`: readiness first,
    /// unless `ready` (an adopted instance is not asked again), then liveness. Notices are
    /// routed from the supervisor's hub when a check listens to them.
    pub(super) fn new(spec: &ProcessSpec, ready: bool, instance: &mut Instance, shared: &Shared) -> Self {
        let active = Active::new(spec, ready, instance, shared);
        Self { seed: active.seed, active: (!active.inert()).then(|| Box::new(active)) }
    }

    /// Whether nothing can come of the checks until they change.
    pub(super) fn idle(&self) -> bool {
        self.active.as_ref().is_none_or(|active| active.idle())
    }

    /// Applies changed checks to the running instance: a readiness that already passed (or
    /// never was) is not asked again; liveness starts over.
    pub(super) fn update(&mut self, readiness: Option<Readiness>, liveness: Option<Liveness>, shared: &Shared) {
        let active = self.active.get_or_insert_with(|| Box::new(Active::empty(self.seed, shared)));
        active.update(readiness, liveness);
        if active.inert() {
            self.active = None;
        }
    }

    /// Waits for the next probe or notice, and says what it found. Never returns when
    /// nothing is checked. Cancel-safe, as [`Active::next`].
    pub(super) async fn next(&mut self, spec: &ProcessSpec) -> Checked {
        match self.active.as_mut() {
            Some(active) => active.next(spec).await,
            None => std::future::pending().await,
        }
    }
}

/// The state of an instance's checks, while it has any.
struct Active {
    /// Still to pass; `None` once ready (or when there is none).
    readiness: Option<Readiness>,
    liveness: Option<Liveness>,
    /// Failed liveness checks in a row.
    failures: u32,
    /// When the next probe runs, or the watchdog expires; `None` when nothing is timed.
    next: Option<Instant>,
    /// The instance's notices, when a check listens to them.
    notices: Option<Route>,
    /// What to report first: the notices cannot be received.
    broken: Option<String>,
    /// The read end of the notification pipe (readiness `fd`), until a newline or its end.
    pipe: Option<AsyncFd<OwnedFd>>,
    /// The instance's output, for readiness `log_line`.
    lines: Option<LineWatch>,
    /// Where probe durations are recorded.
    stats: Arc<ProbeStats>,
    /// Spreads the probes of many instances over their interval.
    seed: u64,
}

impl Active {
    /// Nothing checked yet: `seed` spreads its probes, `shared` records their durations.
    fn empty(seed: u64, shared: &Shared) -> Self {
        Self {
            readiness: None,
            liveness: None,
            failures: 0,
            next: None,
            notices: None,
            broken: None,
            pipe: None,
            lines: None,
            stats: Arc::clone(&shared.probes),
            seed,
        }
    }

    /// As [`Checks::new`]; its pid is the seed that places its probes in their interval.
    fn new(spec: &ProcessSpec, ready: bool, instance: &mut Instance, shared: &Shared) -> Self {
        let hub = &shared.notify;
        let (seed, pgid) = (instance.pid, instance.pgid);
        let readiness =
            if ready { None } else { spec.health.readiness.as_deref().cloned().filter(|r| is_checked(&r.probe)) };
        let pipe =
            instance.notification.take().filter(|_| matches!(&readiness, Some(r) if matches!(r.probe, Probe::Fd(_))));
        let mut checks = Self::empty(u64::from(seed).wrapping_mul(0x9E37_79B9), shared);
        checks.readiness = readiness;
        checks.set_liveness(spec.health.liveness.as_deref().cloned());
        if let (Some(Readiness { probe: Probe::LogLine(pattern), .. }), Some(offsets)) =
            (&checks.readiness, instance.log_offsets.take())
        {
            checks.lines = Some(LineWatch::new(spec, pattern.clone(), offsets));
        }
        if let Some(pipe) = pipe {
            #[allow(unsafe_code)]
            // SAFETY: the `AsyncFd` owns the `OwnedFd`, so the fd stays open and refers to the
            // same pipe until the `AsyncFd` is dropped, and `as_raw_fd` always returns it.
            match unsafe { AsyncFd::register_with_interest(pipe, tokio::io::Interest::READABLE) } {
                Ok(pipe) => checks.pipe = Some(pipe),
                Err(error) => checks.broken = Some(format!("cannot watch the notification descriptor: {error}")),
            }
        }
        if uses_notify(&spec.health) {
            match hub.register(pgid) {
                Ok(route) => checks.notices = Some(route),
                Err(error) => {
                    checks.broken = Some(format!("cannot receive notifications on {}: {error}", hub.address()))
                }
            }
        }
        checks.schedule_first();
        checks
    }

    /// Whether nothing is or can be checked, whatever the time: nothing to probe, listen to
    /// or report.
    fn inert(&self) -> bool {
        self.readiness.is_none()
            && self.liveness.is_none()
            && self.notices.is_none()
            && self.pipe.is_none()
            && self.lines.is_none()
            && self.broken.is_none()
    }

    /// Whether nothing can come of the checks until they change: no timer, nothing to listen
    /// to, nothing to report.
    fn idle(&self) -> bool {
        self.next.is_none() && self.notices.is_none() && self.pipe.is_none() && self.broken.is_none()
    }

    /// Applies changed checks to the running instance: a readiness that already passed is
    /// not asked again; liveness starts over. (Whether the instance's notices are received
    /// was settled when it started, with its environment.)
    fn update(&mut self, readiness: Option<Readiness>, liveness: Option<Liveness>) {
        if self.readiness.is_some() {
            self.readiness = readiness.filter(|r| is_checked(&r.probe));
        }
        self.set_liveness(liveness);
        self.failures = 0;
        self.schedule_first();
    }

    fn set_liveness(&mut self, liveness: Option<Liveness>) {
        self.liveness = liveness.filter(|l| l.probe.checks_liveness());
    }

    /// The check that runs now: readiness until it passed, then liveness.
    fn current(&self) -> Option<(&Probe, Duration, Duration)> {
        match (&self.readiness, &self.liveness) {
            (Some(r), _) => Some((&r.probe, r.interval, r.timeout)),
            (None, Some(l)) => Some((&l.probe, l.interval, l.timeout)),
            (None, None) => None,
        }
    }

    /// The first timer: a polled readiness probe at once plus a jitter of up to a tenth of
    /// its interval (a new instance is rarely ready at once, and its starter waits for it);
    /// liveness after a whole interval plus a jitter of up to a quarter (a watchdog, after
    /// exactly one interval). A `notify` readiness has no timer: the instance says when.
    fn schedule_first(&mut self) {
        self.next = match self.current() {
            None => None,
            Some((Probe::Notify | Probe::Fd(_), _, _)) if self.readiness.is_some() => None,
            Some((Probe::Notify, interval, _)) => Some(Instant::now() + interval),
            Some((_, interval, _)) if self.readiness.is_some() => Some(Instant::now() + self.jitter(interval / 10)),
            Some((_, interval, _)) => Some(slotted(Instant::now() + interval + self.jitter(interval / 4), interval)),
        };
    }

    fn jitter(&self, spread: Duration) -> Duration {
        let spread_ns = u64::try_from(spread.as_nanos()).unwrap_or(u64::MAX);
        if spread_ns == 0 { Duration::ZERO } else { Duration::from_nanos(self.seed % spread_ns) }
    }

    /// Waits for the next probe or notice, and says what it found. Never returns when
    /// nothing is checked.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a dropped call changes nothing (a probe process it started is killed,
    /// a notice stays queued), and the next call probes at once if the time has come.
    async fn next(&mut self, spec: &ProcessSpec) -> Checked {
        if let Some(broken) = self.broken.take() {
            return if self.readiness.is_some() {
                Checked::NotReady(broken)
            } else {
                Checked::Unhealthy { failures: 0, message: broken }
            };
        }
        loop {
            let timer = self.next;
            let notice = async {
                match self.notices.as_mut() {
                    Some(route) => route.notices.recv().await,
                    None => std::future::pending().await,
                }
            };
            let written = async {
                match self.pipe.as_ref() {
                    Some(pipe) => read_pipe(pipe).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                written = written => match written {
                    Ok(Some(true)) if self.readiness.is_some() => {
                        self.pipe = None;
                        self.readiness = None;
                        self.schedule_first();
                        return Checked::Ready;
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => {
                        self.pipe = None;
                        let fd = self.readiness.as_ref().map(|r| r.probe.to_string()).unwrap_or_default();
                        return Checked::NotReady(format!("readiness {fd}: closed without writing a newline"));
                    }
                    Err(error) => {
                        self.pipe = None;
                        return Checked::NotReady(format!("readiness: cannot read the notification descriptor: {error}"));
                    }
                },
                notice = notice => match notice {
                    Some(notice) => {
                        if let Some(checked) = self.noticed(notice) {
                            return checked;
                        }
                    }
                    None => self.notices = None,
                },
                // Boxed: a probe's future is large, and allocated only while one runs, so
                // that waiting checks keep the supervising task small.
                () = sleep_until(timer) => return Box::pin(self.timed(spec)).await,
            }
        }
    }

    /// What `notice` means for the checks, if anything.
    fn noticed(&mut self, notice: Notice) -> Option<Checked> {
        let readiness_notify = matches!(&self.readiness, Some(r) if r.probe == Probe::Notify);
        let liveness_notify = self.readiness.is_none() && matches!(&self.liveness, Some(l) if l.probe == Probe::Notify);
        match notice {
            Notice::Status(text) => Some(Checked::StatusText(text)),
            Notice::Ready if readiness_notify => {
                self.readiness = None;
                self.schedule_first();
                Some(Checked::Ready)
            }
            Notice::Watchdog if liveness_notify => {
                self.next = self.liveness.as_ref().map(|l| Instant::now() + l.interval);
                let recovered = std::mem::take(&mut self.failures) > 0;
                recovered.then_some(Checked::Alive { recovered })
            }
            Notice::WatchdogTrigger if liveness_notify => {
                self.failures = 0;
                Some(Checked::Dead("liveness: the process asked for a restart (WATCHDOG=trigger)".to_owned()))
            }
            Notice::Reloading(_) => Some(Checked::Reload(notice)),
            Notice::Ready if self.readiness.is_none() => Some(Checked::Reload(notice)),
            _ => None,
        }
    }

    /// The timer fired: a polled probe runs, or a watchdog expired.
    async fn timed(&mut self, spec: &ProcessSpec) -> Checked {
        let Some((probe, interval, timeout)) = self.current().map(|(p, i, t)| (p.clone(), i, t)) else {
            self.next = None;
            return std::future::pending().await;
        };
        let started = Instant::now();
        let outcome = match probe {
            Probe::Notify => Err(format!("no WATCHDOG=1 within {}", humantime::format_duration(interval))),
            Probe::LogLine(_) => match self.lines.as_mut().map(LineWatch::matched) {
                Some(Ok(true)) => Ok(()),
                Some(Ok(false)) => Err("no line of its output matches yet".to_owned()),
                Some(Err(error)) => Err(format!("cannot read its output: {error}")),
                None => Err("its output was not followed from its start".to_owned()),
            },
            _ => {
                let outcome = probe::run(&probe, timeout, spec).await;
                self.stats.record(started.elapsed());
                outcome
            }
        };
        // The next probe an interval after this one began: a slow probe does not shift the
        // schedule by its own duration.
        let readiness = self.readiness.is_some();
        self.next = Some(if readiness { started + interval } else { slotted(started + interval, interval) });
        match (readiness, outcome) {
            (true, Ok(())) => {
                self.readiness = None;
                self.schedule_first();
                Checked::Ready
            }
            (true, Err(message)) => Checked::NotReady(format!("readiness probe {probe}: {message}")),
            (false, Ok(())) => Checked::Alive { recovered: std::mem::take(&mut self.failures) > 0 },
            (false, Err(message)) => {
                self.failures += 1;
                let threshold = self.liveness.as_ref().map_or(1, |l| l.failures);
                if self.failures >= threshold {
                    Checked::Dead(format!(
                        "liveness probe {probe} failed {} times in a row: {message}",
                        std::mem::take(&mut self.failures)
                    ))
                } else {
                    Checked::Unhealthy {
                        failures: self.failures,
                        message: format!("liveness probe {probe}: {message}"),
                    }
                }
            }
        }
    }
}

/// Reads what the instance wrote to its notification pipe: `Some(true)` once a newline came,
/// `Some(false)` for other bytes, `None` at its end.
async fn read_pipe(pipe: &AsyncFd<OwnedFd>) -> std::io::Result<Option<bool>> {
    let mut buffer = [0_u8; 512];
    let read = pipe
        .async_io(tokio::io::Interest::READABLE, |fd| nix::unistd::read(fd, &mut buffer).map_err(std::io::Error::from))
        .await?;
    Ok((read > 0).then(|| buffer[..read].contains(&b'\n')))
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Whether a new instance of `spec` is ready once it runs: it has no readiness check that
/// the supervisor runs.
pub(super) fn starts_ready(spec: &ProcessSpec) -> bool {
    spec.health.readiness.as_ref().is_none_or(|readiness| !is_checked(&readiness.probe))
}

/// Whether the supervisor checks readiness through `probe`: every kind.
fn is_checked(probe: &Probe) -> bool {
    matches!(probe, Probe::Tcp(_) | Probe::Http(_) | Probe::Exec(_) | Probe::Notify | Probe::Fd(_) | Probe::LogLine(_))
}

/// Whether a new instance of `spec` has its output followed from its start (readiness
/// `log_line`).
pub(super) fn watches_lines(spec: &ProcessSpec) -> bool {
    spec.health.readiness.as_ref().is_some_and(|r| matches!(r.probe, Probe::LogLine(_)))
}

/// Whether an instance with `health` is told `NOTIFY_SOCKET`.
pub(crate) fn uses_notify(health: &crate::spec::HealthChecks) -> bool {
    health.readiness.as_ref().is_some_and(|r| r.probe == Probe::Notify)
        || health.liveness.as_ref().is_some_and(|l| l.probe == Probe::Notify)
}

/// Sets `NOTIFY_SOCKET` (and, for a watchdog, `WATCHDOG_USEC`) in `spec`'s environment when
/// its checks use notices, and removes them when they do not.
pub(crate) fn set_notify_env(spec: &mut ProcessSpec, address: &str) {
    spec.env.retain(|(key, _)| key != "NOTIFY_SOCKET" && key != "WATCHDOG_USEC");
    if !uses_notify(&spec.health) {
        return;
    }
    spec.env.push(("NOTIFY_SOCKET".into(), address.into()));
    if let Some(liveness) = spec.health.liveness.as_ref().filter(|l| l.probe == Probe::Notify) {
        spec.env.push(("WATCHDOG_USEC".into(), liveness.interval.as_micros().to_string().into()));
    }
}

/// The longest a liveness probe is held back to share its slot with others.
const MAX_SLOT: Duration = Duration::from_millis(20);

/// `at`, moved up to the next slot boundary: liveness probes of many proxies then come due
/// in groups, each group taken by one wake-up of the runtime, rather than one wake-up per
/// probe. A slot is a fiftieth of `interval`, at most [`MAX_SLOT`]: a probe every second
/// runs up to 20 ms late, and keeps its place in its interval. Readiness probes are not
/// slotted: a start waits for them.
fn slotted(at: Instant, interval: Duration) -> Instant {
    static ORIGIN: std::sync::Mutex<Option<Instant>> = std::sync::Mutex::new(None);
    let slot = (interval / 50).min(MAX_SLOT);
    if slot < Duration::from_millis(1) {
        return at;
    }
    // Slots count from the earliest instant seen, so that every proxy shares them; an
    // earlier one (another runtime's clock, in tests) becomes the origin.
    let origin = {
        let mut origin = tether_state::lock(&ORIGIN);
        let value = match *origin {
            Some(earlier) if earlier <= at => earlier,
            _ => at,
        };
        *origin = Some(value);
        value
    };
    let since = at.duration_since(origin).as_nanos();
    let slot_ns = slot.as_nanos();
    let late = (slot_ns - since % slot_ns) % slot_ns;
    at + Duration::from_nanos(u64::try_from(late).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{MAX_SLOT, slotted};

    #[test]
    fn liveness_probes_due_within_one_slot_share_it_and_are_late_by_less_than_a_slot() {
        let second = Duration::from_secs(1);
        let base = Instant::now();
        let due: Vec<Instant> = (0..200u64).map(|i| base + Duration::from_micros(i * 997)).collect();
        let slots: Vec<Instant> = due.iter().map(|at| slotted(*at, second)).collect();
        for (at, slot) in due.iter().zip(&slots) {
            assert!(*slot >= *at && *slot - *at < MAX_SLOT, "{at:?} went to {slot:?}");
        }
        let mut distinct = slots.clone();
        distinct.dedup();
        // 200 probes over about 200 ms fall into about ten 20 ms slots.
        assert!((10..=12).contains(&distinct.len()), "{} slots", distinct.len());
        // Short intervals get short slots; very short ones none.
        let tenth = Duration::from_millis(100);
        assert!(slotted(base + Duration::from_micros(1), tenth) - base <= Duration::from_millis(2));
        assert_eq!(
            slotted(base + Duration::from_micros(1), Duration::from_millis(10)),
            base + Duration::from_micros(1)
        );
    }
}
