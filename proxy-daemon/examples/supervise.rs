//! The supervisor alone, without the engine: builds with `--no-default-features`, on the
//! crate's public API only.
//!
//! It starts `sleep` under supervision, kills it from outside to show the restart, and
//! stops it, printing what the supervisor observes.
//!
//! `cargo run -p tether-proxy-daemon --no-default-features --example supervise`

#![allow(clippy::print_stdout)]

use std::time::Duration;

use tether_proxy_daemon::{ProcessName, ProcessSpec, ProcessState, Supervisor};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let data = tether_state::persist::DataDir::open(dir.path())?;
    let mut spec = ProcessSpec::new(ProcessName::new("sleeper")?, "/bin/sleep", &data);
    spec.args = vec!["30".into()];
    spec.env = vec![("PATH".into(), "/usr/bin:/bin".into())];
    spec.kill.timeout = Duration::from_secs(2);

    let supervisor = Supervisor::new()?;
    let handle = supervisor.spawn(spec).await?;
    let first = handle.status().pid.ok_or("no pid")?;
    println!("running as pid {first}");

    // Killed from outside: the supervisor learns it through a pidfd and restarts it.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(first)?), nix::sys::signal::Signal::SIGKILL)?;
    let mut status = handle.subscribe();
    let restarted = tokio::time::timeout(
        Duration::from_secs(10),
        status.wait_for(|s| s.state == ProcessState::Running && s.pid.is_some_and(|pid| pid != first)),
    )
    .await??
    .clone();
    println!("restarted as pid {:?} after {:?} (restarts: {})", restarted.pid, restarted.last_exit, restarted.restarts);

    let last = handle.stop().await;
    println!("stopped: {}", last.state);
    Ok(())
}
