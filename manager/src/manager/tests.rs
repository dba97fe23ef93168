//! Tests of the engine: a fake backend and mocks under a paused clock, driving real catalogs.

use std::collections::BTreeMap;
use std::time::Duration;

use tether_state::{LocalState, ProcessFigures, ProxySpec, Service, ServiceId, ServiceName, Source};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::fake::{Call, Fake};
use super::*;
use crate::snapshot::{MemorySnapshotStore, ProxyRecord, Snapshot};
use crate::{BackendRecord, BackendState, BackendStatus, MockProxyBackend, MockProxyHandle, ProxyEvent, RequestError};

const LIMIT: Duration = Duration::from_secs(600);
const QUIESCENT: Duration = Duration::from_millis(500);

fn service(name: &str) -> Service {
    Service::new(ServiceId::new(name).unwrap(), ServiceName::new(name).unwrap()).with_proxy(ProxySpec::default())
}

fn with_user(name: &str) -> Service {
    let mut service = service(name);
    service.proxy.as_mut().unwrap().user = Some("nobody".into());
    service
}

/// A backend record holding `value`.
fn record_of(value: serde_json::Value) -> BackendRecord {
    BackendRecord::new(&value).unwrap()
}

fn pid(name: &str) -> ProxyId {
    ServiceId::new(name).unwrap().proxy_id()
}

fn catalog(services: &[Service]) -> LocalState {
    let state = LocalState::new();
    for service in services {
        state.upsert(service.clone(), Source::Api).unwrap();
    }
    state
}

struct Running {
    state: LocalState,
    fake: Arc<Fake>,
    store: Arc<MemorySnapshotStore>,
    handle: ManagerHandle,
    shutdown: CancellationToken,
    task: JoinHandle<Manager>,
}

/// Runs `manager` in a task until the returned token is cancelled; the task gives it back.
fn spawn_run(mut manager: Manager) -> (CancellationToken, JoinHandle<Manager>) {
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    let task = tokio::spawn(async move {
        manager.run(token).await;
        manager
    });
    (shutdown, task)
}

fn run_with(state: &LocalState, fake: &Arc<Fake>, store: &Arc<MemorySnapshotStore>, config: ManagerConfig) -> Running {
    let manager = Manager::new(Arc::new(state.clone()), Arc::new(fake.clone()), store.clone(), config);
    let handle = manager.handle();
    let (shutdown, task) = spawn_run(manager);
    Running { state: state.clone(), fake: fake.clone(), store: store.clone(), handle, shutdown, task }
}

fn run(services: &[Service]) -> Running {
    run_with(&catalog(services), &Fake::new(), &Arc::new(MemorySnapshotStore::new()), ManagerConfig::default())
}

impl Running {
    async fn stop(self) -> Manager {
        self.shutdown.cancel();
        tokio::time::timeout(LIMIT, self.task).await.expect("run ends once cancelled").expect("run does not panic")
    }

    /// Waits until `id` runs the definition of catalog revision `revision`.
    async fn until_applied(&self, id: &ProxyId, revision: Revision) {
        let mut events = self.handle.subscribe();
        let applied = tokio::time::timeout(LIMIT, async {
            while self.handle.proxy(id).and_then(|s| s.applied_revision) != Some(revision) {
                let _ = events.recv().await;
            }
        })
        .await;
        assert!(applied.is_ok(), "{id} never ran revision {revision}: {:?}", self.handle.proxy(id));
    }

    /// Waits until `id` shows `state`.
    async fn until_state(&self, id: &ProxyId, state: ProxyState) -> ProxyStatus {
        let mut events = self.handle.subscribe();
        let result = tokio::time::timeout(LIMIT, async {
            loop {
                if let Some(status) = self.handle.proxy(id).filter(|s| s.state == state) {
                    return status;
                }
                let _ = events.recv().await;
            }
        })
        .await;
        result.unwrap_or_else(|_| panic!("{id} never became {state}: {:?}", self.handle.proxy(id)))
    }

    async fn until_gone(&self, id: &ProxyId) {
        let mut events = self.handle.subscribe();
        let gone = tokio::time::timeout(LIMIT, async {
            while self.handle.proxy(id).is_some() {
                let _ = events.recv().await;
            }
        })
        .await;
        assert!(gone.is_ok(), "{id} never left the list: {:?}", self.handle.proxy(id));
    }
}

