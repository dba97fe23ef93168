//! The fleet against a three-member etcd cluster that fails: members killed (the leader
//! among them), quorum lost and regained. Each test starts its own cluster on free loopback
//! ports (client and peer port per member, a temp data dir each), gives the agents and the
//! `tether fleet` commands all three endpoints, and kills every member on drop.

use super::*;
use netns::Partition;

/// One member of a [`Cluster`]: its name, ports, data dir and process.
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
    /// Its ports, kept for it while it is down.
    _ports: [ReservedPort; 2],
}

impl Member {
    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }
}

/// A three-member etcd cluster; dropping it kills every member.
pub struct Cluster {
    binary: PathBuf,
    dir: tempfile::TempDir,
    members: Vec<Member>,
    /// A second address every member serves clients on, beside loopback.
    also_at: Option<&'static str>,
}

impl Cluster {
    /// Starts three members and waits until the cluster has a leader, or returns `None`
    /// (and says why) when there is no etcd binary.
    fn start(test: &str) -> Option<Self> {
        Self::start_also_at(test, None)
    }

    /// Like [`Cluster::start`], each member serving clients at `address` too (on the same
    /// port as on loopback).
    fn start_also_at(test: &str, also_at: Option<&'static str>) -> Option<Self> {
        let Some(binary) = etcd_binary() else {
            assert!(std::env::var_os("CI").is_none(), "CI must have an etcd binary (.ci/run installs etcd-server)");
            eprintln!("skipping {test}: no etcd binary on PATH (apt-get install etcd-server)");
            return None;
        };
        let members = (0..3)
            .map(|i| {
                let ports = [ReservedPort::new(), ReservedPort::new()];
                let (client_port, peer_port) = (ports[0].port(), ports[1].port());
                Member { name: format!("m{i}"), client_port, peer_port, child: None, _ports: ports }
            })
            .collect();
        let mut cluster = Self { binary, dir: tempfile::tempdir().unwrap(), members, also_at };
        for i in 0..3 {
            cluster.spawn(i);
        }
        cluster.wait_leader();
        Some(cluster)
    }

    /// Every member's client URL at `address`, comma-separated.
    fn urls_at(&self, address: &str) -> String {
        let urls: Vec<String> = self.members.iter().map(|m| format!("http://{address}:{}", m.client_port)).collect();
        urls.join(",")
    }

    /// Starts member `i` on its data dir (new, or kept from before).
    fn spawn(&mut self, i: usize) {
        self.spawn_as(i, "new");
    }

