//! The recording backend of the test kit: starts, exits and restarts on the backoff, failed
//! starts retried, on a paused clock.

use std::time::Duration;

use tether_manager::ProxyState;
use tether_manager::testing::{CallKind, RecordingBackend, RunningManager, wait_for_proxy, wait_until_state};
use tether_manager::tether_state::ExitReason;
use tokio::time::Instant;

use crate::support::{LIMIT, catalog, id, manager, service, with_proxy};

#[tokio::test(start_paused = true)]
async fn a_proxy_that_exits_is_restarted_by_the_backend_on_its_backoff() {
    // No free attempt: the first restart waits 1s, the next one 2s.
    let web = with_proxy(service("web"), |spec| spec.restart.free_attempts = 0);
    let backend = RecordingBackend::new();
    let running = RunningManager::spawn(manager(&catalog(&[web]), backend.clone()));
    let started = wait_until_state(running.handle(), &id("web"), ProxyState::Running, LIMIT).await.unwrap();
    assert_eq!(started.figures.pid, Some(1001));
    assert_eq!(backend.running(&id("web")), [1001]);

    let exited_at = Instant::now();
    assert_eq!(backend.exit(&id("web"), ExitReason::Code(3)), 1001);
    let backoff = wait_until_state(running.handle(), &id("web"), ProxyState::Backoff, LIMIT).await.unwrap();
    assert_eq!((backoff.figures.pid, backoff.figures.last_exit), (None, Some(ExitReason::Code(3))));
    assert!(backend.running(&id("web")).is_empty());

    let restarted = wait_for_proxy(running.handle(), &id("web"), "has restarted", |s| s.figures.restarts == 1, LIMIT)
        .await
        .unwrap();
    assert_eq!(exited_at.elapsed(), Duration::from_secs(1), "the first restart waits out its backoff");
    assert_eq!((restarted.state, restarted.figures.pid), (ProxyState::Running, Some(1002)));

    // Exited again at once: the second attempt in a row waits twice as long.
    let exited_at = Instant::now();
    backend.exit(&id("web"), ExitReason::Signal(9));
    wait_for_proxy(running.handle(), &id("web"), "has restarted twice", |s| s.figures.restarts == 2, LIMIT)
        .await
        .unwrap();
    assert_eq!(exited_at.elapsed(), Duration::from_secs(2));

    // Restarting after an exit is the backend's job: the engine started the proxy once.
    use CallKind::{Create, Start};
    assert_eq!(backend.calls_of(&id("web")), [(Create, 1), (Start, 1)]);
    running.close().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_failed_start_is_retried_with_a_new_handle_on_the_backoff() {
    let web = with_proxy(service("web"), |spec| spec.restart.free_attempts = 0);
    let backend = RecordingBackend::new();
    backend.fail_starts(&id("web"), 2);
    let began = Instant::now();
    let running = RunningManager::spawn(manager(&catalog(&[web]), backend.clone()));

    let failed = wait_until_state(running.handle(), &id("web"), ProxyState::Failed, LIMIT).await.unwrap();
    let error = failed.figures.error.unwrap_or_default();
    assert!(error.contains("told to fail this start"), "{error}");
    let web = wait_until_state(running.handle(), &id("web"), ProxyState::Running, LIMIT).await.unwrap();
    assert_eq!(web.figures.pid, Some(1001), "a failed start runs nothing");

    let starts: Vec<(u64, Duration)> = backend
        .calls()
        .iter()
        .filter(|call| call.kind == CallKind::Start)
        .map(|call| (call.handle, call.at - began))
        .collect();
    assert_eq!(starts, [(1, Duration::ZERO), (2, Duration::from_secs(1)), (3, Duration::from_secs(3))]);
    running.close().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_start_rule_fails_only_the_proxies_it_picks() {
    let backend = RecordingBackend::new();
    backend.fail_starts_when(|proxy| proxy.id().as_str() == "db-proxy");
    let running = RunningManager::spawn(manager(&catalog(&[service("web"), service("db")]), backend.clone()));
    wait_until_state(running.handle(), &id("web"), ProxyState::Running, LIMIT).await.unwrap();
    wait_until_state(running.handle(), &id("db"), ProxyState::Failed, LIMIT).await.unwrap();
    assert!(backend.running(&id("db")).is_empty());

    // Lifted: the next retry runs it.
    backend.fail_starts_when(|_| false);
    wait_until_state(running.handle(), &id("db"), ProxyState::Running, LIMIT).await.unwrap();
    running.kill().await.unwrap();
    assert!(backend.running(&id("web")).is_empty() && backend.running(&id("db")).is_empty(), "kill stops all");
}

#[tokio::test(start_paused = true)]
async fn a_closed_engine_leaves_its_proxies_running() {
    let backend = RecordingBackend::new();
    let running = RunningManager::spawn(manager(&catalog(&[service("web")]), backend.clone()));
    wait_until_state(running.handle(), &id("web"), ProxyState::Running, LIMIT).await.unwrap();
    running.close().await.unwrap();
    use CallKind::{Create, Detach, Start};
    assert_eq!(backend.calls_of(&id("web")), [(Create, 1), (Start, 1), (Detach, 1)]);
    assert_eq!(backend.running(&id("web")), [1001]);
}

#[tokio::test(start_paused = true)]
async fn a_panic_in_a_start_rule_fails_the_test_with_its_message() {
    let backend = RecordingBackend::new();
    backend.fail_starts_when(|_| panic!("the rule has a bug"));
    let running = RunningManager::spawn(manager(&catalog(&[service("web")]), backend));
    let began = Instant::now();
    // The wait ends when the engine does, not at its deadline.
    let waited = wait_until_state(running.handle(), &id("web"), ProxyState::Running, LIMIT).await;
    assert!(waited.is_err_and(|err| err.to_string().starts_with("the engine ended before proxy web-proxy is running")));
    assert_eq!(began.elapsed(), Duration::ZERO);
    let message = crate::support::panic_of(tokio::spawn(running.stop())).await;
    assert_eq!(message, "the rule has a bug");
}
