//! The end-to-end figures of the `tether` binary with real processes: bring-up, restart
//! latency, change-to-running latency, memory per proxy, idle cost, parallel stop, agent
//! restart with adoption, and the cost of idle blocking queries.
//!
//! Each figure has a baseline measured in the same run: raw spawning by this process for
//! process work, the agent with no proxies for the agent's own costs.

use std::collections::BTreeMap;
use std::fs;
use std::io::{ErrorKind, Read};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use super::lab::{Agent, Flock, Lab, POLL, ProxyRow, SLEEP, raw_bring_up, request, send};
use super::report::{Met, Report, Row, median, met, ms, percentile, ratio, secs};
use super::sys;

/// Proxies for bring-up, memory, agent restart and blocking queries.
const MANY: usize = 1_000;
/// Proxies for the idle cost and the parallel stop.
const SOME: usize = 100;
/// `kill -9`s for the restart latency (each of a different proxy, so that none backs off).
const KILLS: usize = 200;
/// Kills of adopted proxies after the agent restart.
const ADOPTED_KILLS: usize = 50;
/// New services for the change-to-running latency, through the API and through SIGHUP.
const REGISTERS: usize = 20;
const RELOADS: usize = 10;
/// The agents' `--sync-quiescent`: the quiet time left between two changes, so that each is
/// the first after a quiet period and applies at once.
const QUIESCENT: Duration = Duration::from_millis(20);
/// The window over which idle wake-ups are counted.
const IDLE: Duration = Duration::from_secs(10);

/// A proxy that ignores SIGINT without forking: the ignored disposition survives `exec`.
const DEAF: &[&str] = &["/bin/sh", "-c", "trap '' INT; exec /bin/sleep 3600"];

/// Runs the figures of the 1 000-proxy section (`many`) and of the 100-proxy section
/// (`some`), appending rows; returns the errors of the parts that failed.
pub(crate) fn run(
    lab: &Lab,
    report: &mut Report,
    with_many: bool,
    with_some: bool,
    with_scale: bool,
) -> Result<(), String> {
    let empty = lab.subdir("b-config")?;
    let mut idle_agent = lab.agent("b", &empty, &lab.dir.join("b-data"), &[])?;
    idle_agent.wait_healthy(Duration::from_secs(30))?;
    thread::sleep(Duration::from_secs(1));
    let empty_rss = sys::rss_kib(idle_agent.pid())?;
    let mut errors = Vec::new();
    if with_many && let Err(err) = many(lab, &idle_agent, empty_rss, report.begin("many")) {
        report.current().push(Row::failed("1 000-proxy figures", &err));
        errors.push(err);
    }
    if with_scale && let Err(err) = super::scale::run(lab, empty_rss, report.begin("scale")) {
        report.current().push(Row::failed("bring-up at 100, 1 000 and 10 000 proxies", &err));
        errors.push(err);
    }
    if with_some && let Err(err) = some(lab, &idle_agent, report.begin("some")) {
        report.current().push(Row::failed("100-proxy figures", &err));
        errors.push(err);
    }
    idle_agent.leave(Duration::from_secs(30))?;
    if errors.is_empty() { Ok(()) } else { Err(errors.join("; ")) }
}

fn push(rows: &mut Vec<Row>, row: Row) {
    eprintln!("xtask: bench: {}: {} (baseline {}, target {})", row.figure, row.value, row.baseline, row.target);
    rows.push(row);
}

/// A config file of `count` services `<prefix>NNNN`, each with a proxy running `command`.
pub(super) fn write_services(
    dir: &Path,
    file: &str,
    prefix: &str,
    count: usize,
    command: &[&str],
) -> Result<(), String> {
    let command = serde_json::to_string(command).map_err(|err| err.to_string())?;
    let mut text = String::new();
    for index in 0..count {
        text.push_str(&format!(
            "[[service]]\nname = \"{prefix}{index:04}\"\n\n[service.proxy]\ncommand = {command}\nkill_timeout = \"1s\"\n\n"
        ));
    }
    write_atomic(&dir.join(file), &text)
}

