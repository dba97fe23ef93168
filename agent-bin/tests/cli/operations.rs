//! The procedures of `docs/operations.md`, followed for real: its systemd unit verifies,
//! and its upgrade procedure restarts no proxy.

use std::path::Path;

use nix::sys::signal::Signal;

use crate::support::*;

/// The unit file between the guide's markers.
fn unit_of_the_guide() -> String {
    let guide = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md")).unwrap();
    let (_, rest) = guide.split_once("<!-- unit:begin -->").expect("the guide marks its unit");
    let (block, _) = rest.split_once("<!-- unit:end -->").expect("the guide marks its unit's end");
    let (_, unit) = block.split_once("```ini\n").expect("an ini block");
    let (unit, _) = unit.split_once("```").expect("the end of the ini block");
    unit.to_owned()
}

#[test]
fn the_systemd_unit_of_the_operations_guide_verifies() {
    let Ok(version) = std::process::Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("skipped: systemd-analyze is not installed");
        return;
    };
    assert!(version.status.success());
    let unit = unit_of_the_guide();
    assert!(unit.contains("KillMode=process"), "proxies must survive a restart of the unit");
    assert!(unit.contains("ExecReload=/bin/kill -HUP $MAINPID"));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tether.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/tether", env!("CARGO_BIN_EXE_tether"))).unwrap();
    let verify =
        std::process::Command::new("systemd-analyze").args(["verify", "--man=no"]).arg(&path).output().unwrap();
    let stderr = String::from_utf8_lossy(&verify.stderr);
    assert!(verify.status.success() && stderr.trim().is_empty(), "systemd-analyze verify: {stderr}");
}

#[test]
fn the_upgrade_procedure_replaces_the_binary_and_restarts_no_proxy() {
    let dirs = Dirs::new();
    // The agent runs from an installed copy, which the upgrade replaces.
    let bin = dirs.temp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let installed = bin.join("tether");
    std::fs::copy(env!("CARGO_BIN_EXE_tether"), &installed).unwrap();
    let upstream = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let bind = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    dirs.write_config(
        "a.toml",
        &format!(
            "{}[[service]]\nname = \"edge\"\nport = {}\n[service.proxy]\nconfig = {{ bind_port = {bind} }}\n",
            sleeper("web"),
            upstream.local_addr().unwrap().port()
        ),
    );
    let flags: Vec<&str> = if is_root() { vec!["--allow-root"] } else { vec![] };
    let mut old = Agent::start_with(&installed, &dirs, &flags);
    let web = old.wait_state("web-proxy", "running");
    let edge = old.wait_state("edge-proxy", "running");

    // 1. Put the new binary in place atomically, as `install` does.
    let staged = bin.join(".tether.new");
    std::fs::copy(env!("CARGO_BIN_EXE_tether"), &staged).unwrap();
    std::fs::rename(&staged, &installed).unwrap();
    // 2. Restart the agent.
    old.signal(Signal::SIGTERM);
    assert!(old.wait().success());
    let new = Agent::start_with(&installed, &dirs, &flags);
    for (id, before) in [("web-proxy", &web), ("edge-proxy", &edge)] {
        let after = new.wait_state(id, "running");
        assert_eq!(after["pid"], before["pid"], "{id} kept its process");
        assert_eq!(after["restarts"], 0, "{id} was not restarted");
    }
    // The built-in proxy still runs the replaced binary; its next start runs the new one
    // from the same path.
    let edge_pid = edge["pid"].as_i64().unwrap();
    let exe = std::fs::read_link(format!("/proc/{edge_pid}/exe")).unwrap();
    assert!(exe.to_string_lossy().ends_with("(deleted)"), "{}", exe.display());
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(edge_pid as i32), Signal::SIGKILL).unwrap();
    let restarted = wait_for("edge-proxy to run anew", || {
        new.proxy("edge-proxy").filter(|p| p["state"] == "running" && p["pid"].as_i64() != Some(edge_pid))
    });
    let exe = std::fs::read_link(format!("/proc/{}/exe", restarted["pid"])).unwrap();
    assert_eq!(exe, installed, "the restart runs the new binary from the installed path");
}
