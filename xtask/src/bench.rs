//! `cargo xtask bench`: every crate's benchmarks in release mode, then the end-to-end
//! benchmarks of the release `tether` binary with real processes, written to
//! `BENCHMARKS.md` and printed.
//!
//! Each figure sits next to a baseline measured in the same run. The end-to-end part
//! builds the binary itself (`cargo build --release -p tether-agent`), works in a temp dir
//! under /tmp, and leaves no process behind, even when it fails.
//!
//! For work on one figure, `XTASK_BENCH_ONLY` narrows the run: `e2e` skips the crate
//! benchmarks; a comma-separated list of sections (`many`, `scale`, `some`, `health`, `updates`, `reload`, `cgroups`,
//! `peers`, `builtin-proxy`, `ordering`, `templates`, `fleet`, `fleet-scale`, `connect`, `xds`) runs only those end-to-end sections and prints their table without rewriting
//! `BENCHMARKS.md`, which always holds a whole run.

mod bringup;
mod builtin_proxy;
mod cgroups;
mod connect;
mod e2e;
mod fleet;
mod fleet_scale;
mod health;
mod lab;
mod ordering;
mod peers;
mod reload;
mod report;
mod scale;
mod sys;
mod templates;
mod updates;
mod xds;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use report::{Machine, Row};

/// The end-to-end sections that `XTASK_BENCH_ONLY` can name (`bring-up`: see `bringup.rs`).
const SECTIONS: &[&str] = &[
    "many",
    "scale",
    "some",
    "health",
    "updates",
    "reload",
    "cgroups",
    "peers",
    "bring-up",
    "builtin-proxy",
    "ordering",
    "templates",
    "fleet",
    "fleet-scale",
    "connect",
    "xds",
];

/// What `XTASK_BENCH_ONLY` asks for: `None` for a whole run.
struct Only {
    skip_crates: bool,
    sections: Option<Vec<String>>,
}

impl Only {
    fn from_env() -> Result<Self, String> {
        let Ok(only) = std::env::var("XTASK_BENCH_ONLY") else {
            return Ok(Self { skip_crates: false, sections: None });
        };
        if only == "e2e" {
            return Ok(Self { skip_crates: true, sections: None });
        }
        let sections: Vec<String> = only.split(',').map(|section| section.trim().to_owned()).collect();
        if let Some(unknown) = sections.iter().find(|section| !SECTIONS.contains(&section.as_str())) {
            return Err(format!(
                "XTASK_BENCH_ONLY: unknown section `{unknown}`; expected `e2e` or a comma-separated list of {}",
                SECTIONS.join(", ")
            ));
        }
        Ok(Self { skip_crates: true, sections: Some(sections) })
    }

    /// Whether the run includes `section`.
    pub(crate) fn wants(&self, section: &str) -> bool {
        self.sections.as_ref().is_none_or(|sections| sections.iter().any(|wanted| wanted == section))
    }
}

/// Runs every crate's benchmarks, then the end-to-end benchmarks.
pub(crate) fn run(root: &Path) -> Result<(), String> {
    let start = Instant::now();
    let only = Only::from_env()?;
    let crates = if only.skip_crates {
        None
    } else {
        // A failing crate benchmark does not hide the end-to-end figures: both are reported.
        Some((crate::run("bench", &["bench", "--workspace", "--benches"]), start.elapsed()))
    };
    let crate_result = crates.as_ref().map_or(Ok(()), |(result, _)| result.clone());
    let end_to_end = end_to_end(root, start, crates, &only);
    crate_result.and(end_to_end)
}

