//! Config directories: which files are read, in which order, what their errors say, and
//! what the incremental loader reads again.

use std::os::unix::fs::{MetadataExt as _, symlink};

use super::*;

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, text).unwrap();
    path
}

#[test]
fn dirs_load_toml_and_json_in_lexical_order_and_ignore_other_files() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "b.json", r#"{"service": [{"name": "b"}]}"#);
    write(dir.path(), "a.toml", "[[service]]\nname = \"a\"\n[[service]]\nname = \"c\"\n");
    write(dir.path(), "notes.txt", "not config");
    write(dir.path(), "x.toml.bak", "[[oops");
    let nested = dir.path().join("nested");
    fs::create_dir(&nested).unwrap();
    write(&nested, "d.toml", "[[service]]\nname = \"d\"\n");
    let entries = load_dirs(&[dir.path()]).unwrap().services;
    let ids: Vec<&str> = entries.iter().map(|e| e.service.id.as_str()).collect();
    assert_eq!(ids, ["a", "c", "b"]);
    assert_eq!(entries[2].file, dir.path().join("b.json"));
}

#[test]
fn dirs_report_every_error_and_cross_file_duplicates() {
    let one_dir = tempfile::tempdir().unwrap();
    let two_dir = tempfile::tempdir().unwrap();
    let first = write(one_dir.path(), "a.toml", "[[service]]\nname = \"web\"\n");
    write(one_dir.path(), "b.toml", "[[service]]\nname = \"db\"\nprot = 1\n");
    let second = write(two_dir.path(), "c.json", "{\"service\": [\n {\"name\": \"web\"}]}");
    let errors = load_dirs(&[one_dir.path(), two_dir.path()]).unwrap_err();
    let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(messages.len(), 2, "{messages:#?}");
    assert!(messages[0].contains("b.toml:3:1: field `service[0].prot`"), "{}", messages[0]);
    assert_eq!(
        messages[1],
        format!("{}:2:2: duplicate service id `web`: already defined at {}:1:1", second.display(), first.display())
    );
}

#[test]
fn ids_defined_again_in_a_second_file_show_one_line_each_in_that_files_order() {
    let dir = tempfile::tempdir().unwrap();
    let first = write(
        dir.path(),
        "a.toml",
        "[[service]]\nname = \"web\"\n[[service]]\nname = \"db\"\n[[service]]\nname = \"api\"\n",
    );
    let second = write(
        dir.path(),
        "b.toml",
        "[[service]]\nname = \"api\"\n[[service]]\nname = \"web\"\n[[service]]\nname = \"db\"\n",
    );
    let errors = load_dirs(&[dir.path()]).unwrap_err();
    let (first, second) = (first.display(), second.display());
    assert_eq!(
        errors.to_string(),
        format!(
            "{second}:1:1: duplicate service id `api`: already defined at {first}:5:1\n\
             {second}:3:1: duplicate service id `web`: already defined at {first}:1:1\n\
             {second}:5:1: duplicate service id `db`: already defined at {first}:3:1"
        )
    );
    assert_eq!(errors.len(), 3);
    assert_eq!(errors.first().location().line, Some(1));
}

#[test]
fn an_id_defined_twice_in_one_file_is_reported_at_the_second_definition() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "a.toml", "[[service]]\nname = \"web\"\n[[service]]\nname = \"web\"\n");
    let errors = load_dirs(&[dir.path()]).unwrap_err();
    assert_eq!(
        errors.to_string(),
        format!("{0}:3:1: duplicate service id `web`: already defined at {0}:1:1", file.display())
    );
}

#[test]
fn an_id_defined_again_in_a_later_dir_is_reported_there_even_when_its_file_sorts_first() {
    let one = tempfile::tempdir().unwrap();
    let two = tempfile::tempdir().unwrap();
    let late = write(one.path(), "z.toml", "[[service]]\nname = \"web\"\n");
    let early = write(two.path(), "a.json", "{\"service\": [{\"name\": \"web\"}]}");
    let message = |dirs: &[&Path]| load_dirs(dirs).unwrap_err().to_string();
    assert_eq!(
        message(&[one.path(), two.path()]),
        format!("{}:1:14: duplicate service id `web`: already defined at {}:1:1", early.display(), late.display())
    );
    assert_eq!(
        message(&[two.path(), one.path()]),
        format!("{}:1:1: duplicate service id `web`: already defined at {}:1:14", late.display(), early.display())
    );
}

