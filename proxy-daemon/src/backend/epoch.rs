//! `update = "epoch"`: the live generations of each proxy that hands over by itself (Envoy's
//! hot restart), their restart epochs, and the proxies' base ids.
//!
//! A generation is one handle's process: it begins when the handle starts (or restore
//! adopts it), is current until the engine lets it drain ([`Generations::drain`]), and ends
//! when its supervision ends. Each generation's status lists every live generation of its
//! proxy, its own first; a change of any of them is told to all of them, under this
//! registry's lock, so that no list overwrites a newer one.

use std::collections::HashMap;
use std::ffi::OsString;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tether_manager::{BackendStatus, Generation};
use tether_state::{KillPolicy, ProxyId, proxy_env, substitute_epoch};
use tokio::sync::watch;

use super::keep::Kept;
use crate::proc::Identity;
use crate::spec::{ProcessSpec, Restarted};
use crate::status::ProcessStatus;
use crate::supervisor::ProcessHandle;

/// Base ids are drawn from `1..=BASE_IDS`: never 0, Envoy's default, so that an Envoy run by
/// hand beside the agent does not meet a proxy's, and small enough that Envoy's
/// `base_id * 10 + epoch` stays a 32-bit number.
const BASE_IDS: u32 = 100_000_000;

/// How often the sockets of a generation that serves are looked for until it listens.
const KEEP_SEARCH: Duration = Duration::from_millis(100);
/// How often they are looked at again once it does.
const KEEP_REFRESH: Duration = Duration::from_secs(1);

/// The live generations of every proxy with `update = "epoch"`, and the base ids taken.
#[derive(Debug, Default)]
pub(super) struct Generations {
    inner: Mutex<Inner>,
    next_key: AtomicU64,
}

#[derive(Debug, Default)]
struct Inner {
    proxies: HashMap<ProxyId, Proxy>,
    /// Which proxy each base id is taken by: one proxy's for the agent's lifetime.
    taken: HashMap<u32, ProxyId>,
}

#[derive(Debug)]
struct Proxy {
    base_id: u32,
    live: Vec<Live>,
    /// Told whenever a generation ends or gets a process: a cold start waits on it.
    changed: watch::Sender<()>,
    /// Told when a cold start is waiting for the generations that drain: they are stopped
    /// at once ([`await_drain`]).
    cut: watch::Sender<()>,
    /// `keep_listening`: whether the agent keeps the serving generation's sockets.
    keep_listening: bool,
    /// The sockets kept, while the proxy has a live generation.
    kept: Kept,
}

#[derive(Debug)]
struct Live {
    key: u64,
    epoch: u32,
    pid: Option<u32>,
    /// The restarts its supervisor had counted when it was last seen: each restart is a
    /// cold start, at epoch 0.
    restarts: u64,
    /// Set once it drains: what the snapshot needs to adopt it again, and until when it may.
    draining: Option<Draining>,
    /// The status of the handle whose generation it is; `None` once it drains (the engine
    /// has dropped that handle).
    status: Option<super::StatusSender>,
    /// The pid whose listening sockets were kept (`keep_listening`), once it was ready.
    kept_from: Option<u32>,
}

impl Live {
    /// Whether a hot restart may take over from it: it is current, and its process runs (one
    /// that exited and waits on its restart backoff has no sockets to hand over).
    fn is_parent(&self) -> bool {
        self.draining.is_none() && self.pid.is_some()
    }
}

/// A generation that drains: its process, how to stop it, and until when it may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Draining {
    pub(super) identity: Identity,
    pub(super) epoch: u32,
    pub(super) kill: KillPolicy,
    pub(super) until: SystemTime,
}

/// A generation that began: its key in the registry, its epoch and its proxy's base id.
#[derive(Debug, Clone, Copy)]
pub(super) struct Begun {
    pub(super) key: u64,
    pub(super) epoch: u32,
    pub(super) base_id: u32,
}

