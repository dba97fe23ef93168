//! Ordering between proxies (`depends_on`): which proxy waits before it starts, which one
//! must stop before what it depends on stops, and in which order a kill stops everything.
//!
//! This module only answers questions about the engine's state and queues proxies to be
//! planned again; it launches nothing itself, so that every action still goes through
//! `Manager::consider`, one per proxy. A proxy without `depends_on`, and one that nothing
//! depends on, costs a lookup in an empty map.

use std::collections::{HashMap, HashSet};

use tether_state::{Condition, DependsOn, ProxyId};

use super::Manager;
use crate::backend::{BackendState, ProxyState};
use crate::plan::{Action, Observed};

impl Manager {
    /// Notes that `id`, wanted as `depends_on` says, may depend on the proxies its names
    /// stand for, so that a change of those wakes it. Entries of an older `depends_on` are
    /// left in place: every lookup checks the current one.
    pub(super) fn index_dependencies(&mut self, id: &ProxyId, depends_on: &DependsOn) {
        for candidate in depends_on.keys().flat_map(|dependency| dependency.candidates()).flatten() {
            let dependents = self.dependents.entry(candidate).or_default();
            if !dependents.contains(id) {
                dependents.push(id.clone());
            }
        }
    }

    /// Drops `id` from the index of dependents, once the engine has forgotten it.
    pub(super) fn unindex_dependencies(&mut self, id: &ProxyId) {
        if self.dependents.is_empty() {
            return;
        }
        self.dependents.retain(|_, dependents| {
            dependents.retain(|dependent| dependent != id);
            !dependents.is_empty()
        });
    }

    /// The `depends_on` that applies to `id` now: the wanted proxy's, else that of the proxy
    /// that runs (a proxy no longer wanted stops in the order it ran in).
    fn depends_on(&self, id: &ProxyId) -> Option<&DependsOn> {
        if let Some(desired) = self.desired.get(id) {
            return Some(&desired.proxy.spec().depends_on);
        }
        let slot = self.slots.get(id)?;
        match &slot.observed {
            Observed::Running { applied } => Some(&applied.spec().depends_on),
            _ => slot.launched_for.as_ref().map(|proxy| &proxy.spec().depends_on),
        }
    }

    /// The proxies that `id` depends on now, among those the engine knows.
    pub(super) fn dependencies_of(&self, id: &ProxyId) -> Vec<ProxyId> {
        let Some(depends_on) = self.depends_on(id) else { return Vec::new() };
        depends_on.keys().filter_map(|dependency| dependency.resolve(|p| self.known(p))).collect()
    }

    /// The proxies that depend on `id` now, among those the engine knows.
    pub(super) fn dependents_of(&self, id: &ProxyId) -> Vec<ProxyId> {
        let Some(candidates) = self.dependents.get(id) else { return Vec::new() };
        candidates
            .iter()
            .filter(|dependent| {
                self.depends_on(dependent).is_some_and(|depends_on| {
                    depends_on.keys().any(|dependency| dependency.resolve(|p| self.known(p)).as_ref() == Some(id))
                })
            })
            .cloned()
            .collect()
    }

    fn known(&self, id: &ProxyId) -> bool {
        self.desired.contains_key(id) || self.slots.contains_key(id)
    }

    /// What `id` still waits for before it may start, as its error says it; `None` once
    /// every dependency has reached its condition.
    pub(super) fn unmet_dependencies(&self, id: &ProxyId) -> Option<String> {
        let depends_on = &self.desired.get(id)?.proxy.spec().depends_on;
        if depends_on.is_empty() {
            return None;
        }
        let mut waits = Vec::new();
        for (dependency, condition) in depends_on {
            let Some(target) = dependency.resolve(|p| self.desired.contains_key(p)) else {
                waits.push(format!("{dependency} (not in the catalog)"));
                continue;
            };
            if self.held.contains(&target) {
                waits.push(format!("{target} to be {condition} (it is stopped by the operator)"));
            } else if self.slots.get(&target).is_some_and(|slot| slot.draining) {
                waits.push(format!("{target} to be {condition} (it is stopping for its own dependencies)"));
            } else if !self.reached(&target, *condition) {
                let state = self.published.lock().proxies.get(&target).map_or(ProxyState::Pending, |s| s.state);
                waits.push(format!("{target} to be {condition} (it is {state})"));
            }
        }
        if waits.is_empty() { None } else { Some(format!("waiting for {}", waits.join(", "))) }
    }

    /// Whether `id` has reached `condition`: its process runs (`started`), or it is running
    /// and ready (`ready`), with no start, stop or restart of it in flight.
    fn reached(&self, id: &ProxyId, condition: Condition) -> bool {
        let Some(slot) = self.slots.get(id) else { return false };
        if matches!(slot.busy, Some(Action::Start | Action::Stop | Action::Restart)) {
            return false;
        }
        let Some(installed) = &slot.installed else { return false };
        let status = installed.status();
        match condition {
            Condition::Ready => status.state == BackendState::Running,
            Condition::Started => {
                matches!(status.state, BackendState::Starting | BackendState::Running) && status.figures.pid.is_some()
            }
        }
    }

    /// The dependency of `id` that is going away — no longer wanted, held down by the
    /// operator, or itself stopping for a dependency of its own — while it is still known:
    /// `id` must stop before it.
    pub(super) fn dependency_going_away(&self, id: &ProxyId) -> Option<ProxyId> {
        let depends_on = self.depends_on(id)?;
        depends_on.keys().filter_map(|dependency| dependency.resolve(|p| self.known(p))).find(|target| {
            !self.desired.contains_key(target)
                || self.held.contains(target)
                || self.slots.get(target).is_some_and(|slot| slot.draining)
        })
    }

