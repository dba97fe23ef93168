//! `cargo xtask bench`: every crate's benchmarks in release mode, then the end-to-end
//! benchmarks of the release `tether` binary with real processes, written to
//! `BENCHMARKS.md` and printed.
//!
//! Each figure sits next to a baseline measured in the same run. The end-to-end part
//! builds the binary itself (`cargo build --release -p tether-agent`), works in a temp dir
//! under /tmp, and leaves no process behind, even when it fails. `XTASK_BENCH_ONLY=e2e`
//! skips the crate benchmarks, for work on this module.

mod builtin_proxy;
mod e2e;
mod fleet;
mod lab;
mod report;
mod sys;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use report::{Machine, Row};

/// Runs every crate's benchmarks, then the end-to-end benchmarks.
pub(crate) fn run(root: &Path) -> Result<(), String> {
    let start = Instant::now();
    let crates = if std::env::var("XTASK_BENCH_ONLY").is_ok_and(|only| only == "e2e") {
        None
    } else {
        // A failing crate benchmark does not hide the end-to-end figures: both are reported.
        Some((crate::run("bench", &["bench", "--workspace", "--benches"]), start.elapsed()))
    };
    let crate_result = crates.as_ref().map_or(Ok(()), |(result, _)| result.clone());
    let end_to_end = end_to_end(root, start, crates);
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

fn end_to_end(root: &Path, start: Instant, crates: Option<(Result<(), String>, Duration)>) -> Result<(), String> {
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
        if let Err(err) = e2e::run(&lab, &mut rows) {
            lab.keep();
            errors.push(err);
        }
        if let Err(err) = builtin_proxy::run(&lab, &mut rows) {
            lab.keep();
            rows.push(Row::failed("built-in proxy figures", &err));
            errors.push(err);
        }
        // The simulated fleet (20 agents, one etcd, 2 000 puts): informational figures.
        match fleet::run(root, &lab.tether) {
            Ok(figures) => rows.extend(
                figures
                    .into_iter()
                    .map(|(figure, value)| Row::new(&figure, "—".into(), value, "—".into(), "—", report::Met::Info)),
            ),
            Err(err) => {
                rows.push(Row::failed("simulated fleet", &err));
                errors.push(err);
            }
        }
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
    report::write(root, &machine, &rows, &notes)?;
    println!("{}", report::table(&rows));
    for note in &notes {
        println!("{note}");
    }
    if errors.is_empty() { Ok(()) } else { Err(format!("bench: {}", errors.join("; "))) }
}
