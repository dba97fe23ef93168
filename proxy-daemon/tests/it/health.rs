//! Health checks with real processes: readiness gating `running`, liveness restarting an
//! instance that stops answering, and exec probes bounded by their timeout.

use std::time::Duration;

use nix::sys::signal::Signal;
use tether_proxy_daemon::{HealthChecks, ProcessState, ProcessUpdate};
use tether_state::{CommandLine, HttpTarget, Liveness, Probe, Readiness, TcpTarget};

use crate::support::*;

/// A loopback address with a port that nothing listens on now.
fn free_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| String::from_utf8_lossy(&raw).replace('\0', " "))
        .unwrap_or_default()
}

#[tokio::test]
async fn an_instance_is_starting_until_its_readiness_probe_passes() {
    let fx = Fixture::new();
    let address = free_address();
    let mut spec = fx.spec("late-proxy", &["--delay", "1500", "--serve-http", &address]);
    let mut readiness = Readiness::new(Probe::Tcp(TcpTarget::parse(&address).unwrap()));
    readiness.interval = Duration::from_millis(100);
    spec.health = HealthChecks::new(Some(readiness), None);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let first = handle.status();
    assert_eq!((first.state, first.ready, first.figures.pid.is_some()), (ProcessState::Starting, false, true));

    let refused = status_where(&handle, "a failed readiness probe", |status| status.figures.error.is_some()).await;
    assert_eq!(refused.state, ProcessState::Starting);
    let error = refused.figures.error.unwrap();
    assert!(error.starts_with(&format!("readiness probe tcp {address}: connect: ")), "{error}");
    assert!(std::net::TcpStream::connect(&address).is_err(), "it does not listen yet, so it cannot be ready");

    let ready = status_where(&handle, "readiness", |status| status.state == ProcessState::Running).await;
    assert!(ready.ready);
    assert_eq!(ready.figures.error, None, "a passed readiness clears its probe's error");
    assert_eq!(ready.figures.pid, first.figures.pid);
    std::net::TcpStream::connect(&address).expect("ready means it listens");
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn an_instance_that_stops_answering_is_restarted_after_its_liveness_failures() {
    let fx = Fixture::new();
    let address = free_address();
    let mut spec = fx.spec("stuck-proxy", &["--serve-http", &address]);
    let mut liveness = Liveness::new(Probe::Http(HttpTarget::parse(&format!("http://{address}/health")).unwrap()));
    (liveness.interval, liveness.timeout, liveness.failures) = (Duration::from_secs(1), Duration::from_millis(200), 2);
    // Ready once it listens, so that the stop below finds it serving.
    let mut readiness = Readiness::new(Probe::Tcp(TcpTarget::parse(&address).unwrap()));
    readiness.interval = Duration::from_millis(50);
    spec.health = HealthChecks::new(Some(readiness), Some(liveness));
    spec.kill.timeout = Duration::from_millis(300);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let first =
        status_where(&handle, "running", |status| status.state == ProcessState::Running).await.figures.pid.unwrap();

    // Stopped, it keeps its socket (connects succeed) but answers nothing. The restart
    // shows its cause until a probe of the new instance passes, an interval later:
    // watched from before the stop, so that a slow test thread does not miss it.
    let mut watched = handle.subscribe();
    send(first, Signal::SIGSTOP);
    let status = within(
        "the restart with its cause",
        watched.wait_for(|s| s.figures.pid != Some(first) && s.figures.pid.is_some()),
    )
    .await
    .map(|status| status.clone())
    .expect("supervision goes on");
    let second = status.figures.pid.unwrap();
    assert_eq!(status.figures.restarts, 1);
    let error = status.figures.error.expect("the restart says why");
    assert_eq!(
        error,
        format!("liveness probe http http://{address}/health failed 2 times in a row: no answer within 200ms")
    );
    eventually("the stuck instance to be gone", || is_dead(first)).await;

    // The new instance answers: its first passing probe clears the error.
    let healthy = status_where(&handle, "a passing liveness probe", |status| status.figures.error.is_none()).await;
    assert_eq!((healthy.figures.pid, healthy.state), (Some(second), ProcessState::Running));
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn an_exec_probe_that_hangs_is_killed_at_its_timeout() {
    let fx = Fixture::new();
    let mut spec = fx.spec("slow-check-proxy", &["--sleep"]);
    let probe = Probe::Exec(CommandLine::from_words(vec!["/bin/sleep".into(), "30".into()]).unwrap());
    let mut readiness = Readiness::new(probe);
    (readiness.interval, readiness.timeout) = (Duration::from_millis(400), Duration::from_millis(300));
    spec.health = HealthChecks::new(Some(readiness), None);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let proxy = handle.status().figures.pid.unwrap();

    let mut probe_pid = None;
    eventually("a probe process", || {
        probe_pid =
            fx.marked_processes().into_iter().find(|&pid| pid != proxy && cmdline(pid).starts_with("/bin/sleep 30"));
        probe_pid.is_some()
    })
    .await;
    let status = status_where(&handle, "the probe's timeout", |status| status.figures.error.is_some()).await;
    assert_eq!(status.figures.error.as_deref(), Some("readiness probe exec /bin/sleep: no answer within 300ms"));
    assert_eq!(status.state, ProcessState::Starting);
    eventually("the hung probe to be killed", || is_dead(probe_pid.unwrap())).await;

    // A stop ends a probe in flight too.
    within("stop", handle.stop()).await;
    eventually("no process left", || fx.marked_processes().iter().all(|&pid| is_dead(pid))).await;
}

#[tokio::test]
async fn an_exec_probe_runs_like_the_proxy_and_passes_on_exit_zero() {
    let fx = Fixture::new();
    let mut spec = fx.spec("checked-proxy", &["--sleep"]);
    let address = tether_state::ListenAddress::Unix(fx.data_dir().join("checked.sock"));
    let socket = std::sync::Arc::new(tether_proxy_daemon::bind_listener(&address).unwrap());
    spec.listeners = vec![tether_proxy_daemon::InheritedSocket { name: "public".into(), socket }];
    // The probe sees the proxy's environment, but not its token, nor its listeners: it
    // must not hold them, nor be taken for an instance that serves.
    let check = "test -n \"$TETHER_PROXY_ID\" && test -z \"$TETHER_PROXY_TOKEN\" \
                 && test -z \"$LISTEN_FDS\" && ! test -e /proc/$$/fd/3";
    let probe = Probe::Exec(CommandLine::from_words(vec!["/bin/sh".into(), "-c".into(), check.into()]).unwrap());
    let mut readiness = Readiness::new(probe);
    readiness.interval = Duration::from_millis(100);
    spec.health = HealthChecks::new(Some(readiness), None);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let ready = status_where(&handle, "readiness", |status| status.ready).await;
    assert_eq!((ready.state, ready.figures.error), (ProcessState::Running, None));
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn an_exec_probe_finds_a_bare_name_in_the_path_of_the_proxys_environment() {
    use std::os::unix::fs::PermissionsExt;
    let fx = Fixture::new();
    let checks = fx.data_dir().join("checks");
    std::fs::create_dir(&checks).unwrap();
    let script = checks.join("tether-check");
    std::fs::write(&script, "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:/usr/bin:/bin", checks.display());
    let readiness = |word: &str| {
        let mut readiness = Readiness::new(Probe::Exec(CommandLine::from_words(vec![word.into()]).unwrap()));
        readiness.interval = Duration::from_millis(100);
        HealthChecks::new(Some(readiness), None)
    };

    let mut spec = fx.spec("found-check-proxy", &["--sleep"]);
    spec.env.push(("PATH".into(), path.clone().into()));
    spec.health = readiness("tether-check");
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let ready = status_where(&handle, "readiness", |status| status.ready).await;
    assert_eq!((ready.state, ready.figures.error), (ProcessState::Running, None));
    within("stop", handle.stop()).await;

    let mut spec = fx.spec("missing-check-proxy", &["--sleep"]);
    spec.env.push(("PATH".into(), path.clone().into()));
    spec.health = readiness("tether-no-such-check");
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let failing = status_where(&handle, "a failed probe", |status| status.figures.error.is_some()).await;
    assert_eq!(
        failing.figures.error.unwrap(),
        format!(
            "readiness probe exec tether-no-such-check: cannot start: program `tether-no-such-check` not found in PATH `{path}`"
        )
    );
    assert_eq!(failing.state, ProcessState::Starting);
    within("stop", handle.stop()).await;
}

fn notify_checks(readiness: bool, liveness: Option<(u64, u32)>) -> HealthChecks {
    HealthChecks::new(
        readiness.then(|| Readiness::new(Probe::Notify)),
        liveness.map(|(interval_ms, failures)| {
            let mut liveness = Liveness::new(Probe::Notify);
            (liveness.interval, liveness.failures) = (Duration::from_millis(interval_ms), failures);
            liveness
        }),
    )
}

#[tokio::test]
async fn a_notify_instance_is_ready_on_ready_1_and_shows_its_status_text() {
    let fx = Fixture::new();
    let mut spec = fx.spec(
        "notify-proxy",
        &["--print-env", "--delay", "300", "--notify", "STATUS=warming up", "--notify", "READY=1\nSTATUS=serving"],
    );
    spec.health = notify_checks(true, None);
    let stdout = spec.logs.stdout.path();
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    assert_eq!(handle.status().state, ProcessState::Starting);
    let ready = status_where(&handle, "READY=1", |status| status.ready).await;
    assert_eq!((ready.state, ready.figures.status_text.as_deref()), (ProcessState::Running, Some("serving")));
    let environment = std::fs::read_to_string(stdout).unwrap();
    assert!(environment.contains(&format!("NOTIFY_SOCKET={}\n", fx.supervisor.notify_socket())), "{environment}");
    assert!(!environment.contains("WATCHDOG_USEC="), "no watchdog without a notify liveness check");
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn a_notify_instance_whose_watchdog_pings_stop_is_restarted() {
    let fx = Fixture::new();
    // Pings every 100 ms for 1 s, then silence; the watchdog interval is 400 ms.
    let mut spec = fx.spec("watchdog-proxy", &["--print-env", "--watchdog", "100", "10"]);
    spec.health = notify_checks(false, Some((400, 2)));
    spec.kill.timeout = Duration::from_millis(500);
    let stdout = spec.logs.stdout.path();
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let first = handle.status().figures.pid.unwrap();
    let second = restarted(&handle, first).await;
    let status = handle.status();
    assert_eq!(
        status.figures.error.as_deref(),
        Some("liveness probe notify failed 2 times in a row: no WATCHDOG=1 within 400ms")
    );
    assert_ne!(second, first);
    let environment = std::fs::read_to_string(stdout).unwrap();
    assert!(environment.contains("WATCHDOG_USEC=400000\n"), "{environment}");
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn a_notification_from_a_foreign_process_changes_nothing_and_is_counted() {
    use std::os::linux::net::SocketAddrExt;
    let fx = Fixture::new();
    let mut spec = fx.spec("guarded-proxy", &["--sleep"]);
    spec.health = notify_checks(true, None);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let name = fx.supervisor.notify_socket().strip_prefix('@').unwrap().to_owned();
    let address = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let before = fx.supervisor.foreign_notifications();
    // This test's process is no instance: its READY=1 must not make the proxy ready.
    let socket = std::os::unix::net::UnixDatagram::unbound().unwrap();
    socket.send_to_addr(b"READY=1", &address).unwrap();
    eventually("the foreign datagram counted", || fx.supervisor.foreign_notifications() > before).await;
    let status = handle.status();
    assert_eq!((status.state, status.ready), (ProcessState::Starting, false));
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn an_fd_instance_is_ready_when_it_writes_a_newline_to_its_descriptor() {
    let fx = Fixture::new();
    let mut spec = fx
        .spec("fd-proxy", &["--delay", "300", "--write-fd", "5", "almost", "--delay", "200", "--write-fd", "5", "\\n"]);
    spec.health = HealthChecks::new(Some(Readiness::new(Probe::Fd(5))), None);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    assert_eq!(handle.status().state, ProcessState::Starting);
    let ready = status_where(&handle, "the newline", |status| status.ready).await;
    assert_eq!((ready.state, ready.figures.error), (ProcessState::Running, None));
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn an_fd_instance_that_closes_its_descriptor_without_a_newline_is_not_ready() {
    let fx = Fixture::new();
    // It writes, closes the descriptor and runs on: no exit races the end of the pipe.
    let mut spec = fx.spec("closing-proxy", &[]);
    spec.program = "/bin/sh".into();
    spec.args = vec!["-c".into(), "printf 'no newline' >&4; exec 4>&-; exec sleep 3600".into()];
    spec.health = HealthChecks::new(Some(Readiness::new(Probe::Fd(4))), None);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let closed = Some("readiness fd 4: closed without writing a newline");
    let status =
        status_where(&handle, "the closed descriptor", |status| status.figures.error.as_deref() == closed).await;
    assert!(!status.ready, "{status:?}");
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn a_log_line_instance_is_ready_when_its_line_appears_even_in_a_rotated_log() {
    let fx = Fixture::new();
    // Its first look finds nothing; then the line, then enough output to rotate the file
    // before the next look: the line is in the rotated copy by then.
    let mut spec = fx.spec(
        "log-proxy",
        &["--print", "booting", "--delay", "300", "--print", "ready: listening", "--write-bytes", "17000"],
    );
    // Past the cap, and within the tenth past it that one copy holds.
    spec.logs.limits =
        tether_proxy_daemon::LogPolicy { max_size: 16384, keep: 1, ..tether_proxy_daemon::LogPolicy::default() };
    let mut readiness = Readiness::new(Probe::LogLine(tether_state::LinePattern::new("^ready: ").unwrap()));
    readiness.interval = Duration::from_millis(1500);
    spec.health = HealthChecks::new(Some(readiness), None);
    let rotated = fx.data_dir().join("logs/log-proxy-stdout.log.1");
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let not_yet = status_where(&handle, "a look without the line", |status| status.figures.error.is_some()).await;
    assert_eq!(not_yet.state, ProcessState::Starting);
    assert_eq!(
        not_yet.figures.error.as_deref(),
        Some("readiness probe log_line \"^ready: \": no line of its output matches yet")
    );
    eventually("the log rotated", || rotated.exists()).await;
    let ready = status_where(&handle, "the ready line", |status| status.ready).await;
    assert_eq!((ready.state, ready.figures.error), (ProcessState::Running, None));
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn an_adopted_instance_is_not_asked_for_readiness_again_and_its_liveness_resumes() {
    let fx = Fixture::new();
    let address = free_address();
    let mut spec = fx.spec("adopted-checked-proxy", &["--serve-http", &address]);
    let mut readiness = Readiness::new(Probe::Tcp(TcpTarget::parse(&address).unwrap()));
    readiness.interval = Duration::from_millis(50);
    let mut liveness = Liveness::new(Probe::Http(HttpTarget::parse(&format!("http://{address}/")).unwrap()));
    (liveness.interval, liveness.timeout, liveness.failures) =
        (Duration::from_millis(500), Duration::from_millis(200), 2);
    spec.health = HealthChecks::new(Some(readiness), Some(liveness));
    spec.kill.timeout = Duration::from_millis(300);
    let handle = fx.supervisor.spawn(spec.clone()).await.unwrap();
    let pid = status_where(&handle, "ready", |status| status.ready).await.figures.pid.unwrap();
    pid_in_file(&pid_file_of(&spec)).await;
    let identity = within("detach", handle.detach()).await.unwrap();

    // After a restart of the supervising side: ready at once, not `starting`.
    let next = tether_proxy_daemon::Supervisor::new().unwrap();
    let adopted = next.adopt(spec, &identity).expect("adopted");
    let status = adopted.status();
    assert_eq!((status.state, status.ready, status.figures.pid), (ProcessState::Running, true, Some(pid)));
    // Its liveness is probed again: stopped, it is restarted.
    send(pid, Signal::SIGSTOP);
    // The error shows from the failed probes until a probe of the next instance passes,
    // which may be before a look at the restarted instance: it is looked for first.
    status_where(&adopted, "the liveness error", |status| {
        status.figures.error.as_deref().is_some_and(|error| error.starts_with("liveness probe http"))
    })
    .await;
    let second = restarted(&adopted, pid).await;
    assert_ne!(second, pid);
    within("stop", adopted.stop()).await;
}

#[tokio::test]
async fn a_restarted_log_line_instance_is_ready_again_when_its_line_appears() {
    let fx = Fixture::new();
    // Ready at once, then it exits; each restart prints the line again.
    let mut spec = fx.spec("relog-proxy", &["--print", "ready: listening", "--delay", "1500", "--exit", "1"]);
    let mut readiness = Readiness::new(Probe::LogLine(tether_state::LinePattern::new("^ready: ").unwrap()));
    readiness.interval = Duration::from_millis(100);
    spec.health = HealthChecks::new(Some(readiness), None);
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let again = status_where(&handle, "a restarted instance that is ready", |status| {
        status.figures.restarts >= 1 && status.state == ProcessState::Running
    })
    .await;
    assert!(again.ready && again.figures.error.is_none(), "{again:?}");
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn a_liveness_check_given_by_an_update_to_an_instance_without_checks_applies_to_it() {
    let fx = Fixture::new();
    let handle = fx.supervisor.spawn(fx.spec("unchecked-proxy", &["--sleep"])).await.unwrap();
    let first = handle.status();
    assert_eq!((first.state, first.ready), (ProcessState::Running, true));
    let first = first.figures.pid.unwrap();

    // A probe that always fails, given to the running instance: it is restarted, with
    // the probe's reason, without a new spawn of the supervisor.
    let probe = Probe::Exec(CommandLine::from_words(vec!["/bin/false".into()]).unwrap());
    let mut liveness = Liveness::new(probe);
    (liveness.interval, liveness.timeout, liveness.failures) = (Duration::from_millis(100), Duration::from_secs(2), 1);
    let health = HealthChecks::new(None, Some(liveness));
    handle.update(ProcessUpdate { health: Some(health), ..ProcessUpdate::default() }).unwrap();
    let mut watched = handle.subscribe();
    let status =
        within("the restart by the new check", watched.wait_for(|s| s.figures.pid.is_some_and(|pid| pid != first)))
            .await
            .map(|status| status.clone())
            .expect("supervision goes on");
    assert!(status.figures.restarts >= 1);
    let error = status.figures.error.expect("the restart says why");
    assert!(error.starts_with("liveness probe exec /bin/false failed 1 times in a row"), "{error}");

    within("stop", handle.stop()).await;
}