/// Builds the release binary and returns its path, from cargo's own artifact messages.
fn build_tether(root: &Path) -> Result<PathBuf, String> {
    eprintln!("xtask: bench: cargo build --release -p tether-agent");
    let output = Command::new(crate::cargo())
        .args(["build", "--release", "-p", "tether-agent", "--message-format=json-render-diagnostics"])
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|err| format!("cannot run cargo: {err}"))?;
    if !output.status.success() {
        return Err(format!("cargo build --release -p tether-agent failed ({})", output.status));
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| message["reason"] == "compiler-artifact" && message["target"]["name"] == "tether")
        .find_map(|message| message["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| "cargo built no `tether` executable".to_owned())
}

fn end_to_end(
    root: &Path,
    start: Instant,
    crates: Option<(Result<(), String>, Duration)>,
    only: &Only,
) -> Result<(), String> {
    let tether = build_tether(root)?;
    let open_files = sys::raise_open_files()?;
    if open_files < 4_096 {
        return Err(format!("the open-file limit is {open_files}; the bench needs 4096"));
    }
    let mut machine = Machine::now();
    let e2e_start = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    let mut errors = Vec::new();
    {
        let lab = lab::Lab::new(tether)?;
        eprintln!("xtask: bench: end-to-end in {}", lab.dir.display());
        if (only.wants("many") || only.wants("scale") || only.wants("some"))
            && let Err(err) = e2e::run(&lab, &mut rows, only.wants("many"), only.wants("some"), only.wants("scale"))
        {
            lab.keep();
            errors.push(err);
        }
        if only.wants("health")
            && let Err(err) = health::run(&lab, &mut rows)
        {
            lab.keep();
            rows.push(Row::failed("health-check figures", &err));
            errors.push(err);
        }
        if only.wants("updates")
            && let Err(err) = updates::run(&lab, &mut rows)
        {
            lab.keep();
            rows.push(Row::failed("zero-downtime updates", &err));
            errors.push(err);
        }
        if only.wants("reload")
            && let Err(err) = reload::run(&lab, &mut rows)
        {
            lab.keep();
            rows.push(Row::failed("reload in place (HAProxy)", &err));
            errors.push(err);
        }
        if only.wants("cgroups")
            && let Err(err) = cgroups::run(&lab, &mut rows)
        {
            lab.keep();
            rows.push(Row::failed("cgroups: bring-up and restart", &err));
            errors.push(err);
        }
        if only.wants("peers")
            && let Err(err) = peers::run(&lab, &mut rows)
        {
            lab.keep();
            rows.push(Row::failed("side by side with s6, runit and supervisord", &err));
            errors.push(err);
        }
        if only.wants("bring-up")
            && let Err(err) = bringup::run(&lab, &mut rows)
        {
            lab.keep();
            rows.push(Row::failed("bring-up seen from outside", &err));
            errors.push(err);
        }
        if only.wants("builtin-proxy")
            && let Err(err) = builtin_proxy::run(&lab, &mut rows)
        {
            lab.keep();
            rows.push(Row::failed("built-in proxy figures", &err));
            errors.push(err);
        }
        if only.wants("ordering")
            && let Err(err) = ordering::run(&lab, &mut rows)
        {
            lab.keep();
            rows.push(Row::failed("ordering: chains against independent proxies", &err));
            errors.push(err);
        }
        if only.wants("templates")
            && let Err(err) = templates::run(&lab, &mut rows)
        {
            lab.keep();
            rows.push(Row::failed("templates: change to verdict, and CPU", &err));
            errors.push(err);
        }
        if only.wants("connect")
            && let Err(err) = connect::run(&lab, &mut rows)
        {
            lab.keep();
            rows.push(Row::failed("connect: leaf certificates at start", &err));
            errors.push(err);
        }
        if only.wants("xds")
            && let Err(err) = xds::run(&lab, &mut rows)
        {
            lab.keep();
            rows.push(Row::failed("xDS: change to Envoy's ACK", &err));
            errors.push(err);
        }
        // Informational figures, with no baseline: the simulated fleet (20 agents, one etcd,
        // 2 000 puts) and 300 agents on a three-member etcd cluster.
        let mut informational = |name: &str, figures: Option<Result<Vec<(String, String)>, String>>| match figures {
            None => {}
            Some(Ok(figures)) => rows.extend(
                figures
                    .into_iter()
                    .map(|(figure, value)| Row::new(&figure, "—".into(), value, "—".into(), "—", report::Met::Info)),
            ),
            Some(Err(err)) => {
                rows.push(Row::failed(name, &err));
                errors.push(err);
            }
        };
        informational("simulated fleet", only.wants("fleet").then(|| fleet::run(root, &lab.tether)));
        informational("fleet at scale", only.wants("fleet-scale").then(|| fleet_scale::run(&lab.tether)));
    }
    machine.load_after = report::load_average();
    let mut notes = vec![format!(
        "run time: end-to-end {:.0} s, whole `cargo xtask bench` {:.0} s{}",
        e2e_start.elapsed().as_secs_f64(),
        start.elapsed().as_secs_f64(),
        crates.as_ref().map_or_else(
            || " (crate benchmarks skipped)".to_owned(),
            |(_, took)| format!(" (crate benchmarks with their build {:.0} s)", took.as_secs_f64())
        )
    )];
    if let Some((Err(err), _)) = &crates {
        notes.push(format!("crate benchmarks: {err} (see the output of `cargo bench --workspace --benches`)"));
    }
    if !errors.is_empty() {
        notes.push(format!("errors: {}", errors.join("; ")));
    }
    if only.sections.is_none() {
        report::write(root, &machine, &rows, &notes)?;
    } else {
        notes.push("a partial run (XTASK_BENCH_ONLY): BENCHMARKS.md is left as it was".to_owned());
    }
    println!("{}", report::table(&rows));
    for note in &notes {
        println!("{note}");
    }
    if errors.is_empty() { Ok(()) } else { Err(format!("bench: {}", errors.join("; "))) }
}
