//! A mock's unmet expectation fails the test that made it, whichever way the engine ends:
//! written as a crate that uses the engine would, through its public API and mocks only.

use std::sync::Arc;
use std::time::Duration;

use tether_manager::tether_state::{LocalState, ProxyId, ProxySpec, Service, ServiceId, ServiceName, Source};
use tether_manager::{
    BackendRecord, BackendState, BackendStatus, CancellationToken, Manager, ManagerConfig, MemorySnapshotStore,
    MockProxyBackend, MockProxyHandle, ProcessFigures, watch,
};

const LIMIT: Duration = Duration::from_secs(30);

/// A catalog with one service, `web`, with a proxy.
fn catalog() -> Arc<LocalState> {
    let catalog = LocalState::new();
    let web = Service::new(ServiceId::new("web").unwrap(), ServiceName::new("web").unwrap());
    catalog.upsert(web.with_proxy(ProxySpec::default()), Source::Api).unwrap();
    Arc::new(catalog)
}

/// A backend whose one handle is `handle`.
fn backend(handle: MockProxyHandle) -> MockProxyBackend {
    let mut handle = Some(handle);
    let mut backend = MockProxyBackend::new();
    backend.expect_adoption_candidates().returning(Vec::new);
    backend.expect_restored().return_const(());
    backend.expect_create().returning(move |_| Box::new(handle.take().expect("one proxy, created once")));
    backend
}

/// A handle that starts and runs as pid 42; `detach` and `stop` are the test's to expect.
fn running_handle() -> MockProxyHandle {
    let (status, running) = watch::channel(BackendStatus {
        state: BackendState::Running,
        figures: ProcessFigures { pid: Some(42), ..ProcessFigures::default() },
        ..Default::default()
    });
    // Kept alive with the handle, so that the status never closes.
    let status = Arc::new(status);
    let mut handle = MockProxyHandle::new();
    handle.expect_on_status_change().returning(|_| false);
    handle.expect_start().returning(|| Ok(()));
    handle.expect_status().returning(move || {
        let _keep = &status;
        running.clone()
    });
    handle.expect_record().returning(BackendRecord::none);
    handle
}

/// Runs the engine until `web-proxy` runs as pid 42, and gives it back.
async fn run_until_running(backend: MockProxyBackend) -> Manager {
    let mut manager =
        Manager::new(catalog(), Arc::new(backend), Arc::new(MemorySnapshotStore::new()), ManagerConfig::default());
    let view = manager.handle();
    let mut events = view.subscribe();
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    let watcher = tokio::spawn(async move {
        let web = ProxyId::parse("web-proxy").unwrap();
        while view.proxy(&web).is_none_or(|status| status.figures.pid != Some(42)) {
            if events.recv().await.is_err() {
                return;
            }
        }
        stop.cancel();
    });
    tokio::time::timeout(LIMIT, manager.run(shutdown)).await.expect("the proxy runs");
    watcher.await.unwrap();
    manager
}

/// The message of the panic that `task` ended with.
async fn panic_of(task: tokio::task::JoinHandle<()>) -> String {
    let ended = tokio::time::timeout(LIMIT, task).await.expect("the task ends, rather than hangs");
    let panic = ended.expect_err("the task panicked").into_panic();
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

#[tokio::test]
async fn an_unmet_expectation_in_an_action_fails_run() {
    // The handle expects no `start`: the engine's start action calls it, and the mock panics.
    let backend = backend(MockProxyHandle::new());
    let manager =
        Manager::new(catalog(), Arc::new(backend), Arc::new(MemorySnapshotStore::new()), ManagerConfig::default());
    let task = tokio::spawn(async move {
        let mut manager = manager;
        manager.run(CancellationToken::new()).await;
    });
    let message = panic_of(task).await;
    assert!(message.contains("No matching expectation found"), "{message}");
}

#[tokio::test]
async fn an_unmet_expectation_in_a_detach_fails_close() {
    // `detach` is not expected: `close` calls it for the running proxy.
    let manager = run_until_running(backend(running_handle())).await;
    let task = tokio::spawn(async move {
        let _ = manager.close().await;
    });
    let message = panic_of(task).await;
    assert!(message.contains("No matching expectation found"), "{message}");
}

#[tokio::test]
async fn an_unmet_expectation_in_a_stop_fails_kill() {
    // `stop` is not expected: `kill` calls it for the running proxy.
    let manager = run_until_running(backend(running_handle())).await;
    let task = tokio::spawn(async move {
        let _ = manager.kill().await;
    });
    let message = panic_of(task).await;
    assert!(message.contains("No matching expectation found"), "{message}");
}

#[tokio::test]
async fn with_every_expectation_met_close_and_kill_succeed() {
    let mut handle = running_handle();
    handle.expect_detach().times(1).return_const(());
    let manager = run_until_running(backend(handle)).await;
    tokio::time::timeout(LIMIT, manager.close()).await.unwrap().unwrap();

    let mut handle = running_handle();
    handle.expect_stop().times(1).returning(|| Ok(()));
    let manager = run_until_running(backend(handle)).await;
    tokio::time::timeout(LIMIT, manager.kill()).await.unwrap().unwrap();
}
