//! When to probe an instance, and what the results mean: its readiness until the first
//! pass, then its liveness, with a failure count (SPEC.md's "Health").
//!
//! This module owns the schedule of one instance's checks and nothing else: the supervising
//! task turns a [`Checked`] into a status or a restart. An instance without checks costs
//! nothing: [`Checks::next`] then never wakes.

use std::time::Duration;

use tether_state::{Liveness, Probe, Readiness};
use tokio::time::Instant;

use crate::probe;
use crate::spec::ProcessSpec;

/// What a check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Checked {
    /// The readiness probe passed: the instance is ready.
    Ready,
    /// A readiness probe failed; probing goes on.
    NotReady(String),
    /// A liveness probe passed; `recovered` when failures preceded it.
    Alive { recovered: bool },
    /// A liveness probe failed, `failures` in a row, fewer than the threshold.
    Unhealthy { failures: u32, message: String },
    /// Liveness failed `failures` times in a row: the instance must be restarted. The
    /// message says which probe and what it saw.
    Dead(String),
}

/// The checks of one instance.
pub(super) struct Checks {
    /// Still to pass; `None` once ready (or when there is none).
    readiness: Option<Readiness>,
    liveness: Option<Liveness>,
    /// Failed liveness probes in a row.
    failures: u32,
    /// When the next probe runs; `None` when nothing is probed.
    next: Option<Instant>,
    /// Spreads the probes of many instances over their interval.
    seed: u64,
}

impl Checks {
    /// The checks of a new instance of `spec`: readiness first, unless `ready` (an adopted
    /// instance is not asked again), then liveness. `seed` (its pid) places its probes in
    /// their interval.
    pub(super) fn new(spec: &ProcessSpec, ready: bool, seed: u32) -> Self {
        let readiness = if ready { None } else { spec.health.readiness.clone().filter(|r| is_polled(&r.probe)) };
        let mut checks = Self {
            readiness,
            liveness: None,
            failures: 0,
            next: None,
            seed: u64::from(seed).wrapping_mul(0x9E37_79B9),
        };
        checks.set_liveness(spec.health.liveness.clone());
        checks.schedule_first();
        checks
    }

    /// Applies changed checks to the running instance: a readiness that already passed is
    /// not asked again; liveness starts over.
    pub(super) fn update(&mut self, readiness: Option<Readiness>, liveness: Option<Liveness>) {
        if self.readiness.is_some() {
            self.readiness = readiness.filter(|r| is_polled(&r.probe));
        }
        self.set_liveness(liveness);
        self.failures = 0;
        self.schedule_first();
    }

    fn set_liveness(&mut self, liveness: Option<Liveness>) {
        self.liveness = liveness.filter(|l| is_polled(&l.probe));
    }

    /// The interval and timeout of the probe that runs next.
    fn current(&self) -> Option<(&Probe, Duration, Duration)> {
        match (&self.readiness, &self.liveness) {
            (Some(r), _) => Some((&r.probe, r.interval, r.timeout)),
            (None, Some(l)) => Some((&l.probe, l.interval, l.timeout)),
            (None, None) => None,
        }
    }

    /// The first probe: readiness at once plus a jitter of up to a tenth of its interval (a
    /// new instance is rarely ready at once, and its starter waits for it); liveness after
    /// a whole interval plus a jitter of up to a quarter.
    fn schedule_first(&mut self) {
        self.next = self.current().map(|(_, interval, _)| {
            let (base, spread) =
                if self.readiness.is_some() { (Duration::ZERO, interval / 10) } else { (interval, interval / 4) };
            Instant::now() + base + self.jitter(spread)
        });
    }

    fn jitter(&self, spread: Duration) -> Duration {
        let spread_ns = u64::try_from(spread.as_nanos()).unwrap_or(u64::MAX);
        if spread_ns == 0 { Duration::ZERO } else { Duration::from_nanos(self.seed % spread_ns) }
    }

    /// Waits for the next probe, runs it against the instance of `spec`, and says what it
    /// found. Never returns when nothing is probed.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a dropped call changes nothing (a probe process it started is killed),
    /// and the next call probes at once if the time has come.
    pub(super) async fn next(&mut self, spec: &ProcessSpec) -> Checked {
        let Some(at) = self.next else { return std::future::pending().await };
        tokio::time::sleep_until(at).await;
        let Some((probe, interval, timeout)) = self.current().map(|(p, i, t)| (p.clone(), i, t)) else {
            return std::future::pending().await;
        };
        let started = Instant::now();
        let outcome = probe::run(&probe, timeout, spec).await;
        // The next probe an interval after this one began: a slow probe does not shift the
        // schedule by its own duration.
        self.next = Some(started + interval);
        let readiness = self.readiness.is_some();
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

/// Whether a new instance of `spec` is ready once it runs: it has no readiness check that
/// the supervisor runs.
pub(super) fn starts_ready(spec: &ProcessSpec) -> bool {
    spec.health.readiness.as_ref().is_none_or(|readiness| !is_polled(&readiness.probe))
}

/// Whether the agent polls `probe` (`tcp`, `http`, `exec`); the other kinds are told by the
/// instance itself.
fn is_polled(probe: &Probe) -> bool {
    matches!(probe, Probe::Tcp(_) | Probe::Http(_) | Probe::Exec(_))
}
