//! The built-in proxy in the mesh: an upstream of one service reaches another over mutual
//! TLS, intentions refuse new connections and close open ones at a reload, and the inbound
//! listener refuses, with a counter and an event naming why, what `curl` brings without a
//! valid identity (no certificate, another CA, an expired leaf, a service the intentions
//! deny). `curl` and `openssl` are TLS stacks nobody here wrote.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime};

use nix::sys::signal::Signal;

use crate::connect::{events, leaf, openssl_ca, token};
use crate::support::{Agent, DEADLINE, Dirs, get, sleeper, wait_for};

pub(crate) const DOMAIN: &str = "mesh.example.org";

pub(crate) fn dev_mesh(ttl: &str) -> String {
    format!("[connect]\ntrust_domain = \"{DOMAIN}\"\n[connect.ca]\nprovider = \"dev\"\nleaf_ttl = \"{ttl}\"\n")
}

pub(crate) fn intention(source: &str, destination: &str, action: &str) -> String {
    format!("[[intention]]\nsource = \"{source}\"\ndestination = \"{destination}\"\naction = \"{action}\"\n")
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A service on loopback that serves each connection on a thread of its own; its port.
fn serving(serve: impl Fn(TcpStream) + Copy + Send + 'static) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            std::thread::spawn(move || serve(stream));
        }
    });
    port
}

/// Answers each read with `db: <what was read>`.
pub(crate) fn echo() -> u16 {
    echo_as("db")
}

/// Answers each read with `<name>: <what was read>`.
fn echo_as(name: &'static str) -> u16 {
    serving(move |mut stream| {
        let mut buffer = [0u8; 1024];
        while let Ok(n) = stream.read(&mut buffer) {
            if n == 0 || stream.write_all(&[name.as_bytes(), b": ", &buffer[..n]].concat()).is_err() {
                return;
            }
        }
    })
}

/// Answers one HTTP request with `ok` and closes.
fn http_ok() -> u16 {
    serving(|mut stream| {
        let mut buffer = [0u8; 4096];
        let _ = stream.read(&mut buffer);
        let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok");
    })
}

pub(crate) fn builtin(name: &str, port: Option<u16>, config: &str) -> String {
    let port = port.map(|port| format!("port = {port}\n")).unwrap_or_default();
    format!("[[service]]\nname = \"{name}\"\n{port}[service.proxy]\nkill_timeout = \"2s\"\nconfig = {{ {config} }}\n")
}

/// Sends `line` on a new connection to `port` and returns the answer; `None` when the
/// connection is closed without one.
pub(crate) fn exchange_once(port: u16, line: &str) -> Option<(TcpStream, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    stream.write_all(line.as_bytes()).ok()?;
    let mut buffer = [0u8; 1024];
    let n = stream.read(&mut buffer).ok()?;
    (n > 0).then(|| (stream, String::from_utf8_lossy(&buffer[..n]).into_owned()))
}

/// Whether `stream` was closed by its peer: it reads an end or an error within the deadline.
pub(crate) fn closed(stream: &mut TcpStream) -> bool {
    let mut buffer = [0u8; 64];
    matches!(stream.read(&mut buffer), Ok(0) | Err(_))
}

fn refusals(agent: &Agent, service: &str, reason: &str) -> u64 {
    let metrics = get(&agent.socket, "/metrics").unwrap().body;
    let prefix = format!("tether_connect_refusals_total{{service=\"{service}\",reason=\"{reason}\"}} ");
    metrics.lines().find_map(|line| line.strip_prefix(prefix.as_str())).map_or(0, |n| n.parse().unwrap())
}

/// Waits for an event line that holds every one of `needles`.
fn wait_event(seen: &std::sync::mpsc::Receiver<String>, needles: &[&str]) -> String {
    let deadline = std::time::Instant::now() + DEADLINE;
    let mut lines = Vec::new();
    while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
        match seen.recv_timeout(left) {
            Ok(line) if needles.iter().all(|needle| line.contains(needle)) => return line,
            Ok(line) => lines.push(line),
            Err(_) => break,
        }
    }
    panic!("no event with {needles:?}; saw:\n{}", lines.join("\n"));
}

/// The agent's events, once the stream follows them: plaintext sent to the TLS listener on
/// `port` is refused as `handshake` until the stream shows one.
fn following_events(dirs: &Dirs, port: u16) -> (crate::connect::KillOnDrop, std::sync::mpsc::Receiver<String>) {
    let (child, seen) = events(dirs);
    wait_for("the events stream to follow", || {
        let plain = exchange_once(port, "plain\n").map(|(_, answer)| answer).unwrap_or_default();
        assert!(!plain.contains("plain"), "the TLS listener forwarded plaintext: {plain}");
        let line = seen.recv_timeout(Duration::from_millis(500)).ok()?;
        (line.contains("connection-refused") && line.contains("handshake")).then_some(())
    });
    (child, seen)
}