impl Generations {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every critical section only moves values in or out.
        tether_state::lock(&self.inner)
    }

    /// Takes `base_id` for `id` (recorded by an earlier agent), unless another proxy has it;
    /// restore calls it before any proxy starts, so that a recorded base id stays its proxy's.
    pub(super) fn reserve(&self, id: &ProxyId, base_id: u32) {
        let mut inner = self.lock();
        if inner.proxies.contains_key(id) || inner.taken.get(&base_id).is_some_and(|owner| owner != id) {
            return;
        }
        inner.taken.insert(base_id, id.clone());
        inner.proxies.insert(id.clone(), Proxy::new(base_id));
    }

    /// Begins a generation of `id` whose handle reports through `status`: at `epoch` when
    /// given (an adopted process), else one more than the current generation whose process
    /// runs (a hot restart, from that live parent), or 0 when there is none (a cold start):
    /// only generations that drain live, or the current one exited and waits to start again.
    pub(super) fn begin(
        &self,
        id: &ProxyId,
        status: Option<super::StatusSender>,
        epoch: Option<u32>,
        draining: Option<Draining>,
    ) -> Begun {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let mut inner = self.lock();
        let proxy = inner.proxy(id);
        let parents = proxy.live.iter().filter(|live| live.is_parent());
        let epoch = epoch.unwrap_or_else(|| parents.map(|live| live.epoch + 1).max().unwrap_or(0));
        let pid = draining.as_ref().map(|draining| draining.identity.pid);
        proxy.live.push(Live { key, epoch, pid, restarts: 0, draining, status, kept_from: None });
        let base_id = proxy.base_id;
        inner.refresh(id);
        Begun { key, epoch, base_id }
    }

    /// Ends generation `key` of `id` whose process could not start.
    pub(super) fn end(&self, id: &ProxyId, key: u64) {
        let mut inner = self.lock();
        if let Some(proxy) = inner.proxies.get_mut(id) {
            proxy.live.retain(|live| live.key != key);
            proxy.changed.send_replace(());
            proxy.release_when_gone(id);
        }
        inner.refresh(id);
    }

    /// Sets `keep_listening` of `id`: its generations' sockets are kept from the next one that
    /// is ready on; turned off, the kept ones are closed.
    pub(super) fn keep_listening(&self, id: &ProxyId, on: bool) {
        let mut inner = self.lock();
        let proxy = inner.proxy(id);
        proxy.keep_listening = on;
        if !on {
            proxy.kept.release(id);
            proxy.live.iter_mut().for_each(|live| live.kept_from = None);
        }
    }

    /// Follows what the supervisor observes of generation `key` of `id`: its pid, its cold
    /// restarts (epoch 0) and its end. Publishes `next` with the generations, when given,
    /// under the registry's lock.
    pub(super) fn observe(
        self: &Arc<Self>,
        id: &ProxyId,
        key: u64,
        current: &ProcessStatus,
        next: Option<(BackendStatus, &super::StatusSender)>,
    ) {
        let mut inner = self.lock();
        if let Some(proxy) = inner.proxies.get_mut(id) {
            if current.state.is_final() {
                let before = proxy.live.len();
                proxy.live.retain(|live| live.key != key);
                if proxy.live.len() != before {
                    proxy.changed.send_replace(());
                }
                proxy.release_when_gone(id);
            } else if let Some(live) = proxy.live.iter_mut().find(|live| live.key == key) {
                let restarted = current.figures.restarts > live.restarts;
                if restarted {
                    live.epoch = 0;
                    live.restarts = current.figures.restarts;
                }
                if live.pid != current.figures.pid || restarted {
                    live.pid = current.figures.pid;
                    proxy.changed.send_replace(());
                }
                // A generation that serves, ready, from a process not yet kept: its sockets
                // are the ones to keep from now on, followed while it serves.
                let ready = current.ready && live.draining.is_none();
                if let Some(identity) = current.identity.as_ref().filter(|_| ready && proxy.keep_listening)
                    && live.kept_from != Some(identity.pid)
                {
                    live.kept_from = Some(identity.pid);
                    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                        runtime.spawn(Arc::clone(self).keep_following(id.clone(), key, identity.clone()));
                    }
                }
            }
        }
        if let Some((mut next, status)) = next {
            next.generations = inner.list(id, key);
            status.send_replace(next);
        }
        inner.refresh_others(id, key);
    }

    /// Keeps the listening sockets of generation `key` of `id` (process `identity`) while it
    /// serves: at once, again every [`KEEP_SEARCH`] until it listens on something (a hot
    /// restart's new generation may be told ready before its sockets reach it), then every
    /// [`KEEP_REFRESH`], so that a listener it opens later is kept too.
    async fn keep_following(self: Arc<Self>, id: ProxyId, key: u64, identity: Identity) {
        let mut listens = false;
        loop {
            {
                let mut inner = self.lock();
                let Some(proxy) = inner.proxies.get_mut(&id) else { return };
                let serving = proxy.live.iter().any(|live| {
                    live.key == key
                        && live.draining.is_none()
                        && live.pid == Some(identity.pid)
                        && live.kept_from == Some(identity.pid)
                });
                if !proxy.keep_listening || !serving {
                    return;
                }
                listens = proxy.kept.take_from(&id, &identity) || listens;
            }
            tokio::time::sleep(if listens { KEEP_REFRESH } else { KEEP_SEARCH }).await;
        }
    }

    /// Told when a cold start of `id` would wait for its generations that drain: then they
    /// are to stop at once.
    pub(super) fn cut_signal(&self, id: &ProxyId) -> watch::Receiver<()> {
        let mut inner = self.lock();
        let mut receiver = inner.proxy(id).cut.subscribe();
        receiver.mark_unchanged();
        receiver
    }

    /// Lets generation `key` of `id` drain: from now on it is listed as draining, and the
    /// handle that started it no longer reports it.
    pub(super) fn drain(&self, id: &ProxyId, key: u64, draining: Draining) {
        let mut inner = self.lock();
        if let Some(live) = inner.proxies.get_mut(id).and_then(|proxy| proxy.live.iter_mut().find(|l| l.key == key)) {
            live.draining = Some(draining);
            live.status = None;
        }
        inner.refresh(id);
    }

    /// What the snapshot records beside generation `key` of `id`: its epoch, the base id,
    /// and the generations that drain.
    pub(super) fn recorded(&self, id: &ProxyId, key: u64) -> Option<(u32, u32, Vec<Draining>)> {
        let inner = self.lock();
        let proxy = inner.proxies.get(id)?;
        let epoch = proxy.live.iter().find(|live| live.key == key)?.epoch;
        let draining = proxy.live.iter().filter_map(|live| live.draining.clone()).collect();
        Some((epoch, proxy.base_id, draining))
    }

    /// The base id of `id`, taken now if it has none.
    #[cfg(test)]
    pub(super) fn base_id(&self, id: &ProxyId) -> u32 {
        self.lock().proxy(id).base_id
    }

    /// Whether a start of `id` has no parent to take over from (no current generation whose
    /// process runs) while generations that drain still run: it is then a cold start, which
    /// waits for them to exit ([`Generations::alone`]).
    pub(super) fn without_parent(&self, id: &ProxyId) -> bool {
        let inner = self.lock();
        inner.proxies.get(id).is_some_and(|proxy| {
            let running = proxy.live.iter().any(|live| live.pid.is_some());
            running && !proxy.live.iter().any(Live::is_parent)
        })
    }

    /// Resolves once no generation of `id` but `key` has a process: when a crashed
    /// generation may start again cold, at epoch 0.
    ///
    /// The generations it waits for that drain are stopped at once: each handed its sockets
    /// over to a generation that is gone, so until a new generation listens, nothing does
    /// (and connections are refused); the cold start cannot take over from them, and cannot
    /// bind beside them under their base id.
    pub(super) fn alone(
        self: Arc<Self>,
        id: ProxyId,
        key: u64,
    ) -> Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut cut = false;
            loop {
                let mut changed = {
                    let mut inner = self.lock();
                    let proxy = inner.proxy(&id);
                    let others = proxy.live.iter().filter(|live| live.key != key && live.pid.is_some());
                    let (count, draining) = others.fold((0, 0), |(count, draining), live| {
                        (count + 1, draining + usize::from(live.draining.is_some()))
                    });
                    if count == 0 {
                        return;
                    }
                    if !cut && draining == count {
                        tracing::info!(
                            proxy = %id,
                            draining,
                            "a cold start stops the old generations that drain: they handed their sockets over"
                        );
                        proxy.cut.send_replace(());
                        cut = true;
                    }
                    proxy.changed.subscribe()
                };
                if changed.changed().await.is_err() {
                    return;
                }
            }
        })
    }

    /// Makes `spec` (of proxy `id`) generation `begun`'s: `{restart_epoch}` and `{base_id}`
    /// replaced in its arguments and environment, and, should its process exit, started
    /// again cold (epoch 0) once no other generation of the proxy runs.
    pub(super) fn apply(self: &Arc<Self>, spec: &mut ProcessSpec, id: &ProxyId, begun: Begun) {
        let substitute = |text: &OsString, epoch: u32| match text.to_str() {
            Some(text) => OsString::from(substitute_epoch(text, epoch, begun.base_id)),
            None => text.clone(),
        };
        let cold_args = spec.args.iter().map(|arg| substitute(arg, 0)).collect();
        // Its own epoch and base id in its environment too: they tell the next agent what a
        // live process is when no snapshot record does.
        let told = |epoch: u32| {
            [
                (OsString::from(proxy_env::RESTART_EPOCH), OsString::from(epoch.to_string())),
                (OsString::from(proxy_env::BASE_ID), OsString::from(begun.base_id.to_string())),
            ]
        };
        let mut cold_env: Vec<(OsString, OsString)> = spec
            .env
            .iter()
            .filter(|(_, value)| value.to_str().is_some_and(|v| tether_state::epoch_placeholder_in(v).is_some()))
            .map(|(key, value)| (key.clone(), substitute(value, 0)))
            .collect();
        cold_env.extend(told(0));
        spec.args = spec.args.iter().map(|arg| substitute(arg, begun.epoch)).collect();
        for (_, value) in &mut spec.env {
            *value = substitute(value, begun.epoch);
        }
        spec.env.extend(told(begun.epoch));
        let (registry, id, key) = (Arc::clone(self), id.clone(), begun.key);
        spec.restarted = Some(Box::new(Restarted {
            args: cold_args,
            env: cold_env.into(),
            after: Arc::new(move || Arc::clone(&registry).alone(id.clone(), key)),
        }));
    }
}

