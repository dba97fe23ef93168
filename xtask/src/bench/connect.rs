//! Connect's certificates at scale: the issuance of a leaf for each of 1 000 services at the
//! agent's start (the agent logs how long its issuing loop took), and the bring-up of those
//! 1 000 `sleep` proxies with `[connect]` against the same 1 000 without it, in the same run.
//! Issuing a leaf and renewing one are the same work (a new P-256 key, a signature); the
//! renewals are also measured as they happen, as the agent's CPU time per renewal of leaves
//! that live 10 s, against the same agent's idle CPU with leaves that live 72 h.
//!
//! Then the mesh's data path: two built-in proxies (web's upstream listener, out over mutual
//! TLS to db's public listener, in front of a sink or an echo server of this process),
//! against a direct connection and against the same two proxies in plaintext (a second agent
//! without `[connect]`, web's proxy forwarding to db's), in the same run: bulk throughput,
//! and the set-up of a new connection until its first byte comes back.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread;

use super::builtin_proxy::{BULK, BULK_ROUNDS, Upstream, bulk, echo, free_port, gib_per_second, median_f64, sink, us};
use super::lab::{Agent, Lab, request};
use super::report::{Met, Row, median, met, ratio, secs};
use super::sys;

const COUNT: usize = 1_000;
const ROUNDS: usize = 2;

/// The target of the issuance at start.
const ISSUE_TARGET: Duration = Duration::from_secs(2);

/// Runs the section, appending its rows.
pub(crate) fn run(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    let plain = lab.subdir("connect-plain-config")?;
    write_config(&plain, false)?;
    let mesh = lab.subdir("connect-mesh-config")?;
    write_config(&mesh, true)?;
    let (mut plain_best, mut mesh_best, mut issue_best) = (Duration::MAX, Duration::MAX, Duration::MAX);
    for round in 0..ROUNDS {
        for (name, config) in [("plain", &plain), ("mesh", &mesh)] {
            let data = lab.dir.join(format!("connect-{name}-{round}-data"));
            let start = Instant::now();
            let mut agent = lab.agent(&format!("connect-{name}-{round}"), config, &data, &[])?;
            let (_, seen) = agent.wait_running(COUNT, Duration::from_secs(300))?;
            let up = seen - start;
            if name == "mesh" {
                let issued = issue_time(&agent.log_text()).ok_or_else(|| agent.error("no issuance in the log"))?;
                eprintln!("xtask: bench: connect, round {round}: {COUNT} leaves issued in {}", secs(issued));
                issue_best = issue_best.min(issued);
                mesh_best = mesh_best.min(up);
            } else {
                plain_best = plain_best.min(up);
            }
            eprintln!("xtask: bench: connect, {name}, round {round}: bring-up {}", secs(up));
            agent.leave(Duration::from_secs(300))?;
        }
    }
    #[allow(clippy::cast_precision_loss)]
    let per_leaf_us = issue_best.as_secs_f64() * 1e6 / COUNT as f64;
    rows.push(Row::new(
        &format!("connect: issuance of {COUNT} leaf certificates at agent start (best of {ROUNDS})"),
        format!("bring-up of {COUNT} `sleep` proxies without [connect]: {}", secs(plain_best)),
        format!("{} ({per_leaf_us:.0} µs per leaf, the cost of a renewal)", secs(issue_best)),
        ratio(issue_best.as_secs_f64(), plain_best.as_secs_f64()),
        &format!("≤ {} s", ISSUE_TARGET.as_secs()),
        met(issue_best <= ISSUE_TARGET),
    ));
    rows.push(Row::new(
        &format!("connect: bring-up of {COUNT} `sleep` proxies with [connect] (best of {ROUNDS})"),
        format!("without [connect]: {}", secs(plain_best)),
        secs(mesh_best),
        ratio(mesh_best.as_secs_f64(), plain_best.as_secs_f64()),
        "—",
        Met::Info,
    ));
    renewals(lab, rows)?;
    data_path(lab, rows)
}

/// Services whose leaves are renewed while the agent's CPU time is measured.
const RENEWING: usize = 200;
/// The window over which renewals are counted.
const RENEWAL_WINDOW: Duration = Duration::from_secs(20);

