//! [`RecordingBackend`]: a backend that runs nothing, says that what it started runs, and
//! records every call the engine makes, in order.
//!
//! This module owns the pretend processes of its handles (a pid and a status each) and the
//! timer tasks that restart them after a pretend exit; it never runs a process.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::SystemTime;

use async_trait::async_trait;
use tether_state::{ExitReason, ManagedProxy, ProxyId};
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::backend::{BackendError, BackendState, BackendStatus, ProxyBackend, ProxyHandle};

/// The first pid handed out is one above this.
const FIRST_PID: u32 = 1000;

/// A [`ProxyBackend`] for tests, that records what the engine asks of it.
///
/// - Every call the engine makes of a handle is recorded, in order, as a [`Call`]: creations,
///   starts, updates, stops and detaches, each with its proxy id and the number of its handle
///   (handles are numbered from 1 in the order they are created), and creations and updates
///   with the proxy they were given.
/// - A started handle reports [`BackendState::Running`] at once, with a pid of its own (pids
///   are numbered from 1001 in the order processes start, restarts included, so a test sees
///   the same pids every run).
/// - [`RecordingBackend::fail_starts`] and [`RecordingBackend::fail_starts_when`] make starts
///   fail with [`BackendError::Start`].
/// - [`RecordingBackend::exit`] ends a running proxy as if its process had exited: the
///   handle reports `backoff` (or `starting`, when no delay is due) with the exit, and
///   restarts it after the delay of the proxy's restart policy, as the process backend does.
///
/// It adopts nothing ([`ProxyBackend::restore`] keeps its default, and its handles record
/// nothing): an engine started over it starts every proxy afresh. Clones share everything, so
/// a test keeps one clone and hands the engine another.
///
/// # Panics
///
/// A handle panics, with a message, when the engine breaks the backend contract: a handle
/// started twice. Under the `testing` feature the engine raises that panic again.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
///
/// use tether_manager::testing::{CallKind, RecordingBackend, RunningManager, wait_until_state};
/// use tether_manager::tether_state::{LocalState, ProxySpec, Service, ServiceId, ServiceName, Source};
/// use tether_manager::{Manager, ManagerConfig, MemorySnapshotStore, ProxyState};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let catalog = LocalState::new();
/// let web = Service::new(ServiceId::new("web").unwrap(), ServiceName::new("web").unwrap());
/// catalog.upsert(web.with_proxy(ProxySpec::default()), Source::Api).unwrap();
/// let id = ServiceId::new("web").unwrap().proxy_id();
///
/// let backend = RecordingBackend::new();
/// backend.fail_starts(&id, 1);
/// let store = Arc::new(MemorySnapshotStore::new());
/// let manager = Manager::new(Arc::new(catalog), Arc::new(backend.clone()), store, ManagerConfig::default());
/// let running = RunningManager::spawn(manager);
///
/// // The first start fails, the engine retries it with a new handle.
/// let web = wait_until_state(running.handle(), &id, ProxyState::Running, Duration::from_secs(10)).await.unwrap();
/// assert_eq!(web.figures.pid, Some(1001));
/// use CallKind::{Create, Start};
/// assert_eq!(backend.calls_of(&id), [(Create, 1), (Start, 1), (Create, 2), (Start, 2)]);
/// running.close().await.unwrap();
/// # }
/// ```
#[derive(Clone, Default)]
pub struct RecordingBackend {
    shared: Arc<Shared>,
}

/// One call the engine made of a [`RecordingBackend`] or of one of its handles.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Call {
    /// What was asked.
    pub kind: CallKind,
    /// Of which proxy.
    pub id: ProxyId,
    /// Of which handle: handles are numbered from 1, in the order they were created.
    pub handle: u64,
    /// The proxy it was given: with [`CallKind::Create`] and [`CallKind::Update`].
    pub proxy: Option<Arc<ManagedProxy>>,
    /// When, on tokio's clock (paused or not).
    pub at: Instant,
}

