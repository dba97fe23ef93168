//! The agent's lifecycle: start, reload, close and restart with adoption, crash recovery,
//! leave, restarts of exited proxies, policy, file modes and secrets.

use assert_cmd::prelude::*;
use nix::sys::signal::Signal;
use predicates::prelude::*;

use crate::support::*;

/// `--allow-root` when the tests run as root, so that proxies without `user` may run.
fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

#[test]
fn sigterm_leaves_proxies_running_and_the_next_agent_adopts_them_with_the_same_pid() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &format!("{}{}", sleeper("web"), sleeper("db")));
    let mut first = Agent::start(&dirs, &root_flags());
    let web = pid_of(&first.wait_state("web-proxy", "running"));
    let db = pid_of(&first.wait_state("db-proxy", "running"));

    first.signal(Signal::SIGTERM);
    assert!(first.wait().success(), "the agent exits 0 on SIGTERM");
    assert!(alive(web) && alive(db), "proxies keep running without the agent");
    assert!(dirs.data.join("snapshot.json").exists());

    let second = Agent::start(&dirs, &root_flags());
    let adopted = second.wait_state("web-proxy", "running");
    assert_eq!(pid_of(&adopted), web);
    assert_eq!(adopted["restarts"], 0);
    assert_eq!(pid_of(&second.wait_state("db-proxy", "running")), db);
    assert!(second.logs().contains("proxy adopted"), "{}", second.logs());

    tether().arg("leave").arg("--data-dir").arg(&dirs.data).assert().code(0);
    let mut second = second;
    assert!(second.wait().success());
    wait_for("no proxy left", || proxies_of(&dirs.socket()).is_empty().then_some(()));
    assert!(!alive(web) && !alive(db));
    assert!(!dirs.data.join("snapshot.json").exists(), "leave removes the snapshot");
    assert!(!dirs.data.join("pids/web-proxy.pid").exists(), "stopped proxies have no pid file");
}

#[test]
fn sigkill_of_the_agent_is_recovered_by_the_next_agent_and_an_adopted_exit_is_restarted() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &sleeper("web"));
    let mut first = Agent::start(&dirs, &root_flags());
    let web = pid_of(&first.wait_state("web-proxy", "running"));
    first.signal(Signal::SIGKILL);
    first.wait();
    assert!(alive(web), "a crash of the agent is not a crash of its proxies");

    let second = Agent::start(&dirs, &root_flags());
    assert_eq!(pid_of(&second.wait_state("web-proxy", "running")), web);

    // The adopted proxy is not the new agent's child; its exit is still noticed.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(web as i32), Signal::SIGKILL).unwrap();
    let restarted = wait_for("a new web-proxy process", || {
        second.proxy("web-proxy").filter(|p| p["state"] == "running" && p["pid"].as_i64().is_some_and(|pid| pid != web))
    });
    assert_eq!(restarted["restarts"], 1);
    // The pid file is written by a background writer, just after the process starts.
    let new_pid = pid_of(&restarted);
    wait_for("the pid file to follow the restart", || {
        let text = std::fs::read_to_string(dirs.data.join("pids/web-proxy.pid")).ok()?;
        (text.trim().parse::<i64>().ok()? == new_pid).then_some(())
    });
}

#[test]
fn a_corrupt_snapshot_is_moved_aside_and_proxies_are_adopted_from_pid_files() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &sleeper("web"));
    let mut first = Agent::start(&dirs, &root_flags());
    let web = pid_of(&first.wait_state("web-proxy", "running"));
    first.signal(Signal::SIGTERM);
    first.wait();
    std::fs::write(dirs.data.join("snapshot.json"), "{ not json").unwrap();

    let second = Agent::start(&dirs, &root_flags());
    assert_eq!(pid_of(&second.wait_state("web-proxy", "running")), web, "adopted through its pid file, not restarted");
    assert!(dirs.data.join("snapshot.json.corrupt").exists());
    assert!(second.logs().contains("snapshot unusable"), "{}", second.logs());
}

