//! The bench's laboratory: a temp dir under /tmp, `tether` agents started in it, a minimal
//! HTTP/1.1 client for their Unix sockets, and the guards that leave nothing running.
//!
//! Cleanup never depends on the bench succeeding: an [`Agent`] dropped while running gets
//! `tether leave` (bounded in time), then SIGKILL to its process group; a [`Flock`] of raw
//! processes is SIGKILLed and reaped; and the [`Lab`], dropped last, SIGKILLs every process
//! whose environment still names one of its agents' sockets, then removes its dir.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};

use super::sys;

/// How often the bench looks at a file or the API while it waits for something.
pub(crate) const POLL: Duration = Duration::from_micros(50);

/// The temp dir of one bench run and the sockets of the agents started in it.
pub(crate) struct Lab {
    pub(crate) tether: PathBuf,
    pub(crate) dir: PathBuf,
    sockets: Mutex<Vec<PathBuf>>,
    /// Set when something failed, so that the dir (and the agents' logs) stay for a look.
    keep: Mutex<bool>,
}

impl Lab {
    pub(crate) fn new(tether: PathBuf) -> Result<Self, String> {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let dir = PathBuf::from(format!("/tmp/tether-bench-{}-{nanos:09}", std::process::id()));
        fs::create_dir_all(&dir).map_err(|err| format!("{}: {err}", dir.display()))?;
        Ok(Self { tether, dir, sockets: Mutex::new(Vec::new()), keep: Mutex::new(false) })
    }

    /// A fresh dir `name` inside the lab.
    pub(crate) fn subdir(&self, name: &str) -> Result<PathBuf, String> {
        let path = self.dir.join(name);
        fs::create_dir_all(&path).map_err(|err| format!("{}: {err}", path.display()))?;
        Ok(path)
    }

    /// Keeps the lab's dir after the run, for its logs.
    pub(crate) fn keep(&self) {
        *self.keep.lock().unwrap_or_else(|e| e.into_inner()) = true;
    }

    fn remember(&self, socket: &Path) {
        let mut sockets = self.sockets.lock().unwrap_or_else(|e| e.into_inner());
        if !sockets.iter().any(|known| known == socket) {
            sockets.push(socket.to_path_buf());
        }
    }