/// What a [`Call`] asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CallKind {
    /// [`ProxyBackend::create`].
    Create,
    /// [`ProxyHandle::start`].
    Start,
    /// [`ProxyHandle::update`].
    Update,
    /// [`ProxyHandle::stop`].
    Stop,
    /// [`ProxyHandle::detach`].
    Detach,
}

impl fmt::Display for CallKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Create => "create",
            Self::Start => "start",
            Self::Update => "update",
            Self::Stop => "stop",
            Self::Detach => "detach",
        })
    }
}

impl fmt::Display for Call {
    /// `start web-proxy #2`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} #{}", self.kind, self.id, self.handle)
    }
}

/// Decides whether a start of the proxy fails.
type StartCheck = Arc<dyn Fn(&ManagedProxy) -> bool + Send + Sync>;

#[derive(Default)]
struct Shared {
    record: Mutex<Record>,
}

#[derive(Default)]
struct Record {
    calls: Vec<Call>,
    handles: u64,
    last_pid: Option<u32>,
    /// Starts still to fail, by proxy.
    fail_next: HashMap<ProxyId, u32>,
    fail_when: Option<StartCheck>,
    /// Every handle that may still be alive, in creation order.
    instances: Vec<Weak<Instance>>,
    /// The pids that run, by proxy: started, neither stopped nor exited (detached ones too).
    running: HashMap<ProxyId, Vec<u32>>,
}

impl Record {
    fn next_pid(&mut self) -> u32 {
        let pid = self.last_pid.map_or(FIRST_PID + 1, |pid| pid + 1);
        self.last_pid = Some(pid);
        pid
    }

    fn call(&mut self, kind: CallKind, instance: &Instance, proxy: Option<Arc<ManagedProxy>>) {
        let call = Call { kind, id: instance.id.clone(), handle: instance.number, proxy, at: Instant::now() };
        self.calls.push(call);
    }

    fn forget_pid(&mut self, id: &ProxyId, pid: u32) {
        if let Some(pids) = self.running.get_mut(id) {
            pids.retain(|running| *running != pid);
            if pids.is_empty() {
                self.running.remove(id);
            }
        }
    }
}

impl fmt::Debug for RecordingBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let record = self.shared.lock();
        f.debug_struct("RecordingBackend")
            .field("calls", &record.calls.len())
            .field("running", &record.running)
            .finish_non_exhaustive()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Record> {
        // Every critical section leaves the record whole: a panic in one (a test's own
        // assertion) loses nothing.
        tether_state::lock(&self.record)
    }
}

impl RecordingBackend {
    /// A backend that has recorded nothing and fails no start.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every call so far, in the order they were made.
    pub fn calls(&self) -> Vec<Call> {
        self.shared.lock().calls.clone()
    }

    /// The calls so far for proxy `id`, each as what was asked and of which handle:
    /// `[(Create, 1), (Start, 1)]`.
    pub fn calls_of(&self, id: &ProxyId) -> Vec<(CallKind, u64)> {
        let record = self.shared.lock();
        record.calls.iter().filter(|call| &call.id == id).map(|call| (call.kind, call.handle)).collect()
    }

    /// The pids of proxy `id` that run now: started and neither stopped nor exited. A
    /// detached or dropped handle's process keeps running, as the backend contract asks.
    pub fn running(&self, id: &ProxyId) -> Vec<u32> {
        self.shared.lock().running.get(id).cloned().unwrap_or_default()
    }

    /// Makes the next `count` starts of proxy `id` fail with [`BackendError::Start`], on top
    /// of any not yet used up.
    pub fn fail_starts(&self, id: &ProxyId, count: u32) {
        let mut record = self.shared.lock();
        let left = record.fail_next.entry(id.clone()).or_default();
        *left = left.saturating_add(count);
    }

