//! Where the tests and the benchmark find `tether-test-proxy`, the stand-in proxy of the
//! unpublished `test-proxy` crate.
//!
//! A workspace run (`cargo xtask test`, `cargo test --workspace`) builds it beside the test
//! binaries; a narrower run (`cargo test -p tether-proxy-daemon`) does not, and a change to
//! its source leaves the one there stale: then it is built here, once per process, by the
//! cargo that builds these tests, into the same target dir and profile.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::SystemTime;

/// The fixture's source, whose changes a built binary must not be older than.
const SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../test-proxy/src/main.rs");

/// The path of the built stand-in proxy.
pub fn test_proxy() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(locate).clone()
}

fn locate() -> PathBuf {
    // `<target>/<profile>/deps/<test>-<hash>` (or `<target>/<profile>/<bench>` for no harness
    // run through deps too): the fixture is `<target>/<profile>/tether-test-proxy`.
    let exe = std::env::current_exe().expect("the test binary knows its own path");
    let profile_dir = exe.ancestors().find(|dir| dir.join("deps").is_dir()).expect("a cargo target dir").to_owned();
    let program = profile_dir.join("tether-test-proxy");
    if !is_current(&program) {
        build(&profile_dir);
    }
    assert!(program.is_file(), "building the test proxy left no {}", program.display());
    program
}

/// Whether `program` exists and was built after its source last changed.
fn is_current(program: &Path) -> bool {
    let modified = |path: &Path| std::fs::metadata(path).and_then(|meta| meta.modified()).ok();
    let source = modified(Path::new(SOURCE)).unwrap_or(SystemTime::UNIX_EPOCH);
    modified(program).is_some_and(|built| built >= source)
}

fn build(profile_dir: &Path) {
    let target_dir = profile_dir.parent().expect("a profile dir is inside the target dir");
    let profile = match profile_dir.file_name().and_then(|name| name.to_str()) {
        Some("debug") => "dev",
        Some(name) => name,
        None => "dev",
    };
    let status = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "--package", "tether-test-proxy", "--profile", profile, "--target-dir"])
        .arg(target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("cargo runs");
    assert!(status.success(), "cargo could not build the test proxy: {status}");
}
