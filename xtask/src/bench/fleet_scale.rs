//! The fleet at scale: 300 agents on this machine, each with its own node name and data dir
//! and 10 `/bin/sleep` proxies, following a three-member etcd cluster on loopback (every
//! agent given every member's endpoint).
//!
//! Measured: one change to a service on every node (300 puts) until each node's proxy runs
//! the new version (from etcd's answer to the put to the mtime of the new pid file, which the
//! backend writes as it spawns), median, p99 and max; a rollout of a new version of one
//! service over the 300 nodes, 20 at a time, by `tether fleet rollout`; and from the
//! members' own metrics and API, the watchers the agents hold, the leases, keys and database
//! size, the gRPC messages and lease keep-alives a second while idle, the revisions (write
//! transactions) a second while idle, and the gRPC messages and bytes etcd handles for one
//! change. These are what docs/operations.md projects to larger fleets. Everything runs in a
//! temp dir under /tmp; a guard stops every agent, proxy and member, even on failure.
//!
//! 300 agents on one host hold more inotify instances than the kernel's default per-user
//! limit (`fs.inotify.max_user_instances`, often 128) allows: as root the bench raises it for
//! its run and puts it back afterwards, also on failure; otherwise it stops at once, naming
//! the setting.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;

use super::fleet::{find_on_path, free_port, http_tcp, http_unix, kill_proxies_of, wait};
use super::report::{ms, percentile, secs};
use super::sys;

/// Agents in the fleet.
const AGENTS: usize = 300;
/// Proxies per agent.
const PER_AGENT: usize = 10;
/// Nodes written at once by the rollout.
const PARALLEL: usize = 20;
/// How long the idle rates are measured over.
const IDLE: Duration = Duration::from_secs(10);
/// The inotify instances an agent and its keeper hold, at most (cgroup events, the watched
/// pid files, the log rotator): with room to spare.
const INOTIFY_PER_AGENT: u64 = 4;
/// Inotify instances left for the rest of the machine's processes of the same user.
const INOTIFY_HEADROOM: u64 = 256;
/// The sysctl that caps inotify instances per user.
const INOTIFY_INSTANCES: &str = "fs.inotify.max_user_instances";

/// Lease keep-alives received, as etcd counts them (a sample per member).
const KEEP_ALIVES: &str = r#"grpc_server_msg_received_total{grpc_method="LeaseKeepAlive""#;
/// Every gRPC message received (unary requests and stream messages), all methods.
const MESSAGES: &str = "grpc_server_msg_received_total{";
const MIB: f64 = 1024.0 * 1024.0;

/// Runs the fleet at scale with the `tether` binary at `tether`; returns (figure, value) rows.
pub(crate) fn run(tether: &Path) -> Result<Vec<(String, String)>, String> {
    let etcd = find_on_path("etcd").ok_or("no etcd binary on PATH (apt-get install etcd-server)")?;
    let needed = AGENTS as u64 * INOTIFY_PER_AGENT + INOTIFY_HEADROOM;
    // Declared before the fleet, so dropped after it: put back once every agent is gone.
    let raised = sys::sysctl_at_least(INOTIFY_INSTANCES, needed, &format!("{AGENTS} agents on one host"))?;
    let inotify = match &raised {
        Some(raised) => format!("{needed} for the run (was {}, put back after)", raised.old()),
        None => format!("{} (left as it was)", sys::read_sysctl(INOTIFY_INSTANCES)?),
    };
    let dir = std::env::temp_dir().join(format!("tether-fleet-scale-{}", std::process::id()));
    fs::create_dir_all(&dir).map_err(|err| format!("cannot create {}: {err}", dir.display()))?;
    let mut fleet = Fleet { dir, members: Vec::new(), agents: Vec::new(), tether: tether.to_owned() };
    let result = fleet.run(&etcd).map(|mut rows| {
        rows.insert(1, (format!("fleet at scale: {INOTIFY_INSTANCES}"), inotify));
        rows
    });
    fleet.stop();
    drop(raised);
    if result.is_ok() {
        let _ = fs::remove_dir_all(&fleet.dir);
    } else {
        eprintln!("xtask: bench: fleet-scale: logs kept in {}", fleet.dir.display());
    }
    result
}

struct Fleet {
    dir: PathBuf,
    /// Each member's process and client port.
    members: Vec<(Child, u16)>,
    agents: Vec<(Child, PathBuf)>,
    tether: PathBuf,
}

fn node(index: usize) -> String {
    format!("n{index:03}")
}

