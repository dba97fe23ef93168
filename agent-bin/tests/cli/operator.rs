//! The operator's commands beyond status: `tether logs`, and a proxy's output in the
//! journal.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::mpsc;

use crate::support::*;

/// `--allow-root` when the tests run as root, so that proxies without `user` may run.
fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

/// A proxy that writes numbered lines of about 100 bytes to stdout, `every` seconds apart,
/// and one line to stderr.
fn chatty(every: &str, log_max_size: &str) -> String {
    format!(
        "[[service]]\nname = \"chatty\"\n[service.proxy]\ncommand = [\"/bin/sh\", \"-c\", \
         \"echo to stderr >&2; i=0; while :; do echo line $i {pad}; i=$((i+1)); sleep {every}; done\"]\n\
         log_max_size = \"{log_max_size}\"\nlog_keep = 1\n",
        pad = "x".repeat(90)
    )
}

/// A `tether` command that streams until killed: killed and reaped on drop.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `tether ARGS --data-dir DIR` and hands each line it prints to the receiver, as it
/// comes.
fn streaming(dirs: &Dirs, args: &[&str]) -> (KillOnDrop, mpsc::Receiver<String>) {
    let mut child = tether()
        .args(args)
        .arg("--data-dir")
        .arg(&dirs.data)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (lines, seen) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if lines.send(line).is_err() {
                return;
            }
        }
    });
    (KillOnDrop(child), seen)
}

fn line_number(line: &str) -> Option<u64> {
    line.strip_prefix("line ")?.split(' ').next()?.parse().ok()
}

#[test]
fn logs_shows_the_last_lines_of_either_stream_and_names_an_unknown_id() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    dirs.write_config("chatty.toml", &chatty("0.01", "64MiB"));
    let agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("chatty-proxy", "running");
    let logs = |args: &[&str]| {
        let output = tether().arg("logs").arg("--data-dir").arg(&dirs.data).args(args).output().unwrap();
        (output.status.code(), String::from_utf8(output.stdout).unwrap(), String::from_utf8(output.stderr).unwrap())
    };
    let (code, out, err) = wait_for("25 lines written", || {
        let shown = logs(&["chatty-proxy", "-n", "3"]);
        let numbers: Vec<u64> = shown.1.lines().filter_map(line_number).collect();
        (numbers.len() == 3 && numbers[0] >= 25).then_some(shown)
    });
    assert_eq!(code, Some(0), "{err}");
    let numbers: Vec<u64> = out.lines().filter_map(line_number).collect();
    assert_eq!(numbers, [numbers[0], numbers[0] + 1, numbers[0] + 2], "three consecutive lines:\n{out}");
    let (code, out, _) = logs(&["chatty-proxy"]);
    assert_eq!(code, Some(0));
    assert_eq!(out.lines().count(), 20, "20 lines by default:\n{out}");
    let (code, out, _) = logs(&["chatty-proxy", "--stderr"]);
    assert_eq!((code, out.as_str()), (Some(0), "to stderr\n"));

    let (code, _, err) = logs(&["nothing-proxy"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("nothing-proxy"), "{err}");
    let (code, _, err) = logs(&["not-a-proxy-id!"]);
    assert_eq!(code, Some(2), "{err}");
}

#[test]
fn logs_follow_shows_lines_written_after_a_rotation() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    // About 2 KiB a second against a 4 KiB cap: a copy-truncate rotation every two seconds.
    dirs.write_config("chatty.toml", &chatty("0.05", "4KiB"));
    let agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("chatty-proxy", "running");
    let (_follow, seen) = streaming(&dirs, &["logs", "chatty-proxy", "-n", "1", "-f"]);
    let rotated = dirs.data.join("logs/chatty-proxy-stdout.log.1");
    let mut numbers = Vec::new();
    // Until two rotations have happened since following began, and lines after them arrived.
    let mut rotations = 0;
    let mut last_first_line = None;
    wait_for("lines after two rotations", || {
        while let Ok(line) = seen.try_recv() {
            numbers.extend(line_number(&line));
        }
        let first = std::fs::read_to_string(&rotated).ok().and_then(|text| text.lines().next().map(str::to_owned));
        if first.is_some() && first != last_first_line {
            rotations += 1;
            last_first_line = first;
        }
        (rotations >= 2 && numbers.len() > 60).then_some(())
    });
    // Every line arrives once and in order across the truncations: the follower reads the
    // end of the copy it had not read, then the file from its start. (A line written in the
    // instant between the copy and the truncation is in neither, as with every copy-truncate
    // rotation: at most one gap per rotation.)
    assert!(numbers.windows(2).all(|pair| pair[0] < pair[1]), "in order, once each: {numbers:?}");
    let span = numbers[numbers.len() - 1] - numbers[0] + 1;
    let missing = span - numbers.len() as u64;
    assert!(missing <= rotations, "{missing} lines missing across {rotations} rotations: {numbers:?}");
}

