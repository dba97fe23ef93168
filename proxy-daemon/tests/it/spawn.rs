//! Spawning: the environment, the files, the process group, and spawn errors.

use std::os::unix::fs::PermissionsExt;

use tether_proxy_daemon::{ProcessState, SpawnError};

use crate::support::*;

#[tokio::test]
async fn process_gets_exactly_the_given_environment() {
    let fx = Fixture::new();
    let spec = fx.spec("env-proxy", &["--print-env", "--print", "done"]);
    let expected: Vec<String> =
        spec.env.iter().map(|(key, value)| format!("{}={}", key.to_string_lossy(), value.to_string_lossy())).collect();
    let stdout = spec.logs.stdout.path();
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    eventually("the environment in the log", || {
        std::fs::read_to_string(&stdout).is_ok_and(|log| log.ends_with("done\n"))
    })
    .await;

    let log = std::fs::read_to_string(&stdout).unwrap();
    let mut printed: Vec<&str> = log.lines().filter(|line| *line != "done").collect();
    let mut expected: Vec<&str> = expected.iter().map(String::as_str).collect();
    printed.sort_unstable();
    expected.sort_unstable();
    assert_eq!(printed, expected, "nothing of the agent's environment leaks through");
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn start_and_stop_with_the_token_in_the_environment() {
    let fx = Fixture::new();
    let spec = fx.spec("web-proxy", &["--sleep"]);
    let pid_file = pid_file_of(&spec);
    let token = spec.identity_env[1].1.clone();
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let status = handle.status();
    assert_eq!(status.state, ProcessState::Running);
    let pid = status.figures.pid.unwrap();
    assert!(status.figures.started_at.is_some());

    // `posix_spawn` returns once the child's exec has switched address spaces, which is
    // a moment before the kernel records where the new environment lives: poll for it.
    let needle = format!("TETHER_PROXY_TOKEN={}", token.to_string_lossy());
    eventually("the token in /proc/<pid>/environ", || {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        environ.split(|&b| b == 0).any(|entry| entry == needle.as_bytes())
    })
    .await;
    // Its own process group, so one killpg reaches all of it and a terminal's Ctrl-C none.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let pgid: u32 = stat[stat.rfind(')').unwrap() + 1..].split_whitespace().nth(2).unwrap().parse().unwrap();
    assert_eq!(pgid, pid);
    assert_eq!(pid_in_file(&pid_file).await, pid);
    assert_eq!(std::fs::metadata(&pid_file).unwrap().permissions().mode() & 0o777, 0o600);

    let stopped = within("stop", handle.stop()).await;
    assert_eq!(stopped.state, ProcessState::Stopped);
    assert_eq!(stopped.figures.pid, None);
    assert_eq!(stopped.figures.last_exit, Some(tether_proxy_daemon::ExitReason::Signal(libc::SIGINT)));
    assert!(!exists(pid), "the leader is reaped, not a zombie");
    assert!(!pid_file.exists(), "the pid file is removed on stop");
}

#[tokio::test]
async fn a_spec_without_a_pid_file_writes_none_across_restarts() {
    let fx = Fixture::new();
    let mut spec = fx.spec("unfiled-proxy", &["--sleep"]);
    spec.pid_file = None;
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let first = handle.status().figures.pid.unwrap();
    send(first, nix::sys::signal::Signal::SIGKILL);
    let second = restarted(&handle, first).await;

    // One thread writes every pid file, in order: once a later spec's file is there, any
    // file of the earlier one would be too.
    let witness = fx.spec("witness-proxy", &["--sleep"]);
    let witness_file = pid_file_of(&witness);
    let witness = fx.supervisor.spawn(witness).await.unwrap();
    pid_in_file(&witness_file).await;
    let names: Vec<_> =
        std::fs::read_dir(fx.data_dir().join("pids")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["witness-proxy.pid"]);

    let stopped = within("stop", handle.stop()).await;
    assert_eq!(
        (stopped.state, stopped.figures.error),
        (ProcessState::Stopped, None),
        "no pid file to remove, no error"
    );
    assert!(!exists(second));
    within("stop", witness.stop()).await;
}

#[tokio::test]
async fn log_files_are_private_and_the_working_dir_is_applied() {
    let fx = Fixture::new();
    let mut spec = fx.spec("cwd-proxy", &["--print-cwd"]);
    let work = fx.data_dir().join("work");
    std::fs::create_dir(&work).unwrap();
    spec.working_dir = work.clone();
    let (stdout, stderr) = (spec.logs.stdout.path(), spec.logs.stderr.path());
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let expected = format!("{}\n", work.display());
    eventually("the working dir in the log", || std::fs::read_to_string(&stdout).is_ok_and(|log| log == expected))
        .await;
    for log in [&stdout, &stderr] {
        assert_eq!(std::fs::metadata(log).unwrap().permissions().mode() & 0o777, 0o600, "{}", log.display());
    }
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn unknown_user_is_a_clear_spawn_error() {
    let fx = Fixture::new();
    let mut spec = fx.spec("user-proxy", &["--sleep"]);
    spec.user = Some("no-such-user-tether".into());
    let error = fx.supervisor.spawn(spec).await.unwrap_err();
    assert!(matches!(&error, SpawnError::UnknownUser { user } if user == "no-such-user-tether"), "{error:?}");
    assert_eq!(error.to_string(), "unknown user \"no-such-user-tether\"");
    assert!(fx.marked_processes().is_empty());
}

#[tokio::test]
async fn missing_program_and_missing_working_dir_are_spawn_errors() {
    let fx = Fixture::new();
    let mut spec = fx.spec("missing-proxy", &[]);
    spec.program = fx.data_dir().join("no-such-program");
    let error = fx.supervisor.spawn(spec).await.unwrap_err();
    assert!(
        matches!(&error, SpawnError::Exec { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
        "{error:?}"
    );

    let mut spec = fx.spec("missing-proxy", &[]);
    spec.working_dir = fx.data_dir().join("no-such-dir");
    let error = fx.supervisor.spawn(spec).await.unwrap_err();
    assert!(matches!(&error, SpawnError::WorkingDir { .. }), "{error:?}");

    // No program relative to the working dir.
    let mut spec = fx.spec("missing-proxy", &[]);
    spec.program = "bin/sleep".into();
    let error = fx.supervisor.spawn(spec).await.unwrap_err();
    let message = tether_state::error_chain(&error);
    assert!(message.contains("failed to execute `bin/sleep`: a relative path"), "{message}");
    assert!(fx.marked_processes().is_empty());
}
