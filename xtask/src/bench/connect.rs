//! Connect's certificates at scale: the issuance of a leaf for each of 1 000 services at the
//! agent's start (the agent logs how long its issuing loop took), and the bring-up of those
//! 1 000 `sleep` proxies with `[connect]` against the same 1 000 without it, in the same run.
//! Issuing a leaf and renewing one are the same work (a new P-256 key, a signature), so the
//! time per leaf is also a renewal's cost: the loop is single-threaded and does nothing else.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use super::lab::Lab;
use super::report::{Met, Row, met, ratio, secs};

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
    Ok(())
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
    let mut text = String::new();
    if mesh {
        text.push_str("[connect]\ntrust_domain = \"bench.example.org\"\n\n[connect.ca]\nprovider = \"dev\"\n\n");
    }
    for index in 0..COUNT {
        text.push_str(&format!(
            "[[service]]\nname = \"s{index:04}\"\n\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\nkill_timeout = \"1s\"\n\n"
        ));
    }
    let path = dir.join("services.toml");
    let temp = path.with_extension("partial");
    fs::write(&temp, text).map_err(|err| format!("{}: {err}", temp.display()))?;
    fs::rename(&temp, &path).map_err(|err| format!("{}: {err}", path.display()))
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
