//! Tests that need root: pid reuse steered through `ns_last_pid`, and the user switch.
//!
//! Each skips with a printed reason when the tests do not run as root.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use nix::sys::signal::Signal;
use tether_proxy_daemon::{ProcessState, Supervisor};

use crate::support::*;

/// Clock ticks since boot, the unit of a process's start time.
fn ticks_since_boot() -> u64 {
    let uptime = std::fs::read_to_string("/proc/uptime").unwrap();
    let seconds: f64 = uptime.split_whitespace().next().unwrap().parse().unwrap();
    let ticks_per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).unwrap().unwrap();
    (seconds * ticks_per_second as f64) as u64
}

/// A foreign process (not started by the supervisor, without the token) on `pid`.
struct Foreign(std::process::Child);

impl Drop for Foreign {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a foreign process on exactly `pid`, steering the kernel's pid allocator
/// through `/proc/sys/kernel/ns_last_pid`. Other processes on the machine race for the
/// same numbers, so it retries until the pid lands.
fn foreign_process_on(pid: u32, mark: &str) -> Foreign {
    // Serialize with every other user of ns_last_pid, in any test process.
    let lock = std::fs::File::create("/tmp/tether-ns-last-pid.lock").unwrap();
    let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive).unwrap();
    for _attempt in 0..200 {
        let mut last_pid = std::fs::OpenOptions::new().write(true).open("/proc/sys/kernel/ns_last_pid").unwrap();
        write!(last_pid, "{}", pid - 1).unwrap();
        drop(last_pid);
        let child = Command::new(helper())
            .arg("--sleep")
            .env_clear()
            .env(MARK, mark)
            // Its own group, like the original: only the start time tells them apart.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let foreign = Foreign(child);
        if foreign.0.id() == pid {
            return foreign;
        }
    }
    panic!("could not steer a process onto pid {pid}");
}

#[tokio::test]
async fn foreign_process_on_a_reused_pid_is_neither_adopted_nor_signalled() {
    if skip_unless_root("foreign_process_on_a_reused_pid_is_neither_adopted_nor_signalled") {
        return;
    }
    let fx = Fixture::new();
    let spec = fx.spec("reuse-proxy", &["--sleep"]);
    let handle = fx.supervisor.spawn(spec.clone()).await.unwrap();
    pid_in_file(&pid_file_of(&spec)).await;
    let identity = within("detach", handle.detach()).await.unwrap();

    // The proxy dies while no agent watches; its pid is freed once it is reaped.
    send(identity.pid, Signal::SIGKILL);
    eventually("the old pid to be free", || !exists(identity.pid)).await;
    // A start time is counted in clock ticks: the foreign process must start in a later
    // tick than the original, as any real reuse of a pid does (it takes the whole pid
    // space to wrap).
    eventually("a later clock tick", || ticks_since_boot() > identity.start_time + 1).await;
    let foreign = foreign_process_on(identity.pid, &fx.mark);

    let next = Supervisor::new().unwrap();
    assert!(next.adopt(spec.clone(), &identity).is_none(), "a snapshot's pid alone proves nothing");
    assert!(next.adopt_from_pid_file(spec.clone()).is_none(), "a pid file's pid alone proves nothing");
    assert_eq!(read_pid_file(&pid_file_of(&spec)), Some(identity.pid), "the stale pid file still names the pid");
    assert!(!is_dead(identity.pid), "the foreign process was not signalled");
    let mut foreign = foreign;
    assert!(foreign.0.try_wait().unwrap().is_none(), "the foreign process is alive");
}

#[tokio::test]
async fn user_switch_sets_uid_gid_and_supplementary_groups() {
    if skip_unless_root("user_switch_sets_uid_gid_and_supplementary_groups") {
        return;
    }
    let nobody = nix::unistd::User::from_name("nobody").unwrap().expect("a `nobody` user");
    let name = std::ffi::CString::new("nobody").unwrap();
    let mut groups: Vec<u32> =
        nix::unistd::getgrouplist(&name, nobody.gid).unwrap().iter().map(|gid| gid.as_raw()).collect();
    groups.sort_unstable();

    let fx = Fixture::new();
    let mut spec = fx.spec("nobody-proxy", &["--print", "as nobody"]);
    spec.user = Some("nobody".into());
    // `nobody` must be able to reach the program: the build dir may sit under a private
    // (0700) directory, so run a copy from a directory anyone can traverse.
    let public = tempfile::Builder::new().prefix("tether-nobody-").tempdir().unwrap();
    std::fs::set_permissions(public.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let program = public.path().join("tether-test-proxy");
    std::fs::copy(&spec.program, &program).unwrap();
    spec.program = program;
    let stdout = spec.logs.stdout.path();
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let pid = handle.status().figures.pid.unwrap();
    eventually("output written through the agent's fd", || {
        std::fs::read_to_string(&stdout).is_ok_and(|log| log == "as nobody\n")
    })
    .await;

    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |key: &str| -> Vec<u32> {
        let line = status.lines().find(|line| line.starts_with(key)).unwrap();
        let mut ids: Vec<u32> = line[key.len()..].split_whitespace().map(|id| id.parse().unwrap()).collect();
        ids.sort_unstable();
        ids
    };
    let uid = nobody.uid.as_raw();
    let gid = nobody.gid.as_raw();
    assert_eq!(field("Uid:"), [uid; 4], "real, effective, saved and fs uid");
    assert_eq!(field("Gid:"), [gid; 4], "real, effective, saved and fs gid");
    assert_eq!(field("Groups:"), groups, "the user's supplementary groups, not root's");
    let stopped = within("stop", handle.stop()).await;
    assert_eq!(stopped.state, ProcessState::Stopped);
}
