//! The simulated fleet: 20 agents on this machine, each with its own node name and data
//! dir, following one etcd; 2 000 puts spread over the nodes (100 `/bin/sleep` proxies per
//! agent); the time until every proxy runs, and the etcd-to-running latency of each put.
//!
//! Keys are written through etcd's JSON gateway (`POST /v3/kv/put`, base64), so that the
//! bench needs only `etcd` and std. A put's latency runs from etcd's answer to the put (the
//! value is committed) to the mtime of the proxy's pid file, which the backend writes as it
//! spawns the process; convergence is checked through each agent's API. Everything runs in
//! a temp dir under /tmp, and a guard stops every agent, proxy and etcd, even on failure.
//!
//! Then the status the agents publish: how long a proxy's restart (its new pid file) takes
//! to show in its status key, which `tether fleet status` reads; and etcd's write rate (its
//! revision, which every write transaction moves) while the fleet is idle and while one
//! agent's proxies restart 10 times a second.
//!
//! Last, a burst on one node: 10 000 puts over its 100 keys, as fast as one keep-alive
//! connection writes them; how long after the last put the agent has applied it and
//! published every proxy on its final revision, in how many change sets, and how long its
//! API takes to answer meanwhile.

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
                .args(["--log-format", "json"])
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
        let mut rows = vec![
            ("fleet: agents × proxies each".to_owned(), format!("{AGENTS} × {per_agent} (one etcd)")),
            (
                "fleet: agent coalescing".to_owned(),
                "the defaults (--sync-quiescent 500ms --sync-max-delay 5s)".to_owned(),
            ),
            (
                format!("fleet: {PUTS} puts written"),
                format!("{:.2} s ({:.0} puts/s)", puts_took.as_secs_f64(), PUTS as f64 / puts_took.as_secs_f64()),
            ),
            ("fleet: time to converge (first put → last proxy spawned)".to_owned(), secs(last_spawn)),
            ("fleet: time to converge (first put → every agent's API reports all running)".to_owned(), secs(converged)),
            ("fleet: time to converge after the last put".to_owned(), ms(converged.saturating_sub(puts_took))),
            ("fleet: etcd-to-running latency, median (target ≤ 20 ms)".to_owned(), ms(percentile(&latencies, 50.0))),
            ("fleet: etcd-to-running latency, p99 (target ≤ 100 ms)".to_owned(), ms(percentile(&latencies, 99.0))),
            ("fleet: etcd-to-running latency, max".to_owned(), ms(percentile(&latencies, 100.0))),
        ];
        rows.extend(self.status_figures()?);
        rows.extend(self.burst_figures()?);
        Ok(rows)
    }

    /// 10 000 puts on node-00's 100 keys: convergence after the last put, change sets, and
    /// the agent's API meanwhile.
    fn burst_figures(&self) -> Result<Vec<(String, String)>, String> {
        const BURST: usize = 10_000;
        let keys = PUTS / AGENTS;
        let socket = self.agents[0].1.join("agent.sock");
        let applies_before = applies(&socket)?;
        // The agent's API, asked back to back while the burst runs: its slowest answer.
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let asking = {
            let (socket, done) = (socket.clone(), done.clone());
            thread::spawn(move || {
                let mut slowest = Duration::ZERO;
                let mut answers = 0_u64;
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let asked = Instant::now();
                    http_unix(&socket, "GET", "/v1/agent/proxies")?;
                    slowest = slowest.max(asked.elapsed());
                    answers += 1;
                }
                Ok::<_, String>((slowest, answers))
            })
        };
        let mut gateway = Gateway::connect(self.etcd_port)?;
        let start = Instant::now();
        let mut last = vec![0_i64; keys];
        for put in 0..BURST {
            let service = format!("s{}", put % keys);
            let key = format!("/tether/nodes/{}/services/{service}", node(0));
            let value = format!(
                r#"{{"name": "{service}", "meta": {{"put": "{put}"}}, "proxy": {{"command": ["/bin/sleep", "3600"], "kill_timeout": "1s"}}}}"#
            );
            last[put % keys] = gateway.put(&key, &value)?;
        }
        let written = start.elapsed();
        let last_put = Instant::now();
        let final_revision = last.iter().copied().max().unwrap_or(0);
        wait("node-00 to apply the burst's last put", || {
            let body = http_unix(&socket, "GET", "/v1/agent/fleet")?;
            let status: serde_json::Value = serde_json::from_str(&body).map_err(|err| err.to_string())?;
            Ok(status["revision"].as_i64() >= Some(final_revision))
        })?;
        let applied = last_put.elapsed();
        wait("node-00 to publish every proxy on its final revision", || {
            let published = self.published_revisions(0)?;
            Ok((0..keys).all(|key| published.get(&format!("s{key}-proxy")) == Some(&last[key])))
        })?;
        let published = last_put.elapsed();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let (slowest, answers) = asking.join().map_err(|_| "the API asker panicked".to_owned())??;
        let change_sets = applies(&socket)? - applies_before;
        Ok(vec![
            (
                format!("fleet burst: {BURST} puts on one node's {keys} keys written (one connection)"),
                format!("{:.2} s ({:.0} puts/s)", written.as_secs_f64(), BURST as f64 / written.as_secs_f64()),
            ),
            ("fleet burst: last put → applied by its agent".to_owned(), ms(applied)),
            ("fleet burst: last put → every proxy published on its final revision".to_owned(), ms(published)),
            (format!("fleet burst: change sets applied for {BURST} puts"), change_sets.to_string()),
            (format!("fleet burst: the agent's API during the burst, slowest of {answers} answers"), ms(slowest)),
        ])
    }

    /// The `revision` of every proxy that agent `index` publishes, by proxy id.
    fn published_revisions(&self, index: usize) -> Result<std::collections::BTreeMap<String, i64>, String> {
        let prefix = format!("/tether/status/{}/proxies/", node(index));
        let end = format!("/tether/status/{}/proxies0", node(index));
        let body = http_tcp(
            self.etcd_port,
            "/v3/kv/range",
            &format!(r#"{{"key": "{}", "range_end": "{}"}}"#, BASE64.encode(&prefix), BASE64.encode(end)),
        )?;
        let value: serde_json::Value = serde_json::from_str(&body).map_err(|err| err.to_string())?;
        let decode = |field: &serde_json::Value| -> Option<Vec<u8>> { BASE64.decode(field.as_str()?).ok() };
        let mut revisions = std::collections::BTreeMap::new();
        for kv in value["kvs"].as_array().into_iter().flatten() {
            let (Some(key), Some(raw)) = (decode(&kv["key"]), decode(&kv["value"])) else { continue };
            let status: serde_json::Value = serde_json::from_slice(&raw).map_err(|err| err.to_string())?;
            let proxy = String::from_utf8_lossy(&key).trim_start_matches(&prefix).to_owned();
            if let Some(revision) = status["revision"].as_i64() {
                revisions.insert(proxy, revision);
            }
        }
        Ok(revisions)
    }

    /// The store's revision now.
    fn revision(&self) -> Result<i64, String> {
        let body = http_tcp(self.etcd_port, "/v3/kv/range", r#"{"key": "AA=="}"#)?;
        let value: serde_json::Value = serde_json::from_str(&body).map_err(|err| err.to_string())?;
        value["header"]["revision"].as_str().and_then(|r| r.parse().ok()).ok_or_else(|| format!("no revision: {body}"))
    }

    /// The status key of `proxy` on agent `index`, parsed (`Null` while there is none).
    fn published(&self, index: usize, proxy: &str) -> Result<serde_json::Value, String> {
        let key = format!("/tether/status/{}/proxies/{proxy}", node(index));
        let body = http_tcp(self.etcd_port, "/v3/kv/range", &format!(r#"{{"key": "{}"}}"#, BASE64.encode(key)))?;
        let value: serde_json::Value = serde_json::from_str(&body).map_err(|err| err.to_string())?;
        let Some(encoded) = value["kvs"][0]["value"].as_str() else { return Ok(serde_json::Value::Null) };
        let raw = BASE64.decode(encoded).map_err(|err| err.to_string())?;
        serde_json::from_slice(&raw).map_err(|err| err.to_string())
    }

    /// The pid in a proxy's pid file.
    fn pid_of(&self, index: usize, proxy: &str) -> Result<i32, String> {
        let path = self.agents[index].1.join("pids").join(format!("{proxy}.pid"));
        let text = fs::read_to_string(&path).map_err(|err| format!("{}: {err}", path.display()))?;
        text.split_whitespace()
            .next()
            .and_then(|pid| pid.parse().ok())
            .ok_or_else(|| format!("{}: no pid", path.display()))
    }

    /// Kills `proxy` of agent `index`; returns its old pid.
    fn kill_proxy(&self, index: usize, proxy: &str) -> Result<i32, String> {
        let pid = self.pid_of(index, proxy)?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)
            .map_err(|err| format!("kill {pid}: {err}"))?;
        Ok(pid)
    }

    /// etcd write transactions per second over `window`, from the store's revision.
    fn write_rate(&self, window: Duration, mut during: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
        let before = self.revision()?;
        let start = Instant::now();
        while start.elapsed() < window {
            during()?;
        }
        let after = self.revision()?;
        Ok((after - before) as f64 / start.elapsed().as_secs_f64())
    }

    /// Restart-to-visible latency and etcd write rates of the status the agents publish.
    fn status_figures(&self) -> Result<Vec<(String, String)>, String> {
        // Every proxy published running: the fleet is settled.
        wait("every proxy's status published", || {
            (0..AGENTS)
                .try_fold(true, |all, index| Ok(all && self.published(index, "s99-proxy")?["state"] == "running"))
        })?;
        let window = Duration::from_secs(5);
        let idle = self.write_rate(window, || {
            thread::sleep(Duration::from_millis(100));
            Ok(())
        })?;
        // Restarts one at a time over the agents: from the new pid file to the new pid in the key.
        const RESTARTS: usize = 100;
        let mut visible = Vec::with_capacity(RESTARTS);
        for restart in 0..RESTARTS {
            let (index, proxy) = (restart % AGENTS, format!("s{}-proxy", 50 + restart / AGENTS));
            let old = self.kill_proxy(index, &proxy)?;
            let mut new = 0;
            wait(&format!("{proxy} of {} to restart", node(index)), || {
                new = self.pid_of(index, &proxy).unwrap_or(old);
                Ok(new != old)
            })?;
            let pid_file = self.agents[index].1.join("pids").join(format!("{proxy}.pid"));
            let spawned = fs::metadata(&pid_file).and_then(|meta| meta.modified()).map_err(|err| err.to_string())?;
            wait(&format!("{proxy} of {} to show its new pid", node(index)), || {
                let status = self.published(index, &proxy)?;
                Ok(status["pid"].as_i64() == Some(i64::from(new)) && status["state"] == "running")
            })?;
            visible.push(SystemTime::now().duration_since(spawned).unwrap_or(Duration::ZERO));
        }
        visible.sort();
        // 10 restarts a second on one agent (node-00), distinct proxies so that none backs off.
        let mut next = 0;
        let mut due = Instant::now();
        let busy = self.write_rate(window, || {
            if Instant::now() >= due {
                self.kill_proxy(0, &format!("s{next}-proxy"))?;
                next += 1;
                due += Duration::from_millis(100);
            }
            thread::sleep(Duration::from_millis(5));
            Ok(())
        })?;
        Ok(vec![
            (
                format!("fleet status: a proxy restart → visible in its status key, median ({RESTARTS} restarts)"),
                ms(percentile(&visible, 50.0)),
            ),
            (
                "fleet status: a proxy restart → visible, p99 (target ≤ 200 ms)".to_owned(),
                ms(percentile(&visible, 99.0)),
            ),
            (
                "fleet status: etcd write transactions/s per agent, idle (target 0)".to_owned(),
                format!("{:.2}", idle / AGENTS as f64),
            ),
            (
                "fleet status: etcd write transactions/s of one agent with 10 restarts/s".to_owned(),
                format!("{busy:.1}"),
            ),
        ])
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

pub(super) fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| candidate.is_file())
}

pub(super) fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|err| format!("no free loopback port: {err}"))?;
    listener.local_addr().map(|addr| addr.port()).map_err(|err| err.to_string())
}