/// The agent's CPU time per renewal: [`RENEWING`] services with leaves of 10 s (renewed every
/// 6 to 8 s) over [`RENEWAL_WINDOW`], less what the same agent spends idle with leaves of 72 h.
fn renewals(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    let mut idle_per_second = 0.0;
    let mut renewing = None;
    for ttl in ["72h", "10s"] {
        let config = lab.subdir(&format!("connect-renew-{ttl}-config"))?;
        write_services(&config, RENEWING, Some(ttl))?;
        let data = lab.dir.join(format!("connect-renew-{ttl}-data"));
        let mut agent = lab.agent(&format!("connect-renew-{ttl}"), &config, &data, &[])?;
        agent.wait_running(RENEWING, Duration::from_secs(120))?;
        // Past the first issuance and the bring-up's own work.
        thread::sleep(Duration::from_secs(2));
        let (cpu_before, renewed_before) = (sys::process_cpu_time(agent.pid())?, renewed(&agent)?);
        let start = Instant::now();
        thread::sleep(RENEWAL_WINDOW);
        let (cpu_after, renewed_after) = (sys::process_cpu_time(agent.pid())?, renewed(&agent)?);
        let (cpu, window) = ((cpu_after - cpu_before).as_secs_f64(), start.elapsed().as_secs_f64());
        agent.leave(Duration::from_secs(120))?;
        if ttl == "72h" {
            idle_per_second = cpu / window;
        } else {
            renewing = Some((cpu - idle_per_second * window, renewed_after.saturating_sub(renewed_before)));
        }
    }
    let Some((cpu, count)) = renewing.filter(|(_, count)| *count > 0) else {
        return Err("no leaf was renewed within the window".to_owned());
    };
    #[allow(clippy::cast_precision_loss)]
    let per_renewal_us = cpu.max(0.0) * 1e6 / count as f64;
    eprintln!("xtask: bench: connect: {count} renewals, {cpu:.3} s of CPU above idle");
    rows.push(Row::new(
        &format!(
            "connect: agent CPU per leaf renewal ({RENEWING} services, leaves of 10 s, {count} renewals in {} s)",
            RENEWAL_WINDOW.as_secs()
        ),
        format!("idle with leaves of 72 h: {:.1} ms of CPU per second", idle_per_second * 1e3),
        format!("{per_renewal_us:.0} µs"),
        "—".to_owned(),
        "—",
        Met::Info,
    ));
    Ok(())
}

/// How many `leaf-renewed` events the agent's history holds.
fn renewed(agent: &Agent<'_>) -> Result<usize, String> {
    let response = request(&agent.socket, "GET", "/v1/agent/history", &[], None)?;
    if response.status != 200 {
        return Err(agent.error(&format!("GET /v1/agent/history: {}", response.status)));
    }
    let events: Vec<serde_json::Value> =
        serde_json::from_slice(&response.body).map_err(|err| agent.error(&format!("the history: {err}")))?;
    Ok(events.iter().filter(|event| event["event"] == "leaf-renewed").count())
}

/// New connections per kind in the set-up figure, after a tenth as many of warm-up.
const SETUPS: usize = 500;
/// The most the set-up of a new mutual TLS connection may add to the plaintext proxies'.
const SETUP_TARGET: Duration = Duration::from_millis(1);

/// Where the data-path figures send their bytes: the sink and the echo server, each directly
/// and through the plaintext and the mutual TLS pair of proxies.
struct Paths {
    sink: [SocketAddr; 3],
    echo: [SocketAddr; 3],
}

