//! Shared fixtures: a supervisor in a temporary data dir, specs for the helper
//! binary, waiting with deadlines, and the guard that kills every leftover process.
//!
//! Nothing here sleeps to wait for an effect: waits poll a condition until a deadline.

use std::ffi::OsString;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tether_proxy_daemon::{ProcessHandle, ProcessName, ProcessSpec, ProcessState, ProcessStatus, Supervisor};
use tether_state::persist::DataDir;

/// How long any single wait in a test may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// The environment variable that marks every process a test starts.
pub const MARK: &str = "TETHER_TEST_MARK";

/// The stand-in proxy.
pub fn helper() -> PathBuf {
    crate::fixture::test_proxy()
}

/// Awaits `future`, failing the test with `what` if it takes longer than [`DEADLINE`].
pub async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, future).await {
        Ok(value) => value,
        Err(_elapsed) => panic!("timed out after {DEADLINE:?} waiting for {what}"),
    }
}

/// Polls `condition` until it holds, failing the test after [`DEADLINE`].
pub async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let start = Instant::now();
    while !condition() {
        assert!(start.elapsed() < DEADLINE, "timed out after {DEADLINE:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until the handle's status satisfies `predicate`, and returns it.
pub async fn status_where(
    handle: &ProcessHandle,
    what: &str,
    predicate: impl FnMut(&ProcessStatus) -> bool,
) -> ProcessStatus {
    let mut status = handle.subscribe();
    let result = within(what, status.wait_for(predicate)).await.map(|status| status.clone());
    result.unwrap_or_else(|_| panic!("supervision ended while waiting for {what}: {:?}", handle.status()))
}

/// Waits for a running instance other than `old_pid`; returns its pid.
pub async fn restarted(handle: &ProcessHandle, old_pid: u32) -> u32 {
    let status = status_where(handle, "a restarted instance", |status| {
        status.state == ProcessState::Running && status.figures.pid.is_some_and(|pid| pid != old_pid)
    })
    .await;
    status.figures.pid.unwrap()
}

/// The state letter of `/proc/<pid>/stat`, or `None` when there is no such process.
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

/// Whether `pid` is gone or a zombie (a dead process its new parent has not reaped yet;
/// in a container without an init, nobody ever will).
pub fn is_dead(pid: u32) -> bool {
    matches!(proc_state(pid), None | Some('Z') | Some('X'))
}

/// Whether `pid` exists at all, zombies included (`kill(pid, 0)` answers for zombies).
pub fn exists(pid: u32) -> bool {
    kill(Pid::from_raw(pid as i32), None).is_ok()
}

pub fn read_pid_file(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The pid file of a spec that has one (every spec of [`Fixture::spec`]: the data dir's).
pub fn pid_file_of(spec: &ProcessSpec) -> PathBuf {
    spec.pid_file.clone().expect("a spec in a data dir has a pid file")
}

/// Waits until the file at `path` appears and holds a pid.
pub async fn pid_in_file(path: &Path) -> u32 {
    let mut pid = None;
    eventually(&format!("a pid in {}", path.display()), || {
        pid = read_pid_file(path);
        pid.is_some()
    })
    .await;
    pid.unwrap()
}

/// A temporary data dir, a supervisor, and the kill-everything guard.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub data: DataDir,
    pub supervisor: Supervisor,
    pub mark: String,
}

impl Fixture {
    pub fn new() -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let dir = tempfile::tempdir().expect("temporary directory");
        let mark = format!("{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
        let data = DataDir::open(dir.path()).expect("data dir");
        Self { dir, data, supervisor: Supervisor::new().expect("supervisor"), mark }
    }

    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// A spec running the helper with `args`, with a proxy's environment (`PATH`, `HOME`,
    /// `TETHER_PROXY_ID`, `TETHER_PROXY_TOKEN`) and a token.
    pub fn spec(&self, name: &str, args: &[&str]) -> ProcessSpec {
        let mut spec = ProcessSpec::new(ProcessName::new(name).unwrap(), helper(), &self.data);
        spec.args = args.iter().map(OsString::from).collect();
        let token = format!("token-{}-{name}", self.mark);
        spec.env = vec![
            ("PATH".into(), "/usr/bin:/bin".into()),
            ("HOME".into(), self.data_dir().into()),
            ("TETHER_PROXY_ID".into(), name.into()),
            ("TETHER_PROXY_TOKEN".into(), token.clone().into()),
            (MARK.into(), self.mark.clone().into()),
        ]
        .into();
        spec.identity_env =
            vec![("TETHER_PROXY_ID".into(), name.into()), ("TETHER_PROXY_TOKEN".into(), token.into())].into();
        spec.kill.timeout = Duration::from_secs(5);
        spec
    }

    /// Every live process that carries this fixture's marker.
    pub fn marked_processes(&self) -> Vec<u32> {
        marked_processes(&self.mark)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // Until three scans in a row find nothing: a supervising task that has not ended yet
        // may start one more instance after a kill.
        let start = Instant::now();
        let mut quiet = 0;
        while quiet < 3 && start.elapsed() < DEADLINE {
            let marked = self.marked_processes();
            if marked.is_empty() {
                quiet += 1;
            } else {
                quiet = 0;
                for pid in marked {
                    let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A marker for the processes of one test that needs no data dir, and the guard that kills
/// their process groups when it is dropped, pass or fail.
pub struct Marked {
    pub mark: String,
}

impl Marked {
    pub fn new() -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        Self { mark: format!("standalone-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)) }
    }

    /// The environment entry that marks a process as this test's.
    pub fn env(&self) -> (String, String) {
        (MARK.to_owned(), self.mark.clone())
    }
}

impl Drop for Marked {
    fn drop(&mut self) {
        // Only processes that carry the mark are signalled, so a reused pid is never hit;
        // each leads its own group, and the group takes its children with it.
        let start = Instant::now();
        let mut quiet = 0;
        while quiet < 3 && start.elapsed() < DEADLINE {
            let marked = marked_processes(&self.mark);
            if marked.is_empty() {
                quiet += 1;
            } else {
                quiet = 0;
                for pid in marked {
                    let _ = nix::sys::signal::killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
                    let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

pub fn marked_processes(mark: &str) -> Vec<u32> {
    let needle = format!("{MARK}={mark}");
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .map(|environ| environ.split(|&b| b == 0).any(|entry| entry == needle.as_bytes()))
                .unwrap_or(false)
        })
        .filter(|&pid| !is_dead(pid))
        .collect()
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Prints why a root-only test is skipped; `true` when it must skip.
pub fn skip_unless_root(test: &str) -> bool {
    if is_root() {
        return false;
    }
    #[allow(clippy::print_stderr)] // the reason for a skip belongs in the test output
    {
        eprintln!("skipping {test}: needs root");
    }
    true
}

pub fn send(pid: u32, signal: Signal) {
    kill(Pid::from_raw(pid as i32), signal).expect("signal the test process");
}
