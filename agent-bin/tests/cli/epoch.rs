//! `update = "epoch"`: a hot restart by the proxy itself, as Envoy does it. The proxy of
//! these tests is a small Python program that follows Envoy's contract: given
//! `--restart-epoch N --base-id B`, epoch 0 binds its listening socket itself; epoch N > 0
//! asks epoch N - 1 for its listening socket over Unix datagram sockets (abstract, named by
//! role and `B * 10 + epoch`, as Envoy's `envoy_domain_socket_{parent,child}_*` are), takes
//! it (`SCM_RIGHTS`), serves, says it is ready (sd_notify) and tells the old one to drain;
//! the old one stops accepting, and exits 0 once drained.

use std::path::{Path, PathBuf};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::support::*;

const FAKE_ENVOY: &str = r#"
import array, os, select, socket, sys, time

args = sys.argv[1:]
def opt(name, default=None):
    return args[args.index(name) + 1] if name in args else default

epoch = int(opt("--restart-epoch"))
base_id = int(opt("--base-id"))
port = int(opt("--port"))
drain_s = float(opt("--drain-s", "0.5"))
never_exit = "--never-exit" in args
if "--fail" in args:
    print("epoch %d: refusing to start" % epoch, flush=True)
    sys.exit(3)

def address(role, of_epoch):
    return "\0tether-test-envoy-%s-%d" % (role, base_id * 10 + of_epoch)

# As Envoy's hot restart: datagram sockets, one to answer the next epoch, one to ask the last.
control = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
control.bind(address("parent", epoch))
parent = None
if epoch == 0:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # As Envoy's listeners: another socket may join the address (a cold start beside a
    # socket the agent keeps).
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(1024)
else:
    parent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    parent.bind(address("child", epoch))
    parent.connect(address("parent", epoch - 1))
    parent.send(b"listeners")
    _, fds, _, _ = socket.recv_fds(parent, 64, 4)
    listener = socket.socket(fileno=fds[0])
listener.setblocking(False)
print("epoch %d: serving on %d" % (epoch, port), flush=True)

notify = os.environ.get("NOTIFY_SOCKET")
if notify:
    if notify.startswith("@"):
        notify = "\0" + notify[1:]
    socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"READY=1", notify)
if parent is not None:
    parent.send(b"drain")

drained_at = None
while True:
    watched = [control] + ([listener] if listener is not None else [])
    readable, _, _ = select.select(watched, [], [], 0.05)
    for ready in readable:
        if ready is not control:
            # The listener, shared with the other generation while one hands over: it may
            # have taken the connection first, and this one may have closed it since.
            if listener is None:
                continue
            try:
                connection, _ = listener.accept()
            except BlockingIOError:
                continue
            connection.setblocking(True)
            connection.sendall(b"epoch %d\n" % epoch)
            connection.close()
        else:
            word, child = control.recvfrom(64)
            if word == b"listeners":
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [listener.fileno()]))]
                control.sendmsg([b"listeners"], rights, 0, child)
            elif word == b"drain":
                print("epoch %d: draining" % epoch, flush=True)
                listener.close()
                listener = None
                drained_at = time.monotonic() + drain_s
    if drained_at is not None and time.monotonic() >= drained_at and not never_exit:
        print("epoch %d: drained" % epoch, flush=True)
        sys.exit(0)
"#;

/// One test's agent setup: its dirs, the program and the port its proxy serves on.
struct Setup {
    dirs: Dirs,
    script: PathBuf,
    port: u16,
    name: &'static str,
}

/// The knobs of a proxy's config.
struct Knobs<'a> {
    drain_s: f64,
    drain_timeout: &'a str,
    max_generations: u32,
    extra: &'a [&'a str],
    /// Changed to make a restart-requiring change.
    generation: u32,
    keep_listening: bool,
}

impl Default for Knobs<'_> {
    fn default() -> Self {
        Self {
            drain_s: 1.0,
            drain_timeout: "30s",
            max_generations: 3,
            extra: &[],
            generation: 0,
            keep_listening: false,
        }
    }
}

impl Setup {
    /// `name` must be the test's own: base ids are derived from the proxy id, and the
    /// program's sockets are named by them, which tests running side by side share.
    fn new(name: &'static str) -> Self {
        let dirs = Dirs::new();
        let script = dirs.temp.path().join("fake-envoy.py");
        std::fs::write(&script, FAKE_ENVOY).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        Self { dirs, script, port, name }
    }

    fn id(&self) -> String {
        format!("{}-proxy", self.name)
    }

