//! The waits of the test kit: what their errors say, and when they give up.

use std::time::Duration;

use tether_manager::ProxyState;
use tether_manager::testing::{
    RecordingBackend, RunningManager, WaitError, wait_for, wait_until_gone, wait_until_state,
};
use tokio::time::Instant;

use crate::support::{LIMIT, catalog, id, manager, service};

#[tokio::test(start_paused = true)]
async fn a_wait_that_times_out_names_the_proxy_the_condition_and_what_it_saw() {
    let backend = RecordingBackend::new();
    backend.fail_starts(&id("web"), u32::MAX);
    let running = RunningManager::spawn(manager(&catalog(&[service("web")]), backend));

    let began = Instant::now();
    let waited = wait_until_state(running.handle(), &id("web"), ProxyState::Running, Duration::from_secs(5)).await;
    assert_eq!(began.elapsed(), Duration::from_secs(5));
    let error = waited.unwrap_err();
    let message = error.to_string();
    assert!(
        message.starts_with(
            "timed out after 5s waiting until proxy web-proxy is running; last seen: web-proxy failed (error: cannot start proxy web-proxy"
        ),
        "{message}"
    );
    assert!(message.ends_with("the recording backend was told to fail this start)"), "{message}");
    let WaitError::TimedOut { proxy, last_seen, .. } = error else { panic!("{error:?}") };
    assert_eq!(proxy, Some(id("web")));
    assert_eq!(last_seen.len(), 1);
    running.close().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_wait_on_every_proxy_says_when_none_is_listed() {
    let running = RunningManager::spawn(manager(&catalog(&[]), RecordingBackend::new()));
    let waited = wait_for(running.handle(), "a proxy is listed", |all| all.first().cloned(), Duration::from_secs(1));
    let message = waited.await.unwrap_err().to_string();
    assert_eq!(message, "timed out after 1s waiting until a proxy is listed; last seen: no proxy is listed");
    running.close().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_wait_on_a_closed_engine_ends_at_once() {
    let running = RunningManager::spawn(manager(&catalog(&[service("web")]), RecordingBackend::new()));
    let view = running.handle().clone();
    wait_until_state(&view, &id("web"), ProxyState::Running, LIMIT).await.unwrap();
    running.close().await.unwrap();

    let began = Instant::now();
    let message = wait_until_gone(&view, &id("web"), LIMIT).await.unwrap_err().to_string();
    assert_eq!(began.elapsed(), Duration::ZERO);
    assert_eq!(message, "the engine ended before proxy web-proxy is gone; last seen: web-proxy running (pid 1001)");
    // What holds already holds: a closed engine's last statuses still answer.
    wait_until_state(&view, &id("web"), ProxyState::Running, LIMIT).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_removed_proxy_is_waited_until_gone() {
    let catalog = catalog(&[service("web")]);
    let running = RunningManager::spawn(manager(&catalog, RecordingBackend::new()));
    wait_until_state(running.handle(), &id("web"), ProxyState::Running, LIMIT).await.unwrap();
    let web = tether_manager::tether_state::ServiceId::new("web").unwrap();
    catalog.remove(&web, &tether_manager::tether_state::SourceKind::Api).unwrap();
    wait_until_gone(running.handle(), &id("web"), LIMIT).await.unwrap();
    running.close().await.unwrap();
}
