//! Connect's certificate authority in a running agent: the roots and leaf endpoints, the
//! leaf in the status and the metrics, renewal with a lifetime of seconds, the proxy's token,
//! and a CA whose files are wrong — at the start and at a reload. Leaves are checked with
//! `openssl`, a TLS stack nobody here wrote.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::sys::signal::Signal;

use crate::support::{Agent, Dirs, environ_var, get, request, sleeper, tether, wait_for};

const DOMAIN: &str = "mesh.example.org";

fn dev_mesh(ttl: &str) -> String {
    format!("[connect]\ntrust_domain = \"{DOMAIN}\"\n[connect.ca]\nprovider = \"dev\"\nleaf_ttl = \"{ttl}\"\n")
}

pub(crate) fn file_mesh(cert: &Path, key: &Path, ttl: &str) -> String {
    format!(
        "[connect]\ntrust_domain = \"{DOMAIN}\"\n[connect.ca]\nprovider = \"file\"\ncert_file = \"{}\"\nkey_file = \"{}\"\nleaf_ttl = \"{ttl}\"\n",
        cert.display(),
        key.display()
    )
}

/// The proxy token of `service`'s proxy, from the running proxy's environment.
pub(crate) fn token(agent: &Agent, service: &str) -> String {
    let status = agent.wait_state(&format!("{service}-proxy"), "running");
    let pid = status["pid"].as_i64().unwrap() as i32;
    wait_for("the proxy's token", || environ_var(pid, "TETHER_PROXY_TOKEN"))
}

pub(crate) fn leaf(agent: &Agent, service: &str, token: Option<&str>, query: &str) -> crate::support::Response {
    let headers: Vec<(&str, &str)> = token.map(|t| ("X-Tether-Proxy-Token", t)).into_iter().collect();
    request(&agent.socket, "GET", &format!("/v1/agent/connect/ca/leaf/{service}{query}"), &headers, None).unwrap()
}

/// A CA certificate and PKCS #8 key made by `openssl`, as an operator would; `None` (the
/// test skips) where `openssl` is not installed.
pub(crate) fn openssl_ca(dir: &Path) -> Option<(PathBuf, PathBuf)> {
    let (cert, key) = (dir.join("ca.pem"), dir.join("ca-key.pem"));
    let made = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2"])
        .args(["-subj", "/CN=operator root", "-addext", "basicConstraints=critical,CA:TRUE"])
        .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output();
    match made {
        Ok(output) if output.status.success() => {
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
            Some((cert, key))
        }
        _ => {
            eprintln!("skipped: openssl is not installed");
            None
        }
    }
}

/// `openssl verify` of `leaf_pem` against `roots_pem`: what a peer's TLS stack would say.
fn openssl_verify(dir: &Path, roots_pem: &str, leaf_pem: &str) -> Option<String> {
    let (roots, leaf) = (dir.join("roots.pem"), dir.join("leaf.pem"));
    std::fs::write(&roots, roots_pem).unwrap();
    std::fs::write(&leaf, leaf_pem).unwrap();
    let output = Command::new("openssl").arg("verify").arg("-CAfile").arg(&roots).arg(&leaf).output().ok()?;
    Some(format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr)))
}

