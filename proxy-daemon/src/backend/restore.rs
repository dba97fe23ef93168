//! Restore after an agent restart or crash: every live instance of a proxy is found from
//! the processes themselves, one is kept, the others are stopped.
//!
//! The snapshot's record and the pid file are hints, not the truth: after a crash during an
//! overlapping update either may name an instance that is gone, or one that was told to
//! stop and no longer serves, while the other instance serves. So every instance is looked
//! for (the record's identity, the pid file, the environment of every process), proven with
//! the same proof as an adoption, and asked which listening sockets it holds; [`preference`]
//! then says which one is kept and [`retirement`] how each other one is stopped. This module
//! never signals a process that it has not proven, and never stops the instance that serves
//! in favour of one that it cannot prove ready.

use std::cmp::Ordering;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::SystemTime;

use tether_manager::{Adopted, BackendRecord, ProxyHandle};
use tether_state::{ManagedProxy, ProxyId, UpdateStrategy};

use super::epoch::Draining;
use super::record::{Read, Record};
use super::{OsProcessBackend, OsProxyHandle};
use crate::spec::ProcessSpec;
use crate::supervisor::{ProcessHandle, Proven};

/// What restore knows of one live, proven instance of a proxy: what the rule decides on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Seen {
    /// Proven well enough to be kept: by its recorded identity, or by the wanted proxy's id
    /// and token in its environment (by the id and this agent's socket, for a proxy that is
    /// no longer wanted). Otherwise only well enough to be stopped (an outdated token).
    pub(super) keepable: bool,
    /// It holds one of the proxy's listening sockets, or the proxy has none. An instance of
    /// a proxy with listeners that holds none was told to stop (it closed them, and is
    /// finishing the connections it accepted), or cannot serve.
    pub(super) serves: bool,
    /// The process that the snapshot's record names: the one the engine last installed.
    pub(super) recorded: bool,
    /// When it started, in clock ticks after boot.
    pub(super) start_time: u64,
    pub(super) pid: u32,
}

/// The order in which the instances of one proxy are tried for keeping, best first:
///
/// 1. one that may be kept (the others are only ever stopped);
/// 2. one that serves, over one that does not: an instance that closed its listeners was
///    told to stop by the agent that died;
/// 3. the snapshot's, then the one that started first. Of two instances that both serve, the
///    newer is the new instance of an overlapping update that was under way: nothing proves
///    it ready, while the older one served until the crash. (The engine then does the
///    update again, the kept one serving meanwhile.)
///
/// The pid breaks the last tie, so that the choice does not depend on the order in which
/// instances were found.
pub(super) fn preference(a: &Seen, b: &Seen) -> Ordering {
    b.keepable
        .cmp(&a.keepable)
        .then(b.serves.cmp(&a.serves))
        .then(b.recorded.cmp(&a.recorded))
        .then(a.start_time.cmp(&b.start_time))
        .then(a.pid.cmp(&b.pid))
}

/// How an instance beside the kept one is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Retirement {
    /// Its kill signal, then SIGKILL after its kill timeout: it serves, and finishes what
    /// it accepted once signalled.
    Stop,
    /// No signal: it was told to stop already and is finishing its connections (a second
    /// signal makes many proxies drop them). It is awaited up to its kill timeout, then
    /// SIGKILLed.
    AwaitExit,
}

/// How `extra` is stopped, `kept` (if any) being the instance kept: only once the kept one
/// holds the listeners (and the agent with it) is an instance that gave them up left to
/// finish on its own.
pub(super) fn retirement(kept: Option<&Seen>, extra: &Seen) -> Retirement {
    match kept {
        Some(kept) if kept.serves && !extra.serves => Retirement::AwaitExit,
        _ => Retirement::Stop,
    }
}

/// One live instance of the proxy being restored.
struct Found {
    proven: Proven,
    seen: Seen,
    /// Copies of the proxy's listening sockets that it holds.
    listening: Vec<OwnedFd>,
}

