//! Ordering with real processes: `depends_on` holds a proxy `waiting` until what it depends
//! on is ready, `tether leave` stops dependents first, a chain starts in order, and a cycle
//! is refused by `validate` and by a reload.

use std::path::Path;

use assert_cmd::prelude::*;
use nix::sys::signal::Signal;

use crate::support::*;

/// `--allow-root` when the tests run as root, so that proxies without `user` may run.
fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

/// A service whose proxy runs `script` under `/bin/sh`, with `extra` lines in its
/// `[service.proxy]` table.
fn scripted(name: &str, script: &str, extra: &str) -> String {
    let script = script.replace('\\', "\\\\").replace('"', "\\\"");
    format!(
        "[[service]]\nname = \"{name}\"\n[service.proxy]\ncommand = [\"/bin/sh\", \"-c\", \"{script}\"]\nkill_timeout = \"5s\"\n{extra}"
    )
}

/// The nanoseconds since the epoch that the file at `path` holds, once it holds them.
#[track_caller]
fn read_time(path: &Path) -> u128 {
    wait_for(&format!("{} to be written", path.display()), || {
        std::fs::read_to_string(path).ok().and_then(|text| text.split_whitespace().last()?.parse().ok())
    })
}

/// The first word of the file at `path` (a pid), once it is written.
#[track_caller]
fn read_pid(path: &Path) -> i64 {
    wait_for(&format!("{} to be written", path.display()), || {
        std::fs::read_to_string(path).ok().and_then(|text| text.split_whitespace().next()?.parse().ok())
    })
}

#[test]
fn a_dependent_starts_only_once_its_dependency_is_ready() {
    let dirs = Dirs::new();
    let out = dirs.temp.path();
    // A takes 2 s to be ready: its readiness is a file it creates then.
    let a = scripted(
        "a",
        &format!("echo $$ $(date +%s%N) > {0}/a.start; sleep 2; touch {0}/a.ready; exec sleep 3600", out.display()),
        &format!(
            "[service.proxy.readiness]\nexec = [\"/bin/test\", \"-e\", \"{}/a.ready\"]\ninterval = \"50ms\"\n",
            out.display()
        ),
    );
    let b = scripted(
        "b",
        &format!("echo $$ $(date +%s%N) > {}/b.start; exec sleep 3600", out.display()),
        "depends_on = { a = \"ready\" }\n",
    );
    dirs.write_config("a.toml", &format!("{a}{b}"));
    let agent = Agent::start(&dirs, &root_flags());

    let waiting = agent.wait_state("b-proxy", "waiting");
    assert_eq!(waiting["pid"], serde_json::Value::Null);
    let error = waiting["error"].as_str().unwrap();
    assert!(error.starts_with("waiting for a-proxy to be ready"), "{waiting}");
    let metrics = get(&agent.socket, "/metrics").unwrap().body;
    assert!(metrics.contains("tether_proxies{state=\"waiting\"} 1"), "{metrics}");
    assert!(metrics.contains("tether_proxies{state=\"blocked\"} 0"), "every state is listed: {metrics}");

    let b_status = agent.wait_state("b-proxy", "running");
    let a_status = agent.wait_state("a-proxy", "running");
    let (a_pid, a_started) = (read_pid(&out.join("a.start")), read_time(&out.join("a.start")));
    let (b_pid, b_started) = (read_pid(&out.join("b.start")), read_time(&out.join("b.start")));
    assert_eq!((pid_of(&a_status), pid_of(&b_status)), (a_pid, b_pid), "the pids that wrote the files");
    let ready = std::fs::metadata(out.join("a.ready")).unwrap().modified().unwrap();
    let ready = ready.duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    assert!(b_started >= ready, "b started {} ms before a was ready", (ready - b_started) / 1_000_000);
    assert!(b_started - a_started >= 2_000_000_000, "b started {} ms after a", (b_started - a_started) / 1_000_000);
    assert_eq!(b_status["error"], serde_json::Value::Null);

    // A dependency that exits is restarted by the supervisor; its dependent keeps running.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(a_pid as i32), Signal::SIGKILL).unwrap();
    wait_for("a-proxy to run again", || {
        agent.proxy("a-proxy").filter(|p| p["state"] == "running" && p["pid"].as_i64().is_some_and(|pid| pid != a_pid))
    });
    let b_after = agent.proxy("b-proxy").unwrap();
    assert_eq!((b_after["state"].as_str(), pid_of(&b_after)), (Some("running"), b_pid), "b was not restarted");
    assert!(alive(b_pid));
    tether().arg("leave").arg("--data-dir").arg(&dirs.data).assert().code(0);
}