    fn write(&self, knobs: &Knobs<'_>) {
        let mut words = vec![
            "/usr/bin/python3".to_owned(),
            self.script.display().to_string(),
            "--restart-epoch".to_owned(),
            "{restart_epoch}".to_owned(),
            "--base-id".to_owned(),
            "{base_id}".to_owned(),
            "--port".to_owned(),
            self.port.to_string(),
            "--drain-s".to_owned(),
            knobs.drain_s.to_string(),
        ];
        words.extend(knobs.extra.iter().map(|word| (*word).to_owned()));
        let command = serde_json::to_string(&words).unwrap();
        self.dirs.write_config(
            "envoy.toml",
            &format!(
                "[[service]]\nname = \"{}\"\n[service.proxy]\ncommand = {command}\n\
                 env = {{ GENERATION = \"{}\", EPOCH = \"epoch-{{restart_epoch}}\" }}\n\
                 update = \"epoch\"\nupdate_timeout = \"10s\"\ndrain_timeout = \"{}\"\nmax_generations = {}\n\
                 keep_listening = {}\nkill_timeout = \"2s\"\n[service.proxy.readiness]\nnotify = true\n",
                self.name, knobs.generation, knobs.drain_timeout, knobs.max_generations, knobs.keep_listening
            ),
        );
    }

    fn start(&self, knobs: &Knobs<'_>) -> Agent {
        self.write(knobs);
        let agent = Agent::start(&self.dirs, &root_flags());
        wait_generations(&agent, &self.id(), "the first generation", |g| g == [(0, "current")]);
        agent
    }

    /// An agent whose proxy was hot restarted once and whose old generation drains for a
    /// minute: the agent, and the pids of the current and the draining generation.
    fn draining(&self) -> (Agent, Vec<i64>) {
        self.draining_with(Knobs::default())
    }

    fn draining_with(&self, knobs: Knobs<'_>) -> (Agent, Vec<i64>) {
        let agent = self.start(&Knobs { drain_s: 60.0, ..knobs });
        restart(&agent, &self.id());
        let both = wait_generations(&agent, &self.id(), "two generations", |g| g == [(1, "current"), (0, "draining")]);
        let pids = generation_pids(&both);
        (agent, pids)
    }
}

fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

/// A proxy's generations as its status lists them: (epoch, role) in order.
fn generations(status: &serde_json::Value) -> Vec<(u64, String)> {
    status["generations"]
        .as_array()
        .map(|all| all.iter().map(|g| (g["epoch"].as_u64().unwrap(), g["role"].as_str().unwrap().to_owned())).collect())
        .unwrap_or_default()
}

/// The pid of each generation, in the status's order.
fn generation_pids(status: &serde_json::Value) -> Vec<i64> {
    status["generations"].as_array().unwrap().iter().map(|g| g["pid"].as_i64().unwrap_or(0)).collect()
}

/// Waits until `id`'s generations, as (epoch, role), satisfy `until`; returns its status.
#[track_caller]
fn wait_generations(agent: &Agent, id: &str, what: &str, until: impl Fn(&[(u64, &str)]) -> bool) -> serde_json::Value {
    wait_for(what, || {
        let status = agent.proxy(id)?;
        let listed = generations(&status);
        let listed: Vec<(u64, &str)> = listed.iter().map(|(epoch, role)| (*epoch, role.as_str())).collect();
        let complete = status["generations"].as_array()?.iter().all(|g| g["pid"].is_number());
        (complete && status["state"] == "running" && until(&listed)).then_some(status)
    })
}

/// Asks the agent to restart `id`, and waits for its answer.
fn restart(agent: &Agent, id: &str) {
    let response = put(&agent.socket, &format!("/v1/agent/proxy/{id}/restart"), None).unwrap();
    assert_eq!(response.status, 200, "{}", response.body);
}

/// What a connection to the proxy's port reads: the epoch of the generation that accepted it.
fn served_by(port: u16) -> Option<String> {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    Some(answer.trim().to_owned())
}

fn exited(pid: i64) -> bool {
    !alive(pid)
}

fn snapshot(data: &Path) -> String {
    std::fs::read_to_string(data.join("snapshot.json")).unwrap_or_default()
}

