//! A proxy outlives the agent, even one that asks to die with its parent: the keeper, not
//! the agent, is every proxy's parent.
//!
//! The proxy here is a small Python program that arms `PR_SET_PDEATHSIG` (SIGTERM) for
//! itself, as Envoy does, and then sleeps: with the agent as its parent it would die with
//! the agent.

use std::path::{Path, PathBuf};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::support::*;

/// A program that asks for SIGTERM when its parent dies, then sleeps until killed.
fn write_program(dirs: &Dirs) -> PathBuf {
    let path = dirs.temp.path().join("dies-with-parent.py");
    std::fs::write(
        &path,
        "import ctypes, signal, time\n\
         PR_SET_PDEATHSIG = 1\n\
         if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:\n    \
             raise SystemExit('prctl failed')\n\
         print('armed', flush=True)\n\
         while True:\n    time.sleep(3600)\n",
    )
    .unwrap();
    path
}

fn config(program: &Path) -> String {
    format!(
        "[[service]]\nname = \"web\"\n[service.proxy]\ncommand = [\"/usr/bin/python3\", \"{}\"]\nkill_timeout = \"2s\"\n\
         [service.proxy.readiness]\nlog_line = \"armed\"\n",
        program.display()
    )
}

/// Starts an agent with the proxy, and waits until the proxy has armed its signal.
fn started(dirs: &Dirs) -> (Agent, i64) {
    let program = write_program(dirs);
    dirs.write_config("web.toml", &config(&program));
    let agent = Agent::start(dirs, &["--allow-root"]);
    let status = agent.wait_state("web-proxy", "running");
    let pid = status["pid"].as_i64().unwrap();
    (agent, pid)
}

/// The second agent adopts the proxy: same pid, `running`, no restart.
#[track_caller]
fn adopted(dirs: &Dirs, pid: i64) -> Agent {
    let next = Agent::start(dirs, &["--allow-root"]);
    let status = next.wait_state("web-proxy", "running");
    assert_eq!(status["pid"].as_i64(), Some(pid), "the same process is adopted: {status}\n{}", next.logs());
    assert_eq!(status["restarts"], 0, "{status}");
    assert!(alive(pid), "the proxy {pid} still runs");
    next
}

#[test]
fn the_keeper_not_the_agent_is_the_parent_of_a_proxy() {
    let dirs = Dirs::new();
    let (agent, pid) = started(&dirs);
    let parent = parent_of(pid as i32).unwrap();
    assert_ne!(parent, agent.pid().as_raw(), "the agent is not the proxy's parent");
    assert_eq!(keeper_of(pid as i32), Some(parent), "the parent is a keeper: {:?}", cmdline(parent));
    let (_, keeper_session) = pgid_and_sid(parent).unwrap();
    assert_eq!(keeper_session, parent, "the keeper leads a session of its own");
}

#[test]
fn a_proxy_that_asks_to_die_with_its_parent_outlives_an_agent_killed_with_sigkill() {
    let dirs = Dirs::new();
    let (mut agent, pid) = started(&dirs);
    agent.signal(Signal::SIGKILL);
    agent.wait();
    let next = adopted(&dirs, pid);

    // The adopted proxy is the keeper's child: how it ends is known, and it restarts.
    kill(Pid::from_raw(pid as i32), Signal::SIGUSR1).unwrap();
    let restarted = wait_for("the proxy's restart", || {
        next.proxy("web-proxy").filter(|p| p["restarts"] == 1 && p["state"] == "running" && p["pid"] != pid)
    });
    assert_eq!(restarted["last_exit"], serde_json::json!({"signal": 10}), "{restarted}");
}

#[test]
fn a_proxy_that_asks_to_die_with_its_parent_outlives_an_agent_stopped_with_sigterm() {
    let dirs = Dirs::new();
    let (mut agent, pid) = started(&dirs);
    agent.signal(Signal::SIGTERM);
    assert!(agent.wait().success());
    let _next = adopted(&dirs, pid);
}

#[test]
fn leave_stops_the_proxies_and_the_keeper_exits_with_them() {
    let dirs = Dirs::new();
    let (mut agent, pid) = started(&dirs);
    let keeper = keeper_of(pid as i32).unwrap();
    let left = tether().arg("leave").arg("--data-dir").arg(&dirs.data).output().unwrap();
    assert!(left.status.success(), "{}", String::from_utf8_lossy(&left.stderr));
    assert!(agent.wait().success());
    wait_for("the proxy to be gone", || (!alive(pid)).then_some(()));
    // Its parent may be gone too, or a zombie that nobody reaps yet: neither runs.
    wait_for("the keeper to exit", || (!alive(i64::from(keeper))).then_some(()));
}

