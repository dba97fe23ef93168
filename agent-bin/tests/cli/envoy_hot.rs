//! Hot restart of a proxy of `kind = "envoy"` with the real Envoy: a change that xDS cannot
//! deliver (the proxy's `env`) starts a new generation at the next restart epoch beside the
//! old one, which hands its listeners over without one refused connection, drains and exits;
//! two such proxies have base ids of their own; and a generation killed with SIGKILL is
//! started again cold, at epoch 0, never at an epoch with no live parent.

use std::path::Path;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::envoy::{generations, wait_generations};
use crate::support::*;
use crate::xds::{EnvoyGuard, Greeter, free_port, root_flags, wait_served};

/// The value that follows `flag` on process `pid`'s command line.
fn flag_of(pid: i64, flag: &str) -> Option<String> {
    let words = cmdline(pid as i32);
    words.windows(2).find(|pair| pair[0] == flag).map(|pair| pair[1].clone())
}

/// A service `name` on `port` whose proxy is an Envoy of `kind = "envoy"`, with its admin on
/// `admin_port` (its `/ready` the readiness check) and its public listener on `bind_port`;
/// `generation` is an environment variable, a change of which only a new process can take.
/// Envoy drains for 1 s and ends the old generation 3 s into a hot restart. A crashed Envoy
/// is started again after 1 s, then 2 s (no restart without delay).
fn write_envoy(dirs: &Dirs, envoy: &Path, name: &str, ports: (u16, u16, u16), generation: u32) {
    let (port, admin_port, bind_port) = ports;
    let command = serde_json::to_string(&[
        envoy.display().to_string().as_str(),
        "--concurrency",
        "1",
        "--drain-time-s",
        "1",
        "--parent-shutdown-time-s",
        "3",
    ])
    .unwrap();
    dirs.write_config(
        &format!("{name}.toml"),
        &format!(
            "[[service]]\nname = \"{name}\"\nport = {port}\n[service.proxy]\nkind = \"envoy\"\ncommand = {command}\n\
             admin_port = {admin_port}\nenv = {{ GENERATION = \"{generation}\" }}\nkill_signal = \"SIGTERM\"\n\
             kill_timeout = \"5s\"\nconfig = {{ bind_port = {bind_port} }}\n\
             [service.proxy.restart]\nfree_attempts = 0\n"
        ),
    );
}

/// Waits until `front-proxy` runs one generation, a process other than `killed`; its pid.
#[track_caller]
fn wait_restarted(agent: &Agent, killed: i64) -> i64 {
    let status = wait_until("front-proxy to run again", || {
        let status = agent.proxy("front-proxy").ok_or("not listed")?;
        let pid = status["pid"].as_i64().unwrap_or(0);
        let one = generations(&status).len() == 1;
        if status["state"] == "running" && pid > 0 && pid != killed && one {
            Ok(status)
        } else {
            Err(format!("{status}"))
        }
    });
    assert_eq!(generations(&status)[0].0, 0, "a cold start: {status}");
    status["pid"].as_i64().unwrap()
}

#[track_caller]
fn reload(dirs: &Dirs) {
    let reloaded = tether().arg("reload").arg("--data-dir").arg(&dirs.data).output().unwrap();
    assert!(reloaded.status.success(), "{}", String::from_utf8_lossy(&reloaded.stderr));
}

