//! Bring-up at every size: the agent's start until N `sleep` proxies are `running`, at
//! N = 100, 1 000 and 10 000, each against a raw spawn loop of N in the same run; and at
//! 10 000, the agent's memory per proxy and that none is left `failed`.
//!
//! (The 1 000-proxy section measures its own bring-up too, best of 2, with the figures that
//! need the agent it leaves running.)

use std::fs;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use super::lab::{Lab, raw_bring_up};
use super::report::{Row, met, ratio, secs};

/// The sizes, with how many rounds each (the best is kept) and the ratio to the raw loop
/// that the target allows, if there is one (at 100 the agent's own start dominates).
const SIZES: [(usize, usize, Option<f64>); 3] = [(100, 3, None), (1_000, 3, Some(1.3)), (10_000, 1, Some(1.5))];

/// Runs the section, appending its rows; `empty_rss` is the RSS of an agent with no proxy.
pub(crate) fn run(lab: &Lab, empty_rss: u64, rows: &mut Vec<Row>) -> Result<(), String> {
    for (count, rounds, target) in SIZES {
        let config = lab.subdir(&format!("n{count}-config"))?;
        write_config(&config, count)?;
        let (mut raw_best, mut agent_best) = (Duration::MAX, Duration::MAX);
        let mut last = None;
        for round in 0..rounds {
            let raw = raw_bring_up(lab, &format!("n{count}-raw{round}"), count)?;
            raw_best = raw_best.min(raw);
            let data = lab.dir.join(format!("n{count}-{round}-data"));
            let start = Instant::now();
            let mut agent = lab.agent(&format!("n{count}-{round}"), &config, &data, &[])?;
            let (running, seen) = agent.wait_running(count, Duration::from_secs(300))?;
            agent_best = agent_best.min(seen - start);
            eprintln!("xtask: bench: bring-up of {count}, round {round}: {} (raw {})", secs(seen - start), secs(raw));
            if round + 1 == rounds {
                last = Some((agent, running.len()));
            } else {
                agent.leave(Duration::from_secs(120))?;
            }
        }
        let took_ratio = agent_best.as_secs_f64() / raw_best.as_secs_f64();
        rows.push(Row::new(
            &format!("bring-up: agent start until {count} `sleep` proxies are `running` (best of {rounds})"),
            format!("raw spawn of {count}: {}", secs(raw_best)),
            secs(agent_best),
            ratio(agent_best.as_secs_f64(), raw_best.as_secs_f64()),
            &target.map_or_else(|| "—".to_owned(), |target| format!("≤ {target}")),
            target.map_or(super::report::Met::Info, |target| met(took_ratio <= target)),
        ));
        eprintln!("xtask: bench: bring-up of {count}: {} (raw {})", secs(agent_best), secs(raw_best));
        let (mut agent, running) = last.ok_or("no agent")?;
        if count == 10_000 {
            // Settled: the snapshot and pid files are written, the burst's buffers freed.
            thread::sleep(Duration::from_secs(3));
            let proxies = agent.proxies()?;
            let failed = proxies.iter().filter(|row| row.state == "failed").count();
            let all_running = proxies.iter().filter(|row| row.state == "running").count();
            rows.push(Row::new(
                "10 000 proxies: running / failed after bring-up",
                "—".into(),
                format!("{all_running} / {failed} (of {running})"),
                "—".into(),
                "10 000 / 0",
                met(all_running == count && failed == 0),
            ));
            let rss = agent.rss_with_keeper_kib()?;
            #[allow(clippy::cast_precision_loss)]
            let per_proxy = rss.saturating_sub(empty_rss) as f64 / count as f64;
            rows.push(Row::new(
                "agent RSS and keeper private memory per managed proxy, N = 10 000",
                format!("agent with 0 proxies (no keeper yet): {empty_rss} KiB"),
                format!("{per_proxy:.1} KiB (agent and keeper: {} MiB)", rss / 1024),
                "—".into(),
                "≤ 8 KiB",
                met(per_proxy <= 8.0),
            ));
        }
        agent.leave(Duration::from_secs(300))?;
    }
    Ok(())
}

fn write_config(dir: &Path, count: usize) -> Result<(), String> {
    let mut text = String::new();
    for index in 0..count {
        text.push_str(&format!(
            "[[service]]\nname = \"n{index:05}\"\n\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\nkill_timeout = \"1s\"\n\n"
        ));
    }
    let path = dir.join("services.toml");
    let temp = path.with_extension("partial");
    fs::write(&temp, text).map_err(|err| format!("{}: {err}", temp.display()))?;
    fs::rename(&temp, &path).map_err(|err| format!("{}: {err}", path.display()))
}