#[test]
fn reload_applies_a_valid_config_and_refuses_a_broken_one_with_file_and_line() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    dirs.write_config("a.toml", &sleeper("web"));
    let agent = Agent::start(&dirs, &root_flags());
    let web = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    let reload = || {
        let output = tether().arg("reload").arg("--data-dir").arg(&dirs.data).output().unwrap();
        (output.status.code(), String::from_utf8(output.stdout).unwrap(), String::from_utf8(output.stderr).unwrap())
    };

    dirs.write_config("b.toml", &sleeper("db"));
    let (code, out, err) = reload();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("1 added"), "{out}");
    agent.wait_state("db-proxy", "running");

    // A broken file: exit 2 naming the file, line and field; nothing changes.
    dirs.write_config("c.toml", "[[service]]\nname = \"api\"\n[service.proxy]\nkill_timeout = \"5x\"\n");
    std::fs::remove_file(dirs.config.join("b.toml")).unwrap();
    let (code, _, err) = reload();
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("c.toml:4:"), "{err}");
    assert!(err.contains("kill_timeout"), "{err}");
    let proxies = agent.proxies();
    let ids: Vec<&str> = proxies.iter().map(|p| p["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["db-proxy", "web-proxy"], "the previous config stays in force");
    assert_eq!(agent.proxy("web-proxy").unwrap()["pid"].as_i64(), Some(web));
}

#[test]
fn events_show_a_killed_proxy_exit_and_restart() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let agent = Agent::start(&dirs, &root_flags());
    let (_events, seen) = streaming(&dirs, &["events", "--json"]);
    let mut received: Vec<serde_json::Value> = Vec::new();
    let mut next = |what: &str, wanted: &dyn Fn(&serde_json::Value) -> bool| -> serde_json::Value {
        wait_for(what, || {
            while let Ok(line) = seen.try_recv() {
                received.push(serde_json::from_str(&line).unwrap_or_else(|err| panic!("{err}: {line}")));
            }
            let found = received.iter().position(wanted)?;
            Some(received.remove(found))
        })
    };

    // A proxy registered after the stream began is seen starting.
    dirs.write_config("a.toml", &sleeper("web"));
    assert_eq!(tether().arg("reload").arg("--data-dir").arg(&dirs.data).status().unwrap().code(), Some(0));
    let started = next("started", &|e| e["proxy"] == "web-proxy" && e["event"] == "started");
    let pid = started["pid"].as_i64().unwrap();
    assert!(humantime::parse_rfc3339(started["time"].as_str().unwrap()).is_ok(), "{started}");

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    let exited = next("exited", &|e| e["proxy"] == "web-proxy" && e["event"] == "exited");
    assert_eq!(exited["pid"].as_i64(), Some(pid));
    assert_eq!(exited["detail"], "killed by signal 9");
    let restarted = next("restarted", &|e| e["proxy"] == "web-proxy" && e["event"] == "restarted");
    assert_ne!(restarted["pid"].as_i64(), Some(pid));
    assert_eq!(agent.proxy("web-proxy").unwrap()["pid"], restarted["pid"]);
}

