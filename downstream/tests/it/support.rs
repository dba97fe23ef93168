//! What the tests share: services and catalogs, deadlines for waits, and the guard that kills
//! every process a test started, even when the test fails.

use std::ffi::OsString;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tether_state::{
    CommandLine, LocalState, ProxyCommand, ProxyId, ProxySpec, Service, ServiceId, ServiceName, Source,
};

/// How long a wait on real processes may take before the test fails.
pub const LIMIT: Duration = Duration::from_secs(10);

/// How long a wait on the paused clock may take: far beyond any backoff of these tests.
pub const PAUSED_LIMIT: Duration = Duration::from_secs(600);

/// The environment variable that marks every process a test starts, for its guard.
const MARK: &str = "TETHER_DOWNSTREAM_TEST_MARK";

/// A service `name` with a proxy of the default spec (the built-in proxy).
pub fn service(name: &str) -> Service {
    Service::new(ServiceId::new(name).unwrap(), ServiceName::new(name).unwrap()).with_proxy(ProxySpec::default())
}

/// The id of service `name`'s proxy.
pub fn id(name: &str) -> ProxyId {
    ServiceId::new(name).unwrap().proxy_id()
}

/// A catalog that wants `services`.
pub fn catalog(services: &[Service]) -> LocalState {
    let catalog = LocalState::new();
    for service in services {
        catalog.upsert(service.clone(), Source::Api).unwrap();
    }
    catalog
}

/// Awaits `future`, failing the test with `what` if it takes longer than [`LIMIT`].
pub async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(LIMIT, future).await {
        Ok(value) => value,
        Err(_elapsed) => panic!("timed out after {LIMIT:?} waiting for {what}"),
    }
}

/// Whether `pid` is gone: `kill(pid, 0)` answers for any process, zombies included, so this
/// also proves that it was reaped.
pub fn is_gone(pid: u32) -> bool {
    kill(Pid::from_raw(pid as i32), None) == Err(Errno::ESRCH)
}

/// Ends process `pid` from outside, as a crash would.
pub fn crash(pid: u32) {
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).expect("signal the test's process");
}

/// A temporary directory for processes' logs, and the guard that kills, when dropped, every
/// process started with [`Processes::marked`]'s environment.
pub struct Processes {
    dir: tempfile::TempDir,
    mark: String,
}

impl Processes {
    pub fn new() -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let dir = tempfile::tempdir().expect("a temporary directory");
        let mark = format!("{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
        Self { dir, mark }
    }

    /// The directory the processes' logs go to.
    pub fn logs(&self) -> std::path::PathBuf {
        self.dir.path().join("logs")
    }

    /// The environment entry that marks a process as this guard's.
    pub fn marked(&self) -> (OsString, OsString) {
        (MARK.into(), self.mark.clone().into())
    }

    /// A service `name` whose proxy runs `command`, marked as this guard's.
    pub fn service(&self, name: &str, command: &[&str]) -> Service {
        let words = command.iter().map(|word| (*word).to_owned()).collect();
        let mut spec =
            ProxySpec { command: ProxyCommand::Exec(CommandLine::from_words(words).unwrap()), ..ProxySpec::default() };
        spec.env.insert(MARK.to_owned(), self.mark.clone());
        spec.kill.timeout = Duration::from_secs(2);
        Service::new(ServiceId::new(name).unwrap(), ServiceName::new(name).unwrap()).with_proxy(spec)
    }

    /// Waits until the live processes that carry this guard's mark are `expected`, failing the
    /// test after [`LIMIT`]. A process shows the mark once it has executed its program, which
    /// may be a moment after its spawn returned.
    pub async fn wait_until_running(&self, expected: &[u32]) {
        let start = Instant::now();
        loop {
            let running = self.running();
            if running == expected {
                return;
            }
            assert!(
                start.elapsed() < LIMIT,
                "timed out after {LIMIT:?} waiting until the marked processes are {expected:?}; last seen: {running:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Every live process that carries this guard's mark, sorted.
    pub fn running(&self) -> Vec<u32> {
        let needle = format!("{MARK}={}", self.mark);
        let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
        let mut pids: Vec<u32> = entries
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|environ| environ.split(|&byte| byte == 0).any(|entry| entry == needle.as_bytes()))
            })
            .filter(|&pid| !is_zombie(pid))
            .collect();
        pids.sort_unstable();
        pids
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        // Until three scans in a row find nothing: a supervising task that has not ended yet
        // may start one more instance after a kill.
        let start = Instant::now();
        let mut quiet = 0;
        while quiet < 3 && start.elapsed() < LIMIT {
            let marked = self.running();
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

/// Whether `pid` is a zombie: dead, and not yet reaped by its parent (in a container
/// without an init, an orphan never is).
fn is_zombie(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let state = stat.rfind(')').and_then(|end| stat[end + 1..].trim_start().chars().next());
    matches!(state, Some('Z' | 'X'))
}