fn openssl_text(dir: &Path, leaf_pem: &str) -> Option<String> {
    let leaf = dir.join("leaf-text.pem");
    std::fs::write(&leaf, leaf_pem).unwrap();
    let output = Command::new("openssl").args(["x509", "-noout", "-text", "-in"]).arg(&leaf).output().ok()?;
    Some(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[test]
fn the_roots_and_a_leaf_are_served_and_openssl_verifies_the_leaf() {
    let dirs = Dirs::new();
    dirs.write_config("mesh.toml", &dev_mesh("72h"));
    dirs.write_config("web.toml", &sleeper("web"));
    let agent = Agent::start(&dirs, &["--allow-root"]);
    let token = token(&agent, "web");

    let roots = get(&agent.socket, "/v1/agent/connect/ca/roots").unwrap();
    assert_eq!(roots.status, 200, "{}", roots.body);
    let roots = roots.json();
    assert_eq!(roots["trust_domain"], DOMAIN);
    assert_eq!(roots["roots"].as_array().unwrap().len(), 1);
    assert_eq!(roots["roots"][0]["active"], true);
    assert_eq!(roots["active_root_id"], roots["roots"][0]["id"]);

    let answer = leaf(&agent, "web", Some(&token), "");
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(answer.headers.to_lowercase().contains("x-tether-index"), "{}", answer.headers);
    let body = answer.json();
    let spiffe = format!("spiffe://{DOMAIN}/ns/default/dc/dc1/svc/web");
    assert_eq!(body["spiffe_id"], spiffe.as_str());
    assert!(body["private_key_pem"].as_str().unwrap().contains("BEGIN PRIVATE KEY"));
    let cert = body["cert_pem"].as_str().unwrap();

    let root_pem = roots["roots"][0]["root_cert"].as_str().unwrap();
    let Some(verdict) = openssl_verify(dirs.temp.path(), root_pem, cert) else {
        return eprintln!("skipped: openssl is not installed");
    };
    assert!(verdict.trim_end().ends_with(": OK"), "{verdict}");
    let text = openssl_text(dirs.temp.path(), cert).unwrap();
    assert!(text.contains(&format!("URI:{spiffe}")), "{text}");
    assert!(text.contains("prime256v1") || text.contains("P-256"), "{text}");
    assert!(text.contains("CA:FALSE"), "{text}");

    // The status shows the certificate, the metrics its expiry; neither the key.
    let status = agent.proxy("web-proxy").unwrap();
    assert_eq!(status["certificate"]["serial"], body["serial"]);
    assert_eq!(status["certificate"]["spiffe_id"], spiffe.as_str());
    assert_eq!(status["certificate"]["not_after"], body["valid_before"]);
    assert!(status["error"].is_null(), "{status}");
    let metrics = get(&agent.socket, "/metrics").unwrap().body;
    let line = metrics
        .lines()
        .find(|line| line.starts_with("tether_leaf_cert_expiry_timestamp_seconds{service=\"web\"}"))
        .unwrap_or_else(|| panic!("no expiry metric for web:\n{metrics}"));
    let expiry: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    let valid_before = humantime::parse_rfc3339(body["valid_before"].as_str().unwrap()).unwrap();
    assert_eq!(expiry as u64, valid_before.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs());

    let key_line = body["private_key_pem"].as_str().unwrap().lines().nth(1).unwrap().to_owned();
    let status_text = get(&agent.socket, "/v1/agent/proxies").unwrap().body;
    for (what, text) in [("status", &status_text), ("metrics", &metrics), ("the agent's log", &agent.logs())] {
        assert!(!text.contains(&key_line) && !text.contains("PRIVATE KEY"), "a key in {what}");
    }
    // The dev CA lives in the data dir, private.
    for name in ["ca.pem", "ca-key.pem"] {
        assert_eq!(crate::support::mode(&dirs.data.join("connect").join(name)), 0o600, "{name}");
    }
}

#[test]
fn the_leaf_needs_its_own_proxys_token_and_hints_nothing() {
    let dirs = Dirs::new();
    dirs.write_config("mesh.toml", &dev_mesh("72h"));
    dirs.write_config("web.toml", &format!("{}\n{}", sleeper("web"), sleeper("db")));
    let agent = Agent::start(&dirs, &["--allow-root"]);
    let web = token(&agent, "web");
    let db = token(&agent, "db");
    assert_eq!(leaf(&agent, "web", Some(&web), "").status, 200);

    let wrong = leaf(&agent, "web", Some(&"0".repeat(64)), "");
    let missing = leaf(&agent, "web", None, "");
    let others = leaf(&agent, "web", Some(&db), "");
    let unknown = leaf(&agent, "nope", Some(&web), "");
    for refused in [&wrong, &missing, &others, &unknown] {
        assert_eq!(refused.status, 403, "{}", refused.body);
        assert!(!refused.body.contains("PRIVATE KEY"));
    }
    assert_eq!(wrong.body, unknown.body, "an unknown service and a wrong token look the same");
}

#[test]
fn without_a_connect_table_the_endpoints_say_so() {
    let dirs = Dirs::new();
    dirs.write_config("web.toml", &sleeper("web"));
    let agent = Agent::start(&dirs, &["--allow-root"]);
    let token = token(&agent, "web");
    let roots = get(&agent.socket, "/v1/agent/connect/ca/roots").unwrap();
    assert_eq!(roots.status, 404);
    assert!(roots.json()["error"].as_str().unwrap().contains("[connect]"), "{}", roots.body);
    assert_eq!(leaf(&agent, "web", Some(&token), "").status, 404);
    assert!(agent.proxy("web-proxy").unwrap()["certificate"].is_null());
}

/// `tether events --json`, killed and reaped on drop.
pub(crate) struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Streams the agent's events, one JSON line each, to the receiver as they come.
pub(crate) fn events(dirs: &Dirs) -> (KillOnDrop, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead;
    let mut child = tether()
        .args(["events", "--json", "--data-dir"])
        .arg(&dirs.data)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (send, receive) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if send.send(line).is_err() {
                return;
            }
        }
    });
    (KillOnDrop(child), receive)
}

