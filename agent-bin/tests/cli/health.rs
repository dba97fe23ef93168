//! Health checks through the binary: a readiness check read from a config file gates
//! `running`, and the status, its table and the metrics say whether a proxy is ready.

use std::net::{TcpListener, TcpStream};

use crate::support::*;

fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A built-in proxy on `bind`, ready once `ready_port` accepts connections.
fn checked_builtin(name: &str, bind: u16, ready_port: u16) -> String {
    format!(
        "[[service]]\nname = \"{name}\"\nport = 9\n[service.proxy]\nkill_timeout = \"2s\"\nconfig = {{ bind_port = {bind} }}\n\
         [service.proxy.readiness]\ntcp = \"127.0.0.1:{ready_port}\"\ninterval = \"100ms\"\n"
    )
}

#[test]
fn running_means_ready_and_a_proxy_whose_readiness_fails_stays_starting_with_the_reason() {
    let dirs = Dirs::new();
    let (bind, never) = (free_port(), free_port());
    dirs.write_config(
        "a.toml",
        &format!("{}{}", checked_builtin("web", bind, bind), checked_builtin("late", free_port(), never)),
    );
    let agent = Agent::start(&dirs, &root_flags());

    let web = agent.wait_state("web-proxy", "running");
    assert_eq!(web["ready"], true, "{web}");
    // Running means its readiness passed: it listens now, without a retry.
    TcpStream::connect(("127.0.0.1", bind)).expect("a ready built-in proxy listens");

    let late = wait_for("late-proxy's failed readiness probe", || {
        agent.proxy("late-proxy").filter(|p| p["state"] == "starting" && p["error"].is_string())
    });
    assert_eq!(late["ready"], false, "{late}");
    assert!(late["pid"].is_number(), "it runs, not ready: {late}");
    let error = late["error"].as_str().unwrap();
    assert!(error.starts_with(&format!("readiness probe tcp 127.0.0.1:{never}: connect: ")), "{error}");

    let table = tether().args(["status", "--data-dir"]).arg(&dirs.data).output().unwrap();
    let table = String::from_utf8(table.stdout).unwrap();
    let row = |id: &str| {
        table
            .lines()
            .find(|line| line.starts_with(id))
            .unwrap_or_default()
            .split_whitespace()
            .take(4)
            .collect::<Vec<_>>()
    };
    assert_eq!(row("web-proxy"), ["web-proxy", "web", "running", "yes"], "{table}");
    assert_eq!(row("late-proxy"), ["late-proxy", "late", "starting", "no"], "{table}");

    let metrics = get(&agent.socket, "/metrics").unwrap().body;
    assert!(metrics.contains("tether_proxy_ready{proxy=\"web-proxy\",service=\"web\"} 1"), "{metrics}");
    assert!(metrics.contains("tether_proxy_ready{proxy=\"late-proxy\",service=\"late\"} 0"), "{metrics}");
    let value = |prefix: &str| -> f64 {
        let line =
            metrics.lines().find(|line| line.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix}: {metrics}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(value("tether_proxy_probe_failures_total{proxy=\"late-proxy\"") >= 1.0, "{metrics}");
    assert!(value("tether_probe_duration_seconds_count") >= 2.0, "{metrics}");
    assert_eq!(value("tether_notify_foreign_total"), 0.0, "{metrics}");
}

#[test]
fn haproxy_in_master_worker_mode_turns_ready_through_notify_socket() {
    let Some(haproxy) = haproxy() else {
        eprintln!("skipped: haproxy is not installed (CI installs Debian's haproxy)");
        return;
    };
    let dirs = Dirs::new();
    let port = free_port();
    let config = dirs.data.parent().unwrap().join("haproxy.cfg");
    std::fs::write(
        &config,
        format!(
            "global\n    maxconn 64\ndefaults\n    mode tcp\n    timeout connect 1s\n    timeout client 5s\n    timeout server 5s\n\
             frontend front\n    bind 127.0.0.1:{port}\n    default_backend none\nbackend none\n"
        ),
    )
    .unwrap();
    // -Ws: master-worker mode with systemd's notification protocol; the master says READY=1
    // once its workers run. Nothing in it knows about tether.
    dirs.write_config(
        "h.toml",
        &format!(
            "[[service]]\nname = \"edge\"\n[service.proxy]\ncommand = [\"{haproxy}\", \"-Ws\", \"-f\", \"{}\"]\n\
             kill_signal = \"SIGTERM\"\nkill_timeout = \"5s\"\n[service.proxy.readiness]\nnotify = true\n",
            config.display()
        ),
    );
    let agent = Agent::start(&dirs, &root_flags());
    let started = wait_for("haproxy started", || agent.proxy("edge-proxy").filter(|p| p["pid"].is_number()));
    let ready = agent.wait_state("edge-proxy", "running");
    assert_eq!(ready["ready"], true, "{ready}");
    assert_eq!(ready["pid"], started["pid"], "the master, not a restart, became ready: {ready}");
    TcpStream::connect(("127.0.0.1", port)).expect("ready haproxy listens");
    assert!(!agent.logs().contains("no supervised instance"), "{}", agent.logs());
}
