//! Every way a process is created, seen from outside — the environment it gets, and how
//! a bare program name is found in its `PATH`: the standard library's
//! `posix_spawn` (no code in the child), a child that places inherited listeners and execs
//! itself, a user switch, and a birth in the process's cgroup (`clone3`), with and without
//! a user switch. (The way into a cgroup through `cgroup.procs`, which only a refused
//! `clone3` takes, is chosen by the spawn module's own tests.)
//!
//! Each test runs on every way this host offers; a way it cannot take (not root, no
//! writable cgroup2) is skipped with the reason printed.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tether_proxy_daemon::{Cgroups, InheritedSocket, ProcessSpec, ProcessState, SpawnError, Supervisor};

use crate::support::*;

/// A way of creating a process that a caller of the supervisor can choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Nothing runs in the child before its exec: `posix_spawn`.
    PosixSpawn,
    /// The child places a listener at descriptor 3 and execs itself.
    Listeners,
    /// The child drops to `nobody` before its exec (root only).
    UserSwitch,
    /// Born in its cgroup (where cgroup2 is writable).
    IntoCgroup,
    /// Born in its cgroup, as `nobody` (root only).
    IntoCgroupAsUser,
}

const WAYS: [Way; 5] = [Way::PosixSpawn, Way::Listeners, Way::UserSwitch, Way::IntoCgroup, Way::IntoCgroupAsUser];

impl Way {
    fn slug(self) -> &'static str {
        match self {
            Self::PosixSpawn => "spawn",
            Self::Listeners => "listeners",
            Self::UserSwitch => "user",
            Self::IntoCgroup => "cgroup",
            Self::IntoCgroupAsUser => "cgroup-user",
        }
    }

    fn switches_user(self) -> bool {
        matches!(self, Self::UserSwitch | Self::IntoCgroupAsUser)
    }

    fn uses_cgroups(self) -> bool {
        matches!(self, Self::IntoCgroup | Self::IntoCgroupAsUser)
    }
}

/// What a way needs: a supervisor (with a cgroup subtree of its own, or without), and what
/// it adds to a spec. Dropping it kills and removes whatever is left in its subtree.
struct Setup {
    way: Way,
    supervisor: Supervisor,
    cgroups: Option<Cgroups>,
    listener: Option<Arc<std::os::fd::OwnedFd>>,
}

impl Setup {
    /// `None`, with the reason printed, when this host cannot take `way` in `test`.
    fn new(fx: &Fixture, way: Way, test: &str) -> Option<Self> {
        #[allow(clippy::print_stderr)] // a skipped way says why
        let skip = |reason: &str| eprintln!("{test}: skipping the {way:?} way: {reason}");
        if way.switches_user() && !is_root() {
            skip("needs root");
            return None;
        }
        let cgroups = if way.uses_cgroups() {
            match Cgroups::open(None, &fx.data_dir().join(way.slug())) {
                Ok(cgroups) => Some(cgroups),
                Err(unavailable) => {
                    skip(&unavailable.to_string());
                    return None;
                }
            }
        } else {
            None
        };
        let supervisor = Supervisor::with_cgroups(fx.data.notify_address(), cgroups.clone()).expect("supervisor");
        let listener = (way == Way::Listeners).then(|| {
            let path = fx.data_dir().join("ways.sock");
            let address = tether_state::ListenAddress::parse(&path.to_string_lossy()).unwrap();
            Arc::new(tether_proxy_daemon::bind_listener(&address).expect("a listener"))
        });
        Some(Self { way, supervisor, cgroups, listener })
    }

    /// Makes `spec` take this way.
    fn apply(&self, spec: &mut ProcessSpec) {
        if self.way.switches_user() {
            spec.user = Some("nobody".into());
        }
        if let Some(socket) = &self.listener {
            spec.listeners = vec![InheritedSocket { name: "public".into(), socket: Arc::clone(socket) }];
        }
    }