#[test]
fn a_leaf_of_seconds_is_renewed_before_it_expires_and_a_blocking_query_wakes_on_it() {
    let dirs = Dirs::new();
    dirs.write_config("mesh.toml", &dev_mesh("10s"));
    dirs.write_config("web.toml", &sleeper("web"));
    let agent = Agent::start(&dirs, &["--allow-root"]);
    let token = token(&agent, "web");
    let first = leaf(&agent, "web", Some(&token), "").json();
    let index = first["index"].as_u64().unwrap();
    let before = humantime::parse_rfc3339(first["valid_before"].as_str().unwrap()).unwrap();
    let (_events, seen) = events(&dirs);

    // Renewed at 6 to 8 s of a 10 s life: the blocking query answers then, not at its wait.
    let started = std::time::Instant::now();
    let renewed = leaf(&agent, "web", Some(&token), &format!("?index={index}&wait=20s"));
    let waited = started.elapsed();
    assert_eq!(renewed.status, 200, "{}", renewed.body);
    let renewed = renewed.json();
    assert!(renewed["index"].as_u64().unwrap() > index);
    assert_ne!(renewed["serial"], first["serial"]);
    assert!(waited < std::time::Duration::from_secs(10), "renewed after {waited:?}");
    assert!(std::time::SystemTime::now() < before, "renewed before the first leaf expired");
    // The status follows.
    wait_for("the status to show the renewed serial", || {
        (agent.proxy("web-proxy")?["certificate"]["serial"] == renewed["serial"]).then_some(())
    });
    // A stale index answers at once.
    let stale = leaf(&agent, "web", Some(&token), "?index=0&wait=20s");
    assert_eq!(stale.json()["serial"], renewed["serial"]);
    // The renewal is an event of the service's proxy, naming the serial, not the key.
    let serial = renewed["serial"].as_str().unwrap().to_owned();
    let mut lines = Vec::new();
    let event = wait_for("the leaf-renewed event", || {
        while let Ok(line) = seen.try_recv() {
            assert!(!line.contains("PRIVATE KEY"), "{line}");
            lines.push(serde_json::from_str::<serde_json::Value>(&line).unwrap());
        }
        let renewal = |event: &&serde_json::Value| {
            event["event"] == "leaf-renewed" && event["detail"].as_str().is_some_and(|detail| detail.contains(&serial))
        };
        lines.iter().find(renewal).cloned()
    });
    assert_eq!(event["proxy"], "web-proxy");
}