#[test]
fn a_hot_restart_keeps_the_socket_serving_counts_epochs_up_and_lets_the_old_generation_exit() {
    let setup = Setup::new("epoch-hot");
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let agent = setup.start(&Knobs { drain_s: 2.0, ..Knobs::default() });
    let id = setup.id();
    let first = agent.proxy(&id).unwrap();
    let first_pid = first["pid"].as_i64().unwrap();
    assert_eq!(wait_for("an answer", || served_by(setup.port)), "epoch 0");
    let words = cmdline(first_pid as i32);
    let base_id = words[words.iter().position(|w| w == "--base-id").unwrap() + 1].clone();
    assert!(base_id.parse::<u32>().is_ok_and(|b| b > 0), "{words:?}");
    assert_eq!(environ_var(first_pid as i32, "EPOCH").as_deref(), Some("epoch-0"));

    let prober = Prober::start(setup.port);
    wait_for("the prober's first tries", || (prober.counts().0 > 20).then_some(()));
    restart(&agent, &id);
    // The old generation is not signalled: both are listed while it drains.
    let during = wait_generations(&agent, &id, "both generations", |g| g == [(1, "current"), (0, "draining")]);
    let pids = generation_pids(&during);
    assert_eq!(pids[1], first_pid, "{during}");
    assert_eq!(during["pid"].as_i64(), Some(pids[0]));
    assert!(alive(first_pid), "the old generation drains");
    let second = cmdline(pids[0] as i32);
    assert!(second.windows(2).any(|w| w == ["--restart-epoch", "1"]), "{second:?}");
    assert!(second.windows(2).any(|w| w[0] == "--base-id" && w[1] == base_id), "the same base id: {second:?}");
    assert_eq!(environ_var(pids[0] as i32, "EPOCH").as_deref(), Some("epoch-1"));
    let cli = tether().args(["status", "--json", "--data-dir"]).arg(&setup.dirs.data).output().unwrap();
    assert!(cli.status.success(), "{}", String::from_utf8_lossy(&cli.stderr));
    let listed: Vec<serde_json::Value> = serde_json::from_slice(&cli.stdout).unwrap();
    let shown = listed.iter().find(|p| p["id"] == id.as_str()).unwrap();
    assert_eq!(shown["generations"][1]["role"], "draining", "{shown}");

    // It exits by itself once drained.
    wait_for("the old generation to exit by itself", || exited(first_pid).then_some(()));
    wait_generations(&agent, &id, "one generation", |g| g == [(1, "current")]);
    // Logged by the task that awaited the drain, which may run after the status changed.
    wait_for("the agent to log the drained exit", || {
        agent.logs().contains("the old generation drained and exited").then_some(())
    });
    assert_eq!(wait_for("an answer", || served_by(setup.port)), "epoch 1");

    restart(&agent, &id);
    wait_generations(&agent, &id, "epoch 2", |g| g.first() == Some(&(2, "current")));
    let (tried, refused) = prober.counts();
    assert!(tried > 100, "{tried} connections tried");
    assert_eq!(refused, 0, "{refused} of {tried} connections refused across hot restarts");
}

#[test]
fn an_old_generation_that_never_exits_is_stopped_after_drain_timeout() {
    let setup = Setup::new("epoch-stuck");
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let stuck = Knobs { drain_timeout: "1s", extra: &["--never-exit"], ..Knobs::default() };
    let agent = setup.start(&stuck);
    let id = setup.id();
    let old = agent.proxy(&id).unwrap()["pid"].as_i64().unwrap();
    // A restart-requiring change: the new generation exits when drained.
    setup.write(&Knobs { drain_timeout: "1s", generation: 1, ..Knobs::default() });
    agent.signal(Signal::SIGHUP);
    wait_generations(&agent, &id, "the new generation", |g| g.first() == Some(&(1, "current")));
    wait_for("the stuck generation to be stopped", || exited(old).then_some(()));
    wait_generations(&agent, &id, "one generation", |g| g == [(1, "current")]);
    let logs = agent.logs();
    assert!(logs.contains("the old generation did not exit within drain_timeout; stopping it"), "{logs}");
}

#[test]
fn a_new_generation_that_fails_leaves_the_old_one_current() {
    let setup = Setup::new("epoch-fails");
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let agent = setup.start(&Knobs::default());
    let id = setup.id();
    let old = agent.proxy(&id).unwrap()["pid"].as_i64().unwrap();
    setup.write(&Knobs { extra: &["--fail"], generation: 1, ..Knobs::default() });
    agent.signal(Signal::SIGHUP);
    let status = wait_for("the hot restart to be abandoned", || agent.proxy(&id).filter(|p| p["error"].is_string()));
    let error = status["error"].as_str().unwrap();
    assert!(error.contains("hot restart abandoned, the old generation serves on"), "{error}");
    assert!(error.contains("the new generation is"), "says why: {error}");
    assert_eq!(status["state"], "running");
    assert_eq!(status["pid"].as_i64(), Some(old));
    assert!(alive(old), "never killed because its successor failed");
    assert_eq!(generations(&status), [(0, "current".to_owned())], "{status}");
    assert_eq!(wait_for("an answer", || served_by(setup.port)), "epoch 0");
}