#[test]
fn sighup_adds_removes_restarts_and_changes_in_place() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &format!("{}{}{}", sleeper("keep"), sleeper("gone"), sleeper("changed")));
    let agent = Agent::start(&dirs, &root_flags());
    let keep = pid_of(&agent.wait_state("keep-proxy", "running"));
    let gone = pid_of(&agent.wait_state("gone-proxy", "running"));
    let changed = pid_of(&agent.wait_state("changed-proxy", "running"));

    let in_place = sleeper("keep").replace("kill_timeout = \"2s\"", "kill_timeout = \"3s\"\nconfig = { a = 1 }");
    let restart = sleeper("changed").replace("\"3600\"", "\"3601\"");
    dirs.write_config("a.toml", &format!("{in_place}{restart}{}", sleeper("added")));
    agent.signal(Signal::SIGHUP);

    agent.wait_gone("gone-proxy");
    wait_for("gone-proxy's process to end", || (!alive(gone)).then_some(()));
    agent.wait_state("added-proxy", "running");
    let restarted = wait_for("changed-proxy to run anew", || {
        agent.proxy("changed-proxy").filter(|p| p["state"] == "running" && p["pid"].as_i64() != Some(changed))
    });
    assert!(!alive(changed));
    assert_ne!(pid_of(&restarted), changed);
    assert_eq!(pid_of(&agent.wait_state("keep-proxy", "running")), keep, "an in-place change keeps the process");
}

#[test]
fn sighup_with_a_broken_file_keeps_the_whole_previous_config() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &sleeper("web"));
    let agent = Agent::start(&dirs, &root_flags());
    let web = pid_of(&agent.wait_state("web-proxy", "running"));

    dirs.write_config("a.toml", &sleeper("other"));
    dirs.write_config("b.toml", "[[service]]\nname = \"bad\"\nprot = 1\n");
    agent.signal(Signal::SIGHUP);
    wait_for("the reload error in the log", || agent.logs().contains("config reload refused").then_some(()));
    assert!(agent.logs().contains("b.toml:3:1: field `service[0].prot`"), "{}", agent.logs());
    let proxies = agent.proxies();
    assert_eq!(proxies.len(), 1, "nothing started, nothing stopped: {proxies:?}");
    assert_eq!(pid_of(&proxies[0]), web);

    std::fs::remove_file(dirs.config.join("b.toml")).unwrap();
    agent.signal(Signal::SIGHUP);
    agent.wait_state("other-proxy", "running");
    agent.wait_gone("web-proxy");
}

#[test]
fn an_invalid_config_at_start_exits_2_naming_file_and_line() {
    let dirs = Dirs::new();
    dirs.write_config("web.toml", "[[service]]\nname = \"web\"\n[service.proxy]\nexec_mode = \"script\"\n");
    let mut agent = Agent::spawn(&dirs, &[]);
    let status = agent.wait();
    assert_eq!(status.code(), Some(2));
    let logs = agent.logs();
    assert!(logs.contains("web.toml:4:13: field `service[0].proxy.exec_mode`: unknown variant `script`"), "{logs}");
}

#[test]
fn a_second_agent_on_the_same_data_dir_is_refused() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &sleeper("web"));
    let first = Agent::start(&dirs, &root_flags());
    first.wait_state("web-proxy", "running");
    let mut second = Agent::spawn(&dirs, &root_flags());
    assert_eq!(second.wait().code(), Some(1));
    assert!(second.logs().contains("another agent is running with the data dir"), "{}", second.logs());
    assert_eq!(first.proxies().len(), 1);
}

#[test]
fn an_exiting_proxy_is_restarted_with_backoff_and_its_exit_is_shown() {
    let dirs = Dirs::new();
    dirs.write_config(
        "a.toml",
        "[[service]]\nname = \"crash\"\n[service.proxy]\ncommand = [\"/bin/sh\", \"-c\", \"exit 3\"]\n\
         [service.proxy.restart]\nfree_attempts = 1\nmax_delay = \"30s\"\n",
    );
    let agent = Agent::start(&dirs, &root_flags());
    let status = agent.wait_state("crash-proxy", "backoff");
    assert_eq!(status["last_exit"], serde_json::json!({ "code": 3 }));
    assert!(status["restarts"].as_u64().unwrap() >= 1, "{status}");
    assert!(agent.logs().contains("process exited; restarting"), "{}", agent.logs());
}

#[test]
fn a_proxy_that_cannot_start_is_failed_with_the_reason() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", "[[service]]\nname = \"nope\"\n[service.proxy]\ncommand = [\"/nonexistent/proxy\"]\n");
    let agent = Agent::start(&dirs, &root_flags());
    let status = agent.wait_state("nope-proxy", "failed");
    let error = status["error"].as_str().unwrap();
    assert!(error.contains("/nonexistent/proxy"), "{error}");
}