    /// Starts `tether agent` on `config` and `data` with the bench's flags plus `extra`.
    pub(crate) fn agent<'lab>(
        &'lab self,
        name: &str,
        config: &Path,
        data: &Path,
        extra: &[&str],
    ) -> Result<Agent<'lab>, String> {
        let log = self.dir.join(format!("agent-{name}.log"));
        let out = OpenOptions::new().create(true).append(true).open(&log).map_err(|err| format!("{err}"))?;
        let err = out.try_clone().map_err(|err| format!("{err}"))?;
        let socket = data.join("agent.sock");
        self.remember(&socket);
        let mut command = Command::new(&self.tether);
        command
            .arg("agent")
            .arg("--config-dir")
            .arg(config)
            .arg("--data-dir")
            .arg(data)
            .args(["--allow-root", "--sync-quiescent", "20ms"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        let child = command.spawn().map_err(|err| format!("cannot start {}: {err}", self.tether.display()))?;
        Ok(Agent { lab: self, name: name.to_owned(), child: Some(child), data: data.to_path_buf(), socket, log })
    }

    /// Runs `tether leave` for `data`, waiting at most `limit`; true if it succeeded.
    fn leave(&self, data: &Path, limit: Duration) -> Result<bool, String> {
        let mut child = Command::new(&self.tether)
            .arg("leave")
            .arg("--data-dir")
            .arg(data)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|err| format!("cannot run tether leave: {err}"))?;
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = child.try_wait().map_err(|err| format!("tether leave: {err}"))? {
                return Ok(status.success());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Ok(false);
            }
            thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let sockets = self.sockets.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for socket in &sockets {
            let Some(value) = socket.to_str() else { continue };
            for pid in sys::processes_with_env("TETHER_SOCKET", value) {
                eprintln!("xtask: bench: SIGKILL to leftover process {pid} of {value}");
                if let Some(pgid) = sys::process_group(pid) {
                    sys::signal_group(pgid, sys::SIGKILL);
                }
                let _ = sys::signal(pid, sys::SIGKILL);
            }
        }
        // The agents' cgroup subtrees: killed and removed, as the agents left them.
        for entry in fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let name = entry.file_name();
            if name.to_string_lossy().starts_with("agent-") {
                remove_cgroup_subtree(&fs::read_to_string(entry.path()).unwrap_or_default());
            }
        }
        if *self.keep.lock().unwrap_or_else(|e| e.into_inner()) {
            eprintln!("xtask: bench: kept {} for its logs", self.dir.display());
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// Kills whatever is left in the cgroup subtree that an agent's log names, and removes it.
fn remove_cgroup_subtree(log: &str) {
    let Some(subtree) = log
        .lines()
        .filter(|line| line.contains("a cgroup per proxy"))
        .find_map(|line| line.split_whitespace().find_map(|word| word.strip_prefix("subtree=")))
        .map(PathBuf::from)
    else {
        return;
    };
    kill_cgroup(&subtree);
}

/// Kills every process in the cgroup `dir` and below (`cgroup.kill`), and removes it with
/// the cgroups below it, waiting up to 10 s for them to empty.
pub(crate) fn kill_cgroup(dir: &Path) {
    let _ = fs::write(dir.join("cgroup.kill"), "1");
    let deadline = Instant::now() + Duration::from_secs(10);
    while dir.exists() && Instant::now() < deadline {
        for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.path().is_dir() {
                let _ = fs::remove_dir(entry.path());
            }
        }
        if fs::remove_dir(dir).is_err() {
            thread::sleep(Duration::from_millis(10));
        }
    }
}

/// One proxy of `GET /v1/agent/proxies`.
#[derive(Debug, Clone)]
pub(crate) struct ProxyRow {
    pub(crate) id: String,
    pub(crate) state: String,
    pub(crate) pid: Option<u32>,
    /// An overlapping update is in flight: its new instance starts beside this one.
    pub(crate) updating: bool,
}

/// A running `tether agent`, left and killed when dropped.
pub(crate) struct Agent<'lab> {
    lab: &'lab Lab,
    name: String,
    child: Option<Child>,
    pub(crate) data: PathBuf,
    pub(crate) socket: PathBuf,
    log: PathBuf,
}