#[test]
fn leave_stops_dependents_and_waits_for_them_before_signalling_what_they_depend_on() {
    let dirs = Dirs::new();
    let out = dirs.temp.path();
    // On SIGINT, A notes the time, whether B's process is still there (a zombie still has
    // its /proc entry) and whether C was signalled already (C blocks SIGINT, so a SIGINT
    // sent to it stays pending, which /proc shows), then takes 1 s to exit.
    let a = scripted(
        "a",
        &format!(
            "trap 'b=$(cat {0}/b.pid); if [ -e /proc/$b ]; then s=b-alive; else s=b-gone; fi; \
             c=$(cat {0}/c.pid); p=0; for m in $(awk \"/^(SigPnd|ShdPnd):/ {{print \\$2}}\" /proc/$c/status); do p=$(( p | 0x$m )); done; \
             if [ $(( p & 2 )) -ne 0 ]; then t=c-signalled; else t=c-not-signalled; fi; \
             echo $s $t $(date +%s%N) > {0}/a.signalled; sleep 1; exit 0' INT; \
             while :; do sleep 0.05; done",
            out.display()
        ),
        "",
    );
    let b = scripted(
        "b",
        &format!(
            "echo $$ > {0}/b.pid; trap 'echo $(date +%s%N) > {0}/b.exiting; exit 0' INT; while :; do sleep 0.05; done",
            out.display()
        ),
        "depends_on = { \"a-proxy\" = \"started\" }\n",
    );
    // C depends on nothing: it is signalled at once, beside B. It blocks SIGINT, so the
    // signal stays pending for A to see, and is killed after its kill_timeout.
    let c = format!(
        "[[service]]\nname = \"c\"\n[service.proxy]\ncommand = [\"/usr/bin/python3\", \"-c\", \"import os, signal, time; \
         signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT]); open('{0}/c.pid', 'w').write(str(os.getpid())); \
         time.sleep(3600)\"]\nkill_timeout = \"1s\"\n",
        out.display()
    );
    dirs.write_config("a.toml", &format!("{a}{b}{c}"));
    let mut agent = Agent::start(&dirs, &root_flags());
    let a_pid = pid_of(&agent.wait_state("a-proxy", "running"));
    let b_pid = pid_of(&agent.wait_state("b-proxy", "running"));
    let c_pid = pid_of(&agent.wait_state("c-proxy", "running"));
    assert_eq!(read_pid(&out.join("b.pid")), b_pid);
    assert_eq!(read_pid(&out.join("c.pid")), c_pid);

    tether().arg("leave").arg("--data-dir").arg(&dirs.data).assert().code(0);
    assert!(agent.wait().success());
    assert!(!alive(a_pid) && !alive(b_pid));
    let signalled = std::fs::read_to_string(out.join("a.signalled")).unwrap();
    assert!(signalled.starts_with("b-gone "), "a was signalled while b still existed: {signalled}");
    assert!(
        signalled.contains(" c-signalled "),
        "c, which nothing orders, was signalled in the first wave, beside b: {signalled}"
    );
    let a_signalled = read_time(&out.join("a.signalled"));
    let b_exiting = read_time(&out.join("b.exiting"));
    assert!(b_exiting < a_signalled, "b was stopped first");
}

#[test]
fn a_chain_of_fifty_starts_in_order() {
    let dirs = Dirs::new();
    let order = dirs.temp.path().join("order");
    // Each link notes its id, then says it is ready on descriptor 3 (no polling).
    let script = format!("echo $TETHER_PROXY_ID >> {}; echo >&3; exec sleep 3600 3>&-", order.display());
    let mut config = String::new();
    // Written backwards, so that the order comes from the dependencies alone.
    for i in (0..50).rev() {
        let mut extra = String::from("[service.proxy.readiness]\nfd = 3\n");
        if i > 0 {
            extra = format!("depends_on = {{ n{} = \"ready\" }}\n{extra}", i - 1);
        }
        config.push_str(&scripted(&format!("n{i}"), &script, &extra));
    }
    dirs.write_config("chain.toml", &config);
    let agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("n49-proxy", "running");
    let expected: Vec<String> = (0..50).map(|i| format!("n{i}-proxy")).collect();
    let written: Vec<String> = std::fs::read_to_string(&order).unwrap().lines().map(str::to_owned).collect();
    assert_eq!(written, expected);
    tether().arg("leave").arg("--data-dir").arg(&dirs.data).assert().code(0);
}

