//! The fleet catalog against a real etcd: each test starts its own `etcd` on free loopback
//! ports with a temp data dir (a guard kills it on drop), drives `tether fleet` and
//! `tether agent --etcd`, and checks the proxies that run. Without an etcd binary the tests
//! skip with a reason, except in CI, where `.ci/run` installs one.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use assert_cmd::prelude::*;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use nix::sys::signal::Signal;

use crate::support::{self, Agent, Dirs, Prober, ReservedPort, alive, is_root, mode, tether, wait_for, wait_until};

/// The etcd binary, if this machine has one.
fn etcd_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|dir| dir.join("etcd")).find(|candidate| candidate.is_file())
}

/// A port that was free on loopback a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A running etcd; dropping it kills it. `stop` and `start` keep its data and ports.
pub struct Etcd {
    binary: PathBuf,
    child: Option<Child>,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    /// Its ports, kept for it while it is stopped.
    _ports: [ReservedPort; 2],
    /// With TLS: the certificates of `make_certificates`, in `dir`.
    tls: bool,
}

impl Etcd {
    /// Starts an etcd, or returns `None` (and says why) when there is no etcd binary.
    fn start(test: &str) -> Option<Self> {
        Self::start_with(test, false)
    }

    /// Starts an etcd that serves TLS only and requires a client certificate, with a CA,
    /// server and client certificates made by `openssl` in its dir.
    fn start_tls(test: &str) -> Option<Self> {
        Self::start_with(test, true)
    }