#[test]
fn an_upstream_reaches_its_destination_over_mutual_tls_and_intentions_refuse_close_and_restore() {
    let dirs = Dirs::new();
    let (db_bind, web_bind, web_upstream) = (free_port(), free_port(), free_port());
    dirs.write_config("mesh.toml", &dev_mesh("72h"));
    dirs.write_config("intentions.toml", &intention("web", "db", "allow"));
    dirs.write_config("db.toml", &builtin("db", Some(echo()), &format!("bind_port = {db_bind}")));
    let web = format!(
        "bind_port = {web_bind}, upstreams = [{{ destination_name = \"db\", local_bind_port = {web_upstream} }}]"
    );
    dirs.write_config("web.toml", &builtin("web", None, &web));
    let agent = Agent::start(&dirs, &["--allow-root"]);
    agent.wait_state("db-proxy", "running");
    agent.wait_state("web-proxy", "running");

    let (mut open, answer) = wait_for("web's upstream to reach db", || exchange_once(web_upstream, "one"));
    assert_eq!(answer, "db: one");
    // What db's listener takes is TLS only: a plaintext client gets a TLS alert at most.
    let (_events, seen) = following_events(&dirs, db_bind);
    dirs.write_config("intentions.toml", &intention("web", "db", "deny"));
    agent.signal(Signal::SIGHUP);
    assert!(closed(&mut open), "the open connection was not closed when the intention came to deny it");
    let line = wait_event(&seen, &["connection-refused", "db-proxy", "closed", "denied by intention web -> db"]);
    assert!(line.contains("spiffe://mesh.example.org/ns/default/dc/dc1/svc/web"), "{line}");
    assert!(exchange_once(web_upstream, "two").is_none(), "a new connection passed a deny intention");
    wait_event(&seen, &["connection-refused", "denied: spiffe://", "denied by intention web -> db"]);
    wait_for("the refusals counted", || (refusals(&agent, "db", "denied") >= 2).then_some(()));

    dirs.write_config("intentions.toml", &intention("web", "db", "allow"));
    agent.signal(Signal::SIGHUP);
    let (_, answer) = wait_for("the allow intention to let web in again", || exchange_once(web_upstream, "three"));
    assert_eq!(answer, "db: three");
}

#[test]
fn an_upstream_spreads_over_the_instances_and_skips_one_that_fails_its_handshake() {
    let dirs = Dirs::new();
    let (a_bind, b_bind, web_bind, web_upstream) = (free_port(), free_port(), free_port(), free_port());
    dirs.write_config("mesh.toml", &dev_mesh("72h"));
    dirs.write_config("intentions.toml", &intention("web", "db", "allow"));
    let db = |id: &str, port: u16, bind: u16| {
        format!(
            "[[service]]\nname = \"db\"\nid = \"{id}\"\nport = {port}\n[service.proxy]\nkill_timeout = \"2s\"\nconfig = {{ bind_port = {bind} }}\n"
        )
    };
    dirs.write_config(
        "db.toml",
        &format!("{}\n{}", db("db-a", echo_as("a"), a_bind), db("db-b", echo_as("b"), b_bind)),
    );
    let web = format!(
        "bind_port = {web_bind}, upstreams = [{{ destination_name = \"db\", local_bind_port = {web_upstream} }}]"
    );
    dirs.write_config("web.toml", &builtin("web", None, &web));
    let agent = Agent::start(&dirs, &["--allow-root"]);
    agent.wait_state("db-a-proxy", "running");
    let b_pid = agent.wait_state("db-b-proxy", "running")["pid"].as_i64().unwrap() as i32;
    agent.wait_state("web-proxy", "running");

    // Connections take the instances in turn: both answer.
    let mut seen = std::collections::BTreeSet::new();
    wait_for("both instances to answer through web's upstream", || {
        if let Some((_, answer)) = exchange_once(web_upstream, "hi") {
            seen.insert(answer);
        }
        (seen.len() == 2).then_some(())
    });
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), ["a: hi", "b: hi"]);

    // db-b's proxy stops answering (its process is stopped, its port still takes connections):
    // every connection still reaches db-a, one of them after db-b's handshake times out.
    let b = nix::unistd::Pid::from_raw(b_pid);
    nix::sys::signal::kill(b, Signal::SIGSTOP).unwrap();
    struct Resume(nix::unistd::Pid);
    impl Drop for Resume {
        fn drop(&mut self) {
            let _ = nix::sys::signal::kill(self.0, Signal::SIGCONT);
        }
    }
    let _resume = Resume(b);
    for _ in 0..2 {
        let answer = exchange_once(web_upstream, "again").map(|(_, answer)| answer);
        assert_eq!(answer.as_deref(), Some("a: again"), "a failed instance was not skipped");
    }
}