impl Inner {
    fn proxy(&mut self, id: &ProxyId) -> &mut Proxy {
        if !self.proxies.contains_key(id) {
            let base_id = free_base_id(&self.taken, id);
            self.taken.insert(base_id, id.clone());
            self.proxies.insert(id.clone(), Proxy::new(base_id));
        }
        self.proxies.get_mut(id).unwrap_or_else(|| unreachable!("inserted above"))
    }

    /// The live generations of `id` as generation `key` lists them: its own first, then the
    /// others that do not drain, then those that drain, newest first.
    fn list(&self, id: &ProxyId, key: u64) -> Vec<Generation> {
        let Some(proxy) = self.proxies.get(id) else { return Vec::new() };
        let mut live: Vec<&Live> = proxy.live.iter().collect();
        live.sort_by_key(|live| (live.key != key, live.draining.is_some(), std::cmp::Reverse(live.epoch)));
        live.into_iter()
            .map(|live| Generation { epoch: live.epoch, pid: live.pid, draining: live.draining.is_some() })
            .collect()
    }

    /// Tells every handle of `id` its list of generations.
    fn refresh(&self, id: &ProxyId) {
        self.refresh_others(id, u64::MAX);
    }

    fn refresh_others(&self, id: &ProxyId, except: u64) {
        let Some(proxy) = self.proxies.get(id) else { return };
        for live in proxy.live.iter().filter(|live| live.key != except) {
            if let Some(status) = &live.status {
                let generations = self.list(id, live.key);
                status.send_if_modified(|status| {
                    let changed = status.generations != generations;
                    status.generations = generations;
                    changed
                });
            }
        }
    }
}