#[test]
fn a_proxy_of_kind_envoy_hot_restarts_without_a_refused_connection_and_starts_cold_after_a_kill() {
    let test = "a_proxy_of_kind_envoy_hot_restarts_without_a_refused_connection_and_starts_cold_after_a_kill";
    let Some(envoy) = envoy_or_skip(test) else { return };
    let dirs = Dirs::new();
    let bootstrap = |id: &str| dirs.data.join("envoy").join(format!("{id}.json"));
    let front_envoys = EnvoyGuard::of_bootstrap(bootstrap("front-proxy"));
    let back_envoys = EnvoyGuard::of_bootstrap(bootstrap("back-proxy"));
    let _sweep = SweepOnDrop(dirs.socket());
    let (front_service, back_service) = (Greeter::start("front\n"), Greeter::start("back\n"));
    let front = (front_service.port, free_port(), free_port());
    let back = (back_service.port, free_port(), free_port());
    write_envoy(&dirs, &envoy, "front", front, 0);
    write_envoy(&dirs, &envoy, "back", back, 0);
    let agent = Agent::start(&dirs, &root_flags());
    let first = wait_generations(&agent, "front-proxy", &[(0, "current")]);
    let other = wait_generations(&agent, "back-proxy", &[(0, "current")]);
    let first_pid = first["pid"].as_i64().unwrap();
    let other_pid = other["pid"].as_i64().unwrap();
    front_envoys.note(first_pid);
    back_envoys.note(other_pid);
    let base_id = flag_of(first_pid, "--base-id").expect("the agent gives Envoy its base id");
    assert_eq!(flag_of(first_pid, "--restart-epoch").as_deref(), Some("0"), "{:?}", cmdline(first_pid as i32));
    assert_ne!(Some(&base_id), flag_of(other_pid, "--base-id").as_ref(), "each proxy has a base id of its own");
    wait_served(front.2, "front\n");
    wait_served(back.2, "back\n");

    // A new environment: only a new process has it, and Envoy hands over to epoch 1.
    let prober = Prober::start(front.2);
    wait_for("connections through Envoy", || (prober.counts().0 >= 100).then_some(()));
    write_envoy(&dirs, &envoy, "front", front, 1);
    reload(&dirs);
    let both = wait_generations(&agent, "front-proxy", &[(1, "current"), (0, "draining")]);
    let pids: Vec<i64> = generations(&both).iter().map(|(_, _, pid)| *pid).collect();
    let second_pid = pids[0];
    assert_eq!(pids[1], first_pid, "the old generation is the first Envoy: {both}");
    assert!(alive(first_pid), "the previous generation lives while the new one starts: {both}");
    front_envoys.note(second_pid);
    assert_eq!(flag_of(second_pid, "--restart-epoch").as_deref(), Some("1"), "{:?}", cmdline(second_pid as i32));
    assert_eq!(flag_of(second_pid, "--base-id"), Some(base_id.clone()), "a hot restart keeps the base id");
    assert_eq!(environ_var(second_pid as i32, "GENERATION").as_deref(), Some("1"));
    // The old generation drains, and Envoy ends it.
    wait_until(
        "the old generation to exit",
        || if alive(first_pid) { Err(format!("{first_pid} runs")) } else { Ok(()) },
    );
    wait_generations(&agent, "front-proxy", &[(1, "current")]);
    let tried = prober.counts().0;
    wait_for("more connections through Envoy", || (prober.counts().0 >= tried + 100).then_some(()));
    let (tried, refused) = prober.counts();
    drop(prober);
    assert_eq!(refused, 0, "{refused} of {tried} connections refused across the hot restart");
    wait_served(front.2, "front\n");
    let status = agent.proxy("front-proxy").unwrap();
    assert_eq!(status["restarts"], 0, "a hot restart is no restart: {status}");
    assert!(alive(other_pid), "the other Envoy runs on");

    // The serving generation killed: no parent lives, so the next one starts cold.
    kill(Pid::from_raw(second_pid as i32), Signal::SIGKILL).unwrap();
    let cold_pid = wait_restarted(&agent, second_pid);
    front_envoys.note(cold_pid);
    assert_eq!(flag_of(cold_pid, "--restart-epoch").as_deref(), Some("0"), "{:?}", cmdline(cold_pid as i32));
    wait_served(front.2, "front\n");

    // Killed again, and changed while it waits on its backoff: the change is no hot restart
    // either, as nothing lives to hand over from.
    kill(Pid::from_raw(cold_pid as i32), Signal::SIGKILL).unwrap();
    wait_until("front-proxy to wait on its backoff", || {
        let status = agent.proxy("front-proxy").ok_or("not listed")?;
        if status["state"] == "backoff" { Ok(()) } else { Err(format!("{status}")) }
    });
    write_envoy(&dirs, &envoy, "front", front, 2);
    reload(&dirs);
    let changed_pid = wait_restarted(&agent, cold_pid);
    front_envoys.note(changed_pid);
    assert_eq!(flag_of(changed_pid, "--restart-epoch").as_deref(), Some("0"), "{:?}", cmdline(changed_pid as i32));
    assert_eq!(environ_var(changed_pid as i32, "GENERATION").as_deref(), Some("2"));
    wait_served(front.2, "front\n");

    // And from there a hot restart is epoch 1 again, beside its live parent.
    write_envoy(&dirs, &envoy, "front", front, 3);
    reload(&dirs);
    let again = wait_generations(&agent, "front-proxy", &[(1, "current"), (0, "draining")]);
    let again_pid = generations(&again)[0].2;
    front_envoys.note(again_pid);
    assert_eq!(generations(&again)[1].2, changed_pid, "{again}");
    assert_eq!(flag_of(again_pid, "--restart-epoch").as_deref(), Some("1"), "{:?}", cmdline(again_pid as i32));
    wait_served(front.2, "front\n");
    wait_until("the cold generation to exit", || {
        if alive(changed_pid) { Err(format!("{changed_pid} runs")) } else { Ok(()) }
    });
    drop(agent);
}