#[test]
fn a_change_beyond_max_generations_waits_for_an_old_one_to_exit() {
    let setup = Setup::new("epoch-max");
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let knobs = |generation| Knobs { drain_s: 4.0, max_generations: 2, generation, ..Knobs::default() };
    let agent = setup.start(&knobs(0));
    let id = setup.id();
    let first = agent.proxy(&id).unwrap()["pid"].as_i64().unwrap();
    setup.write(&knobs(1));
    agent.signal(Signal::SIGHUP);
    wait_generations(&agent, &id, "two generations", |g| g == [(1, "current"), (0, "draining")]);

    setup.write(&knobs(2));
    agent.signal(Signal::SIGHUP);
    let waiting = wait_for("the change to wait", || {
        agent.proxy(&id).filter(|p| p["error"].as_str().is_some_and(|e| e.contains("waiting for an old generation")))
    });
    assert!(waiting["error"].as_str().unwrap().contains("2 run, and max_generations is 2"), "{waiting}");
    assert!(alive(first));
    assert_eq!(generations(&waiting).len(), 2, "no third generation: {waiting}");

    // Once the first generation exits, the change goes on.
    wait_for("the first generation to exit", || exited(first).then_some(()));
    let last = wait_generations(&agent, &id, "epoch 2", |g| g.first() == Some(&(2, "current")));
    assert!(last["error"].is_null(), "{last}");
}

#[test]
fn a_crash_of_the_current_generation_is_a_cold_start_at_epoch_0() {
    let setup = Setup::new("epoch-crash");
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let agent = setup.start(&Knobs { drain_s: 0.2, ..Knobs::default() });
    let id = setup.id();
    restart(&agent, &id);
    let current = wait_generations(&agent, &id, "epoch 1 alone", |g| g == [(1, "current")]);
    let crashed = current["pid"].as_i64().unwrap();
    kill(Pid::from_raw(crashed as i32), Signal::SIGKILL).unwrap();
    let cold = wait_generations(&agent, &id, "a cold start", |g| g == [(0, "current")]);
    let pid = cold["pid"].as_i64().unwrap();
    assert_ne!(pid, crashed);
    assert!(cmdline(pid as i32).windows(2).any(|w| w == ["--restart-epoch", "0"]), "{:?}", cmdline(pid as i32));
    assert_eq!(environ_var(pid as i32, "EPOCH").as_deref(), Some("epoch-0"));
    assert_eq!(wait_for("an answer", || served_by(setup.port)), "epoch 0");
}

/// The new generation dies while the old one drains (for a minute, within a `drain_timeout`
/// of 30 s): the old one gave its socket away and serves nothing new, so it is stopped at
/// once and the proxy starts cold, instead of refusing connections until the drain ends.
#[test]
fn a_crash_of_the_new_generation_mid_hand_over_stops_the_old_one_and_starts_cold() {
    let setup = Setup::new("epoch-midway");
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let (agent, pids) = setup.draining();
    let id = setup.id();
    let prober = Prober::start(setup.port);
    let crashed_at = std::time::Instant::now();
    kill(Pid::from_raw(pids[0] as i32), Signal::SIGKILL).unwrap();
    let cold = wait_generations(&agent, &id, "a cold start", |g| g == [(0, "current")]);
    let pid = cold["pid"].as_i64().unwrap();
    assert!(!pids.contains(&pid), "a new process: {cold}");
    assert!(exited(pids[1]), "the old generation was stopped: {cold}");
    assert_eq!(wait_for("an answer", || served_by(setup.port)), "epoch 0");
    let running_after = crashed_at.elapsed();
    let (tried, refused) = prober.counts();
    drop(prober);
    // A figure, not a bound: the machines are shared.
    eprintln!("serving again {running_after:?} after the crash; {refused} of {tried} connections refused");
}