#[test]
fn errors_come_in_the_order_the_files_were_read_with_their_causes() {
    let one = tempfile::tempdir().unwrap();
    let two = tempfile::tempdir().unwrap();
    let missing = one.path().join("missing");
    let first = write(one.path(), "a.toml", "[[service]]\nname = \"web\"\n");
    let again = write(one.path(), "b.toml", "[[service]]\nname = \"web\"\n");
    let broken = write(one.path(), "c.toml", "[[service]]\nname = \"db\"\nprot = 1\n");
    let last = write(two.path(), "a.toml", "[[service]]\nname = \"web\"\n");
    let errors = load_dirs(&[one.path(), &missing, two.path()]).unwrap_err();
    let lines: Vec<String> = errors.to_string().lines().map(str::to_owned).collect();
    assert_eq!(lines.len(), 4, "{errors}");
    let (first, again, broken, last) = (first.display(), again.display(), broken.display(), last.display());
    assert_eq!(lines[0], format!("{again}:1:1: duplicate service id `web`: already defined at {first}:1:1"));
    assert!(
        lines[1].starts_with(&format!("{broken}:3:1: field `service[0].prot`: unknown field `prot`")),
        "{}",
        lines[1]
    );
    assert_eq!(lines[2], format!("{}: cannot read: No such file or directory (os error 2)", missing.display()));
    assert_eq!(lines[3], format!("{last}:1:1: duplicate service id `web`: already defined at {first}:1:1"));
}

#[test]
fn unreadable_inputs_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let err = load_dirs(&[&missing]).unwrap_err().into_vec().remove(0);
    assert!(matches!(err, ConfigError::Read { .. }), "{err:?}");
    assert_eq!(err.to_string(), format!("{}: cannot read", missing.display()));

    fs::create_dir(dir.path().join("dir.toml")).unwrap();
    let binary = dir.path().join("bin.toml");
    fs::write(&binary, b"[[service]]\nname = \"\xff\"\n").unwrap();
    let huge = dir.path().join("huge.json");
    fs::File::create(&huge).unwrap().set_len(MAX_FILE_SIZE + 1).unwrap();
    let errors: Vec<String> = load_dirs(&[dir.path()]).unwrap_err().iter().map(ToString::to_string).collect();
    assert_eq!(
        errors,
        [
            format!("{}: not valid UTF-8", format_args!("{}:2:9", binary.display())),
            format!("{}/dir.toml: not a regular file", dir.path().display()),
            format!("{}: file is larger than {MAX_FILE_SIZE} bytes", huge.display()),
        ]
    );
}

#[test]
fn symlinked_files_are_followed() {
    let outside = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let target = write(outside.path(), "real.toml", "[[service]]\nname = \"web\"\n");
    symlink(&target, dir.path().join("web.toml")).unwrap();
    assert_eq!(load_dirs(&[dir.path()]).unwrap().services[0].service.id.as_str(), "web");
}

#[test]
fn a_fifo_in_the_config_dir_is_not_a_file_and_is_never_opened() {
    let outside = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Opening a FIFO for reading blocks until a writer comes: load in a thread, and fail
    // (rather than hang) if it does not answer.
    let mode = nix::sys::stat::Mode::from_bits_truncate(0o600);
    nix::unistd::mkfifo(&outside.path().join("fifo"), mode).unwrap();
    symlink(outside.path().join("fifo"), dir.path().join("linked.toml")).unwrap();
    nix::unistd::mkfifo(&dir.path().join("fifo.json"), mode).unwrap();
    let (sender, answer) = std::sync::mpsc::channel();
    let path = dir.path().to_owned();
    std::thread::spawn(move || sender.send(load_dirs(&[path]).map(|_| ()).unwrap_err()));
    let errors = answer.recv_timeout(Duration::from_secs(10)).expect("load_dirs opened a FIFO and blocked");
    let errors: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        errors,
        [
            format!("{}/fifo.json: not a regular file", dir.path().display()),
            format!("{}/linked.toml: not a regular file", dir.path().display()),
        ]
    );
}