    /// The dependents of `id` that still run or have an action in flight: `id` stops only
    /// once they are down.
    pub(super) fn dependents_up(&self, id: &ProxyId) -> Vec<ProxyId> {
        let mut up = self.dependents_of(id);
        up.retain(|dependent| {
            self.slots
                .get(dependent)
                .is_some_and(|slot| slot.busy.is_some() || slot.installed.is_some() || slot.observed.has_process())
        });
        up
    }

    /// Queues `ids` to be planned again by [`Manager::plan_woken`].
    pub(super) fn wake(&mut self, ids: impl IntoIterator<Item = ProxyId>) {
        self.woken.extend(ids);
    }

    /// After a change of `id`: its dependents may start (or must wait), and what it depends
    /// on may now stop.
    pub(super) fn wake_around(&mut self, id: &ProxyId) {
        if self.dependents.is_empty() {
            return;
        }
        let dependents = self.dependents_of(id);
        let dependencies = self.dependencies_of(id);
        self.wake(dependents.into_iter().chain(dependencies));
    }

    /// Plans again every proxy woken so far, and those they wake in turn.
    pub(super) fn plan_woken(&mut self) {
        while let Some(id) = self.woken.pop() {
            self.consider(&id);
        }
    }
}

/// The order of a kill: a proxy is stopped once every proxy that depends on it has stopped
/// (or failed to); independent proxies all at once. A cycle (which only registrations made
/// through the API can form) is broken by stopping the rest together.
pub(super) struct StopOrder {
    /// For each proxy not launched yet, how many of its dependents are still up.
    dependents_up: HashMap<ProxyId, usize>,
    /// What each proxy depends on, among those being stopped.
    dependencies: HashMap<ProxyId, Vec<ProxyId>>,
    launched: HashSet<ProxyId>,
}

impl StopOrder {
    /// The order for `proxies`, each with what it depends on among them.
    pub(super) fn new(proxies: impl IntoIterator<Item = (ProxyId, Vec<ProxyId>)>) -> Self {
        let dependencies: HashMap<ProxyId, Vec<ProxyId>> = proxies.into_iter().collect();
        let mut dependents_up: HashMap<ProxyId, usize> = dependencies.keys().map(|id| (id.clone(), 0)).collect();
        for targets in dependencies.values() {
            for target in targets {
                if let Some(count) = dependents_up.get_mut(target) {
                    *count += 1;
                }
            }
        }
        Self { dependents_up, dependencies, launched: HashSet::new() }
    }

    /// The proxies that may be stopped now and were not yet; when none may but some are
    /// left, the rest (a cycle).
    pub(super) fn ready(&mut self, in_flight: usize) -> Vec<ProxyId> {
        let mut ready: Vec<ProxyId> =
            self.dependents_up.iter().filter(|(_, up)| **up == 0).map(|(id, _)| id.clone()).collect();
        if ready.is_empty() && in_flight == 0 {
            ready = self.dependents_up.keys().cloned().collect();
        }
        ready.sort();
        for id in &ready {
            self.dependents_up.remove(id);
            self.launched.insert(id.clone());
        }
        ready
    }

    /// Notes that `id` is down (or gave up): what it depends on has one dependent fewer.
    pub(super) fn done(&mut self, id: &ProxyId) {
        for target in self.dependencies.get(id).into_iter().flatten() {
            if let Some(up) = self.dependents_up.get_mut(target) {
                *up = up.saturating_sub(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> ProxyId {
        ProxyId::parse(format!("{s}-proxy")).unwrap()
    }

    #[track_caller]
    fn order(graph: &[(&str, &[&str])]) -> Vec<Vec<ProxyId>> {
        let mut order =
            StopOrder::new(graph.iter().map(|(p, deps)| (id(p), deps.iter().map(|d| id(d)).collect::<Vec<_>>())));
        let mut waves = Vec::new();
        loop {
            let wave = order.ready(0);
            if wave.is_empty() {
                break;
            }
            for stopped in &wave {
                order.done(stopped);
            }
            waves.push(wave);
        }
        waves
    }

    #[test]
    fn independent_proxies_stop_in_one_wave() {
        assert_eq!(order(&[("a", &[]), ("b", &[]), ("c", &[])]), [vec![id("a"), id("b"), id("c")]]);
    }

    #[test]
    fn dependents_stop_before_what_they_depend_on() {
        let waves = order(&[("db", &[]), ("api", &["db"]), ("web", &["api", "db"]), ("cache", &[])]);
        assert_eq!(waves, [vec![id("cache"), id("web")], vec![id("api")], vec![id("db")]]);
    }

    #[test]
    fn a_cycle_is_stopped_together_once_nothing_else_can_stop() {
        let waves = order(&[("a", &["b"]), ("b", &["a"]), ("c", &["a"])]);
        assert_eq!(waves, [vec![id("c")], vec![id("a"), id("b")]]);
    }

    #[test]
    fn a_proxy_waits_for_dependents_in_flight() {
        let mut order = StopOrder::new([(id("a"), vec![]), (id("b"), vec![id("a")])]);
        assert_eq!(order.ready(0), [id("b")]);
        assert!(order.ready(1).is_empty(), "a waits while b is stopping");
        order.done(&id("b"));
        assert_eq!(order.ready(0), [id("a")]);
    }
}
