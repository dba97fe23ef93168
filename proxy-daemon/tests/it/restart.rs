//! Restarting: after an exit, the pid file following, the group swept first.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tether_proxy_daemon::{ExitReason, ProcessState, ProcessUpdate, RestartPolicy, Restarted};

use crate::support::*;

#[tokio::test]
async fn exited_process_is_restarted_and_the_pid_file_follows() {
    let fx = Fixture::new();
    let spec = fx.spec("restart-proxy", &["--sleep"]);
    let pid_file = pid_file_of(&spec);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let first = handle.status().figures.pid.unwrap();
    assert_eq!(pid_in_file(&pid_file).await, first);

    send(first, Signal::SIGKILL);
    let second = restarted(&handle, first).await;
    let status = handle.status();
    assert_eq!(status.figures.restarts, 1);
    assert_eq!(status.figures.last_exit, Some(ExitReason::Signal(libc::SIGKILL)));
    eventually("the pid file to follow the restart", || read_pid_file(&pid_file) == Some(second)).await;

    send(second, Signal::SIGTERM);
    let third = restarted(&handle, second).await;
    assert_eq!(handle.status().figures.restarts, 2);
    assert_eq!(handle.status().figures.last_exit, Some(ExitReason::Signal(libc::SIGTERM)));
    eventually("the pid file to follow again", || read_pid_file(&pid_file) == Some(third)).await;
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn killed_main_process_has_its_surviving_worker_swept_before_the_restart() {
    let fx = Fixture::new();
    let worker_file = fx.data_dir().join("worker.pid");
    let spec = fx.spec("master-proxy", &["--fork-worker", worker_file.to_str().unwrap()]);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let master = handle.status().figures.pid.unwrap();
    let worker = pid_in_file(&worker_file).await;
    std::fs::remove_file(&worker_file).unwrap();

    // Like the OOM killer: only the master dies, the worker would keep its port.
    send(master, Signal::SIGKILL);
    let replacement = restarted(&handle, master).await;
    // The sweep's SIGKILL was sent before the replacement was spawned; give the kernel
    // its moment to finish the kill.
    eventually("the old worker to be dead", || is_dead(worker)).await;
    let new_worker = pid_in_file(&worker_file).await;
    assert_ne!(new_worker, worker);
    assert!(!is_dead(new_worker), "the new instance's worker is untouched");
    assert!(!is_dead(replacement));
    within("stop", handle.stop()).await;
    eventually("the new worker to die with the stop", || is_dead(new_worker)).await;
}

#[tokio::test]
async fn crash_loop_backs_off_after_the_free_attempts() {
    let fx = Fixture::new();
    let mut spec = fx.spec("loop-proxy", &["--exit", "7"]);
    spec.restart =
        RestartPolicy { free_attempts: 2, max_delay: Duration::from_secs(60), healthy_after: Duration::from_secs(60) };
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    // Two free restarts, then the third exit waits 1 s in backoff.
    let status =
        status_where(&handle, "backoff after two free restarts", |status| status.state == ProcessState::Backoff).await;
    assert_eq!(status.figures.restarts, 2);
    assert_eq!(status.figures.last_exit, Some(ExitReason::Code(7)));
    // After the 1 s delay it restarts, exits again, and waits 2 s.
    let status =
        status_where(&handle, "the restart after the first delay", |status| status.figures.restarts == 3).await;
    assert_eq!(status.figures.last_exit, Some(ExitReason::Code(7)));
    status_where(&handle, "the second backoff", |status| {
        status.state == ProcessState::Backoff && status.figures.restarts == 3
    })
    .await;
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn restart_policy_changes_apply_in_place() {
    let fx = Fixture::new();
    let mut spec = fx.spec("policy-proxy", &["--sleep"]);
    spec.restart.free_attempts = 0;
    spec.restart.max_delay = Duration::from_secs(3600);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let pid = handle.status().figures.pid.unwrap();
    handle
        .update(ProcessUpdate {
            restart: Some(RestartPolicy { free_attempts: 5, ..RestartPolicy::default() }),
            ..ProcessUpdate::default()
        })
        .unwrap();
    assert_eq!(handle.status().figures.pid, Some(pid), "the update did not restart the process");
    send(pid, Signal::SIGKILL);
    // With the old policy this would wait an hour; the new one restarts at once.
    restarted(&handle, pid).await;
    assert_eq!(handle.status().figures.restarts, 1);
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn dropping_the_handle_leaves_the_process_running() {
    let fx = Fixture::new();
    let handle = fx.supervisor.spawn(fx.spec("drop-proxy", &["--sleep"])).await.unwrap();
    let pid = handle.status().figures.pid.unwrap();
    let mut status = handle.subscribe();
    drop(handle);
    within("the supervising task to end", status.changed()).await.unwrap_err();
    assert!(!is_dead(pid), "supervision ended, the process did not");
    // The fixture's guard kills it.
}

#[tokio::test]
async fn a_restart_that_cannot_exec_waits_on_the_backoff_with_the_reason_and_runs_once_it_can() {
    let fx = Fixture::new();
    let program = fx.data_dir().join("vanishing-proxy");
    std::fs::copy(helper(), &program).unwrap();
    let mut spec = fx.spec("vanish-proxy", &["--sleep"]);
    spec.program = program.clone();
    spec.restart = RestartPolicy { free_attempts: 1, max_delay: Duration::from_secs(1), ..RestartPolicy::default() };
    let pid_file = pid_file_of(&spec);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let pid = handle.status().figures.pid.unwrap();
    pid_in_file(&pid_file).await;

    std::fs::remove_file(&program).unwrap();
    send(pid, Signal::SIGKILL);
    let status = status_where(&handle, "the failed restart", |status| {
        status.state == ProcessState::Backoff && status.figures.error.is_some()
    })
    .await;
    let error = status.figures.error.clone().expect("the reason");
    assert!(error.starts_with("cannot restart (failed attempts: 1): "), "{error}");
    assert!(error.contains(&format!("failed to execute `{}`", program.display())), "{error}");
    assert_eq!(status.figures.pid, None);
    assert_eq!(status.figures.last_exit, Some(ExitReason::Signal(libc::SIGKILL)));
    assert_eq!(status.figures.restarts, 0, "a restart that did not run is not counted: {status:?}");
    eventually("no pid file names a process that does not exist", || !pid_file.exists()).await;

    // The program comes back: the next attempt on the backoff runs it, with no change made.
    std::fs::copy(helper(), &program).unwrap();
    let status =
        status_where(&handle, "the restart once the program is back", |status| status.state == ProcessState::Running)
            .await;
    assert_eq!(status.figures.error, None);
    assert_eq!(status.figures.restarts, 1);
    let new_pid = status.figures.pid.unwrap();
    assert_ne!(new_pid, pid);
    eventually("the pid file to name the new instance", || read_pid_file(&pid_file) == Some(new_pid)).await;
    assert_eq!(within("stop", handle.stop()).await.state, ProcessState::Stopped);
    eventually("the pid file removed on stop", || !pid_file.exists()).await;
}

#[tokio::test]
async fn a_healthy_run_resets_the_backoff() {
    let fx = Fixture::new();
    let mut spec = fx.spec("healthy-proxy", &["--sleep"]);
    let healthy_after = Duration::from_millis(150);
    spec.restart = RestartPolicy { free_attempts: 1, max_delay: Duration::from_secs(60), healthy_after };
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    for round in 1..=3 {
        let status = handle.status();
        let pid = status.figures.pid.unwrap();
        let started_at = status.figures.started_at.unwrap();
        // The condition is the passing of time itself: the run must reach `healthy_after`.
        eventually("a healthy run", || started_at.elapsed().unwrap_or_default() > healthy_after).await;
        let killed_at = Instant::now();
        send(pid, Signal::SIGKILL);
        restarted(&handle, pid).await;
        // Without the reset, the second exit would be attempt 2 and wait 1 s in backoff.
        assert!(
            killed_at.elapsed() < Duration::from_millis(900),
            "round {round}: restarted at once after a healthy run"
        );
        assert_eq!(handle.status().figures.restarts, round);
    }
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn an_observer_is_told_the_current_status_and_then_every_change_in_order() {
    use std::sync::{Arc, Mutex};

    let fx = Fixture::new();
    let handle = fx.supervisor.spawn(fx.spec("observed-proxy", &["--sleep"])).await.unwrap();
    let first = handle.status().figures.pid.unwrap();
    type Seen = Vec<(ProcessState, Option<u32>, u64)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let record = Arc::clone(&seen);
    handle.observe(move |status| {
        record.lock().unwrap().push((status.state, status.figures.pid, status.figures.restarts))
    });
    assert_eq!(seen.lock().unwrap().as_slice(), [(ProcessState::Running, Some(first), 0)], "told at once");

    send(first, Signal::SIGKILL);
    let second = restarted(&handle, first).await;
    let stopped = handle.stop().await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen.last(),
        Some(&(stopped.state, stopped.figures.pid, stopped.figures.restarts)),
        "told of the last change: {seen:?}"
    );
    assert!(seen.contains(&(ProcessState::Running, Some(second), 1)), "told of the restart: {seen:?}");
    let restarts: Vec<u64> = seen.iter().map(|(_, _, restarts)| *restarts).collect();
    assert!(restarts.is_sorted(), "in order: {seen:?}");
}

/// A condition a test opens, and how many times the supervisor asked for it.
fn gate() -> (tokio::sync::watch::Sender<bool>, Arc<AtomicUsize>, Restarted) {
    let (open, opened) = tokio::sync::watch::channel(false);
    let asked = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&asked);
    let after = Arc::new(move || {
        counted.fetch_add(1, Ordering::SeqCst);
        let mut opened = opened.clone();
        Box::pin(async move {
            let _open = opened.wait_for(|open| *open).await;
        }) as std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
    });
    let restarted = Restarted {
        args: vec!["--print".into(), "cold".into(), "--sleep".into()],
        env: vec![("GENERATION".into(), "cold".into())].into(),
        after,
    };
    (open, asked, restarted)
}

#[tokio::test]
async fn a_process_started_again_waits_for_its_condition_and_runs_its_restarted_arguments() {
    let fx = Fixture::new();
    let mut spec = fx.spec("cold-proxy", &["--sleep"]);
    spec.env.push(("GENERATION".into(), "first".into()));
    let (open, asked, cold) = gate();
    spec.restarted = Some(Box::new(cold));
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let first = handle.status().figures.pid.unwrap();

    send(first, Signal::SIGKILL);
    eventually("the supervisor to wait for the condition", || asked.load(Ordering::SeqCst) == 1).await;
    let waiting = handle.status();
    assert_eq!((waiting.state, waiting.figures.pid), (ProcessState::Backoff, None), "not started before it holds");

    open.send_replace(true);
    let second = restarted(&handle, first).await;
    let cmdline = || std::fs::read(format!("/proc/{second}/cmdline")).unwrap_or_default();
    eventually("the restarted arguments", || cmdline().split(|b| *b == 0).any(|word| word == b"cold")).await;
    let environ = std::fs::read(format!("/proc/{second}/environ")).unwrap();
    let entries: Vec<&[u8]> = environ.split(|b| *b == 0).filter(|e| e.starts_with(b"GENERATION=")).collect();
    assert_eq!(entries, [b"GENERATION=cold".as_slice()], "replaced, not added");
    assert_eq!(handle.status().figures.restarts, 1);
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn restarts_turned_off_while_it_waits_to_start_again_end_supervision() {
    let fx = Fixture::new();
    let mut spec = fx.spec("drained-proxy", &["--sleep"]);
    let (_open, asked, cold) = gate();
    spec.restarted = Some(Box::new(cold));
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let first = handle.status().figures.pid.unwrap();
    send(first, Signal::SIGKILL);
    eventually("the supervisor to wait for the condition", || asked.load(Ordering::SeqCst) == 1).await;
    handle.update(ProcessUpdate { restart_on_exit: Some(false), ..ProcessUpdate::default() }).unwrap();
    let last = status_where(&handle, "supervision to end", |status| status.state.is_final()).await;
    assert_eq!((last.state, last.figures.pid), (ProcessState::Stopped, None));
}
