//! The supervisor alone, as a tool that is not the agent uses it: the public API only, no
//! data dir and no `tether-state`, as it builds with `--no-default-features`.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use tether_proxy_daemon::{
    LogTarget, ProcessName, ProcessSpec, ProcessSpecBuilder, ProcessState, RestartPolicy, Supervisor,
};

use crate::support::*;

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// Every entry below `dir`, as paths relative to it, sorted.
fn tree(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).unwrap() {
            let path = entry.unwrap().path();
            found.push(path.strip_prefix(dir).unwrap().display().to_string());
            if path.is_dir() {
                pending.push(path);
            }
        }
    }
    found.sort();
    found
}

/// `/bin/sleep 30`, marked as this test's, with its logs in `logs`.
fn sleeper(marked: &Marked, name: &str, logs: &Path) -> ProcessSpecBuilder {
    let (key, value) = marked.env();
    ProcessSpec::builder(ProcessName::new(name).unwrap(), "/bin/sleep")
        .arg("30")
        .env("PATH", "/usr/bin:/bin")
        .env(key, value)
        .logs(LogTarget::Dir(logs.to_owned()))
}

#[tokio::test]
async fn a_process_is_supervised_with_its_logs_in_a_directory_and_no_data_dir() {
    let marked = Marked::new();
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let spec = sleeper(&marked, "sleeper", &logs).build().unwrap();
    let supervisor = Supervisor::new().unwrap();

    let handle = within("spawn", supervisor.spawn(spec)).await.unwrap();
    let status = handle.status();
    assert_eq!((status.state, status.ready), (ProcessState::Running, true));
    let pid = status.figures.pid.unwrap();

    assert_eq!(tree(dir.path()), ["logs", "logs/sleeper-stderr.log", "logs/sleeper-stdout.log"], "no pid file");
    assert_eq!(mode(&logs), 0o700);
    assert_eq!(mode(&logs.join("sleeper-stdout.log")), 0o600);
    assert_eq!(mode(&logs.join("sleeper-stderr.log")), 0o600);

    let listed = supervisor.processes();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].name.as_str(), "sleeper");
    assert_eq!((listed[0].status.state, listed[0].status.figures.pid), (ProcessState::Running, Some(pid)));

    let stopped = within("stop", handle.stop()).await;
    assert_eq!((stopped.state, stopped.ready, stopped.figures.pid), (ProcessState::Stopped, false, None));
    assert!(!handle.status().ready);
    assert!(!exists(pid), "the process is gone, and reaped");
    assert_eq!(supervisor.processes(), [], "a stopped process is not listed");
    assert_eq!(tree(dir.path()), ["logs", "logs/sleeper-stderr.log", "logs/sleeper-stdout.log"]);
}

#[tokio::test]
async fn a_pid_file_is_written_only_when_asked_and_removed_on_stop() {
    let marked = Marked::new();
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let pid_file = dir.path().join("run/with-file.pid");
    let supervisor = Supervisor::new().unwrap();

    let without = sleeper(&marked, "without-file", &logs).build().unwrap();
    let without = within("spawn", supervisor.spawn(without)).await.unwrap();
    let with = sleeper(&marked, "with-file", &logs).pid_file(&pid_file).build().unwrap();
    let with = within("spawn", supervisor.spawn(with)).await.unwrap();
    let pid = with.status().figures.pid.unwrap();

    assert_eq!(pid_in_file(&pid_file).await, pid);
    assert_eq!(mode(&pid_file), 0o600);
    // The pid files are written in order, by one writer: the second's is there, so the
    // first would be.
    let files: Vec<String> = tree(dir.path()).into_iter().filter(|path| !path.starts_with("logs")).collect();
    assert_eq!(files, ["run", "run/with-file.pid"]);

    within("stop", with.stop()).await;
    assert!(!pid_file.exists(), "the pid file is removed on stop");
    assert!(!exists(pid));
    within("stop", without.stop()).await;
}

#[tokio::test]
async fn the_supervisor_lists_what_it_supervises_until_supervision_ends() {
    let marked = Marked::new();
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let supervisor = Supervisor::new().unwrap();

    let sleeping = within("spawn", supervisor.spawn(sleeper(&marked, "sleeping", &logs).build().unwrap())).await;
    let sleeping = sleeping.unwrap();
    let (key, value) = marked.env();
    let crashing = ProcessSpec::builder(ProcessName::new("crashing").unwrap(), "/bin/sh")
        .args(["-c", "exit 3"])
        .env(key, value)
        .restart(RestartPolicy { free_attempts: 0, max_delay: Duration::from_secs(60), ..RestartPolicy::default() })
        .logs(LogTarget::Dir(logs.clone()))
        .build()
        .unwrap();
    let crashing = within("spawn", supervisor.spawn(crashing)).await.unwrap();
    status_where(&crashing, "backoff", |status| status.state == ProcessState::Backoff).await;

    // In the order supervision began; a clone of the supervisor lists the same.
    let listed: Vec<_> = supervisor
        .clone()
        .processes()
        .into_iter()
        .map(|process| {
            (process.name.to_string(), process.status.state, process.status.figures.pid, process.status.ready)
        })
        .collect();
    let pid = sleeping.status().figures.pid.unwrap();
    assert_eq!(
        listed,
        [
            ("sleeping".to_owned(), ProcessState::Running, Some(pid), true),
            ("crashing".to_owned(), ProcessState::Backoff, None, false),
        ]
    );

    drop(crashing);
    eventually("the dropped handle's process to leave the list", || supervisor.processes().len() == 1).await;
    assert_eq!(supervisor.processes()[0].name.as_str(), "sleeping");

    let identity = within("detach", sleeping.detach()).await.unwrap();
    assert_eq!(supervisor.processes(), [], "a detached process is no longer supervised");
    assert!(exists(identity.pid), "and keeps running (until the guard kills its group)");
}