#[test]
fn restart_changes_the_pid_and_keeps_the_restart_count() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    dirs.write_config("a.toml", &sleeper("web"));
    let agent = Agent::start(&dirs, &root_flags());
    let first = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    // One crash first: the count is 1.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(first).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let second = wait_for("the restart after the crash", || {
        agent.proxy("web-proxy").filter(|p| p["state"] == "running" && p["pid"].as_i64() != Some(first))
    });
    assert_eq!(second["restarts"], 1);
    let second = second["pid"].as_i64().unwrap();

    let output = tether().arg("restart").arg("--data-dir").arg(&dirs.data).arg("web-proxy").output().unwrap();
    let out = String::from_utf8(output.stdout).unwrap();
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    let status = agent.proxy("web-proxy").unwrap();
    let third = status["pid"].as_i64().unwrap();
    assert_ne!(third, second, "a new process");
    assert!(!alive(second), "the old one is gone");
    assert_eq!((status["state"].as_str(), status["restarts"].as_u64()), (Some("running"), Some(1)));
    assert!(out.contains(&format!("pid {third}")), "{out}");

    let output = tether().arg("restart").arg("--data-dir").arg(&dirs.data).arg("nothing-proxy").output().unwrap();
    let err = String::from_utf8(output.stderr).unwrap();
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(err.contains("nothing-proxy"), "{err}");
}

#[test]
fn a_stopped_proxy_stays_stopped_across_a_reload_and_an_agent_restart_until_started() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    dirs.write_config("a.toml", &sleeper("web"));
    let mut agent = Agent::start(&dirs, &root_flags());
    let pid = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    let run = |verb: &str| {
        let output = tether().arg(verb).arg("--data-dir").arg(&dirs.data).arg("web-proxy").output().unwrap();
        let out = String::from_utf8(output.stdout).unwrap();
        assert_eq!(output.status.code(), Some(0), "{verb}: {}", String::from_utf8_lossy(&output.stderr));
        out
    };
    assert_eq!(run("stop"), "web-proxy: stopped\n");
    assert!(!alive(pid), "the process is gone");
    assert_eq!(agent.proxy("web-proxy").unwrap()["pid"], serde_json::Value::Null);

    // A reload, then an agent restart: still stopped, nothing started.
    agent.signal(nix::sys::signal::Signal::SIGHUP);
    dirs.write_config("b.toml", &sleeper("db"));
    agent.signal(nix::sys::signal::Signal::SIGHUP);
    agent.wait_state("db-proxy", "running");
    assert_eq!(agent.proxy("web-proxy").unwrap()["state"], "stopped");
    agent.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(agent.wait().success());
    let agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("db-proxy", "running");
    assert_eq!(agent.wait_state("web-proxy", "stopped")["pid"], serde_json::Value::Null);
    assert!(!processes_by_proxy_id(&dirs.socket()).contains_key("web-proxy"), "no web-proxy process");

    let out = run("start");
    assert!(out.starts_with("web-proxy: "), "{out}");
    agent.wait_state("web-proxy", "running");
}