/// A loader that trusts any file changed before it was read: only safe where every change
/// gets a later timestamp, which the tests below make sure of.
fn eager_loader(dirs: &[&Path]) -> ConfigLoader {
    ConfigLoader::with_settle_time(dirs.iter().map(|dir| dir.to_path_buf()).collect(), Duration::ZERO)
}

#[track_caller]
fn ids(entries: &[ConfigEntry]) -> Vec<&str> {
    entries.iter().map(|e| e.service.id.as_str()).collect()
}

/// Waits until a file changed now gets a later change time than `path` has: the file
/// system's clock ticks coarsely, and the tests need a change that its timestamps show.
fn wait_for_a_later_ctime(path: &Path) {
    let probe = path.with_extension("probe");
    let before = fs::metadata(path).unwrap().ctime_nsec() + fs::metadata(path).unwrap().ctime() * 1_000_000_000;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        fs::write(&probe, "").unwrap();
        let probed = fs::metadata(&probe).unwrap();
        if probed.ctime() * 1_000_000_000 + probed.ctime_nsec() > before {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the file system's clock did not move");
        std::thread::sleep(Duration::from_millis(1));
    }
    fs::remove_file(&probe).unwrap();
}

/// Rewrites `path` in place (same inode), then sets its modification time back.
fn rewrite_keeping_mtime(path: &Path, text: &str) {
    let mtime = fs::metadata(path).unwrap().modified().unwrap();
    let mut file = fs::OpenOptions::new().write(true).truncate(true).open(path).unwrap();
    std::io::Write::write_all(&mut file, text.as_bytes()).unwrap();
    file.set_modified(mtime).unwrap();
}

#[test]
fn a_loader_reads_only_changed_files_and_sees_added_and_removed_ones() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a.toml", "[[service]]\nname = \"a\"\n");
    let b = write(dir.path(), "b.toml", "[[service]]\nname = \"b\"\n");
    let mut loader = eager_loader(&[dir.path()]);
    assert_eq!(ids(&loader.load().unwrap().services), ["a", "b"]);
    assert_eq!(loader.last_stats(), LoadStats { read: 2, reused: 0 });
    assert_eq!(ids(&loader.load().unwrap().services), ["a", "b"]);
    assert_eq!(loader.last_stats(), LoadStats { read: 0, reused: 2 });

    write(dir.path(), "c.json", r#"{"service": [{"name": "c"}]}"#);
    let entries = loader.load().unwrap().services;
    assert_eq!(ids(&entries), ["a", "b", "c"]);
    assert_eq!(entries[2].file, dir.path().join("c.json"));
    assert_eq!(loader.last_stats(), LoadStats { read: 1, reused: 2 });

    fs::remove_file(&b).unwrap();
    assert_eq!(ids(&loader.load().unwrap().services), ["a", "c"]);
    assert_eq!(loader.last_stats(), LoadStats { read: 0, reused: 2 });

    // A new file under an old name is a new inode, whatever its size and times.
    write(dir.path(), "b.toml.new", "[[service]]\nname = \"d\"\n");
    fs::rename(dir.path().join("b.toml.new"), &b).unwrap();
    assert_eq!(ids(&loader.load().unwrap().services), ["a", "d", "c"]);
    assert_eq!(loader.last_stats(), LoadStats { read: 1, reused: 2 });
    assert_eq!(loader.load().unwrap().services, load_dirs(&[dir.path()]).unwrap().services);
}

#[test]
fn a_rewrite_in_place_that_keeps_size_and_mtime_is_still_read_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "web.toml", "[[service]]\nname = \"aaa\"\n");
    let mut loader = eager_loader(&[dir.path()]);
    assert_eq!(ids(&loader.load().unwrap().services), ["aaa"]);
    // The change time still moves, as no tool can set it.
    wait_for_a_later_ctime(&path);
    rewrite_keeping_mtime(&path, "[[service]]\nname = \"bbb\"\n");
    assert_eq!(ids(&loader.load().unwrap().services), ["bbb"]);
    assert_eq!(loader.last_stats(), LoadStats { read: 1, reused: 0 });
}

