//! The simulated fleet: 20 agents on this machine, each with its own node name and data
//! dir, following one etcd; 2 000 puts spread over the nodes (100 `/bin/sleep` proxies per
//! agent); the time until every proxy runs, and the etcd-to-running latency of each put.
//!
//! Keys are written through etcd's JSON gateway (`POST /v3/kv/put`, base64), so that the
//! bench needs only `etcd` and std. A put's latency runs from etcd's answer to the put (the
//! value is committed) to the mtime of the proxy's pid file, which the backend writes as it
//! spawns the process; convergence is checked through each agent's API. Everything runs in
//! a temp dir under /tmp, and a guard stops every agent, proxy and etcd, even on failure.

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;

use super::report::{ms, percentile, secs};

/// Agents in the fleet.
const AGENTS: usize = 20;
/// Puts in all, spread round-robin over the agents' nodes.
const PUTS: usize = 2_000;
/// The agents' coalescing: quick enough that the figure shows the fleet path, not the wait.
const SYNC_QUIESCENT: &str = "50ms";
const SYNC_MAX_DELAY: &str = "500ms";
/// How long any phase may take before the bench gives up.
const LIMIT: Duration = Duration::from_secs(180);

/// Runs the simulated fleet with the `tether` binary at `tether`; returns (figure, value) rows.
pub(crate) fn run(_root: &Path, tether: &Path) -> Result<Vec<(String, String)>, String> {
    let etcd_binary = find_on_path("etcd").ok_or("no etcd binary on PATH (apt-get install etcd-server)")?;
    let dir = std::env::temp_dir().join(format!("tether-fleet-bench-{}", std::process::id()));
    fs::create_dir_all(&dir).map_err(|err| format!("cannot create {}: {err}", dir.display()))?;
    let mut fleet = Fleet { dir, etcd: None, etcd_port: 0, agents: Vec::new(), tether: tether.to_owned() };
    let result = fleet.run(&etcd_binary);
    fleet.stop();
    if result.is_ok() {
        let _ = fs::remove_dir_all(&fleet.dir);
    } else {
        eprintln!("xtask: bench: fleet: logs kept in {}", fleet.dir.display());
    }
    result
}

struct Fleet {
    dir: PathBuf,
    etcd: Option<Child>,
    etcd_port: u16,
    agents: Vec<(Child, PathBuf)>,
    tether: PathBuf,
}

impl Fleet {
    fn run(&mut self, etcd_binary: &Path) -> Result<Vec<(String, String)>, String> {
        self.start_etcd(etcd_binary)?;
        let root = fs::metadata("/proc/self").map(|meta| meta.uid() == 0).unwrap_or(false);
        for index in 0..AGENTS {
            let data = self.dir.join(format!("agent-{index}"));
            let log = fs::File::create(self.dir.join(format!("agent-{index}.log"))).map_err(|err| err.to_string())?;
            let mut command = Command::new(&self.tether);
            command
                .arg("agent")
                .arg("--data-dir")
                .arg(&data)
                .args(["--etcd", &self.etcd_url(), "--node", &node(index)])
                .args(["--sync-quiescent", SYNC_QUIESCENT, "--sync-max-delay", SYNC_MAX_DELAY, "--log-format", "json"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log);
            if root {
                command.arg("--allow-root");
            }
            let child = command.spawn().map_err(|err| format!("cannot start {}: {err}", self.tether.display()))?;
            self.agents.push((child, data));
        }
        for (_, data) in &self.agents {
            let socket = data.join("agent.sock");
            wait(&format!("the agent on {}", data.display()), || {
                Ok(http_unix(&socket, "GET", "/v1/agent/fleet")?.contains("\"connected\":true"))
            })?;
        }

        let mut committed = Vec::with_capacity(PUTS);
        let start = Instant::now();
        let start_wall = SystemTime::now();
        for put in 0..PUTS {
            let (index, service) = (put % AGENTS, format!("s{}", put / AGENTS));
            let key = format!("/tether/nodes/{}/services/{service}", node(index));
            let value = format!(
                r#"{{"name": "{service}", "proxy": {{"command": ["/bin/sleep", "3600"], "kill_timeout": "1s"}}}}"#
            );
            let body = format!(r#"{{"key": "{}", "value": "{}"}}"#, BASE64.encode(key), BASE64.encode(value));
            http_tcp(self.etcd_port, "/v3/kv/put", &body)?;
            committed.push((index, format!("{service}-proxy"), SystemTime::now()));
        }
        let puts_took = start.elapsed();

        let per_agent = PUTS / AGENTS;
        for (_, data) in &self.agents {
            let socket = data.join("agent.sock");
            wait(&format!("{per_agent} proxies running on {}", data.display()), || {
                let body = http_unix(&socket, "GET", "/v1/agent/proxies")?;
                Ok(body.matches("\"state\":\"running\"").count() == per_agent)
            })?;
        }
        let converged = start.elapsed();

        let mut latencies = Vec::with_capacity(PUTS);
        for (index, proxy, at) in &committed {
            let pid_file = self.agents[*index].1.join("pids").join(format!("{proxy}.pid"));
            let spawned = fs::metadata(&pid_file)
                .and_then(|meta| meta.modified())
                .map_err(|err| format!("{}: {err}", pid_file.display()))?;
            latencies.push(spawned.duration_since(*at).unwrap_or(Duration::ZERO));
        }
        let last_spawn = committed
            .iter()
            .filter_map(|(index, proxy, _)| {
                fs::metadata(self.agents[*index].1.join("pids").join(format!("{proxy}.pid"))).ok()?.modified().ok()
            })
            .max()
            .and_then(|last| last.duration_since(start_wall).ok())
            .unwrap_or(converged);
        latencies.sort();
        let rows = vec![
            ("fleet: agents × proxies each".to_owned(), format!("{AGENTS} × {per_agent} (one etcd)")),
            (
                "fleet: agent coalescing".to_owned(),
                format!("--sync-quiescent {SYNC_QUIESCENT} --sync-max-delay {SYNC_MAX_DELAY}"),
            ),
            (
                format!("fleet: {PUTS} puts written"),
                format!("{:.2} s ({:.0} puts/s)", puts_took.as_secs_f64(), PUTS as f64 / puts_took.as_secs_f64()),
            ),
            ("fleet: time to converge (first put → last proxy spawned)".to_owned(), secs(last_spawn)),
            ("fleet: time to converge (first put → every agent's API reports all running)".to_owned(), secs(converged)),
            ("fleet: time to converge after the last put".to_owned(), ms(converged.saturating_sub(puts_took))),
            ("fleet: etcd-to-running latency, median".to_owned(), ms(percentile(&latencies, 50.0))),
            ("fleet: etcd-to-running latency, p99".to_owned(), ms(percentile(&latencies, 99.0))),
            ("fleet: etcd-to-running latency, max".to_owned(), ms(percentile(&latencies, 100.0))),
        ];
        Ok(rows)
    }

    fn etcd_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.etcd_port)
    }

