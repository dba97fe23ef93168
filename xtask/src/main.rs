//! `cargo xtask`: the project's automation, in Rust, needing nothing beyond `cargo`.
//!
//! It stays small and synchronous: it runs `cargo` (through `$CARGO`) and reads files,
//! and never builds or links project code itself.

#![allow(clippy::print_stdout, clippy::print_stderr)]

mod bench;
mod deps;
mod dist;
mod downstream;
mod floors;
mod fuzz;
mod tidy;

use std::env;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

const TASKS: &str = "\
usage: cargo xtask <task>

tasks:
  ci          everything CI runs: fmt --check, clippy -D warnings, tests (nextest), doctests, examples, docs, tidy,
              deps, and the same for the downstream crate (downstream/), whose must-fail test must fail
  test        the test suite only (nextest, then doctests, then the downstream crate's tests and its must-fail test)
  tidy        module docs present, no #[should_panic], no bare #[ignore], no process spawning outside proxy-daemon,
              no reference to a document outside the repository, and the binary's modules on their floors
  deps        the crate graph against the allow-list
  downstream  the downstream crate alone: its lock file, fmt --check, clippy -D warnings, tests, must-fail test
  bench       every crate's benchmarks, then the end-to-end benchmarks of the tether binary
  fuzz        every fuzz target for a bounded time
  dist        release binary (stripped), shell completions, man page and systemd unit in target/dist
";

fn main() -> ExitCode {
    let task = env::args().nth(1);
    let result = match task.as_deref() {
        Some("ci") => ci(),
        Some("test") => test(),
        Some("tidy") => report(tidy::check(&workspace_root())),
        Some("deps") => report(deps::check(&cargo(), &workspace_root())),
        Some("downstream") => downstream::lint(&workspace_root()).and_then(|()| downstream::test(&workspace_root())),
        Some("bench") => bench::run(&workspace_root()),
        Some("fuzz") => fuzz::run(&workspace_root(), env::args().skip(2).collect()),
        Some("dist") => dist::run(&workspace_root()),
        None | Some("help" | "-h" | "--help") => {
            print!("{TASKS}");
            return ExitCode::SUCCESS;
        }
        Some(other) => Err(format!("unknown task `{other}`\n\n{TASKS}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

pub(crate) fn cargo() -> String {
    env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."))
}

fn report(problems: Result<Vec<String>, String>) -> Result<(), String> {
    let problems = problems?;
    if problems.is_empty() {
        return Ok(());
    }
    for problem in &problems {
        eprintln!("  {problem}");
    }
    Err(format!("{} problem(s)", problems.len()))
}

pub(crate) fn run(step: &str, args: &[&str]) -> Result<(), String> {
    eprintln!("xtask: {step}: cargo {}", args.join(" "));
    let status = Command::new(cargo())
        .args(args)
        .current_dir(workspace_root())
        .status()
        .map_err(|err| format!("{step}: cannot run cargo: {err}"))?;
    if status.success() { Ok(()) } else { Err(format!("{step} failed ({status})")) }
}

fn has_nextest() -> bool {
    Command::new(cargo())
        .args(["nextest", "--version"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

fn test() -> Result<(), String> {
    if has_nextest() {
        let profile = if env::var_os("CI").is_some() { "ci" } else { "default" };
        run("tests", &["nextest", "run", "--workspace", "--lib", "--bins", "--tests", "--profile", profile])?;
    } else {
        eprintln!("xtask: cargo-nextest is not installed; running the tests with `cargo test` instead");
        run("tests", &["test", "--workspace", "--lib", "--bins", "--tests"])?;
    }
    // Every feature on: the crate docs' tests against the mocks need `mock`.
    run("doctests", &["test", "--workspace", "--doc", "--all-features"])?;
    // The library crates as another project uses them: only their public APIs and features.
    downstream::test(&workspace_root())
}

fn ci() -> Result<(), String> {
    run("fmt", &["fmt", "--all", "--check"])?;
    run("clippy", &["clippy", "--workspace", "--all-targets", "--all-features", "--", "-D", "warnings"])?;
    downstream::lint(&workspace_root())?;
    report(tidy::check(&workspace_root()))?;
    report(deps::check(&cargo(), &workspace_root()))?;
    test()?;
    examples()?;
    // Warnings denied: a broken intra-doc link fails CI like a compiler warning does. Every
    // feature on, as docs.rs builds the library crates' pages.
    run_with_env("docs", &["doc", "--workspace", "--no-deps", "--all-features"], &[("RUSTDOCFLAGS", "-D warnings")])?;
    eprintln!("xtask: ci passed");
    Ok(())
}

/// Runs each library crate's examples, which use only its public API: the downstream path.
fn examples() -> Result<(), String> {
    run("example", &["run", "--quiet", "-p", "tether-manager", "--example", "custom_backend"])?;
    // The supervisor alone, without the engine.
    run("example", &["run", "--quiet", "-p", "tether-proxy-daemon", "--no-default-features", "--example", "supervise"])
}

fn run_with_env(step: &str, args: &[&str], vars: &[(&str, &str)]) -> Result<(), String> {
    eprintln!("xtask: {step}: cargo {}", args.join(" "));
    let status = Command::new(cargo())
        .args(args)
        .envs(vars.iter().copied())
        .current_dir(workspace_root())
        .status()
        .map_err(|err| format!("{step}: cannot run cargo: {err}"))?;
    if status.success() { Ok(()) } else { Err(format!("{step} failed ({status})")) }
}
