//! A test that must fail: a mock's expectation that is not met fails the test that set it,
//! even when the engine ends in a way that never makes the expected call.
//!
//! Ignored in a normal run; `cargo xtask ci` runs it on its own and fails unless it fails
//! with mockall's message for the unmet expectation.

use std::sync::Arc;

use tether_downstream::engine;
use tether_manager::ProxyState;
use tether_manager::testing::{RunningManager, mock_backend, mock_handle, wait_until_state};

use crate::support::{PAUSED_LIMIT, catalog, id, service};

#[tokio::test(start_paused = true)]
#[ignore = "must fail: `cargo xtask ci` runs it alone and checks that the unmet expectation fails it"]
async fn an_unmet_expectation_fails_the_test() {
    let handle = mock_handle(|handle| {
        handle.expect_start().times(1).returning(|| Ok(()));
        handle.expect_stop().times(1).returning(|| Ok(()));
    });
    let backend = mock_backend(|backend| {
        backend.expect_create().times(1).return_once(move |_proxy| Box::new(handle));
    });
    let running = RunningManager::spawn(engine(&catalog(&[service("web")]), Arc::new(backend)));
    wait_until_state(running.handle(), &id("web"), ProxyState::Running, PAUSED_LIMIT).await.unwrap();
    // Closed, not killed: the proxy is detached and never stopped, so the handle's `stop`
    // expectation is unmet when the engine drops the mock.
    running.close().await.unwrap();
}