    /// Makes every start for which `fails` returns `true` fail with [`BackendError::Start`]
    /// (in place of an earlier rule of this kind). It is asked with the proxy to start, on
    /// the engine's task; a panic in it is raised again by the engine.
    pub fn fail_starts_when(&self, fails: impl Fn(&ManagedProxy) -> bool + Send + Sync + 'static) {
        self.shared.lock().fail_when = Some(Arc::new(fails));
    }

    /// Ends the process of proxy `id` as if it had exited with `reason`, and returns its pid.
    /// The handle that runs it (the one created last, should two run) reports the exit, then
    /// restarts it with a new pid after the delay of the proxy's restart policy (none for its
    /// first free attempts; an attempt count that a run of `healthy_after` resets), counting
    /// the restart in its status.
    ///
    /// # Panics
    ///
    /// When no supervised process of `id` runs (none was started, or it was stopped, detached
    /// or is waiting for its restart), and outside a tokio runtime.
    pub fn exit(&self, id: &ProxyId, reason: ExitReason) -> u32 {
        let instance = {
            let record = self.shared.lock();
            record
                .instances
                .iter()
                .rev()
                .filter_map(Weak::upgrade)
                .find(|instance| &instance.id == id && instance.life().running().is_some())
        };
        let Some(instance) = instance else {
            panic!("proxy {id} has no running process to end: none was started, or it was stopped, detached or exited")
        };
        instance.exit(&self.shared, reason)
    }
}

#[async_trait]
impl ProxyBackend for RecordingBackend {
    fn create(&self, proxy: Arc<ManagedProxy>) -> Box<dyn ProxyHandle> {
        let mut record = self.shared.lock();
        record.handles += 1;
        let instance = Arc::new(Instance {
            number: record.handles,
            id: proxy.id().clone(),
            proxy: Mutex::new(proxy.clone()),
            status: watch::Sender::new(BackendStatus::default()),
            life: Mutex::new(Life::Created),
            restart: Mutex::new(None),
        });
        record.call(CallKind::Create, &instance, Some(proxy));
        record.instances.retain(|alive| alive.strong_count() > 0);
        record.instances.push(Arc::downgrade(&instance));
        Box::new(RecordedHandle { shared: self.shared.clone(), instance })
    }
}

/// Where a handle's pretend process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    Created,
    /// Its start failed.
    Refused,
    Running {
        pid: u32,
        since: Instant,
        /// The restart attempt that started it (0 for the engine's start).
        attempt: u32,
    },
    /// Exited; restarted after `attempt`'s delay.
    Exited {
        attempt: u32,
    },
    Stopped,
    Detached,
}

impl Life {
    fn running(self) -> Option<u32> {
        match self {
            Self::Running { pid, .. } => Some(pid),
            _ => None,
        }
    }
}

/// What a handle and its restart timer share.
struct Instance {
    number: u64,
    id: ProxyId,
    proxy: Mutex<Arc<ManagedProxy>>,
    status: watch::Sender<BackendStatus>,
    life: Mutex<Life>,
    /// The pending restart after an exit.
    restart: Mutex<Option<AbortHandle>>,
}

impl Instance {
    fn life(&self) -> Life {
        *tether_state::lock(&self.life)
    }

    fn set_life(&self, life: Life) {
        *tether_state::lock(&self.life) = life;
    }

    fn proxy(&self) -> Arc<ManagedProxy> {
        tether_state::lock(&self.proxy).clone()
    }

    fn cancel_restart(&self) {
        if let Some(restart) = tether_state::lock(&self.restart).take() {
            restart.abort();
        }
    }

    /// Runs a new process: a new pid, `running` at once.
    fn run(&self, record: &mut Record, attempt: u32) {
        let pid = record.next_pid();
        record.running.entry(self.id.clone()).or_default().push(pid);
        self.set_life(Life::Running { pid, since: Instant::now(), attempt });
        self.status.send_modify(|status| {
            status.state = BackendState::Running;
            status.figures.pid = Some(pid);
            status.figures.started_at = Some(SystemTime::now());
            if attempt > 0 {
                status.figures.restarts += 1;
            }
        });
    }