impl OsProcessBackend {
    /// [`tether_manager::ProxyBackend::restore`]: keeps one live instance of `id`, stops
    /// the others, and tells the engine what the kept one runs.
    pub(super) async fn restore_proxy(
        &self,
        id: ProxyId,
        record: BackendRecord,
        desired: Option<Arc<ManagedProxy>>,
    ) -> Option<Box<dyn ProxyHandle>> {
        let desired_proxy = desired.as_deref();
        let recorded = match Record::read(&record) {
            Ok(Read::Process(record)) => Some(record),
            Ok(Read::Candidate) => None,
            Err(err) => {
                tracing::info!(proxy = %id, error = %err, "snapshot record unreadable; not adopting");
                return None;
            }
        };
        // The generations that drain (`update = "epoch"`) are taken back as they are, first:
        // they are not instances to choose among, and are never signalled before their time.
        let epoch = recorded.as_ref().and_then(|record| record.epoch.clone());
        let mut draining_pids = Vec::new();
        if let Some(epoch) = &epoch {
            self.shared.generations.reserve(&id, epoch.base_id);
            for draining in &epoch.draining {
                draining_pids.extend(self.adopt_draining(&id, desired_proxy, draining));
            }
        }
        let mut instances = self.live_instances(&id, desired_proxy, recorded.as_ref(), &draining_pids);
        instances.sort_by(|a, b| preference(&a.seen, &b.seen));
        let handle = OsProxyHandle::new(self.shared.clone(), id.clone(), desired.clone());
        let hands_over = desired_proxy.is_some_and(|proxy| proxy.spec().update.strategy == UpdateStrategy::Epoch);

        let kill = recorded.as_ref().map(|record| record.kill);
        let mut kept: Option<(ProcessHandle, Seen)> = None;
        let mut kept_generation = None;
        let mut extras = Vec::new();
        let mut remaining = instances.into_iter();
        while let Some(instance) = remaining.next() {
            if !instance.seen.keepable {
                extras.push(instance);
                continue;
            }
            let mut spec = self.adoption_spec(&id, desired_proxy, kill.unwrap_or_default());
            if let Some(proxy) = desired_proxy {
                // Its own sockets first, then those the other instances hold: whichever
                // instance holds them, the agent takes them back rather than binding again.
                let mut taken = Vec::new();
                taken.extend(instance.listening.iter().filter_map(|fd| fd.try_clone().ok()));
                let others = remaining.as_slice().iter().chain(&extras);
                taken.extend(others.flat_map(|other| other.listening.iter().filter_map(|fd| fd.try_clone().ok())));
                spec.listeners = match self.shared.listeners(proxy, taken) {
                    Ok(sockets) => sockets,
                    Err(error) => {
                        // The instance serves on; its next restart fails to start and says why.
                        tracing::warn!(proxy = %id, pid = instance.seen.pid, %error, "cannot keep the listeners of the adopted instance");
                        Vec::new()
                    }
                };
            }
            let seen = instance.seen;
            // A generation of its own, at its recorded epoch, and started again cold.
            let begun = hands_over.then(|| {
                // Its epoch as recorded, else as its environment says (a snapshot that missed
                // the last hot restart, or none).
                let recorded_epoch = epoch.as_ref().filter(|_| seen.recorded).map(|epoch| epoch.epoch);
                let (told_epoch, told_base_id) = super::epoch::told_to(seen.pid);
                if let (None, Some(base_id)) = (&epoch, told_base_id) {
                    self.shared.generations.reserve(&id, base_id);
                }
                let epoch_of = recorded_epoch.or(told_epoch);
                let keep = desired_proxy.is_some_and(|proxy| proxy.spec().update.keep_listening);
                self.shared.generations.keep_listening(&id, keep);
                let begun = self.shared.generations.begin(&id, Some(handle.status.clone()), epoch_of, None);
                self.shared.generations.apply(&mut spec, &id, begun);
                begun
            });
            let span = tracing::info_span!("proxy.adopt", proxy = %spec.name, pid = seen.pid);
            let adopted = span.in_scope(|| self.shared.supervisor.adopt_proven(spec, instance.proven, true));
            if let Some(process) = adopted {
                handle.lock().generation = begun.map(|begun| begun.key);
                kept_generation = begun;
                kept = Some((process, seen));
                extras.extend(remaining);
                break;
            }
            if let Some(begun) = begun {
                self.shared.generations.end(&id, begun.key);
            }
        }

        // Only now, the kept instance holding the listeners, are the others stopped.
        let kept_seen = kept.as_ref().map(|(_, seen)| *seen);
        for extra in extras {
            let how = retirement(kept_seen.as_ref(), &extra.seen);
            // An older generation that gave its listeners up drains: it is left to exit on
            // its own, as the engine would have after the hot restart the snapshot missed.
            match (hands_over, how, desired_proxy) {
                (true, Retirement::AwaitExit, Some(proxy)) => self.drain_extra(&id, proxy, extra),
                _ => self.retire(&id, desired_proxy, extra, how).await,
            }
        }

        let (process, seen) = kept?;
        // What the wanted proxy's instance runs: for a generation, with its epoch and base id.
        let wanted_spec = |proxy: &ManagedProxy| {
            let mut spec = self.shared.process_spec(proxy);
            if let Some(begun) = kept_generation {
                self.shared.generations.apply(&mut spec, &id, begun);
            }
            spec
        };
        let adopted = match desired_proxy {
            _ if seen.recorded => Adopted::AsRecorded,
            Some(proxy) if process.runs(&wanted_spec(proxy)) => Adopted::Desired,
            Some(_) => {
                tracing::info!(proxy = %id, pid = seen.pid, "adopted an instance that runs another spec; it will be replaced");
                Adopted::Unknown
            }
            None => Adopted::AsRecorded,
        };
        if !seen.recorded && recorded.is_some() {
            tracing::info!(proxy = %id, pid = seen.pid, "the snapshot's instance is gone or no longer serves; adopted another");
        }
        let handle = OsProxyHandle { adopted, ..handle };
        handle.attach(process);
        Some(Box::new(handle))
    }