    /// Starts member `i` with `--initial-cluster-state STATE`: `new` for a founding member
    /// (or one that restarts on its data), `existing` for one added to a running cluster.
    fn spawn_as(&mut self, i: usize, state: &str) {
        let initial: Vec<String> = self.members.iter().map(|m| format!("{}={}", m.name, m.peer_url())).collect();
        let token = self.dir.path().file_name().unwrap().to_string_lossy().into_owned();
        let member = &self.members[i];
        assert!(member.child.is_none(), "{} runs already", member.name);
        let listen = match self.also_at {
            Some(address) => format!("{},http://{address}:{}", member.url(), member.client_port),
            None => member.url(),
        };
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{}.log", member.name)))
            .unwrap();
        let child = support::command(&self.binary)
            .arg(format!("--name={}", member.name))
            .arg(format!("--data-dir={}", self.dir.path().join(&member.name).display()))
            .arg(format!("--listen-client-urls={listen}"))
            .arg(format!("--advertise-client-urls={}", member.url()))
            .arg(format!("--listen-peer-urls={}", member.peer_url()))
            .arg(format!("--initial-advertise-peer-urls={}", member.peer_url()))
            .arg(format!("--initial-cluster={}", initial.join(",")))
            .arg(format!("--initial-cluster-token={token}"))
            .arg(format!("--initial-cluster-state={state}"))
            .arg("--logger=zap")
            .arg("--log-level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.members[i].child = Some(child);
    }

    /// Kills member `i` with SIGKILL (its data stays).
    fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// One POST to member `i`'s JSON gateway; the body of a 200 answer.
    fn call(&self, i: usize, path: &str, body: &str) -> Result<String, String> {
        gateway(self.members[i].client_port, path, body)
    }

    /// The members that serve a watch now, by etcd's own gauge of watchers.
    fn watched(&self) -> Vec<usize> {
        (0..3)
            .filter(|i| self.members[*i].child.is_some())
            .filter(|i| {
                let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.members[*i].client_port)) else {
                    return false;
                };
                stream.set_read_timeout(Some(support::DEADLINE)).unwrap();
                let request = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
                let mut text = String::new();
                if stream.write_all(request.as_bytes()).is_err() || stream.read_to_string(&mut text).is_err() {
                    return false;
                }
                text.lines().any(|line| {
                    line.strip_prefix("etcd_debugging_mvcc_watcher_total ")
                        .and_then(|value| value.trim().parse::<f64>().ok())
                        .is_some_and(|watchers| watchers > 0.0)
                })
            })
            .collect()
    }

    /// Member `i` loses its data dir: it is removed from the cluster, added again with the
    /// same peer URL and started empty, and catches up from the others.
    fn replace(&mut self, i: usize) {
        let leader = self.wait_leader();
        let list: serde_json::Value =
            serde_json::from_str(&self.call(leader, "/v3/cluster/member/list", "{}").unwrap()).unwrap();
        let id = list["members"]
            .as_array()
            .unwrap()
            .iter()
            .find(|member| member["name"] == self.members[i].name.as_str())
            .and_then(|member| member["ID"].as_str())
            .unwrap()
            .to_owned();
        self.kill(i);
        std::fs::remove_dir_all(self.dir.path().join(&self.members[i].name)).unwrap();
        let leader = self.wait_leader();
        self.call(leader, "/v3/cluster/member/remove", &format!(r#"{{"ID": "{id}"}}"#)).unwrap();
        // etcd refuses a new member until the cluster has been healthy for a moment
        // ("unhealthy cluster"): asked again until it takes it.
        let add = format!(r#"{{"peerURLs": ["{}"]}}"#, self.members[i].peer_url());
        wait_until("the cluster to take the member again", || {
            let leader = self.leader().ok_or("no leader")?;
            self.call(leader, "/v3/cluster/member/add", &add).map(|_| ())
        });
        self.spawn_as(i, "existing");
        wait_until("the new member to serve reads", || self.call(i, "/v3/kv/range", r#"{"key": "AA=="}"#).map(|_| ()));
    }

    /// Compacts the history up to the current revision, through the leader.
    fn compact(&self) {
        let leader = self.wait_leader();
        let revision = revision_of(&self.call(leader, "/v3/kv/range", r#"{"key": "AA=="}"#).unwrap());
        let body = format!(r#"{{"revision": "{revision}", "physical": true}}"#);
        self.call(leader, "/v3/kv/compaction", &body).unwrap();
    }

    /// The index of the member that leads, as the live members say.
    fn leader(&self) -> Option<usize> {
        (0..3).filter(|i| self.members[*i].child.is_some()).find_map(|i| {
            let status: serde_json::Value =
                serde_json::from_str(&self.call(i, "/v3/maintenance/status", "{}").ok()?).ok()?;
            let leader = status["leader"].as_str()?.to_owned();
            (0..3).find(|j| {
                self.call(*j, "/v3/maintenance/status", "{}")
                    .ok()
                    .and_then(|body| serde_json::from_str::<serde_json::Value>(&body).ok())
                    .is_some_and(|s| s["header"]["member_id"].as_str() == Some(leader.as_str()))
            })
        })
    }

    /// Waits until a member leads and a linearizable read through it succeeds.
    #[track_caller]
    fn wait_leader(&self) -> usize {
        wait_until("the cluster to elect a leader", || {
            let leader = self.leader().ok_or("no leader yet")?;
            self.call(leader, "/v3/kv/range", r#"{"key": "AA=="}"#)?;
            Ok::<_, String>(leader)
        })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..3 {
            self.kill(i);
        }
    }
}

/// A service file of `name`: `/bin/sleep SECONDS`.
fn sleeper_file(dirs: &Dirs, name: &str, seconds: u32) -> String {
    service_file(dirs, name, seconds, "2s").to_str().unwrap().to_owned()
}

/// `tether fleet put NODE FILE` through all three endpoints; must succeed.
fn put(cluster: &Cluster, node: &str, file: &str) {
    let output = fleet(&cluster.urls(), &["put", node, file]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
}

/// An agent that follows `node`, given every member's endpoint.
fn cluster_agent(dirs: &Dirs, cluster: &Cluster, node: &str) -> Agent {
    cluster_agent_with(dirs, cluster, node, &[])
}

/// Like [`cluster_agent`], with `extra` flags.
fn cluster_agent_with(dirs: &Dirs, cluster: &Cluster, node: &str, extra: &[&str]) -> Agent {
    Agent::start(dirs, &agent_flags(&cluster.urls(), node, extra))
}

/// An agent in the cut-off side of `partition` that follows `node`, given every member's
/// endpoint on the link.
fn partitioned_agent(partition: &Partition, dirs: &Dirs, cluster: &Cluster, node: &str, extra: &[&str]) -> Agent {
    let urls = cluster.urls_at(netns::STORE_ADDRESS);
    let flags = agent_flags(&urls, node, extra);
    Agent::start_configured(dirs, &flags, |command| partition.in_cut_off(command))
}

/// `--etcd URLS --node NODE EXTRA...`, and `--allow-root` as root.
fn agent_flags<'a>(urls: &'a str, node: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut flags = vec!["--etcd", urls, "--node", node];
    flags.extend_from_slice(extra);
    if is_root() {
        flags.push("--allow-root");
    }
    flags
}

/// How long the quorum-lost test keeps two of three members down.
const QUORUM_LOST_FOR: Duration = Duration::from_secs(30);

/// The next event named `name` on `lines` (JSON lines of `tether events --json`), within the
/// deadline; events of other names are passed over.
#[track_caller]
fn next_event(lines: &std::sync::mpsc::Receiver<String>, name: &str) -> serde_json::Value {
    wait_for(&format!("a {name} event"), || {
        let line = lines.try_recv().ok()?;
        let event: serde_json::Value = serde_json::from_str(&line).unwrap();
        (event["event"] == name).then_some(event)
    })
}

/// `tether status` of the agent on `dirs`: its exit code and what it printed.
fn agent_status(dirs: &Dirs) -> (Option<i32>, String) {
    let output = tether().args(["status", "--data-dir"]).arg(&dirs.data).output().unwrap();
    (output.status.code(), String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Two of three members down: no quorum, so no request succeeds, and a watch on the member
/// left may stay open and silent. The agent keeps every proxy, says the store is
/// unreachable (in its fleet status, metrics, events and `tether status`), and converges
/// within seconds once quorum is back, telling so.
#[test]
fn with_quorum_lost_every_proxy_runs_on_the_store_shows_unreachable_and_changes_apply_on_return() {
    let Some(mut cluster) = Cluster::start("fleet quorum lost") else { return };
    let dirs = Dirs::new();
    let _sweep = support::SweepOnDrop(dirs.socket());
    let agent = cluster_agent(&dirs, &cluster, "n1");
    put(&cluster, "n1", &sleeper_file(&dirs, "a", 3600));
    pid_of(&agent, "a-proxy");
    // The events stream, proved live by the start of the second proxy.
    let (_events, lines) = crate::templates::events(&dirs);
    wait_for("the events stream", || {
        let output = fleet(&cluster.urls(), &["put", "n1", &sleeper_file(&dirs, "b", 3600)]);
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        lines.recv_timeout(Duration::from_millis(500)).ok()
    });
    let pids = (pid_of(&agent, "a-proxy"), pid_of(&agent, "b-proxy"));
    wait_for("the agent's watch", || fleet_status(&agent)["connected"].as_bool().filter(|c| *c));
    let (code, said) = agent_status(&dirs);
    assert_eq!(code, Some(0));
    assert!(!said.contains("fleet:"), "nothing said of the store while it is reachable: {said}");

    // The member that serves the agent's watch stays: its stream stays open, and only the
    // member's lost leader can tell the agent that nothing will come through it.
    let watched = wait_until("the member that serves the watch", || match cluster.watched()[..] {
        [one] => Ok(one),
        ref other => Err(format!("members with a watcher: {other:?}")),
    });
    let (leader, follower) = ((watched + 1) % 3, (watched + 2) % 3);
    cluster.kill(leader);
    cluster.kill(follower);
    let lost_at = Instant::now();
    wait_until("the agent to say the store is unreachable", || {
        let status = fleet_status(&agent);
        (status["connected"] == false).then_some(()).ok_or(status.to_string())
    });
    let noticed_after = lost_at.elapsed();
    assert_eq!(metric(&agent, "tether_fleet_connected"), Some(0.0));
    let lost = next_event(&lines, "store-unreachable");
    assert_eq!(lost["proxy"], serde_json::Value::Null, "the agent's own event: {lost}");
    let detail = lost["detail"].as_str().unwrap();
    assert!(detail.contains(&cluster.urls()), "names the endpoints: {detail}");
    let shown = fleet_status(&agent);
    let since = shown["unreachable_since"].as_str().unwrap_or_else(|| panic!("since when: {shown}")).to_owned();
    let (code, said) = agent_status(&dirs);
    assert_eq!(code, Some(0), "the proxies run: {said}");
    assert!(
        said.contains(&format!("fleet: etcd unreachable since {since}")) && said.contains(&cluster.urls()),
        "tether status says since when and where the store is lost: {said}"
    );
    let view = fleet(&cluster.urls(), &["status"]);
    assert_eq!(view.status.code(), Some(1), "{}", String::from_utf8_lossy(&view.stdout));
    let said = String::from_utf8_lossy(&view.stderr).into_owned();
    assert!(said.contains("etcd at"), "says it cannot reach the store: {said}");
    assert_eq!((pid_of(&agent, "a-proxy"), pid_of(&agent, "b-proxy")), pids, "no proxy stopped or restarted");
    // Quorum stays lost for 30 s; the proxies run on, and the agent says the same throughout.
    while lost_at.elapsed() < QUORUM_LOST_FOR {
        assert_eq!((pid_of(&agent, "a-proxy"), pid_of(&agent, "b-proxy")), pids, "no proxy stopped or restarted");
        assert_eq!(fleet_status(&agent)["unreachable_since"].as_str(), Some(since.as_str()));
        std::thread::sleep(Duration::from_millis(500));
    }

    // Quorum is back: a change made now applies, and nothing else restarts.
    cluster.spawn(leader);
    cluster.spawn(follower);
    cluster.wait_leader();
    let back_at = Instant::now();
    put(&cluster, "n1", &sleeper_file(&dirs, "c", 3600));
    pid_of(&agent, "c-proxy");
    let converged_after = back_at.elapsed();
    wait_for("the agent's watch again", || fleet_status(&agent)["connected"].as_bool().filter(|c| *c));
    let back = next_event(&lines, "store-reachable");
    assert_eq!(back["proxy"], serde_json::Value::Null, "the agent's own event: {back}");
    assert_eq!(fleet_status(&agent)["unreachable_since"], serde_json::Value::Null);
    let (_, said) = agent_status(&dirs);
    assert!(!said.contains("fleet:"), "nothing said of the store once it is back: {said}");
    assert_eq!((pid_of(&agent, "a-proxy"), pid_of(&agent, "b-proxy")), pids, "no proxy stopped or restarted");
    wait_until("fleet status to show n1 with three proxies", || {
        let output = fleet(&cluster.urls(), &["status", "--json"]);
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        (output.status.success() && text.contains("c-proxy")).then_some(()).ok_or(text)
    });
    // Figures, not bounds: the machines are shared.
    eprintln!("quorum lost: noticed after {noticed_after:?}; after its return a change ran in {converged_after:?}");
}

/// The status TTL of the agents that follow a cluster: longer than an election (about a
/// second here) and a keep-alive's move to another member, as a production TTL is.
const CLUSTER_TTL_SECONDS: u64 = 6;

/// Three agents that follow a cluster.
type ClusterNodes = Nodes<Cluster>;

impl Store for Cluster {
    const TTL_SECONDS: u64 = CLUSTER_TTL_SECONDS;

    fn up(test: &str) -> Option<Self> {
        Cluster::start(test)
    }

    fn urls(&self) -> String {
        self.members.iter().map(Member::url).collect::<Vec<_>>().join(",")
    }

    /// A document that does not parse (no member answers) reads as null: the caller waits on.
    fn view(&self) -> (Option<i32>, serde_json::Value) {
        let output = fleet(&self.urls(), &["status", "--json"]);
        let text = String::from_utf8_lossy(&output.stdout);
        (output.status.code(), serde_json::from_str(&text).unwrap_or(serde_json::Value::Null))
    }
}

/// The leader killed while a rollout goes one node at a time: the rollout finishes after
/// the election, or stops with an error that `--resume` continues from; no node is written
/// twice or out of order, and a proxy the rollout does not touch never restarts.
#[test]
fn a_leader_killed_mid_rollout_neither_skips_nor_repeats_a_node_and_restarts_nothing_else() {
    let Some(mut nodes) = ClusterNodes::start("fleet leader lost mid-rollout") else { return };
    let _sweeps: Vec<support::SweepOnDrop> =
        nodes.dirs.iter().map(|dirs| support::SweepOnDrop(dirs.socket())).collect();
    let v1 = web_version(&nodes.dirs[0], 3600, &["/bin/true"]);
    let other = sleeper_file(&nodes.dirs[0], "other", 3600);
    for node in ClusterNodes::NODES {
        put(&nodes.etcd, node, v1.to_str().unwrap());
        put(&nodes.etcd, node, &other);
    }
    nodes.wait_all_ready(2);
    let (web_before, others) = (nodes.pids("web-proxy"), nodes.pids("other-proxy"));

    // Each node's new version gets ready a second after it starts: the rollout takes a
    // few seconds, and the leader dies in the middle.
    let v2 = web_version(&nodes.dirs[0], 3601, &["/bin/sleep", "1"]);
    let args = [v2.to_str().unwrap(), "--nodes", "n1,n2,n3", "--max-parallel", "1"];
    let mut rollout = RolloutCli::spawn(&nodes.etcd, &nodes.dirs[0], &args);
    wait_until("n1 to be done", || {
        rollout.output().contains("n1: running and ready").then_some(()).ok_or_else(|| rollout.output())
    });
    let leader = nodes.etcd.wait_leader();
    nodes.etcd.kill(leader);
    let mut outputs = vec![];
    let code = rollout.wait();
    outputs.push(rollout.output());
    if code != Some(0) {
        // Stopped by the failure: it says why, and how to go on.
        assert_eq!(code, Some(1), "{}", outputs[0]);
        assert!(outputs[0].contains("etcd") && outputs[0].contains("--resume web"), "{}", outputs[0]);
        let mut resumed = RolloutCli::spawn(&nodes.etcd, &nodes.dirs[0], &["--resume", "web"]);
        let code = resumed.wait();
        let text = resumed.output();
        assert_eq!(code, Some(0), "{text}");
        outputs.push(text);
    }
    let all = outputs.join("\n");
    let wrote: Vec<&str> = all
        .lines()
        .filter_map(|line| line.strip_suffix(": wrote").or_else(|| line.split_once(": wrote").map(|(node, _)| node)))
        .collect();
    assert_eq!(wrote, ["n1", "n2", "n3"], "each node written once, in order:\n{all}");
    nodes.etcd.spawn(leader);
    let view = nodes.wait_all_ready(2);
    let web_after = nodes.pids("web-proxy");
    for (i, node) in ClusterNodes::NODES.iter().enumerate() {
        assert_ne!(web_after[i], web_before[i], "{node} runs the new version: {view}");
        assert!(support::cmdline(i32::try_from(web_after[i]).unwrap()).contains(&"3601".to_owned()));
    }
    assert_eq!(nodes.pids("other-proxy"), others, "a proxy outside the rollout never restarts");
    nodes.agents.clear();
    eprintln!("rollout across a leader's death:\n{all}");
}

/// One agent cut off from every member while another is not: its proxies run on, it is
/// `down` in `fleet status` once its TTL passes, and once the link returns it is `up` with
/// nothing restarted and the change made meanwhile applied, once.
#[test]
fn an_agent_cut_off_from_the_cluster_keeps_its_proxies_is_down_after_the_ttl_and_catches_up_on_return() {
    let Some(partition) = Partition::new("fleet agent cut off") else { return };
    let Some(cluster) = Cluster::start_also_at("fleet agent cut off", Some(netns::STORE_ADDRESS)) else { return };
    let (cut_dirs, other_dirs) = (Dirs::new(), Dirs::new());
    let _sweeps = [support::SweepOnDrop(cut_dirs.socket()), support::SweepOnDrop(other_dirs.socket())];
    let cut_off = partitioned_agent(&partition, &cut_dirs, &cluster, "n1", &["--fleet-ttl", "3s"]);
    let other = cluster_agent_with(&other_dirs, &cluster, "n2", &["--fleet-ttl", "3s"]);
    put(&cluster, "n1", &sleeper_file(&cut_dirs, "a", 3600));
    put(&cluster, "n2", &sleeper_file(&other_dirs, "b", 3600));
    let (a, b) = (pid_of(&cut_off, "a-proxy"), pid_of(&other, "b-proxy"));
    let node_state = |node: &str| {
        let output = fleet(&cluster.urls(), &["status", "--json"]);
        let view: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap_or_default();
        node_of(&view, node)["state"].as_str().unwrap_or_default().to_owned()
    };
    wait_for("n1 up", || (node_state("n1") == "up").then_some(()));

    partition.cut();
    let cut_at = Instant::now();
    wait_until("n1 to be down", || {
        let state = node_state("n1");
        (state == "down").then_some(()).ok_or(state)
    });
    let down_after = cut_at.elapsed();
    // Meanwhile a change for n1: it reaches n1 once the link is back.
    put(&cluster, "n1", &sleeper_file(&cut_dirs, "c", 3600));
    wait_until("the cut-off agent to see the store unreachable", || {
        let status = fleet_status(&cut_off);
        (status["connected"] == false).then_some(()).ok_or(status.to_string())
    });
    assert_eq!(pid_of(&cut_off, "a-proxy"), a, "a proxy of the cut-off node runs on");
    assert!(cut_off.proxy("c-proxy").is_none(), "nothing reached it");
    assert_eq!(node_state("n2"), "up");

    partition.heal();
    let healed_at = Instant::now();
    let c = pid_of(&cut_off, "c-proxy");
    wait_until("n1 up again", || {
        let state = node_state("n1");
        (state == "up").then_some(()).ok_or(state)
    });
    let up_after = healed_at.elapsed();
    assert_eq!((pid_of(&cut_off, "a-proxy"), pid_of(&other, "b-proxy")), (a, b), "nothing restarted");
    let c_status = cut_off.proxy("c-proxy").unwrap();
    assert_eq!((c_status["pid"].as_i64(), c_status["restarts"].as_u64()), (Some(c), Some(0)), "applied once");
    // Figures, not bounds: the machines are shared.
    eprintln!("cut off: down in fleet status after {down_after:?}; up again {up_after:?} after the link returned");
}

/// History compacted past a running agent's revision while it was cut off: once the link
/// returns, its watch cannot resume, so it reads the whole set again and applies only the
/// difference.
#[test]
fn history_compacted_while_an_agent_was_cut_off_is_read_whole_and_only_the_difference_applies() {
    let Some(partition) = Partition::new("fleet compaction while cut off") else { return };
    let Some(cluster) = Cluster::start_also_at("fleet compaction while cut off", Some(netns::STORE_ADDRESS)) else {
        return;
    };
    let dirs = Dirs::new();
    let _sweep = support::SweepOnDrop(dirs.socket());
    let agent = partitioned_agent(&partition, &dirs, &cluster, "n1", &[]);
    put(&cluster, "n1", &sleeper_file(&dirs, "a", 3600));
    put(&cluster, "n1", &sleeper_file(&dirs, "b", 3600));
    let b = pid_of(&agent, "b-proxy");
    pid_of(&agent, "a-proxy");
    wait_for("the agent's watch", || fleet_status(&agent)["connected"].as_bool().filter(|c| *c));

    partition.cut();
    let removed = fleet(&cluster.urls(), &["rm", "n1", "a"]);
    assert!(removed.status.success(), "{}", String::from_utf8_lossy(&removed.stderr));
    put(&cluster, "n1", &sleeper_file(&dirs, "c", 3600));
    put(&cluster, "n1", &sleeper_file(&dirs, "c", 3601));
    cluster.compact();
    wait_until("the cut-off agent to see the store unreachable", || {
        let status = fleet_status(&agent);
        (status["connected"] == false).then_some(()).ok_or(status.to_string())
    });

    partition.heal();
    let c = pid_of(&agent, "c-proxy");
    agent.wait_gone("a-proxy");
    assert_eq!(pid_of(&agent, "b-proxy"), b, "an unchanged proxy is left alone");
    assert!(support::cmdline(i32::try_from(c).unwrap()).contains(&"3601".to_owned()), "the latest c");
    assert_eq!(agent.proxy("c-proxy").unwrap()["restarts"].as_u64(), Some(0), "c started once");
    assert!(metric(&agent, "tether_fleet_compactions_total") >= Some(1.0));
}

/// A member loses its data dir and is added back empty: the agent notices at most a
/// reconnect (no proxy restarts), and a change made afterwards applies.
#[test]
fn a_member_that_lost_its_data_and_was_added_again_costs_the_agent_at_most_a_reconnect() {
    let Some(mut cluster) = Cluster::start("fleet member replaced") else { return };
    let dirs = Dirs::new();
    let _sweep = support::SweepOnDrop(dirs.socket());
    let agent = cluster_agent(&dirs, &cluster, "n1");
    put(&cluster, "n1", &sleeper_file(&dirs, "a", 3600));
    let a = pid_of(&agent, "a-proxy");
    wait_for("the agent's watch", || fleet_status(&agent)["connected"].as_bool().filter(|c| *c));
    // The member that serves the agent's watch goes: the hardest case for the agent.
    let watched = wait_until("the member that serves the watch", || match cluster.watched()[..] {
        [one] => Ok(one),
        ref other => Err(format!("members with a watcher: {other:?}")),
    });
    cluster.replace(watched);
    put(&cluster, "n1", &sleeper_file(&dirs, "b", 3600));
    pid_of(&agent, "b-proxy");
    wait_for("the agent's watch again", || fleet_status(&agent)["connected"].as_bool().filter(|c| *c));
    assert_eq!(pid_of(&agent, "a-proxy"), a, "nothing restarted");
    assert_eq!(agent.proxy("a-proxy").unwrap()["restarts"].as_u64(), Some(0));
}