#[test]
fn as_root_a_proxy_without_user_is_blocked_unless_root_is_allowed() {
    if !is_root() {
        eprintln!("skipped: needs root (the root policy applies only to an agent running as uid 0)");
        return;
    }
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &sleeper("web"));
    let agent = Agent::start(&dirs, &[]);
    let status = agent.wait_state("web-proxy", "blocked");
    assert!(status["error"].as_str().unwrap().contains("--allow-root"), "{status}");
    assert!(proxies_of(&dirs.socket()).is_empty(), "a blocked proxy never runs");
}

#[test]
fn as_root_a_proxy_with_a_user_runs_as_that_user() {
    if !is_root() {
        eprintln!("skipped: needs root (switching users)");
        return;
    }
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &sleeper("web").replace("kill_timeout", "user = \"nobody\"\nkill_timeout"));
    let agent = Agent::start(&dirs, &[]);
    let pid = pid_of(&agent.wait_state("web-proxy", "running"));
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    let nobody = nix::unistd::User::from_name("nobody").unwrap().unwrap().uid;
    assert!(uid.split_whitespace().nth(1) == Some(&nobody.to_string()), "{uid}");
}

#[test]
fn files_have_spec_modes_and_secrets_appear_nowhere_but_private_files() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &sleeper("web"));
    let mut agent = Agent::start(&dirs, &root_flags());
    let pid = pid_of(&agent.wait_state("web-proxy", "running"));
    wait_for("the pid file", || dirs.data.join("pids/web-proxy.pid").exists().then_some(()));
    wait_for("the snapshot", || dirs.data.join("snapshot.json").exists().then_some(()));

    assert_eq!(mode(&dirs.data), 0o700);
    for dir in ["registrations", "pids", "logs"] {
        assert_eq!(mode(&dirs.data.join(dir)), 0o700, "{dir}");
    }
    for file in [
        "agent.sock",
        "snapshot.json",
        "tokens.json",
        "pids/web-proxy.pid",
        "logs/web-proxy-stdout.log",
        "logs/web-proxy-stderr.log",
    ] {
        assert_eq!(mode(&dirs.data.join(file)), 0o600, "{file}");
    }

    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let token = environ
        .split(|b| *b == 0)
        .find_map(|var| var.strip_prefix(b"TETHER_PROXY_TOKEN="))
        .map(|t| String::from_utf8(t.to_vec()).unwrap())
        .expect("the proxy has its token");
    assert!(token.len() >= 32, "at least 128 bits of hex");
    let status = tether().args(["status", "--json", "--data-dir"]).arg(&dirs.data).output().unwrap();
    let table = tether().args(["status", "--data-dir"]).arg(&dirs.data).output().unwrap();
    agent.signal(Signal::SIGTERM);
    agent.wait();
    for (what, text) in [
        ("status --json", String::from_utf8_lossy(&status.stdout).into_owned()),
        ("status", String::from_utf8_lossy(&table.stdout).into_owned()),
        ("agent log", agent.logs()),
        ("snapshot", std::fs::read_to_string(dirs.data.join("snapshot.json")).unwrap()),
    ] {
        assert!(!text.contains(&token), "the token appears in the {what}");
    }
    assert!(
        std::fs::read_to_string(dirs.data.join("tokens.json")).unwrap().contains(&token),
        "kept for the next agent"
    );
}

#[test]
fn the_proxy_environment_is_clean_and_complete() {
    let dirs = Dirs::new();
    dirs.write_config(
        "a.toml",
        &sleeper("web")
            .replace("kill_timeout", "env = { LOG_LEVEL = \"debug\" }\nworking_dir = \"/tmp\"\nkill_timeout"),
    );
    let agent = Agent::start(&dirs, &root_flags());
    let pid = pid_of(&agent.wait_state("web-proxy", "running"));
    let environ = wait_for("the proxy's environment", || {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        (!environ.is_empty()).then_some(environ)
    });
    let mut names: Vec<String> = environ
        .split(|b| *b == 0)
        .filter(|v| !v.is_empty())
        .map(|v| String::from_utf8_lossy(v).split('=').next().unwrap().to_owned())
        .collect();
    names.sort();
    let mut expected = vec!["LOG_LEVEL", "TETHER_PROXY_ID", "TETHER_PROXY_TOKEN", "TETHER_SERVICE_ID", "TETHER_SOCKET"];
    if std::env::var_os("PATH").is_some() {
        expected.push("PATH");
    }
    if std::env::var_os("HOME").is_some() {
        expected.push("HOME");
    }
    expected.sort();
    assert_eq!(names, expected);
    assert_eq!(std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap(), std::path::Path::new("/tmp"));
    assert_eq!(std::fs::read_link(format!("/proc/{pid}/fd/0")).unwrap(), std::path::Path::new("/dev/null"));
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split(' ').collect();
    assert_eq!(fields[2], pid.to_string(), "the proxy leads its own process group");
}