    /// Takes back `draining`, a generation of `id` that drained when the snapshot was
    /// written, if it is still the process recorded: awaited until the end of its drain, then
    /// stopped. Returns its pid when taken.
    fn adopt_draining(&self, id: &ProxyId, desired: Option<&ManagedProxy>, draining: &Draining) -> Option<u32> {
        let pid = draining.identity.pid;
        let span = tracing::info_span!("proxy.adopt", proxy = %id, pid);
        let _entered = span.enter();
        let proven = self.shared.supervisor.prove(&draining.identity)?;
        let mut spec = self.stop_spec(id, desired);
        spec.kill = draining.kill;
        let process = self.shared.supervisor.adopt_proven(spec, proven, false)?;
        let begun = self.shared.generations.begin(id, None, Some(draining.epoch), Some(draining.clone()));
        let (generations, watched) = (self.shared.generations.clone(), id.clone());
        process.observe(move |current| generations.observe(&watched, begun.key, current, None));
        let remaining = draining.until.duration_since(SystemTime::now()).unwrap_or_default();
        tracing::info!(proxy = %id, pid, epoch = draining.epoch, "adopted an old generation that drains");
        let cut = self.shared.generations.cut_signal(id);
        tokio::spawn(super::epoch::await_drain(id.clone(), process, remaining, cut));
        Some(pid)
    }

    /// Takes back `extra`, a generation of `id` that gave its listeners up and that no
    /// record names, as one that drains: awaited up to `drain_timeout` from now, then
    /// stopped.
    fn drain_extra(&self, id: &ProxyId, desired: &ManagedProxy, extra: Found) {
        let Found { proven, seen, listening } = extra;
        drop(listening);
        let (epoch, _) = super::epoch::told_to(seen.pid);
        let mut spec = self.stop_spec(id, Some(desired));
        spec.kill = super::kill_policy(desired);
        let span = tracing::info_span!("proxy.adopt", proxy = %id, pid = seen.pid);
        let _entered = span.enter();
        let Some(process) = self.shared.supervisor.adopt_proven(spec, proven, false) else {
            tracing::info!(proxy = %id, pid = seen.pid, "an old generation could not be taken over; left alone");
            return;
        };
        let Some(identity) = process.status().identity else {
            return; // gone meanwhile: nothing drains
        };
        let timeout = desired.spec().update.drain_timeout;
        let draining = Draining {
            identity,
            epoch: epoch.unwrap_or_default(),
            kill: super::kill_policy(desired),
            until: SystemTime::now() + timeout,
        };
        let begun = self.shared.generations.begin(id, None, Some(draining.epoch), Some(draining));
        let (generations, watched) = (self.shared.generations.clone(), id.clone());
        process.observe(move |current| generations.observe(&watched, begun.key, current, None));
        tracing::info!(proxy = %id, pid = seen.pid, epoch = begun.epoch, "adopted an old generation that drains");
        let cut = self.shared.generations.cut_signal(id);
        tokio::spawn(super::epoch::await_drain(id.clone(), process, timeout, cut));
    }