#[test]
fn a_file_changed_just_before_it_was_read_is_read_again_every_time() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "web.toml", "[[service]]\nname = \"aaa\"\n");
    let mut loader = ConfigLoader::new(vec![dir.path().to_owned()]);
    assert_eq!(ids(&loader.load().unwrap().services), ["aaa"]);
    // Within one tick of the file system's clock nothing in the metadata changes: only not
    // trusting a file that changed so recently catches this.
    rewrite_keeping_mtime(&path, "[[service]]\nname = \"bbb\"\n");
    assert_eq!(ids(&loader.load().unwrap().services), ["bbb"]);
    assert_eq!(loader.last_stats(), LoadStats { read: 1, reused: 0 });
    assert_eq!(ids(&loader.load().unwrap().services), ["bbb"]);
    assert_eq!(loader.last_stats(), LoadStats { read: 1, reused: 0 });
}

#[test]
fn a_loader_reports_exactly_the_errors_of_load_dirs_and_reads_only_the_fix() {
    let one_dir = tempfile::tempdir().unwrap();
    let two_dir = tempfile::tempdir().unwrap();
    write(one_dir.path(), "a.toml", "[[service]]\nname = \"web\"\n");
    let broken = write(one_dir.path(), "b.toml", "[[service]]\nname = \"db\"\nprot = 1\n");
    let duplicate = write(two_dir.path(), "c.json", "{\"service\": [\n {\"name\": \"web\"}]}");
    let dirs = [one_dir.path(), two_dir.path()];
    let messages = |errors: ConfigErrors| errors.iter().map(ToString::to_string).collect::<Vec<_>>();
    let expected = messages(load_dirs(&dirs).unwrap_err());
    assert_eq!(expected.len(), 2, "{expected:#?}");
    let mut loader = eager_loader(&dirs);
    assert_eq!(messages(loader.load().unwrap_err()), expected);
    // Again, with the files that did load taken from the first pass.
    assert_eq!(messages(loader.load().unwrap_err()), expected);
    assert_eq!(loader.last_stats(), LoadStats { read: 1, reused: 2 });

    write(one_dir.path(), "b.toml.new", "[[service]]\nname = \"db\"\nport = 1\n");
    fs::rename(one_dir.path().join("b.toml.new"), &broken).unwrap();
    fs::remove_file(&duplicate).unwrap();
    assert_eq!(ids(&loader.load().unwrap().services), ["web", "db"]);
    assert_eq!(loader.last_stats(), LoadStats { read: 1, reused: 1 });
}

#[test]
fn a_cached_file_that_becomes_unreadable_gets_the_error_of_load_dirs() {
    let outside = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let target = write(outside.path(), "real.toml", "[[service]]\nname = \"web\"\n");
    let link = dir.path().join("web.toml");
    symlink(&target, &link).unwrap();
    let mut loader = eager_loader(&[dir.path()]);
    assert_eq!(ids(&loader.load().unwrap().services), ["web"]);
    fs::remove_file(&target).unwrap();
    let mode = nix::sys::stat::Mode::from_bits_truncate(0o600);
    nix::unistd::mkfifo(&target, mode).unwrap();
    let errors: Vec<String> = loader.load().unwrap_err().iter().map(ToString::to_string).collect();
    assert_eq!(errors, [format!("{}: not a regular file", link.display())]);
    fs::remove_file(&target).unwrap();
    let errors: Vec<String> = loader.load().unwrap_err().iter().map(ToString::to_string).collect();
    assert_eq!(errors, [format!("{}: cannot read", link.display())]);
}

#[test]
fn control_characters_in_file_names_are_escaped() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "evil\n\x1b[31m.toml", "[[oops");
    let message = load_dirs(&[dir.path()]).unwrap_err().first().to_string();
    assert!(!message.contains('\n') && !message.contains('\x1b'), "{message:?}");
    assert!(message.contains("evil\\n\\u{1b}[31m.toml"), "{message:?}");
}

#[test]
fn depends_on_reads_proxy_and_service_ids_and_is_written_back() {
    let text = "[[service]]\nname = \"web\"\n[service.proxy]\ndepends_on = { db = \"ready\", \"cache-proxy\" = \"started\" }\n";
    let services = parse_file(text, Format::Toml, &Origin::Body).unwrap();
    let depends_on = &services[0].proxy.as_ref().unwrap().depends_on;
    let written: Vec<(&str, Condition)> = depends_on.iter().map(|(name, c)| (name.as_str(), *c)).collect();
    assert_eq!(written, [("cache-proxy", Condition::Started), ("db", Condition::Ready)]);
    for format in [Format::Toml, Format::Json] {
        let again = parse_file(&to_file_text(&services, format).unwrap(), format, &Origin::Body).unwrap();
        assert_eq!(again, services, "{format:?}");
    }
}