/// Bulk throughput and connection set-up through two built-in proxies over mutual TLS,
/// against direct loopback and against the same two proxies in plaintext.
fn data_path(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    let (sink_upstream, echo_upstream) = (Upstream::start(sink)?, Upstream::start(echo)?);
    let ports = |count: usize| (0..count).map(|_| free_port()).collect::<Result<Vec<u16>, String>>();
    let mesh_ports = ports(5)?;
    let mesh_config = lab.subdir("connect-path-mesh-config")?;
    let mesh_text = format!(
        "[connect]\ntrust_domain = \"bench.example.org\"\n\n[connect.ca]\nprovider = \"dev\"\n\n\
         [[intention]]\nsource = \"web\"\ndestination = \"*\"\naction = \"allow\"\n\n{}{}{}",
        builtin("sink", Some(sink_upstream.addr.port()), &format!("bind_port = {}", mesh_ports[0])),
        builtin("echo", Some(echo_upstream.addr.port()), &format!("bind_port = {}", mesh_ports[1])),
        builtin(
            "web",
            None,
            &format!(
                "bind_port = {}, upstreams = [{{ destination_name = \"sink\", local_bind_port = {} }}, \
                 {{ destination_name = \"echo\", local_bind_port = {} }}]",
                mesh_ports[2], mesh_ports[3], mesh_ports[4]
            ),
        ),
    );
    write_file(&mesh_config.join("mesh.toml"), &mesh_text)?;
    let plain_ports = ports(4)?;
    let plain_config = lab.subdir("connect-path-plain-config")?;
    let local = |bind: u16, port: u16| format!("bind_port = {bind}, local_service_address = \"127.0.0.1:{port}\"");
    let plain_text = format!(
        "{}{}{}{}",
        builtin("sink", Some(sink_upstream.addr.port()), &format!("bind_port = {}", plain_ports[0])),
        builtin("echo", Some(echo_upstream.addr.port()), &format!("bind_port = {}", plain_ports[1])),
        builtin("web-sink", None, &local(plain_ports[2], plain_ports[0])),
        builtin("web-echo", None, &local(plain_ports[3], plain_ports[1])),
    );
    write_file(&plain_config.join("plain.toml"), &plain_text)?;
    let mut mesh = lab.agent("connect-path-mesh", &mesh_config, &lab.dir.join("connect-path-mesh-data"), &[])?;
    let mut plain = lab.agent("connect-path-plain", &plain_config, &lab.dir.join("connect-path-plain-data"), &[])?;
    mesh.wait_running(3, Duration::from_secs(60))?;
    plain.wait_running(4, Duration::from_secs(60))?;
    let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    let paths = Paths {
        sink: [sink_upstream.addr, at(plain_ports[2]), at(mesh_ports[3])],
        echo: [echo_upstream.addr, at(plain_ports[3]), at(mesh_ports[4])],
    };
    // The mesh is up once a byte comes back through each path (leaves, roots, intentions
    // and the upstream's instances known to both proxies).
    let deadline = Instant::now() + Duration::from_secs(30);
    for addr in paths.echo {
        while first_byte(addr).is_err() {
            if Instant::now() > deadline {
                return Err(mesh.error(&format!("nothing comes back through {addr}")));
            }
            thread::sleep(Duration::from_millis(10));
        }
    }
    let proxy_pids = ["web-proxy", "sink-proxy"]
        .into_iter()
        .map(|id| mesh.proxy(id)?.pid.ok_or_else(|| mesh.error(&format!("{id} has no pid"))))
        .collect::<Result<Vec<u32>, String>>()?;
    throughput(&paths, &proxy_pids, rows)?;
    set_up(&paths, rows)?;
    mesh.leave(Duration::from_secs(30))?;
    plain.leave(Duration::from_secs(30))
}

/// Bulk transfers of 1 GiB, direct, plaintext and mutual TLS alternating round by round.
fn throughput(paths: &Paths, mesh_pids: &[u32], rows: &mut Vec<Row>) -> Result<(), String> {
    for addr in paths.sink {
        bulk(addr, BULK / 16)?;
    }
    let (mut rates, mut mesh_cpu) = ([Vec::new(), Vec::new(), Vec::new()], Vec::new());
    let (mut of_direct, mut of_plain) = (Vec::new(), Vec::new());
    let cpu_of = |pids: &[u32]| pids.iter().map(|pid| sys::cpu_time(*pid)).sum::<Result<Duration, String>>();
    for _ in 0..BULK_ROUNDS {
        let mut round = [0.0; 3];
        for (kind, addr) in paths.sink.iter().enumerate() {
            let before = cpu_of(mesh_pids)?;
            round[kind] = gib_per_second(bulk(*addr, BULK)?);
            if kind == 2 {
                mesh_cpu.push(cpu_of(mesh_pids)? - before);
            }
            rates[kind].push(round[kind]);
        }
        eprintln!(
            "xtask: bench: connect: bulk direct {:.2}, plaintext proxies {:.2}, mutual TLS {:.2} GiB/s",
            round[0], round[1], round[2]
        );
        of_direct.push(round[2] / round[0]);
        of_plain.push(round[2] / round[1]);
    }
    let [direct, plain, mesh] = rates.map(|rates| median_f64(&rates));
    let (of_direct, of_plain) = (median_f64(&of_direct), median_f64(&of_plain));
    rows.push(Row::new(
        &format!("connect: bulk throughput through two built-in proxies over mutual TLS, 1 GiB, median of {BULK_ROUNDS} alternating rounds"),
        format!("direct: {direct:.2} GiB/s"),
        format!("{mesh:.2} GiB/s"),
        format!("{of_direct:.2}"),
        "≥ 0.5",
        met(of_direct >= 0.5),
    ));
    rows.push(Row::new(
        "connect: bulk throughput over mutual TLS against the same two proxies in plaintext",
        format!("plaintext (spliced): {plain:.2} GiB/s ({:.2} of direct)", plain / direct),
        format!("{mesh:.2} GiB/s"),
        format!("{of_plain:.2}"),
        "—",
        Met::Info,
    ));
    rows.push(Row::new(
        "connect: CPU time (user + system) of the two proxies per GiB over mutual TLS, median",
        "—".to_owned(),
        format!("{:.0} ms", median(&mesh_cpu).as_secs_f64() * 1e3),
        "—".to_owned(),
        "—",
        Met::Info,
    ));
    Ok(())
}

