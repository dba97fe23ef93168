//! Reloads in place through [`ProcessHandle::reload`]: the verdict from the instance's
//! notices (a stale `RELOADING=1` is not this reload's), a timeout that restarts nothing,
//! an exit during the reload, a refusing check, and reloads that never overlap.

use std::time::Duration;

use tether_proxy_daemon::{
    CommandLine, HealthChecks, KillSignal, Probe, ProcessState, Readiness, ReloadAction, ReloadPolicy, ReloadResult,
};

use crate::support::*;

fn by_signal(timeout: Duration) -> ReloadPolicy {
    let mut policy = ReloadPolicy::new(ReloadAction::Signal(KillSignal::Hup));
    policy.timeout = timeout;
    policy
}

fn notify_ready() -> HealthChecks {
    HealthChecks::new(Some(Readiness::new(Probe::Notify)), None)
}

fn words(words: &[&str]) -> CommandLine {
    CommandLine::from_words(words.iter().map(|w| (*w).to_owned()).collect()).unwrap()
}

/// A MONOTONIC_USEC far after any request: this reload's.
const LATER: &str = "18446744073709551";

#[tokio::test]
async fn a_reload_is_applied_by_the_instances_own_reloading_then_ready() {
    let fx = Fixture::new();
    let reloading = format!("RELOADING=1\nMONOTONIC_USEC={LATER}");
    // READY=1 for its start; on SIGHUP a stale RELOADING=1 and a READY=1 (an earlier
    // reload's, which must not decide this one), then its own RELOADING=1 and READY=1.
    let args = [
        "--block",
        "HUP",
        "--notify",
        "READY=1",
        "--await",
        "HUP",
        "--notify",
        "RELOADING=1\nMONOTONIC_USEC=1",
        "--notify",
        "READY=1",
        "--delay",
        "200",
        "--notify",
        &reloading,
        "--notify",
        "READY=1",
    ];
    let mut spec = fx.spec("applied-proxy", &args);
    spec.health = notify_ready();
    spec.reload = Some(Box::new(by_signal(Duration::from_secs(5))));
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let ready = status_where(&handle, "ready", |status| status.ready).await;
    let started = std::time::Instant::now();
    let outcome = within("the verdict", handle.reload()).await.unwrap();
    assert_eq!((outcome.result, outcome.error.as_deref()), (ReloadResult::Applied, None));
    assert!(started.elapsed() >= Duration::from_millis(200), "the stale notices did not decide it");
    let status = handle.status();
    assert_eq!((status.figures.pid, status.figures.restarts), (ready.figures.pid, 0));
    let reloads = status.figures.reloads.unwrap();
    assert_eq!((reloads.last, reloads.counts.get(ReloadResult::Applied)), (outcome.clone(), 1));
    assert_eq!(reloads.last_success, Some(outcome.at));
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn a_reload_without_a_verdict_times_out_and_the_proxy_keeps_running() {
    let fx = Fixture::new();
    // A stale RELOADING=1 then READY=1: no reload of this request.
    let args = [
        "--block",
        "HUP",
        "--notify",
        "READY=1",
        "--await",
        "HUP",
        "--notify",
        "RELOADING=1\nMONOTONIC_USEC=1",
        "--notify",
        "READY=1",
    ];
    let mut spec = fx.spec("silent-proxy", &args);
    spec.health = notify_ready();
    spec.reload = Some(Box::new(by_signal(Duration::from_millis(500))));
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let ready = status_where(&handle, "ready", |status| status.ready).await;
    let outcome = within("the verdict", handle.reload()).await.unwrap();
    assert_eq!(outcome.result, ReloadResult::TimedOut);
    assert_eq!(outcome.error.as_deref(), Some("the proxy sent no RELOADING=1 then READY=1 within 500ms"));
    let status = handle.status();
    assert_eq!(
        (status.state, status.figures.pid, status.figures.restarts),
        (ProcessState::Running, ready.figures.pid, 0),
        "not restarted"
    );
    assert!(status.ready && exists(ready.figures.pid.unwrap()));
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn an_exit_during_a_reload_fails_it_and_the_proxy_is_restarted() {
    let fx = Fixture::new();
    let args = ["--block", "HUP", "--notify", "READY=1", "--await", "HUP", "--exit", "3"];
    let mut spec = fx.spec("exiting-proxy", &args);
    spec.health = notify_ready();
    spec.reload = Some(Box::new(by_signal(Duration::from_secs(5))));
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let first = status_where(&handle, "ready", |status| status.ready).await.figures.pid.unwrap();
    let outcome = within("the verdict", handle.reload()).await.unwrap();
    assert_eq!(outcome.result, ReloadResult::Failed);
    assert!(outcome.error.as_deref().unwrap().contains("exited during the reload"), "{outcome:?}");
    let second = restarted(&handle, first).await;
    assert_ne!(first, second);
    assert_eq!(handle.status().figures.reloads.unwrap().counts.get(ReloadResult::Failed), 1);
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn a_failed_check_refuses_the_reload_with_its_output_and_signals_nothing() {
    let fx = Fixture::new();
    // SIGHUP is not blocked: a signal would end the process.
    let mut spec = fx.spec("checked-proxy", &["--sleep"]);
    let mut policy = by_signal(Duration::from_secs(5));
    policy.check = Some(words(&["/bin/sh", "-c", "echo line 3: unknown keyword >&2; exit 2"]));
    spec.reload = Some(Box::new(policy));
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let pid = handle.status().figures.pid;
    let outcome = within("the verdict", handle.reload()).await.unwrap();
    assert_eq!(outcome.result, ReloadResult::Refused);
    assert_eq!(outcome.error.as_deref(), Some("check failed (exit code 2): line 3: unknown keyword"));
    let status = handle.status();
    assert_eq!((status.state, status.figures.pid, status.figures.restarts), (ProcessState::Running, pid, 0));
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn reloads_of_one_process_never_overlap_and_one_asked_meanwhile_runs_after() {
    let fx = Fixture::new();
    let trace = fx.dir.path().join("trace");
    let mut spec = fx.spec("serial-proxy", &["--block", "HUP", "--sleep"]);
    let mut policy = by_signal(Duration::from_secs(5));
    let script = format!("echo start >> {0}; sleep 0.2; echo end >> {0}", trace.display());
    policy.check = Some(words(&["/bin/sh", "-c", &script]));
    spec.reload = Some(Box::new(policy));
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    // The first runs; the two asked during its check are answered by one reload after it.
    let first = handle.reload();
    eventually("the first check to start", || std::fs::read_to_string(&trace).is_ok_and(|t| t == "start\n")).await;
    let (second, third) = (handle.reload(), handle.reload());
    let outcomes = within("three verdicts", async { (first.await, second.await, third.await) }).await;
    let (first, second, third) = (outcomes.0.unwrap(), outcomes.1.unwrap(), outcomes.2.unwrap());
    // Without a readiness check, the signal is all there is to know.
    assert_eq!([first.result, second.result, third.result], [ReloadResult::Signalled; 3]);
    assert_eq!(second, third, "one reload answered both");
    assert!(second.at > first.at);
    let trace = std::fs::read_to_string(&trace).unwrap();
    assert_eq!(trace, "start\nend\nstart\nend\n", "two checks, one after the other");
    assert_eq!(handle.status().figures.reloads.unwrap().counts.get(ReloadResult::Signalled), 2);
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn a_process_without_a_reload_policy_cannot_be_reloaded() {
    let fx = Fixture::new();
    let handle = fx.supervisor.spawn(fx.spec("plain-proxy", &["--sleep"])).await.unwrap();
    assert_eq!(within("the answer", handle.reload()).await, None);
    within("stop", handle.stop()).await;
}
