//! Ordering: the bring-up of 1 000 `sleep` proxies in 10 chains of 100 (each link
//! `depends_on` the one before it being ready), against 1 000 independent ones in the same
//! run, and the `tether leave` of each: the chains stop link by link, the independent ones
//! all at once.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use super::lab::Lab;
use super::report::{Met, Row, ratio, secs};

const CHAINS: usize = 10;
const LINKS: usize = 100;
const ROUNDS: usize = 2;

/// Runs the section, appending its rows.
pub(crate) fn run(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    let count = CHAINS * LINKS;
    let independent = lab.subdir("ordering-independent-config")?;
    write_config(&independent, false)?;
    let chained = lab.subdir("ordering-chains-config")?;
    write_config(&chained, true)?;
    let mut best = [(Duration::MAX, Duration::MAX); 2];
    for round in 0..ROUNDS {
        for (index, (name, config)) in [("independent", &independent), ("chains", &chained)].into_iter().enumerate() {
            let data = lab.dir.join(format!("ordering-{name}-{round}-data"));
            let start = Instant::now();
            let mut agent = lab.agent(&format!("ordering-{name}-{round}"), config, &data, &[])?;
            let (_, seen) = agent.wait_running(count, Duration::from_secs(300))?;
            let up = seen - start;
            let leave_start = Instant::now();
            agent.leave(Duration::from_secs(300))?;
            let down = leave_start.elapsed();
            eprintln!("xtask: bench: ordering, {name}, round {round}: bring-up {}, leave {}", secs(up), secs(down));
            best[index].0 = best[index].0.min(up);
            best[index].1 = best[index].1.min(down);
        }
    }
    let [(independent_up, independent_down), (chains_up, chains_down)] = best;
    rows.push(Row::new(
        &format!("ordering: bring-up of {count} proxies in {CHAINS} chains of {LINKS} (best of {ROUNDS})"),
        format!("{count} independent: {}", secs(independent_up)),
        secs(chains_up),
        ratio(chains_up.as_secs_f64(), independent_up.as_secs_f64()),
        "—",
        Met::Info,
    ));
    rows.push(Row::new(
        &format!("ordering: `tether leave` of {count} proxies in {CHAINS} chains of {LINKS} (best of {ROUNDS})"),
        format!("{count} independent: {}", secs(independent_down)),
        secs(chains_down),
        ratio(chains_down.as_secs_f64(), independent_down.as_secs_f64()),
        "—",
        Met::Info,
    ));
    Ok(())
}

/// Writes the services: `c<chain>l<link>`, each link after the first depending on the one
/// before it, when `chained`.
fn write_config(dir: &Path, chained: bool) -> Result<(), String> {
    let mut text = String::new();
    for chain in 0..CHAINS {
        for link in 0..LINKS {
            text.push_str(&format!(
                "[[service]]\nname = \"c{chain}l{link:03}\"\n\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\nkill_timeout = \"1s\"\n"
            ));
            if chained && link > 0 {
                text.push_str(&format!("depends_on = {{ \"c{chain}l{:03}\" = \"ready\" }}\n", link - 1));
            }
            text.push('\n');
        }
    }
    let path = dir.join("services.toml");
    let temp = path.with_extension("partial");
    fs::write(&temp, text).map_err(|err| format!("{}: {err}", temp.display()))?;
    fs::rename(&temp, &path).map_err(|err| format!("{}: {err}", path.display()))
}