#[test]
fn a_service_id_names_its_proxy_wherever_a_proxy_id_does_and_a_malformed_id_is_a_bad_request() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    dirs.write_config("chatty.toml", &chatty("0.01", "64MiB"));
    let agent = Agent::start(&dirs, &root_flags());
    let first = agent.wait_state("chatty-proxy", "running")["pid"].as_i64().unwrap();
    let run = |args: &[&str]| {
        let output = tether().args(args).arg("--data-dir").arg(&dirs.data).output().unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };

    let (code, out, err) = wait_for("a line in the log", || {
        Some(run(&["logs", "chatty", "-n", "1"])).filter(|(_, out, _)| !out.is_empty())
    });
    assert_eq!(code, Some(0), "{err}");
    assert!(line_number(out.trim_end()).is_some(), "{out}");
    let (code, out, err) = run(&["restart", "chatty"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.starts_with("restarted chatty"), "{out}");
    let second = agent.wait_state("chatty-proxy", "running")["pid"].as_i64().unwrap();
    assert_ne!(first, second);
    assert_eq!(run(&["stop", "chatty"]).0, Some(0));
    agent.wait_state("chatty-proxy", "stopped");
    assert_eq!(run(&["start", "chatty"]).0, Some(0));
    agent.wait_state("chatty-proxy", "running");

    let socket = dirs.socket();
    let by_service = get(&socket, "/v1/agent/proxy/chatty").unwrap();
    assert_eq!(by_service.status, 200, "{}", by_service.body);
    assert_eq!(by_service.json()["id"], "chatty-proxy");
    for (path, status) in [
        ("/v1/agent/proxy/bad%20id", 400),
        ("/v1/agent/proxy/..", 400),
        ("/v1/agent/proxy/-x/logs", 400),
        ("/v1/agent/proxy/nothing", 404),
        ("/v1/agent/proxy/nothing-proxy", 404),
    ] {
        let response = get(&socket, path).unwrap();
        assert_eq!(response.status, status, "{path}: {}", response.body);
        assert!(response.json()["error"].is_string(), "{path}: {}", response.body);
    }
    let response = put(&socket, "/v1/agent/proxy/bad%20id/restart", None).unwrap();
    assert_eq!(response.status, 400, "{}", response.body);
    let (code, _, err) = run(&["restart", "nothing"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("no proxy nothing"), "{err}");

    // Every answer, whatever its type or status, tells a browser not to guess another type.
    for path in [
        "/v1/agent/proxies",
        "/v1/agent/proxy/chatty",
        "/v1/agent/health",
        "/metrics",
        "/",
        "/v1/agent/proxy/x%20y",
        "/nowhere",
    ] {
        let response = get(&socket, path).unwrap();
        assert!(
            response.headers.to_ascii_lowercase().contains("x-content-type-options: nosniff"),
            "{path}: {}",
            response.headers
        );
    }
}

#[test]
fn logs_json_writes_one_object_a_line_and_follows() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    dirs.write_config("chatty.toml", &chatty("0.05", "64MiB"));
    let agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("chatty-proxy", "running");
    let parse = |line: &str| -> serde_json::Value {
        serde_json::from_str(line).unwrap_or_else(|err| panic!("not a JSON line: {line:?}: {err}"))
    };
    let output =
        tether().args(["logs", "chatty", "--stderr", "--json", "--data-dir"]).arg(&dirs.data).output().unwrap();
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    let out = String::from_utf8(output.stdout).unwrap();
    let lines: Vec<serde_json::Value> = out.lines().map(parse).collect();
    assert_eq!(lines.len(), 1, "{out}");
    let line = &lines[0];
    assert_eq!(line.as_object().unwrap().len(), 4, "time, proxy, stream and text only: {line}");
    assert_eq!(line["proxy"], "chatty-proxy", "the proxy's id, though a service id was given");
    assert_eq!(line["stream"], "stderr");
    assert_eq!(line["text"], "to stderr");
    humantime::parse_rfc3339(line["time"].as_str().unwrap()).unwrap();

    let (_follow, seen) = streaming(&dirs, &["logs", "chatty-proxy", "-n", "1", "-f", "--json"]);
    let mut numbers = Vec::new();
    wait_for("five lines followed", || {
        while let Ok(line) = seen.try_recv() {
            let line = parse(&line);
            assert_eq!((&line["proxy"], &line["stream"]), (&"chatty-proxy".into(), &"stdout".into()), "{line}");
            numbers.extend(line_number(line["text"].as_str().unwrap()));
        }
        (numbers.len() >= 5).then_some(())
    });
    assert!(numbers.windows(2).all(|pair| pair[1] == pair[0] + 1), "whole lines, in order: {numbers:?}");
}

/// A journal of the test's: a datagram socket in the test's temp dir.
fn journal(dirs: &Dirs) -> (std::os::unix::net::UnixDatagram, String) {
    let path = dirs.temp.path().join("journal.socket");
    let journal = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
    journal.set_read_timeout(Some(std::time::Duration::from_millis(100))).unwrap();
    (journal, path.to_str().unwrap().to_owned())
}

/// The next entry the journal receives whose fields include `field` (a `KEY=value` line).
fn entry_with(journal: &std::os::unix::net::UnixDatagram, field: &str) -> String {
    let mut buffer = vec![0; 1 << 16];
    wait_for(&format!("an entry with {field:?}"), || {
        let length = journal.recv(&mut buffer).ok()?;
        let entry = String::from_utf8_lossy(&buffer[..length]).into_owned();
        entry.contains(&format!("\n{field}\n")).then_some(entry)
    })
}

