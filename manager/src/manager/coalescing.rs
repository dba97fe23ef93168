//! Coalescing, proxy by proxy: which catalog changes the engine applies at once and which it
//! holds while their proxy keeps changing.
//!
//! A change to a proxy that has not changed for the quiescent window applies at once; a
//! change that follows another of the same proxy within it is held until the proxy has been
//! quiet for the window, and at most the maximum delay after the first held one. A proxy
//! that keeps changing never delays another. This module only keeps the times and the held
//! changes; the engine applies what it releases.

use std::collections::HashMap;
use std::time::Duration;

use tether_state::{DesiredProxy, ProxyId, Revision};
use tokio::time::Instant;

/// The engine's windows: `sync_quiescent` and `sync_max_delay`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Window {
    pub(super) quiescent: Duration,
    pub(super) max_delay: Duration,
}

/// What became of an offered change.
pub(super) enum Offered {
    /// Apply it now (`None`: the proxy is no longer wanted).
    Now(Option<DesiredProxy>),
    /// Held: it is released by [`Coalescing::take_due`].
    Held,
}

/// A proxy's change held back because the proxy keeps changing: its latest definition
/// (`None`: no longer wanted), and when the run of changes began and last moved.
struct Deferred {
    change: Option<DesiredProxy>,
    first: Instant,
    last: Instant,
}

impl Deferred {
    fn due_at(&self, window: Window) -> Instant {
        (self.last + window.quiescent).min(self.first + window.max_delay)
    }
}

/// The coalescing state of the engine.
#[derive(Default)]
pub(super) struct Coalescing {
    /// When each recently changed proxy last changed; forgotten once all are older than the
    /// window.
    changed: HashMap<ProxyId, Instant>,
    /// When every entry of `changed` is older than the window.
    stale_at: Option<Instant>,
    deferred: HashMap<ProxyId, Deferred>,
    /// No deferred change is due before this (it may be early, never late).
    next_release: Option<Instant>,
}

impl Coalescing {
    /// When the engine must next look at the coalescing state.
    pub(super) fn deadline(&self) -> Option<Instant> {
        match (self.next_release, self.stale_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// A change of `id` at `now`: to apply now, or held while `id` keeps changing.
    pub(super) fn offer(&mut self, id: ProxyId, change: Option<DesiredProxy>, now: Instant, window: Window) -> Offered {
        let previous = self.changed.insert(id.clone(), now);
        self.stale_at = Some(now + window.quiescent);
        if let Some(deferred) = self.deferred.get_mut(&id) {
            deferred.change = change;
            deferred.last = now;
            return Offered::Held;
        }
        if previous.is_some_and(|at| now.duration_since(at) < window.quiescent) {
            let due = now + window.quiescent.min(window.max_delay);
            self.next_release = Some(self.next_release.map_or(due, |next| next.min(due)));
            self.deferred.insert(id, Deferred { change, first: now, last: now });
            return Offered::Held;
        }
        Offered::Now(change)
    }

    /// Takes the held changes that are due at `now`.
    pub(super) fn take_due(&mut self, now: Instant, window: Window) -> Vec<(ProxyId, Option<DesiredProxy>)> {
        let due: Vec<ProxyId> =
            self.deferred.iter().filter(|(_, d)| d.due_at(window) <= now).map(|(id, _)| id.clone()).collect();
        let released =
            due.into_iter().filter_map(|id| self.deferred.remove(&id).map(|deferred| (id, deferred.change))).collect();
        self.next_release = self.deferred.values().map(|d| d.due_at(window)).min();
        if self.deferred.is_empty() {
            self.deferred.shrink_to_fit();
        }
        released
    }

    /// Forgets when proxies changed once every such change is older than the window.
    pub(super) fn forget_stale(&mut self, now: Instant) {
        if self.stale_at.is_some_and(|at| at <= now) {
            self.changed = HashMap::new();
            self.stale_at = None;
        }
    }

    /// The proxies whose held change still wants them.
    pub(super) fn held_wanted(&self) -> impl Iterator<Item = &ProxyId> {
        self.deferred.iter().filter(|(_, d)| d.change.is_some()).map(|(id, _)| id)
    }

    /// The revision that `id`'s held change wants (`Some(None)`: held, no longer wanted);
    /// `None` when nothing of `id` is held.
    pub(super) fn held_revision(&self, id: &ProxyId) -> Option<Option<Revision>> {
        self.deferred.get(id).map(|deferred| deferred.change.as_ref().map(|d| d.revision))
    }

    /// How many changes are held.
    pub(super) fn held(&self) -> usize {
        self.deferred.len()
    }
}