#[tokio::test(start_paused = true)]
async fn initial_sync_starts_every_wanted_proxy_at_once() {
    let t0 = Instant::now();
    let running = run(&[service("web"), service("db")]);
    let starts = running.fake.wait_calls(Call::Start, 2).await;
    assert!(starts.iter().all(|(at, _)| *at == t0), "the first sync is not coalesced: {starts:?}");
    running.until_state(&pid("web"), ProxyState::Running).await;
    let db = running.until_state(&pid("db"), ProxyState::Running).await;
    assert_eq!(db.service.as_str(), "db");
    assert!(db.figures.pid.is_some());
    assert_eq!(running.fake.live_ids(), ["db-proxy", "web-proxy"]);
    assert_eq!(running.handle.stats().passes, 1);
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn the_first_change_after_a_quiet_period_is_synced_at_once() {
    let running = run(&[]);
    tokio::time::sleep(QUIESCENT).await;
    let t0 = Instant::now();
    running.state.upsert(service("web"), Source::Api).unwrap();
    let starts = running.fake.wait_calls(Call::Start, 1).await;
    assert_eq!(starts[0].0, t0, "an idle engine does not wait");
    running.until_state(&pid("web"), ProxyState::Running).await;
    running.stop().await;
}

/// `web` with its port set to `port`: a change applied in place.
fn web_on(port: u16) -> Service {
    let mut web = service("web");
    web.port = Some(port);
    web
}

#[tokio::test(start_paused = true)]
async fn a_change_soon_after_another_of_the_same_proxy_waits_for_a_quiet_window() {
    let running = run(&[]);
    tokio::time::sleep(QUIESCENT).await;
    let t0 = Instant::now();
    running.state.upsert(web_on(1), Source::Api).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    running.state.upsert(web_on(2), Source::Api).unwrap();
    tokio::time::sleep(Duration::from_millis(399)).await;
    let t1 = Instant::now();
    running.state.upsert(web_on(3), Source::Api).unwrap();
    let starts = running.fake.wait_calls(Call::Start, 1).await;
    assert_eq!(starts[0], (t0, pid("web")), "the first change at once");
    assert_eq!(running.handle.stats().deferred, 1, "the rest of the burst is held");
    // The rest of the burst, once: when the proxy has been quiet for the window.
    let updates = running.fake.wait_calls(Call::Update, 1).await;
    assert_eq!(updates, [(t1 + QUIESCENT, pid("web"))]);
    let wanted = running.state.get(&ServiceId::new("web").unwrap()).unwrap().revision;
    running.until_applied(&pid("web"), wanted).await;
    assert_eq!(running.fake.state().live[&pid("web")].service().port, Some(3), "the latest change is the one applied");
    assert_eq!(running.fake.calls_of(Call::Update).len(), 1, "the held changes apply as one");
    assert_eq!(running.handle.stats().deferred, 0);
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_proxy_that_keeps_changing_delays_no_other() {
    let running = run(&[]);
    tokio::time::sleep(QUIESCENT).await;
    running.state.upsert(web_on(1), Source::Api).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    running.state.upsert(web_on(2), Source::Api).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // `web` is in a burst; `db` and `cache` are not, and start at once, one after the other.
    let t1 = Instant::now();
    running.state.upsert(service("db"), Source::Api).unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let t2 = Instant::now();
    running.state.upsert(service("cache"), Source::Api).unwrap();
    let starts = running.fake.wait_calls(Call::Start, 3).await;
    assert_eq!(starts[1..], [(t1, pid("db")), (t2, pid("cache"))]);
    assert!(running.fake.calls_of(Call::Update).is_empty(), "web's second change is still held");
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_removal_soon_after_a_change_waits_like_a_change() {
    let running = run(&[]);
    tokio::time::sleep(QUIESCENT).await;
    running.state.upsert(service("web"), Source::Api).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t1 = Instant::now();
    running.state.remove(&ServiceId::new("web").unwrap(), &tether_state::SourceKind::Api).unwrap();
    let stops = running.fake.wait_calls(Call::Stop, 1).await;
    assert_eq!(stops, [(t1 + QUIESCENT, pid("web"))]);
    running.until_gone(&pid("web")).await;
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn an_engine_that_fell_behind_keeps_a_held_change_held_and_applies_the_rest_at_once() {
    let running = run(&[service("db")]);
    running.until_state(&pid("db"), ProxyState::Running).await;
    tokio::time::sleep(QUIESCENT).await;
    running.state.upsert(web_on(1), Source::Api).unwrap();
    running.fake.wait_calls(Call::Start, 2).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let held = Instant::now();
    running.state.upsert(web_on(2), Source::Api).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(running.handle.stats().deferred, 1);
    // More removals than the catalog remembers, before the engine looks again: its next
    // read is the whole desired set.
    for index in 0..1_100 {
        let id = ServiceId::new(format!("n{index}")).unwrap();
        running.state.upsert(Service::new(id, ServiceName::new("n").unwrap()), Source::Api).unwrap();
    }
    for index in 0..1_100 {
        let id = ServiceId::new(format!("n{index}")).unwrap();
        running.state.remove(&id, &tether_state::SourceKind::Api).unwrap();
    }
    let gone = Instant::now();
    running.state.remove(&ServiceId::new("db").unwrap(), &tether_state::SourceKind::Api).unwrap();
    // db had been quiet: its removal applies at once. web's change stays held until web
    // has been quiet for the window.
    assert_eq!(running.fake.wait_calls(Call::Stop, 1).await, [(gone, pid("db"))]);
    assert_eq!(running.fake.wait_calls(Call::Update, 1).await, [(held + QUIESCENT, pid("web"))]);
    let wanted = running.state.get(&ServiceId::new("web").unwrap()).unwrap().revision;
    running.until_applied(&pid("web"), wanted).await;
    assert_eq!(running.fake.state().live[&pid("web")].service().port, Some(2));
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_stream_of_changes_is_synced_at_most_max_delay_after_its_first_unsynced_change() {
    let running = run(&[]);
    tokio::time::sleep(QUIESCENT).await;
    let t0 = Instant::now();
    // A change every 400ms never leaves 500ms of quiet.
    for port in 0..20u16 {
        let mut web = service("web");
        web.port = Some(port);
        running.state.upsert(web, Source::Api).unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
        if !running.fake.calls_of(Call::Update).is_empty() {
            break;
        }
    }
    let starts = running.fake.wait_calls(Call::Start, 1).await;
    assert_eq!(starts[0].0, t0, "the first change at once");
    let updates = running.fake.wait_calls(Call::Update, 1).await;
    assert_eq!(updates[0].0 - t0, Duration::from_millis(400) + Duration::from_secs(5));
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn coalescing_windows_are_configurable() {
    let config = ManagerConfig { sync_quiescent: Duration::from_millis(20), ..ManagerConfig::default() };
    let running = run_with(&catalog(&[]), &Fake::new(), &Arc::new(MemorySnapshotStore::new()), config);
    tokio::time::sleep(Duration::from_millis(20)).await;
    running.state.upsert(web_on(1), Source::Api).unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let t1 = Instant::now();
    running.state.upsert(web_on(2), Source::Api).unwrap();
    let updates = running.fake.wait_calls(Call::Update, 1).await;
    assert_eq!(updates, [(t1 + Duration::from_millis(20), pid("web"))]);
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn removed_service_is_stopped_and_leaves_the_list() {
    let running = run(&[service("web"), service("db")]);
    running.until_state(&pid("web"), ProxyState::Running).await;
    let mut events = running.handle.subscribe();
    running.state.remove(&ServiceId::new("web").unwrap(), &tether_state::SourceKind::Api).unwrap();
    running.until_gone(&pid("web")).await;
    assert_eq!(running.fake.calls_of(Call::Stop).len(), 1);
    assert_eq!(running.fake.live_ids(), ["db-proxy"]);
    let mut seen = Vec::new();
    while let Ok(event) = events.try_recv() {
        seen.push(event);
    }
    assert!(seen.iter().any(|e| matches!(e, ProxyEvent::Changed(s) if s.state == ProxyState::Stopping)), "{seen:?}");
    assert_eq!(seen.last(), Some(&ProxyEvent::Removed(pid("web"))));
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn restart_relevant_change_stops_then_starts() {
    let running = run(&[service("web")]);
    let first = running.until_state(&pid("web"), ProxyState::Running).await;
    let mut web = service("web");
    web.proxy.as_mut().unwrap().env.insert("LOG_LEVEL".into(), "debug".into());
    running.state.upsert(web, Source::Api).unwrap();
    let starts = running.fake.wait_calls(Call::Start, 2).await;
    let stops = running.fake.calls_of(Call::Stop);
    assert_eq!(stops.len(), 1);
    assert!(stops[0].0 <= starts[1].0);
    let second = running.until_state(&pid("web"), ProxyState::Running).await;
    assert_ne!(first.figures.pid, second.figures.pid);
    assert_eq!(running.fake.state().live[&pid("web")].spec().env["LOG_LEVEL"], "debug");
    assert!(running.fake.calls_of(Call::Update).is_empty());
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn the_applied_revision_is_the_definition_the_instance_runs() {
    let running = run(&[service("web")]);
    let first = running.until_state(&pid("web"), ProxyState::Running).await;
    let started = running.state.get(&ServiceId::new("web").unwrap()).unwrap().revision;
    assert_eq!(first.applied_revision, Some(started));

    // A change that touches nothing of the proxy is applied at once, without an action.
    let mut tagged = service("web");
    tagged.tags = vec!["blue".into()];
    let tags_revision = running.state.upsert(tagged.clone(), Source::Api).unwrap();
    let mut events = running.handle.subscribe();
    while running.handle.proxy(&pid("web")).and_then(|s| s.applied_revision) != Some(tags_revision) {
        tokio::time::timeout(LIMIT, events.recv()).await.expect("the tags' revision is applied").unwrap();
    }
    assert_eq!(running.fake.calls_of(Call::Start).len(), 1);

    // A restart: the new instance applies the new revision once it runs.
    tagged.proxy.as_mut().unwrap().env.insert("LOG_LEVEL".into(), "debug".into());
    let restart_revision = running.state.upsert(tagged, Source::Api).unwrap();
    running.fake.wait_calls(Call::Start, 2).await;
    let second = running.until_state(&pid("web"), ProxyState::Running).await;
    assert_ne!(first.figures.pid, second.figures.pid);
    assert_eq!(second.applied_revision, Some(restart_revision));
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn in_place_change_is_applied_without_a_restart() {
    let running = run(&[service("web")]);
    running.until_state(&pid("web"), ProxyState::Running).await;
    let mut web = service("web");
    web.port = Some(9090);
    running.state.upsert(web, Source::Api).unwrap();
    running.fake.wait_calls(Call::Update, 1).await;
    assert_eq!(running.fake.calls_of(Call::Start).len(), 1);
    assert!(running.fake.calls_of(Call::Stop).is_empty());
    assert_eq!(running.fake.state().live[&pid("web")].service().port, Some(9090));
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_slow_stop_delays_no_other_action() {
    let running = run(&[service("slow")]);
    running.until_state(&pid("slow"), ProxyState::Running).await;
    running.fake.state().stop_delay.insert(pid("slow"), Duration::from_secs(5));
    let t0 = Instant::now();
    running.state.remove(&ServiceId::new("slow").unwrap(), &tether_state::SourceKind::Api).unwrap();
    running.state.upsert(service("fast"), Source::Api).unwrap();
    let starts = running.fake.wait_calls(Call::Start, 2).await;
    // Both changes came before the engine looked, after a quiet period: one sync, at once.
    assert_eq!(starts[1], (t0, pid("fast")));
    let fast = running.until_state(&pid("fast"), ProxyState::Running).await;
    assert_eq!(fast.state, ProxyState::Running);
    assert_eq!(running.handle.proxy(&pid("slow")).map(|s| s.state), Some(ProxyState::Stopping));
    running.until_gone(&pid("slow")).await;
    assert_eq!(Instant::now() - t0, Duration::from_secs(5));
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn actions_beyond_the_bound_wait_for_a_free_slot() {
    let config = ManagerConfig { max_concurrent_actions: 2, ..ManagerConfig::default() };
    let fake = Fake::new();
    fake.state().script.extend([(false, 100); 5]);
    let names = ["a", "b", "c", "d", "e"].map(service);
    let running = run_with(&catalog(&names), &fake, &Arc::new(MemorySnapshotStore::new()), config);
    let starts = fake.wait_calls(Call::Start, 5).await;
    let mut times: Vec<Duration> = starts.iter().map(|(at, _)| at.duration_since(starts[0].0)).collect();
    times.sort();
    assert_eq!(times, [0, 0, 100, 100, 200].map(Duration::from_millis));
    for name in ["a", "b", "c", "d", "e"] {
        running.until_state(&pid(name), ProxyState::Running).await;
    }
    running.stop().await;
}

fn mock_handle(start: Result<(), ()>) -> MockProxyHandle {
    let mut handle = MockProxyHandle::new();
    handle.expect_on_status_change().returning(|_| false);
    let (status, receiver) = watch::channel(BackendStatus {
        state: BackendState::Running,
        figures: ProcessFigures { pid: Some(7), ..ProcessFigures::default() },
        ..Default::default()
    });
    let status = Arc::new(status);
    handle.expect_start().times(1).returning(move || match start {
        Ok(()) => Ok(()),
        Err(()) => Err(BackendError::Start { id: pid("web"), source: "exec failed: no such file".into() }),
    });
    handle.expect_status().returning(move || {
        let _keep_sender = &status;
        receiver.clone()
    });
    handle.expect_record().returning(|| record_of(serde_json::json!({ "pid": 7 })));
    handle.expect_detach().returning(|| ());
    handle
}

/// A manager whose backend fails the first start of web-proxy and runs the second, on a
/// catalog where web-proxy's restart policy starts backing off at once (1 s, 2 s, ...).
fn failing_once() -> (Manager, LocalState) {
    let mut backend = MockProxyBackend::new();
    let mut sequence = mockall::Sequence::new();
    backend.expect_create().times(1).in_sequence(&mut sequence).returning(|_| Box::new(mock_handle(Err(()))));
    backend.expect_create().times(1).in_sequence(&mut sequence).returning(|_| Box::new(mock_handle(Ok(()))));
    backend.expect_adoption_candidates().returning(Vec::new);
    backend.expect_restored().times(1).return_const(());
    let mut web = service("web");
    web.proxy.as_mut().unwrap().restart.free_attempts = 0;
    let state = catalog(&[web]);
    let store = Arc::new(MemorySnapshotStore::new());
    let manager = Manager::new(Arc::new(state.clone()), Arc::new(backend), store, ManagerConfig::default());
    (manager, state)
}

async fn next_in_state(events: &mut tokio::sync::broadcast::Receiver<ProxyEvent>, state: ProxyState) -> ProxyStatus {
    tokio::time::timeout(LIMIT, async {
        loop {
            if let Ok(ProxyEvent::Changed(status)) = events.recv().await {
                if status.state == state {
                    return status;
                }
            }
        }
    })
    .await
    .unwrap()
}

#[tokio::test(start_paused = true)]
async fn failed_start_leaves_the_proxy_failed_and_it_is_retried_on_the_backoff() {
    let (manager, _state) = failing_once();
    let handle = manager.handle();
    let (shutdown, task) = spawn_run(manager);
    let mut events = handle.subscribe();
    let failed = next_in_state(&mut events, ProxyState::Failed).await;
    let failed_at = Instant::now();
    assert_eq!(failed.figures.error.as_deref(), Some("cannot start proxy web-proxy: exec failed: no such file"));
    assert_eq!(handle.stats().failures, 1);
    // No change is made: the start is tried again after the first backoff step, 1 s.
    let running = next_in_state(&mut events, ProxyState::Running).await;
    assert_eq!((running.figures.pid, running.figures.error), (Some(7), None));
    let waited = failed_at.elapsed();
    assert!(waited >= Duration::from_secs(1) && waited < Duration::from_millis(1100), "{waited:?}");
    let stats = handle.stats();
    assert_eq!(stats.actions_by_kind.get(&(crate::ActionKind::Start, false)), Some(&1));
    assert_eq!(stats.actions_by_kind.get(&(crate::ActionKind::Start, true)), Some(&1));
    shutdown.cancel();
    let manager = tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_change_retries_a_failed_start_at_once() {
    let (manager, state) = failing_once();
    let handle = manager.handle();
    let (shutdown, task) = spawn_run(manager);
    let mut events = handle.subscribe();
    next_in_state(&mut events, ProxyState::Failed).await;
    let changed_at = Instant::now();
    let mut web = service("web");
    web.proxy.as_mut().unwrap().restart.free_attempts = 0;
    web.port = Some(1);
    state.upsert(web, Source::Api).unwrap();
    let running = next_in_state(&mut events, ProxyState::Running).await;
    assert_eq!((running.figures.pid, running.figures.error), (Some(7), None));
    // After the quiescent period (500 ms), not after the backoff (1 s).
    let waited = changed_at.elapsed();
    assert!(waited < Duration::from_secs(1), "{waited:?}");
    let stats = handle.stats();
    assert!(stats.pass_buckets.iter().sum::<u64>() == stats.passes && stats.passes >= 2, "{stats:?}");
    shutdown.cancel();
    let manager = tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn proxy_without_user_is_blocked_when_running_as_root() {
    let config = ManagerConfig { running_as_root: true, ..ManagerConfig::default() };
    let state = catalog(&[service("web"), with_user("db")]);
    let running = run_with(&state, &Fake::new(), &Arc::new(MemorySnapshotStore::new()), config.clone());
    let web = running.until_state(&pid("web"), ProxyState::Blocked).await;
    assert!(web.figures.error.as_deref().is_some_and(|e| e.contains("root")), "{web:?}");
    running.until_state(&pid("db"), ProxyState::Running).await;
    assert_eq!(running.fake.live_ids(), ["db-proxy"]);
    // Giving it a user lifts the block.
    state.upsert(with_user("web"), Source::Api).unwrap();
    running.until_state(&pid("web"), ProxyState::Running).await;
    running.stop().await;

    let allowed = ManagerConfig { allow_root: true, ..config };
    let running = run_with(&catalog(&[service("web")]), &Fake::new(), &Arc::new(MemorySnapshotStore::new()), allowed);
    running.until_state(&pid("web"), ProxyState::Running).await;
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn proxy_whose_user_is_uid_0_is_blocked_and_its_user_is_looked_up_again_when_it_changes() {
    let uids = Arc::new(std::sync::Mutex::new(HashMap::from([("toor", 0), ("svc", 1000)])));
    let users = {
        let uids = uids.clone();
        UserLookup::new(move |user| uids.lock().unwrap().get(user).copied())
    };
    let run_as = |name: &str, user: &str| {
        let mut service = service(name);
        service.proxy.as_mut().unwrap().user = Some(user.into());
        service
    };
    let config = ManagerConfig { running_as_root: true, users, ..ManagerConfig::default() };
    let state = catalog(&[run_as("web", "toor"), run_as("db", "svc")]);
    let running = run_with(&state, &Fake::new(), &Arc::new(MemorySnapshotStore::new()), config.clone());
    let web = running.until_state(&pid("web"), ProxyState::Blocked).await;
    let error = web.figures.error.unwrap_or_default();
    assert!(error.contains("`user` \"toor\" is uid 0") && error.contains("--allow-root"), "{error}");
    running.until_state(&pid("db"), ProxyState::Running).await;
    assert_eq!(running.fake.live_ids(), ["db-proxy"]);

    // svc becomes uid 0: nothing is asked until db changes; then it is stopped and blocked.
    uids.lock().unwrap().insert("svc", 0);
    let mut moved = run_as("db", "svc");
    moved.port = Some(1);
    state.upsert(moved, Source::Api).unwrap();
    let db = running.until_state(&pid("db"), ProxyState::Blocked).await;
    assert!(db.figures.error.as_deref().is_some_and(|e| e.contains("\"svc\" is uid 0")), "{db:?}");
    // toor is given up, and web runs as a user that does not resolve: its start, not the
    // policy, has the last word.
    state.upsert(run_as("web", "ghost"), Source::Api).unwrap();
    running.until_state(&pid("web"), ProxyState::Running).await;
    assert_eq!(running.fake.live_ids(), ["web-proxy"]);
    running.stop().await;

    let allowed = ManagerConfig { allow_root: true, ..config };
    let running =
        run_with(&catalog(&[run_as("web", "toor")]), &Fake::new(), &Arc::new(MemorySnapshotStore::new()), allowed);
    running.until_state(&pid("web"), ProxyState::Running).await;
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_dropped_run_future_leaves_its_actions_to_finish() {
    let state = catalog(&[service("web")]);
    let fake = Fake::new();
    fake.state().script.push_back((false, 1000));
    let mut manager = Manager::new(
        Arc::new(state),
        Arc::new(fake.clone()),
        Arc::new(MemorySnapshotStore::new()),
        ManagerConfig::default(),
    );
    let handle = manager.handle();
    // Cancel the run future while the start is in flight.
    let interrupted = tokio::time::timeout(Duration::from_millis(10), manager.run(CancellationToken::new())).await;
    assert!(interrupted.is_err());
    assert_eq!(handle.proxy(&pid("web")).unwrap().state, ProxyState::Starting);
    tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();
    assert_eq!(fake.live_ids(), ["web-proxy"]);
    assert_eq!(fake.calls_of(Call::Detach).len(), 1, "the finished start was applied, then detached");
    assert_eq!(handle.proxy(&pid("web")).unwrap().state, ProxyState::Running);
}

mod property {
    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        /// Upsert service `index` in shape `variant` (0 and 1 differ in place, 2 by env, 3 by user).
        Upsert {
            index: usize,
            variant: u8,
        },
        Remove {
            index: usize,
        },
        Wait {
            ms: u64,
        },
    }

    const NAMES: [&str; 4] = ["a", "b", "c", "d"];

    fn shaped(index: usize, variant: u8) -> Service {
        let mut service = service(NAMES[index]);
        let spec = service.proxy.as_mut().unwrap();
        match variant {
            0 => {}
            1 => service.port = Some(1000),
            2 => drop(spec.env.insert("MODE".into(), "b".into())),
            _ => spec.user = Some("nobody".into()),
        }
        service
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..NAMES.len(), 0..4u8).prop_map(|(index, variant)| Op::Upsert { index, variant }),
            (0..NAMES.len()).prop_map(|index| Op::Remove { index }),
            (0..1500u64).prop_map(|ms| Op::Wait { ms }),
        ]
    }

    async fn scenario(ops: Vec<Op>, outcomes: Vec<(bool, u64)>, bound: usize) {
        let config = ManagerConfig { max_concurrent_actions: bound, ..ManagerConfig::default() };
        let fake = Fake::new();
        fake.state().script.extend(outcomes);
        let state = LocalState::new();
        let running = run_with(&state, &fake, &Arc::new(MemorySnapshotStore::new()), config);
        let mut shapes: BTreeMap<usize, Service> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Upsert { index, variant } => {
                    let service = shaped(index, variant);
                    state.upsert(service.clone(), Source::Api).unwrap();
                    shapes.insert(index, service);
                }
                Op::Remove { index } => {
                    if shapes.remove(&index).is_some() {
                        state.remove(&ServiceId::new(NAMES[index]).unwrap(), &tether_state::SourceKind::Api).unwrap();
                    }
                }
                Op::Wait { ms } => tokio::time::sleep(Duration::from_millis(ms)).await,
            }
        }
        // Settle: the backend stops failing, and every wanted proxy gets a change, which
        // retries the failed ones.
        fake.state().script.clear();
        for service in shapes.values_mut() {
            service.tags.push("touched".into());
            state.upsert(service.clone(), Source::Api).unwrap();
        }
        let wanted: BTreeMap<ProxyId, Arc<ManagedProxy>> =
            state.changes_since(None).upserted.into_iter().map(|d| (d.proxy.id().clone(), d.proxy)).collect();
        let settled = tokio::time::timeout(LIMIT, async {
            loop {
                let live = fake.state().live.clone();
                let failed: Vec<ProxyId> = running
                    .handle
                    .status()
                    .into_iter()
                    .filter(|s| s.state == ProxyState::Failed && !wanted.contains_key(&s.id))
                    .map(|s| s.id)
                    .collect();
                let live_wanted: BTreeMap<_, _> =
                    live.iter().filter(|(id, _)| !failed.contains(id)).map(|(k, v)| (k.clone(), v.clone())).collect();
                let matches = live_wanted.len() == wanted.len()
                    && wanted.iter().all(|(id, proxy)| {
                        live_wanted
                            .get(id)
                            .is_some_and(|run| run.change_to(proxy) == tether_state::ProxyChange::Unchanged)
                    });
                let shown = running.handle.status();
                let all_running =
                    wanted.keys().all(|id| shown.iter().any(|s| &s.id == id && s.state == ProxyState::Running));
                let only_known = shown.iter().all(|s| wanted.contains_key(&s.id) || failed.contains(&s.id));
                if matches && all_running && only_known && running.handle.stats().in_flight == 0 {
                    return;
                }
                // Polling a condition until a deadline, in paused time.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        let live = fake.live_ids();
        assert!(
            settled.is_ok(),
            "never settled: wanted {:?}, live {live:?}, shown {:?}",
            wanted.keys(),
            running.handle.status()
        );
        {
            let fake_state = fake.state();
            assert!(fake_state.overlaps.is_empty(), "two actions at once on {:?}", fake_state.overlaps);
            assert!(fake_state.ran_twice.is_empty(), "ran twice: {:?}", fake_state.ran_twice);
        }
        let manager = running.stop().await;
        tokio::time::timeout(LIMIT, manager.kill()).await.unwrap().unwrap();
        // Every proxy ever started was stopped by the end (or was in the final set, which
        // `kill` then stopped).
        assert!(fake.live_ids().is_empty(), "left running: {:?}", fake.live_ids());
        assert!(fake.state().overlaps.is_empty());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        #[test]
        fn after_settling_what_runs_is_what_is_wanted(
            ops in proptest::collection::vec(op(), 1..30),
            outcomes in proptest::collection::vec((proptest::bool::weighted(0.3), 0..2000u64), 0..40),
            bound in 1..4usize,
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
            runtime.block_on(scenario(ops, outcomes, bound));
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_mock_expectation_that_fails_in_an_action_fails_the_run_instead_of_hanging_it() {
    let mut backend = MockProxyBackend::new();
    // The handle expects no `start`: the action's call panics inside its task.
    backend.expect_create().returning(|_| Box::new(MockProxyHandle::new()));
    backend.expect_adoption_candidates().returning(Vec::new);
    backend.expect_restored().times(1).return_const(());
    let state = catalog(&[service("web")]);
    let store = Arc::new(MemorySnapshotStore::new());
    let manager = Manager::new(Arc::new(state), Arc::new(backend), store, ManagerConfig::default());
    let (_shutdown, task) = spawn_run(manager);
    let ended = tokio::time::timeout(LIMIT, task).await.expect("the run ends");
    let panic = ended.expect_err("the run panicked").into_panic();
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("No matching expectation found"), "{message}");
}

#[tokio::test(start_paused = true)]
async fn a_restart_asked_through_the_handle_stops_and_starts_and_keeps_the_count() {
    let running = run(&[service("web"), with_user("db")]);
    let before = running.until_state(&pid("web"), ProxyState::Running).await;
    tokio::time::timeout(LIMIT, running.handle.restart(&pid("web"))).await.unwrap().unwrap();
    let after = running.handle.proxy(&pid("web")).unwrap();
    assert_eq!(after.state, ProxyState::Running);
    assert_ne!(after.figures.pid, before.figures.pid, "a new process");
    assert_eq!(after.figures.restarts, before.figures.restarts);
    assert_eq!(running.fake.calls_of(Call::Stop).len(), 1);
    assert_eq!(running.fake.calls_of(Call::Start).len(), 3);

    let unknown = ServiceId::new("nothing").unwrap().proxy_id();
    let refused = running.handle.restart(&unknown).await;
    assert_eq!(refused, Err(RequestError::NotFound(unknown)));
    let manager = running.stop().await;
    tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_reload_asked_through_the_handle_reaches_only_a_running_proxy_with_a_reload_table() {
    use tether_state::{KillSignal, ReloadAction, ReloadPolicy, ReloadResult};
    let mut web = service("web");
    web.proxy.as_mut().unwrap().reload = Some(Box::new(ReloadPolicy::new(ReloadAction::Signal(KillSignal::Hup))));
    let running = run(&[web, service("db")]);
    let before = running.until_state(&pid("web"), ProxyState::Running).await;
    running.until_state(&pid("db"), ProxyState::Running).await;
    let outcome = tokio::time::timeout(LIMIT, running.handle.reload(&pid("web"))).await.unwrap().unwrap();
    assert_eq!((outcome.result, outcome.error), (ReloadResult::Applied, None));
    assert_eq!(running.fake.calls_of(Call::Reload).len(), 1);
    assert_eq!(running.fake.calls_of(Call::Start).len(), 2, "a reload starts nothing");
    assert_eq!(running.handle.proxy(&pid("web")).unwrap().figures.pid, before.figures.pid);

    assert_eq!(running.handle.reload(&pid("db")).await, Err(RequestError::NoReload(pid("db"))));
    let unknown = ServiceId::new("nothing").unwrap().proxy_id();
    assert_eq!(running.handle.reload(&unknown).await, Err(RequestError::NotFound(unknown)));
    running.handle.hold(&pid("web"), true).await.unwrap();
    running.until_state(&pid("web"), ProxyState::Stopped).await;
    let refused = running.handle.reload(&pid("web")).await;
    assert_eq!(refused, Err(RequestError::NotRunning { id: pid("web"), state: ProxyState::Stopped }));
    assert_eq!(running.fake.calls_of(Call::Reload).len(), 1, "only a running proxy's handle is asked");
    let manager = running.stop().await;
    tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_held_proxy_is_stopped_stays_stopped_through_changes_and_starts_when_released() {
    let running = run(&[service("web")]);
    running.until_state(&pid("web"), ProxyState::Running).await;
    running.handle.hold(&pid("web"), true).await.unwrap();
    let stopped = running.until_state(&pid("web"), ProxyState::Stopped).await;
    assert_eq!(stopped.figures.pid, None);
    assert_eq!(running.fake.calls_of(Call::Stop).len(), 1);
    // A change to the service does not start it.
    let mut web = service("web");
    web.port = Some(9);
    running.state.upsert(web, Source::Api).unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(running.handle.proxy(&pid("web")).unwrap().state, ProxyState::Stopped);
    assert_eq!(running.fake.calls_of(Call::Start).len(), 1);
    let refused = running.handle.restart(&pid("web")).await;
    assert!(matches!(refused, Err(RequestError::Blocked { .. })), "{refused:?}");

    running.handle.hold(&pid("web"), false).await.unwrap();
    running.until_state(&pid("web"), ProxyState::Running).await;
    assert_eq!(running.fake.calls_of(Call::Start).len(), 2);
    let unknown = ServiceId::new("nothing").unwrap().proxy_id();
    assert_eq!(running.handle.hold(&unknown, true).await, Err(RequestError::NotFound(unknown)));
    let manager = running.stop().await;
    tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_proxy_held_when_the_engine_starts_is_not_started() {
    let config = ManagerConfig { held: [pid("web")].into(), ..ManagerConfig::default() };
    let running = run_with(&catalog(&[service("web")]), &Fake::new(), &Arc::new(MemorySnapshotStore::new()), config);
    running.until_state(&pid("web"), ProxyState::Stopped).await;
    assert!(running.fake.calls_of(Call::Start).is_empty());
    let manager = running.stop().await;
    tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();
}

mod epoch;
mod ordering;
mod overlap;
mod snapshot;