#[test]
fn a_cycle_is_refused_by_validate_and_by_a_reload_which_keeps_the_old_config() {
    let dirs = Dirs::new();
    let valid = format!("{}depends_on = {{ b = \"ready\" }}\n{}", sleeper("a"), sleeper("b"));
    let cycle = format!(
        "{}depends_on = {{ b = \"ready\" }}\n{}depends_on = {{ a = \"started\" }}\n",
        sleeper("a"),
        sleeper("b")
    );
    dirs.write_config("a.toml", &valid);
    let agent = Agent::start(&dirs, &root_flags());
    let a = pid_of(&agent.wait_state("a-proxy", "running"));
    let b = pid_of(&agent.wait_state("b-proxy", "running"));

    dirs.write_config("a.toml", &cycle);
    let file = dirs.config.join("a.toml");
    let expected = format!(
        "{0}:6:14: field `service[0].proxy.depends_on`: dependency cycle: a-proxy ({0}:6:14) -> b-proxy ({0}:12:14) -> a-proxy",
        file.display()
    );
    let output = tether().arg("validate").arg(&dirs.config).output().unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(&expected), "{stderr}");

    agent.signal(Signal::SIGHUP);
    wait_for("the reload error in the log", || agent.logs().contains("config reload refused").then_some(()));
    assert!(agent.logs().contains("dependency cycle: a-proxy ("), "{}", agent.logs());
    let reload = tether().arg("reload").arg("--data-dir").arg(&dirs.data).output().unwrap();
    assert_eq!(reload.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&reload.stderr).contains(&expected), "{reload:?}");
    let proxies = agent.proxies();
    assert_eq!(proxies.len(), 2, "{proxies:?}");
    assert_eq!(pid_of(&agent.proxy("a-proxy").unwrap()), a, "the old config keeps running");
    assert_eq!(pid_of(&agent.proxy("b-proxy").unwrap()), b);
    assert!(alive(a) && alive(b));
}

#[test]
fn a_ready_dependency_that_flaps_starts_its_dependent_once_ready_and_never_restarts_it() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let out = dirs.temp.path();
    // A lives 0.3 s and exits, restarted at once each time, until `a.steady` exists; an
    // instance is ready once `a.ready` exists (probed every 50 ms).
    let a = scripted(
        "a",
        &format!("if [ -e {0}/a.steady ]; then exec sleep 3600; fi; sleep 0.3; exit 1", out.display()),
        &format!(
            "[service.proxy.restart]\nfree_attempts = 1000\n\
             [service.proxy.readiness]\nexec = [\"/bin/test\", \"-e\", \"{}/a.ready\"]\ninterval = \"50ms\"\n",
            out.display()
        ),
    );
    let b = scripted(
        "b",
        &format!("echo $$ >> {}/b.starts; exec sleep 3600", out.display()),
        "depends_on = { a = \"ready\" }\n",
    );
    dirs.write_config("a.toml", &format!("{a}{b}"));
    let agent = Agent::start(&dirs, &root_flags());

    // Never ready while it flaps: B waits, through restart after restart of A.
    wait_for("a to restart three times", || {
        agent.proxy("a-proxy").filter(|a| a["restarts"].as_u64().is_some_and(|restarts| restarts >= 3))
    });
    let waiting = agent.proxy("b-proxy").unwrap();
    assert_eq!(waiting["state"], "waiting", "{waiting}");
    assert!(waiting["error"].as_str().unwrap().starts_with("waiting for a-proxy to be ready"), "{waiting}");
    assert!(!out.join("b.starts").exists(), "b started before a was ready");

    // Ready for a moment in each of its lives: B starts, once.
    std::fs::write(out.join("a.ready"), "").unwrap();
    let b_pid = pid_of(&agent.wait_state("b-proxy", "running"));
    let restarts = agent.proxy("a-proxy").unwrap()["restarts"].as_u64().unwrap();
    // A goes on flapping, running then exiting: B is neither stopped nor restarted.
    wait_for("a to flap five more times", || {
        let b = agent.proxy("b-proxy").unwrap();
        assert_eq!((b["state"].as_str(), b["pid"].as_i64()), (Some("running"), Some(b_pid)), "{b}");
        agent.proxy("a-proxy").filter(|a| a["restarts"].as_u64().is_some_and(|now| now >= restarts + 5))
    });
    // And when it is not ready at all for a while (its new instances never pass), B runs on.
    std::fs::remove_file(out.join("a.ready")).unwrap();
    let restarts = agent.proxy("a-proxy").unwrap()["restarts"].as_u64().unwrap();
    wait_for("a to restart, never ready, three more times", || {
        agent.proxy("a-proxy").filter(|a| a["restarts"].as_u64().is_some_and(|now| now >= restarts + 3))
    });
    let b = agent.proxy("b-proxy").unwrap();
    assert_eq!(
        (b["state"].as_str(), b["pid"].as_i64(), b["restarts"].as_u64()),
        (Some("running"), Some(b_pid), Some(0))
    );
    assert_eq!(std::fs::read_to_string(out.join("b.starts")).unwrap(), format!("{b_pid}\n"), "b started once");

    // A settles: both run, and leave stops B before A.
    std::fs::write(out.join("a.steady"), "").unwrap();
    std::fs::write(out.join("a.ready"), "").unwrap();
    wait_for("a to run steadily", || {
        agent.proxy("a-proxy").filter(|a| a["state"] == "running" && a["pid"].as_i64().is_some_and(alive))
    });
    assert!(alive(b_pid));
    tether().arg("leave").arg("--data-dir").arg(&dirs.data).assert().code(0);
    assert!(!alive(b_pid));
}
