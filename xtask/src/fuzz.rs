//! `cargo xtask fuzz [SECONDS] [TARGET...]`: every fuzz target in `fuzz/`, one after
//! another, each for a bounded time; fails if any target finds a crash.
//!
//! The targets are a cargo-fuzz (libFuzzer) package outside the workspace. This module
//! installs cargo-fuzz when it is missing and runs it on the stable toolchain with
//! `RUSTC_BOOTSTRAP=1`, which lets cargo-fuzz pass its `-Z` flags (AddressSanitizer,
//! coverage instrumentation). It never edits the seed corpora in `fuzz/corpus/`: what
//! libFuzzer finds goes to `fuzz/target/corpus/`, crashes to `fuzz/artifacts/`.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};

/// The fuzz targets, as named by the `[[bin]]` sections of `fuzz/Cargo.toml`.
const TARGETS: &[&str] = &["config_toml", "config_json", "register_body", "api_params"];

/// How long each target runs when the command line does not say, in seconds.
const DEFAULT_SECONDS: u64 = 60;

const USAGE: &str = "usage: cargo xtask fuzz [SECONDS] [TARGET...]";

/// Runs the chosen fuzz targets (all by default) for `SECONDS` each.
pub(crate) fn run(root: &Path, args: Vec<String>) -> Result<(), String> {
    let (seconds, targets) = parse_args(&args)?;
    if !root.join("fuzz").is_dir() {
        return Err("there are no fuzz targets (fuzz/ is missing)".to_owned());
    }
    if !has_cargo_fuzz() {
        eprintln!("xtask: cargo-fuzz is not installed; installing it from crates.io");
        crate::run("install cargo-fuzz", &["install", "cargo-fuzz", "--locked"])?;
    }
    let max_total_time = format!("-max_total_time={seconds}");
    let mut crashed = Vec::new();
    for target in &targets {
        // libFuzzer writes new inputs to the first corpus dir and only reads the others.
        let found = format!("fuzz/target/corpus/{target}");
        let seeds = format!("fuzz/corpus/{target}");
        fs::create_dir_all(root.join(&found)).map_err(|err| format!("cannot create {found}: {err}"))?;
        let args = [
            "fuzz",
            "run",
            "--debug-assertions",
            target,
            &found,
            &seeds,
            "--",
            &max_total_time,
            "-print_final_stats=1",
        ];
        if let Err(err) = crate::run_with_env(&format!("fuzz {target}"), &args, &[("RUSTC_BOOTSTRAP", "1")]) {
            eprintln!("xtask: {err}; the input is in fuzz/artifacts/{target}/");
            crashed.push(*target);
        }
    }
    if crashed.is_empty() {
        eprintln!("xtask: fuzz: {} target(s) ran {seconds} s each without a crash", targets.len());
        return Ok(());
    }
    Err(format!("fuzz targets failed: {}", crashed.join(", ")))
}

/// The seconds per target and the targets to run.
fn parse_args(args: &[String]) -> Result<(u64, Vec<&'static str>), String> {
    let mut seconds = DEFAULT_SECONDS;
    let mut targets = Vec::new();
    for (index, arg) in args.iter().enumerate() {
        if let Ok(value) = arg.parse::<u64>() {
            if index != 0 || value == 0 {
                return Err(format!("unexpected `{arg}`: SECONDS comes first and is at least 1\n{USAGE}"));
            }
            seconds = value;
        } else if let Some(target) = TARGETS.iter().find(|target| **target == arg.as_str()) {
            targets.push(*target);
        } else {
            return Err(format!("unknown fuzz target `{arg}` (targets: {})\n{USAGE}", TARGETS.join(", ")));
        }
    }
    if targets.is_empty() {
        targets = TARGETS.to_vec();
    }
    Ok((seconds, targets))
}

fn has_cargo_fuzz() -> bool {
    Command::new(crate::cargo())
        .args(["fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &[&str]) -> Vec<String> {
        words.iter().map(|word| (*word).to_owned()).collect()
    }

    #[test]
    fn every_target_runs_for_the_default_time_unless_told() {
        assert_eq!(parse_args(&[]).unwrap(), (DEFAULT_SECONDS, TARGETS.to_vec()));
        assert_eq!(parse_args(&args(&["600"])).unwrap(), (600, TARGETS.to_vec()));
        assert_eq!(parse_args(&args(&["5", "api_params"])).unwrap(), (5, vec!["api_params"]));
    }

    #[test]
    fn unknown_targets_and_misplaced_seconds_are_refused() {
        assert!(parse_args(&args(&["config"])).unwrap_err().contains("unknown fuzz target `config`"));
        assert!(parse_args(&args(&["api_params", "5"])).unwrap_err().contains("SECONDS comes first"));
        assert!(parse_args(&args(&["0"])).unwrap_err().contains("at least 1"));
    }

    #[test]
    fn the_target_list_matches_the_fuzz_package() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let manifest = fs::read_to_string(root.join("fuzz/Cargo.toml")).unwrap();
        let mut declared: Vec<&str> = manifest
            .split("[[bin]]")
            .skip(1)
            .filter_map(|section| section.lines().find_map(|line| line.trim().strip_prefix("name = ")))
            .map(|name| name.trim_matches('"'))
            .collect();
        declared.sort_unstable();
        let mut known = TARGETS.to_vec();
        known.sort_unstable();
        assert_eq!(declared, known);
        for target in TARGETS {
            assert!(root.join(format!("fuzz/fuzz_targets/{target}.rs")).is_file(), "{target}");
            assert!(root.join(format!("fuzz/corpus/{target}")).is_dir(), "{target}: no seed corpus");
        }
    }
}