    /// The cgroup `pid` is in, relative to this setup's subtree, when it uses one.
    fn cgroup_of(&self, pid: u32) -> Option<PathBuf> {
        let cgroups = self.cgroups.as_ref()?;
        let line = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        let path = line.lines().find_map(|line| line.strip_prefix("0::"))?;
        let subtree = cgroups.dir().file_name()?;
        let (_, inside) = path.split_once(&*subtree.to_string_lossy())?;
        Some(PathBuf::from(inside.trim_start_matches('/')))
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let Some(cgroups) = &self.cgroups else { return };
        let subtree = cgroups.dir().to_owned();
        let _ = std::fs::write(subtree.join("cgroup.kill"), "1");
        let start = Instant::now();
        while subtree.exists() && start.elapsed() < DEADLINE {
            for child in std::fs::read_dir(&subtree).into_iter().flatten().flatten() {
                if child.path().is_dir() {
                    let _ = std::fs::remove_dir(child.path());
                }
            }
            let _ = std::fs::remove_dir(&subtree);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}

/// A directory that any user may traverse and read (the build dir may sit under a private
/// one, out of reach of `nobody`), holding a copy of the helper.
struct PublicDir {
    dir: tempfile::TempDir,
}

impl PublicDir {
    fn new() -> Self {
        let dir = tempfile::Builder::new().prefix("tether-ways-").tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        Self { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A directory `name` in it, that anyone may traverse.
    fn subdir(&self, name: &str) -> PathBuf {
        let dir = self.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }

    /// A copy of the helper at `dir/name`, executable by anyone.
    fn helper_at(&self, dir: &Path, name: &str) -> PathBuf {
        let program = dir.join(name);
        std::fs::copy(helper(), &program).unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        program
    }
}

/// The environment of `pid`, entry by entry, once its exec has recorded it (its mark is in
/// it).
async fn environment_of(pid: u32, mark: &str) -> Vec<(String, String)> {
    let needle = format!("{MARK}={mark}");
    let mut entries = Vec::new();
    eventually("the environment in /proc/<pid>/environ", || {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        entries = environ
            .split(|&b| b == 0)
            .filter(|entry| !entry.is_empty())
            .map(|entry| String::from_utf8_lossy(entry).into_owned())
            .collect::<Vec<String>>();
        entries.contains(&needle)
    })
    .await;
    entries
        .into_iter()
        .map(|entry| {
            let (key, value) = entry.split_once('=').unwrap_or((&entry, ""));
            (key.to_owned(), value.to_owned())
        })
        .collect()
}

fn pair(key: &str, value: &str) -> (OsString, OsString) {
    (key.into(), value.into())
}

/// What `pid` runs once its exec has recorded it: the file (`/proc/<pid>/exe`) and its
/// `argv[0]`.
async fn running_program(pid: u32, expected_arg0: &str) -> (PathBuf, String) {
    let mut seen = (PathBuf::new(), String::new());
    eventually("the command line in /proc/<pid>/cmdline", || {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let arg0 = cmdline.split(|&b| b == 0).next().map(|arg| String::from_utf8_lossy(arg).into_owned());
        seen = (std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default(), arg0.unwrap_or_default());
        seen.1 == expected_arg0
    })
    .await;
    seen
}

/// Whether the cgroup subtree of `setup` has no cgroup left in it.
fn no_cgroup_left(setup: &Setup) -> bool {
    let Some(cgroups) = &setup.cgroups else { return true };
    std::fs::read_dir(cgroups.dir()).into_iter().flatten().flatten().all(|entry| !entry.path().is_dir())
}

#[tokio::test]
async fn a_bare_name_is_found_in_the_path_that_env_sets_on_every_way() {
    let test = "a_bare_name_is_found_in_the_path_that_env_sets_on_every_way";
    let fx = Fixture::new();
    let public = PublicDir::new();
    let name = "tether-found-proxy";
    // In the order of the PATH below: a directory that does not exist; one where the name
    // is a file nobody may execute; one where it is a directory; then the program.
    let missing = public.path().join("missing");
    let denied = public.subdir("denied");
    std::fs::write(denied.join(name), "#!/bin/sh\nexit 3\n").unwrap();
    std::fs::set_permissions(denied.join(name), std::fs::Permissions::from_mode(0o644)).unwrap();
    let shadowed = public.subdir("shadowed");
    std::fs::create_dir(shadowed.join(name)).unwrap();
    let bin = public.subdir("bin");
    let program = public.helper_at(&bin, name);
    // An empty entry and `.` would find this one, in the working directory: they are
    // skipped.
    let work = public.subdir("work");
    public.helper_at(&work, name);
    let path = format!(":.:{}:{}:{}:{}", missing.display(), denied.display(), shadowed.display(), bin.display());

    for way in WAYS {
        let Some(setup) = Setup::new(&fx, way, test) else { continue };
        let mut spec = fx.spec(&format!("found-{}", way.slug()), &["--sleep"]);
        spec.program = name.into();
        spec.working_dir = work.clone();
        // After the fixture's own `PATH`, which does not hold the name: the later one is
        // searched.
        spec.env.push(pair("PATH", &path));
        setup.apply(&mut spec);
        let handle = within("spawn", setup.supervisor.spawn(spec))
            .await
            .unwrap_or_else(|e| panic!("{way:?}: {}", tether_state::error_chain(&e)));
        let status = handle.status();
        assert_eq!(status.state, ProcessState::Running, "{way:?}");
        let pid = status.figures.pid.unwrap();
        assert!(!is_dead(pid), "{way:?}");
        let (exe, arg0) = running_program(pid, name).await;
        assert_eq!(exe, program, "{way:?}: the first place where the program may be executed");
        assert_eq!(arg0, name, "{way:?}: argv[0] is the name as configured");
        let stopped = within("stop", handle.stop()).await;
        assert_eq!(stopped.state, ProcessState::Stopped, "{way:?}");
    }
}

#[tokio::test]
async fn a_name_found_nowhere_fails_naming_the_program_and_the_path_on_every_way() {
    let test = "a_name_found_nowhere_fails_naming_the_program_and_the_path_on_every_way";
    let fx = Fixture::new();
    let public = PublicDir::new();
    let (empty, other) = (public.subdir("empty"), public.subdir("other"));
    // The agent's own PATH holds `sleep`, but the configured one, later, is searched.
    let path = format!("{}:{}", empty.display(), other.display());
    for way in WAYS {
        let Some(setup) = Setup::new(&fx, way, test) else { continue };
        let mut spec = fx.spec(&format!("missing-{}", way.slug()), &["30"]);
        spec.program = "sleep".into();
        spec.env.push(pair("PATH", &path));
        setup.apply(&mut spec);
        let error = within("spawn", setup.supervisor.spawn(spec)).await.unwrap_err();
        let SpawnError::ProgramNotFound(not_found) = &error else { panic!("{way:?}: {error:?}") };
        assert_eq!(not_found.program, Path::new("sleep"), "{way:?}");
        assert_eq!(not_found.path, OsString::from(&path), "{way:?}");
        assert!(!not_found.denied, "{way:?}");
        assert_eq!(error.to_string(), format!("program `sleep` not found in PATH `{path}`"), "{way:?}");
        assert!(fx.marked_processes().is_empty(), "{way:?}: nothing was started");
        assert!(no_cgroup_left(&setup), "{way:?}: the cgroup made for it is gone");
    }
}

/// The child looks for the program as the user it becomes: a place that its user may not
/// reach is passed over for the next one, as `execvp` in that child would, although the
/// agent (root) could run the first.
#[tokio::test]
async fn a_child_that_switches_user_looks_for_its_program_as_that_user() {
    let test = "a_child_that_switches_user_looks_for_its_program_as_that_user";
    let fx = Fixture::new();
    let public = PublicDir::new();
    let name = "tether-user-proxy";
    let private = public.subdir("private");
    public.helper_at(&private, name);
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let bin = public.subdir("bin");
    let program = public.helper_at(&bin, name);
    let path = format!("{}:{}", private.display(), bin.display());
    for way in WAYS.into_iter().filter(|way| way.switches_user()) {
        let Some(setup) = Setup::new(&fx, way, test) else { continue };
        let mut spec = fx.spec(&format!("user-{}", way.slug()), &["--sleep"]);
        spec.program = name.into();
        spec.env.push(pair("PATH", &path));
        setup.apply(&mut spec);
        let handle = within("spawn", setup.supervisor.spawn(spec))
            .await
            .unwrap_or_else(|e| panic!("{way:?}: {}", tether_state::error_chain(&e)));
        let pid = handle.status().figures.pid.unwrap();
        let (exe, _) = running_program(pid, name).await;
        assert_eq!(exe, program, "{way:?}: the place `nobody` may reach");
        within("stop", handle.stop()).await;

        // Where `nobody` may reach none, the start fails and names the program.
        let mut spec = fx.spec(&format!("user-none-{}", way.slug()), &["--sleep"]);
        spec.program = name.into();
        spec.env.push(pair("PATH", &private.to_string_lossy()));
        setup.apply(&mut spec);
        let error = within("spawn", setup.supervisor.spawn(spec)).await.unwrap_err();
        assert!(
            matches!(&error, SpawnError::Exec { program, source }
                if program == Path::new(name) && source.raw_os_error() == Some(libc::EACCES)),
            "{way:?}: {error:?}"
        );
        assert!(fx.marked_processes().is_empty(), "{way:?}: nothing was left running");
    }
}

/// A program that is gone when its process must restart (an upgrade in progress, a package
/// removed) does not hold the process down: the restart is retried on the backoff, and
/// succeeds once the program is back.
#[tokio::test]
async fn a_restart_whose_program_is_gone_is_retried_until_it_is_back() {
    let fx = Fixture::new();
    let public = PublicDir::new();
    let name = "tether-late-proxy";
    let bin = public.subdir("bin");
    let program = public.helper_at(&bin, name);
    let mut spec = fx.spec("late-proxy", &["--sleep"]);
    spec.program = name.into();
    spec.env.push(pair("PATH", &bin.to_string_lossy()));
    spec.restart.max_delay = std::time::Duration::from_millis(200);
    let handle = within("spawn", fx.supervisor.spawn(spec)).await.unwrap();
    let first = handle.status().figures.pid.unwrap();

    std::fs::remove_file(&program).unwrap();
    send(first, nix::sys::signal::Signal::SIGKILL);
    let waiting = status_where(&handle, "a failed restart", |status| {
        status.state == ProcessState::Backoff
            && status.figures.error.as_deref().is_some_and(|e| e.contains("not found in PATH"))
    })
    .await;
    let error = waiting.figures.error.unwrap();
    assert!(error.contains(&format!("program `{name}` not found in PATH `{}`", bin.display())), "{error}");

    public.helper_at(&bin, name);
    let second = restarted(&handle, first).await;
    let (exe, _) = running_program(second, name).await;
    assert_eq!(exe, program);
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn each_variable_appears_once_and_the_last_entry_wins_on_every_way() {
    let test = "each_variable_appears_once_and_the_last_entry_wins_on_every_way";
    let fx = Fixture::new();
    let public = PublicDir::new();
    let program = public.helper_at(public.path(), "tether-test-proxy");
    for way in WAYS {
        let Some(setup) = Setup::new(&fx, way, test) else { continue };
        let mut spec = fx.spec(&format!("env-{}", way.slug()), &["--sleep"]);
        spec.program = program.clone();
        // The layers as the agent stacks them: its own PATH and HOME first (from the
        // fixture), then the configured ones.
        spec.env.extend([
            pair("PATH", "/opt/proxy/bin:/usr/bin:/bin"),
            pair("HOME", "/nonexistent/proxy-home"),
            pair("LOG_LEVEL", "info"),
            pair("LOG_LEVEL", "debug"),
        ]);
        setup.apply(&mut spec);
        let handle = within("spawn", setup.supervisor.spawn(spec.clone()))
            .await
            .unwrap_or_else(|e| panic!("{way:?}: {}", tether_state::error_chain(&e)));
        assert_eq!(handle.status().state, ProcessState::Running, "{way:?}");
        let pid = handle.status().figures.pid.unwrap();
        if setup.cgroups.is_some() {
            assert!(setup.cgroup_of(pid).is_some_and(|c| !c.as_os_str().is_empty()), "{way:?}: in its own cgroup");
        }

        let environment = environment_of(pid, &fx.mark).await;
        let mut names: Vec<&str> = environment.iter().map(|(key, _)| key.as_str()).collect();
        names.sort_unstable();
        let count = names.len();
        names.dedup();
        assert_eq!(names.len(), count, "{way:?}: a variable appears twice in {environment:?}");
        let value = |key: &str| environment.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
        assert_eq!(value("PATH"), Some("/opt/proxy/bin:/usr/bin:/bin"), "{way:?}");
        assert_eq!(value("HOME"), Some("/nonexistent/proxy-home"), "{way:?}");
        assert_eq!(value("LOG_LEVEL"), Some("debug"), "{way:?}");
        assert_eq!(value("TETHER_PROXY_ID"), Some(format!("env-{}", way.slug()).as_str()), "{way:?}");
        if way == Way::Listeners {
            assert_eq!(value("LISTEN_PID"), Some(pid.to_string().as_str()), "{way:?}");
        }
        // What an agent asks after a restart, before it keeps a process it adopted.
        assert!(handle.runs(&spec), "{way:?}: the process is recognised as running its spec");

        let stopped = within("stop", handle.stop()).await;
        assert_eq!(stopped.state, ProcessState::Stopped, "{way:?}");
    }
}
