//! Log files: appended across restarts, rotated at their cap.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nix::sys::signal::Signal;
use tether_proxy_daemon::{LogPolicy, ProcessUpdate};

use crate::support::*;

fn rotated(path: &Path, index: u32) -> PathBuf {
    PathBuf::from(format!("{}.{index}", path.display()))
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map(|metadata| metadata.len()).unwrap_or(0)
}

#[tokio::test]
async fn logs_are_appended_across_restarts() {
    let fx = Fixture::new();
    let spec = fx.spec("append-proxy", &["--print", "hello"]);
    let stdout = spec.logs.stdout.path();
    std::fs::create_dir_all(stdout.parent().unwrap()).unwrap();
    std::fs::write(&stdout, "from before\n").unwrap();
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let count = || std::fs::read_to_string(&stdout).unwrap_or_default().matches("hello\n").count();
    eventually("the first greeting", || count() == 1).await;
    for _ in 0..2 {
        let pid = handle.status().figures.pid.unwrap();
        let before = count();
        send(pid, Signal::SIGKILL);
        restarted(&handle, pid).await;
        eventually("the next greeting", || count() == before + 1).await;
    }
    let log = std::fs::read_to_string(&stdout).unwrap();
    assert_eq!(log, "from before\nhello\nhello\nhello\n");
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn logs_are_rotated_at_their_cap() {
    let fx = Fixture::new();
    let mut spec = fx.spec("chatty-proxy", &["--write-bytes", "300000"]);
    spec.logs.limits = LogPolicy { max_size: 64 * 1024, keep: 2, ..LogPolicy::default() };
    let stdout = spec.logs.stdout.path();
    let handle = fx.supervisor.spawn(spec).await.unwrap();

    eventually("a rotated copy and a file back under its cap", || {
        rotated(&stdout, 1).exists() && size(&stdout) <= 64 * 1024
    })
    .await;
    assert!(!rotated(&stdout, 3).exists(), "only `keep` copies are kept");
    assert_eq!(std::fs::metadata(rotated(&stdout, 1)).unwrap().permissions().mode() & 0o777, 0o600);
    // A copy holds at most the cap and a tenth, however far past it the file was found.
    for index in [1, 2] {
        assert!(size(&rotated(&stdout, index)) <= 64 * 1024 * 11 / 10, "copy {index} passes the cap");
    }

    // The process keeps its fd: new output lands in the truncated file, from offset 0.
    let pid = handle.status().figures.pid.unwrap();
    assert!(!is_dead(pid));
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn log_limit_changes_apply_in_place() {
    let fx = Fixture::new();
    let spec = fx.spec("limits-proxy", &["--write-bytes", "20000"]);
    let stdout = spec.logs.stdout.path();
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    eventually("the output", || size(&stdout) == 20000).await;
    assert!(!rotated(&stdout, 1).exists(), "under the default cap nothing rotates");

    handle
        .update(ProcessUpdate {
            log_limits: Some(LogPolicy { max_size: 4096, keep: 1, ..LogPolicy::default() }),
            ..ProcessUpdate::default()
        })
        .unwrap();
    eventually("rotation under the new cap", || rotated(&stdout, 1).exists() && size(&stdout) == 0).await;
    // The newest 4505 bytes: a copy never holds more than the cap and a tenth.
    assert_eq!(size(&rotated(&stdout, 1)), 4096 + 409);
    assert!(!rotated(&stdout, 2).exists());
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn links_planted_at_a_log_file_and_its_rotated_copy_are_never_followed() {
    let fx = Fixture::new();
    let outside = tempfile::tempdir().unwrap();
    let targets: Vec<PathBuf> = ["log-target", "copy-target"].iter().map(|name| outside.path().join(name)).collect();
    for target in &targets {
        std::fs::write(target, "not tether's\n").unwrap();
        std::fs::set_permissions(target, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let mut spec = fx.spec("planted-proxy", &["--write-bytes", "300000"]);
    spec.logs.limits = LogPolicy { max_size: 64 * 1024, keep: 2, ..LogPolicy::default() };
    let stdout = spec.logs.stdout.path();
    std::os::unix::fs::symlink(&targets[0], &stdout).unwrap();
    std::os::unix::fs::symlink(&targets[1], rotated(&stdout, 1)).unwrap();

    let handle = fx.supervisor.spawn(spec).await.unwrap();
    eventually("a rotated copy and a file back under its cap", || {
        std::fs::symlink_metadata(rotated(&stdout, 1)).is_ok_and(|m| m.is_file()) && size(&stdout) <= 64 * 1024
    })
    .await;
    for target in &targets {
        assert_eq!(std::fs::read_to_string(target).unwrap(), "not tether's\n", "{}", target.display());
        assert_eq!(std::fs::metadata(target).unwrap().permissions().mode() & 0o777, 0o644, "{}", target.display());
    }
    for path in [stdout.clone(), rotated(&stdout, 1)] {
        let metadata = std::fs::symlink_metadata(&path).unwrap();
        assert!(metadata.is_file(), "{}", path.display());
        assert_eq!(metadata.permissions().mode() & 0o777, 0o600, "{}", path.display());
    }
    within("stop", handle.stop()).await;
}

/// Runs alone (`exclusive_`): how far a log passes its cap depends on how soon the agent
/// gets a core after the writer filled its file.
#[tokio::test]
#[allow(clippy::print_stderr)] // the figures belong in the test output
async fn exclusive_a_log_written_at_50_mb_a_second_never_passes_its_cap_by_a_tenth() {
    const CAP: u64 = 10 << 20;
    const RATE: u64 = 50_000_000;
    let fx = Fixture::new();
    let mut spec = fx.spec("loud-proxy", &["--write-rate", &format!("{RATE}:3"), "--sleep"]);
    spec.logs.limits = LogPolicy { max_size: CAP, keep: 30, ..LogPolicy::default() };
    let stdout = spec.logs.stdout.path();
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let start = std::time::Instant::now();
    let mut largest = 0;
    // The writer writes for 3 s; the live file is sampled all the while.
    while start.elapsed() < std::time::Duration::from_millis(3500) {
        largest = largest.max(size(&stdout));
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    let copies: Vec<u64> = (1..=30).map(|index| size(&rotated(&stdout, index))).filter(|&size| size > 0).collect();
    let written = copies.iter().sum::<u64>() + size(&stdout);
    assert!(copies.len() >= 5, "{} rotations for {written} bytes", copies.len());
    let limit = CAP + CAP / 10;
    assert!(largest <= limit, "the live log reached {largest} bytes (cap {CAP})");
    for (index, copy) in copies.iter().enumerate() {
        assert!(*copy <= limit, "copy {} holds {copy} bytes (cap {CAP})", index + 1);
    }
    eprintln!(
        "{written} bytes written, {} copies, the largest {} bytes, the live log at most {largest}",
        copies.len(),
        copies.iter().max().unwrap()
    );
    within("stop", handle.stop()).await;
}