#[test]
fn a_proxy_with_log_target_journal_sends_each_line_with_its_proxy_service_and_pid() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let (journal, socket_path) = journal(&dirs);
    dirs.write_config("chatty.toml", &format!("{}log_target = \"journal\"\n", chatty("0.05", "64MiB")));
    let mut flags = root_flags();
    flags.extend(["--journal-socket", &socket_path]);
    let agent = Agent::start(&dirs, &flags);
    let pid = pid_of(&agent.wait_state("chatty-proxy", "running"));
    let entry = entry_with(&journal, "MESSAGE=to stderr");
    for field in [
        "SYSLOG_IDENTIFIER=chatty-proxy\n".to_owned(),
        format!("SYSLOG_PID={pid}\n"),
        "TETHER_PROXY=chatty-proxy\n".to_owned(),
        "TETHER_SERVICE=chatty\n".to_owned(),
        "TETHER_STREAM=stderr\n".to_owned(),
        "PRIORITY=3\n".to_owned(),
    ] {
        assert!(entry.contains(&field), "{field:?} missing from {entry:?}");
    }
}

#[test]
fn log_target_changes_in_place_and_the_next_lines_go_to_the_journal() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let (journal, socket_path) = journal(&dirs);
    dirs.write_config("chatty.toml", &chatty("0.05", "64MiB"));
    let mut flags = root_flags();
    flags.extend(["--journal-socket", &socket_path]);
    let agent = Agent::start(&dirs, &flags);
    let pid = pid_of(&agent.wait_state("chatty-proxy", "running"));
    dirs.write_config("chatty.toml", &format!("{}log_target = \"both\"\n", chatty("0.05", "64MiB")));
    agent.signal(nix::sys::signal::Signal::SIGHUP);
    let entry = entry_with(&journal, "TETHER_STREAM=stdout");
    assert!(entry.contains("TETHER_SERVICE=chatty\n"), "the agent's socket and fields, not a default: {entry:?}");
    assert!(entry.contains(&format!("SYSLOG_PID={pid}\n")), "{entry:?}");
    assert_eq!(pid_of(&agent.proxy("chatty-proxy").unwrap()), pid, "the proxy kept running");
}

#[test]
fn a_proxy_whose_journal_does_not_listen_fails_naming_itself_and_the_socket() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let socket_path = dirs.temp.path().join("no-journal.socket");
    let socket_path = socket_path.to_str().unwrap();
    dirs.write_config("chatty.toml", &format!("{}log_target = \"both\"\n", chatty("0.05", "64MiB")));
    let mut flags = root_flags();
    flags.extend(["--journal-socket", socket_path]);
    let agent = Agent::start(&dirs, &flags);
    let status = wait_for("the start refused", || {
        let proxy = agent.proxy("chatty-proxy")?;
        proxy["error"].as_str().is_some_and(|error| error.contains("journal")).then_some(proxy)
    });
    let error = status["error"].as_str().unwrap();
    assert!(
        error.contains("chatty-proxy: log_target sends its output to the journal") && error.contains(socket_path),
        "{error}"
    );
}

#[test]
fn the_agents_own_log_in_json_is_one_object_a_line_with_the_proxy_in_a_field() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    dirs.write_config("a.toml", &sleeper("web"));
    // The test kit starts every agent with `--log-format json`.
    let agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("web-proxy", "running");
    let logs = wait_for("a line about web-proxy", || {
        let logs = agent.logs();
        logs.contains("web-proxy").then_some(logs)
    });
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|err| panic!("not a JSON line: {line:?}: {err}")))
        .collect();
    for line in &lines {
        for key in ["timestamp", "level", "message"] {
            assert!(line.get(key).is_some(), "no {key} in {line}");
        }
    }
    assert!(lines.iter().any(|line| line["proxy"] == "web-proxy"), "no line names the proxy in a field:\n{logs}");
}