#[test]
fn status_prints_a_table_and_exact_json() {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &sleeper("web"));
    let agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("web-proxy", "running");
    tether()
        .args(["status", "--data-dir"])
        .arg(&dirs.data)
        .assert()
        .code(0)
        .stdout(predicate::str::starts_with("ID         SERVICE  STATE    READY  PID"))
        .stdout(predicate::str::contains("web-proxy  web      running"));
    let output = tether().args(["status", "--json", "--data-dir"]).arg(&dirs.data).output().unwrap();
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let entry = json.as_array().unwrap()[0].as_object().unwrap();
    let mut keys: Vec<&str> = entry.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "certificate",
            "depends_on",
            "error",
            "generations",
            "id",
            "last_exit",
            "last_reload",
            "last_xds",
            "pid",
            "ready",
            "resources",
            "restarts",
            "service",
            "started_at",
            "state",
            "status_text",
            "templates",
            "update"
        ]
    );
    assert!(entry["pid"].is_number() && entry["error"].is_null() && entry["last_exit"].is_null());
    assert!(entry["ready"] == true && entry["status_text"].is_null() && entry["last_reload"].is_null());
    assert!(entry["last_xds"].is_null(), "no Envoy asked: {entry:?}");
    // Under cgroups (as root on a host with a writable cgroup2), what the proxy's cgroup
    // used; without, null.
    let resources = &entry["resources"];
    if !resources.is_null() {
        assert!(resources["cpu_seconds"].is_number(), "{resources}");
        let mut keys: Vec<&str> = resources.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["cpu_seconds", "memory_bytes", "tasks"]);
    }
    assert!(entry["update"].is_null(), "no overlapping update in flight");
    let started = entry["started_at"].as_str().unwrap();
    assert!(humantime::parse_rfc3339(started).is_ok(), "{started}");
}

/// Rewrites the snapshot of `data` as the first snapshot format wrote it: version 1, and the
/// process backend's record flat (the identity's fields beside the kill policy).
fn downgrade_snapshot_to_version_1(data: &std::path::Path) {
    let path = data.join("snapshot.json");
    let mut snapshot: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(snapshot["version"], 2, "{snapshot}");
    snapshot["version"] = 1.into();
    for record in snapshot["proxies"].as_array_mut().unwrap() {
        let process = record["backend"]["process"].take();
        let identity = &process["identity"];
        record["backend"] = serde_json::json!({
            "boot_id": identity["boot_id"],
            "kill_signal": process["kill_signal"],
            "kill_timeout_ms": process["kill_timeout_ms"],
            "pgid": identity["pgid"],
            "pid": identity["pid"],
            "start_time": identity["start_time"],
        });
    }
    std::fs::write(&path, serde_json::to_string_pretty(&snapshot).unwrap()).unwrap();
}