#[test]
fn depends_on_refuses_unknown_conditions_and_invalid_names_naming_the_field() {
    let bad_condition = "[[service]]\nname = \"web\"\n[service.proxy]\ndepends_on = { db = \"healthy\" }\n";
    let err = parse_file(bad_condition, Format::Toml, &Origin::Body).unwrap_err().to_string();
    assert!(err.contains("request body:4:") && err.contains("service[0].proxy.depends_on"), "{err}");
    assert!(err.contains("unknown condition \"healthy\""), "{err}");
    let bad_name = r#"{"service": [{"name": "web", "proxy": {"depends_on": {"../db": "ready"}}}]}"#;
    let err = parse_file(bad_name, Format::Json, &Origin::Body).unwrap_err().to_string();
    assert!(err.contains("service[0].proxy.depends_on") && err.contains("../db"), "{err}");
}

#[test]
fn a_dependency_cycle_across_files_is_refused_naming_the_cycle_with_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(dir.path(), "a.toml", "[[service]]\nname = \"a\"\n[service.proxy]\ndepends_on = { b = \"ready\" }\n");
    let b = write(
        dir.path(),
        "b.json",
        "{\"service\": [{\"name\": \"c\", \"proxy\": {}},\n {\"name\": \"b\", \"proxy\": {\"depends_on\": {\"a-proxy\": \"started\"}}}]}",
    );
    let errors = load_dirs(&[dir.path()]).unwrap_err();
    let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        messages,
        [format!(
            "{a}:4:14: field `service[0].proxy.depends_on`: dependency cycle: a-proxy ({a}:4:14) -> b-proxy ({b}:2:40) -> a-proxy",
            a = a.display(),
            b = b.display()
        )]
    );
    // The incremental loader refuses it too, and accepts the fix.
    let mut loader = ConfigLoader::with_settle_time(vec![dir.path().to_owned()], Duration::ZERO);
    assert!(loader.load().is_err());
    write(dir.path(), "a.toml", "[[service]]\nname = \"a\"\n[service.proxy]\n");
    assert_eq!(loader.load().unwrap().services.len(), 3);
}

#[test]
fn a_dependency_on_itself_or_on_an_unknown_proxy() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a.toml", "[[service]]\nname = \"a\"\n[service.proxy]\ndepends_on = { nowhere = \"ready\" }\n");
    assert_eq!(load_dirs(&[dir.path()]).unwrap().services.len(), 1, "an unknown dependency may come from the API");
    write(dir.path(), "a.toml", "[[service]]\nname = \"a\"\n[service.proxy]\ndepends_on = { a = \"ready\" }\n");
    let err = load_dirs(&[dir.path()]).unwrap_err().to_string();
    assert!(err.contains("dependency cycle: a-proxy (") && err.ends_with(") -> a-proxy"), "{err}");
}

#[test]
fn one_destination_for_the_templates_of_two_proxies_is_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let service = |name: &str, destination: &str| {
        format!(
            "[[service]]\nname = \"{name}\"\n[service.proxy]\n[[service.proxy.template]]\ncontents = \"x\"\ndestination = \"{destination}\"\n"
        )
    };
    let a = write(dir.path(), "a.toml", &service("a", "/etc/edge/edge.cfg"));
    let b = write(
        dir.path(),
        "b.toml",
        &format!("{}{}", service("c", "/etc/edge/c.cfg"), service("b", "/etc/edge/edge.cfg")),
    );
    let errors = load_dirs(&[dir.path()]).unwrap_err();
    let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        messages,
        [format!(
            "{b}:7:1: field `service[1].proxy.template[0].destination`: /etc/edge/edge.cfg is also the destination of a \
             template of a-proxy ({a}:1:1): two proxies cannot write one file",
            a = a.display(),
            b = b.display()
        )]
    );
    write(dir.path(), "b.toml", &service("b", "/etc/edge/b.cfg"));
    assert_eq!(load_dirs(&[dir.path()]).unwrap().services.len(), 2);
}
