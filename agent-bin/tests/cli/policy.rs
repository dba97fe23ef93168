//! What the agent refuses: settings of the register API that need `--allow-api-commands`,
//! proxies that would run as root without `--allow-root`, and `config` values nested past
//! the limit, in config files, `tether validate` and the API.

use assert_cmd::prelude::*;
use nix::sys::signal::Signal;
use predicates::prelude::*;

use crate::support::*;

/// `--allow-root` when the tests run as root, so that proxies without `user` may run.
fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

fn pid_of(status: &serde_json::Value) -> i32 {
    status["pid"].as_i64().and_then(|pid| i32::try_from(pid).ok()).unwrap_or_else(|| panic!("no pid in {status}"))
}

/// The real uid of process `pid`.
fn uid_of(pid: i32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|line| line.starts_with("Uid:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

const REGISTER: &str = "/v1/agent/service/register";

/// One register body per refused setting, with the key its refusal names.
fn refused_bodies() -> Vec<(String, &'static str)> {
    let proxy = |name: &str, setting: &str| format!(r#"{{"name": "{name}", "proxy": {{{setting}}}}}"#);
    vec![
        (proxy("user", r#""user": "nobody""#), "`proxy.user`"),
        (proxy("workdir", r#""working_dir": "/""#), "`proxy.working_dir`"),
        (proxy("inherit", r#""inherit_env": true"#), "`proxy.inherit_env`"),
        (proxy("preload", r#""env": {"LOG_LEVEL": "info", "LD_PRELOAD": "/tmp/evil.so"}"#), "`proxy.env.LD_PRELOAD`"),
        (proxy("gconv", r#""env": {"GCONV_PATH": "/tmp"}"#), "`proxy.env.GCONV_PATH`"),
        // Refused before its value is checked: an empty command is not the client's to set either.
        (proxy("empty", r#""command": []"#), "`proxy.command`"),
        // Addresses the agent or the built-in proxy would bind or contact, judged by what they
        // mean, not how they are written.
        (
            proxy("any", r#""listener": [{"name": "l", "address": "0.0.0.0:18302"}]"#),
            "`proxy.listener.address` to `0.0.0.0:18302`, which means 0.0.0.0",
        ),
        (
            proxy("mapped", r#""listener": [{"name": "l", "address": "[::ffff:0.0.0.0]:18302"}]"#),
            "`proxy.listener.address` to `[::ffff:0.0.0.0]:18302`, which means 0.0.0.0",
        ),
        (proxy("zero", r#""config": {"bind_address": "0", "bind_port": 18303}"#), "`proxy.config.bind_address` to `0`"),
        (proxy("low", r#""config": {"bind_port": 80}"#), "`proxy.config.bind_port` to 80"),
        (
            proxy("decimal", r#""readiness": {"http": "http://167772161:80/"}"#),
            "`proxy.readiness.http` to `http://167772161:80/`, which means 10.0.0.1",
        ),
        (proxy("named", r#""readiness": {"http": "http://example.com/"}"#), "is a host name"),
        (proxy("remote", r#""liveness": {"tcp": "10.0.0.1:80"}"#), "`proxy.liveness.tcp` to `10.0.0.1:80`"),
        (
            proxy("upstream", r#""config": {"local_service_address": "10.0.0.1:80"}"#),
            "`proxy.config.local_service_address` to `10.0.0.1:80`",
        ),
        (r#"{"name": "far", "address": "10.0.0.1", "port": 80, "proxy": {}}"#.to_owned(), "`address` to `10.0.0.1`"),
        // The probe that found the hole: root and a preloaded library, both refused.
        (
            r#"{"name": "pwn", "proxy": {"user": "root", "env": {"LD_PRELOAD": "/tmp/evil.so"}}}"#.to_owned(),
            "`proxy.user`",
        ),
    ]
}

#[test]
fn without_the_flag_the_register_api_refuses_what_runs_and_how_naming_the_key() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let agent = Agent::start(&dirs, &root_flags());
    for (body, key) in refused_bodies() {
        let response = put(&dirs.socket(), REGISTER, Some(&body)).unwrap();
        assert_eq!(response.status, 403, "{body}: {}", response.body);
        let error = response.json()["error"].as_str().unwrap().to_owned();
        assert!(error.contains(key) && error.contains("--allow-api-commands"), "{body}: {error}");
    }
    // Harmless settings, and the defaults `tether register` writes out, still register.
    let plain = r#"{"name": "plain", "proxy": {"inherit_env": false, "env": {"LOG_LEVEL": "info"}}}"#;
    let response = put(&dirs.socket(), REGISTER, Some(plain)).unwrap();
    assert_eq!(response.status, 200, "{}", response.body);
    // Registered after every refusal: once it is listed, a refused one would be too.
    wait_for("plain-proxy in the list", || agent.proxy("plain-proxy"));
    let ids: Vec<String> = agent.proxies().iter().map(|p| p["id"].as_str().unwrap().to_owned()).collect();
    assert_eq!(ids, ["plain-proxy"]);
    let registrations: Vec<_> = std::fs::read_dir(dirs.data.join("registrations")).unwrap().flatten().collect();
    assert_eq!(registrations.len(), 1, "{registrations:?}");
}

#[test]
fn with_the_flag_the_register_api_may_set_them() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let mut flags = root_flags();
    flags.push("--allow-api-commands");
    let agent = Agent::start(&dirs, &flags);
    let sleeper = |name: &str, setting: &str| {
        format!(
            r#"{{"name": "{name}", "proxy": {{"command": ["/bin/sleep", "3600"], "kill_timeout": "2s", {setting}}}}}"#
        )
    };
    let user = if is_root() {
        "nobody".to_owned()
    } else {
        nix::unistd::User::from_uid(nix::unistd::getuid()).unwrap().unwrap().name
    };
    let bodies = [
        sleeper("user", &format!(r#""user": "{user}""#)),
        sleeper("workdir", r#""working_dir": "/""#),
        sleeper("inherit", r#""inherit_env": true"#),
        sleeper("preload", r#""env": {"LD_PRELOAD": "/nonexistent/lib.so"}"#),
        sleeper("gconv", r#""env": {"GCONV_PATH": "/nonexistent"}"#),
    ];
    for body in &bodies {
        let response = put(&dirs.socket(), REGISTER, Some(body)).unwrap();
        assert_eq!(response.status, 200, "{body}: {}", response.body);
    }
    // A process's environment shows in /proc a moment after its exec: waited for.
    let preload = pid_of(&agent.wait_state("preload-proxy", "running"));
    let seen = wait_for("LD_PRELOAD in the proxy's environment", || environ_var(preload, "LD_PRELOAD"));
    assert_eq!(seen, "/nonexistent/lib.so");
    let gconv = pid_of(&agent.wait_state("gconv-proxy", "running"));
    let seen = wait_for("GCONV_PATH in the proxy's environment", || environ_var(gconv, "GCONV_PATH"));
    assert_eq!(seen, "/nonexistent");
    agent.wait_state("workdir-proxy", "running");
    agent.wait_state("inherit-proxy", "running");
    if is_root() {
        let nobody = nix::unistd::User::from_name("nobody").unwrap().unwrap().uid.as_raw();
        assert_eq!(uid_of(pid_of(&agent.wait_state("user-proxy", "running"))), nobody);
    }
    // With the flag the value is checked like any other: an empty command is a bad request.
    let empty = put(&dirs.socket(), REGISTER, Some(r#"{"name": "empty", "proxy": {"command": []}}"#)).unwrap();
    assert_eq!(empty.status, 400, "{}", empty.body);
    assert!(empty.json()["error"].as_str().unwrap().contains("field `proxy.command`"), "{}", empty.body);
}

#[test]
fn as_root_a_proxy_whose_user_is_root_is_blocked_unless_root_is_allowed() {
    if !is_root() {
        eprintln!("skipped: needs root (the root policy applies only to an agent running as uid 0)");
        return;
    }
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    dirs.write_config("a.toml", &sleeper("web").replace("kill_timeout", "user = \"root\"\nkill_timeout"));
    let mut agent = Agent::start(&dirs, &[]);
    let status = agent.wait_state("web-proxy", "blocked");
    let error = status["error"].as_str().unwrap();
    assert!(error.contains("`user` \"root\" is uid 0") && error.contains("--allow-root"), "{status}");
    assert!(proxies_of(&dirs.socket()).is_empty(), "a blocked proxy never runs");

    // Another user lifts the block, once the agent has looked that user up.
    dirs.write_config("a.toml", &sleeper("web").replace("kill_timeout", "user = \"nobody\"\nkill_timeout"));
    agent.signal(Signal::SIGHUP);
    let nobody = nix::unistd::User::from_name("nobody").unwrap().unwrap().uid.as_raw();
    assert_eq!(uid_of(pid_of(&agent.wait_state("web-proxy", "running"))), nobody);
    tether().arg("leave").arg("--data-dir").arg(&dirs.data).assert().code(0);
    assert!(agent.wait().success());

    dirs.write_config("a.toml", &sleeper("web").replace("kill_timeout", "user = \"root\"\nkill_timeout"));
    let agent = Agent::start(&dirs, &["--allow-root"]);
    assert_eq!(uid_of(pid_of(&agent.wait_state("web-proxy", "running"))), 0);
}

/// A `[[service]]` running `sleep` whose `config` nests `depth` tables, counting `config`.
fn nested_sleeper(name: &str, depth: usize) -> String {
    format!("{}config = {}1{}\n", sleeper(name), "{ a = ".repeat(depth), " }".repeat(depth))
}

/// The field that a `config` nested past the limit is refused at, in a file.
fn too_deep_field() -> String {
    format!("field `service[0].proxy.config{}`: `config` nests tables and arrays more than 32 deep", ".a".repeat(32))
}

#[test]
fn validate_and_the_agent_take_config_nested_32_deep_and_refuse_33_naming_the_field() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    dirs.write_config("deep.toml", &nested_sleeper("deep", 32));
    tether().arg("validate").arg(&dirs.config).assert().code(0);

    // Such a proxy survives an agent restart: the snapshot that holds it stays readable.
    let mut first = Agent::start(&dirs, &root_flags());
    let pid = pid_of(&first.wait_state("deep-proxy", "running"));
    first.signal(Signal::SIGTERM);
    assert!(first.wait().success());
    let second = Agent::start(&dirs, &root_flags());
    assert_eq!(pid_of(&second.wait_state("deep-proxy", "running")), pid);
    assert!(!second.logs().contains("snapshot unusable"), "{}", second.logs());
    drop(second);

    let other = Dirs::new();
    other.write_config("deep.toml", &nested_sleeper("deep", 33));
    let file = other.config.join("deep.toml");
    tether()
        .arg("validate")
        .arg(&other.config)
        .assert()
        .code(2)
        .stderr(predicate::str::contains(format!("{}:", file.display())))
        .stderr(predicate::str::contains(too_deep_field()));
    let mut refused = Agent::spawn(&other, &root_flags());
    assert_eq!(refused.wait().code(), Some(2));
    assert!(refused.logs().contains(&too_deep_field()), "{}", refused.logs());
}

#[test]
fn the_register_api_takes_config_nested_32_deep_and_refuses_33_naming_the_field() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let agent = Agent::start(&dirs, &root_flags());
    let body = |name: &str, depth: usize| {
        format!(r#"{{"name": "{name}", "proxy": {{"config": {}1{}}}}}"#, r#"{"a": "#.repeat(depth), "}".repeat(depth))
    };
    let accepted = put(&dirs.socket(), REGISTER, Some(&body("ok", 32))).unwrap();
    assert_eq!(accepted.status, 200, "{}", accepted.body);
    wait_for("ok-proxy in the list", || agent.proxy("ok-proxy"));

    let refused = put(&dirs.socket(), REGISTER, Some(&body("deep", 33))).unwrap();
    assert_eq!(refused.status, 400, "{}", refused.body);
    let error = refused.json()["error"].as_str().unwrap().to_owned();
    let field = format!("field `proxy.config{}`", ".a".repeat(32));
    assert!(error.starts_with("request body:1:") && error.contains(&field), "{error}");
    assert!(error.contains("more than 32 deep"), "{error}");
    assert!(agent.proxy("deep-proxy").is_none());
}