impl Proxy {
    fn new(base_id: u32) -> Self {
        Self {
            base_id,
            live: Vec::new(),
            changed: watch::Sender::new(()),
            cut: watch::Sender::new(()),
            keep_listening: false,
            kept: Kept::default(),
        }
    }

    /// Closes the kept sockets once no generation of the proxy serves or is to serve again
    /// (those left drain, having handed their sockets over): it was stopped or deregistered,
    /// and a connection should be refused rather than wait in them for nobody.
    fn release_when_gone(&mut self, id: &ProxyId) {
        if self.live.iter().all(|live| live.draining.is_some()) {
            self.kept.release(id);
        }
    }
}

/// The base id of `id`: derived from its id (FNV-1a), so that it is the same for the
/// proxy after an agent restart, and the next free one after it when another proxy has
/// that one.
fn free_base_id(taken: &HashMap<u32, ProxyId>, id: &ProxyId) -> u32 {
    let hash = id
        .as_str()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3));
    let mut base_id = (hash % u64::from(BASE_IDS)) as u32 + 1;
    while taken.get(&base_id).is_some_and(|owner| owner != id) {
        base_id = base_id % BASE_IDS + 1;
    }
    base_id
}

/// The restart epoch and base id that live process `pid` was started with, from its
/// environment: what a generation is when no snapshot record says it.
pub(super) fn told_to(pid: u32) -> (Option<u32>, Option<u32>) {
    let Ok(environ) = crate::proc::read_environ(pid) else { return (None, None) };
    let value = |name: &str| {
        environ.split(|byte| *byte == 0).find_map(|entry| {
            let value = entry.strip_prefix(name.as_bytes())?.strip_prefix(b"=")?;
            std::str::from_utf8(value).ok()?.parse::<u32>().ok()
        })
    };
    (value(proxy_env::RESTART_EPOCH), value(proxy_env::BASE_ID))
}

