//! The agent's engine over the test kit's recording backend, on the paused clock: a proxy
//! starts, its process exits, and the backend restarts it once its backoff has passed.

use std::sync::Arc;
use std::time::Duration;

use tether_downstream::engine;
use tether_manager::ProxyState;
use tether_manager::testing::{CallKind, RecordingBackend, RunningManager, wait_for_proxy, wait_until_state};
use tether_state::ExitReason;
use tokio::time::Instant;

use crate::support::{PAUSED_LIMIT, catalog, id, service};

#[tokio::test(start_paused = true)]
async fn an_exited_proxy_is_restarted_after_its_backoff() {
    // No free attempt: the first restart waits its 1s backoff.
    let mut web = service("web");
    web.proxy.as_mut().unwrap().restart.free_attempts = 0;
    let backend = RecordingBackend::new();
    let running = RunningManager::spawn(engine(&catalog(&[web]), Arc::new(backend.clone())));

    let started = wait_until_state(running.handle(), &id("web"), ProxyState::Running, PAUSED_LIMIT).await.unwrap();
    assert_eq!(started.figures.pid, Some(1001));

    let exited_at = Instant::now();
    backend.exit(&id("web"), ExitReason::Code(1));
    let waiting = wait_until_state(running.handle(), &id("web"), ProxyState::Backoff, PAUSED_LIMIT).await.unwrap();
    assert_eq!(waiting.figures.last_exit, Some(ExitReason::Code(1)));

    let restarted =
        wait_for_proxy(running.handle(), &id("web"), "has restarted", |web| web.figures.restarts == 1, PAUSED_LIMIT)
            .await
            .unwrap();
    assert_eq!(exited_at.elapsed(), Duration::from_secs(1), "the restart waits out the backoff");
    assert_eq!((restarted.state, restarted.figures.pid), (ProxyState::Running, Some(1002)));

    // The restart was the backend's; killing the engine stops the one handle it started.
    running.kill().await.unwrap();
    use CallKind::{Create, Start, Stop};
    assert_eq!(backend.calls_of(&id("web")), [(Create, 1), (Start, 1), (Stop, 1)]);
    assert!(backend.running(&id("web")).is_empty());
}