impl Agent<'_> {
    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The process whose children the agent's proxies are: the keeper (`tether keeper`),
    /// the parent of the proxies it lists (an earlier agent's child, after a restart) or the
    /// one it started; the agent itself before there is one.
    pub(crate) fn proxies_parent(&self) -> u32 {
        let is_keeper = |pid: &u32| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmdline| cmdline.split(|byte| *byte == 0).nth(1) == Some(b"keeper".as_slice()))
        };
        let of_proxies = self
            .proxies()
            .ok()
            .and_then(|proxies| proxies.iter().filter_map(|proxy| proxy.pid).filter_map(sys::parent).find(is_keeper));
        of_proxies.or_else(|| sys::children_of(self.pid()).into_iter().find(is_keeper)).unwrap_or_else(|| self.pid())
    }

    /// The agent's RSS and the private memory of the keeper that is its proxies' parent, in
    /// KiB: what the agent's proxies cost, whichever of the two holds it. The keeper runs the
    /// agent's own program, whose pages it shares with the agent: only what it alone holds
    /// is its own cost.
    pub(crate) fn rss_with_keeper_kib(&self) -> Result<u64, String> {
        let agent = sys::rss_kib(self.pid())?;
        let parent = self.proxies_parent();
        let keeper = if parent == self.pid() { 0 } else { sys::private_kib(parent)? };
        Ok(agent + keeper)
    }

    /// What the agent has logged so far.
    pub(crate) fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Registers a service through the API (`body`: its JSON), refusing any answer but 200.
    pub(crate) fn register(&self, body: &str) -> Result<(), String> {
        let response = request(&self.socket, "PUT", "/v1/agent/service/register", &[], Some(body.as_bytes()))?;
        if response.status != 200 {
            return Err(self.error(&format!(
                "register {body}: {} {}",
                response.status,
                String::from_utf8_lossy(&response.body)
            )));
        }
        Ok(())
    }

    /// An error about this agent, pointing at its log.
    pub(crate) fn error(&self, what: &str) -> String {
        self.lab.keep();
        format!("agent {}: {what} (log: {})", self.name, self.log.display())
    }

    fn check_alive(&mut self) -> Result<(), String> {
        let exited = match self.child.as_mut() {
            Some(child) => child.try_wait().map_err(|err| err.to_string())?,
            None => return Err(self.error("already stopped")),
        };
        match exited {
            Some(status) => Err(self.error(&format!("exited early ({status})"))),
            None => Ok(()),
        }
    }

    /// Waits until the API answers.
    pub(crate) fn wait_healthy(&mut self, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            self.check_alive()?;
            if request(&self.socket, "GET", "/v1/agent/health", &[], None).is_ok_and(|r| r.status == 200) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.error("API not answering"));
            }
            thread::sleep(Duration::from_millis(1));
        }
    }

    /// Every proxy, as the API lists them.
    pub(crate) fn proxies(&self) -> Result<Vec<ProxyRow>, String> {
        let value = self.get_json("/v1/agent/proxies")?;
        let rows = value.as_array().ok_or_else(|| self.error("proxies: not an array"))?;
        Ok(rows.iter().map(proxy_row).collect())
    }

    /// One proxy, as the API shows it.
    pub(crate) fn proxy(&self, id: &str) -> Result<ProxyRow, String> {
        Ok(proxy_row(&self.get_json(&format!("/v1/agent/proxy/{id}"))?))
    }

    fn get_json(&self, path: &str) -> Result<serde_json::Value, String> {
        let response = request(&self.socket, "GET", path, &[], None)?;
        if response.status != 200 {
            return Err(self.error(&format!("GET {path}: {}", response.status)));
        }
        serde_json::from_slice(&response.body).map_err(|err| self.error(&format!("GET {path}: {err}")))
    }

    /// Waits until the API lists `count` proxies, all `running`; returns them and when that
    /// was. While fewer pid files than `count` exist it only counts them, to spare the agent
    /// the cost of answering. When was is the moment the confirming answer was asked for
    /// (the moment the last pid file appeared, if that answer confirms): listing 10 000
    /// proxies takes the agent a few hundred milliseconds that are not bring-up, and a pid
    /// file is written after its process runs.
    pub(crate) fn wait_running(&mut self, count: usize, limit: Duration) -> Result<(Vec<ProxyRow>, Instant), String> {
        let deadline = Instant::now() + limit;
        let mut pids = PidFiles::new(self.data.join("pids"));
        loop {
            self.check_alive()?;
            if pids.count() >= count {
                // The first time round, right after the last pid file appeared.
                let asked = Instant::now();
                // A new agent may not listen yet: an unreachable API is "not yet".
                let rows = self.proxies().unwrap_or_default();
                if rows.len() == count && rows.iter().all(|row| row.state == "running" && row.pid.is_some()) {
                    return Ok((rows, asked));
                }
                thread::sleep(Duration::from_millis(2));
            } else {
                thread::sleep(Duration::from_micros(500));
            }
            if Instant::now() > deadline {
                let running = self.proxies().map_or(0, |rows| rows.iter().filter(|r| r.state == "running").count());
                return Err(self.error(&format!("{running} of {count} proxies running after {limit:?}")));
            }
        }
    }

    /// The pid in the pid file of `proxy`, if there is one.
    pub(crate) fn pid_file(&self, proxy: &str) -> Option<u32> {
        fs::read_to_string(self.data.join("pids").join(format!("{proxy}.pid"))).ok()?.trim().parse().ok()
    }

    /// Sends `signal` to the agent.
    pub(crate) fn signal(&self, signal: sys::Signal) -> Result<(), String> {
        sys::signal(self.pid(), signal)
    }

    /// SIGTERM, then waits for the agent to exit (it leaves its proxies running).
    pub(crate) fn terminate(&mut self, limit: Duration) -> Result<(), String> {
        self.signal(sys::SIGTERM)?;
        self.wait_exit(limit)
    }

    /// Waits for the agent to exit by itself, successfully.
    pub(crate) fn wait_exit(&mut self, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            let Some(child) = self.child.as_mut() else { return Ok(()) };
            if let Some(status) = child.try_wait().map_err(|err| err.to_string())? {
                self.child = None;
                return if status.success() { Ok(()) } else { Err(self.error(&format!("exited with {status}"))) };
            }
            if Instant::now() > deadline {
                return Err(self.error(&format!("still running {limit:?} after being asked to stop")));
            }
            thread::sleep(Duration::from_micros(200));
        }
    }

    /// `tether leave`, then waits for the agent to exit.
    pub(crate) fn leave(&mut self, limit: Duration) -> Result<(), String> {
        if !self.lab.leave(&self.data, limit)? {
            return Err(self.error("tether leave failed"));
        }
        self.wait_exit(limit)
    }
}