/// Writes `path` through a temp name that the agent's loader ignores, then renames it.
fn write_atomic(path: &Path, text: &str) -> Result<(), String> {
    let temp = path.with_extension("partial");
    fs::write(&temp, text).map_err(|err| format!("{}: {err}", temp.display()))?;
    fs::rename(&temp, path).map_err(|err| format!("{}: {err}", path.display()))
}

fn wait_for<T>(what: &str, limit: Duration, mut probe: impl FnMut() -> Option<T>) -> Result<T, String> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = probe() {
            return Ok(value);
        }
        if Instant::now() > deadline {
            return Err(format!("timed out after {limit:?} waiting for {what}"));
        }
        thread::sleep(POLL);
    }
}

/// The raw restart baseline: SIGKILL a child, reap it, spawn it again; and the time of
/// each spawn alone.
fn raw_restarts(lab: &Lab, count: usize) -> Result<(Vec<Duration>, Vec<Duration>), String> {
    let logs = lab.subdir("raw-restart-logs")?;
    let mut flock = Flock::default();
    flock.spawn(SLEEP, &logs, "r")?;
    let (mut restarts, mut spawns) = (Vec::new(), Vec::new());
    for _ in 0..count {
        let mut child = flock.children.pop().ok_or("no child to kill")?;
        sys::signal(child.id(), sys::SIGKILL)?;
        let start = Instant::now();
        child.wait().map_err(|err| format!("wait: {err}"))?;
        let spawn = Instant::now();
        flock.spawn(SLEEP, &logs, "r")?;
        restarts.push(start.elapsed());
        spawns.push(spawn.elapsed());
        thread::sleep(Duration::from_millis(2));
    }
    Ok((restarts, spawns))
}

/// Waits until a child of the agent's keeper (the proxies' parent) has exec'd with
/// `TETHER_PROXY_ID=proxy`; returns its pid and when it was seen in `/proc`.
/// `parent` is the proxies' parent ([`Agent::proxies_parent`]), found before the clock starts.
fn wait_new_proxy(
    agent: &Agent<'_>,
    parent: u32,
    watch: &mut sys::NewProcesses,
    proxy: &str,
) -> Result<(u32, Instant), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let (pid, seen) = loop {
        if let Some(pid) = watch.poll(parent, "TETHER_PROXY_ID", proxy)? {
            break (pid, Instant::now());
        }
        if Instant::now() > deadline {
            return Err(agent.error(&format!("no new process for {proxy}")));
        }
        thread::sleep(POLL);
    };
    Ok((pid, seen))
}

/// Waits until the API shows `proxy` running as `pid`.
fn verify_running(agent: &Agent<'_>, proxy: &str, pid: u32) -> Result<(), String> {
    wait_for(&format!("the API to show {proxy} running as {pid}"), Duration::from_secs(10), || {
        agent.proxy(proxy).ok().filter(|row| row.state == "running" && row.pid == Some(pid))
    })
    .map(drop)
    .map_err(|err| agent.error(&err))
}

/// Restart latencies: until the new process has exec'd, and until its pid file names it.
pub(super) struct Latencies {
    pub(super) process: Vec<Duration>,
    pub(super) pid_file: Vec<Duration>,
}

/// `kill -9` of each proxy in turn, timing until a new process runs in its place.
pub(super) fn restart_latencies(
    agent: &Agent<'_>,
    services: impl Iterator<Item = String>,
) -> Result<Latencies, String> {
    let mut latencies = Latencies { process: Vec::new(), pid_file: Vec::new() };
    let parent = agent.proxies_parent();
    for service in services {
        let proxy = format!("{service}-proxy");
        let old = agent.pid_file(&proxy).ok_or_else(|| agent.error(&format!("no pid file for {proxy}")))?;
        let mut watch = sys::NewProcesses::since_now()?;
        sys::signal(old, sys::SIGKILL)?;
        let start = Instant::now();
        let (pid, seen) = wait_new_proxy(agent, parent, &mut watch, &proxy)?;
        latencies.process.push(seen - start);
        wait_for(&format!("the pid file of {proxy}"), Duration::from_secs(10), || {
            (agent.pid_file(&proxy) == Some(pid)).then(Instant::now)
        })
        .map(|written| latencies.pid_file.push(written - start))
        .map_err(|err| agent.error(&err))?;
        verify_running(agent, &proxy, pid)?;
        // Let the restart's tail work (snapshot) finish, so that samples stay independent.
        thread::sleep(Duration::from_millis(5));
    }
    Ok(latencies)
}

