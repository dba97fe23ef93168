//! Templates: how long a catalog change (a service registered through the API) takes to
//! reach a proxy as a rendered file and a reload verdict, median and p99; and the agent's CPU
//! over 1 000 catalog changes with 100 proxies that each render a template of every service,
//! against the same changes and proxies without templates, in the same run.

use std::fs;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use super::lab::{Agent, Lab, request};
use super::report::{Met, Row, ms, ratio};
use super::sys;

/// Timed changes.
const TIMED: usize = 50;
/// Proxies of the CPU comparison.
const PROXIES: usize = 100;
/// Catalog changes of the CPU comparison.
const CHANGES: usize = 1_000;

/// Runs the section, appending its rows.
pub(crate) fn run(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    let latencies = change_to_verdict(lab)?;
    let row = Row::new(
        &format!("templates: API change → file rendered → reload verdict, median / p99 of {TIMED} (wait = \"1ms\")"),
        "—".to_owned(),
        format!("{} / {}", ms(percentile(&latencies, 0.5)), ms(percentile(&latencies, 0.99))),
        "—".to_owned(),
        "—",
        Met::Info,
    );
    eprintln!("xtask: bench: {}: {}", row.figure, row.value);
    rows.push(row);

    let without = cpu_over_changes(lab, false)?;
    let with = cpu_over_changes(lab, true)?;
    let row = Row::new(
        &format!("templates: agent CPU over {CHANGES} catalog changes, {PROXIES} proxies each rendering every service"),
        format!("the same without templates: {}", ms(without)),
        ms(with),
        ratio(with.as_secs_f64(), without.as_secs_f64()),
        "—",
        Met::Info,
    );
    eprintln!("xtask: bench: {}: {} (baseline {})", row.figure, row.value, row.baseline);
    rows.push(row);
    Ok(())
}

fn percentile(durations: &[Duration], at: f64) -> Duration {
    let mut sorted = durations.to_vec();
    sorted.sort_unstable();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    let index = ((sorted.len() as f64 - 1.0) * at).round() as usize;
    sorted.get(index).copied().unwrap_or_default()
}

fn register(agent: &Agent<'_>, name: &str) -> Result<(), String> {
    agent.register(&format!(r#"{{"name":"{name}","port":8080}}"#))
}

/// The `last_reload.at` of `id`, if it was ever reloaded.
fn last_reload(agent: &Agent<'_>, id: &str) -> Result<Option<String>, String> {
    let response = request(&agent.socket, "GET", &format!("/v1/agent/proxy/{id}"), &[], None)?;
    let status: serde_json::Value =
        serde_json::from_slice(&response.body).map_err(|err| format!("GET /v1/agent/proxy/{id}: {err}"))?;
    Ok(status["last_reload"]["at"].as_str().map(str::to_owned))
}

/// One proxy whose template lists every service, reloaded by SIGHUP (a shell that traps it):
/// each registration's time until the proxy's next reload verdict.
fn change_to_verdict(lab: &Lab) -> Result<Vec<Duration>, String> {
    let config = lab.subdir("templates-latency-config")?;
    let rendered = lab.dir.join("templates-latency.list");
    let text = format!(
        "[[service]]\nname = \"edge\"\n[service.proxy]\n\
         command = [\"/bin/sh\", \"-c\", \"trap : HUP; while :; do sleep 1; done\"]\nkill_timeout = \"1s\"\n\
         [service.proxy.reload]\nsignal = \"SIGHUP\"\n\
         [[service.proxy.template]]\ncontents = '''{{% for s in services %}}{{{{ s.id }}}}\n{{% endfor %}}'''\n\
         destination = \"{}\"\nwait = \"1ms\"\n",
        rendered.display()
    );
    write(&config, &text)?;
    let mut agent = lab.agent("templates-latency", &config, &lab.dir.join("templates-latency-data"), &[])?;
    agent.wait_running(1, Duration::from_secs(60))?;
    let mut latencies = Vec::with_capacity(TIMED);
    for index in 0..TIMED {
        let before = last_reload(&agent, "edge-proxy")?;
        let start = Instant::now();
        register(&agent, &format!("t{index:03}"))?;
        loop {
            if last_reload(&agent, "edge-proxy")? != before {
                latencies.push(start.elapsed());
                break;
            }
            if start.elapsed() > Duration::from_secs(10) {
                return Err(agent.error("no reload verdict within 10 s of a change"));
            }
            thread::sleep(Duration::from_micros(200));
        }
        // Quiet between changes, so that each is the first after a quiet period.
        thread::sleep(Duration::from_millis(50));
    }
    agent.leave(Duration::from_secs(60))?;
    Ok(latencies)
}

/// The agent's CPU time while [`CHANGES`] services are registered one after another, with
/// [`PROXIES`] `sleep` proxies, each rendering a template of every service when `templates`.
fn cpu_over_changes(lab: &Lab, templates: bool) -> Result<Duration, String> {
    let name = if templates { "templates-cpu-with" } else { "templates-cpu-without" };
    let config = lab.subdir(&format!("{name}-config"))?;
    let out = lab.subdir(&format!("{name}-rendered"))?;
    let mut text = String::new();
    for index in 0..PROXIES {
        text.push_str(&format!(
            "[[service]]\nname = \"p{index:03}\"\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\nkill_timeout = \"1s\"\n"
        ));
        if templates {
            text.push_str(&format!(
                "[[service.proxy.template]]\ncontents = '''{{% for s in services %}}{{{{ s.id }}}} {{{{ s.port }}}}\n{{% endfor %}}'''\n\
                 destination = \"{}\"\non_change = \"none\"\n",
                out.join(format!("p{index:03}.list")).display()
            ));
        }
        text.push('\n');
    }
    write(&config, &text)?;
    let mut agent = lab.agent(name, &config, &lab.dir.join(format!("{name}-data")), &[])?;
    agent.wait_running(PROXIES, Duration::from_secs(120))?;
    let before = sys::process_cpu_time(agent.pid())?;
    for index in 0..CHANGES {
        register(&agent, &format!("c{index:04}"))?;
    }
    // The last renders are at most one template `wait` (200 ms) behind the last change.
    thread::sleep(Duration::from_millis(500));
    let used = sys::process_cpu_time(agent.pid())?.saturating_sub(before);
    if templates {
        let last = fs::read_to_string(out.join("p000.list")).map_err(|err| format!("p000.list: {err}"))?;
        if !last.contains(&format!("c{:04} ", CHANGES - 1)) {
            return Err(agent.error("the last change never reached the rendered file"));
        }
    }
    agent.leave(Duration::from_secs(60))?;
    Ok(used)
}

fn write(dir: &Path, text: &str) -> Result<(), String> {
    let path = dir.join("services.toml");
    let temp = path.with_extension("partial");
    fs::write(&temp, text).map_err(|err| format!("{}: {err}", temp.display()))?;
    fs::rename(&temp, &path).map_err(|err| format!("{}: {err}", path.display()))
}
