//! The control API and the CLI commands built on it: register, deregister, refusals,
//! error shapes, the read-only HTTP listener and metrics.

use assert_cmd::prelude::*;
use predicates::prelude::*;

use crate::support::*;

fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

#[test]
fn register_and_deregister_through_the_cli_and_registrations_survive_a_restart() {
    let dirs = Dirs::new();
    let agent = Agent::start(&dirs, &root_flags());
    let file = dirs.temp.path().join("api.toml");
    std::fs::write(&file, "[[service]]\nname = \"api\"\nport = 9000\n[service.proxy]\nconfig = { bind_port = 0 }\n")
        .unwrap();
    tether().arg("register").arg(&file).arg("--data-dir").arg(&dirs.data).assert().code(0).stdout("registered api\n");
    let registration = dirs.data.join("registrations/api.json");
    assert_eq!(mode(&registration), 0o600);
    // The built-in proxy is the default command; bind_port 0 makes it exit, which is fine
    // here: the registration is what is under test.
    wait_for("api-proxy in the list", || agent.proxy("api-proxy"));
    drop(agent);

    let agent = Agent::start(&dirs, &root_flags());
    wait_for("api-proxy after a restart", || agent.proxy("api-proxy"));
    tether().args(["deregister", "api", "--data-dir"]).arg(&dirs.data).assert().code(0).stdout("deregistered api\n");
    agent.wait_gone("api-proxy");
    assert!(!registration.exists());
    tether()
        .args(["deregister", "api", "--data-dir"])
        .arg(&dirs.data)
        .assert()
        .code(1)
        .stderr(predicate::str::contains("404 Not Found: service api is not registered"));
}

#[test]
fn an_api_command_is_refused_unless_allowed() {
    let dirs = Dirs::new();
    let body = r#"{"name": "web", "proxy": {"command": ["/bin/sleep", "3600"]}}"#;
    let agent = Agent::start(&dirs, &root_flags());
    let response = put(&dirs.socket(), "/v1/agent/service/register", Some(body)).unwrap();
    assert_eq!(response.status, 403);
    assert!(response.json()["error"].as_str().unwrap().contains("--allow-api-commands"), "{}", response.body);
    assert!(agent.proxies().is_empty());
    drop(agent);

    let mut flags = root_flags();
    flags.push("--allow-api-commands");
    let agent = Agent::start(&dirs, &flags);
    let response = put(&dirs.socket(), "/v1/agent/service/register", Some(body)).unwrap();
    assert_eq!(response.status, 200, "{}", response.body);
    agent.wait_state("web-proxy", "running");
}

#[test]
fn a_registration_that_cannot_be_persisted_is_refused_and_its_proxy_never_stays() {
    let dirs = Dirs::new();
    let mut flags = root_flags();
    flags.push("--allow-api-commands");
    let agent = Agent::start(&dirs, &flags);
    let socket = dirs.socket();
    // A directory where the registration file goes: the atomic rename over it fails.
    let blocked = dirs.data.join("registrations/web.json");
    std::fs::create_dir(&blocked).unwrap();
    std::fs::write(blocked.join("inside"), "").unwrap();
    let body = |name: &str| format!(r#"{{"name": "{name}", "proxy": {{"command": ["/bin/sleep", "3600"]}}}}"#);

    let refused = put(&socket, "/v1/agent/service/register", Some(&body("web"))).unwrap();
    assert_eq!(refused.status, 500, "{}", refused.body);
    let message = refused.json()["error"].as_str().unwrap().to_owned();
    assert!(message.starts_with("service web was not changed: cannot persist the registration"), "{message}");
    assert!(message.contains("registrations/web.json"), "{message}");

    // A later registration is planned after the rollback: once it runs, web's fate is settled.
    let other = put(&socket, "/v1/agent/service/register", Some(&body("other"))).unwrap();
    assert_eq!(other.status, 200, "{}", other.body);
    agent.wait_state("other-proxy", "running");
    agent.wait_gone("web-proxy");
    wait_until("no process of web-proxy", || match processes_by_proxy_id(&socket).get("web-proxy") {
        Some(pids) if !pids.is_empty() => Err(format!("web-proxy runs as {pids:?}")),
        _ => Ok(()),
    });

    std::fs::remove_dir_all(&blocked).unwrap();
    let accepted = put(&socket, "/v1/agent/service/register", Some(&body("web"))).unwrap();
    assert_eq!(accepted.status, 200, "{}", accepted.body);
    agent.wait_state("web-proxy", "running");
    assert!(blocked.is_file());
}

#[test]
fn bad_requests_get_json_errors_with_fitting_codes() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &sleeper("cfg"));
    let _agent = Agent::start(&dirs, &root_flags());
    let socket = dirs.socket();

    let malformed = put(&socket, "/v1/agent/service/register", Some("{\"name\": ")).unwrap();
    assert_eq!(malformed.status, 400);
    assert_eq!(malformed.json()["error"], "request body:1:9: EOF while parsing a value");

    let unknown_field = put(&socket, "/v1/agent/service/register", Some("{\"name\": \"x\", \"prot\": 1}")).unwrap();
    assert_eq!(unknown_field.status, 400);
    assert!(unknown_field.json()["error"].as_str().unwrap().contains("field `prot`: unknown field `prot`"));

    let bad_id = put(&socket, "/v1/agent/service/register", Some("{\"name\": \"../x\"}")).unwrap();
    assert_eq!(bad_id.status, 400);

    let unknown = get(&socket, "/v1/agent/proxy/nope-proxy").unwrap();
    assert_eq!(unknown.status, 404);
    assert!(unknown.json()["error"].is_string());
    assert_eq!(put(&socket, "/v1/agent/service/deregister/nope", None).unwrap().status, 404);
    assert_eq!(get(&socket, "/v1/agent/nothing-here").unwrap().status, 404);

    let config_owned = put(&socket, "/v1/agent/service/deregister/cfg", None).unwrap();
    assert_eq!(config_owned.status, 409);
    assert!(config_owned.json()["error"].as_str().unwrap().contains("defined by config file"));
    let taken = put(&socket, "/v1/agent/service/register", Some("{\"name\": \"cfg\"}")).unwrap();
    assert_eq!(taken.status, 409);

    assert_eq!(get(&socket, "/v1/agent/health").unwrap().json(), serde_json::json!({ "status": "ok" }));
}

