//! Scale and transient failures: no proxy stays down for a reason that goes away, and the
//! agent fits in a descriptor limit that holds one descriptor per proxy.

use std::path::Path;

use crate::support::*;

/// `--allow-root` when the tests run as root, so that proxies without `user` may run.
fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

#[test]
fn a_proxy_whose_program_appears_later_runs_within_its_backoff_without_a_change() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let program = dirs.temp.path().join("late-sleep");
    dirs.write_config(
        "late.toml",
        &format!("[[service]]\nname = \"late\"\n[service.proxy]\ncommand = [\"{}\", \"3600\"]\n", program.display()),
    );
    let agent = Agent::start(&dirs, &root_flags());
    let failed = agent.wait_state("late-proxy", "failed");
    assert!(failed["error"].as_str().unwrap().contains("late-sleep"), "{failed}");

    // The program is installed; nothing about the service changes.
    let staged = dirs.temp.path().join("staged");
    std::fs::copy("/bin/sleep", &staged).unwrap();
    std::fs::rename(&staged, &program).unwrap();
    let running = agent.wait_state("late-proxy", "running");
    assert_eq!(running["error"], serde_json::Value::Null);
    let pid = i32::try_from(running["pid"].as_i64().unwrap()).unwrap();
    assert_eq!(cmdline(pid).first().map(String::as_str), Some(program.to_str().unwrap()));
}

#[test]
fn the_agent_runs_more_proxies_than_half_its_descriptor_limit() {
    // Two descriptors a proxy would need 2 × 200 + the agent's own: more than 300.
    const PROXIES: usize = 200;
    const NOFILE: u64 = 300;
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let services: String = (0..PROXIES).map(|n| sleeper(&format!("p{n:03}"))).collect();
    dirs.write_config("many.toml", &services);
    let agent = Agent::start_with_nofile(&dirs, &root_flags(), NOFILE);
    let proxies = wait_for("every proxy running", || {
        let proxies = agent.proxies();
        (proxies.len() == PROXIES && proxies.iter().all(|p| p["state"] == "running")).then_some(proxies)
    });
    assert!(proxies.iter().all(|p| p["error"].is_null()), "{proxies:?}");
    let descriptors = std::fs::read_dir(Path::new(&format!("/proc/{}/fd", agent.pid()))).unwrap().count();
    assert!(descriptors < PROXIES + 64, "{descriptors} descriptors for {PROXIES} proxies");
    assert!(agent.logs().contains("\"nofile\":300"), "the limit is logged:\n{}", agent.logs());
}