    /// Every live instance of `id` that can be proven, each once, with what the rule needs
    /// to know of it: the one `recorded` names, the one the pid file names, and those found
    /// by their environment (an instance started just before a crash, or whose pid-file
    /// write failed, is known only by it).
    /// The generations that drain (`draining`) are left out: they were taken back already.
    fn live_instances(
        &self,
        id: &ProxyId,
        desired: Option<&ManagedProxy>,
        recorded: Option<&Record>,
        draining: &[u32],
    ) -> Vec<Found> {
        let name = super::process_name(id);
        let mut instances: Vec<Found> = Vec::new();
        if let Some(record) = recorded {
            let span = tracing::info_span!("proxy.adopt", proxy = %name, pid = record.identity.pid);
            if let Some(proven) = span.in_scope(|| self.shared.supervisor.prove(&record.identity)) {
                instances.push(self.looked_at(desired, proven, true, true));
            }
        }
        let mut pids: Vec<u32> = crate::pidfile::read(&self.shared.data.pid_file(id)).into_iter().collect();
        pids.extend(self.take_found(id));
        // Proven by the wanted proxy's token, an instance may be kept; by its id and this
        // agent's socket only (its token has changed since), it is stopped. A proxy that is
        // no longer wanted has no token: the id and the socket prove it, and the engine stops
        // what is kept.
        let keep_spec: Option<ProcessSpec> = desired.map(|proxy| self.shared.process_spec(proxy));
        let stop_spec = self.stop_spec(id, desired);
        for pid in pids {
            if instances.iter().any(|instance| instance.seen.pid == pid) || draining.contains(&pid) {
                continue;
            }
            let span = tracing::info_span!("proxy.adopt", proxy = %name, pid);
            let _entered = span.enter();
            let proven = keep_spec.as_ref().and_then(|spec| self.shared.supervisor.prove_by_environment(spec, pid));
            let (proven, keepable) = match proven {
                Some(proven) => (Some(proven), true),
                None => (self.shared.supervisor.prove_by_environment(&stop_spec, pid), desired.is_none()),
            };
            match proven {
                Some(proven) => instances.push(self.looked_at(desired, proven, keepable, false)),
                None => {
                    tracing::info!(proxy = %id, pid, "a process found for the proxy is not proven to be its instance; left alone")
                }
            }
        }
        instances
    }

    /// What the rule needs to know of `proven`: whether it holds `desired`'s listeners.
    fn looked_at(&self, desired: Option<&ManagedProxy>, proven: Proven, keepable: bool, recorded: bool) -> Found {
        let wanted = desired.map(|proxy| proxy.spec().listeners.as_slice()).unwrap_or_default();
        let listening: Vec<OwnedFd> = if wanted.is_empty() {
            Vec::new()
        } else {
            let sockets = proven.listening_sockets().unwrap_or_else(|error| {
                tracing::warn!(pid = proven.pid(), %error, "cannot take the listening sockets of the running instance");
                Vec::new()
            });
            sockets
                .into_iter()
                .filter(|fd| wanted.iter().any(|listener| crate::listen::listens_on(fd, &listener.address)))
                .collect()
        };
        // A proxy that hands over by itself binds its own listeners: one that holds none
        // has handed them over (or cannot serve). Where that cannot be read, it may serve.
        let hands_over = desired.is_some_and(|proxy| proxy.spec().update.strategy == UpdateStrategy::Epoch);
        let serves = match (wanted.is_empty(), hands_over) {
            (true, true) => proven.listening_sockets().map_or(true, |sockets| !sockets.is_empty()),
            (true, false) => true,
            (false, _) => !listening.is_empty(),
        };
        let seen = Seen { keepable, serves, recorded, start_time: proven.start_time(), pid: proven.pid() };
        Found { proven, seen, listening }
    }