/// Context switches of each of `pids` (all threads) over `window`.
fn idle_switches(pids: &[u32], window: Duration) -> Result<Vec<u64>, String> {
    let before: Vec<_> = pids.iter().map(|pid| sys::context_switches(*pid)).collect::<Result<_, _>>()?;
    thread::sleep(window);
    let after: Vec<_> = pids.iter().map(|pid| sys::context_switches(*pid)).collect::<Result<_, _>>()?;
    Ok(before
        .iter()
        .zip(&after)
        .map(|(before, after)| {
            let (switches, exited) = sys::switches_between(before, after);
            if exited > 0 {
                eprintln!("xtask: bench: {exited} thread(s) exited during the idle window: a lower bound");
            }
            switches
        })
        .collect())
}

fn kib(value: u64) -> String {
    #[allow(clippy::cast_precision_loss)]
    let mib = value as f64 / 1024.0;
    format!("{mib:.1} MiB")
}

/// The figures with 1 000 proxies, on one agent and its successor.
fn many(lab: &Lab, idle_agent: &Agent<'_>, empty_rss: u64, rows: &mut Vec<Row>) -> Result<(), String> {
    let config = lab.subdir("a-config")?;
    write_services(&config, "services.toml", "s", MANY, SLEEP)?;
    let flags = ["--allow-api-commands"];

    // Bring-up, best of two rounds each, the raw baseline first.
    let (mut raw_best, mut agent_best) = (Duration::MAX, Duration::MAX);
    let mut kept = None;
    for round in 0..2 {
        raw_best = raw_best.min(raw_bring_up(lab, &format!("raw{round}-logs"), MANY)?);
        let data = lab.dir.join(format!("a{round}-data"));
        let start = Instant::now();
        let mut agent = lab.agent(&format!("a{round}"), &config, &data, &flags)?;
        let (_, seen) = agent.wait_running(MANY, Duration::from_secs(120))?;
        agent_best = agent_best.min(seen - start);
        if round == 0 {
            agent.leave(Duration::from_secs(60))?;
        } else {
            kept = Some(agent);
        }
    }
    let mut agent = kept.ok_or("no agent")?;
    let bring_up_ratio = agent_best.as_secs_f64() / raw_best.as_secs_f64();
    push(
        rows,
        Row::new(
            "bring-up: agent start until 1 000 `sleep` proxies are `running` (best of 2)",
            format!("raw spawn of 1 000: {}", secs(raw_best)),
            secs(agent_best),
            ratio(agent_best.as_secs_f64(), raw_best.as_secs_f64()),
            "≤ 1.3",
            met(bring_up_ratio <= 1.3),
        ),
    );

    // Memory per proxy.
    thread::sleep(Duration::from_secs(1));
    let many_rss = agent.rss_with_keeper_kib()?;
    #[allow(clippy::cast_precision_loss)]
    let per_proxy = (many_rss.saturating_sub(empty_rss)) as f64 / MANY as f64;
    push(
        rows,
        Row::new(
            "agent RSS and keeper private memory per managed proxy, N = 1 000",
            format!("agent with 0 proxies (no keeper yet): {}", kib(empty_rss)),
            format!("{per_proxy:.1} KiB (agent and keeper: {})", kib(many_rss)),
            "—".into(),
            "≤ 16 KiB",
            met(per_proxy <= 16.0),
        ),
    );

    // Restart latency after kill -9.
    let (raw_restart, raw_spawn) = raw_restarts(lab, KILLS)?;
    let latencies = restart_latencies(&agent, (0..KILLS).map(|index| format!("s{index:04}")))?;
    let raw_median = median(&raw_restart);
    for (how, samples) in [("new process exec'd", &latencies.process), ("pid file written", &latencies.pid_file)] {
        let (value, raw) = (median(samples), raw_median);
        push(
            rows,
            Row::new(
                &format!("restart latency after `kill -9` until {how}, median (200 proxies of 1 000)"),
                format!("raw kill, reap, spawn: {}", ms(raw)),
                ms(value),
                ratio(value.as_secs_f64(), raw.as_secs_f64()),
                "< 5 ms",
                met(value < Duration::from_millis(5)),
            ),
        );
        let (value, raw) = (percentile(samples, 99.0), percentile(&raw_restart, 99.0));
        push(
            rows,
            Row::new(
                &format!("restart latency after `kill -9` until {how}, p99"),
                format!("raw: {}", ms(raw)),
                ms(value),
                ratio(value.as_secs_f64(), raw.as_secs_f64()),
                "—",
                Met::Info,
            ),
        );
    }
    let (before, _) = agent.wait_running(MANY, Duration::from_secs(30))?;

    // Agent restart: SIGTERM, a new agent, all adopted.
    let data = agent.data.clone();
    let stop = Instant::now();
    agent.terminate(Duration::from_secs(60))?;
    let stopped = stop.elapsed();
    let lost = before.iter().filter(|row| !row.pid.is_some_and(sys::alive)).count();
    if lost > 0 {
        return Err(format!("{lost} proxies died with the agent's SIGTERM"));
    }
    drop(agent);
    let start = Instant::now();
    let mut agent = lab.agent("a2", &config, &data, &flags)?;
    let (after, seen) = agent.wait_running(MANY, Duration::from_secs(120))?;
    let adopted_in = seen - start;
    let old: BTreeMap<&str, Option<u32>> = before.iter().map(|row| (row.id.as_str(), row.pid)).collect();
    let restarted = after.iter().filter(|row| old.get(row.id.as_str()).copied().flatten() != row.pid).count();
    push(
        rows,
        Row::new(
            "agent restart with 1 000 running: new agent start until all `running` with the same pids",
            format!("bring-up of 1 000: {}", secs(agent_best)),
            format!("{} (SIGTERM to exit: {})", secs(adopted_in), secs(stopped)),
            ratio(adopted_in.as_secs_f64(), agent_best.as_secs_f64()),
            "—",
            Met::Info,
        ),
    );
    push(
        rows,
        Row::new(
            "agent restart with 1 000 running: proxies restarted",
            "—".into(),
            restarted.to_string(),
            "—".into(),
            "0",
            met(restarted == 0),
        ),
    );

    // Restart latency of adopted proxies (watched through pidfds, not as children).
    let latencies = restart_latencies(&agent, (KILLS..KILLS + ADOPTED_KILLS).map(|index| format!("s{index:04}")))?;
    let adopted_median = median(&latencies.process);
    push(
        rows,
        Row::new(
            "restart latency after `kill -9` of an adopted proxy until new process exec'd, median (50)",
            format!("raw kill, reap, spawn: {}", ms(raw_median)),
            ms(adopted_median),
            ratio(adopted_median.as_secs_f64(), raw_median.as_secs_f64()),
            "< 5 ms",
            met(adopted_median < Duration::from_millis(5)),
        ),
    );
    let (after, _) = agent.wait_running(MANY, Duration::from_secs(30))?;

    blocking_queries(&agent, idle_agent, &after, rows)?;
    change_to_running(&agent, &config, median(&raw_spawn), rows)?;
    agent.leave(Duration::from_secs(60))
}