#[test]
fn a_snapshot_of_the_first_format_is_adopted_from_and_written_again_in_the_current_one() {
    let dirs = Dirs::new();
    // `gone` tells which signal stopped it: SIGTERM, its kill signal, is known to the next
    // agent only through its snapshot record (a proxy no longer configured and found by
    // other means is stopped with the default, SIGINT).
    let signals = dirs.data.parent().unwrap().join("gone-signals");
    let script = format!(
        "trap 'echo term >> {0}; exit 0' TERM; trap 'echo int >> {0}; exit 0' INT; while :; do sleep 1; done",
        signals.display()
    );
    let gone = format!(
        "[[service]]\nname = \"gone\"\n[service.proxy]\ncommand = [\"/bin/sh\", \"-c\", \"{script}\"]\nkill_signal = \"SIGTERM\"\nkill_timeout = \"30s\"\n"
    );
    dirs.write_config("a.toml", &format!("{}{gone}", sleeper("kept")));
    let mut first = Agent::start(&dirs, &root_flags());
    let kept = pid_of(&first.wait_state("kept-proxy", "running"));
    pid_of(&first.wait_state("gone-proxy", "running"));
    first.signal(Signal::SIGTERM);
    assert!(first.wait().success());
    downgrade_snapshot_to_version_1(&dirs.data);
    dirs.write_config("a.toml", &sleeper("kept"));

    let second = Agent::start(&dirs, &root_flags());
    let adopted = second.wait_state("kept-proxy", "running");
    assert_eq!((pid_of(&adopted), &adopted["restarts"]), (kept, &serde_json::json!(0)));
    second.wait_gone("gone-proxy");
    let received = wait_for("gone-proxy's signal", || std::fs::read_to_string(&signals).ok().filter(|s| !s.is_empty()));
    assert_eq!(received, "term\n", "stopped with the kill signal of its first-format record");
    // Written once the stop of gone-proxy is known: a write in between may still list it
    // (as not running).
    let snapshot = wait_for("the snapshot in the current format, without gone-proxy", || {
        let text = std::fs::read_to_string(dirs.data.join("snapshot.json")).ok()?;
        (text.starts_with("{\n  \"version\": 2,") && !text.contains("gone-proxy")).then_some(text)
    });
    assert!(snapshot.contains("\"process\":{\"identity\":{"), "{snapshot}");
}

/// Coalescing windows no test can wait out: a change that waited for one would never apply.
const HOUR_WINDOWS: [&str; 4] = ["--sync-quiescent", "1h", "--sync-max-delay", "2h"];

#[test]
fn the_first_change_after_a_quiet_period_applies_at_once_from_a_config_reload() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let mut flags = root_flags();
    flags.extend(HOUR_WINDOWS);
    let agent = Agent::start(&dirs, &flags);
    dirs.write_config("web.toml", &sleeper("web"));
    tether().args(["reload", "--data-dir"]).arg(&dirs.data).assert().code(0);
    agent.wait_state("web-proxy", "running");
}

#[test]
fn the_first_change_after_a_quiet_period_applies_at_once_from_the_api() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let mut flags = root_flags();
    flags.extend(HOUR_WINDOWS);
    let agent = Agent::start(&dirs, &flags);
    let body = r#"{"name": "api", "port": 9000, "proxy": {"config": {"bind_port": 0}}}"#;
    let response = put(&dirs.socket(), "/v1/agent/service/register", Some(body)).unwrap();
    assert_eq!(response.status, 200, "{}", response.body);
    // Started: it has a pid or an exit (bind_port 0 makes the built-in proxy exit).
    wait_for("api-proxy started", || {
        agent.proxy("api-proxy").filter(|status| !status["pid"].is_null() || !status["last_exit"].is_null())
    });
}

#[test]
fn a_proxy_that_keeps_changing_holds_back_only_its_own_change() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let mut flags = root_flags();
    flags.extend(HOUR_WINDOWS);
    flags.push("--allow-api-commands");
    let agent = Agent::start(&dirs, &flags);
    let register = |name: &str, version: u32| {
        let body = format!(
            r#"{{"name": "{name}", "proxy": {{"command": ["/bin/sleep", "3600"], "env": {{"VERSION": "{version}"}}}}}}"#
        );
        let response = put(&dirs.socket(), "/v1/agent/service/register", Some(&body)).unwrap();
        assert_eq!(response.status, 200, "{}", response.body);
    };
    // web's first registration must be a change, not part of the engine's first read (which
    // nothing holds back, and which holds nothing back): registered after the first pass.
    wait_for("the engine's first reconcile pass", || {
        let metrics = get(&dirs.socket(), "/metrics").ok()?.body;
        let passes = metrics.lines().find_map(|line| line.strip_prefix("tether_reconcile_passes_total "))?;
        (passes.parse::<f64>().ok()? >= 1.0).then_some(())
    });
    register("web", 1);
    let web = pid_of(&agent.wait_state("web-proxy", "running"));
    // A second change of web within the window is held (for an hour)...
    register("web", 2);
    wait_for("web's second change held", || {
        let metrics = get(&dirs.socket(), "/metrics").ok()?.body;
        metrics.lines().any(|line| line == "tether_reconcile_deferred 1").then_some(())
    });
    // ...and delays nothing else: db is new, and starts at once.
    register("db", 1);
    agent.wait_state("db-proxy", "running");
    let status = agent.proxy("web-proxy").unwrap();
    assert_eq!((pid_of(&status), &status["restarts"]), (web, &serde_json::json!(0)), "web's held change waits");
}
