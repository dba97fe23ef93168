//! The agent's engine over the mocks, with the test kit's defaults for the calls a test is
//! not about: each test expects only what it is about.

use std::sync::Arc;

use tether_downstream::engine;
use tether_manager::testing::{RunningManager, mock_backend, mock_handle, wait_until_gone, wait_until_state};
use tether_manager::{BackendError, ProxyState};
use tether_state::{ServiceId, SourceKind};

use crate::support::{PAUSED_LIMIT, catalog, id, service};

#[tokio::test(start_paused = true)]
async fn a_new_proxy_is_started_once_and_stopped_when_the_engine_is_killed() {
    let handle = mock_handle(|handle| {
        handle.expect_start().times(1).returning(|| Ok(()));
        handle.expect_stop().times(1).returning(|| Ok(()));
    });
    let backend = mock_backend(|backend| {
        backend
            .expect_create()
            .times(1)
            .withf(|proxy| proxy.id().as_str() == "web-proxy")
            .return_once(move |_proxy| Box::new(handle));
    });
    let running = RunningManager::spawn(engine(&catalog(&[service("web")]), Arc::new(backend)));
    wait_until_state(running.handle(), &id("web"), ProxyState::Running, PAUSED_LIMIT).await.unwrap();
    // Drops the mocks, which check their expectations.
    running.kill().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_removed_service_has_its_proxy_stopped() {
    let handle = mock_handle(|handle| {
        handle.expect_start().times(1).returning(|| Ok(()));
        handle.expect_stop().times(1).returning(|| Ok(()));
    });
    let backend = mock_backend(|backend| {
        backend.expect_create().times(1).return_once(move |_proxy| Box::new(handle));
    });
    let catalog = catalog(&[service("web")]);
    let running = RunningManager::spawn(engine(&catalog, Arc::new(backend)));
    wait_until_state(running.handle(), &id("web"), ProxyState::Running, PAUSED_LIMIT).await.unwrap();

    catalog.remove(&ServiceId::new("web").unwrap(), &SourceKind::Api).unwrap();
    wait_until_gone(running.handle(), &id("web"), PAUSED_LIMIT).await.unwrap();
    // Nothing left to detach.
    running.close().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_failed_start_is_retried_with_a_new_handle() {
    let refusing = mock_handle(|handle| {
        handle
            .expect_start()
            .times(1)
            .returning(|| Err(BackendError::Start { id: id("web"), source: "no such program".into() }));
    });
    let working = mock_handle(|handle| {
        handle.expect_start().times(1).returning(|| Ok(()));
    });
    let backend = mock_backend(|backend| {
        let mut sequence = mockall::Sequence::new();
        backend.expect_create().times(1).in_sequence(&mut sequence).return_once(move |_proxy| Box::new(refusing));
        backend.expect_create().times(1).in_sequence(&mut sequence).return_once(move |_proxy| Box::new(working));
    });
    let running = RunningManager::spawn(engine(&catalog(&[service("web")]), Arc::new(backend)));

    let failed = wait_until_state(running.handle(), &id("web"), ProxyState::Failed, PAUSED_LIMIT).await.unwrap();
    let error = failed.figures.error.unwrap_or_default();
    assert!(error.contains("no such program"), "{error}");
    wait_until_state(running.handle(), &id("web"), ProxyState::Running, PAUSED_LIMIT).await.unwrap();
    running.close().await.unwrap();
}