/// 1 000 blocking queries, one per proxy, held open while the agent idles.
fn blocking_queries(
    agent: &Agent<'_>,
    idle_agent: &Agent<'_>,
    proxies: &[ProxyRow],
    rows: &mut Vec<Row>,
) -> Result<(), String> {
    let mut queries = Vec::new();
    for row in proxies {
        let pid = row.pid.ok_or_else(|| agent.error(&format!("{} has no pid", row.id)))?;
        let token = sys::environ_var(pid, "TETHER_PROXY_TOKEN")
            .ok_or_else(|| format!("no TETHER_PROXY_TOKEN in the environment of {pid} ({})", row.id))?;
        let path = format!("/v1/agent/proxy/{}/config", row.id);
        let response = request(&agent.socket, "GET", &path, &[("X-Tether-Proxy-Token", &token)], None)?;
        if response.status != 200 {
            return Err(agent.error(&format!("GET {path}: {}", response.status)));
        }
        let body: serde_json::Value = serde_json::from_slice(&response.body).map_err(|err| err.to_string())?;
        let index = body["index"].as_u64().ok_or_else(|| agent.error(&format!("GET {path}: no index")))?;
        queries.push((format!("{path}?index={index}&wait=5m"), token));
    }
    thread::sleep(Duration::from_secs(1));
    let idle = idle_switches(&[agent.pid(), idle_agent.pid()], IDLE)?;
    let rss_before = sys::rss_kib(agent.pid())?;
    let mut streams = Vec::new();
    for (path, token) in &queries {
        let mut stream = UnixStream::connect(&agent.socket).map_err(|err| format!("connect: {err}"))?;
        send(&mut stream, "GET", path, &[("X-Tether-Proxy-Token", token)], None)
            .map_err(|err| format!("blocking query: {err}"))?;
        streams.push(stream);
    }
    thread::sleep(Duration::from_secs(2));
    let rss_after = sys::rss_kib(agent.pid())?;
    let busy = idle_switches(&[agent.pid()], IDLE)?;
    let mut answered = 0;
    for stream in &mut streams {
        stream.set_nonblocking(true).map_err(|err| err.to_string())?;
        match stream.read(&mut [0; 1]) {
            Err(err) if err.kind() == ErrorKind::WouldBlock => {}
            _ => answered += 1,
        }
    }
    drop(streams);
    if answered > 0 {
        return Err(agent.error(&format!("{answered} of {MANY} blocking queries answered before their wait")));
    }
    push(
        rows,
        Row::new(
            "idle context switches over 10 s, 1 000 adopted proxies",
            format!("agent with 0 proxies: {}", idle[1]),
            idle[0].to_string(),
            "—".into(),
            "≤ 1",
            met(idle[0] <= 1),
        ),
    );
    push(
        rows,
        Row::new(
            "1 000 idle blocking queries: agent wake-ups over 10 s",
            format!("same agent without queries: {}", idle[0]),
            busy[0].to_string(),
            "—".into(),
            "0",
            met(busy[0] == 0),
        ),
    );
    #[allow(clippy::cast_precision_loss)]
    let per_query = rss_after.saturating_sub(rss_before) as f64 / MANY as f64;
    push(
        rows,
        Row::new(
            "1 000 idle blocking queries: agent RSS increase",
            format!("agent before: {}", kib(rss_before)),
            format!("+{} KiB ({per_query:.1} KiB per query)", rss_after.saturating_sub(rss_before)),
            ratio(
                f64::from(u32::try_from(rss_after).unwrap_or(u32::MAX)),
                f64::from(u32::try_from(rss_before).unwrap_or(u32::MAX)),
            ),
            "—",
            Met::Info,
        ),
    );
    Ok(())
}

