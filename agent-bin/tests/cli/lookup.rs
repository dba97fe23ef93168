//! Programs named by a bare name, found in the proxy's `PATH` as `execvp` finds them: one
//! that is there runs, one that is not yet fails its start, says why, and runs once it is
//! installed, without anything else being done.

use std::os::unix::fs::PermissionsExt;

use crate::support::*;

/// `--allow-root` when the tests run as root, so that proxies without `user` may run.
fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

/// `argv[0]` and the executable of `pid`.
fn program_of(pid: i64) -> (String, std::path::PathBuf) {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let arg0 = cmdline.split(|&b| b == 0).next().map(|arg| String::from_utf8_lossy(arg).into_owned());
    (arg0.unwrap_or_default(), std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default())
}

#[test]
fn a_proxy_whose_command_is_a_bare_name_runs() {
    let dirs = Dirs::new();
    dirs.write_config("web.toml", "[[service]]\nname = \"web\"\n[service.proxy]\ncommand = [\"sleep\", \"1000\"]\n");
    let agent = Agent::start(&dirs, &root_flags());
    let status = agent.wait_state("web-proxy", "running");
    let pid = status["pid"].as_i64().unwrap_or_else(|| panic!("no pid in {status}"));
    assert!(alive(pid));
    let (arg0, exe) = program_of(pid);
    assert_eq!(arg0, "sleep");
    assert!(exe.is_absolute() && exe.file_name().is_some_and(|name| name == "sleep"), "{}", exe.display());
    assert!(!agent.logs().contains("program not found"), "{}", agent.logs());
}

#[test]
fn a_program_installed_after_the_start_is_found_by_the_next_attempt() {
    let dirs = Dirs::new();
    let bin = dirs.temp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    dirs.write_config(
        "late.toml",
        &format!(
            "[[service]]\nname = \"late\"\n[service.proxy]\ncommand = [\"tether-late-sleep\", \"1000\"]\n\
             env = {{ PATH = \"{}\" }}\n[service.proxy.restart]\nmax_delay = \"1s\"\n",
            bin.display()
        ),
    );
    let agent = Agent::start(&dirs, &root_flags());
    let expected = format!("program `tether-late-sleep` not found in PATH `{}`", bin.display());
    let failed = wait_for("the failed start", || {
        agent.proxy("late-proxy").filter(|p| p["error"].as_str().is_some_and(|error| error.contains(&expected)))
    });
    assert_eq!(failed["state"], "failed", "{failed}");
    assert_eq!(failed["pid"], serde_json::Value::Null, "{failed}");
    // The agent said so at its start, naming the field, the program and the PATH.
    let logs = agent.logs();
    let warning = logs
        .lines()
        .find(|line| line.contains("program not found in PATH"))
        .unwrap_or_else(|| panic!("no warning in {logs}"));
    let warning: serde_json::Value = serde_json::from_str(warning).unwrap();
    assert_eq!(warning["level"], "WARN", "{warning}");
    assert_eq!(warning["program"], "tether-late-sleep", "{warning}");
    assert_eq!(warning["path"], bin.display().to_string(), "{warning}");
    assert_eq!(warning["field"], "proxy.command", "{warning}");

    // Installed now, written whole and renamed into place: the retries find it.
    let staged = bin.join(".tether-late-sleep.tmp");
    std::fs::copy("/bin/sleep", &staged).unwrap();
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&staged, bin.join("tether-late-sleep")).unwrap();
    let running = agent.wait_state("late-proxy", "running");
    let pid = running["pid"].as_i64().unwrap_or_else(|| panic!("no pid in {running}"));
    assert_eq!(program_of(pid), ("tether-late-sleep".to_owned(), bin.join("tether-late-sleep")));
    assert_eq!(running["error"], serde_json::Value::Null, "{running}");
}