    fn start_etcd(&mut self, binary: &Path) -> Result<(), String> {
        self.etcd_port = free_port()?;
        let peer = format!("http://127.0.0.1:{}", free_port()?);
        let log = fs::File::create(self.dir.join("etcd.log")).map_err(|err| err.to_string())?;
        let child = Command::new(binary)
            .arg("--name=bench")
            .arg(format!("--data-dir={}", self.dir.join("etcd").display()))
            .arg(format!("--listen-client-urls={}", self.etcd_url()))
            .arg(format!("--advertise-client-urls={}", self.etcd_url()))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=bench={peer}"))
            .args(["--logger=zap", "--log-level=warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|err| format!("cannot start etcd: {err}"))?;
        self.etcd = Some(child);
        wait("etcd", || Ok(http_tcp(self.etcd_port, "/v3/kv/range", r#"{"key": "AA=="}"#).is_ok()))
    }

    /// Stops every proxy (`tether leave`, bounded), every agent and etcd.
    fn stop(&mut self) {
        let leaves: Vec<Child> = self
            .agents
            .iter()
            .filter_map(|(_, data)| {
                Command::new(&self.tether)
                    .arg("leave")
                    .arg("--data-dir")
                    .arg(data)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .ok()
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        for mut leave in leaves {
            while leave.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(20));
            }
            let _ = leave.kill();
            let _ = leave.wait();
        }
        for (child, data) in &mut self.agents {
            let _ = child.kill();
            let _ = child.wait();
            kill_proxies_of(&data.join("agent.sock"));
        }
        self.agents.clear();
        if let Some(mut etcd) = self.etcd.take() {
            let _ = etcd.kill();
            let _ = etcd.wait();
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop();
    }
}

fn node(index: usize) -> String {
    format!("node-{index:02}")
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| candidate.is_file())
}

fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|err| format!("no free loopback port: {err}"))?;
    listener.local_addr().map(|addr| addr.port()).map_err(|err| err.to_string())
}

/// Polls `done` until it says yes, or fails after [`LIMIT`] with `what`.
fn wait(what: &str, mut done: impl FnMut() -> Result<bool, String>) -> Result<(), String> {
    let start = Instant::now();
    let mut last = String::new();
    loop {
        match done() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(err) => last = err,
        }
        if start.elapsed() > LIMIT {
            return Err(format!("timed out after {}s waiting for {what} {last}", LIMIT.as_secs()));
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// One POST to etcd's JSON gateway; the body of a 200 answer.
fn http_tcp(port: u16, path: &str, body: &str) -> Result<String, String> {
    let stream = TcpStream::connect(("127.0.0.1", port)).map_err(|err| format!("etcd: {err}"))?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    exchange(stream, &request)
}

/// One request to an agent's socket; the body of a 200 answer.
fn http_unix(socket: &Path, method: &str, path: &str) -> Result<String, String> {
    let stream = UnixStream::connect(socket).map_err(|err| format!("{}: {err}", socket.display()))?;
    let request = format!("{method} {path} HTTP/1.1\r\nHost: tether\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
    exchange(stream, &request)
}

fn exchange(mut stream: impl Read + Write, request: &str) -> Result<String, String> {
    stream.write_all(request.as_bytes()).map_err(|err| err.to_string())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(|err| err.to_string())?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("no HTTP head")?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(head.lines().next().unwrap_or_default().to_owned());
    }
    Ok(body.to_owned())
}

/// SIGKILLs the process group of every live process whose environment names `socket`.
fn kill_proxies_of(socket: &Path) {
    let needle = format!("TETHER_SOCKET={}", socket.display());
    let Ok(entries) = fs::read_dir("/proc") else { return };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<i32>().ok()) else { continue };
        let Ok(environ) = fs::read(entry.path().join("environ")) else { continue };
        if environ.split(|byte| *byte == 0).any(|var| var == needle.as_bytes()) {
            let pid = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
}
