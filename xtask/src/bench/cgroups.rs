//! The cost of a cgroup per proxy: bring-up of 1 000 `sleep` proxies and the restart
//! latency after `kill -9`, with cgroups against the same agent with `--no-cgroups`, in
//! alternating rounds of the same run.

use std::time::Duration;

use super::e2e::{restart_latencies, write_services};
use super::lab::{Lab, SLEEP};
use super::report::{Met, Row, median, met, ms, ratio, secs};

/// Proxies per agent.
const PROXIES: usize = 1_000;
/// Rounds of each mode; the best bring-up of each counts.
const ROUNDS: usize = 3;
/// `kill -9`s for the restart latency, each of a different proxy, in every round.
const KILLS: usize = 50;
/// The most cgroups may cost, as a ratio of the same figure without.
const TARGET: f64 = 1.15;

/// Runs the section, appending its rows.
pub(crate) fn run(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    let config = lab.subdir("cg-config")?;
    write_services(&config, "services.toml", "c", PROXIES, SLEEP)?;
    let modes: [(&str, &[&str]); 2] = [("without", &["--no-cgroups"]), ("with", &[])];
    let mut bring_up = [Duration::MAX; 2];
    let mut restarts: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for round in 0..ROUNDS {
        for (mode, (name, flags)) in modes.iter().enumerate() {
            let data = lab.dir.join(format!("cg-{name}{round}-data"));
            let start = std::time::Instant::now();
            let mut agent = lab.agent(&format!("cg-{name}{round}"), &config, &data, flags)?;
            let (_, seen) = agent.wait_running(PROXIES, Duration::from_secs(120))?;
            bring_up[mode] = bring_up[mode].min(seen - start);
            if *name == "with" && !agent.log_text().contains("a cgroup per proxy") {
                let reason = agent
                    .log_text()
                    .lines()
                    .find(|line| line.contains("cgroups unavailable"))
                    .unwrap_or("no cgroup line in the log")
                    .to_owned();
                agent.leave(Duration::from_secs(60))?;
                rows.push(Row::new(
                    "cgroups: bring-up and restart with a cgroup per proxy",
                    "—".into(),
                    format!("not measured: {reason}"),
                    "—".into(),
                    "—",
                    Met::Info,
                ));
                return Ok(());
            }
            let services = (round * KILLS..(round + 1) * KILLS).map(|index| format!("c{index:04}"));
            restarts[mode].extend(restart_latencies(&agent, services)?.process);
            agent.leave(Duration::from_secs(60))?;
        }
    }
    let [without, with] = bring_up;
    rows.push(Row::new(
        &format!("cgroups: bring-up of {PROXIES} `sleep` proxies, a cgroup each (best of {ROUNDS})"),
        format!("--no-cgroups: {}", secs(without)),
        secs(with),
        ratio(with.as_secs_f64(), without.as_secs_f64()),
        "≤ 1.15",
        met(with.as_secs_f64() <= TARGET * without.as_secs_f64()),
    ));
    let (without, with) = (median(&restarts[0]), median(&restarts[1]));
    rows.push(Row::new(
        &format!(
            "cgroups: restart after `kill -9` until the new process exec'd, median ({} kills each), the old cgroup killed and removed first",
            restarts[0].len()
        ),
        format!("--no-cgroups: {}", ms(without)),
        ms(with),
        ratio(with.as_secs_f64(), without.as_secs_f64()),
        "≤ 1.15",
        met(with.as_secs_f64() <= TARGET * without.as_secs_f64()),
    ));
    Ok(())
}