/// One new service at a time, through the register API and through a new config file and
/// SIGHUP, each after a quiet period, timed until its pid file names a live process.
fn change_to_running(agent: &Agent<'_>, config: &Path, raw_spawn: Duration, rows: &mut Vec<Row>) -> Result<(), String> {
    let parent = agent.proxies_parent();
    let wait_started = |proxy: &str, watch: &mut sys::NewProcesses, start: Instant| {
        let (pid, seen) = wait_new_proxy(agent, parent, watch, proxy)?;
        verify_running(agent, proxy, pid)?;
        Ok::<_, String>(seen - start)
    };
    let command = serde_json::to_string(SLEEP).map_err(|err| err.to_string())?;
    let mut registered = Vec::new();
    for index in 0..REGISTERS {
        let name = format!("api{index:02}");
        let body = format!(r#"{{"name":"{name}","proxy":{{"command":{command},"kill_timeout":"1s"}}}}"#);
        let mut watch = sys::NewProcesses::since_now()?;
        let start = Instant::now();
        agent.register(&body)?;
        registered.push(wait_started(&format!("{name}-proxy"), &mut watch, start)?);
        thread::sleep(QUIESCENT * 2);
    }
    let mut reloaded = Vec::new();
    for index in 0..RELOADS {
        let name = format!("hup{index:02}");
        write_services(config, &format!("{name}.toml"), &name, 1, SLEEP)?;
        let mut watch = sys::NewProcesses::since_now()?;
        let start = Instant::now();
        agent.signal(sys::SIGHUP)?;
        reloaded.push(wait_started(&format!("{name}0000-proxy"), &mut watch, start)?);
        thread::sleep(QUIESCENT * 2);
    }
    // The register API's target is the tighter: its change is one service, and durable
    // before the proxy may start.
    let figures: [Figure<'_>; 2] = [
        ("`PUT /v1/agent/service/register`", &registered, "≤ 3 ms", |value| value <= Duration::from_millis(3)),
        ("new config file + SIGHUP (1 000 services reloaded)", &reloaded, "< 5 ms", |value| {
            value < Duration::from_millis(5)
        }),
    ];
    for (how, samples, target, within) in figures {
        let value = median(samples);
        push(
            rows,
            Row::new(
                &format!("change-to-running, one new service via {how}, median"),
                format!("raw spawn of one: {}", ms(raw_spawn)),
                format!("{} (p99 {})", ms(value), ms(percentile(samples, 99.0))),
                ratio(value.as_secs_f64(), raw_spawn.as_secs_f64()),
                target,
                met(within(value)),
            ),
        );
    }
    Ok(())
}

/// A change-to-running figure: how, its samples, its target, and whether a median meets it.
type Figure<'a> = (&'a str, &'a Vec<Duration>, &'a str, fn(Duration) -> bool);