/// `curl` over TLS to `port` with `cert` and `key`, if given; its output when it succeeded.
fn curl(port: u16, identity: Option<(&Path, &Path)>) -> Option<String> {
    let mut command = Command::new("curl");
    // The server's leaf names a service, not a host: the client side is what is tested.
    command.args(["-s", "-k", "--max-time", "10"]);
    if let Some((cert, key)) = identity {
        command.arg("--cert").arg(cert).arg("--key").arg(key);
    }
    let output = command.arg(format!("https://127.0.0.1:{port}/")).output().unwrap();
    output.status.success().then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// A client certificate for `web` from a CA of its own, made by `openssl`.
fn foreign_identity(dir: &Path) -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    let foreign = dir.join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    let (ca, ca_key) = openssl_ca(&foreign)?;
    let (key, csr, cert, ext) =
        (foreign.join("key.pem"), foreign.join("csr.pem"), foreign.join("cert.pem"), foreign.join("ext.cnf"));
    std::fs::write(
        &ext,
        format!(
            "subjectAltName=URI:spiffe://{DOMAIN}/ns/default/dc/dc1/svc/web\nextendedKeyUsage=clientAuth,serverAuth\n"
        ),
    )
    .unwrap();
    let request = Command::new("openssl")
        .args(["req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", "/CN=web"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&csr)
        .output()
        .unwrap();
    assert!(request.status.success(), "{}", String::from_utf8_lossy(&request.stderr));
    let signed = Command::new("openssl")
        .args(["x509", "-req", "-days", "1", "-set_serial", "7"])
        .arg("-in")
        .arg(&csr)
        .arg("-CA")
        .arg(&ca)
        .arg("-CAkey")
        .arg(&ca_key)
        .arg("-extfile")
        .arg(&ext)
        .arg("-out")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(signed.status.success(), "{}", String::from_utf8_lossy(&signed.stderr));
    Some((cert, key))
}

/// Writes `service`'s current leaf and key as PEM files; their paths and the leaf's expiry.
fn leaf_files(
    agent: &Agent,
    dir: &Path,
    service: &str,
    name: &str,
) -> (std::path::PathBuf, std::path::PathBuf, SystemTime) {
    let token = token(agent, service);
    let body = leaf(agent, service, Some(&token), "").json();
    let (cert, key) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}-key.pem")));
    std::fs::write(&cert, body["cert_pem"].as_str().unwrap()).unwrap();
    std::fs::write(&key, body["private_key_pem"].as_str().unwrap()).unwrap();
    let expiry = humantime::parse_rfc3339(body["valid_before"].as_str().unwrap()).unwrap();
    (cert, key, expiry)
}

#[test]
fn the_inbound_listener_takes_a_valid_leaf_and_refuses_each_other_client_saying_why() {
    if Command::new("curl").arg("--version").output().is_err() {
        return eprintln!("skipped: curl is not installed");
    }
    let dirs = Dirs::new();
    let db_bind = free_port();
    // Leaves of seconds: the proxy reloads its own across renewals, and a leaf kept aside expires.
    dirs.write_config("mesh.toml", &dev_mesh("10s"));
    dirs.write_config("intentions.toml", &intention("web", "db", "allow"));
    dirs.write_config("db.toml", &builtin("db", Some(http_ok()), &format!("bind_port = {db_bind}")));
    dirs.write_config("clients.toml", &format!("{}\n{}", sleeper("web"), sleeper("api")));
    let agent = Agent::start(&dirs, &["--allow-root"]);
    agent.wait_state("db-proxy", "running");
    let temp = dirs.temp.path();
    let (web_cert, web_key, web_expiry) = leaf_files(&agent, temp, "web", "web");
    let (api_cert, api_key, _) = leaf_files(&agent, temp, "api", "api");
    let (_events, seen) = following_events(&dirs, db_bind);

    let answer = wait_for("db's proxy to take web's leaf", || curl(db_bind, Some((&web_cert, &web_key))));
    assert_eq!(answer, "ok");

    assert_eq!(curl(db_bind, None), None, "no client certificate was accepted");
    wait_event(&seen, &["connection-refused", "db-proxy", "no-certificate"]);

    assert_eq!(curl(db_bind, Some((&api_cert, &api_key))), None, "api, which no intention allows, was accepted");
    wait_event(
        &seen,
        &["connection-refused", "denied: spiffe://mesh.example.org/ns/default/dc/dc1/svc/api", "default_intention"],
    );

    if let Some((cert, key)) = foreign_identity(temp) {
        assert_eq!(curl(db_bind, Some((&cert, &key))), None, "a leaf of another CA was accepted");
        wait_event(&seen, &["connection-refused", "untrusted"]);
    }

    // Across the renewals of db's own leaf (every 6 to 8 s), a fresh web leaf still passes.
    wait_for("web's first leaf to expire", || (SystemTime::now() > web_expiry + Duration::from_secs(1)).then_some(()));
    assert_eq!(curl(db_bind, Some((&web_cert, &web_key))), None, "an expired leaf was accepted");
    wait_event(&seen, &["connection-refused", "expired"]);
    let (fresh_cert, fresh_key, _) = leaf_files(&agent, temp, "web", "web-fresh");
    assert_eq!(curl(db_bind, Some((&fresh_cert, &fresh_key))).as_deref(), Some("ok"));

    for reason in ["no-certificate", "denied", "expired"] {
        wait_for(&format!("a {reason} refusal counted"), || (refusals(&agent, "db", reason) >= 1).then_some(()));
    }
}
