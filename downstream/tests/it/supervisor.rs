//! `tether-proxy-daemon`'s `Supervisor` alone, without the engine (the crate is built without
//! its `manager` feature): a real process, stopped, is gone; a detached one keeps running.

use std::time::Duration;

use tether_proxy_daemon::{
    ExitReason, KillPolicy, KillSignal, LogTarget, ProcessName, ProcessSpec, ProcessState, Supervisor,
};

use crate::support::{Processes, is_gone, within};

/// `sleep 60`, found in `PATH`, its logs in `processes`' directory, marked as theirs; no pid file.
fn sleeper(processes: &Processes) -> ProcessSpec {
    let (mark, value) = processes.marked();
    ProcessSpec::builder(ProcessName::new("sleeper").unwrap(), "sleep")
        .arg("60")
        .env("PATH", "/usr/bin:/bin")
        .env(mark, value)
        .kill(KillPolicy { signal: KillSignal::Term, timeout: Duration::from_secs(2) })
        .logs(LogTarget::Dir(processes.logs()))
        .build()
        .expect("a valid spec")
}

#[tokio::test]
async fn a_stopped_process_is_gone() {
    let processes = Processes::new();
    let supervisor = Supervisor::new().unwrap();
    let handle = within("the spawn", supervisor.spawn(sleeper(&processes))).await.unwrap();
    let pid = handle.status().figures.pid.expect("a spawned process has a pid");
    processes.wait_until_running(&[pid]).await;

    let last = within("the stop", handle.stop()).await;
    assert_eq!(last.state, ProcessState::Stopped);
    assert_eq!(last.figures.last_exit, Some(ExitReason::Signal(15)), "ended by its kill signal, SIGTERM");
    assert!(is_gone(pid), "the stop reaps the process");
    assert!(processes.running().is_empty(), "{:?}", processes.running());
}

#[tokio::test]
async fn a_detached_process_keeps_running() {
    let processes = Processes::new();
    let supervisor = Supervisor::new().unwrap();
    let handle = within("the spawn", supervisor.spawn(sleeper(&processes))).await.unwrap();
    let pid = handle.status().figures.pid.expect("a spawned process has a pid");

    let identity = within("the detach", handle.detach()).await.unwrap();
    assert_eq!(identity.pid, pid);
    // No longer supervised; the guard ends it with the test.
    processes.wait_until_running(&[pid]).await;
}
