//! A hand-written backend for the engine's tests: it records every call with its (paused)
//! time, tracks what "runs", and checks that no proxy ever sees two operations at once.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tether_state::{ManagedProxy, ProxyId, ReloadOutcome, ReloadResult};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::backend::{Adopted, BackendError, BackendRecord, BackendState, BackendStatus, ProxyBackend, ProxyHandle};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Call {
    Start,
    Stop,
    Update,
    Detach,
    Restore,
    Reload,
    Drain,
}

#[derive(Default)]
pub(super) struct FakeState {
    pub(super) calls: Vec<(Instant, ProxyId, Call)>,
    /// What runs, as what it was last given.
    pub(super) live: BTreeMap<ProxyId, Arc<ManagedProxy>>,
    /// Every proxy ever started.
    pub(super) started: HashSet<ProxyId>,
    busy: HashMap<ProxyId, u32>,
    pub(super) overlaps: Vec<ProxyId>,
    pub(super) ran_twice: Vec<ProxyId>,
    pub(super) fail_starts: HashSet<ProxyId>,
    pub(super) stop_delay: HashMap<ProxyId, Duration>,
    /// Scripted outcomes for start/stop/update, consumed in order: (fails, delay in ms).
    pub(super) script: VecDeque<(bool, u64)>,
    pub(super) unprovable: HashSet<ProxyId>,
    pub(super) candidates: Vec<ProxyId>,
    /// Proxies whose instances stay `starting`: never ready.
    pub(super) never_ready: HashSet<ProxyId>,
    /// Proxies whose instances stay `starting` this long after their start, then are ready.
    pub(super) ready_after: HashMap<ProxyId, Duration>,
    /// What a restored handle says its process runs, when not as recorded.
    pub(super) adopted: HashMap<ProxyId, Adopted>,
    /// The pid of the instance that runs, by proxy: a stop removes only its own.
    live_pid: HashMap<ProxyId, u32>,
    /// The instance an overlapping start ran beside, until one of the two stops.
    previous: HashMap<ProxyId, (u32, Arc<ManagedProxy>)>,
    /// The live generations each new instance of a proxy reports (`update = "epoch"`).
    pub(super) generations: HashMap<ProxyId, usize>,
    /// The status of the last instance started of each proxy.
    pub(super) last_started: HashMap<ProxyId, watch::Sender<BackendStatus>>,
    next_pid: u32,
}

pub(super) struct Fake {
    state: Mutex<FakeState>,
    calls: watch::Sender<usize>,
}