#[test]
fn a_ca_key_open_to_others_stops_the_start_naming_the_file_and_field() {
    let dirs = Dirs::new();
    let Some((cert, key)) = openssl_ca(dirs.temp.path()) else { return };
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    dirs.write_config("mesh.toml", &file_mesh(&cert, &key, "72h"));
    dirs.write_config("web.toml", &sleeper("web"));
    let mut agent = Agent::spawn(&dirs, &["--allow-root"]);
    let status = agent.wait();
    assert_eq!(status.code(), Some(2), "{}", agent.logs());
    let logs = agent.logs();
    let config = dirs.config.join("mesh.toml");
    assert!(logs.contains(&config.display().to_string()), "{logs}");
    assert!(logs.contains("connect.ca.key_file") && logs.contains("0644") && logs.contains("0600"), "{logs}");
    assert!(logs.contains(&key.display().to_string()), "{logs}");
    assert!(crate::support::proxies_of(&dirs.socket()).is_empty(), "no proxy was started");
}

#[test]
fn an_unreadable_ca_key_stops_the_start() {
    let dirs = Dirs::new();
    let Some((cert, _)) = openssl_ca(dirs.temp.path()) else { return };
    let missing = dirs.temp.path().join("gone-key.pem");
    dirs.write_config("mesh.toml", &file_mesh(&cert, &missing, "72h"));
    let mut agent = Agent::spawn(&dirs, &["--allow-root"]);
    assert_eq!(agent.wait().code(), Some(2), "{}", agent.logs());
    let logs = agent.logs();
    assert!(logs.contains("connect.ca.key_file") && logs.contains("gone-key.pem"), "{logs}");
}

#[test]
fn the_operators_ca_signs_and_a_refused_reload_keeps_the_running_certificates() {
    let dirs = Dirs::new();
    let Some((cert, key)) = openssl_ca(dirs.temp.path()) else { return };
    dirs.write_config("mesh.toml", &file_mesh(&cert, &key, "72h"));
    dirs.write_config("web.toml", &sleeper("web"));
    let agent = Agent::start(&dirs, &["--allow-root"]);
    let token = token(&agent, "web");
    let pid = agent.proxy("web-proxy").unwrap()["pid"].clone();
    let first = leaf(&agent, "web", Some(&token), "").json();
    let root = std::fs::read_to_string(&cert).unwrap();
    let verdict = openssl_verify(dirs.temp.path(), &root, first["cert_pem"].as_str().unwrap()).unwrap();
    assert!(verdict.trim_end().ends_with(": OK"), "the operator's CA signed it: {verdict}");

    // A key that does not match the certificate, and a new lifetime that would issue again.
    let other = dirs.temp.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let (_, other_key) = openssl_ca(&other).unwrap();
    dirs.write_config("mesh.toml", &file_mesh(&cert, &other_key, "1h"));
    let output = tether().arg("reload").arg("--data-dir").arg(&dirs.data).output().unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("connect.ca.key_file") && stderr.contains("does not match"), "{stderr}");

    // Malformed PEM, by SIGHUP this time.
    std::fs::write(dirs.temp.path().join("broken.pem"), "-----BEGIN CERTIFICATE-----\nnope\n").unwrap();
    dirs.write_config("mesh.toml", &file_mesh(&dirs.temp.path().join("broken.pem"), &key, "1h"));
    agent.signal(Signal::SIGHUP);
    wait_for("the refused reload in the log", || agent.logs().contains("config reload refused").then_some(()));

    let after = leaf(&agent, "web", Some(&token), "").json();
    assert_eq!(after["serial"], first["serial"], "the running leaf stays");
    assert_eq!(after["index"], first["index"]);
    let status = agent.proxy("web-proxy").unwrap();
    assert_eq!(status["pid"], pid, "nothing restarted");
    assert!(status["error"].is_null(), "{status}");

    // A valid change is applied: the new lifetime issues every leaf again.
    dirs.write_config("mesh.toml", &file_mesh(&cert, &key, "1h"));
    let output = tether().arg("reload").arg("--data-dir").arg(&dirs.data).output().unwrap();
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    let renewed = leaf(&agent, "web", Some(&token), &format!("?index={}&wait=20s", first["index"])).json();
    assert_ne!(renewed["serial"], first["serial"]);
    let life = humantime::parse_rfc3339(renewed["valid_before"].as_str().unwrap())
        .unwrap()
        .duration_since(std::time::SystemTime::now())
        .unwrap();
    assert!(life <= std::time::Duration::from_secs(3600), "{life:?}");
}