#[test]
fn a_keeper_killed_with_its_proxy_is_replaced_and_the_proxy_restarted() {
    let dirs = Dirs::new();
    let (agent, pid) = started(&dirs);
    let keeper = keeper_of(pid as i32).unwrap();
    // The proxy dies with its parent; the agent starts a new keeper and a new instance.
    kill(Pid::from_raw(keeper), Signal::SIGKILL).unwrap();
    let restarted = wait_for("the proxy's restart", || {
        agent.proxy("web-proxy").filter(|p| p["state"] == "running" && p["pid"] != pid && p["restarts"] == 1)
    });
    let new_pid = restarted["pid"].as_i64().unwrap() as i32;
    let new_keeper = keeper_of(new_pid).expect("the new instance's parent is a keeper");
    assert_ne!(new_keeper, keeper);
}

/// A copy of this build of `tether` whose keeper says it is of another build: an agent of
/// an older version, as far as the keeper's handshake can tell.
fn older_build(dirs: &Dirs) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let marker = format!("tether keeper {} protocol 1", env!("CARGO_PKG_VERSION"));
    let older = format!("tether keeper {} protocol 0", env!("CARGO_PKG_VERSION"));
    let mut bytes = std::fs::read(env!("CARGO_BIN_EXE_tether")).unwrap();
    let at: Vec<usize> =
        bytes.windows(marker.len()).enumerate().filter(|(_, w)| *w == marker.as_bytes()).map(|(i, _)| i).collect();
    assert_eq!(at.len(), 1, "the build marker {marker:?} stands once in the binary");
    bytes[at[0]..at[0] + older.len()].copy_from_slice(older.as_bytes());
    let path = dirs.temp.path().join("tether-older");
    std::fs::write(&path, bytes).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[test]
fn an_agent_of_another_build_adopts_the_old_keepers_proxies_and_retires_it() {
    let dirs = Dirs::new();
    let older = older_build(&dirs);
    let program = write_program(&dirs);
    dirs.write_config("web.toml", &config(&program));
    let mut old = Agent::start_with(&older, &dirs, &["--allow-root"]);
    let pid = old.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    let old_keeper = keeper_of(pid as i32).unwrap();
    assert_eq!(std::fs::read_link(format!("/proc/{old_keeper}/exe")).unwrap(), older);
    old.signal(Signal::SIGTERM);
    assert!(old.wait().success());

    // The next version adopts the proxy that the old keeper keeps.
    let next = adopted(&dirs, pid);
    assert!(alive(i64::from(old_keeper)), "the old keeper keeps serving its proxy");

    // What it starts, it starts through a keeper of its own build.
    dirs.write_config(
        "api.toml",
        "[[service]]\nname = \"api\"\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\nkill_timeout = \"2s\"\n",
    );
    next.signal(Signal::SIGHUP);
    let api = next.wait_state("api-proxy", "running")["pid"].as_i64().unwrap();
    let new_keeper = keeper_of(api as i32).unwrap();
    assert_ne!(new_keeper, old_keeper);
    assert_eq!(std::fs::read_link(format!("/proc/{new_keeper}/exe")).unwrap(), Path::new(env!("CARGO_BIN_EXE_tether")));

    // The old keeper still tells how its proxy ends; the replacement is the new keeper's,
    // and the old keeper, retired and childless, exits.
    kill(Pid::from_raw(pid as i32), Signal::SIGUSR1).unwrap();
    let restarted = wait_for("the proxy's restart", || {
        next.proxy("web-proxy").filter(|p| p["restarts"] == 1 && p["state"] == "running" && p["pid"] != pid)
    });
    assert_eq!(restarted["last_exit"], serde_json::json!({"signal": 10}), "{restarted}");
    assert_eq!(keeper_of(restarted["pid"].as_i64().unwrap() as i32), Some(new_keeper));
    wait_for("the retired keeper to exit", || (!alive(i64::from(old_keeper))).then_some(()));
}

/// A descriptor that the agent inherited without close-on-exec (from whatever started it)
/// reaches neither the keeper's children nor, through the keeper, any proxy.
#[test]
fn a_proxy_holds_no_descriptor_that_the_agent_inherited() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let dirs = Dirs::new();
    dirs.write_config("web.toml", &sleeper("web"));
    let inherited = std::fs::File::open("/dev/null").unwrap();
    let source = inherited.as_raw_fd();
    let agent = Agent::start_configured(&dirs, &["--allow-root"], |command| {
        // SAFETY: the hook runs in the forked child, where only async-signal-safe calls are
        // allowed: dup2(2) is one, and the closure allocates nothing.
        unsafe {
            command.pre_exec(move || {
                if libc::dup2(source, 9) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    });
    let pid = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    let open = |pid: i64| -> Vec<String> {
        let mut fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .flatten()
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .collect();
        fds.sort_unstable();
        fds
    };
    assert!(open(i64::from(agent.pid().as_raw())).contains(&"9".to_owned()), "the agent holds it");
    assert_eq!(open(pid), ["0", "1", "2"], "the proxy holds its standard streams only");
    let keeper = keeper_of(pid as i32).unwrap();
    assert!(!open(i64::from(keeper)).contains(&"9".to_owned()), "nor does the keeper");
}
