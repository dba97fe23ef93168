//! The data dir as hostile ground: links planted in it are reported and replaced, never
//! followed, and their targets never touched; loose modes are tightened on start.

use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};

use assert_cmd::prelude::*;
use nix::sys::signal::Signal;

use crate::support::*;

/// The warning every replaced entry produces.
const REPLACED: &str = "replaced an entry of the data dir that tether does not use as it is";

fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

/// A file and a directory outside the data dir, for links to point at, with what is needed
/// to prove afterwards that nothing changed them.
struct Targets {
    _temp: tempfile::TempDir,
    file: PathBuf,
    dir: PathBuf,
}

impl Targets {
    const CONTENT: &'static str = "not tether's\n";

    fn new() -> Self {
        let temp = tempfile::tempdir().unwrap();
        let file = temp.path().join("target-file");
        std::fs::write(&file, Self::CONTENT).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let dir = temp.path().join("target-dir");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        Self { _temp: temp, file, dir }
    }

    #[track_caller]
    fn assert_untouched(&self) {
        assert_eq!(std::fs::read_to_string(&self.file).unwrap(), Self::CONTENT, "the target file's content");
        assert_eq!(mode(&self.file), 0o644, "the target file's mode");
        assert_eq!(mode(&self.dir), 0o755, "the target directory's mode");
        let entries: Vec<_> = std::fs::read_dir(&self.dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(entries.is_empty(), "nothing was written into the target directory: {entries:?}");
    }
}

fn is_link(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

#[track_caller]
fn assert_private_file(path: &Path) {
    let metadata = std::fs::symlink_metadata(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    assert!(metadata.is_file(), "{} is a regular file", path.display());
    assert_eq!(mode(path), 0o600, "{}", path.display());
}

#[track_caller]
fn assert_private_dir(path: &Path) {
    let metadata = std::fs::symlink_metadata(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    assert!(metadata.is_dir(), "{} is a real directory", path.display());
    assert_eq!(mode(path), 0o700, "{}", path.display());
}

/// Asserts that the agent's log has a replacement warning naming `path`.
#[track_caller]
fn assert_reported(agent: &Agent, path: &Path) {
    let logs = agent.logs();
    let reported = logs.lines().any(|line| line.contains(REPLACED) && line.contains(&*path.to_string_lossy()));
    assert!(reported, "a warning names {}:\n{logs}", path.display());
}

/// A service whose proxy prints `hello` and then sleeps.
fn greeter(name: &str) -> String {
    format!(
        "[[service]]\nname = \"{name}\"\n[service.proxy]\n\
         command = [\"/bin/sh\", \"-c\", \"echo hello; exec sleep 3600\"]\nkill_timeout = \"2s\"\n"
    )
}

#[track_caller]
fn wait_for_greeting(log: &Path) {
    wait_until("the proxy's output in its log file", || {
        let text = std::fs::read_to_string(log).map_err(|err| err.to_string())?;
        if text.contains("hello") { Ok(()) } else { Err(format!("{text:?}")) }
    });
}

#[test]
fn a_link_planted_at_a_log_file_is_replaced_and_its_target_left_alone() {
    let dirs = Dirs::new();
    let targets = Targets::new();
    let log = dirs.data.join("logs/web-proxy-stdout.log");
    std::fs::create_dir_all(log.parent().unwrap()).unwrap();
    symlink(&targets.file, &log).unwrap();
    dirs.write_config("a.toml", &greeter("web"));
    let _sweep = SweepOnDrop(dirs.socket());

    let agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("web-proxy", "running");
    wait_for_greeting(&log);
    assert_private_file(&log);
    assert_reported(&agent, &log);
    targets.assert_untouched();
}

#[test]
fn linked_logs_pids_and_registrations_directories_are_replaced_by_private_ones() {
    let dirs = Dirs::new();
    let targets = Targets::new();
    std::fs::create_dir(&dirs.data).unwrap();
    for name in ["logs", "pids", "registrations"] {
        symlink(&targets.dir, dirs.data.join(name)).unwrap();
    }
    dirs.write_config("a.toml", &greeter("web"));
    let _sweep = SweepOnDrop(dirs.socket());

    let agent = Agent::start(&dirs, &root_flags());
    for name in ["logs", "pids", "registrations"] {
        assert_private_dir(&dirs.data.join(name));
        assert_reported(&agent, &dirs.data.join(name));
    }
    agent.wait_state("web-proxy", "running");
    wait_for_greeting(&dirs.data.join("logs/web-proxy-stdout.log"));
    wait_for("the pid file", || dirs.data.join("pids/web-proxy.pid").exists().then_some(()));
    let file = dirs.temp.path().join("api.toml");
    std::fs::write(&file, "[[service]]\nname = \"api\"\nport = 9000\n").unwrap();
    tether().arg("register").arg(&file).arg("--data-dir").arg(&dirs.data).assert().code(0);
    assert_private_file(&dirs.data.join("registrations/api.json"));
    targets.assert_untouched();
}

#[test]
fn a_link_planted_at_the_lock_file_is_replaced_and_the_lock_still_holds() {
    let dirs = Dirs::new();
    let targets = Targets::new();
    std::fs::create_dir(&dirs.data).unwrap();
    let lock = dirs.data.join("agent.lock");
    symlink(&targets.file, &lock).unwrap();

    let agent = Agent::start(&dirs, &root_flags());
    assert_private_file(&lock);
    assert_reported(&agent, &lock);
    let mut second = Agent::spawn(&dirs, &root_flags());
    assert!(!second.wait().success(), "a second agent is refused");
    assert!(second.logs().contains("another agent is running with the data dir"), "{}", second.logs());
    assert_eq!(get(&agent.socket, "/v1/agent/health").unwrap().status, 200, "the first agent still works");
    targets.assert_untouched();
}

#[test]
fn links_planted_at_the_snapshot_and_the_tokens_are_not_read_through() {
    let dirs = Dirs::new();
    let targets = Targets::new();
    std::fs::create_dir(&dirs.data).unwrap();
    for name in ["snapshot.json", "tokens.json"] {
        symlink(&targets.file, dirs.data.join(name)).unwrap();
    }
    dirs.write_config("a.toml", &sleeper("web"));
    let _sweep = SweepOnDrop(dirs.socket());

    let mut agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("web-proxy", "running");
    let logs = agent.logs();
    assert!(logs.contains("symbolic link, which tether does not follow"), "{logs}");
    for name in ["snapshot.json.corrupt", "tokens.json.corrupt"] {
        assert!(is_link(&dirs.data.join(name)), "the link itself was moved aside to {name}");
    }
    wait_for("the snapshot", || {
        std::fs::symlink_metadata(dirs.data.join("snapshot.json")).ok().filter(|m| m.is_file())
    });
    agent.signal(Signal::SIGTERM);
    assert!(agent.wait().success());
    assert_private_file(&dirs.data.join("snapshot.json"));
    assert_private_file(&dirs.data.join("tokens.json"));
    targets.assert_untouched();
}

#[test]
fn rotation_replaces_a_link_planted_at_the_rotated_copy() {
    let dirs = Dirs::new();
    let targets = Targets::new();
    let log = dirs.data.join("logs/web-proxy-stdout.log");
    let copy = dirs.data.join("logs/web-proxy-stdout.log.1");
    std::fs::create_dir_all(log.parent().unwrap()).unwrap();
    symlink(&targets.file, &copy).unwrap();
    dirs.write_config(
        "a.toml",
        "[[service]]\nname = \"web\"\n[service.proxy]\n\
         command = [\"/bin/sh\", \"-c\", \"head -c 300000 /dev/zero | tr '\\\\0' x; exec sleep 3600\"]\n\
         kill_timeout = \"2s\"\nlog_max_size = \"16KiB\"\nlog_keep = 2\n",
    );
    let _sweep = SweepOnDrop(dirs.socket());

    let agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("web-proxy", "running");
    wait_until("a rotated copy", || {
        let metadata = std::fs::symlink_metadata(&copy).map_err(|err| err.to_string())?;
        if metadata.is_file() { Ok(()) } else { Err(format!("{:?}", metadata.file_type())) }
    });
    assert_private_file(&copy);
    assert_private_file(&log);
    // A fast writer is rotated a little before its cap: the copy holds some of its output,
    // and nothing else.
    let held = std::fs::read(&copy).unwrap();
    assert!(!held.is_empty() && held.iter().all(|byte| *byte == b'x'), "the copy holds the proxy's output");
    targets.assert_untouched();
}

#[test]
fn loose_modes_in_the_data_dir_are_tightened_on_start() {
    let dirs = Dirs::new();
    for name in ["", "logs", "pids", "registrations"] {
        std::fs::create_dir_all(dirs.data.join(name)).unwrap();
        std::fs::set_permissions(dirs.data.join(name), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let old_log = dirs.data.join("logs/old-proxy-stdout.log");
    std::fs::write(&old_log, "from an older agent\n").unwrap();
    std::fs::set_permissions(&old_log, std::fs::Permissions::from_mode(0o644)).unwrap();

    let agent = Agent::start(&dirs, &root_flags());
    for name in ["", "logs", "pids", "registrations"] {
        assert_private_dir(&dirs.data.join(name));
    }
    assert_private_file(&old_log);
    assert_private_file(&dirs.data.join("agent.lock"));
    assert!(agent.logs().contains("restricted the mode of an entry of the data dir"), "{}", agent.logs());
}