    /// Stops `extra`, an instance of `id` beside the one kept (or of a proxy none of whose
    /// instances could be kept), as `how` says. Its pid file is left as it is: it names the
    /// kept one, or is written for it.
    async fn retire(&self, id: &ProxyId, desired: Option<&ManagedProxy>, extra: Found, how: Retirement) {
        let Found { proven, seen, listening } = extra;
        drop(listening);
        let spec = self.stop_spec(id, desired);
        let span = tracing::info_span!("proxy.adopt", proxy = %spec.name, pid = seen.pid);
        let Some(process) = span.in_scope(|| self.shared.supervisor.adopt_proven(spec, proven, false)) else {
            tracing::info!(proxy = %id, pid = seen.pid, "a second instance of the proxy could not be taken over; left alone");
            return;
        };
        let last = match how {
            Retirement::Stop => process.stop().await,
            Retirement::AwaitExit => process.finish_stop().await,
        };
        tracing::warn!(
            proxy = %id,
            pid = seen.pid,
            served = seen.serves,
            last_exit = ?last.figures.last_exit,
            "another instance of the proxy was running; stopped it"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(pid: u32, start_time: u64, serves: bool, recorded: bool) -> Seen {
        Seen { keepable: true, serves, recorded, start_time, pid }
    }

    /// The pids in the order they are tried for keeping.
    #[track_caller]
    fn check(instances: &[Seen], expected: &[u32]) {
        let mut sorted = instances.to_vec();
        sorted.sort_by(preference);
        let order: Vec<u32> = sorted.iter().map(|seen| seen.pid).collect();
        assert_eq!(order, expected, "{instances:?}");
        let mut reversed = instances.to_vec();
        reversed.reverse();
        reversed.sort_by(preference);
        assert_eq!(reversed, sorted, "the order does not depend on the order found");
    }

    #[test]
    fn the_old_instance_that_serves_is_kept_over_an_update_s_new_one() {
        // Killed while the new instance started: both hold the listeners.
        check(&[seen(20, 200, true, false), seen(10, 100, true, true)], &[10, 20]);
        // Without a snapshot record (a full disk): the one that started first.
        check(&[seen(20, 200, true, false), seen(10, 100, true, false)], &[10, 20]);
        // Pids wrap: the start time decides, not the pid.
        check(&[seen(10, 200, true, false), seen(20, 100, true, false)], &[20, 10]);
    }

    #[test]
    fn an_instance_told_to_stop_is_not_kept_over_the_one_that_serves() {
        // Killed once the new instance was ready and the old one told to stop: the snapshot
        // still names the old one, which gave up its listeners and finishes its connections.
        let old = seen(10, 100, false, true);
        let new = seen(20, 200, true, false);
        check(&[old, new], &[20, 10]);
        assert_eq!(retirement(Some(&new), &old), Retirement::AwaitExit, "no second signal");
    }

    #[test]
    fn a_serving_extra_is_stopped_with_its_signal() {
        let old = seen(10, 100, true, true);
        let new = seen(20, 200, true, false);
        assert_eq!(retirement(Some(&old), &new), Retirement::Stop);
        // Nobody holds the listeners (a program that closes them): nothing tells, so signal.
        assert_eq!(retirement(Some(&seen(10, 100, false, true)), &seen(20, 200, false, false)), Retirement::Stop);
        assert_eq!(retirement(None, &old), Retirement::Stop);
    }

    #[test]
    fn an_instance_proven_only_to_be_stopped_is_never_preferred() {
        let outdated = Seen { keepable: false, ..seen(10, 100, true, false) };
        check(&[outdated, seen(20, 200, false, false)], &[20, 10]);
    }

    #[test]
    fn without_listeners_the_snapshot_s_instance_then_the_oldest_is_kept() {
        check(&[seen(10, 100, true, false), seen(20, 200, true, true), seen(30, 300, true, false)], &[20, 10, 30]);
    }
}
