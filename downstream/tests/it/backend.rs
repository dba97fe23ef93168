//! The agent's own backend, `SupervisorBackend`, through the engine, with real processes:
//! started, restarted by the supervisor after a crash, stopped by a kill, left running by a
//! close; and a proxy it cannot run, shown failed with the reason.

use std::sync::Arc;

use tether_downstream::{SupervisorBackend, engine};
use tether_manager::ProxyState;
use tether_manager::testing::{RunningManager, wait_for_proxy, wait_until_state};

use crate::support::{LIMIT, Processes, catalog, crash, id, is_gone, service, within};

#[tokio::test]
async fn a_crashed_proxy_is_restarted_and_a_kill_leaves_no_process() {
    let processes = Processes::new();
    let catalog = catalog(&[processes.service("sleeper", &["/bin/sleep", "60"])]);
    let backend = SupervisorBackend::new(processes.logs()).unwrap();
    let running = RunningManager::spawn(engine(&catalog, Arc::new(backend)));

    let first = wait_until_state(running.handle(), &id("sleeper"), ProxyState::Running, LIMIT).await.unwrap();
    let first = first.figures.pid.expect("a running proxy has a pid");
    processes.wait_until_running(&[first]).await;

    crash(first);
    let restarted =
        wait_for_proxy(running.handle(), &id("sleeper"), "has restarted", |proxy| proxy.figures.restarts == 1, LIMIT)
            .await
            .unwrap();
    let second = restarted.figures.pid.expect("a restarted proxy has a pid");
    assert_ne!(second, first);
    assert!(is_gone(first), "the crashed process was reaped");

    within("the engine's kill", running.kill()).await.unwrap();
    assert!(is_gone(second), "a kill stops the process and reaps it");
    assert!(processes.running().is_empty(), "{:?}", processes.running());
}

#[tokio::test]
async fn closing_the_engine_leaves_the_process_running() {
    let processes = Processes::new();
    let catalog = catalog(&[processes.service("sleeper", &["sleep", "60"])]);
    let backend = SupervisorBackend::new(processes.logs()).unwrap();
    let running = RunningManager::spawn(engine(&catalog, Arc::new(backend)));
    let sleeper = wait_until_state(running.handle(), &id("sleeper"), ProxyState::Running, LIMIT).await.unwrap();

    within("the engine's close", running.close()).await.unwrap();
    // Detached, for the next agent; the guard ends it with the test.
    processes.wait_until_running(&[sleeper.figures.pid.unwrap()]).await;
}

#[tokio::test]
async fn a_proxy_without_a_command_fails_with_the_reason() {
    let processes = Processes::new();
    let catalog = catalog(&[service("web")]);
    let backend = SupervisorBackend::new(processes.logs()).unwrap();
    let running = RunningManager::spawn(engine(&catalog, Arc::new(backend)));

    let web = wait_until_state(running.handle(), &id("web"), ProxyState::Failed, LIMIT).await.unwrap();
    let error = web.figures.error.unwrap_or_default();
    assert!(error.contains("the built-in proxy is not available here"), "{error}");
    within("the engine's kill", running.kill()).await.unwrap();
}