    fn exit(self: &Arc<Self>, shared: &Arc<Shared>, reason: ExitReason) -> u32 {
        let Life::Running { pid, since, attempt } = self.life() else {
            unreachable!("only a running instance is ended")
        };
        let policy = self.proxy().spec().restart;
        // As the process backend counts: a run of `healthy_after` starts the count again.
        let attempt = policy.next_attempt(attempt, since.elapsed());
        let delay = policy.delay_before(attempt);
        shared.lock().forget_pid(&self.id, pid);
        self.set_life(Life::Exited { attempt });
        self.status.send_modify(|status| {
            status.state = if delay.is_zero() { BackendState::Starting } else { BackendState::Backoff };
            status.figures.pid = None;
            status.figures.started_at = None;
            status.figures.last_exit = Some(reason);
        });
        let (instance, shared) = (self.clone(), shared.clone());
        let restart = tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let mut record = shared.lock();
            // A stop or a detach in between cancels the restart; checked under the lock too.
            if instance.life() == (Life::Exited { attempt }) {
                instance.run(&mut record, attempt);
            }
        });
        *tether_state::lock(&self.restart) = Some(restart.abort_handle());
        pid
    }
}

/// A handle of a [`RecordingBackend`].
struct RecordedHandle {
    shared: Arc<Shared>,
    instance: Arc<Instance>,
}

impl Drop for RecordedHandle {
    fn drop(&mut self) {
        // The process keeps running, as after a detach; nothing supervises it any more.
        self.instance.cancel_restart();
    }
}

#[async_trait]
impl ProxyHandle for RecordedHandle {
    async fn start(&self) -> Result<(), BackendError> {
        let instance = &self.instance;
        let fail_when = {
            let mut record = self.shared.lock();
            record.call(CallKind::Start, instance, None);
            record.fail_when.clone()
        };
        let life = instance.life();
        assert!(
            life == Life::Created,
            "handle #{} of proxy {} was started twice (it is {life:?}): the engine starts a handle at most once",
            instance.number,
            instance.id,
        );
        let planned = match self.shared.lock().fail_next.get_mut(&instance.id) {
            Some(left) if *left > 0 => {
                *left -= 1;
                true
            }
            _ => false,
        };
        // Asked outside the lock: the test's closure may panic or look at the backend.
        let fails = planned || fail_when.is_some_and(|fails| fails(&instance.proxy()));
        if fails {
            instance.set_life(Life::Refused);
            let source = "the recording backend was told to fail this start".into();
            return Err(BackendError::Start { id: instance.id.clone(), source });
        }
        instance.run(&mut self.shared.lock(), 0);
        Ok(())
    }

    async fn stop(&self) -> Result<(), BackendError> {
        let instance = &self.instance;
        let mut record = self.shared.lock();
        record.call(CallKind::Stop, instance, None);
        instance.cancel_restart();
        if let Some(pid) = instance.life().running() {
            record.forget_pid(&instance.id, pid);
        }
        instance.set_life(Life::Stopped);
        drop(record);
        instance.status.send_modify(|status| {
            status.state = BackendState::Stopping;
            status.figures.pid = None;
        });
        Ok(())
    }

    async fn detach(&self) {
        let instance = &self.instance;
        let mut record = self.shared.lock();
        record.call(CallKind::Detach, instance, None);
        // Under the lock, as the restart timer looks at the life under it.
        instance.cancel_restart();
        instance.set_life(Life::Detached);
    }

    async fn update(&self, proxy: Arc<ManagedProxy>) -> Result<(), BackendError> {
        let instance = &self.instance;
        self.shared.lock().call(CallKind::Update, instance, Some(proxy.clone()));
        *tether_state::lock(&instance.proxy) = proxy;
        Ok(())
    }

    fn status(&self) -> watch::Receiver<BackendStatus> {
        self.instance.status.subscribe()
    }
}