    fn start_with(test: &str, tls: bool) -> Option<Self> {
        let Some(binary) = etcd_binary() else {
            assert!(std::env::var_os("CI").is_none(), "CI must have an etcd binary (.ci/run installs etcd-server)");
            eprintln!("skipping {test}: no etcd binary on PATH (apt-get install etcd-server)");
            return None;
        };
        let ports = [ReservedPort::new(), ReservedPort::new()];
        let mut etcd = Self {
            binary,
            child: None,
            dir: tempfile::tempdir().unwrap(),
            client_port: ports[0].port(),
            peer_port: ports[1].port(),
            _ports: ports,
            tls,
        };
        if tls {
            make_certificates(etcd.dir.path());
        }
        etcd.resume();
        Some(etcd)
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// A file of the TLS setup.
    fn file(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().unwrap().to_owned()
    }

    /// The client's TLS flags.
    fn client_tls_flags(&self) -> Vec<String> {
        ["--etcd-cacert", "ca.pem", "--etcd-cert", "client.pem", "--etcd-key", "client.key"]
            .iter()
            .enumerate()
            .map(|(i, arg)| if i % 2 == 1 { self.file(arg) } else { (*arg).to_owned() })
            .collect()
    }

    /// Starts etcd again on the same data dir and ports, and waits until it answers.
    fn resume(&mut self) {
        assert!(self.child.is_none());
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.dir.path().join("etcd.log")).unwrap();
        let mut command = support::command(&self.binary);
        if self.tls {
            command
                .arg(format!("--cert-file={}", self.file("server.pem")))
                .arg(format!("--key-file={}", self.file("server.key")))
                .arg(format!("--trusted-ca-file={}", self.file("ca.pem")))
                .arg("--client-cert-auth");
        }
        let child = command
            .arg("--name=test")
            .arg(format!("--data-dir={}", self.dir.path().join("data").display()))
            .arg(format!("--listen-client-urls={}", self.url()))
            .arg(format!("--advertise-client-urls={}", self.url()))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=test={peer}"))
            .arg("--logger=zap")
            .arg("--log-level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        if self.tls {
            wait_until("etcd to answer over TLS", || {
                let output = fleet_with(&self.url(), &["ls", "probe"], &self.client_tls_flags());
                output
                    .status
                    .success()
                    .then_some(())
                    .ok_or_else(|| String::from_utf8_lossy(&output.stderr).into_owned())
            });
            return;
        }
        wait_until("etcd to answer", || {
            let body = self.call("/v3/kv/range", r#"{"key": "AA=="}"#)?;
            body.contains("revision").then_some(()).ok_or(body)
        });
    }

    /// Kills etcd (its data stays).
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// One POST to etcd's JSON gateway; the body of a 200 answer.
    fn call(&self, path: &str, body: &str) -> Result<String, String> {
        gateway(self.client_port, path, body)
    }

    /// Writes a raw value; returns the new revision.
    fn put_raw(&self, key: &str, value: &str) -> i64 {
        let body = format!(r#"{{"key": "{}", "value": "{}"}}"#, BASE64.encode(key), BASE64.encode(value));
        revision_of(&self.call("/v3/kv/put", &body).unwrap())
    }

    /// Deletes every key under `prefix`.
    fn delete_prefix(&self, prefix: &str) {
        let mut end = prefix.as_bytes().to_vec();
        *end.last_mut().unwrap() += 1;
        let body = format!(r#"{{"key": "{}", "range_end": "{}"}}"#, BASE64.encode(prefix), BASE64.encode(&end));
        self.call("/v3/kv/deleterange", &body).unwrap();
    }

    /// The store's current revision.
    fn revision(&self) -> i64 {
        revision_of(&self.call("/v3/kv/range", r#"{"key": "AA=="}"#).unwrap())
    }

    /// Compacts the history up to the current revision.
    fn compact(&self) {
        let revision = self.revision();
        self.call("/v3/kv/compaction", &format!(r#"{{"revision": "{revision}", "physical": true}}"#)).unwrap();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One POST to the JSON gateway of the etcd at `client_port`; the body of a 200 answer.
fn gateway(client_port: u16, path: &str, body: &str) -> Result<String, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", client_port)).map_err(|err| err.to_string())?;
    stream.set_read_timeout(Some(support::DEADLINE)).unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).map_err(|err| err.to_string())?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).map_err(|err| err.to_string())?;
    let (head, body) = raw.split_once("\r\n\r\n").ok_or_else(|| raw.clone())?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(raw.clone());
    }
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return Ok(body.to_owned());
    }
    // A large answer comes in chunks: each a hex length line, then that many bytes.
    let mut rest = body;
    let mut whole = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n").ok_or_else(|| raw.clone())?;
        let size = usize::from_str_radix(size.trim(), 16).map_err(|_| raw.clone())?;
        if size == 0 {
            return Ok(whole);
        }
        whole.push_str(after.get(..size).ok_or_else(|| raw.clone())?);
        rest = after.get(size + 2..).ok_or_else(|| raw.clone())?;
    }
}

fn revision_of(body: &str) -> i64 {
    let value: serde_json::Value = serde_json::from_str(body).unwrap();
    value["header"]["revision"].as_str().and_then(|r| r.parse().ok()).unwrap_or_else(|| panic!("no revision: {body}"))
}

/// `tether fleet ARGS... --etcd URL`.
fn fleet(etcd_url: &str, args: &[&str]) -> Output {
    fleet_with(etcd_url, args, &[])
}

/// `tether fleet ARGS... --etcd URL EXTRA...`.
fn fleet_with(etcd_url: &str, args: &[&str], extra: &[String]) -> Output {
    let mut command = support::tether();
    command.arg("fleet").args(args).arg("--etcd").arg(etcd_url).args(extra).stdin(Stdio::null());
    command.output().unwrap()
}

/// A CA, and a server (127.0.0.1) and a client certificate that it signs, in `dir`.
fn make_certificates(dir: &std::path::Path) {
    let openssl = |args: &[&str]| {
        let output = std::process::Command::new("openssl").args(args).current_dir(dir).output().unwrap();
        assert!(output.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    openssl(
        &[
            &["req", "-x509"],
            &ec[..],
            &["-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=tether test CA"],
        ]
        .concat(),
    );
    for name in ["server", "client"] {
        let ext = format!("{name}.ext");
        std::fs::write(
            dir.join(&ext),
            "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        .unwrap();
        let (key, csr, pem) = (format!("{name}.key"), format!("{name}.csr"), format!("{name}.pem"));
        openssl(
            &[&["req"], &ec[..], &["-keyout", &key, "-out", &csr, "-subj", &format!("/CN=tether test {name}")]]
                .concat(),
        );
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            &ext,
        ]);
    }
}

fn have_openssl(test: &str) -> bool {
    let found = std::process::Command::new("openssl").arg("version").output().is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("skipping {test}: no openssl binary to make test certificates");
    }
    found
}

#[track_caller]
fn fleet_ok(etcd: &Etcd, args: &[&str]) -> String {
    let output = fleet(&etcd.url(), args);
    assert!(output.status.success(), "tether fleet {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The revision that `tether fleet put` reports for its (last) key.
fn put_revision(output: &str) -> i64 {
    let last = output.lines().last().unwrap_or_default();
    last.rsplit_once("(revision ")
        .and_then(|(_, rest)| rest.strip_suffix(')')?.parse().ok())
        .unwrap_or_else(|| panic!("{output}"))
}

/// A service file with one `/bin/sleep SECONDS` proxy, written to the temp dir.
fn service_file(dirs: &Dirs, name: &str, seconds: u32, kill_timeout: &str) -> PathBuf {
    let path = dirs.temp.path().join(format!("{name}-{seconds}-{kill_timeout}.toml"));
    std::fs::write(
        &path,
        format!(
            "[[service]]\nname = \"{name}\"\n[service.proxy]\ncommand = [\"/bin/sleep\", \"{seconds}\"]\nkill_timeout = \"{kill_timeout}\"\n"
        ),
    )
    .unwrap();
    path
}

fn put_sleeper(etcd: &Etcd, dirs: &Dirs, node: &str, name: &str, seconds: u32) {
    let file = service_file(dirs, name, seconds, "2s");
    fleet_ok(etcd, &["put", node, file.to_str().unwrap()]);
}

/// Starts an agent that follows `node` in `etcd`.
fn fleet_agent(dirs: &Dirs, etcd: &Etcd, node: &str) -> Agent {
    let url = etcd.url();
    let mut flags = vec!["--etcd", url.as_str(), "--node", node];
    if is_root() {
        flags.push("--allow-root");
    }
    Agent::start(dirs, &flags)
}

fn fleet_status(agent: &Agent) -> serde_json::Value {
    let response = support::get(&agent.socket, "/v1/agent/fleet").unwrap();
    assert_eq!(response.status, 200, "{}", response.body);
    response.json()
}

fn pid_of(agent: &Agent, id: &str) -> i64 {
    agent.wait_state(id, "running")["pid"].as_i64().unwrap()
}

fn metric(agent: &Agent, name: &str) -> Option<f64> {
    let body = support::get(&agent.socket, "/metrics").unwrap().body;
    body.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Stops the agent with SIGTERM (proxies keep running) and checks that it exited 0.
fn close(agent: &mut Agent) {
    agent.signal(Signal::SIGTERM);
    assert!(agent.wait().success(), "{}", agent.logs());
}

#[test]
fn a_put_starts_a_proxy_an_update_restarts_or_applies_in_place_and_a_delete_stops_it() {
    let Some(etcd) = Etcd::start("fleet put/update/delete") else { return };
    let dirs = Dirs::new();
    let agent = fleet_agent(&dirs, &etcd, "n1");

    put_sleeper(&etcd, &dirs, "n1", "web", 3600);
    let first = pid_of(&agent, "web-proxy");
    // Another node's keys are not ours.
    put_sleeper(&etcd, &dirs, "n2", "other", 3600);

    // A new command restarts the proxy (stop, then start: `update = "restart"`).
    put_sleeper(&etcd, &dirs, "n1", "web", 3601);
    let second = wait_for("web-proxy to restart with the new command", || {
        agent.proxy("web-proxy").filter(|p| p["state"] == "running" && p["pid"].as_i64() != Some(first))
    })["pid"]
        .as_i64()
        .unwrap();
    assert!(!alive(first));

    // A new kill_timeout applies in place: same process.
    let in_place = service_file(&dirs, "web", 3601, "3s");
    let put = fleet_ok(&etcd, &["put", "n1", in_place.to_str().unwrap()]);
    // The put's own revision: the store's moves on with the status the agent publishes.
    let revision = put_revision(&put);
    wait_until("the agent to apply the in-place change", || {
        let status = fleet_status(&agent);
        (status["revision"].as_i64() >= Some(revision)).then_some(()).ok_or(status.to_string())
    });
    assert_eq!(pid_of(&agent, "web-proxy"), second);
    assert!(agent.proxy("other-proxy").is_none());

    let listing = fleet_ok(&etcd, &["ls", "n1"]);
    assert!(listing.lines().any(|line| line.starts_with("web ") && line.ends_with(" ok")), "{listing}");

    fleet_ok(&etcd, &["rm", "n1", "web"]);
    agent.wait_gone("web-proxy");
    assert!(!alive(second));
    let again = fleet(&etcd.url(), &["rm", "n1", "web"]);
    assert_eq!(again.status.code(), Some(1), "{}", String::from_utf8_lossy(&again.stderr));
}

#[test]
fn an_invalid_value_is_reported_for_its_key_and_the_others_apply() {
    let Some(etcd) = Etcd::start("fleet invalid value") else { return };
    let dirs = Dirs::new();
    etcd.put_raw("/tether/nodes/n1/services/bad", r#"{"name": "bad", "proxy": {"kill_timeot": "1s"}}"#);
    etcd.put_raw("/tether/nodes/n1/services/alias", r#"{"name": "web"}"#);
    let agent = fleet_agent(&dirs, &etcd, "n1");
    put_sleeper(&etcd, &dirs, "n1", "good", 3600);
    pid_of(&agent, "good-proxy");

    let status = wait_until("both bad keys to be reported", || {
        let status = fleet_status(&agent);
        (status["invalid"].as_object().map(|o| o.len()) == Some(2)).then(|| status.clone()).ok_or(status.to_string())
    });
    let problem = status["invalid"]["/tether/nodes/n1/services/bad"].as_str().unwrap();
    assert!(problem.contains("kill_timeot"), "{problem}");
    let mismatch = status["invalid"]["/tether/nodes/n1/services/alias"].as_str().unwrap();
    assert!(mismatch.contains("differs from the key"), "{mismatch}");
    assert_eq!(metric(&agent, "tether_fleet_invalid_keys"), Some(2.0));
    assert_eq!(metric(&agent, "tether_fleet_connected"), Some(1.0));
    assert!(agent.logs().contains("/tether/nodes/n1/services/bad"), "{}", agent.logs());
    assert!(agent.proxy("bad-proxy").is_none() && agent.proxy("web-proxy").is_none());

    // `fleet ls` shows the problem too; fixing the value clears it.
    let listing = fleet_ok(&etcd, &["ls", "n1"]);
    assert!(listing.contains("invalid:") && listing.contains("kill_timeot"), "{listing}");
    etcd.put_raw("/tether/nodes/n1/services/bad", r#"{"name": "bad"}"#);
    wait_until("the fixed key to leave the report", || {
        let status = fleet_status(&agent);
        (status["invalid"].as_object().map(|o| o.len()) == Some(1)).then_some(()).ok_or(status.to_string())
    });
}

#[test]
fn proxies_outlive_an_etcd_outage_and_an_agent_restart_and_changes_apply_on_return() {
    let Some(mut etcd) = Etcd::start("fleet outage") else { return };
    let dirs = Dirs::new();
    let mut agent = fleet_agent(&dirs, &etcd, "n1");
    put_sleeper(&etcd, &dirs, "n1", "a", 3600);
    put_sleeper(&etcd, &dirs, "n1", "b", 3600);
    let a = pid_of(&agent, "a-proxy");
    let b = pid_of(&agent, "b-proxy");
    assert_eq!(mode(&dirs.data.join("fleet.json")), 0o600);

    // etcd goes away: nothing stops.
    etcd.stop();
    wait_until("the agent to notice", || {
        let status = fleet_status(&agent);
        (status["connected"] == false).then_some(()).ok_or(status.to_string())
    });
    assert_eq!((pid_of(&agent, "a-proxy"), pid_of(&agent, "b-proxy")), (a, b));

    // Meanwhile the fleet changes, while this agent is stopped: a goes, c comes.
    close(&mut agent);
    etcd.resume();
    fleet_ok(&etcd, &["rm", "n1", "a"]);
    put_sleeper(&etcd, &dirs, "n1", "c", 3600);
    etcd.stop();

    // An agent that starts while etcd is down runs the last known set: a and b, adopted.
    let agent = fleet_agent(&dirs, &etcd, "n1");
    assert_eq!((pid_of(&agent, "a-proxy"), pid_of(&agent, "b-proxy")), (a, b));
    assert!(agent.proxy("c-proxy").is_none());
    assert_eq!(fleet_status(&agent)["connected"], false);

    // etcd is back: the agent reconnects and applies what changed; b is untouched.
    etcd.resume();
    pid_of(&agent, "c-proxy");
    agent.wait_gone("a-proxy");
    assert!(!alive(a));
    assert_eq!(pid_of(&agent, "b-proxy"), b);
    // Connected once its watch is set up, which may come after the read that started it.
    wait_for("the watch on etcd", || fleet_status(&agent)["connected"].as_bool().filter(|connected| *connected));
}

#[test]
fn a_compacted_revision_triggers_a_full_read_and_nothing_is_lost() {
    let Some(etcd) = Etcd::start("fleet compaction") else { return };
    let dirs = Dirs::new();
    let mut agent = fleet_agent(&dirs, &etcd, "n1");
    put_sleeper(&etcd, &dirs, "n1", "a", 3600);
    put_sleeper(&etcd, &dirs, "n1", "b", 3600);
    let b = pid_of(&agent, "b-proxy");
    pid_of(&agent, "a-proxy");
    close(&mut agent);

    // While the agent is away, history moves on and is compacted past its revision.
    fleet_ok(&etcd, &["rm", "n1", "a"]);
    put_sleeper(&etcd, &dirs, "n1", "c", 3600);
    put_sleeper(&etcd, &dirs, "n1", "c", 3601);
    etcd.put_raw("/tether/nodes/n1/services/d", r#"{"name": "d", "proxy": {"command": ["/bin/sleep", "3600"]}}"#);
    etcd.compact();

    let agent = fleet_agent(&dirs, &etcd, "n1");
    let c = pid_of(&agent, "c-proxy");
    pid_of(&agent, "d-proxy");
    agent.wait_gone("a-proxy");
    assert_eq!(pid_of(&agent, "b-proxy"), b);
    assert!(support::cmdline(i32::try_from(c).unwrap()).contains(&"3601".to_owned()));
    assert_eq!(metric(&agent, "tether_fleet_compactions_total"), Some(1.0));
    assert!(metric(&agent, "tether_fleet_full_reads_total") >= Some(1.0));
}

#[test]
fn fleet_commands_check_their_input_first_and_fail_when_etcd_is_unreachable() {
    let dirs = Dirs::new();
    // Claimed, never listened on: no other test's server can take it meanwhile.
    let unused = ReservedPort::new();
    let closed = format!("http://127.0.0.1:{}", unused.port());
    let file = service_file(&dirs, "web", 3600, "2s");
    let file = file.to_str().unwrap();

    let bad_node = fleet(&closed, &["put", "a/b", file]);
    assert_eq!(bad_node.status.code(), Some(2), "{}", String::from_utf8_lossy(&bad_node.stderr));
    let bad_file = dirs.temp.path().join("bad.toml");
    std::fs::write(&bad_file, "[[service]]\nname = \"web\"\nprot = 1\n").unwrap();
    let output = fleet(&closed, &["put", "n1", bad_file.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("prot"));
    let missing_ca = fleet(&closed, &["ls", "n1", "--etcd-cacert", "/nonexistent/ca.pem"]);
    assert_eq!(missing_ca.status.code(), Some(2), "{}", String::from_utf8_lossy(&missing_ca.stderr));
    let half = fleet(&closed, &["ls", "n1", "--etcd-cert", file]);
    assert_eq!(half.status.code(), Some(2));

    let unreachable = fleet(&closed, &["put", "n1", file]);
    assert_eq!(unreachable.status.code(), Some(1), "{}", String::from_utf8_lossy(&unreachable.stderr));
    let stderr = String::from_utf8_lossy(&unreachable.stderr);
    assert!(stderr.contains(&closed), "{stderr}");

    // The agent refuses fleet options it cannot use, before it starts anything.
    for flags in [
        vec!["--etcd", closed.as_str()],
        vec!["--etcd", closed.as_str(), "--node", "a/b"],
        vec!["--etcd", closed.as_str(), "--node", "n1", "--etcd-cacert", "/nonexistent/ca.pem"],
        vec!["--etcd", closed.as_str(), "--node", "n1", "--etcd-prefix", "tether"],
    ] {
        let mut agent = Agent::spawn(&dirs, &flags);
        let status = agent.wait();
        assert_eq!(status.code(), Some(2), "{flags:?}: {}", agent.logs());
    }
}

#[test]
fn an_agent_with_an_unreachable_etcd_starts_and_reports_it() {
    let dirs = Dirs::new();
    // Claimed, never listened on: no other test's server can take it meanwhile.
    let unused = ReservedPort::new();
    let closed = format!("http://127.0.0.1:{}", unused.port());
    let agent = Agent::start(&dirs, &["--etcd", closed.as_str(), "--node", "n1"]);
    wait_until("the failed connection to show", || {
        let status = fleet_status(&agent);
        (status["last_error"].as_str().is_some_and(|e| e.contains(&closed))).then_some(()).ok_or(status.to_string())
    });
    assert_eq!(metric(&agent, "tether_fleet_connected"), Some(0.0));
    assert!(metric(&agent, "tether_fleet_connect_failures_total") >= Some(1.0));
    assert!(agent.proxies().is_empty());
}

#[test]
fn user_and_password_reach_an_etcd_with_auth_enabled() {
    let Some(etcd) = Etcd::start("fleet auth") else { return };
    etcd.call("/v3/auth/role/add", r#"{"name": "root"}"#).unwrap();
    etcd.call("/v3/auth/user/add", r#"{"name": "root", "password": "secret"}"#).unwrap();
    etcd.call("/v3/auth/user/grant", r#"{"user": "root", "role": "root"}"#).unwrap();
    etcd.call("/v3/auth/enable", "{}").unwrap();
    let dirs = Dirs::new();
    let file = service_file(&dirs, "web", 3600, "2s");
    let file = file.to_str().unwrap();

    let anonymous = fleet(&etcd.url(), &["put", "n1", file]);
    assert_eq!(anonymous.status.code(), Some(1), "{}", String::from_utf8_lossy(&anonymous.stderr));
    fleet_ok(&etcd, &["put", "n1", file, "--etcd-user", "root:secret"]);
    let output = support::tether()
        .args(["fleet", "ls", "n1", "--etcd", &etcd.url(), "--etcd-user", "root"])
        .env("TETHER_ETCD_PASSWORD", "secret")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&output.stdout).contains("web"), "{}", String::from_utf8_lossy(&output.stderr));

    let url = etcd.url();
    let mut flags = vec!["--etcd", url.as_str(), "--node", "n1", "--etcd-user", "root:secret"];
    if is_root() {
        flags.push("--allow-root");
    }
    let agent = Agent::start(&dirs, &flags);
    pid_of(&agent, "web-proxy");
    assert!(!agent.logs().contains("secret"), "the password must not be logged");
}

#[test]
fn tls_with_a_private_ca_and_a_client_certificate_reaches_etcd() {
    if !have_openssl("fleet TLS") {
        return;
    }
    let Some(etcd) = Etcd::start_tls("fleet TLS") else { return };
    let dirs = Dirs::new();
    let file = service_file(&dirs, "web", 3600, "2s");
    let tls = etcd.client_tls_flags();

    // Without the client certificate, or without the CA, etcd is not reachable.
    let no_client = fleet_with(&etcd.url(), &["ls", "n1"], &tls[..2]);
    assert_eq!(no_client.status.code(), Some(1), "{}", String::from_utf8_lossy(&no_client.stderr));
    let no_ca = fleet_with(&etcd.url(), &["ls", "n1"], &tls[2..]);
    assert_eq!(no_ca.status.code(), Some(1), "{}", String::from_utf8_lossy(&no_ca.stderr));

    let put = fleet_with(&etcd.url(), &["put", "n1", file.to_str().unwrap()], &tls);
    assert!(put.status.success(), "{}", String::from_utf8_lossy(&put.stderr));
    let url = etcd.url();
    let mut flags: Vec<&str> = vec!["--etcd", url.as_str(), "--node", "n1"];
    flags.extend(tls.iter().map(String::as_str));
    if is_root() {
        flags.push("--allow-root");
    }
    let agent = Agent::start(&dirs, &flags);
    pid_of(&agent, "web-proxy");
    // Connected once its watch is set up, which may come after the read that started it.
    wait_for("the watch on etcd", || fleet_status(&agent)["connected"].as_bool().filter(|connected| *connected));
}

#[test]
fn the_first_change_after_a_quiet_period_applies_at_once_from_etcd() {
    let Some(etcd) = Etcd::start("fleet latency") else { return };
    let dirs = Dirs::new();
    let _sweep = support::SweepOnDrop(dirs.socket());
    let url = etcd.url();
    // Coalescing windows no test can wait out: a change that waited for one would never apply.
    let mut flags = vec!["--etcd", url.as_str(), "--node", "n1", "--sync-quiescent", "1h", "--sync-max-delay", "2h"];
    if is_root() {
        flags.push("--allow-root");
    }
    let agent = Agent::start(&dirs, &flags);
    wait_for("the watch on etcd", || fleet_status(&agent)["connected"].as_bool().filter(|connected| *connected));
    put_sleeper(&etcd, &dirs, "n1", "web", 3600);
    agent.wait_state("web-proxy", "running");
}

/// The status lease's TTL of the agents of the multi-node tests: short, so that a dead
/// agent's node shows `down` soon.
const TTL_SECONDS: u64 = 2;

/// Starts an agent that follows `node` in `etcd` and publishes its status under the store's
/// short lease.
fn publishing_agent(dirs: &Dirs, etcd: &impl Store, node: &str) -> Agent {
    publishing_agent_with(dirs, etcd, node, &[])
}

/// [`publishing_agent`], with `extra` flags.
fn publishing_agent_with<S: Store>(dirs: &Dirs, etcd: &S, node: &str, extra: &[&str]) -> Agent {
    let urls = etcd.urls();
    let ttl = format!("{}s", S::TTL_SECONDS);
    let mut flags = vec!["--etcd", urls.as_str(), "--node", node, "--fleet-ttl", ttl.as_str()];
    if is_root() {
        flags.push("--allow-root");
    }
    flags.extend(extra);
    Agent::start(dirs, &flags)
}

/// `tether fleet status --json`: its exit code and its document.
fn fleet_view(etcd: &Etcd) -> (Option<i32>, serde_json::Value) {
    let output = fleet(&etcd.url(), &["status", "--json"]);
    let text = String::from_utf8_lossy(&output.stdout);
    let value = serde_json::from_str(&text)
        .unwrap_or_else(|err| panic!("{err}: {text}{}", String::from_utf8_lossy(&output.stderr)));
    (output.status.code(), value)
}

/// Node `node` of a `fleet status --json` document.
fn node_of<'a>(view: &'a serde_json::Value, node: &str) -> &'a serde_json::Value {
    view["nodes"]
        .as_array()
        .and_then(|nodes| nodes.iter().find(|n| n["node"] == node))
        .unwrap_or(&serde_json::Value::Null)
}

/// What the agents of [`Nodes`] follow: one etcd, or a cluster of three members
/// (`cluster::Cluster`).
trait Store: Sized {
    /// The status lease's TTL of the agents that follow it.
    const TTL_SECONDS: u64;

    /// Starts it, or returns `None` (and says why) when there is no etcd binary.
    fn up(test: &str) -> Option<Self>;

    /// Every client URL, comma-separated, as `--etcd` takes them.
    fn urls(&self) -> String;

    /// `tether fleet status --json` through [`Store::urls`]: its exit code and its document.
    fn view(&self) -> (Option<i32>, serde_json::Value);
}

impl Store for Etcd {
    const TTL_SECONDS: u64 = TTL_SECONDS;

    fn up(test: &str) -> Option<Self> {
        Etcd::start(test)
    }

    fn urls(&self) -> String {
        self.url()
    }

    fn view(&self) -> (Option<i32>, serde_json::Value) {
        fleet_view(self)
    }
}

/// Three agents on one machine as three nodes, [`Nodes::NODES`], that follow `etcd` and
/// publish their status, and their dirs.
struct Nodes<S: Store> {
    // Agents first: they go before etcd and their dirs.
    agents: Vec<Agent>,
    dirs: Vec<Dirs>,
    etcd: S,
}

/// Three nodes that follow one etcd.
type ThreeNodes = Nodes<Etcd>;

impl<S: Store> Nodes<S> {
    const NODES: [&'static str; 3] = ["n1", "n2", "n3"];

    fn start(test: &str) -> Option<Self> {
        let etcd = S::up(test)?;
        let dirs: Vec<Dirs> = Self::NODES.iter().map(|_| Dirs::new()).collect();
        let agents = Self::NODES.iter().zip(&dirs).map(|(node, dirs)| publishing_agent(dirs, &etcd, node)).collect();
        Some(Self { agents, dirs, etcd })
    }

    /// Waits until `fleet status` exits 0 with every node up and `proxies` proxies ready on
    /// each, on its desired revision; returns the document.
    #[track_caller]
    fn wait_all_ready(&self, proxies: usize) -> serde_json::Value {
        wait_until("every node up with every proxy ready on its desired revision", || {
            let (code, view) = self.etcd.view();
            let ready = Self::NODES.iter().all(|node| {
                let node = node_of(&view, node);
                node["state"] == "up"
                    && node["proxies"].as_array().is_some_and(|p| {
                        p.len() == proxies
                            && p.iter().all(|p| p["ready"] == true && p["running_revision"] == p["desired_revision"])
                    })
            });
            (code == Some(0) && ready).then(|| view.clone()).ok_or(view.to_string())
        })
    }

    /// The pid of `proxy` on each node, in [`Nodes::NODES`]' order.
    fn pids(&self, proxy: &str) -> Vec<i64> {
        self.agents.iter().map(|agent| pid_of(agent, proxy)).collect()
    }
}

#[test]
fn the_page_shows_every_node_of_the_fleet_and_a_killed_agent_down() {
    if crate::page::browser_missing() {
        return;
    }
    let Some(etcd) = Etcd::start("the fleet on the page") else { return };
    let dirs: Vec<Dirs> = ThreeNodes::NODES.iter().map(|_| Dirs::new()).collect();
    let _sweeps: Vec<support::SweepOnDrop> = dirs.iter().map(|dirs| support::SweepOnDrop(dirs.socket())).collect();
    let http_addr = format!("127.0.0.1:{}", crate::page::free_port());
    let mut agents: Vec<Agent> = ThreeNodes::NODES
        .iter()
        .zip(&dirs)
        .map(|(node, dirs)| match *node {
            "n1" => publishing_agent_with(dirs, &etcd, node, &["--http-addr", &http_addr]),
            _ => publishing_agent(dirs, &etcd, node),
        })
        .collect();
    for (node, dirs) in ThreeNodes::NODES.iter().zip(&dirs) {
        put_sleeper(&etcd, dirs, node, "web", 3600);
    }
    let browser = crate::page::Browser::start();
    browser.open(&format!("http://{http_addr}/"));
    let node_state = |node: &str| {
        browser.eval(&format!(
            "const row = document.querySelector('#nodes tr[data-node=\"{node}\"]'); \
             return row ? [row.children[1].textContent, row.children[2].textContent] : null;"
        ))
    };
    // Read through n1's agent: every node up, each with its proxy ready.
    wait_for("every node up and ready on n1's page", || {
        ThreeNodes::NODES.iter().all(|node| node_state(node) == serde_json::json!(["up", "1"])).then_some(())
    });
    let summary = browser.eval("return document.getElementById('fleet-summary').textContent;");
    assert_eq!(summary, serde_json::json!("3 nodes, 3 up; converged"));
    browser.screenshot(&crate::page::artifact("fleet-up"));

    // kill -9 of n2's agent: the page shows n2 down once its lease expires.
    agents[1].signal(Signal::SIGKILL);
    agents[1].wait();
    let killed = Instant::now();
    wait_for("n2 down on the page", || (node_state("n2").get(0) == Some(&serde_json::json!("down"))).then_some(()));
    eprintln!("n2 shown down {:?} after its agent was killed (TTL {TTL_SECONDS} s)", killed.elapsed());
    let summary = browser.eval("return document.getElementById('fleet-summary').textContent;");
    assert_eq!(summary, serde_json::json!("3 nodes, 2 up; not converged"));
    browser.screenshot(&crate::page::artifact("fleet-node-down"));
    drop(agents);
}

#[test]
fn fleet_status_shows_every_node_and_a_killed_agent_is_down_within_the_ttl_then_up_with_nothing_restarted() {
    let Some(mut fleet_nodes) = ThreeNodes::start("fleet status of three nodes") else { return };
    let _sweeps: Vec<support::SweepOnDrop> =
        fleet_nodes.dirs.iter().map(|dirs| support::SweepOnDrop(dirs.socket())).collect();
    for (node, dirs) in ThreeNodes::NODES.iter().zip(&fleet_nodes.dirs) {
        put_sleeper(&fleet_nodes.etcd, dirs, node, "web", 3600);
    }
    let view = fleet_nodes.wait_all_ready(1);
    let n2 = &node_of(&view, "n2")["proxies"][0];
    let (pid, desired) = (n2["pid"].as_i64().unwrap(), n2["desired_revision"].as_i64().unwrap());
    assert_eq!(pid, pid_of(&fleet_nodes.agents[1], "web-proxy"));

    // The table: a row per node and proxy, and the counts.
    let table = fleet_ok(&fleet_nodes.etcd, &["status"]);
    for node in ThreeNodes::NODES {
        assert!(
            table.lines().any(|line| line.starts_with(node) && line.contains("web-proxy") && line.contains("running")),
            "{table}"
        );
    }
    assert!(table.trim_end().ends_with("nodes: 3 up, 0 down; proxies: 3 ready, 0 not ready"), "{table}");

    // Nothing secret is published: no command line, no environment, no token.
    let published = status_keys(&fleet_nodes.etcd);
    assert!(!published.is_empty(), "no status key was published");
    for (_, value) in published {
        for secret in ["/bin/sleep", "TETHER_", "token", "env"] {
            assert!(!value.contains(secret), "{value}");
        }
    }

    // An idle fleet writes nothing: the store's revision stays put across lease renewals.
    let before = fleet_nodes.etcd.revision();
    std::thread::sleep(Duration::from_secs(TTL_SECONDS * 2));
    assert_eq!(fleet_nodes.etcd.revision(), before, "idle agents wrote to etcd");

    // kill -9 of n2's agent: its node is down within the TTL and 2 s, and the command exits 1
    // while it is, so that a script sees the dead host; its proxy runs on.
    fleet_nodes.agents[1].signal(Signal::SIGKILL);
    fleet_nodes.agents[1].wait();
    let killed = Instant::now();
    wait_until("n2 to be down", || {
        let (code, view) = fleet_view(&fleet_nodes.etcd);
        (node_of(&view, "n2")["state"] == "down" && code == Some(1)).then_some(()).ok_or(view.to_string())
    });
    assert!(killed.elapsed() <= Duration::from_secs(TTL_SECONDS + 2), "down after {:?}", killed.elapsed());
    assert!(alive(pid));
    let output = fleet(&fleet_nodes.etcd.url(), &["status"]);
    assert_eq!(output.status.code(), Some(1), "a node is down: {output:?}");
    let table = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(table.lines().any(|line| line.starts_with("n2") && line.contains(" down")), "{table}");
    // Nodes that are up pass on their own.
    let output = fleet(&fleet_nodes.etcd.url(), &["status", "--node", "n1"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    assert!(table.trim_end().ends_with("nodes: 2 up, 1 down; proxies: 2 ready, 1 not ready"), "{table}");

    // A new agent adopts the proxy: n2 is up again, nothing restarted.
    // The killed agent's guard is kept until the end: dropping it now would kill the proxies
    // that the new agent adopts.
    let _killed =
        std::mem::replace(&mut fleet_nodes.agents[1], publishing_agent(&fleet_nodes.dirs[1], &fleet_nodes.etcd, "n2"));
    let view = fleet_nodes.wait_all_ready(1);
    let n2 = &node_of(&view, "n2")["proxies"][0];
    assert_eq!((n2["pid"].as_i64(), n2["restarts"].as_u64()), (Some(pid), Some(0)));
    assert_eq!(n2["running_revision"].as_i64(), Some(desired));
}

#[test]
fn fleet_status_fails_while_a_node_runs_an_old_revision_or_is_not_ready() {
    let Some(etcd) = Etcd::start("fleet status exit code") else { return };
    let dirs = Dirs::new();
    let _sweep = support::SweepOnDrop(dirs.socket());
    let agent = publishing_agent(&dirs, &etcd, "n1");
    put_sleeper(&etcd, &dirs, "n1", "web", 3600);
    pid_of(&agent, "web-proxy");
    wait_until("fleet status to succeed", || {
        let (code, view) = fleet_view(&etcd);
        (code == Some(0)).then_some(()).ok_or(view.to_string())
    });
    // A desired key that the agent cannot run (its program does not exist) fails the check,
    // with the proxy's error shown.
    etcd.put_raw(
        "/tether/nodes/n1/services/broken",
        r#"{"name": "broken", "proxy": {"command": ["/nonexistent/program"]}}"#,
    );
    let view = wait_until("the broken proxy's error to show", || {
        let (code, view) = fleet_view(&etcd);
        let broken = node_of(&view, "n1")["proxies"]
            .as_array()
            .and_then(|p| p.iter().find(|p| p["proxy"] == "broken-proxy").cloned());
        (code == Some(1) && broken.as_ref().is_some_and(|b| b["error"].is_string()))
            .then(|| view.clone())
            .ok_or(view.to_string())
    });
    let broken = node_of(&view, "n1")["proxies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["proxy"] == "broken-proxy")
        .unwrap()
        .clone();
    assert_eq!(broken["ready"], false, "{broken}");
    // Filtered to the service that runs, the check passes again.
    let output = fleet(&etcd.url(), &["status", "--service", "web"]);
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stdout));
    let bad = fleet(&etcd.url(), &["status", "--node", "a/b"]);
    assert_eq!(bad.status.code(), Some(2), "{}", String::from_utf8_lossy(&bad.stderr));
}

/// A service file of `web`: `/bin/sleep SECONDS`, ready once `probe` (an exec readiness
/// probe's words) passes.
fn web_version(dirs: &Dirs, seconds: u32, probe: &[&str]) -> PathBuf {
    let path = dirs.temp.path().join(format!("web-{seconds}.toml"));
    let probe = probe.iter().map(|word| format!("\"{word}\"")).collect::<Vec<_>>().join(", ");
    std::fs::write(
        &path,
        format!(
            "[[service]]\nname = \"web\"\n[service.proxy]\ncommand = [\"/bin/sleep\", \"{seconds}\"]\nkill_timeout = \"2s\"\n[service.proxy.readiness]\nexec = [{probe}]\ninterval = \"100ms\"\ntimeout = \"2s\"\n"
        ),
    )
    .unwrap();
    path
}

/// `tether fleet rollout ARGS...` as a child whose output goes to a file; killed on drop.
struct RolloutCli {
    child: Option<Child>,
    out: PathBuf,
}

impl RolloutCli {
    fn spawn(etcd: &impl Store, dirs: &Dirs, args: &[&str]) -> Self {
        static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let out = dirs.temp.path().join(format!("rollout-{n}.out"));
        let file = std::fs::File::create(&out).unwrap();
        let child = support::tether()
            .arg("fleet")
            .arg("rollout")
            .args(args)
            .args(["--etcd", &etcd.urls()])
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        Self { child: Some(child), out }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// Waits for the command's exit code.
    #[track_caller]
    fn wait(&mut self) -> Option<i32> {
        let child = self.child.as_mut().unwrap();
        let status = wait_for("the rollout to end", || child.try_wait().unwrap());
        self.child = None;
        status.code()
    }
}

impl Drop for RolloutCli {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Every status key the agents publish (`/tether/status/...`), with its value, as text.
fn status_keys(etcd: &Etcd) -> Vec<(String, String)> {
    let body = etcd
        .call(
            "/v3/kv/range",
            &format!(
                r#"{{"key": "{}", "range_end": "{}"}}"#,
                BASE64.encode("/tether/status/"),
                BASE64.encode("/tether/status0")
            ),
        )
        .unwrap();
    let value: serde_json::Value = serde_json::from_str(&body).unwrap();
    let text = |field: &serde_json::Value| String::from_utf8(BASE64.decode(field.as_str().unwrap()).unwrap()).unwrap();
    value["kvs"]
        .as_array()
        .map(|kvs| kvs.iter().map(|kv| (text(&kv["key"]), text(&kv["value"]))).collect())
        .unwrap_or_default()
}

/// Each node's published `web-proxy`: (ready, running revision), from the status keys.
fn published_web(etcd: &Etcd) -> std::collections::BTreeMap<String, (bool, Option<i64>)> {
    let mut seen = std::collections::BTreeMap::new();
    for (key, value) in status_keys(etcd) {
        let Some(node) = key.strip_prefix("/tether/status/").and_then(|rest| rest.strip_suffix("/proxies/web-proxy"))
        else {
            continue;
        };
        let status: serde_json::Value = serde_json::from_str(&value).unwrap();
        seen.insert(node.to_owned(), (status["ready"] == true, status["revision"].as_i64()));
    }
    seen
}

/// Puts version 3600 of `web` on every node and waits until all run it; returns each node's
/// revision and pid.
fn first_version(fleet_nodes: &ThreeNodes) -> std::collections::BTreeMap<String, (i64, i64)> {
    let v1 = web_version(&fleet_nodes.dirs[0], 3600, &["/bin/true"]);
    for node in ThreeNodes::NODES {
        fleet_ok(&fleet_nodes.etcd, &["put", node, v1.to_str().unwrap()]);
    }
    let view = fleet_nodes.wait_all_ready(1);
    ThreeNodes::NODES
        .iter()
        .map(|node| {
            let proxy = &node_of(&view, node)["proxies"][0];
            ((*node).to_owned(), (proxy["running_revision"].as_i64().unwrap(), proxy["pid"].as_i64().unwrap()))
        })
        .collect()
}

#[test]
fn a_rollout_goes_one_node_at_a_time_in_the_given_order() {
    let Some(fleet_nodes) = ThreeNodes::start("fleet rollout order") else { return };
    let _sweeps: Vec<support::SweepOnDrop> =
        fleet_nodes.dirs.iter().map(|dirs| support::SweepOnDrop(dirs.socket())).collect();
    let before = first_version(&fleet_nodes);
    // The new version gets ready half a second after it starts: a window that two nodes
    // between versions at once would show in.
    let v2 = web_version(&fleet_nodes.dirs[0], 3601, &["/bin/sleep", "0.5"]);
    let mut rollout = RolloutCli::spawn(
        &fleet_nodes.etcd,
        &fleet_nodes.dirs[0],
        &[v2.to_str().unwrap(), "--nodes", "n3,n1,n2", "--max-parallel", "1"],
    );
    let mut order: Vec<String> = Vec::new();
    let mut snapshots = 0;
    let code = loop {
        let seen = published_web(&fleet_nodes.etcd);
        snapshots += 1;
        let mut between = Vec::new();
        for node in ThreeNodes::NODES {
            match seen.get(node) {
                Some((true, Some(revision))) if *revision == before[node].0 => {}
                Some((true, Some(revision))) if *revision > before[node].0 => {
                    if !order.iter().any(|done| done == node) {
                        order.push(node.to_owned());
                    }
                }
                other => between.push(format!("{node}: {other:?}")),
            }
        }
        assert!(between.len() <= 1, "two nodes between versions at once: {between:?}\n{}", rollout.output());
        if let Some(status) = rollout.child.as_mut().unwrap().try_wait().unwrap() {
            rollout.child = None;
            break status.code();
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(code, Some(0), "{}", rollout.output());
    assert_eq!(order, ["n3", "n1", "n2"], "{}", rollout.output());
    assert!(snapshots > 10, "the rollout was observed {snapshots} times only");
    let output = rollout.output();
    let lines: Vec<&str> = output.lines().filter(|line| line.contains("running and ready")).collect();
    assert!(lines.len() == 3 && lines[0].starts_with("n3:") && lines[2].starts_with("n2:"), "{output}");
    let view = fleet_nodes.wait_all_ready(1);
    for node in ThreeNodes::NODES {
        assert_ne!(node_of(&view, node)["proxies"][0]["pid"].as_i64(), Some(before[node].1));
    }
}

#[test]
fn a_version_that_never_gets_ready_fails_at_the_first_node_and_is_rolled_back() {
    let Some(fleet_nodes) = ThreeNodes::start("fleet rollout failure") else { return };
    let _sweeps: Vec<support::SweepOnDrop> =
        fleet_nodes.dirs.iter().map(|dirs| support::SweepOnDrop(dirs.socket())).collect();
    let before = first_version(&fleet_nodes);
    let broken = web_version(&fleet_nodes.dirs[0], 3602, &["/bin/false"]);
    let mut rollout = RolloutCli::spawn(
        &fleet_nodes.etcd,
        &fleet_nodes.dirs[0],
        &[broken.to_str().unwrap(), "--nodes", "n1,n2,n3", "--wait", "2s", "--on-failure", "rollback"],
    );
    assert_eq!(rollout.wait(), Some(1), "{}", rollout.output());
    let output = rollout.output();
    assert!(output.contains("n1: not running and ready") && output.contains("/bin/false"), "{output}");
    assert!(output.contains("n1: rolled back") && !output.contains("n2:") && !output.contains("n3:"), "{output}");
    // n2 and n3 never saw the new version; n1 runs the old one again and is ready.
    let view = fleet_nodes.wait_all_ready(1);
    for node in ["n2", "n3"] {
        let proxy = &node_of(&view, node)["proxies"][0];
        assert_eq!(
            (proxy["running_revision"].as_i64(), proxy["pid"].as_i64()),
            (Some(before[node].0), Some(before[node].1))
        );
    }
    let n1 = pid_of(&fleet_nodes.agents[0], "web-proxy");
    assert!(support::cmdline(i32::try_from(n1).unwrap()).contains(&"3600".to_owned()));
    // The rollout is over: the next one may start (and, without rollback, leaves n1 failing).
    let mut again = RolloutCli::spawn(
        &fleet_nodes.etcd,
        &fleet_nodes.dirs[0],
        &[broken.to_str().unwrap(), "--nodes", "n1,n2", "--wait", "1s"],
    );
    assert_eq!(again.wait(), Some(1), "{}", again.output());
    assert!(!again.output().contains("rolled back"), "{}", again.output());
    let (code, _) = fleet_view(&fleet_nodes.etcd);
    assert_eq!(code, Some(1), "n1 is not ready on its desired revision");
}

#[test]
fn a_rollout_whose_command_died_refuses_a_second_and_finishes_with_resume() {
    let Some(fleet_nodes) = ThreeNodes::start("fleet rollout resume") else { return };
    let _sweeps: Vec<support::SweepOnDrop> =
        fleet_nodes.dirs.iter().map(|dirs| support::SweepOnDrop(dirs.socket())).collect();
    let before = first_version(&fleet_nodes);
    // Slow to get ready, so that the command can be killed after the first node.
    let v2 = web_version(&fleet_nodes.dirs[0], 3601, &["/bin/sleep", "1"]);
    let mut rollout =
        RolloutCli::spawn(&fleet_nodes.etcd, &fleet_nodes.dirs[0], &[v2.to_str().unwrap(), "--nodes", "n1,n2,n3"]);
    // Once n2 is written, n1's batch is recorded as done.
    wait_until("n1 to finish", || {
        let output = rollout.output();
        output.contains("n2: wrote").then_some(()).ok_or(output)
    });
    rollout.child.as_mut().unwrap().kill().unwrap();
    rollout.wait();
    let n1 = wait_for("n1's new pid", || {
        let view = fleet_view(&fleet_nodes.etcd).1;
        node_of(&view, "n1")["proxies"][0]["pid"].as_i64()
    });
    assert_ne!(n1, before["n1"].1);

    // A second rollout of the same service is refused while the first is not over.
    let mut second =
        RolloutCli::spawn(&fleet_nodes.etcd, &fleet_nodes.dirs[0], &[v2.to_str().unwrap(), "--nodes", "n3"]);
    assert_eq!(second.wait(), Some(1), "{}", second.output());
    assert!(
        second.output().contains("another rollout is running") && second.output().contains("--resume web"),
        "{}",
        second.output()
    );

    let mut resumed = RolloutCli::spawn(&fleet_nodes.etcd, &fleet_nodes.dirs[0], &["--resume", "web"]);
    assert_eq!(resumed.wait(), Some(0), "{}", resumed.output());
    let output = resumed.output();
    assert!(!output.contains("n1:") && output.contains("n3: running and ready"), "{output}");
    let view = fleet_nodes.wait_all_ready(1);
    assert_eq!(node_of(&view, "n1")["proxies"][0]["pid"].as_i64(), Some(n1), "the resumed rollout left n1 alone");
    let mut nothing = RolloutCli::spawn(&fleet_nodes.etcd, &fleet_nodes.dirs[0], &["--resume", "web"]);
    assert_eq!(nothing.wait(), Some(1), "{}", nothing.output());
}

#[test]
fn after_an_outage_or_a_lost_lease_the_agent_publishes_everything_again() {
    let Some(mut etcd) = Etcd::start("fleet status republish") else { return };
    let dirs = Dirs::new();
    let _sweep = support::SweepOnDrop(dirs.socket());
    let agent = publishing_agent(&dirs, &etcd, "n1");
    put_sleeper(&etcd, &dirs, "n1", "web", 3600);
    let first = pid_of(&agent, "web-proxy");
    let published_pid = |etcd: &Etcd| {
        let view = fleet_view(etcd).1;
        node_of(&view, "n1")["proxies"][0]["pid"].as_i64()
    };
    wait_for("the proxy's status", || (published_pid(&etcd) == Some(first)).then_some(()));

    // While etcd is away the proxy dies and is restarted: the new pid shows once it is back.
    etcd.stop();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(first).unwrap()), Signal::SIGKILL).unwrap();
    let second = wait_for("the proxy's restart", || {
        let proxy = agent.proxy("web-proxy").filter(|p| p["state"] == "running")?;
        proxy["pid"].as_i64().filter(|pid| *pid != first)
    });
    etcd.resume();
    wait_until("the restarted proxy's status", || {
        let pid = published_pid(&etcd);
        (pid == Some(second)).then_some(()).ok_or(format!("{pid:?}"))
    });

    // A lease that etcd dropped (revoked here, as an expiry would) takes the keys with it:
    // the agent takes a new lease and writes them all again.
    let leases: serde_json::Value = serde_json::from_str(&etcd.call("/v3/lease/leases", "{}").unwrap()).unwrap();
    let lease = leases["leases"][0]["ID"].as_str().unwrap().to_owned();
    etcd.call("/v3/lease/revoke", &format!(r#"{{"ID": "{lease}"}}"#)).unwrap();
    wait_until("the node's status to come back under a new lease", || {
        let (code, view) = fleet_view(&etcd);
        let leases: serde_json::Value = serde_json::from_str(&etcd.call("/v3/lease/leases", "{}").unwrap()).unwrap();
        let renewed = leases["leases"].as_array().is_some_and(|l| l.len() == 1 && l[0]["ID"] != lease.as_str());
        (code == Some(0) && renewed && node_of(&view, "n1")["state"] == "up").then_some(()).ok_or(view.to_string())
    });
    assert_eq!(pid_of(&agent, "web-proxy"), second);
}

#[test]
fn a_template_lists_the_fleets_ready_instances_and_follows_them() {
    let Some(etcd) = Etcd::start("templates over the fleet's instances") else { return };
    let (api_dirs, web_dirs) = (Dirs::new(), Dirs::new());
    let _sweeps = (support::SweepOnDrop(api_dirs.socket()), support::SweepOnDrop(web_dirs.socket()));
    // On n2, a proxy whose file lists every ready instance of `api` across the fleet; it
    // reads the file when it wants to (`on_change = "none"`).
    std::fs::create_dir(web_dirs.temp.path().join("rendered")).unwrap();
    let rendered = web_dirs.temp.path().join("rendered").join("api.list");
    web_dirs.write_config(
        "web.toml",
        &format!(
            "[[service]]\nname = \"web\"\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\n\
             [[service.proxy.template]]\n\
             contents = '''{{% for i in instances(\"api\") %}}{{{{ i.node }}}} {{{{ i.id }}}}\n{{% endfor %}}'''\n\
             destination = \"{}\"\non_change = \"none\"\nwait = \"50ms\"\n",
            rendered.display()
        ),
    );
    let api = publishing_agent(&api_dirs, &etcd, "n1");
    let web = publishing_agent(&web_dirs, &etcd, "n2");
    web.wait_state("web-proxy", "running");
    let read = || std::fs::read_to_string(&rendered).unwrap_or_default();

    // n1's api, once ready, is published and rendered on n2.
    put_sleeper(&etcd, &api_dirs, "n1", "api", 3600);
    api.wait_state("api-proxy", "running");
    wait_for("n1's api in n2's file", || (read() == "n1 api\n").then_some(()));

    // Held down on n1, it leaves the fleet's instances, and n2's file.
    tether().args(["stop", "api-proxy", "--data-dir"]).arg(&api_dirs.data).assert().code(0);
    wait_for("n1's api gone from n2's file", || read().is_empty().then_some(()));
    // Back: listed again; n2's own proxy ran throughout.
    tether().args(["start", "api-proxy", "--data-dir"]).arg(&api_dirs.data).assert().code(0);
    wait_for("n1's api back in n2's file", || (read() == "n1 api\n").then_some(()));
    assert_eq!(web.proxy("web-proxy").unwrap()["restarts"], 0);
}

#[test]
fn a_template_whose_fleet_instances_are_unknown_fails_its_proxy_naming_why() {
    let dirs = Dirs::new();
    let _sweep = support::SweepOnDrop(dirs.socket());
    // Claimed, never listened on: no other test's server can take it meanwhile.
    let unused = ReservedPort::new();
    let closed = format!("http://127.0.0.1:{}", unused.port());
    let rendered = dirs.temp.path().join("api.list");
    dirs.write_config(
        "web.toml",
        &format!(
            "[[service]]\nname = \"web\"\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\n\
             [[service.proxy.template]]\ncontents = '''{{{{ instances(\"api\") | length }}}}'''\n\
             destination = \"{}\"\n",
            rendered.display()
        ),
    );
    let mut flags = vec!["--etcd", closed.as_str(), "--node", "n1"];
    if is_root() {
        flags.push("--allow-root");
    }
    let agent = Agent::start(&dirs, &flags);
    // Not an empty list, which would render a file with no backends: the render fails, and
    // nothing is written or started.
    let failed = agent.wait_state("web-proxy", "failed");
    let error = failed["error"].as_str().unwrap();
    assert!(error.contains("the fleet's instances of \"api\" are not known"), "{error}");
    assert!(!rendered.exists());
}

/// `GET /` on `port`: the body, or why not.
fn http_body(port: u16) -> Result<String, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|err| err.to_string())?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).map_err(|err| err.to_string())?;
    stream.write_all(b"GET / HTTP/1.0\r\nHost: test\r\n\r\n").map_err(|err| err.to_string())?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).map_err(|err| err.to_string())?;
    let (head, body) = answer.split_once("\r\n\r\n").ok_or_else(|| format!("no body in {answer:?}"))?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        return Err(head.lines().next().unwrap_or_default().to_owned());
    }
    Ok(body.trim().to_owned())
}

/// A service `api` (id `id`) on `port` that answers every request with `answer`, ready once
/// its port accepts: Debian's Python serving one file.
fn api_service(dirs: &Dirs, id: &str, port: u16, answer: &str) -> PathBuf {
    let root = dirs.temp.path().join(format!("www-{id}"));
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("index.html"), answer).unwrap();
    let path = dirs.temp.path().join(format!("{id}.toml"));
    std::fs::write(
        &path,
        format!(
            "[[service]]\nname = \"api\"\nid = \"{id}\"\naddress = \"127.0.0.1\"\nport = {port}\n[service.proxy]\n\
             command = [\"/usr/bin/python3\", \"-m\", \"http.server\", \"{port}\", \"--bind\", \"127.0.0.1\", \"--directory\", \"{}\"]\n\
             kill_signal = \"SIGTERM\"\n[service.proxy.readiness]\ntcp = \"127.0.0.1:{port}\"\ninterval = \"100ms\"\n",
            root.display()
        ),
    )
    .unwrap();
    path
}

/// The HAProxy config template of the edge: one HTTP frontend on `port`, balancing over every
/// ready `api` instance of the fleet.
fn edge_template(port: u16) -> String {
    format!(
        "global\n    maxconn 256\ndefaults\n    mode http\n    timeout connect 1s\n    timeout client 5s\n    \
         timeout server 5s\n    retries 3\n    option redispatch\nfrontend edge\n    bind 127.0.0.1:{port}\n    \
         default_backend api\nbackend api\n    balance roundrobin\n\
         {{% for i in instances(\"api\") %}}    server {{{{ i.node }}}}-{{{{ i.id }}}} {{{{ i.address }}}}:{{{{ i.port }}}}\n{{% endfor %}}"
    )
}

#[test]
fn haproxy_balances_over_the_fleets_instances_rendered_by_a_template_and_reloaded_in_place() {
    let Some(haproxy) = support::haproxy() else {
        assert!(std::env::var_os("CI").is_none(), "CI must have haproxy (.ci/run installs it)");
        eprintln!("skipped: haproxy is not installed");
        return;
    };
    let Some(mut fleet_nodes) = ThreeNodes::start("haproxy over the fleet's instances") else { return };
    let _sweeps: Vec<support::SweepOnDrop> =
        fleet_nodes.dirs.iter().map(|dirs| support::SweepOnDrop(dirs.socket())).collect();
    // On n1 (from a config file, so that it stays when n1's etcd keys change): an HAProxy whose
    // config is rendered from the fleet's `api` instances, reloaded in place when they change.
    let edge_port = free_port();
    let edge_dirs = &fleet_nodes.dirs[0];
    let config = edge_dirs.temp.path().join("haproxy.cfg");
    edge_dirs.write_config(
        "edge.toml",
        &format!(
            "[[service]]\nname = \"edge\"\n[service.proxy]\ncommand = [\"{haproxy}\", \"-Ws\", \"-f\", \"{cfg}\"]\n\
             kill_signal = \"SIGUSR1\"\nkill_timeout = \"5s\"\n[service.proxy.readiness]\nnotify = true\n\
             [service.proxy.reload]\nsignal = \"SIGUSR2\"\ncheck = [\"{haproxy}\", \"-c\", \"-f\", \"{cfg}\"]\n\
             [[service.proxy.template]]\ncontents = '''{template}'''\ndestination = \"{cfg}\"\nwait = \"50ms\"\n",
            cfg = config.display(),
            template = edge_template(edge_port),
        ),
    );
    tether().args(["reload", "--data-dir"]).arg(&edge_dirs.data).assert().code(0);
    let master = fleet_nodes.agents[0].wait_state("edge-proxy", "running")["pid"].as_i64().unwrap();

    // An `api` on every node, each answering with its node's name.
    let mut ports = Vec::new();
    for (node, dirs) in ThreeNodes::NODES.iter().zip(&fleet_nodes.dirs) {
        let port = free_port();
        ports.push(port);
        let file = api_service(dirs, "api", port, node);
        fleet_ok(&fleet_nodes.etcd, &["put", node, file.to_str().unwrap()]);
    }
    let prober = Prober::start(edge_port);
    let answers = |expected: &[&str]| {
        wait_until("the edge to answer from exactly these nodes", || {
            let mut seen = std::collections::BTreeSet::new();
            for _ in 0..12 {
                seen.insert(http_body(edge_port)?);
            }
            let expected: std::collections::BTreeSet<String> = expected.iter().map(|s| (*s).to_owned()).collect();
            (seen == expected).then_some(()).ok_or(format!("{seen:?}"))
        })
    };
    answers(&["n1", "n2", "n3"]);

    // A fourth instance, on n2: served within a second of becoming ready, by the same master.
    let extra_port = free_port();
    let file = api_service(&fleet_nodes.dirs[1], "api-extra", extra_port, "n2-extra");
    fleet_ok(&fleet_nodes.etcd, &["put", "n2", file.to_str().unwrap()]);
    fleet_nodes.agents[1].wait_state("api-extra-proxy", "running");
    let ready_at = Instant::now();
    answers(&["n1", "n2", "n2-extra", "n3"]);
    assert!(ready_at.elapsed() < Duration::from_secs(1), "served after {:?}", ready_at.elapsed());
    let edge = fleet_nodes.agents[0].proxy("edge-proxy").unwrap();
    assert_eq!(edge["pid"].as_i64(), Some(master), "reloaded, not restarted: {edge}");
    assert_eq!(edge["last_reload"]["result"], "applied", "HAProxy's own verdict: {edge}");

    // n3 dies whole, agent and api: its instance leaves the backend once its lease expires.
    let api_pid = pid_of(&fleet_nodes.agents[2], "api-proxy");
    fleet_nodes.agents[2].signal(Signal::SIGKILL);
    let _ = fleet_nodes.agents[2].wait();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(api_pid as i32), Signal::SIGKILL).unwrap();
    let died = Instant::now();
    wait_for("n3's instance out of the rendered config", || {
        (!std::fs::read_to_string(&config).unwrap_or_default().contains(&format!(":{}", ports[2]))).then_some(())
    });
    assert!(died.elapsed() < Duration::from_secs(TTL_SECONDS + 1), "gone after {:?}", died.elapsed());
    answers(&["n1", "n2", "n2-extra"]);
    assert_eq!(fleet_nodes.agents[0].proxy("edge-proxy").unwrap()["pid"].as_i64(), Some(master));

    let (tried, refused) = prober.counts();
    drop(prober);
    assert!(tried > 100, "the client connected {tried} times");
    assert_eq!(refused, 0, "{refused} of {tried} connections to the edge were refused");
}

#[test]
fn fleet_status_shows_a_proxy_whose_key_was_deleted_as_removing_and_fails_until_it_is_gone() {
    let Some(etcd) = Etcd::start("fleet status while removing") else { return };
    let dirs = Dirs::new();
    let _sweep = support::SweepOnDrop(dirs.socket());
    let agent = publishing_agent(&dirs, &etcd, "n1");
    // Proxies that ignore the stop signal: each stays until its kill_timeout SIGKILLs it.
    for name in ["web", "api"] {
        etcd.put_raw(
            &format!("/tether/nodes/n1/services/{name}"),
            &format!(
                r#"{{"name": "{name}", "proxy": {{"command": ["/bin/sh", "-c", "trap '' INT; exec /bin/sleep 3600"],
                    "kill_timeout": "4s"}}}}"#
            ),
        );
    }
    let pids = [pid_of(&agent, "web-proxy"), pid_of(&agent, "api-proxy")];
    wait_until("fleet status to succeed", || {
        let (code, view) = fleet_view(&etcd);
        (code == Some(0)).then_some(()).ok_or(view.to_string())
    });

    etcd.delete_prefix("/tether/nodes/n1/");
    let view = wait_until("both proxies shown as removing, and a failure", || {
        let (code, view) = fleet_view(&etcd);
        let removing = node_of(&view, "n1")["proxies"]
            .as_array()
            .is_some_and(|p| p.len() == 2 && p.iter().all(|p| p["state"] == "removing"));
        (code == Some(1) && removing).then(|| view.clone()).ok_or(view.to_string())
    });
    for proxy in node_of(&view, "n1")["proxies"].as_array().unwrap() {
        assert!(proxy["desired_revision"].is_null(), "{proxy}");
    }
    let output = fleet(&etcd.url(), &["status"]);
    let table = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{table}");
    assert!(
        table.lines().any(|line| line.starts_with("n1") && line.contains("web-proxy") && line.contains("removing"))
    );
    assert!(table.trim_end().ends_with("proxies: 0 ready, 0 not ready, 2 removing"), "{table}");

    // Once they are gone, the node is converged again.
    agent.wait_gone("web-proxy");
    agent.wait_gone("api-proxy");
    assert!(pids.iter().all(|pid| !alive(*pid)));
    wait_until("fleet status to succeed with nothing left", || {
        let (code, view) = fleet_view(&etcd);
        let empty = node_of(&view, "n1")["proxies"].as_array().is_none_or(Vec::is_empty);
        (code == Some(0) && empty).then_some(()).ok_or(view.to_string())
    });
}

/// A keep-alive connection to etcd's JSON gateway, for bursts of puts.
struct Gateway {
    reader: std::io::BufReader<TcpStream>,
}

impl Gateway {
    fn connect(etcd: &Etcd) -> Self {
        let stream = TcpStream::connect(("127.0.0.1", etcd.client_port)).unwrap();
        stream.set_read_timeout(Some(support::DEADLINE)).unwrap();
        Self { reader: std::io::BufReader::new(stream) }
    }

    /// Puts `value` at `key`; returns the put's revision, or why it failed.
    fn put(&mut self, key: &str, value: &str) -> Result<i64, String> {
        use std::io::BufRead;
        let failed = |err: std::io::Error| err.to_string();
        let body = format!(r#"{{"key": "{}", "value": "{}"}}"#, BASE64.encode(key), BASE64.encode(value));
        let request = format!(
            "POST /v3/kv/put HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.reader.get_mut().write_all(request.as_bytes()).map_err(failed)?;
        let mut length = 0;
        let mut status = String::new();
        self.reader.read_line(&mut status).map_err(failed)?;
        if !status.starts_with("HTTP/1.1 200") {
            return Err(status);
        }
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line).map_err(failed)? == 0 {
                return Err("the connection closed".to_owned());
            }
            if line == "\r\n" {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().map_err(|_| line.clone())?;
            }
        }
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body).map_err(failed)?;
        Ok(revision_of(&String::from_utf8_lossy(&body)))
    }
}

/// Keys of the burst test, each with a `/bin/sleep` proxy.
const BURST_KEYS: usize = 20;

/// Puts `puts` values round-robin over the burst keys from one thread, until done or `stop`;
/// returns the last revision and value index of each key.
fn burst(
    etcd: &Etcd,
    puts: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<std::collections::BTreeMap<usize, (i64, usize)>> {
    let mut gateway = Gateway::connect(etcd);
    std::thread::spawn(move || {
        let mut last = std::collections::BTreeMap::new();
        for n in 0..puts {
            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                break;
            }
            let key = n % BURST_KEYS;
            let value = format!(
                r#"{{"name": "b{key}", "meta": {{"n": "{n}"}}, "proxy": {{"command": ["/bin/sleep", "3600"], "kill_timeout": "2s"}}}}"#
            );
            // The writer stops at the first failure: a test may stop etcd under it.
            let Ok(revision) = gateway.put(&format!("/tether/nodes/n1/services/b{key}"), &value) else { break };
            last.insert(key, (revision, n));
        }
        last
    })
}

#[test]
fn a_burst_of_puts_is_applied_in_a_few_change_sets_while_the_agent_stays_responsive() {
    let Some(etcd) = Etcd::start("fleet burst") else { return };
    let dirs = Dirs::new();
    let _sweep = support::SweepOnDrop(dirs.socket());
    // The agent's own coalescing windows, in which each key of the burst keeps changing.
    let url = etcd.url();
    let mut flags = vec!["--etcd", url.as_str(), "--node", "n1", "--fleet-ttl", "2s"];
    flags.extend(["--sync-quiescent", "500ms", "--sync-max-delay", "5s"]);
    if is_root() {
        flags.push("--allow-root");
    }
    let mut agent = Agent::start(&dirs, &flags);
    wait_for("the watch on etcd", || fleet_status(&agent)["connected"].as_bool().filter(|connected| *connected));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Whatever happens below, the writer stops.
    struct StopOnDrop(std::sync::Arc<std::sync::atomic::AtomicBool>);
    impl Drop for StopOnDrop {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let _stop_writers = StopOnDrop(stop.clone());

    // 10 000 puts; the agent answers its control socket all along.
    const PUTS: usize = 10_000;
    let writer = burst(&etcd, PUTS, stop.clone());
    let mut answered = 0;
    while !writer.is_finished() {
        let mut status = assert_cmd::Command::from_std(tether());
        status.args(["status", "--data-dir"]).arg(&dirs.data).timeout(Duration::from_secs(10)).assert().success();
        answered += 1;
    }
    let last = writer.join().unwrap();
    assert_eq!(last.values().map(|(_, n)| n + 1).max(), Some(PUTS), "every put was written");
    assert!(answered > 0);
    let final_revision = last.values().map(|(revision, _)| *revision).max().unwrap();

    // The final state: every proxy runs from its key's last put, as published.
    wait_until("the agent to apply the burst's last revision and publish it", || {
        let status = fleet_status(&agent);
        let applied = status["revision"].as_i64() >= Some(final_revision);
        let published: std::collections::BTreeMap<String, serde_json::Value> = status_keys(&etcd)
            .into_iter()
            .filter_map(|(key, value)| {
                let proxy = key.strip_prefix("/tether/status/n1/proxies/")?;
                Some((proxy.to_owned(), serde_json::from_str(&value).unwrap()))
            })
            .collect();
        let converged = last.iter().all(|(key, (revision, n))| {
            published.get(&format!("b{key}-proxy")).is_some_and(|p| {
                p["revision"].as_i64() == Some(*revision)
                    && p["meta"]["n"].as_str().and_then(|v| v.parse().ok()) == Some(*n)
                    && p["state"] == "running"
            })
        });
        (applied && converged).then_some(()).ok_or(format!("{status}"))
    });
    // Applied in change sets, not one revision at a time.
    let applies = agent.logs().matches("fleet: set applied").count();
    eprintln!("{PUTS} puts: {applies} change sets applied; `tether status` answered {answered} times meanwhile");
    assert!((1..=PUTS / 20).contains(&applies), "{applies} applies for {PUTS} puts");
    assert_eq!(metric(&agent, "tether_fleet_applies_total"), Some(applies as f64));

    // SIGTERM in the middle of another burst: the agent closes at once, its proxies stay.
    let pids: Vec<i64> = (0..BURST_KEYS).map(|key| pid_of(&agent, &format!("b{key}-proxy"))).collect();
    let writer = burst(&etcd, PUTS, stop.clone());
    wait_until("the agent to apply part of the second burst", || {
        let status = fleet_status(&agent);
        (status["revision"].as_i64() > Some(final_revision)).then_some(()).ok_or(status.to_string())
    });
    close(&mut agent);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    assert!(pids.iter().all(|pid| alive(*pid)), "a proxy did not outlive the agent");
}

#[test]
fn connected_turns_false_when_etcd_goes_away_in_the_middle_of_a_burst() {
    let Some(mut etcd) = Etcd::start("fleet connected during a burst") else { return };
    let dirs = Dirs::new();
    let _sweep = support::SweepOnDrop(dirs.socket());
    let agent = fleet_agent(&dirs, &etcd, "n1");
    wait_for("the watch on etcd", || fleet_status(&agent)["connected"].as_bool().filter(|connected| *connected));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = burst(&etcd, 10_000, stop.clone());
    let started = etcd.revision();
    wait_until("the agent to apply part of the burst", || {
        let status = fleet_status(&agent);
        (status["revision"].as_i64() > Some(started + 500)).then_some(()).ok_or(status.to_string())
    });
    etcd.stop();
    let killed = Instant::now();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let last = writer.join().unwrap();
    let last_put = last.values().map(|(revision, _)| *revision).max().unwrap();
    let status = wait_until("the status to say disconnected", || {
        let status = fleet_status(&agent);
        (status["connected"] == false).then(|| status.clone()).ok_or(status.to_string())
    });
    // Told by the connection as it broke, not by a keep-alive timeout (10 s, then 5 s) or by
    // the follower once it has caught up.
    assert!(killed.elapsed() < Duration::from_secs(5), "disconnected only after {:?}", killed.elapsed());
    assert!(status["last_error"].is_string(), "{status}");
    assert_eq!(metric(&agent, "tether_fleet_connected"), Some(0.0));
    // Nothing was lost: back, the agent applies the store's last revision.
    etcd.resume();
    wait_until("the agent to catch up after etcd is back", || {
        let status = fleet_status(&agent);
        (status["connected"] == true && status["revision"].as_i64() >= Some(last_put))
            .then_some(())
            .ok_or(status.to_string())
    });
}

mod cluster;
mod mesh;
mod netns;
mod roles;