/// Awaits the exit of a generation that drains, up to `timeout`, then stops it with its
/// kill signal (and SIGKILL after its kill timeout); and at once when `cut` is told (a cold
/// start of its proxy waits for it: [`Generations::alone`]).
pub(super) async fn await_drain(id: ProxyId, process: ProcessHandle, timeout: Duration, mut cut: watch::Receiver<()>) {
    let mut status = process.subscribe();
    let pid = status.borrow().figures.pid;
    let exited = tokio::time::timeout(timeout, async {
        let _ended = status.wait_for(|status| status.state.is_final()).await.is_ok();
    });
    let cut_short = async {
        if cut.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let exited = tokio::select! {
        exited = exited => Some(exited),
        () = cut_short => None,
    };
    match exited {
        Some(Ok(_)) => tracing::info!(proxy = %id, pid, "the old generation drained and exited"),
        None => {
            tracing::info!(proxy = %id, pid, "stopping the old generation now: the generation it handed over to is gone");
            let last = process.stop().await;
            tracing::info!(proxy = %id, pid, last_exit = ?last.figures.last_exit, "the old generation stopped");
        }
        Some(Err(_elapsed)) => {
            tracing::warn!(
                proxy = %id,
                pid,
                drain_timeout = %humantime::format_duration(timeout),
                "the old generation did not exit within drain_timeout; stopping it"
            );
            let last = process.stop().await;
            tracing::info!(proxy = %id, pid, last_exit = ?last.figures.last_exit, "the old generation stopped");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> ProxyId {
        tether_state::ServiceId::new(name).unwrap().proxy_id()
    }

    #[test]
    fn a_base_id_is_derived_from_the_id_and_unique_among_the_proxies() {
        let registry = Generations::default();
        let web = registry.base_id(&id("web"));
        assert!((1..=BASE_IDS).contains(&web));
        assert_eq!(registry.base_id(&id("web")), web, "stable");
        assert_eq!(Generations::default().base_id(&id("web")), web, "the same in the next agent");

        // Another proxy whose id hashes to a base id already taken gets the next free one.
        let mut taken = HashMap::new();
        let first = free_base_id(&taken, &id("api"));
        taken.insert(first, id("web"));
        taken.insert(first % BASE_IDS + 1, id("db"));
        assert_eq!(free_base_id(&taken, &id("api")), (first + 1) % BASE_IDS + 1);
    }

    #[tokio::test]
    async fn a_cold_start_tells_the_generations_that_drain_to_stop_and_waits_for_their_end() {
        let registry = Arc::new(Generations::default());
        let web = id("web");
        let old = registry.begin(&web, None, None, None);
        let identity = Identity { pid: 10, pgid: 10, start_time: 1, boot_id: "b".into(), cgroup: None };
        let until = SystemTime::now() + Duration::from_secs(900);
        registry.drain(&web, old.key, Draining { identity, epoch: 0, kill: KillPolicy::default(), until });
        let mut cut = registry.cut_signal(&web);
        let current = registry.begin(&web, None, None, None);
        {
            let mut inner = registry.lock();
            let proxy = inner.proxy(&web);
            proxy.live.iter_mut().for_each(|live| live.pid = Some(10 + live.key as u32));
        }
        assert!(!cut.has_changed().unwrap(), "a hot restart leaves the old generation alone");

        // The current generation crashed and starts again cold: the old one is told to stop.
        let alone = tokio::spawn(Arc::clone(&registry).alone(web.clone(), current.key));
        tokio::time::timeout(Duration::from_secs(10), cut.changed()).await.unwrap().unwrap();
        assert!(!alone.is_finished(), "the cold start waits for the old generation's end");
        registry.end(&web, old.key);
        tokio::time::timeout(Duration::from_secs(10), alone).await.unwrap().unwrap();
    }

    #[test]
    fn a_recorded_base_id_is_kept_unless_another_proxy_has_it() {
        let registry = Generations::default();
        registry.reserve(&id("web"), 42);
        assert_eq!(registry.base_id(&id("web")), 42);
        registry.reserve(&id("api"), 42);
        assert_ne!(registry.base_id(&id("api")), 42);
    }

    #[test]
    fn epochs_count_hot_restarts_from_a_cold_start_and_lists_put_each_generation_first() {
        let registry = Generations::default();
        let web = id("web");
        let first = crate::backend::StatusSender::new();
        let zero = registry.begin(&web, Some(first.clone()), None, None);
        assert_eq!(zero.epoch, 0);
        runs(&registry, &web, zero.key, Some(10));
        let second = crate::backend::StatusSender::new();
        let one = registry.begin(&web, Some(second.clone()), None, None);
        assert_eq!(one.epoch, 1);
        runs(&registry, &web, one.key, Some(11));
        assert_eq!(first.subscribe().borrow().generations.iter().map(|g| g.epoch).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(second.subscribe().borrow().generations.iter().map(|g| g.epoch).collect::<Vec<_>>(), [1, 0]);

        let identity = Identity { pid: 10, pgid: 10, start_time: 1, boot_id: "b".into(), cgroup: None };
        let draining = Draining { identity, epoch: 0, kill: KillPolicy::default(), until: SystemTime::now() };
        registry.drain(&web, zero.key, draining.clone());
        let listed = second.subscribe().borrow().generations.clone();
        assert_eq!(listed.iter().map(|g| (g.epoch, g.draining)).collect::<Vec<_>>(), [(1, false), (0, true)]);
        assert_eq!(registry.recorded(&web, one.key), Some((1, one.base_id, vec![draining])));
        assert!(!registry.without_parent(&web));
        let two = registry.begin(&web, None, None, None);
        assert_eq!(two.epoch, 2);

        // With only generations that drain, the next is a cold start.
        registry.end(&web, one.key);
        registry.end(&web, two.key);
        assert!(registry.without_parent(&web));
        assert_eq!(registry.begin(&web, None, None, None).epoch, 0);
    }

    #[test]
    fn a_current_generation_whose_process_exited_is_no_parent_and_the_next_starts_cold() {
        let registry = Generations::default();
        let web = id("web");
        let zero = registry.begin(&web, None, None, None);
        runs(&registry, &web, zero.key, Some(10));
        let one = registry.begin(&web, None, None, None);
        assert_eq!(one.epoch, 1, "a hot restart from the live epoch 0");
        registry.end(&web, zero.key);
        runs(&registry, &web, one.key, Some(11));
        // Epoch 1 is killed, and waits on its restart backoff: a change now has nothing to
        // take over from, and nothing that runs to wait for.
        runs(&registry, &web, one.key, None);
        assert!(!registry.without_parent(&web));
        assert_eq!(registry.begin(&web, None, None, None).epoch, 0);
    }

    /// Sets the process of generation `key` of `id`, as the supervisor's status would.
    fn runs(registry: &Generations, id: &ProxyId, key: u64, pid: Option<u32>) {
        let mut inner = registry.lock();
        let live = inner.proxy(id).live.iter_mut().find(|live| live.key == key).unwrap();
        live.pid = pid;
    }
}
