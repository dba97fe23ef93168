//! The supervisor alone, without the engine: builds with `--no-default-features`, on the
//! crate's public API only, with no data dir.
//!
//! It starts `sleep` under supervision with its logs in a directory of its own, lists what
//! the supervisor supervises, kills the process from outside to show the restart, and stops
//! it, printing what the supervisor observes.
//!
//! `cargo run -p tether-proxy-daemon --no-default-features --example supervise`

#![allow(clippy::print_stdout)]

use std::time::Duration;

use tether_proxy_daemon::{KillPolicy, LogTarget, ProcessName, ProcessSpec, ProcessState, Supervisor};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    // Output in `logs/sleeper-stdout.log` and `logs/sleeper-stderr.log`; no pid file
    // (`.pid_file(path)` would ask for one).
    let spec = ProcessSpec::builder(ProcessName::new("sleeper")?, "sleep")
        .arg("30")
        .env("PATH", "/usr/bin:/bin")
        .kill(KillPolicy { timeout: Duration::from_secs(2), ..KillPolicy::default() })
        .logs(LogTarget::Dir(dir.path().join("logs")))
        .build()?;

    let supervisor = Supervisor::new()?;
    let handle = supervisor.spawn(spec).await?;
    let first = handle.status().figures.pid.ok_or("no pid")?;
    println!("running as pid {first}");
    for process in supervisor.processes() {
        println!("supervising {}: {} (pid {:?})", process.name, process.status.state, process.status.figures.pid);
    }

    // Killed from outside: the supervisor learns it through a pidfd and restarts it.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(first)?), nix::sys::signal::Signal::SIGKILL)?;
    let mut status = handle.subscribe();
    let restarted = tokio::time::timeout(
        Duration::from_secs(10),
        status.wait_for(|s| s.state == ProcessState::Running && s.figures.pid.is_some_and(|pid| pid != first)),
    )
    .await??
    .clone();
    println!(
        "restarted as pid {:?} after {:?} (restarts: {})",
        restarted.figures.pid, restarted.figures.last_exit, restarted.figures.restarts
    );

    let last = handle.stop().await;
    println!("stopped: {} (ready: {}); still supervised: {}", last.state, last.ready, supervisor.processes().len());
    Ok(())
}
