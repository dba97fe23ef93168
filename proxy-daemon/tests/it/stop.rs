//! Stopping: the kill signal, the escalation to SIGKILL, the whole group, idempotence.

use std::time::{Duration, Instant};

use tether_proxy_daemon::{ExitReason, KillPolicy, KillSignal, ProcessState, ProcessUpdate};

use crate::support::*;

#[tokio::test]
async fn process_ignoring_sigint_is_killed_after_kill_timeout_with_its_grandchild() {
    let fx = Fixture::new();
    let worker_file = fx.data_dir().join("worker.pid");
    let mut spec = fx.spec("stubborn-proxy", &["--ignore-sigint", "--fork-worker", worker_file.to_str().unwrap()]);
    spec.kill.timeout = Duration::from_millis(300);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let pid = handle.status().figures.pid.unwrap();
    let worker = pid_in_file(&worker_file).await;
    assert!(!is_dead(worker));

    let start = Instant::now();
    let mut status = handle.subscribe();
    let (stopped, ()) = tokio::join!(within("stop", handle.stop()), async {
        let stopping =
            within("the stopping state", status.wait_for(|status| status.state != ProcessState::Running)).await;
        assert_eq!(stopping.unwrap().state, ProcessState::Stopping, "the kill timeout is visible as `stopping`");
    });
    assert!(
        start.elapsed() >= Duration::from_millis(300),
        "SIGINT was ignored, so the stop waited: {:?}",
        start.elapsed()
    );
    assert_eq!(stopped.state, ProcessState::Stopped);
    assert_eq!(stopped.figures.last_exit, Some(ExitReason::Signal(libc::SIGKILL)));
    assert!(!exists(pid), "the leader is reaped");
    eventually("the grandchild to die", || is_dead(worker)).await;
}

#[tokio::test]
async fn stop_is_idempotent_and_the_process_never_comes_back() {
    let fx = Fixture::new();
    let handle = fx.supervisor.spawn(fx.spec("idem-proxy", &["--sleep"])).await.unwrap();
    let first = within("first stop", handle.stop()).await;
    let second = within("second stop", handle.stop()).await;
    assert_eq!(first, second);
    assert_eq!(second.state, ProcessState::Stopped);
    assert_eq!(handle.status().state, ProcessState::Stopped);
    assert!(fx.marked_processes().is_empty(), "nothing restarted after the stop");
}

#[tokio::test]
async fn kill_policy_changes_apply_in_place() {
    let fx = Fixture::new();
    let handle = fx.supervisor.spawn(fx.spec("term-proxy", &["--ignore-sigint"])).await.unwrap();
    let pid = handle.status().figures.pid.unwrap();
    handle
        .update(ProcessUpdate {
            kill: Some(KillPolicy { signal: KillSignal::Term, timeout: Duration::from_secs(5) }),
            ..ProcessUpdate::default()
        })
        .unwrap();
    let start = Instant::now();
    let stopped = within("stop", handle.stop()).await;
    assert_eq!(stopped.figures.last_exit, Some(ExitReason::Signal(libc::SIGTERM)), "the new signal was used");
    assert!(start.elapsed() < Duration::from_secs(5), "no escalation was needed");
    assert_eq!(stopped.figures.restarts, 0, "the update did not restart the process");
    assert!(!exists(pid));
}

#[tokio::test]
async fn stop_during_backoff_ends_supervision_without_a_restart() {
    let fx = Fixture::new();
    let mut spec = fx.spec("crash-proxy", &["--exit", "3"]);
    spec.restart.free_attempts = 0;
    spec.restart.max_delay = Duration::from_secs(60);
    let pid_file = pid_file_of(&spec);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let status = status_where(&handle, "backoff", |status| status.state == ProcessState::Backoff).await;
    assert_eq!(status.figures.last_exit, Some(ExitReason::Code(3)));
    assert_eq!(status.figures.pid, None);
    assert_eq!(status.figures.restarts, 0);

    let stopped = within("stop", handle.stop()).await;
    assert_eq!(stopped.state, ProcessState::Stopped);
    assert_eq!(stopped.figures.last_exit, Some(ExitReason::Code(3)));
    assert_eq!(stopped.figures.restarts, 0);
    assert!(!pid_file.exists());
}

#[tokio::test]
async fn a_process_is_not_ready_from_the_moment_its_stop_begins() {
    let fx = Fixture::new();
    let handle = fx.supervisor.spawn(fx.spec("ready-proxy", &["--sleep"])).await.unwrap();
    let running = status_where(&handle, "ready", |status| status.ready).await;
    assert_eq!(running.state, ProcessState::Running);
    let pid = running.figures.pid.unwrap();

    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = std::sync::Arc::clone(&seen);
    handle.observe(move |status| record.lock().unwrap().push((status.state, status.ready)));
    let stopped = within("stop", handle.stop()).await;

    assert_eq!((stopped.state, stopped.ready, stopped.figures.pid), (ProcessState::Stopped, false, None));
    assert!(!handle.status().ready, "the last status stays not ready");
    let seen = seen.lock().unwrap().clone();
    let stopping = seen.iter().position(|(state, _)| *state == ProcessState::Stopping).expect("a `stopping` status");
    assert!(seen[..stopping].iter().all(|&(_, ready)| ready), "ready until the stop: {seen:?}");
    assert!(seen[stopping..].iter().all(|&(_, ready)| !ready), "not ready from the stop on: {seen:?}");
    assert!(!exists(pid), "the process is gone and reaped");
}
