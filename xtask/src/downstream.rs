//! The crate in `downstream/`: outside the workspace, it uses the library crates as another
//! project would. This module formats, lints and tests it, runs its one test that must fail
//! and checks that it does, and checks that its lock file agrees with the workspace's.
//!
//! It runs `cargo` with `--manifest-path` and the workspace's target dir, so that the
//! dependencies both build the same way are compiled once; it never edits a file.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The crate's manifest, relative to the workspace root.
const MANIFEST: &str = "downstream/Cargo.toml";

/// The crate's test that must fail: a mock's expectation that the engine never meets.
const MUST_FAIL: &str = "must_fail::an_unmet_expectation_fails_the_test";

/// What mockall says, when a mock is dropped, of an expectation called fewer times than it
/// asked for.
const UNMET_EXPECTATION: &str = "which is fewer than expected";

/// `cargo fmt --check` and clippy with `-D warnings` on the crate, and its lock file
/// against the workspace's.
pub(crate) fn lint(root: &Path) -> Result<(), String> {
    crate::report(lock_drift(root))?;
    run(root, "downstream fmt", &["fmt", "--manifest-path", MANIFEST, "--check"])?;
    let clippy = ["clippy", "--manifest-path", MANIFEST, "--locked", "--all-targets", "--", "-D", "warnings"];
    run(root, "downstream clippy", &clippy)
}

/// The crate's tests, then its must-fail test alone, which must fail with the mock's message.
pub(crate) fn test(root: &Path) -> Result<(), String> {
    run(root, "downstream tests", &["test", "--manifest-path", MANIFEST, "--locked"])?;
    let args =
        ["test", "--manifest-path", MANIFEST, "--locked", "--test", "it", "--", "--ignored", "--exact", MUST_FAIL];
    eprintln!("xtask: downstream must-fail test: cargo {}", args.join(" "));
    let output = cargo(root)?
        .args(args)
        // The panic's message is the point; a backtrace would only bury it.
        .env("RUST_BACKTRACE", "0")
        .output()
        .map_err(|err| format!("downstream must-fail test: cannot run cargo: {err}"))?;
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    eprint!("{text}");
    must_fail_verdict(output.status.success(), &text)?;
    eprintln!("xtask: downstream must-fail test failed, as it must");
    Ok(())
}

/// Whether the run of the must-fail test shows that test, alone, failing with the mock's
/// unmet expectation; `passed` is whether cargo succeeded.
fn must_fail_verdict(passed: bool, output: &str) -> Result<(), String> {
    let problem = if passed {
        "passed"
    } else if !output.contains(&format!("test {MUST_FAIL} ... FAILED")) {
        "did not run, or did not fail as a test (does the crate build?)"
    } else if !output.contains("0 passed; 1 failed") {
        "did not run alone"
    } else if !output.contains(UNMET_EXPECTATION) {
        "failed, but not with the mock's unmet expectation"
    } else {
        return Ok(());
    };
    Err(format!("downstream test {MUST_FAIL} {problem}: it must fail with mockall's \"{UNMET_EXPECTATION}\""))
}

/// Every package version in `downstream/Cargo.lock` that the workspace's `Cargo.lock` holds
/// in other versions only: the crate would then be tested against other versions than the
/// workspace, and build them twice.
fn lock_drift(root: &Path) -> Result<Vec<String>, String> {
    let read = |path: &Path| fs::read_to_string(path).map_err(|err| format!("{}: {err}", path.display()));
    Ok(drift(&read(&root.join("Cargo.lock"))?, &read(&root.join("downstream/Cargo.lock"))?))
}

/// What [`lock_drift`] reports, from the text of both lock files.
fn drift(workspace_lock: &str, downstream_lock: &str) -> Vec<String> {
    let workspace = locked_packages(workspace_lock);
    let downstream = locked_packages(downstream_lock);
    let mut problems = Vec::new();
    for (name, version) in &downstream {
        let versions: Vec<&str> =
            workspace.iter().filter(|(other, _)| other == name).map(|(_, version)| version.as_str()).collect();
        if !versions.is_empty() && !versions.contains(&version.as_str()) {
            let locked = versions.join(", ");
            let refresh = "refresh it as downstream/README.md says";
            problems.push(format!("downstream/Cargo.lock: {name} {version}, where Cargo.lock has {locked}; {refresh}"));
        }
    }
    problems
}