impl Drop for Agent<'_> {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        if matches!(child.try_wait(), Ok(None)) && !self.lab.leave(&self.data, Duration::from_secs(20)).unwrap_or(false)
        {
            self.lab.keep();
            eprintln!("xtask: bench: tether leave failed for agent {}", self.name);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        sys::signal_group(child.id(), sys::SIGKILL);
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn proxy_row(row: &serde_json::Value) -> ProxyRow {
    ProxyRow {
        id: row["id"].as_str().unwrap_or_default().to_owned(),
        state: row["state"].as_str().unwrap_or_default().to_owned(),
        pid: row["pid"].as_u64().and_then(|pid| u32::try_from(pid).ok()),
        updating: row.get("update").is_some_and(|update| !update.is_null()),
    }
}

/// The pid files of a data dir, counted as they appear: from inotify events once the
/// directory exists, not by listing it again and again, which at 10 000 entries every
/// half millisecond would take a core from the agent being measured.
struct PidFiles {
    dir: PathBuf,
    watch: Option<Inotify>,
    names: HashSet<OsString>,
}

impl PidFiles {
    fn new(dir: PathBuf) -> Self {
        Self { dir, watch: None, names: HashSet::new() }
    }

    /// How many there are now.
    fn count(&mut self) -> usize {
        let Some(watch) = &self.watch else {
            // Watched first, then listed: a file written in between is seen twice, never missed.
            let flags = InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC;
            let Ok(watch) = Inotify::init(flags) else { return self.list() };
            if watch
                .add_watch(
                    &self.dir,
                    // A pid file appears whole: linked in (a creation) or renamed in.
                    AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO,
                )
                .is_err()
            {
                return 0; // not made yet
            }
            self.watch = Some(watch);
            return self.list();
        };
        while let Ok(events) = watch.read_events() {
            if events.iter().any(|event| event.mask.contains(AddWatchFlags::IN_Q_OVERFLOW)) {
                return self.list();
            }
            self.names.extend(events.into_iter().filter_map(|event| event.name).filter(|name| is_pid_file(name)));
        }
        self.names.len()
    }

    fn list(&mut self) -> usize {
        if let Ok(entries) = fs::read_dir(&self.dir) {
            self.names.extend(entries.flatten().map(|entry| entry.file_name()).filter(|name| is_pid_file(name)));
        }
        self.names.len()
    }
}

fn is_pid_file(name: &OsStr) -> bool {
    name.to_str().is_some_and(|name| name.ends_with(".pid"))
}

/// The proxies of every bring-up: `sleep` for an hour.
pub(crate) const SLEEP: &[&str] = &["/bin/sleep", "3600"];

/// The bring-up baseline: the time to spawn `count` sleeps from this process (logs under
/// the lab's `name` subdir), as a supervisor with no bookkeeping at all would.
pub(crate) fn raw_bring_up(lab: &Lab, name: &str, count: usize) -> Result<Duration, String> {
    let logs = lab.subdir(name)?;
    let mut flock = Flock::default();
    let start = Instant::now();
    for index in 0..count {
        flock.spawn(SLEEP, &logs, &format!("s{index:05}"))?;
    }
    let took = start.elapsed();
    flock.kill_all();
    Ok(took)
}

/// Processes the bench starts itself, each in its own process group, SIGKILLed and reaped
/// when dropped.
#[derive(Default)]
pub(crate) struct Flock {
    pub(crate) children: Vec<Child>,
}

impl Flock {
    /// Spawns `argv` as a proxy would be spawned: own process group, stdin from /dev/null,
    /// stdout and stderr appended to files in `logs`, a clean environment.
    pub(crate) fn spawn(&mut self, argv: &[&str], logs: &Path, name: &str) -> Result<u32, String> {
        let open = |stream: &str| {
            let path = logs.join(format!("{name}-{stream}.log"));
            OpenOptions::new().create(true).append(true).open(&path).map_err(|err| format!("{}: {err}", path.display()))
        };
        let (stdout, stderr): (File, File) = (open("stdout")?, open("stderr")?);
        let child = Command::new(argv[0])
            .args(&argv[1..])
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0)
            .spawn()
            .map_err(|err| format!("cannot spawn {}: {err}", argv[0]))?;
        let pid = child.id();
        self.children.push(child);
        Ok(pid)
    }

    /// SIGKILLs and reaps every process.
    pub(crate) fn kill_all(&mut self) {
        for child in &self.children {
            sys::signal_group(child.id(), sys::SIGKILL);
        }
        for mut child in self.children.drain(..) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Flock {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// An HTTP response: status and body.
pub(crate) struct Response {
    pub(crate) status: u16,
    pub(crate) body: Vec<u8>,
}

/// Writes one HTTP/1.1 request (with `Connection: close`) to `stream`.
pub(crate) fn send(
    stream: &mut impl Write,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> std::io::Result<()> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(body) = body {
        head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut message = head.into_bytes();
    message.extend_from_slice(body.unwrap_or_default());
    stream.write_all(&message)
}

/// One request over the Unix socket `socket`.
pub(crate) fn request(
    socket: &Path,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Result<Response, String> {
    let fail = |err: std::io::Error| format!("{method} {path} on {}: {err}", socket.display());
    let mut stream = UnixStream::connect(socket).map_err(fail)?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).map_err(fail)?;
    send(&mut stream, method, path, headers, body).map_err(fail)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(fail)?;
    parse_response(&raw).ok_or_else(|| format!("{method} {path}: malformed HTTP response"))
}

/// Parses a whole HTTP/1.1 response (read to EOF), with a plain or chunked body.
pub(crate) fn parse_response(raw: &[u8]) -> Option<Response> {
    let split = raw.windows(4).position(|window| window == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let chunked = lines.any(|line| {
        line.split_once(':').is_some_and(|(name, value)| {
            name.eq_ignore_ascii_case("transfer-encoding") && value.trim().eq_ignore_ascii_case("chunked")
        })
    });
    let mut rest = &raw[split + 4..];
    if !chunked {
        return Some(Response { status, body: rest.to_vec() });
    }
    let mut body = Vec::new();
    loop {
        let end = rest.windows(2).position(|window| window == b"\r\n")?;
        let size_text = std::str::from_utf8(&rest[..end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[end + 2..];
        if size == 0 {
            return Some(Response { status, body });
        }
        body.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_chunked_responses_parse() {
        let plain = parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n[]").unwrap();
        assert_eq!((plain.status, plain.body.as_slice()), (200, &b"[]"[..]));
        let chunked = parse_response(
            b"HTTP/1.1 403 Forbidden\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((chunked.status, chunked.body.as_slice()), (403, &b"abcde"[..]));
        assert!(parse_response(b"garbage").is_none());
    }
}