impl Fake {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(FakeState { next_pid: 100, ..FakeState::default() }),
            calls: watch::Sender::new(0),
        })
    }

    pub(super) fn state(&self) -> MutexGuard<'_, FakeState> {
        tether_state::lock(&self.state)
    }

    pub(super) fn calls_of(&self, call: Call) -> Vec<(Instant, ProxyId)> {
        self.state().calls.iter().filter(|(_, _, c)| *c == call).map(|(at, id, _)| (*at, id.clone())).collect()
    }

    pub(super) fn live_ids(&self) -> Vec<String> {
        self.state().live.keys().map(|id| id.to_string()).collect()
    }

    /// Waits until `count` calls of kind `call` happened, and returns them.
    pub(super) async fn wait_calls(&self, call: Call, count: usize) -> Vec<(Instant, ProxyId)> {
        let mut calls = self.calls.subscribe();
        let waited = tokio::time::timeout(Duration::from_secs(600), async {
            loop {
                if self.calls_of(call).len() >= count {
                    return;
                }
                if calls.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
        let seen = self.calls_of(call);
        assert!(waited.is_ok(), "timed out waiting for {count} {call:?} calls, saw {seen:?}");
        seen
    }

    fn record(&self, id: &ProxyId, call: Call) {
        self.state().calls.push((Instant::now(), id.clone(), call));
        self.calls.send_modify(|n| *n += 1);
    }

    fn enter(&self, id: &ProxyId) -> (bool, Duration) {
        let mut state = self.state();
        let busy = state.busy.entry(id.clone()).or_default();
        *busy += 1;
        if *busy > 1 {
            state.overlaps.push(id.clone());
        }
        let (fails, delay) = state.script.pop_front().unwrap_or((false, 0));
        (fails, Duration::from_millis(delay))
    }

    fn leave(&self, id: &ProxyId) {
        if let Some(busy) = self.state().busy.get_mut(id) {
            *busy -= 1;
        }
    }

    fn handle(self: &Arc<Self>, id: ProxyId, proxy: Option<Arc<ManagedProxy>>, pid: Option<u32>) -> FakeHandle {
        let status = BackendStatus {
            state: if pid.is_some() { BackendState::Running } else { BackendState::Pending },
            figures: tether_state::ProcessFigures { pid, ..Default::default() },
            ..BackendStatus::default()
        };
        let adopted = self.state().adopted.get(&id).copied().unwrap_or_default();
        FakeHandle { fake: self.clone(), id, proxy: Mutex::new(proxy), status: watch::Sender::new(status), adopted }
    }
}

pub(super) struct FakeHandle {
    fake: Arc<Fake>,
    id: ProxyId,
    proxy: Mutex<Option<Arc<ManagedProxy>>>,
    pub(super) status: watch::Sender<BackendStatus>,
    adopted: Adopted,
}

fn proxy_epoch(proxy: &ManagedProxy) -> bool {
    proxy.spec().update.strategy == tether_state::UpdateStrategy::Epoch
}

fn failure(what: &str) -> crate::BoxError {
    format!("the fake refuses to {what}").into()
}

impl FakeHandle {
    async fn start_instance(&self) -> Result<(), BackendError> {
        let (mut fails, delay) = self.fake.enter(&self.id);
        self.fake.record(&self.id, Call::Start);
        tokio::time::sleep(delay).await;
        fails |= self.fake.state().fail_starts.contains(&self.id);
        let result = if fails {
            Err(BackendError::Start { id: self.id.clone(), source: failure("start") })
        } else {
            let proxy = self.proxy.lock().unwrap().clone().expect("a created handle has its proxy");
            // A generation lists itself, at least.
            let hands_over = proxy_epoch(&proxy);
            let mut state = self.fake.state();
            // An overlapping update runs two instances on purpose, until the old one stops.
            let overlaps = matches!(
                proxy.spec().update.strategy,
                tether_state::UpdateStrategy::Overlap | tether_state::UpdateStrategy::Epoch
            );
            let replaced = state.live.insert(self.id.clone(), proxy);
            if replaced.is_some() && !overlaps {
                state.ran_twice.push(self.id.clone());
            }
            state.started.insert(self.id.clone());
            state.next_pid += 1;
            let pid = state.next_pid;
            let replaced_pid = state.live_pid.insert(self.id.clone(), pid);
            if let (Some(proxy), Some(old_pid)) = (replaced, replaced_pid) {
                state.previous.insert(self.id.clone(), (old_pid, proxy));
            }
            let ready_after = state.ready_after.get(&self.id).copied();
            let ready = !state.never_ready.contains(&self.id) && ready_after.is_none();
            let generations = state.generations.get(&self.id).copied().unwrap_or(usize::from(hands_over));
            state.last_started.insert(self.id.clone(), self.status.clone());
            drop(state);
            self.status.send_modify(|s| {
                s.state = if ready { BackendState::Running } else { BackendState::Starting };
                s.figures.pid = Some(pid);
                s.generations =
                    (0..generations).map(|n| crate::Generation { epoch: 0, pid: Some(pid), draining: n > 0 }).collect();
            });
            if let Some(after) = ready_after {
                // Its readiness passes later, as a probe's would.
                let status = self.status.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    status.send_if_modified(|s| {
                        let same = s.figures.pid == Some(pid) && s.state == BackendState::Starting;
                        if same {
                            s.state = BackendState::Running;
                        }
                        same
                    });
                });
            }
            Ok(())
        };
        self.fake.leave(&self.id);
        result
    }

    async fn end(&self, call: Call) -> Result<(), BackendError> {
        let (fails, delay) = self.fake.enter(&self.id);
        self.fake.record(&self.id, call);
        let delay = delay.max(self.fake.state().stop_delay.get(&self.id).copied().unwrap_or_default());
        tokio::time::sleep(delay).await;
        let result = if fails {
            Err(BackendError::Stop { id: self.id.clone(), source: failure("stop") })
        } else {
            let mut state = self.fake.state();
            let own = self.status.borrow().figures.pid;
            // Not another instance's: restored handles of tests have no recorded pid.
            if state.previous.get(&self.id).is_some_and(|(pid, _)| Some(*pid) == own) {
                state.previous.remove(&self.id);
            } else if state.live_pid.get(&self.id).is_none_or(|live| Some(*live) == own) {
                state.live.remove(&self.id);
                state.live_pid.remove(&self.id);
                // An abandoned overlap: the instance it ran beside is the one that runs.
                if let Some((pid, proxy)) = state.previous.remove(&self.id) {
                    state.live.insert(self.id.clone(), proxy);
                    state.live_pid.insert(self.id.clone(), pid);
                }
            }
            drop(state);
            self.status.send_modify(|s| {
                s.state = BackendState::Stopping;
                s.figures.pid = None;
            });
            Ok(())
        };
        self.fake.leave(&self.id);
        result
    }
}

