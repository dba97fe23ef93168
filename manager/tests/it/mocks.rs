//! Mocks with the test kit's defaults: a test sets expectations only for the calls it is
//! about, its own win over the defaults, and a call nobody expected still fails it.

use tether_manager::ProxyState;
use tether_manager::testing::{RunningManager, WaitError, mock_backend, mock_handle, wait_until_state};

use crate::support::{LIMIT, catalog, id, manager, panic_of, service};

#[tokio::test(start_paused = true)]
async fn a_mock_test_sets_expectations_only_for_the_calls_it_is_about() {
    // Started once and never stopped; closing detaches it (a default).
    let handle = mock_handle(|handle| {
        handle.expect_start().times(1).returning(|| Ok(()));
        handle.expect_stop().never();
    });
    let backend = mock_backend(|backend| {
        backend.expect_create().times(1).return_once(move |_| Box::new(handle));
    });
    let running = RunningManager::spawn(manager(&catalog(&[service("web")]), backend));
    wait_until_state(running.handle(), &id("web"), ProxyState::Running, LIMIT).await.unwrap();
    // Drops the mocks, which check their expectations.
    running.close().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn an_expectation_of_the_test_wins_over_the_default() {
    let handle = mock_handle(|handle| {
        handle.expect_start().returning(|| Ok(()));
        // Were the default used instead, this expectation would be unmet when the mock drops.
        handle.expect_detach().times(1).return_const(());
    });
    let backend = mock_backend(|backend| {
        backend.expect_create().return_once(move |_| Box::new(handle));
        backend.expect_restored().times(1).return_const(());
    });
    let running = RunningManager::spawn(manager(&catalog(&[service("web")]), backend));
    wait_until_state(running.handle(), &id("web"), ProxyState::Running, LIMIT).await.unwrap();
    running.close().await.unwrap();
}

/// A running engine whose one handle expects no start: the engine's start action panics.
fn engine_with_an_unexpected_start() -> RunningManager {
    let handle = mock_handle(|_| {});
    let backend = mock_backend(|backend| {
        backend.expect_create().return_once(move |_| Box::new(handle));
    });
    RunningManager::spawn(manager(&catalog(&[service("web")]), backend))
}

#[tokio::test(start_paused = true)]
async fn a_call_nobody_expected_ends_the_waits_and_fails_the_stop() {
    let running = engine_with_an_unexpected_start();
    let waited = wait_until_state(running.handle(), &id("web"), ProxyState::Running, LIMIT).await;
    assert!(matches!(waited, Err(WaitError::EngineGone { .. })), "{waited:?}");
    let message = panic_of(tokio::spawn(running.stop())).await;
    assert!(message.contains("No matching expectation found"), "{message}");
}

#[tokio::test(start_paused = true)]
async fn a_call_nobody_expected_fails_a_test_that_only_drops_the_engine() {
    let task = tokio::spawn(async {
        let running = engine_with_an_unexpected_start();
        let _ = wait_until_state(running.handle(), &id("web"), ProxyState::Running, LIMIT).await;
        drop(running);
    });
    let message = panic_of(task).await;
    assert!(message.contains("No matching expectation found"), "{message}");
}
