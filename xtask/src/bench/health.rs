//! The cost of health checks: the agent's CPU with 1 000 proxies each probed by a 1 s `tcp`
//! liveness check, against the same 1 000 proxies without checks, in the same run.
//!
//! Both agents run `sleep` proxies; the probes connect to one listener of this process,
//! which accepts and counts every connection, so that the figure also shows that the
//! probes ran.

use std::fs;
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::lab::Lab;
use super::report::{Row, met};
use super::sys;

/// Proxies per agent.
const PROXIES: usize = 1_000;
/// The window over which CPU time is measured.
const WINDOW: Duration = Duration::from_secs(10);
/// Time for the probes to spread over their interval once every proxy runs.
const SETTLE: Duration = Duration::from_secs(3);

/// Runs the section, appending its rows.
pub(crate) fn run(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|err| format!("probe target: {err}"))?;
    let target = listener.local_addr().map_err(|err| err.to_string())?;
    let accepted = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&accepted);
    thread::spawn(move || {
        for stream in listener.incoming() {
            drop(stream);
            counter.fetch_add(1, Ordering::Relaxed);
        }
    });

    let raw = raw_connects(&target.to_string())?;
    let plain = cpu_share(lab, "h-plain", None)?;
    let before = accepted.load(Ordering::Relaxed);
    let probed = cpu_share(lab, "h-probed", Some(&target.to_string()))?;
    let probes = accepted.load(Ordering::Relaxed) - before;
    #[allow(clippy::cast_precision_loss)]
    let per_second = probes as f64 / (WINDOW + SETTLE).as_secs_f64();
    let row = Row::new(
        "agent CPU, 1 000 proxies each with a 1 s tcp liveness probe (share of one core)",
        format!(
            "1 000 proxies without probes: {:.2} %; a plain loop of 1 000 connects/s: {:.2} %",
            plain * 100.0,
            raw * 100.0
        ),
        format!("{:.2} % ({per_second:.0} probes/s seen by the target)", probed * 100.0),
        super::report::ratio(probed, raw),
        "≤ 5 %",
        met(probed <= 0.05 && per_second >= 0.8 * PROXIES as f64),
    );
    eprintln!("xtask: bench: {}: {} (baseline {})", row.figure, row.value, row.baseline);
    rows.push(row);
    Ok(())
}

/// The CPU share of this thread connecting to `target` (and resetting the connection, as a
/// tcp probe does) [`PROXIES`] times a second for [`WINDOW`]: the cost of the probes
/// themselves, without an agent.
fn raw_connects(target: &str) -> Result<f64, String> {
    let address: std::net::SocketAddr = target.parse().map_err(|err| format!("{target}: {err}"))?;
    let every = WINDOW / u32::try_from(PROXIES).unwrap_or(u32::MAX) / u32::try_from(WINDOW.as_secs()).unwrap_or(1);
    let before = sys::thread_cpu_time();
    let start = Instant::now();
    let mut next = start;
    while start.elapsed() < WINDOW {
        let stream = std::net::TcpStream::connect(address).map_err(|err| format!("connect {target}: {err}"))?;
        let linger = nix::libc::linger { l_onoff: 1, l_linger: 0 };
        let _best_effort = nix::sys::socket::setsockopt(&stream, nix::sys::socket::sockopt::Linger, &linger);
        drop(stream);
        next += every;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
    }
    Ok((sys::thread_cpu_time() - before).as_secs_f64() / start.elapsed().as_secs_f64())
}

/// The agent's CPU time over [`WINDOW`], as a share of one core, with [`PROXIES`] `sleep`
/// proxies, each with a `tcp` liveness probe of `target` when there is one.
fn cpu_share(lab: &Lab, name: &str, target: Option<&str>) -> Result<f64, String> {
    let config = lab.subdir(&format!("{name}-config"))?;
    write_config(&config, target)?;
    let mut agent = lab.agent(name, &config, &lab.dir.join(format!("{name}-data")), &[])?;
    agent.wait_running(PROXIES, Duration::from_secs(120))?;
    thread::sleep(SETTLE);
    let before = sys::process_cpu_time(agent.pid())?;
    let start = Instant::now();
    thread::sleep(WINDOW);
    let used = sys::process_cpu_time(agent.pid())?.saturating_sub(before);
    let share = used.as_secs_f64() / start.elapsed().as_secs_f64();
    agent.leave(Duration::from_secs(60))?;
    Ok(share)
}

fn write_config(dir: &Path, target: Option<&str>) -> Result<(), String> {
    let mut text = String::new();
    for index in 0..PROXIES {
        text.push_str(&format!(
            "[[service]]\nname = \"h{index:04}\"\n\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\nkill_timeout = \"1s\"\n"
        ));
        if let Some(target) = target {
            text.push_str(&format!("[service.proxy.liveness]\ntcp = \"{target}\"\ninterval = \"1s\"\n"));
        }
        text.push('\n');
    }
    let path = dir.join("services.toml");
    let temp = path.with_extension("partial");
    fs::write(&temp, text).map_err(|err| format!("{}: {err}", temp.display()))?;
    fs::rename(&temp, &path).map_err(|err| format!("{}: {err}", path.display()))
}
