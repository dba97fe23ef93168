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
    write_atomic_with(&path, Durability::PowerLoss, |out| out.write_all(b"one, ").and_then(|()| out.write_all(b"two")))
        .unwrap();
    assert_eq!(fs::read(&path).unwrap(), b"one, two");
    let failing = |out: &mut dyn Write| {
        out.write_all(b"half")?;
        Err(io::Error::other("the producer failed"))
    };
    assert!(write_atomic_with(&path, Durability::PowerLoss, failing).is_err());
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
fn a_registration_keeps_its_proxys_token_in_its_own_file() {
    let root = tempfile::tempdir().unwrap();
    let dir = DataDir::open(root.path()).unwrap();
    let store = dir.registrations();
    let token = ProxyToken::generate().unwrap();
    let kept = store.save_with_token(&service("web"), &token).unwrap();
    store.save(&service("api")).unwrap();
    let loaded = store.load().unwrap();
    assert_eq!(loaded.services, [service("api"), service("web")]);
    if !kept {
        // A file system without extended attributes: the caller writes tokens.json first.
        assert!(loaded.tokens.is_empty());
        return;
    }
    let proxy = ServiceId::new("web").unwrap().proxy_id();
    assert_eq!(loaded.tokens, BTreeMap::from([(proxy, token.clone())]));
    assert_eq!(store.token(&ServiceId::new("web").unwrap()), Some(token.clone()));
    assert_eq!(store.token(&ServiceId::new("api").unwrap()), None);
    assert_eq!(store.token(&ServiceId::new("none").unwrap()), None);
    // What is not a token is left out; the registration still loads.
    let file = fs::File::open(dir.registrations_dir().join("web.json")).unwrap();
    rustix::fs::fsetxattr(&file, TOKEN_ATTRIBUTE, b"not a token", rustix::fs::XattrFlags::empty()).unwrap();
    let loaded = store.load().unwrap();
    assert!(loaded.tokens.is_empty());
    assert!(loaded.damaged.is_empty());
    assert_eq!(loaded.services.len(), 2);
    // Saved again without its token: the new file has none.
    assert!(store.save_with_token(&service("web"), &token).unwrap());
    store.save(&service("web")).unwrap();
    assert!(store.load().unwrap().tokens.is_empty());
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

/// A file outside the data dir that planted links point at, and its content and mode, so
/// that a test can prove it was never touched.
struct Target {
    path: PathBuf,
}

impl Target {
    const CONTENT: &'static str = "not tether's\n";

    fn new(parent: &Path, name: &str) -> Self {
        let path = parent.join(name);
        fs::write(&path, Self::CONTENT).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        Self { path }
    }

    #[track_caller]
    fn assert_untouched(&self) {
        assert_eq!(fs::read_to_string(&self.path).unwrap(), Self::CONTENT, "{}", self.path.display());
        assert_eq!(mode(&self.path), 0o644, "{}", self.path.display());
    }
}

fn is_link(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

fn unsafe_entry(err: &PersistError) -> Option<UnsafeEntry> {
    let (PersistError::Read { source, .. } | PersistError::Write { source, .. }) = err else { return None };
    source.get_ref()?.downcast_ref::<UnsafeEntry>().copied()
}

#[test]
fn linked_subdirectories_are_replaced_by_private_directories_and_their_targets_left_alone() {
    let parent = tempfile::tempdir().unwrap();
    let elsewhere = parent.path().join("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    fs::set_permissions(&elsewhere, fs::Permissions::from_mode(0o755)).unwrap();
    let target = Target::new(&elsewhere, "web-proxy-stdout.log");
    let root = parent.path().join("data");
    fs::create_dir(&root).unwrap();
    for name in ["logs", "pids", "registrations"] {
        std::os::unix::fs::symlink(&elsewhere, root.join(name)).unwrap();
    }

    let dir = DataDir::open(&root).unwrap();
    for path in [dir.logs_dir(), dir.pids_dir(), dir.registrations_dir()] {
        assert!(!is_link(&path) && path.is_dir(), "{}", path.display());
        assert_eq!(mode(&path), 0o700, "{}", path.display());
    }
    dir.logs().open_append("web-proxy-stdout.log").unwrap().write_all(b"tether's\n").unwrap();
    dir.registrations().save(&service("web")).unwrap();
    target.assert_untouched();
    assert_eq!(mode(&elsewhere), 0o755);
    let names: Vec<_> = fs::read_dir(&elsewhere).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["web-proxy-stdout.log"]);
}

#[test]
fn a_root_that_is_a_link_is_the_operators_choice_and_is_followed() {
    let parent = tempfile::tempdir().unwrap();
    let real = parent.path().join("real");
    fs::create_dir(&real).unwrap();
    let link = parent.path().join("data");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let dir = DataDir::open(&link).unwrap();
    assert!(is_link(&link), "the operator's link stays");
    assert!(real.join("logs").is_dir());
    dir.tokens().save(&BTreeMap::new()).unwrap();
    assert!(real.join("tokens.json").is_file());
}

#[test]
fn loose_modes_are_restricted_on_open() {
    let parent = tempfile::tempdir().unwrap();
    let root = parent.path().join("data");
    for sub in ["", "logs", "pids", "registrations"] {
        fs::create_dir_all(root.join(sub)).unwrap();
        fs::set_permissions(root.join(sub), fs::Permissions::from_mode(0o755)).unwrap();
    }
    let files = ["tokens.json", "logs/web-proxy-stdout.log", "logs/web-proxy-stdout.log.1", "pids/web-proxy.pid"];
    for file in files {
        fs::write(root.join(file), "x").unwrap();
        fs::set_permissions(root.join(file), fs::Permissions::from_mode(0o644)).unwrap();
    }
    // A file with a second name elsewhere is not changed through this one.
    let outside = Target::new(parent.path(), "outside");
    fs::hard_link(&outside.path, root.join("logs/shared.log")).unwrap();

    DataDir::open(&root).unwrap();
    for sub in ["", "logs", "pids", "registrations"] {
        assert_eq!(mode(&root.join(sub)), 0o700, "{sub}");
    }
    for file in files {
        assert_eq!(mode(&root.join(file)), 0o600, "{file}");
    }
    outside.assert_untouched();
}

#[test]
fn appending_replaces_a_planted_link_and_never_writes_through_it() {
    let parent = tempfile::tempdir().unwrap();
    let dir = DataDir::open(parent.path().join("data")).unwrap();
    let logs = dir.logs();
    let target = Target::new(parent.path(), "target");
    std::os::unix::fs::symlink(&target.path, dir.logs_dir().join("link.log")).unwrap();
    std::os::unix::fs::symlink(parent.path().join("missing"), dir.logs_dir().join("dangling.log")).unwrap();
    fs::hard_link(&target.path, dir.logs_dir().join("hard.log")).unwrap();
    nix::unistd::mkfifo(&dir.logs_dir().join("fifo.log"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();

    for name in ["link.log", "dangling.log", "hard.log", "fifo.log"] {
        logs.open_append(name).unwrap().write_all(b"tether's\n").unwrap();
        let path = dir.logs_dir().join(name);
        assert!(fs::symlink_metadata(&path).unwrap().is_file(), "{name}");
        assert_eq!(fs::read_to_string(&path).unwrap(), "tether's\n", "{name}");
        assert_eq!(mode(&path), 0o600, "{name}");
    }
    target.assert_untouched();
    assert!(!parent.path().join("missing").exists(), "a dangling link's target is not created");
}

#[test]
fn appending_keeps_what_is_there_and_restricts_its_mode() {
    let parent = tempfile::tempdir().unwrap();
    let dir = DataDir::open(parent.path().join("data")).unwrap();
    let path = dir.logs_dir().join("web-proxy-stdout.log");
    fs::write(&path, "before\n").unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
    let mut file = dir.logs().open_append("web-proxy-stdout.log").unwrap();
    file.write_all(b"after\n").unwrap();
    assert_eq!(fs::read_to_string(&path).unwrap(), "before\nafter\n");
    assert_eq!(mode(&path), 0o600);
    // Blocking, like any file a child process gets as its output.
    let status = nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_GETFL).unwrap();
    assert_eq!(status & nix::fcntl::OFlag::O_NONBLOCK.bits(), 0);

    fs::create_dir(dir.logs_dir().join("dir.log")).unwrap();
    let err = dir.logs().open_append("dir.log").unwrap_err();
    assert!(err.to_string().ends_with("logs/dir.log"), "{err}");
    assert!(dir.logs_dir().join("dir.log").is_dir(), "a directory in the way is not removed");
}

#[test]
fn only_a_plain_regular_file_has_a_regular_size() {
    let parent = tempfile::tempdir().unwrap();
    let dir = DataDir::open(parent.path().join("data")).unwrap();
    let logs = dir.logs();
    fs::write(dir.logs_dir().join("web.log"), "12345").unwrap();
    assert_eq!(logs.regular_size("web.log"), Some(5));
    assert_eq!(logs.regular_size("missing.log"), None);
    let target = parent.path().join("big");
    fs::write(&target, vec![b'x'; 4096]).unwrap();
    std::os::unix::fs::symlink(&target, dir.logs_dir().join("link.log")).unwrap();
    assert_eq!(logs.regular_size("link.log"), None, "a link is not followed");
    fs::hard_link(&target, dir.logs_dir().join("hard.log")).unwrap();
    assert_eq!(logs.regular_size("hard.log"), None, "a file with other links is not a log");
    fs::create_dir(dir.logs_dir().join("dir.log")).unwrap();
    assert_eq!(logs.regular_size("dir.log"), None);
    assert_eq!(logs.regular_size("../data"), None, "one component only");
}

#[test]
fn a_handle_keeps_its_directory_when_the_path_is_replaced_by_a_link() {
    let parent = tempfile::tempdir().unwrap();
    let dir = DataDir::open(parent.path().join("data")).unwrap();
    let elsewhere = parent.path().join("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    fs::rename(dir.logs_dir(), parent.path().join("moved")).unwrap();
    std::os::unix::fs::symlink(&elsewhere, dir.logs_dir()).unwrap();

    dir.logs().open_append("web-proxy-stdout.log").unwrap().write_all(b"x").unwrap();
    dir.logs().write_atomic("copy", Durability::Crash, b"y").unwrap();
    assert_eq!(fs::read_dir(&elsewhere).unwrap().count(), 0);
    assert_eq!(fs::read_to_string(parent.path().join("moved/web-proxy-stdout.log")).unwrap(), "x");
    assert_eq!(fs::read_to_string(parent.path().join("moved/copy")).unwrap(), "y");
}

#[test]
fn reading_refuses_links_and_special_files_and_leaves_them_in_place() {
    let parent = tempfile::tempdir().unwrap();
    let dir = DataDir::open(parent.path().join("data")).unwrap();
    let target = Target::new(parent.path(), "target");
    let root = dir.root_dir();
    std::os::unix::fs::symlink(&target.path, dir.root().join("link")).unwrap();
    fs::hard_link(&target.path, dir.root().join("hard")).unwrap();
    nix::unistd::mkfifo(&dir.root().join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();

    let refused = |name: &str| unsafe_entry(&root.read(name).unwrap_err());
    assert_eq!(refused("link"), Some(UnsafeEntry::SymbolicLink));
    assert_eq!(refused("hard"), Some(UnsafeEntry::HardLink));
    assert_eq!(refused("fifo"), Some(UnsafeEntry::NotRegular));
    assert!(root.read("missing").unwrap().is_none());
    assert!(is_link(&dir.root().join("link")));
    target.assert_untouched();

    let err = read_no_follow(&dir.root().join("link")).unwrap_err();
    assert_eq!(err.get_ref().and_then(|e| e.downcast_ref::<UnsafeEntry>()), Some(&UnsafeEntry::SymbolicLink));
    assert_eq!(read_no_follow(&dir.root().join("missing")).unwrap_err().kind(), io::ErrorKind::NotFound);
    fs::write(dir.root().join("plain"), "text").unwrap();
    assert_eq!(read_no_follow(&dir.root().join("plain")).unwrap(), b"text");
}

#[test]
fn atomic_writes_replace_a_planted_link_instead_of_following_it() {
    let parent = tempfile::tempdir().unwrap();
    let dir = DataDir::open(parent.path().join("data")).unwrap();
    let target = Target::new(parent.path(), "target");
    for durability in [Durability::PowerLoss, Durability::Crash] {
        let path = dir.pids_dir().join("web-proxy.pid");
        let _ = fs::remove_file(&path);
        std::os::unix::fs::symlink(&target.path, &path).unwrap();
        dir.pids().write_atomic("web-proxy.pid", durability, b"42\n").unwrap();
        assert!(fs::symlink_metadata(&path).unwrap().is_file());
        assert_eq!(fs::read_to_string(&path).unwrap(), "42\n");
        assert_eq!(mode(&path), 0o600);
    }
    // The path-based write does the same for its file.
    let snapshot = dir.snapshot_path();
    std::os::unix::fs::symlink(&target.path, &snapshot).unwrap();
    write_atomic(&snapshot, b"{}").unwrap();
    assert!(fs::symlink_metadata(&snapshot).unwrap().is_file());
    target.assert_untouched();
}

#[test]
fn renames_removals_and_new_files_stay_in_the_directory_and_never_follow_links() {
    let parent = tempfile::tempdir().unwrap();
    let dir = DataDir::open(parent.path().join("data")).unwrap();
    let target = Target::new(parent.path(), "target");
    let pids = dir.pids();
    std::os::unix::fs::symlink(&target.path, dir.pids_dir().join("link")).unwrap();

    let err = pids.create_new("link").unwrap_err();
    assert!(matches!(&err, PersistError::Write { source, .. } if source.kind() == io::ErrorKind::AlreadyExists));
    assert!(pids.rename("link", "moved").unwrap());
    assert!(is_link(&dir.pids_dir().join("moved")));
    assert!(!pids.rename("link", "again").unwrap(), "nothing left to rename");
    assert!(pids.remove("moved", Durability::PowerLoss).unwrap());
    assert!(!pids.remove("moved", Durability::Crash).unwrap());
    target.assert_untouched();

    pids.create_new("new").unwrap().write_all(b"1").unwrap();
    assert_eq!(mode(&dir.pids_dir().join("new")), 0o600);
    let mut names = pids.names().unwrap();
    names.sort();
    assert_eq!(names, ["new"]);
    pids.sync().unwrap();

    for bad in ["", ".", "..", "a/b", "../escape"] {
        let err = pids.write_atomic(bad, Durability::Crash, b"x").unwrap_err();
        assert!(
            matches!(&err, PersistError::Write { source, .. } if source.kind() == io::ErrorKind::InvalidInput),
            "{bad:?}"
        );
    }
    assert!(!parent.path().join("escape").exists());
}

#[test]
fn linked_tokens_and_registrations_are_not_read_through_but_moved_aside() {
    let parent = tempfile::tempdir().unwrap();
    let dir = DataDir::open(parent.path().join("data")).unwrap();
    let target = Target::new(parent.path(), "target");
    std::os::unix::fs::symlink(&target.path, dir.tokens_path()).unwrap();
    std::os::unix::fs::symlink(&target.path, dir.registrations_dir().join("web.json")).unwrap();

    let tokens = dir.tokens().load();
    assert!(tokens.tokens.is_empty());
    let damaged = tokens.damaged.unwrap();
    assert!(damaged.problem.contains("symbolic link"), "{}", damaged.problem);
    assert!(is_link(&dir.root().join("tokens.json.corrupt")), "the link itself is moved aside");

    let registrations = dir.registrations().load().unwrap();
    assert!(registrations.services.is_empty());
    assert!(registrations.damaged[0].problem.contains("symbolic link"), "{}", registrations.damaged[0].problem);
    assert!(is_link(&dir.registrations_dir().join("web.json.corrupt")));
    target.assert_untouched();
}

#[test]
fn a_removed_subdirectory_is_made_again_when_a_file_is_next_created_in_it() {
    let parent = tempfile::tempdir().unwrap();
    let dir = DataDir::open(parent.path().join("data")).unwrap();
    let logs = dir.logs().clone();
    fs::remove_dir_all(dir.logs_dir()).unwrap();
    logs.open_append("web-proxy-stdout.log").unwrap().write_all(b"x").unwrap();
    assert_eq!(fs::read_to_string(dir.logs_dir().join("web-proxy-stdout.log")).unwrap(), "x");
    assert_eq!(mode(&dir.logs_dir()), 0o700);
    assert_eq!(&logs, dir.logs(), "every clone sees the new directory");

    // Removed again, with a link in its place: made again without following it.
    let target = Target::new(parent.path(), "target");
    let elsewhere = parent.path().join("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    fs::remove_dir_all(dir.logs_dir()).unwrap();
    std::os::unix::fs::symlink(&elsewhere, dir.logs_dir()).unwrap();
    dir.logs().write_atomic("copy", Durability::Crash, b"y").unwrap();
    assert!(!is_link(&dir.logs_dir()));
    assert_eq!(fs::read_to_string(dir.logs_dir().join("copy")).unwrap(), "y");
    assert_eq!(fs::read_dir(&elsewhere).unwrap().count(), 0);
    target.assert_untouched();
}

/// The names in `dir`, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    names
}

#[test]
fn the_temporaries_a_crash_left_in_the_data_dir_are_removed_and_nothing_else() {
    let parent = tempfile::tempdir().unwrap();
    let dir = DataDir::open(parent.path().join("data")).unwrap();
    let own = std::process::id();
    // What a crash between the write and the rename leaves, in each directory; and what
    // only looks like it.
    for (path, kind) in [
        (dir.root().join(".snapshot.json.tmp.4000000.3"), "file"),
        (dir.registrations_dir().join(".web.json.tmp.17.0"), "file"),
        (dir.pids_dir().join(".web-proxy.pid.tmp.17.1"), "file"),
        (dir.logs_dir().join(".web-proxy-stdout.log.1.tmp.4000000.0"), "file"),
        (dir.root().join(format!(".tokens.json.tmp.{own}.9")), "file"),
        (dir.root().join(".snapshot.json.tmp.17"), "file"),
        (dir.root().join(".tmp.17.0"), "file"),
        (dir.root().join("snapshot.json.tmp.17.0"), "file"),
        (dir.root().join(".notes.tmp.17.x"), "file"),
        (dir.root().join(".dir.tmp.17.0"), "dir"),
    ] {
        if kind == "dir" {
            fs::create_dir(&path).unwrap();
        } else {
            fs::write(&path, "partial").unwrap();
        }
    }
    write_atomic(&dir.snapshot_path(), b"{}").unwrap();
    let mut removed = dir.remove_temporaries();
    removed.sort();
    let mut expected = vec![
        dir.root().join(".snapshot.json.tmp.4000000.3"),
        dir.registrations_dir().join(".web.json.tmp.17.0"),
        dir.pids_dir().join(".web-proxy.pid.tmp.17.1"),
        dir.logs_dir().join(".web-proxy-stdout.log.1.tmp.4000000.0"),
    ];
    expected.sort();
    assert_eq!(removed, expected);
    assert_eq!(
        names_in(dir.root()),
        [
            ".dir.tmp.17.0".into(),
            ".notes.tmp.17.x".into(),
            ".snapshot.json.tmp.17".into(),
            ".tmp.17.0".into(),
            format!(".tokens.json.tmp.{own}.9"),
            "logs".into(),
            "pids".into(),
            "registrations".into(),
            "snapshot.json".into(),
            "snapshot.json.tmp.17.0".into(),
        ],
        "this process's own temporary, look-alikes and a directory stay"
    );
    assert_eq!(fs::read(dir.snapshot_path()).unwrap(), b"{}");
}

#[test]
fn beside_a_file_only_its_own_temporaries_of_gone_writers_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("haproxy.cfg");
    fs::write(&file, "in place").unwrap();
    let live = std::process::id();
    // No process has a pid as high as the kernel's `pid_max`.
    let gone: u32 = fs::read_to_string("/proc/sys/kernel/pid_max").unwrap().trim().parse().unwrap();
    let planted = [
        format!(".haproxy.cfg.tmp.{gone}.0"),
        format!(".haproxy.cfg.tmp.{live}.1"),
        format!(".other.cfg.tmp.{gone}.0"),
    ];
    for name in &planted {
        fs::write(dir.path().join(name), "partial").unwrap();
    }
    let removed = remove_abandoned_temporaries(&file).unwrap();
    assert_eq!(removed, [dir.path().join(&planted[0])]);
    assert_eq!(names_in(dir.path()), [planted[1].clone(), planted[2].clone(), "haproxy.cfg".into()]);
}

#[test]
fn a_directory_is_opened_without_following_a_link_at_any_component() {
    let temp = tempfile::tempdir().unwrap();
    // A tempdir may itself sit below a link (macOS's /var): resolve it first.
    let base = fs::canonicalize(temp.path()).unwrap();
    fs::create_dir_all(base.join("real/sub")).unwrap();
    std::os::unix::fs::symlink(base.join("real"), base.join("linked")).unwrap();

    let opened = PrivateDir::open_no_follow(&base.join("real/sub")).unwrap();
    assert_eq!(opened.path(), base.join("real/sub"));
    assert!(dir::walk_no_follow(&base.join("real/sub")).is_ok());

    // Both ways of opening name the component that is a link.
    for error in [
        PrivateDir::open_no_follow(&base.join("linked/sub")).unwrap_err(),
        dir::walk_no_follow(&base.join("linked/sub")).unwrap_err(),
        PrivateDir::open_no_follow(&base.join("linked")).unwrap_err(),
    ] {
        let linked = error.get_ref().and_then(|inner| inner.downcast_ref::<LinkedComponent>());
        assert_eq!(linked.map(|l| l.path.clone()), Some(base.join("linked")), "{error:?}");
    }
    for path in [Path::new("relative/dir"), &base.join("real/../real")] {
        let error = PrivateDir::open_no_follow(path).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidInput, "{}", path.display());
    }
    assert_eq!(PrivateDir::open_no_follow(&base.join("missing")).unwrap_err().kind(), io::ErrorKind::NotFound);
}