/// The same crash with `keep_listening`: the agent kept a copy of the socket, so a connection
/// made while no generation listens waits in its backlog, and the cold start answers it.
#[test]
fn with_keep_listening_a_crash_mid_hand_over_refuses_nothing_and_the_cold_start_answers_what_waited() {
    if !is_root() {
        eprintln!(
            "skipped: keeping a proxy's sockets needs the right to trace it, and moving what waited needs net.ipv4.tcp_migrate_req, which only root may set"
        );
        return;
    }
    let setup = Setup::new("epoch-kept");
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let (agent, pids) = setup.draining_with(Knobs { keep_listening: true, ..Knobs::default() });
    let id = setup.id();
    wait_for("the agent to keep the socket", || agent.logs().contains("keeping the listening sockets").then_some(()));
    let prober = Prober::start(setup.port);
    wait_for("the prober's first tries", || (prober.counts().0 > 20).then_some(()));
    let crashed_at = std::time::Instant::now();
    kill(Pid::from_raw(pids[0] as i32), Signal::SIGKILL).unwrap();
    wait_for("the new generation to be gone", || exited(pids[0]).then_some(()));
    // Nothing of the proxy listens now but the kept copy: this connection waits in it.
    let waited = std::thread::spawn(move || served_by(setup.port));
    let cold = wait_generations(&agent, &id, "a cold start", |g| g == [(0, "current")]);
    let running_after = crashed_at.elapsed();
    assert!(!pids.contains(&cold["pid"].as_i64().unwrap()), "a new process: {cold}");
    assert_eq!(waited.join().unwrap().as_deref(), Some("epoch 0"), "the connection that waited is answered");
    assert_eq!(wait_for("an answer", || served_by(setup.port)), "epoch 0");
    wait_for("the old copy to be released", || agent.logs().contains(r#""kept":1,"released":1"#).then_some(()));
    let (tried, refused) = prober.counts();
    drop(prober);
    // On a refusal, what the agent did with the sockets tells when: kept, released, closed.
    let sockets = |logs: String| {
        logs.lines()
            .filter(|line| line.contains("listening sockets") || line.contains("generation"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(
        refused,
        0,
        "{refused} of {tried} connections refused across the crash; the agent:\n{}",
        sockets(agent.logs())
    );
    // A figure, not a bound: the machines are shared.
    eprintln!("running again {running_after:?} after the crash; 0 of {tried} connections refused");

    // Stopped, with a generation left draining: the copies close, and a connection is refused
    // rather than left waiting for nobody.
    restart(&agent, &id);
    wait_generations(&agent, &id, "a hot restart", |g| g == [(1, "current"), (0, "draining")]);
    let stopped = put(&agent.socket, &format!("/v1/agent/proxy/{id}/stop"), None).unwrap();
    assert_eq!(stopped.status, 200, "{}", stopped.body);
    agent.wait_state(&id, "stopped");
    wait_for("connections to be refused", || {
        std::net::TcpStream::connect(("127.0.0.1", setup.port)).is_err().then_some(())
    });
}

#[test]
fn an_agent_killed_and_started_again_adopts_every_live_generation() {
    let setup = Setup::new("epoch-adopt");
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let (mut agent, pids) = setup.draining();
    let id = setup.id();
    wait_for("the snapshot to record both generations", || {
        let text = snapshot(&setup.dirs.data);
        (text.contains("draining") && text.contains(&format!("\"pid\":{}", pids[1]))).then_some(())
    });

    agent.signal(Signal::SIGKILL);
    agent.wait();
    let agent = Agent::start(&setup.dirs, &root_flags());
    let after = wait_generations(&agent, &id, "both generations adopted", |g| g == [(1, "current"), (0, "draining")]);
    assert_eq!(generation_pids(&after), pids, "the same processes, not restarted: {after}");
    assert_eq!(after["restarts"], 0);
    assert!(pids.iter().all(|pid| alive(*pid)));
    assert_eq!(wait_for("an answer", || served_by(setup.port)), "epoch 1");

    // The base id is the proxy's across the agent restart: the next hot restart takes over.
    let base_id = |pid: i64| {
        let words = cmdline(pid as i32);
        words[words.iter().position(|w| w == "--base-id").unwrap() + 1].clone()
    };
    restart(&agent, &id);
    let next = wait_generations(&agent, &id, "epoch 2", |g| g.first() == Some(&(2, "current")));
    assert_eq!(base_id(next["pid"].as_i64().unwrap()), base_id(pids[0]));
}

/// The old generation would drain for a minute: the start does not wait for it, but stops it
/// (it handed its socket over, and serves nothing new), then starts cold.
#[test]
fn a_start_beside_an_old_generation_that_drains_stops_it_and_is_cold() {
    let setup = Setup::new("epoch-hold");
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let agent = setup.start(&Knobs { drain_s: 60.0, ..Knobs::default() });
    let id = setup.id();
    restart(&agent, &id);
    let during = wait_generations(&agent, &id, "both generations", |g| g == [(1, "current"), (0, "draining")]);
    let old = generation_pids(&during)[1];

    let stopped = put(&agent.socket, &format!("/v1/agent/proxy/{id}/stop"), None).unwrap();
    assert_eq!(stopped.status, 200, "{}", stopped.body);
    agent.wait_state(&id, "stopped");
    assert!(alive(old), "the old generation drains on");
    let started = put(&agent.socket, &format!("/v1/agent/proxy/{id}/start"), None).unwrap();
    assert_eq!(started.status, 200, "{}", started.body);
    let cold = wait_generations(&agent, &id, "a cold start", |g| g == [(0, "current")]);
    assert!(exited(old), "started only once the old generation exited: {cold}");
    assert_eq!(wait_for("an answer", || served_by(setup.port)), "epoch 0");
}

#[test]
fn a_proxy_switched_to_epoch_is_restarted_once_then_hands_over_by_itself() {
    let setup = Setup::new("epoch-switch");
    let _sweep = SweepOnDrop(setup.dirs.socket());
    // Before `update = "epoch"`: its own fixed epoch and base id, restarted as any proxy.
    setup.dirs.write_config(
        "envoy.toml",
        &format!(
            "[[service]]\nname = \"{}\"\n[service.proxy]\ncommand = [\"/usr/bin/python3\", \"{}\", \"--restart-epoch\", \
             \"0\", \"--base-id\", \"4242\", \"--port\", \"{}\"]\nkill_timeout = \"2s\"\n\
             [service.proxy.readiness]\nnotify = true\n",
            setup.name,
            setup.script.display(),
            setup.port
        ),
    );
    let agent = Agent::start(&setup.dirs, &root_flags());
    let id = setup.id();
    let plain = agent.wait_state(&id, "running");
    assert_eq!(plain["generations"], serde_json::json!([]), "no generations without update = \"epoch\"");
    let old = plain["pid"].as_i64().unwrap();

    // The old instance cannot hand over: it is stopped, and the first generation is cold.
    setup.write(&Knobs::default());
    agent.signal(Signal::SIGHUP);
    let first = wait_generations(&agent, &id, "the first generation", |g| g == [(0, "current")]);
    assert!(exited(old));
    assert_ne!(first["pid"].as_i64(), Some(old));
    assert!(first["error"].is_null(), "{first}");

    restart(&agent, &id);
    wait_generations(&agent, &id, "a hot restart", |g| g.first() == Some(&(1, "current")));
}

#[test]
fn without_a_snapshot_the_next_agent_tells_the_generations_apart_by_their_listeners() {
    let setup = Setup::new("epoch-nosnap");
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let (mut agent, pids) = setup.draining();
    let id = setup.id();

    // Killed before its snapshot told of the hot restart: here, no snapshot at all.
    agent.signal(Signal::SIGKILL);
    agent.wait();
    std::fs::remove_file(setup.dirs.data.join("snapshot.json")).unwrap();
    let agent = Agent::start(&setup.dirs, &root_flags());
    // The one that holds the listening socket is current; the one that gave it up drains.
    let after = wait_generations(&agent, &id, "both generations adopted", |g| g == [(1, "current"), (0, "draining")]);
    assert_eq!(generation_pids(&after), pids, "the same processes, not restarted: {after}");
    assert!(pids.iter().all(|pid| alive(*pid)));
    assert_eq!(wait_for("an answer", || served_by(setup.port)), "epoch 1");
    // The base id came back from the processes: the next hot restart takes over.
    restart(&agent, &id);
    wait_generations(&agent, &id, "epoch 2", |g| g.first() == Some(&(2, "current")));
}

#[test]
fn an_agent_that_shuts_down_leaves_every_generation_running_for_the_next() {
    let setup = Setup::new("epoch-close");
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let (mut agent, pids) = setup.draining();
    let id = setup.id();

    agent.signal(Signal::SIGTERM);
    assert!(agent.wait().success());
    assert!(pids.iter().all(|pid| alive(*pid)), "a shutdown of the agent is no restart of its proxies");
    let agent = Agent::start(&setup.dirs, &root_flags());
    let after = wait_generations(&agent, &id, "both generations adopted", |g| g == [(1, "current"), (0, "draining")]);
    assert_eq!(generation_pids(&after), pids, "{after}");
}