#[async_trait]
impl ProxyHandle for FakeHandle {
    async fn start(&self) -> Result<(), BackendError> {
        self.start_instance().await
    }

    async fn stop(&self) -> Result<(), BackendError> {
        self.end(Call::Stop).await
    }

    /// Ends the instance as a stop does, told apart in the calls.
    async fn drain(&self) -> Result<(), BackendError> {
        self.end(Call::Drain).await
    }

    async fn detach(&self) {
        self.fake.record(&self.id, Call::Detach);
    }

    /// Applied at once when the proxy has a reload table. Not an operation that excludes
    /// the others: a reload may run beside them.
    async fn reload(&self) -> Option<ReloadOutcome> {
        self.fake.record(&self.id, Call::Reload);
        let proxy = self.proxy.lock().unwrap().clone();
        proxy?.spec().reload.as_ref()?;
        Some(ReloadOutcome::now(ReloadResult::Applied, None))
    }

    async fn update(&self, proxy: Arc<ManagedProxy>) -> Result<(), BackendError> {
        let (fails, delay) = self.fake.enter(&self.id);
        self.fake.record(&self.id, Call::Update);
        tokio::time::sleep(delay).await;
        let result = if fails {
            Err(BackendError::Update { id: self.id.clone(), source: failure("update") })
        } else {
            self.fake.state().live.insert(self.id.clone(), proxy.clone());
            *self.proxy.lock().unwrap() = Some(proxy);
            Ok(())
        };
        self.fake.leave(&self.id);
        result
    }

    fn status(&self) -> watch::Receiver<BackendStatus> {
        self.status.subscribe()
    }

    fn adopted(&self) -> Adopted {
        self.adopted
    }

    fn record(&self) -> BackendRecord {
        let pid = self.status.borrow().figures.pid;
        BackendRecord::new(&FakeRecord { proof: self.id.as_str().to_owned(), pid }).expect("a fake record encodes")
    }
}

#[async_trait]
impl ProxyBackend for Arc<Fake> {
    fn create(&self, proxy: Arc<ManagedProxy>) -> Box<dyn ProxyHandle> {
        Box::new(self.handle(proxy.id().clone(), Some(proxy), None))
    }

    async fn restore(
        &self,
        id: ProxyId,
        record: BackendRecord,
        _desired: Option<Arc<ManagedProxy>>,
    ) -> Option<Box<dyn ProxyHandle>> {
        self.record(&id, Call::Restore);
        let record = record.parse::<FakeRecord>().ok()?;
        let state = self.state();
        let proven = record.proof == id.as_str() && state.live.contains_key(&id) && !state.unprovable.contains(&id);
        let pid = record.pid;
        drop(state);
        proven.then(|| Box::new(self.handle(id, None, pid)) as Box<dyn ProxyHandle>)
    }

    async fn adoption_candidates(&self) -> Vec<(ProxyId, BackendRecord)> {
        let ids = self.state().candidates.clone();
        ids.into_iter()
            .map(|id| {
                let record = FakeRecord { proof: id.as_str().to_owned(), pid: Some(1) };
                (id, BackendRecord::new(&record).expect("a fake record encodes"))
            })
            .collect()
    }
}

/// What the fake records of a proxy: its id as the proof, and its pid.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct FakeRecord {
    pub(super) proof: String,
    pub(super) pid: Option<u32>,
}
