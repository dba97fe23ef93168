//! Detaching and adopting: proof of identity, the pidfd watch, no signals without proof.

use nix::sys::signal::Signal;
use tether_proxy_daemon::{DetachError, ProcessState, Supervisor};

use crate::support::*;

#[tokio::test]
async fn detached_process_keeps_running_and_is_adopted_back() {
    let fx = Fixture::new();
    let spec = fx.spec("adopt-proxy", &["--sleep"]);
    let pid_file = pid_file_of(&spec);
    let handle = fx.supervisor.spawn(spec.clone()).await.unwrap();
    let pid = handle.status().figures.pid.unwrap();
    pid_in_file(&pid_file).await;

    let identity = within("detach", handle.detach()).await.unwrap();
    assert_eq!((identity.pid, identity.pgid), (pid, pid));
    assert!(identity.start_time > 0);
    assert!(!is_dead(pid), "detach leaves the process running");
    assert_eq!(read_pid_file(&pid_file), Some(pid), "detach keeps the pid file");

    // A fresh supervisor, as after an agent restart.
    let next = Supervisor::new().unwrap();
    let adopted = next.adopt(spec, &identity).expect("the same process is adopted");
    let status = adopted.status();
    assert_eq!((status.state, status.figures.pid, status.figures.restarts), (ProcessState::Running, Some(pid), 0));
    let started_at = status.figures.started_at.unwrap();
    assert!(started_at <= std::time::SystemTime::now());
    assert!(started_at.elapsed().unwrap() < std::time::Duration::from_secs(60), "start time comes from /proc");

    let stopped = within("stop", adopted.stop()).await;
    assert_eq!(stopped.state, ProcessState::Stopped);
    assert_eq!(stopped.figures.last_exit, None, "an adopted process's exit status belongs to its parent");
    eventually("the adopted process to die", || is_dead(pid)).await;
    assert!(!pid_file.exists());
}

#[tokio::test]
async fn adopted_process_exit_is_noticed_through_the_pidfd_and_restarted() {
    let fx = Fixture::new();
    let spec = fx.spec("watch-proxy", &["--sleep"]);
    let pid_file = pid_file_of(&spec);
    let handle = fx.supervisor.spawn(spec.clone()).await.unwrap();
    // The first supervisor's write is done before the second one writes (in an agent, the
    // next supervisor starts after the last one's writer has finished or died).
    pid_in_file(&pid_file).await;
    let identity = within("detach", handle.detach()).await.unwrap();
    let adopted = Supervisor::new().unwrap().adopt(spec, &identity).expect("adopted");

    send(identity.pid, Signal::SIGKILL);
    let replacement = restarted(&adopted, identity.pid).await;
    assert_eq!(adopted.status().figures.restarts, 1);
    eventually("the pid file to name the replacement", || read_pid_file(&pid_file) == Some(replacement)).await;
    within("stop", adopted.stop()).await;
    assert!(!exists(replacement));
}

#[tokio::test]
async fn identity_that_does_not_match_is_not_adopted_and_not_signalled() {
    let fx = Fixture::new();
    let spec = fx.spec("mismatch-proxy", &["--sleep"]);
    let handle = fx.supervisor.spawn(spec.clone()).await.unwrap();
    let identity = within("detach", handle.detach()).await.unwrap();

    let next = Supervisor::new().unwrap();
    let mut later_start = identity.clone();
    later_start.start_time += 1;
    assert!(next.adopt(spec.clone(), &later_start).is_none(), "another start time is another process");
    let mut other_boot = identity.clone();
    other_boot.boot_id = "00000000-0000-0000-0000-000000000000".into();
    assert!(next.adopt(spec.clone(), &other_boot).is_none(), "another boot is another process");
    let mut other_group = identity.clone();
    other_group.pgid += 1;
    assert!(next.adopt(spec.clone(), &other_group).is_none());
    assert!(!is_dead(identity.pid), "the process was not signalled");

    // The real identity still works, so the refusals above were about the mismatch.
    let adopted = next.adopt(spec, &identity).expect("the true identity is adopted");
    within("stop", adopted.stop()).await;
}

#[tokio::test]
async fn dead_process_is_not_adopted() {
    let fx = Fixture::new();
    let spec = fx.spec("dead-proxy", &["--sleep"]);
    let handle = fx.supervisor.spawn(spec.clone()).await.unwrap();
    let identity = within("detach", handle.detach()).await.unwrap();
    send(identity.pid, Signal::SIGKILL);
    eventually("the detached process to be gone", || !exists(identity.pid)).await;
    assert!(Supervisor::new().unwrap().adopt(spec.clone(), &identity).is_none());
    assert!(Supervisor::new().unwrap().adopt_from_pid_file(spec).is_none());
}

#[tokio::test]
async fn pid_file_adoption_needs_the_identity_in_the_environment() {
    let fx = Fixture::new();
    let spec = fx.spec("pidfile-proxy", &["--sleep"]);
    let handle = fx.supervisor.spawn(spec.clone()).await.unwrap();
    let pid = handle.status().figures.pid.unwrap();
    pid_in_file(&pid_file_of(&spec)).await;
    within("detach", handle.detach()).await.unwrap();
    let next = Supervisor::new().unwrap();

    let mut wrong_token = spec.clone();
    wrong_token.identity_env[1].1 = "not-the-token".into();
    assert!(next.adopt_from_pid_file(wrong_token).is_none());
    let mut no_identity = spec.clone();
    no_identity.identity_env.clear();
    assert!(next.adopt_from_pid_file(no_identity).is_none(), "an empty identity proves nothing");
    assert!(!is_dead(pid), "the process was not signalled");

    let adopted = next.adopt_from_pid_file(spec).expect("the proven process is adopted");
    assert_eq!(adopted.status().figures.pid, Some(pid));
    within("stop", adopted.stop()).await;
    eventually("the adopted process to die", || is_dead(pid)).await;
}

