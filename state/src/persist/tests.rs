//! Tests of the data dir: layout, modes, atomic writes, and damaged files moved aside.

use std::os::unix::fs::PermissionsExt;

use super::*;
use crate::service::{ProxySpec, ServiceName};

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn service(id: &str) -> Service {
    let mut service =
        Service::new(ServiceId::new(id).unwrap(), ServiceName::new(id).unwrap()).with_proxy(ProxySpec::default());
    service.port = Some(8080);
    service
}

#[test]
fn data_dir_is_created_private_with_its_layout() {
    let parent = tempfile::tempdir().unwrap();
    let root = parent.path().join("data");
    let dir = DataDir::open(&root).unwrap();
    for path in [root.clone(), dir.registrations_dir(), dir.pids_dir(), dir.logs_dir()] {
        assert!(path.is_dir(), "{}", path.display());
        assert_eq!(mode(&path), 0o700, "{}", path.display());
    }
    let id = ServiceId::new("web").unwrap().proxy_id();
    assert_eq!(dir.pid_file(&id), root.join("pids/web-proxy.pid"));
    assert_eq!(dir.log_files(&id), (root.join("logs/web-proxy-stdout.log"), root.join("logs/web-proxy-stderr.log")));
    assert_eq!(dir.snapshot_path(), root.join("snapshot.json"));
    assert_eq!(dir.socket_path(), root.join("agent.sock"));
    // Opening again is fine.
    DataDir::open(&root).unwrap();
}

#[test]
fn data_dir_under_a_file_is_a_clear_error() {
    let parent = tempfile::tempdir().unwrap();
    let file = parent.path().join("file");
    fs::write(&file, "").unwrap();
    let err = DataDir::open(file.join("data")).unwrap_err();
    assert!(err.to_string().starts_with("cannot write "), "{err}");
    assert!(err.to_string().ends_with("file/data"), "{err}");
}

#[test]
fn atomic_writes_replace_whole_files_with_mode_0600_and_leave_no_temp() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("snapshot.json");
    write_atomic(&path, b"one").unwrap();
    write_atomic(&path, b"two").unwrap();
    assert_eq!(fs::read(&path).unwrap(), b"two");
    assert_eq!(mode(&path), 0o600);
    let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["snapshot.json"]);
}

#[test]
fn a_failed_atomic_write_keeps_the_old_content() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.json");
    write_atomic(&path, b"old").unwrap();
    // A directory in the way of the rename: the write fails, the old file stays.
    let blocked = dir.path().join("blocked");
    fs::create_dir(&blocked).unwrap();
    fs::write(blocked.join("inside"), "").unwrap();
    assert!(write_atomic(&blocked, b"new").is_err());
    assert_eq!(fs::read(&path).unwrap(), b"old");
    let names: Vec<_> =
        fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert!(names.iter().all(|n| !n.contains(".tmp.")), "{names:?}");
}

#[test]
fn a_streamed_atomic_write_that_fails_keeps_the_old_content_and_leaves_no_temp() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.json");
    write_atomic_with(&path, |out| out.write_all(b"one, ").and_then(|()| out.write_all(b"two"))).unwrap();
    assert_eq!(fs::read(&path).unwrap(), b"one, two");
    let failing = |out: &mut dyn Write| {
        out.write_all(b"half")?;
        Err(io::Error::other("the producer failed"))
    };
    assert!(write_atomic_with(&path, failing).is_err());
    assert_eq!(fs::read(&path).unwrap(), b"one, two");
    let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["x.json"]);
}

#[test]
fn registrations_round_trip_and_removal_is_idempotent() {
    let root = tempfile::tempdir().unwrap();
    let dir = DataDir::open(root.path()).unwrap();
    let store = dir.registrations();
    store.save(&service("web")).unwrap();
    store.save(&service("api")).unwrap();
    let file = dir.registrations_dir().join("web.json");
    assert_eq!(mode(&file), 0o600);
    let loaded = store.load().unwrap();
    assert!(loaded.damaged.is_empty());
    assert_eq!(loaded.services, [service("api"), service("web")]);
    store.remove(&ServiceId::new("web").unwrap()).unwrap();
    store.remove(&ServiceId::new("web").unwrap()).unwrap();
    assert_eq!(store.load().unwrap().services, [service("api")]);
}

#[test]
fn damaged_registrations_are_moved_aside_and_reported() {
    let root = tempfile::tempdir().unwrap();
    let dir = DataDir::open(root.path()).unwrap();
    let store = dir.registrations();
    store.save(&service("good")).unwrap();
    let registrations = dir.registrations_dir();
    fs::write(registrations.join("broken.json"), "{\"name\": ").unwrap();
    fs::write(registrations.join("renamed.json"), "{\"name\": \"other\"}").unwrap();
    let loaded = store.load().unwrap();
    assert_eq!(loaded.services, [service("good")]);
    assert_eq!(loaded.damaged.len(), 2);
    let broken = &loaded.damaged[0];
    assert_eq!(broken.path, registrations.join("broken.json"));
    assert_eq!(broken.moved_to.as_deref(), Some(registrations.join("broken.json.corrupt").as_path()));
    assert!(broken.problem.contains("broken.json:1:9"), "{}", broken.problem);
    assert!(loaded.damaged[1].problem.contains("holds service other but is not named other.json"));
    assert!(registrations.join("broken.json.corrupt").exists());
    // Moved aside: the next load is clean.
    let again = store.load().unwrap();
    assert!(again.damaged.is_empty());
    assert_eq!(again.services.len(), 1);
}

#[test]
fn tokens_round_trip_in_a_private_file() {
    let root = tempfile::tempdir().unwrap();
    let dir = DataDir::open(root.path()).unwrap();
    let store = dir.tokens();
    assert!(store.load().tokens.is_empty());
    let tokens = BTreeMap::from([
        (ServiceId::new("web").unwrap().proxy_id(), ProxyToken::generate().unwrap()),
        (ServiceId::new("db").unwrap().proxy_id(), ProxyToken::generate().unwrap()),
    ]);
    store.save(&tokens).unwrap();
    assert_eq!(mode(&dir.tokens_path()), 0o600);
    let loaded = store.load();
    assert!(loaded.damaged.is_none());
    assert_eq!(loaded.tokens, tokens);
}

#[test]
fn a_damaged_token_file_is_moved_aside_and_reported() {
    let root = tempfile::tempdir().unwrap();
    let dir = DataDir::open(root.path()).unwrap();
    fs::write(dir.tokens_path(), "{\"version\": 1, \"tokens\": {\"web-proxy\": \"short\"}}").unwrap();
    let loaded = dir.tokens().load();
    assert!(loaded.tokens.is_empty());
    let damaged = loaded.damaged.unwrap();
    assert!(damaged.problem.contains("malformed"), "{}", damaged.problem);
    assert!(!damaged.problem.contains("short"), "the problem must not echo token material: {}", damaged.problem);
    assert!(root.path().join("tokens.json.corrupt").exists());

    fs::write(dir.tokens_path(), "{\"version\": 9, \"tokens\": {}}").unwrap();
    assert!(dir.tokens().load().damaged.unwrap().problem.contains("unknown format version 9"));
}