#[test]
fn the_http_listener_serves_reads_only() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &sleeper("web"));
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut flags = root_flags();
    flags.extend(["--http-addr", addr.as_str()]);
    let agent = Agent::start(&dirs, &flags);
    agent.wait_state("web-proxy", "running");
    let http = |method: &str, path: &str| {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{{}}"
        )
        .unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).unwrap();
        out
    };
    let proxies = http("GET", "/v1/agent/proxies");
    assert!(proxies.starts_with("HTTP/1.1 200"), "{proxies}");
    assert!(proxies.contains("\"web-proxy\""));
    assert!(http("PUT", "/v1/agent/service/register").starts_with("HTTP/1.1 404"));
    assert!(http("PUT", "/v1/agent/leave").starts_with("HTTP/1.1 404"));
    let logs = http("GET", "/v1/agent/proxy/web-proxy/logs");
    assert!(logs.starts_with("HTTP/1.1 404"), "a proxy's output is served over HTTP only with --http-logs: {logs}");
    assert!(agent.proxy("web-proxy").is_some(), "the agent is still there");

    let other = Dirs::new();
    let mut refused = Agent::spawn(&other, &["--http-addr", "0.0.0.0:0"]);
    assert_eq!(refused.wait().code(), Some(2));
    assert!(refused.logs().contains("is not a loopback address"), "{}", refused.logs());
}

/// The value of the first sample of `name` whose labels contain `labels`.
fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']) && line.contains(labels))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
}

#[test]
fn metrics_are_prometheus_text_and_move_when_proxies_restart() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &sleeper("web"));
    let agent = Agent::start(&dirs, &root_flags());
    let first = agent.wait_state("web-proxy", "running");
    let metrics = get(&dirs.socket(), "/metrics").unwrap();
    assert_eq!(metrics.status, 200);
    assert!(
        metrics.headers.to_ascii_lowercase().contains("content-type: text/plain; version=0.0.4"),
        "{}",
        metrics.headers
    );
    // Every sample line is `name{labels} value` or `name value`, and every family has HELP and TYPE.
    for line in metrics.body.lines().filter(|l| !l.is_empty()) {
        if let Some(meta) = line.strip_prefix("# ") {
            assert!(meta.starts_with("HELP tether_") || meta.starts_with("TYPE tether_") || meta == "EOF", "{line}");
        } else {
            let (series, value) = line.rsplit_once(' ').unwrap();
            assert!(series.starts_with("tether_"), "{line}");
            value.parse::<f64>().unwrap_or_else(|_| panic!("not a number: {line}"));
        }
    }
    assert_eq!(sample(&metrics.body, "tether_proxies", "state=\"running\""), Some(1.0), "{}", metrics.body);
    assert_eq!(
        sample(&metrics.body, "tether_proxy_restarts_total", "proxy=\"web-proxy\""),
        Some(0.0),
        "{}",
        metrics.body
    );
    assert!(sample(&metrics.body, "tether_reconcile_passes_total", "").unwrap() >= 1.0, "{}", metrics.body);

    let pid = first["pid"].as_i64().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let body = wait_for("the restart counter to move", || {
        let body = get(&dirs.socket(), "/metrics").ok()?.body;
        (sample(&body, "tether_proxy_restarts_total", "proxy=\"web-proxy\"") == Some(1.0)).then_some(body)
    });
    assert_eq!(sample(&body, "tether_proxy_exits_total", "exit=\"signal\",value=\"9\""), Some(1.0), "{body}");
    assert_eq!(sample(&body, "tether_actions_total", "kind=\"start\",result=\"ok\""), Some(1.0), "{body}");
    assert!(sample(&body, "tether_reconcile_duration_seconds_count", "").unwrap() >= 1.0, "{body}");
    assert!(sample(&body, "tether_snapshot_writes_total", "").unwrap() >= 1.0, "{body}");
    assert_eq!(sample(&body, "tether_adoptions_total", "result=\"dropped\""), Some(0.0), "{body}");
}