/// New connections until their first byte comes back, direct, plaintext and mutual TLS
/// alternating connection by connection.
fn set_up(paths: &Paths, rows: &mut Vec<Row>) -> Result<(), String> {
    let mut samples = [Vec::new(), Vec::new(), Vec::new()];
    for index in 0..SETUPS + SETUPS / 10 {
        for (kind, addr) in paths.echo.iter().enumerate() {
            let took = first_byte(*addr)?;
            if index >= SETUPS / 10 {
                samples[kind].push(took);
            }
        }
    }
    let [direct, plain, mesh] = samples.map(|samples| median(&samples));
    rows.push(Row::new(
        &format!("connect: new connection through two built-in proxies over mutual TLS until its first byte echoes, p50 ({SETUPS})"),
        format!("plaintext proxies: {} (direct: {})", us(plain), us(direct)),
        format!("{} (+{})", us(mesh), us(mesh.saturating_sub(plain))),
        ratio(mesh.as_secs_f64(), plain.as_secs_f64()),
        "≤ plaintext + 1 ms",
        met(mesh <= plain + SETUP_TARGET),
    ));
    Ok(())
}

/// Connects to `addr`, sends one byte and waits for it to come back: how long that took.
fn first_byte(addr: SocketAddr) -> Result<Duration, String> {
    let fail = |err: std::io::Error| format!("a new connection through {addr}: {err}");
    let start = Instant::now();
    let mut stream = TcpStream::connect(addr).map_err(fail)?;
    stream.set_nodelay(true).map_err(fail)?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(fail)?;
    stream.write_all(b"x").map_err(fail)?;
    let mut answer = [0_u8; 1];
    stream.read_exact(&mut answer).map_err(fail)?;
    Ok(start.elapsed())
}

/// A service with a built-in proxy whose `config` is `config`.
fn builtin(name: &str, port: Option<u16>, config: &str) -> String {
    let port = port.map(|port| format!("port = {port}\n")).unwrap_or_default();
    format!(
        "[[service]]\nname = \"{name}\"\n{port}\n[service.proxy]\nkill_timeout = \"2s\"\nconfig = {{ {config} }}\n\n"
    )
}

/// The `elapsed_ms` of the agent's `connect: leaf certificates issued` line.
fn issue_time(log: &str) -> Option<Duration> {
    let line = log.lines().find(|line| line.contains("leaf certificates issued"))?;
    let rest = &line[line.find("elapsed_ms")? + "elapsed_ms".len()..];
    let digits: String =
        rest.trim_start_matches(['"', ':', '=', ' ']).chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok().map(Duration::from_millis)
}

fn write_config(dir: &Path, mesh: bool) -> Result<(), String> {
    write_services(dir, COUNT, mesh.then_some("72h"))
}

/// `count` services with a `sleep` proxy each, with `[connect]` and leaves of `ttl` if given.
fn write_services(dir: &Path, count: usize, ttl: Option<&str>) -> Result<(), String> {
    let mut text = String::new();
    if let Some(ttl) = ttl {
        text.push_str(&format!(
            "[connect]\ntrust_domain = \"bench.example.org\"\n\n[connect.ca]\nprovider = \"dev\"\nleaf_ttl = \"{ttl}\"\n\n"
        ));
    }
    for index in 0..count {
        text.push_str(&format!(
            "[[service]]\nname = \"s{index:04}\"\n\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\nkill_timeout = \"1s\"\n\n"
        ));
    }
    write_file(&dir.join("services.toml"), &text)
}

/// Writes `text` to `path` through a temporary file, so that the agent never reads half.
fn write_file(path: &Path, text: &str) -> Result<(), String> {
    let temp = path.with_extension("partial");
    fs::write(&temp, text).map_err(|err| format!("{}: {err}", temp.display()))?;
    fs::rename(&temp, path).map_err(|err| format!("{}: {err}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_issuance_time_is_read_from_either_log_format() {
        let text = "2026-01-01T00:00:00Z  INFO tether::connect: connect: leaf certificates issued leaves=1000 elapsed_ms=312 trust_domain=x";
        assert_eq!(issue_time(text), Some(Duration::from_millis(312)));
        let json =
            r#"{"message":"connect: leaf certificates issued","leaves":1000,"elapsed_ms":45,"trust_domain":"x"}"#;
        assert_eq!(issue_time(json), Some(Duration::from_millis(45)));
        assert_eq!(issue_time("nothing here"), None);
    }
}