/// Polls `done` until it says yes, or fails after [`LIMIT`] with `what`.
pub(super) fn wait(what: &str, mut done: impl FnMut() -> Result<bool, String>) -> Result<(), String> {
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
pub(super) fn http_tcp(port: u16, path: &str, body: &str) -> Result<String, String> {
    let stream = TcpStream::connect(("127.0.0.1", port)).map_err(|err| format!("etcd: {err}"))?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    exchange(stream, &request)
}

/// `tether_fleet_applies_total` of the agent at `socket`.
fn applies(socket: &Path) -> Result<u64, String> {
    let metrics = http_unix(socket, "GET", "/metrics")?;
    metrics
        .lines()
        .find_map(|line| line.strip_prefix("tether_fleet_applies_total ")?.trim().parse().ok())
        .ok_or_else(|| "no tether_fleet_applies_total".to_owned())
}

/// A keep-alive connection to etcd's JSON gateway, for a burst of puts.
struct Gateway {
    reader: std::io::BufReader<TcpStream>,
}

impl Gateway {
    fn connect(port: u16) -> Result<Self, String> {
        let stream = TcpStream::connect(("127.0.0.1", port)).map_err(|err| format!("etcd: {err}"))?;
        stream.set_read_timeout(Some(LIMIT)).map_err(|err| err.to_string())?;
        Ok(Self { reader: std::io::BufReader::new(stream) })
    }

    /// Puts `value` at `key`; returns the put's revision.
    fn put(&mut self, key: &str, value: &str) -> Result<i64, String> {
        use std::io::BufRead;
        let failed = |err: std::io::Error| format!("etcd: {err}");
        let body = format!(r#"{{"key": "{}", "value": "{}"}}"#, BASE64.encode(key), BASE64.encode(value));
        let request = format!(
            "POST /v3/kv/put HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.reader.get_mut().write_all(request.as_bytes()).map_err(failed)?;
        let mut status = String::new();
        self.reader.read_line(&mut status).map_err(failed)?;
        if !status.starts_with("HTTP/1.1 200") {
            return Err(format!("etcd: {}", status.trim_end()));
        }
        let mut length = 0;
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line).map_err(failed)? == 0 {
                return Err("etcd closed the connection".to_owned());
            }
            if line == "\r\n" {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().map_err(|_| format!("etcd: {}", line.trim_end()))?;
            }
        }
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body).map_err(failed)?;
        let value: serde_json::Value = serde_json::from_slice(&body).map_err(|err| err.to_string())?;
        value["header"]["revision"].as_str().and_then(|r| r.parse().ok()).ok_or_else(|| "no revision".to_owned())
    }
}

/// One request to an agent's socket; the body of a 200 answer.
pub(super) fn http_unix(socket: &Path, method: &str, path: &str) -> Result<String, String> {
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
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return Ok(body.to_owned());
    }
    // A large answer comes in chunks: each a hex length line, then that many bytes.
    let (mut rest, mut whole) = (body, String::new());
    loop {
        let (size, after) = rest.split_once("\r\n").ok_or("a truncated chunk")?;
        let size = usize::from_str_radix(size.trim(), 16).map_err(|_| "a bad chunk length")?;
        if size == 0 {
            return Ok(whole);
        }
        whole.push_str(after.get(..size).ok_or("a truncated chunk")?);
        rest = after.get(size + 2..).ok_or("a truncated chunk")?;
    }
}

/// SIGKILLs the process group of every live process whose environment names `socket`.
pub(super) fn kill_proxies_of(socket: &Path) {
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