#[tokio::test]
async fn detach_during_backoff_reports_that_nothing_runs() {
    let fx = Fixture::new();
    let mut spec = fx.spec("backoff-proxy", &["--exit", "1"]);
    spec.restart.free_attempts = 0;
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    status_where(&handle, "backoff", |status| status.state == ProcessState::Backoff).await;
    let error = within("detach", handle.detach()).await.unwrap_err();
    assert!(matches!(error, DetachError::NotRunning { state: ProcessState::Backoff }), "{error:?}");
    assert!(fx.marked_processes().is_empty());
}

#[tokio::test]
async fn instances_are_found_by_their_environment_and_a_second_one_is_stopped_without_its_pid_file() {
    let fx = Fixture::new();
    let spec = fx.spec("twice-proxy", &["--sleep"]);
    // Two instances of one spec, as two agents that crashed during start-up leave them.
    let first = fx.supervisor.spawn(spec.clone()).await.unwrap();
    let second = fx.supervisor.spawn(spec.clone()).await.unwrap();
    let (first_pid, second_pid) = (first.status().figures.pid.unwrap(), second.status().figures.pid.unwrap());
    eventually("the pid file to name the second", || read_pid_file(&pid_file_of(&spec)) == Some(second_pid)).await;
    drop((first, second)); // supervision ends, the processes run on

    let next = Supervisor::new().unwrap();
    let mark = [(MARK.into(), fx.mark.clone().into())];
    let found = next.find_by_environment(&mark, "TETHER_PROXY_ID");
    let mut expected = vec![(first_pid, "twice-proxy".into()), (second_pid, "twice-proxy".into())];
    expected.sort();
    assert_eq!(found, expected);

    let kept = next.adopt_by_environment(spec.clone(), first_pid).expect("the first is proven");
    let mut wrong_token = spec.clone();
    wrong_token.identity_env[1].1 = "not-the-token".into();
    assert!(within("refused stop", next.stop_by_environment(wrong_token, second_pid)).await.is_none());
    assert!(!is_dead(second_pid), "nothing unproven is signalled");
    let stopped = within("stop", next.stop_by_environment(spec.clone(), second_pid)).await.expect("proven");
    assert_eq!(stopped.state, ProcessState::Stopped);
    eventually("the second instance to die", || is_dead(second_pid)).await;
    eventually("the pid file to name the kept instance", || read_pid_file(&pid_file_of(&spec)) == Some(first_pid))
        .await;
    assert!(!is_dead(first_pid));
    within("stop", kept.stop()).await;
    eventually("the kept instance to die", || is_dead(first_pid)).await;
}

#[tokio::test]
async fn a_worker_that_leads_its_own_group_is_not_taken_for_an_instance() {
    let fx = Fixture::new();
    let mut spec = fx.spec("job-control-proxy", &[]);
    spec.program = "/bin/sh".into();
    // The worker makes itself the leader of a group of its own, in the same session.
    spec.args = vec!["-c".into(), "perl -e 'setpgrp(0, 0); sleep 30' & wait".into()];
    let handle = fx.supervisor.spawn(spec.clone()).await.unwrap();
    let pid = handle.status().figures.pid.unwrap();
    let leads_its_group = |pid: u32| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let pgid = stat.rsplit_once(") ").and_then(|(_, rest)| rest.split(' ').nth(2)?.parse::<u32>().ok());
        pgid == Some(pid)
    };
    let mut worker = 0;
    eventually("the worker to lead its own group", || {
        let others: Vec<u32> = fx.marked_processes().into_iter().filter(|&other| other != pid).collect();
        worker = others.first().copied().unwrap_or(0);
        others.len() == 1 && leads_its_group(worker)
    })
    .await;
    let mark = [(MARK.into(), fx.mark.clone().into())];
    let found: Vec<u32> =
        fx.supervisor.find_by_environment(&mark, "TETHER_PROXY_ID").into_iter().map(|(pid, _)| pid).collect();
    assert_eq!(found, vec![pid]);
    within("stop", handle.stop()).await;
    send(worker, Signal::SIGKILL);
}

#[tokio::test]
async fn a_daemonised_helper_is_not_taken_for_an_instance() {
    let fx = Fixture::new();
    let mut spec = fx.spec("daemonising-proxy", &[]);
    spec.program = "/bin/sh".into();
    // The helper calls setsid(): it leads a session, which no spawned instance does.
    spec.args = vec!["-c".into(), "setsid sleep 30 & exec sleep 30".into()];
    let handle = fx.supervisor.spawn(spec.clone()).await.unwrap();
    let pid = handle.status().figures.pid.unwrap();
    // Both have exec'd `sleep`: the shell's own exec is not caught half-way.
    let sleeping =
        |pid: u32| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|line| line.starts_with(b"sleep\0"));
    eventually("the helper to start", || {
        let marked = fx.marked_processes();
        marked.len() == 2 && marked.iter().all(|&pid| sleeping(pid))
    })
    .await;
    let mark = [(MARK.into(), fx.mark.clone().into())];
    let found: Vec<u32> =
        fx.supervisor.find_by_environment(&mark, "TETHER_PROXY_ID").into_iter().map(|(pid, _)| pid).collect();
    assert_eq!(found, vec![pid]);
    within("stop", handle.stop()).await;
}