fn service_value(name: &str, seconds: u32) -> String {
    format!(r#"{{"name": "{name}", "proxy": {{"command": ["/bin/sleep", "{seconds}"], "kill_timeout": "1s"}}}}"#)
}

impl Fleet {
    fn run(&mut self, etcd: &Path) -> Result<Vec<(String, String)>, String> {
        self.start_cluster(etcd)?;
        let urls = self.urls();
        let root = sys::is_root();
        let started = Instant::now();
        for index in 0..AGENTS {
            let data = self.dir.join(format!("agent-{index}"));
            let log = fs::File::create(self.dir.join(format!("agent-{index}.log"))).map_err(|err| err.to_string())?;
            let mut command = Command::new(&self.tether);
            command
                .arg("agent")
                .arg("--data-dir")
                .arg(&data)
                .args(["--etcd", &urls, "--node", &node(index), "--log-level", "warn"])
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
        let agents_up = started.elapsed();

        // 10 services a node.
        let started = Instant::now();
        for index in 0..AGENTS {
            for service in 0..PER_AGENT {
                self.put(
                    &format!("/tether/nodes/{}/services/s{service}", node(index)),
                    &service_value(&format!("s{service}"), 3600),
                )?;
            }
        }
        self.wait_running(|_| true)?;
        let populated = started.elapsed();

        // Idle: lease keep-alives, every gRPC message and write transactions a second.
        let (keep_alives, messages, revisions) =
            (self.sum_metric(KEEP_ALIVES)?, self.sum_metric(MESSAGES)?, self.revision()?);
        thread::sleep(IDLE);
        let keep_alives_per_s = (self.sum_metric(KEEP_ALIVES)? - keep_alives) / IDLE.as_secs_f64();
        let messages_per_s = (self.sum_metric(MESSAGES)? - messages) / IDLE.as_secs_f64();
        let revisions_per_s = (self.revision()? - revisions) as f64 / IDLE.as_secs_f64();
        let watchers = self.sum_metric("etcd_debugging_mvcc_watcher_total")?;
        // Each agent starts at a member of its own: how evenly the watches spread.
        let per_member = (0..self.members.len())
            .map(|member| self.metric_of(member, "etcd_debugging_mvcc_watcher_total").map(|w| format!("{w:.0}")))
            .collect::<Result<Vec<_>, _>>()?
            .join(" / ");
        let watch_streams = self.sum_metric("etcd_debugging_mvcc_watch_stream_total")?;
        let leases = self.leases()?;
        let keys = self.keys()?;
        // Each member holds the whole database: one member's figures.
        let db_size = self.metric_of(0, "etcd_mvcc_db_total_size_in_bytes")?;
        let db_in_use = self.metric_of(0, "etcd_mvcc_db_total_size_in_use_in_bytes")?;

        // One change to s0 on every node.
        let messages_before = self.sum_metric(MESSAGES)?;
        let bytes_before = self.sum_metric("etcd_network_client_grpc_sent_bytes_total")?;
        let revision_before = self.revision()?;
        let mut committed = Vec::with_capacity(AGENTS);
        let started = Instant::now();
        for index in 0..AGENTS {
            self.put(&format!("/tether/nodes/{}/services/s0", node(index)), &service_value("s0", 3601))?;
            committed.push(SystemTime::now());
        }
        let puts_took = started.elapsed();
        self.wait_running(|cmdline| cmdline.contains("3601"))?;
        let converged = started.elapsed();
        let mut latencies = Vec::with_capacity(AGENTS);
        for (index, at) in committed.iter().enumerate() {
            let pid_file = self.agents[index].1.join("pids").join("s0-proxy.pid");
            let spawned = fs::metadata(&pid_file)
                .and_then(|meta| meta.modified())
                .map_err(|err| format!("{}: {err}", pid_file.display()))?;
            latencies.push(spawned.duration_since(*at).unwrap_or(Duration::ZERO));
        }
        latencies.sort();
        // What etcd sent for it: the watch events to 300 agents, and their status writes'
        // answers; counted from the client gRPC bytes of every member, per change.
        let revisions_for_change = self.revision()? - revision_before;
        let bytes_per_change =
            (self.sum_metric("etcd_network_client_grpc_sent_bytes_total")? - bytes_before) / AGENTS as f64;
        let messages_per_change = (self.sum_metric(MESSAGES)? - messages_before) / AGENTS as f64;

        // A rollout of s1 over every node, 20 at a time.
        let file = self.dir.join("s1.toml");
        fs::write(&file, "[[service]]\nname = \"s1\"\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3602\"]\nkill_timeout = \"1s\"\n").map_err(|err| err.to_string())?;
        let nodes: Vec<String> = (0..AGENTS).map(node).collect();
        let started = Instant::now();
        let output = Command::new(&self.tether)
            .args(["fleet", "rollout"])
            .arg(&file)
            .args(["--nodes", &nodes.join(","), "--max-parallel", &PARALLEL.to_string(), "--etcd", &urls])
            .stdin(Stdio::null())
            .output()
            .map_err(|err| format!("cannot run the rollout: {err}"))?;
        let rollout_took = started.elapsed();
        if !output.status.success() {
            return Err(format!(
                "the rollout failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ));
        }

        Ok(vec![
            (
                "fleet at scale: agents × proxies each".to_owned(),
                format!("{AGENTS} × {PER_AGENT} (three etcd members, every agent given all three)"),
            ),
            ("fleet at scale: agents started and following".to_owned(), secs(agents_up)),
            (format!("fleet at scale: {} puts until every proxy runs", AGENTS * PER_AGENT), secs(populated)),
            (
                "fleet at scale: watchers on etcd, all members (each member)".to_owned(),
                format!("{watchers:.0} ({per_member})"),
            ),
            ("fleet at scale: watch streams on etcd (all members)".to_owned(), format!("{watch_streams:.0}")),
            ("fleet at scale: leases".to_owned(), leases.to_string()),
            ("fleet at scale: keys under the prefix".to_owned(), keys.to_string()),
            (
                "fleet at scale: etcd database size, total / in use (one member)".to_owned(),
                format!("{:.1} MiB / {:.1} MiB", db_size / MIB, db_in_use / MIB),
            ),
            ("fleet at scale: gRPC messages a second, idle (all members)".to_owned(), format!("{messages_per_s:.1}")),
            (
                "fleet at scale: lease keep-alives a second, idle (TTL 10 s)".to_owned(),
                format!("{keep_alives_per_s:.1}"),
            ),
            ("fleet at scale: write transactions a second, idle".to_owned(), format!("{revisions_per_s:.2}")),
            (format!("fleet at scale: one change on every node: {AGENTS} puts written"), ms(puts_took)),
            ("fleet at scale: one change on every node: until all run it".to_owned(), ms(converged)),
            ("fleet at scale: etcd-to-running latency, median".to_owned(), ms(percentile(&latencies, 50.0))),
            ("fleet at scale: etcd-to-running latency, p99".to_owned(), ms(percentile(&latencies, 99.0))),
            ("fleet at scale: etcd-to-running latency, max".to_owned(), ms(percentile(&latencies, 100.0))),
            (
                "fleet at scale: write transactions per change (the put and the node's status)".to_owned(),
                format!("{:.1}", revisions_for_change as f64 / AGENTS as f64),
            ),
            ("fleet at scale: gRPC bytes etcd sent per change".to_owned(), format!("{bytes_per_change:.0} B")),
            ("fleet at scale: gRPC messages etcd received per change".to_owned(), format!("{messages_per_change:.1}")),
            (format!("fleet at scale: rollout over {AGENTS} nodes, {PARALLEL} at a time"), secs(rollout_took)),
        ])
    }

    /// Every member's client URL, comma-separated.
    fn urls(&self) -> String {
        self.members.iter().map(|(_, port)| format!("http://127.0.0.1:{port}")).collect::<Vec<_>>().join(",")
    }

    fn put(&self, key: &str, value: &str) -> Result<(), String> {
        let body = format!(r#"{{"key": "{}", "value": "{}"}}"#, BASE64.encode(key), BASE64.encode(value));
        http_tcp(self.members[0].1, "/v3/kv/put", &body).map(drop)
    }

    fn revision(&self) -> Result<i64, String> {
        let body = http_tcp(self.members[0].1, "/v3/kv/range", r#"{"key": "AA=="}"#)?;
        let value: serde_json::Value = serde_json::from_str(&body).map_err(|err| err.to_string())?;
        value["header"]["revision"].as_str().and_then(|r| r.parse().ok()).ok_or_else(|| "no revision".to_owned())
    }

    /// The sum over the members of every sample whose line starts with `metric`.
    fn sum_metric(&self, metric: &str) -> Result<f64, String> {
        (0..self.members.len()).map(|member| self.metric_of(member, metric)).sum()
    }

    /// The sum of every sample of member `member` whose line starts with `metric`.
    fn metric_of(&self, member: usize, metric: &str) -> Result<f64, String> {
        let text = get(self.members[member].1, "/metrics")?;
        Ok(text
            .lines()
            .filter(|line| line.starts_with(metric))
            .filter_map(|line| line.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
            .sum())
    }

    /// The leases alive in the cluster.
    fn leases(&self) -> Result<usize, String> {
        let body = http_tcp(self.members[0].1, "/v3/lease/leases", "{}")?;
        let value: serde_json::Value = serde_json::from_str(&body).map_err(|err| format!("lease list: {err}"))?;
        Ok(value["leases"].as_array().map_or(0, Vec::len))
    }

    /// The keys under `/tether/`.
    fn keys(&self) -> Result<i64, String> {
        let body = format!(
            r#"{{"key": "{}", "range_end": "{}", "count_only": true}}"#,
            BASE64.encode("/tether/"),
            BASE64.encode("/tether0")
        );
        let answer = http_tcp(self.members[0].1, "/v3/kv/range", &body)?;
        let value: serde_json::Value = serde_json::from_str(&answer).map_err(|err| format!("key count: {err}"))?;
        // The gateway leaves out a count of 0.
        value["count"].as_str().map_or(Ok(0), |count| count.parse().map_err(|err| format!("key count: {err}")))
    }

    /// Waits until every agent runs all its proxies, and every `s0` process's command line
    /// passes `s0`.
    fn wait_running(&self, s0: impl Fn(&str) -> bool) -> Result<(), String> {
        for (_, data) in &self.agents {
            let socket = data.join("agent.sock");
            wait(&format!("{PER_AGENT} proxies running on {}", data.display()), || {
                let body = http_unix(&socket, "GET", "/v1/agent/proxies")?;
                if body.matches("\"state\":\"running\"").count() != PER_AGENT {
                    return Ok(false);
                }
                let proxies: serde_json::Value = serde_json::from_str(&body).map_err(|err| err.to_string())?;
                let pid = proxies
                    .as_array()
                    .and_then(|all| all.iter().find(|p| p["id"] == "s0-proxy"))
                    .and_then(|p| p["pid"].as_i64());
                let cmdline = pid
                    .and_then(|pid| fs::read(format!("/proc/{pid}/cmdline")).ok())
                    .map(|raw| String::from_utf8_lossy(&raw).replace('\0', " "))
                    .unwrap_or_default();
                Ok(s0(&cmdline))
            })?;
        }
        Ok(())
    }

    fn start_cluster(&mut self, etcd: &Path) -> Result<(), String> {
        let ports: Vec<(u16, u16)> = (0..3).map(|_| Ok((free_port()?, free_port()?))).collect::<Result<_, String>>()?;
        let initial: Vec<String> =
            ports.iter().enumerate().map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}")).collect();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let log = fs::File::create(self.dir.join(format!("etcd-m{i}.log"))).map_err(|err| err.to_string())?;
            let child = Command::new(etcd)
                .arg(format!("--name=m{i}"))
                .arg(format!("--data-dir={}", self.dir.join(format!("etcd-m{i}")).display()))
                .arg(format!("--listen-client-urls=http://127.0.0.1:{client}"))
                .arg(format!("--advertise-client-urls=http://127.0.0.1:{client}"))
                .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
                .arg(format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"))
                .arg(format!("--initial-cluster={}", initial.join(",")))
                .args([
                    "--initial-cluster-state=new",
                    "--initial-cluster-token=tether-bench",
                    "--logger=zap",
                    "--log-level=warn",
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .map_err(|err| format!("cannot start etcd: {err}"))?;
            self.members.push((child, *client));
        }
        wait("the etcd cluster", || Ok(http_tcp(self.members[0].1, "/v3/kv/range", r#"{"key": "AA=="}"#).is_ok()))
    }

    /// Stops every proxy (SIGKILL of their groups: 3 000 graceful stops would measure
    /// nothing), every agent and every member.
    fn stop(&mut self) {
        for (child, data) in &mut self.agents {
            let _ = child.kill();
            let _ = child.wait();
            kill_proxies_of(&data.join("agent.sock"));
        }
        self.agents.clear();
        for (mut member, _) in self.members.drain(..) {
            let _ = member.kill();
            let _ = member.wait();
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One GET to a member's client port; the body of a 200 answer.
fn get(port: u16, path: &str) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|err| format!("etcd: {err}"))?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).map_err(|err| err.to_string())?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).map_err(|err| err.to_string())?;
    let (head, body) = raw.split_once("\r\n\r\n").ok_or("no HTTP head")?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(head.lines().next().unwrap_or_default().to_owned());
    }
    Ok(body.to_owned())
}