/// Whether every pid runs `sleep` (so a `DEAF` shell has set its trap and exec'd).
fn all_sleeping(pids: &[u32]) -> bool {
    pids.iter().all(|pid| fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|comm| comm.trim() == "sleep"))
}

/// The raw parallel-stop baseline: SIGINT to every group, up to 1 s for exits, SIGKILL.
fn raw_parallel_stop(lab: &Lab, count: usize) -> Result<Duration, String> {
    let logs = lab.subdir("raw-stop-logs")?;
    let mut flock = Flock::default();
    let mut pids = Vec::new();
    for index in 0..count {
        pids.push(flock.spawn(DEAF, &logs, &format!("d{index:03}"))?);
    }
    wait_for("the raw deaf proxies to exec", Duration::from_secs(30), || all_sleeping(&pids).then_some(()))?;
    let start = Instant::now();
    for pid in &pids {
        sys::signal_group(*pid, sys::SIGINT);
    }
    let deadline = start + Duration::from_secs(1);
    loop {
        flock.children.retain_mut(|child| !matches!(child.try_wait(), Ok(Some(_))));
        if flock.children.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            flock.kill_all();
            break;
        }
        thread::sleep(Duration::from_millis(1));
    }
    Ok(start.elapsed())
}

/// The figures with 100 proxies that ignore SIGINT.
fn some(lab: &Lab, idle_agent: &Agent<'_>, rows: &mut Vec<Row>) -> Result<(), String> {
    let config = lab.subdir("c-config")?;
    write_services(&config, "deaf.toml", "d", SOME, DEAF)?;
    let mut agent = lab.agent("c", &config, &lab.dir.join("c-data"), &[])?;
    let (proxies, _) = agent.wait_running(SOME, Duration::from_secs(60))?;
    let pids: Vec<u32> = proxies.iter().filter_map(|row| row.pid).collect();
    wait_for("the deaf proxies to exec", Duration::from_secs(30), || all_sleeping(&pids).then_some(()))?;
    thread::sleep(Duration::from_secs(1));
    let idle = idle_switches(&[agent.pid(), idle_agent.pid()], IDLE)?;
    push(
        rows,
        Row::new(
            "idle context switches over 10 s, 100 proxies",
            format!("agent with 0 proxies: {}", idle[1]),
            idle[0].to_string(),
            "—".into(),
            "≤ 1",
            met(idle[0] <= 1),
        ),
    );
    let raw = raw_parallel_stop(lab, SOME)?;
    let start = Instant::now();
    agent.leave(Duration::from_secs(30))?;
    wait_for("the proxies to be gone", Duration::from_secs(30), || {
        pids.iter().all(|pid| !sys::alive(*pid)).then_some(())
    })?;
    let took = start.elapsed();
    push(
        rows,
        Row::new(
            "parallel stop: `tether leave`, 100 proxies ignoring SIGINT, kill_timeout 1 s",
            format!("raw SIGINT, 1 s, SIGKILL: {}", secs(raw)),
            secs(took),
            ratio(took.as_secs_f64(), raw.as_secs_f64()),
            "≤ 1.5 s",
            met(took <= Duration::from_millis(1_500)),
        ),
    );
    Ok(())
}