/// The name and version of every package in the text of a `Cargo.lock`.
fn locked_packages(lock: &str) -> Vec<(String, String)> {
    let quoted = |line: &str, key: &str| {
        let value = line.strip_prefix(key)?.trim().strip_prefix('=')?.trim();
        Some(value.strip_prefix('"')?.strip_suffix('"')?.to_owned())
    };
    let mut packages = Vec::new();
    let mut name = None;
    for line in lock.lines() {
        if line == "[[package]]" {
            name = None;
        } else if let Some(value) = quoted(line, "name ") {
            name = Some(value);
        } else if let (Some(version), Some(name)) = (quoted(line, "version "), name.take()) {
            packages.push((name, version));
        }
    }
    packages
}

/// `cargo`, in the workspace root, building into the workspace's target dir.
fn cargo(root: &Path) -> Result<Command, String> {
    let mut command = Command::new(crate::cargo());
    command.current_dir(root).env("CARGO_TARGET_DIR", target_dir(root)?);
    Ok(command)
}

fn run(root: &Path, step: &str, args: &[&str]) -> Result<(), String> {
    eprintln!("xtask: {step}: cargo {}", args.join(" "));
    let status = cargo(root)?.args(args).status().map_err(|err| format!("{step}: cannot run cargo: {err}"))?;
    if status.success() { Ok(()) } else { Err(format!("{step} failed ({status})")) }
}

/// The workspace's target dir, wherever the environment or cargo's config puts it.
fn target_dir(root: &Path) -> Result<PathBuf, String> {
    let metadata = crate::deps::metadata(&crate::cargo(), root)?;
    let dir = metadata["target_directory"].as_str().ok_or("cargo metadata names no target directory")?;
    Ok(PathBuf::from(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_downstream_lock_agrees_with_the_workspace_lock() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let problems = lock_drift(root).unwrap();
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn packages_are_read_from_a_lock_file() {
        let lock = "version = 4\n\n[[package]]\nname = \"a\"\nversion = \"1.0.0\"\nsource = \"x\"\n\n\
                    [[package]]\nname = \"b\"\nversion = \"0.2.1\"\ndependencies = [\n \"a\",\n]\n";
        let expected = [("a".to_owned(), "1.0.0".to_owned()), ("b".to_owned(), "0.2.1".to_owned())];
        assert_eq!(locked_packages(lock), expected);
    }

    #[test]
    fn a_version_the_workspace_does_not_lock_is_reported() {
        let lock = |packages: &[(&str, &str)]| -> String {
            packages
                .iter()
                .map(|(name, version)| format!("[[package]]\nname = \"{name}\"\nversion = \"{version}\"\n\n"))
                .collect()
        };
        let workspace = lock(&[("tokio", "1.54.1"), ("syn", "1.0.109"), ("syn", "2.0.100"), ("xtask", "0.1.0")]);
        let agreeing = lock(&[("tokio", "1.54.1"), ("syn", "1.0.109"), ("tether-downstream", "0.0.0")]);
        assert_eq!(drift(&workspace, &agreeing), Vec::<String>::new());
        let drifted = lock(&[("tokio", "1.50.0"), ("syn", "2.0.100")]);
        let problems = drift(&workspace, &drifted);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("tokio 1.50.0, where Cargo.lock has 1.54.1"), "{problems:?}");
    }

    /// What cargo prints when the must-fail test ran alone and ended with `message`.
    fn failed_with(message: &str) -> String {
        format!(
            "running 1 test\ntest {MUST_FAIL} ... FAILED\n\nfailures:\n\n---- {MUST_FAIL} stdout ----\n\n\
             thread '{MUST_FAIL}' panicked at manager/src/backend.rs:292:41:\n{message}\n\n\
             test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 11 filtered out\n"
        )
    }

    #[test]
    fn only_a_failure_with_the_unmet_expectation_counts() {
        let unmet = "MockProxyHandle::stop: Expectation(<anything>) called 0 time(s) which is fewer than expected 1";
        assert_eq!(must_fail_verdict(false, &failed_with(unmet)), Ok(()));

        let passed = format!("test {MUST_FAIL} ... ok\n\ntest result: ok. 1 passed; 0 failed\n");
        assert!(must_fail_verdict(true, &passed).unwrap_err().contains("passed"));
        let other_panic = failed_with("called `Result::unwrap()` on an `Err` value: TimedOut");
        assert!(must_fail_verdict(false, &other_panic).unwrap_err().contains("not with the mock's"));
        let build_error = "error[E0425]: cannot find value `x` in this scope\nerror: could not compile";
        assert!(must_fail_verdict(false, build_error).unwrap_err().contains("did not run"));
        let not_alone = failed_with(unmet).replace("0 passed; 1 failed", "3 passed; 1 failed");
        assert!(must_fail_verdict(false, &not_alone).unwrap_err().contains("alone"));
    }
}
