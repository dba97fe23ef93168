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
//! `peers`, `bring-up`, `builtin-proxy`, `ordering`, `templates`, `connect`, `xds`, `fleet`, `fleet-scale`) runs only those
//! end-to-end sections, prints their table, and replaces only their blocks in
//! `BENCHMARKS.md` (each block says when it was measured).

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
mod redirect;
mod reload;
mod report;
mod scale;
mod sys;
mod templates;
mod updates;
mod xds;
mod xds_scale;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use report::{Machine, Report, Row};

/// The end-to-end sections, in the order they run and appear in `BENCHMARKS.md`: the name
/// that `XTASK_BENCH_ONLY` takes, and a title (`bring-up`: see `bringup.rs`).
const SECTIONS: &[(&str, &str)] = &[
    ("many", "1 000 proxies"),
    ("scale", "bring-up at 100, 1 000 and 10 000 proxies, as the agent counts it"),
    ("some", "100 proxies"),
    ("health", "health checks"),
    ("updates", "zero-downtime updates"),
    ("reload", "reload in place (HAProxy)"),
    ("cgroups", "cgroups"),
    ("peers", "side by side with s6, runit and supervisord"),
    ("bring-up", "bring-up seen from outside"),
    ("builtin-proxy", "the built-in proxy"),
    ("ordering", "ordering"),
    ("templates", "templates"),
    ("connect", "Connect"),
    ("xds", "xDS"),
    ("fleet", "a simulated fleet: 20 agents on one etcd"),
    ("fleet-scale", "the fleet at scale: 300 agents on a three-member etcd"),
];

/// A section that takes the lab and fills its rows, the title of its failure row, and its
/// name in [`SECTIONS`].
type Run = fn(&lab::Lab, &mut Vec<Row>) -> Result<(), String>;

/// The sections that are one call each, in order, after `many`, `scale` and `some`.
const RUNS: &[(&str, &str, Run)] = &[
    ("health", "health-check figures", health::run),
    ("updates", "zero-downtime updates", updates::run),
    ("reload", "reload in place (HAProxy)", reload::run),
    ("cgroups", "cgroups: bring-up and restart", cgroups::run),
    ("peers", "side by side with s6, runit and supervisord", peers::run),
    ("bring-up", "bring-up seen from outside", bringup::run),
    ("builtin-proxy", "built-in proxy figures", builtin_proxy::run),
    ("ordering", "ordering: chains against independent proxies", ordering::run),
    ("templates", "templates: change to verdict, and CPU", templates::run),
    ("connect", "connect: leaf certificates at start", connect::run),
    ("xds", "xDS: change to Envoy's ACK", xds::run),
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
        if let Some(unknown) = sections.iter().find(|section| !SECTIONS.iter().any(|(name, _)| name == section)) {
            let names: Vec<&str> = SECTIONS.iter().map(|(name, _)| *name).collect();
            return Err(format!(
                "XTASK_BENCH_ONLY: unknown section `{unknown}`; expected `e2e` or a comma-separated list of {}",
                names.join(", ")
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
    let mut report = Report::default();
    let mut errors = Vec::new();
    {
        let lab = lab::Lab::new(tether)?;
        eprintln!("xtask: bench: end-to-end in {}", lab.dir.display());
        if (only.wants("many") || only.wants("scale") || only.wants("some"))
            && let Err(err) = e2e::run(&lab, &mut report, only.wants("many"), only.wants("some"), only.wants("scale"))
        {
            lab.keep();
            errors.push(err);
        }
        for (name, failed, run) in RUNS {
            if only.wants(name)
                && let Err(err) = run(&lab, report.begin(name))
            {
                lab.keep();
                report.current().push(Row::failed(failed, &err));
                errors.push(err);
            }
        }
        // Informational figures, with no baseline: the simulated fleet (20 agents, one etcd,
        // 2 000 puts) and 300 agents on a three-member etcd cluster.
        let mut informational =
            |name: &'static str, failed: &str, run: &dyn Fn() -> Result<Vec<(String, String)>, String>| {
                if !only.wants(name) {
                    return;
                }
                let rows = report.begin(name);
                match run() {
                    Ok(figures) => rows.extend(figures.into_iter().map(|(figure, value)| {
                        Row::new(&figure, "—".into(), value, "—".into(), "—", report::Met::Info)
                    })),
                    Err(err) => {
                        rows.push(Row::failed(failed, &err));
                        errors.push(err);
                    }
                }
            };
        informational("fleet", "simulated fleet", &|| fleet::run(root, &lab.tether));
        informational("fleet-scale", "fleet at scale", &|| fleet_scale::run(&lab.tether));
        report.end();
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
        report::write(root, &machine, &report, SECTIONS, &notes)?;
    } else {
        report::merge(root, &report, SECTIONS)?;
        notes.push("a partial run (XTASK_BENCH_ONLY): only its sections were replaced in BENCHMARKS.md".to_owned());
    }
    let rows: Vec<Row> = report.rows().cloned().collect();
    println!("{}", report::table(&rows));
    for note in &notes {
        println!("{note}");
    }
    if errors.is_empty() { Ok(()) } else { Err(format!("bench: {}", errors.join("; "))) }
}
