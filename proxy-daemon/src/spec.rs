//! What to run and how to treat it: [`ProcessSpec`], its builder and its policies.
//!
//! This module owns the plain data a caller hands to the supervisor, and its defaults
//! (those of the config file, from tether-state). It performs no I/O but the builder's
//! opening of a log directory given by path, and validates nothing beyond the name and the
//! pid file's path: the caller (the agent) has validated the configuration already.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;

use tether_state::persist::DataDir;

use crate::error::InvalidName;
use crate::journal::JournalSink;

mod builder;

pub use builder::{LogTarget, ProcessSpecBuilder};
/// The directories log files are in, as tether-state opens them: [`PrivateDir`] (a
/// directory opened once, whose files are reached without following links), the errors of
/// its operations ([`PersistError`], [`UnsafeEntry`]) and how much a replaced file must
/// survive ([`Durability`]).
pub use tether_state::persist::{Durability, PersistError, PrivateDir, UnsafeEntry};

/// The name of a supervised process: the proxy id, such as `web-proxy`.
///
/// It becomes part of file names (pid file, log files) and appears in tracing fields as
/// `proxy`, so it follows the service id rule, with room for a proxy id: an ASCII letter or
/// digit, then letters, digits, `.`, `_` and `-`, at most 134 bytes (tether-state's
/// `check_process_name`, the rule of the agent's proxy ids).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcessName(std::sync::Arc<str>);

impl ProcessName {
    /// Checks `name` against the id rule.
    ///
    /// # Errors
    ///
    /// [`InvalidName`] when `name` is empty, longer than 134 bytes, starts with anything but
    /// an ASCII letter or digit, or holds anything but ASCII letters, digits, `.`, `_`, `-`.
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidName> {
        let name = name.into();
        match tether_state::check_process_name(&name) {
            Ok(()) => Ok(Self(name.into())),
            Err(_reason) => Err(InvalidName { name }),
        }
    }

    /// The process name of a proxy: its id ([`ProxyId`](crate::ProxyId)), which always
    /// follows the rule.
    pub fn of_proxy(id: &tether_state::ProxyId) -> Self {
        // Shared, not copied: the spec, the supervising task and the supervisor's list of
        // processes hold the same name, which costs memory per process otherwise.
        Self(id.as_str().into())
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for ProcessName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ProcessName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ProcessName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

/// The parts of those policies: [`CpuLimit`], of [`ResourceLimits`], and [`Backoff`], the
/// schedule of [`RestartPolicy::delay_before`].
pub use tether_state::{Backoff, CpuLimit};
/// The checks' vocabulary is tether-state's too: [`Readiness`] and [`Liveness`] ask a
/// [`Probe`] (with its [`TcpTarget`], [`HttpTarget`], [`CommandLine`] or [`LinePattern`]).
pub use tether_state::{CommandLine, HttpTarget, LinePattern, Liveness, Probe, Readiness, TcpTarget};
/// The policies of a process are tether-state's, one vocabulary with the catalog's:
/// [`KillPolicy`] (how it is stopped: its [`KillSignal`] to the group, then SIGKILL after the
/// timeout), [`RestartPolicy`] (when an exited process is started again, with its schedule
/// in [`RestartPolicy::delay_before`]) and [`LogPolicy`] (the size limits of its log files).
/// Their defaults are the config file's, written once there.
pub use tether_state::{KillPolicy, KillSignal, LogOutput, LogPolicy, ResourceLimits, RestartPolicy};
/// How a process reloads in place ([`ReloadPolicy`]: a [`ReloadAction`], a check, watched
/// files, a timeout) and how a reload went ([`ReloadOutcome`], its [`ReloadResult`]; the
/// history, [`Reloads`], with its [`ReloadCounts`]), in tether-state's vocabulary.
pub use tether_state::{
    ReloadAction, ReloadCounts, ReloadOutcome, ReloadPolicy, ReloadResult, Reloads, WATCH_DEBOUNCE,
};

/// When an instance counts as ready, and when it is restarted because it stopped answering
/// ([`Readiness`] and [`Liveness`]). The supervisor probes `tcp`, `http` and `exec`.
///
/// Each check is boxed: a spec lives as long as its process, and most processes have no
/// check, whose room would otherwise be in every spec.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HealthChecks {
    /// Until it first passes, a new instance is `starting`; `None`: ready once it runs.
    pub readiness: Option<Box<Readiness>>,
    /// Probed while the instance is ready; `failures` in a row restart it.
    pub liveness: Option<Box<Liveness>>,
}

impl HealthChecks {
    /// The checks `readiness` and `liveness`, either of which may be absent.
    ///
    /// ```
    /// use tether_proxy_daemon::{HealthChecks, Probe, Readiness};
    ///
    /// let checks = HealthChecks::new(Some(Readiness::new(Probe::Notify)), None);
    /// assert_eq!(checks.readiness.map(|readiness| readiness.probe), Some(Probe::Notify));
    /// assert_eq!(HealthChecks::new(None, None), HealthChecks::default());
    /// ```
    pub fn new(readiness: Option<Readiness>, liveness: Option<Liveness>) -> Self {
        Self { readiness: readiness.map(Box::new), liveness: liveness.map(Box::new) }
    }
}

impl From<&tether_state::ProxySpec> for HealthChecks {
    /// A proxy's checks, as its spec gives them (boxed there too).
    fn from(spec: &tether_state::ProxySpec) -> Self {
        Self { readiness: spec.readiness.clone(), liveness: spec.liveness.clone() }
    }
}

/// A log file: a name in a directory opened once without following links (the data dir's
/// `logs/`, or any directory a caller opened as a [`PrivateDir`]), so that a link planted
/// at the name or in place of the directory never redirects the output.
#[derive(Clone, PartialEq, Eq)]
pub struct LogFile {
    dir: PrivateDir,
    /// Shared by the clones: the spec's, the rotation's, each restart's.
    name: Arc<str>,
}

impl LogFile {
    /// The file `name` in `dir`. `name` is one path component; an operation on a file
    /// with any other name fails.
    pub fn new(dir: PrivateDir, name: impl Into<String>) -> Self {
        Self { dir, name: name.into().into() }
    }

    /// The directory the file is in.
    pub fn dir(&self) -> &PrivateDir {
        &self.dir
    }

    /// The file's name in [`LogFile::dir`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the file is, for messages and for readers outside the supervisor.
    pub fn path(&self) -> PathBuf {
        self.dir.path().join(&*self.name)
    }
}

impl fmt::Debug for LogFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.path(), f)
    }
}

/// Where a process's output goes, and the limits on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogSpec {
    /// The file stdout is appended to (created 0600 if missing).
    pub stdout: LogFile,
    /// The file stderr is appended to (created 0600 if missing).
    pub stderr: LogFile,
    /// Rotation limits, applied to each file separately, and where the lines go.
    pub limits: LogPolicy,
    /// Where the lines go in the journal when [`LogPolicy::output`] says so (`None`: the
    /// default socket, with the process's name as the identifier).
    pub journal: Option<Arc<JournalSink>>,
}

impl LogSpec {
    /// The journal the lines of the process `name` go to, if its output goes to one.
    pub(crate) fn journal_sink(&self, name: &ProcessName) -> Option<Arc<JournalSink>> {
        if !self.limits.output.to_journal() {
            return None;
        }
        Some(self.journal.clone().unwrap_or_else(|| Arc::new(JournalSink::new(name.as_str()))))
    }

    /// The sizes of the stdout and stderr files now (0 for a missing one): where the lines
    /// of an instance started next begin.
    pub(crate) fn sizes(&self) -> [u64; 2] {
        [&self.stdout, &self.stderr].map(|log| log.dir().regular_size(log.name()).unwrap_or(0))
    }
}

/// Everything needed to start, supervise, stop and recognise one process.
///
/// The supervisor passes `env` and nothing else: the caller builds `PATH`, `HOME` and the
/// `TETHER_*` variables. `Debug` prints environment variable names but never their
/// values, which may be secrets ([`Environment`]).
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    /// The proxy id; used in tracing fields, and in the names of the log files of a
    /// directory ([`LogTarget`]) and of [`ProcessSpec::new`]'s pid file.
    pub name: ProcessName,
    /// The program to execute: an absolute path, or a bare name (no `/`) looked up as
    /// `execvp` does in the `PATH` of the process's own [`environment`](Self::environment)
    /// (`/bin:/usr/bin` without one), skipping empty and relative directories
    /// ([`find_program`](crate::find_program)). A process that switches user looks as that
    /// user. It is also the process's `argv[0]`. A relative path with a `/` is refused.
    pub program: PathBuf,
    /// The arguments, without the program name.
    pub args: Vec<OsString>,
    /// The complete environment of the process, in layers: a later entry of a name
    /// replaces an earlier one ([`ProcessSpec::environment`]), so that a caller appends its
    /// own layers (defaults, then what was configured) without looking for duplicates.
    pub env: Environment,
    /// A layer beneath [`env`](Self::env), shared by the specs of many processes rather
    /// than copied into each (such as a caller's own `PATH` and `HOME`): its entries come
    /// first, and an entry of `env` of the same name replaces one of it (default empty).
    pub base_env: Arc<Environment>,
    /// The working directory (default `/`).
    pub working_dir: PathBuf,
    /// Run as this user (uid, primary gid and supplementary groups), if set.
    pub user: Option<String>,
    /// How the process is stopped.
    pub kill: KillPolicy,
    /// When it is restarted after an exit.
    pub restart: RestartPolicy,
    /// Whether an exit is followed by a restart at all (default `true`). `false` suits a
    /// process adopted only to be stopped: its exit then ends supervision as `stopped`.
    pub restart_on_exit: bool,
    /// What an instance started again after an exit runs instead of the first instance's
    /// arguments and environment, and what it waits for first (default `None`: the same
    /// arguments and environment, at once). A proxy that hands over to its successor by
    /// itself (`update = "epoch"`) is started again cold: epoch 0, once no other
    /// generation runs. Boxed, as every setting that most processes leave unset: the spec
    /// lives as long as its process, and it is only as large as what is set.
    pub restarted: Option<Box<Restarted>>,
    /// Where its output goes.
    pub logs: LogSpec,
    /// Its readiness and liveness checks (default none).
    pub health: HealthChecks,
    /// Listening sockets handed to every instance with systemd's socket-activation
    /// protocol: descriptors 3, 4, … in this order, `LISTEN_FDS`, `LISTEN_PID` (the
    /// instance's own pid) and `LISTEN_FDNAMES` (default none). They are shared, not
    /// owned: whoever bound them keeps them open between instances.
    pub listeners: Vec<InheritedSocket>,
    /// The pid file, written atomically (0600) on every start, removed on stop; `None`
    /// writes none. Its directory is created (0700) if missing; the file is written,
    /// renamed and removed relative to that directory, opened without following a link.
    pub pid_file: Option<PathBuf>,
    /// Environment entries that prove a process found through `pid_file` is this one:
    /// every pair must appear in its `/proc/<pid>/environ` (for example `TETHER_PROXY_ID`
    /// and `TETHER_PROXY_TOKEN`). Empty means that pid files prove nothing. Only an
    /// adoption reads them: the supervisor lets go of them once the process is supervised.
    pub identity_env: Environment,
    /// The limits of each instance's cgroup, when the supervisor uses cgroups (default
    /// none). A limit whose controller is not enabled fails the start, naming it.
    pub limits: ResourceLimits,
    /// How the process reloads its files in place ([`ProcessHandle::reload`]), when it can
    /// (default `None`: it cannot). Boxed: most processes have none.
    ///
    /// [`ProcessHandle::reload`]: crate::ProcessHandle::reload
    pub reload: Option<Box<ReloadPolicy>>,
}

impl ProcessSpec {
    /// A builder of the spec that runs `program` as `name`: its arguments, environment and
    /// policies, where its output goes (required) and, if wanted, its pid file.
    ///
    /// ```
    /// use tether_proxy_daemon::{LogTarget, ProcessName, ProcessSpec};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let dir = tempfile::tempdir()?;
    /// # let (logs, run) = (dir.path().join("logs"), dir.path().join("run"));
    /// let spec = ProcessSpec::builder(ProcessName::new("web-proxy")?, "envoy")
    ///     .args(["-c", "/etc/envoy/web.yaml"])
    ///     .env("PATH", "/usr/local/bin:/usr/bin:/bin")
    ///     .logs(LogTarget::Dir(logs)) // web-proxy-stdout.log, web-proxy-stderr.log
    ///     .pid_file(run.join("web-proxy.pid"))
    ///     .build()?;
    /// # assert_eq!(spec.logs.stderr.path(), dir.path().join("logs/web-proxy-stderr.log"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(name: ProcessName, program: impl Into<PathBuf>) -> ProcessSpecBuilder {
        ProcessSpecBuilder::new(name, program.into())
    }

    /// A spec with the agent's data-dir layout in `data` and default policies: the pid
    /// file is `<data dir>/pids/<name>.pid`, the logs are `<name>-stdout.log` and
    /// `<name>-stderr.log` in the data dir's `logs/` ([`LogTarget::In`]). Otherwise as
    /// [`ProcessSpec::builder`] makes it: no arguments, an empty environment, working
    /// directory `/`.
    ///
    /// For a process that is not one of the agent's, [`ProcessSpec::builder`] needs no
    /// data dir (whose `open` also creates the agent's `registrations/`).
    pub fn new(name: ProcessName, program: impl Into<PathBuf>, data: &DataDir) -> Self {
        let (stdout, stderr) = builder::log_files_in(data.logs(), &name);
        let pid_file = data.pid_file(&name);
        Self::builder(name, program).pid_file(pid_file).with_log_files(stdout, stderr)
    }
}

impl ProcessSpec {
    /// The environment the process gets: each variable of `base_env`, then `env`, once,
    /// where it first appears, with the value of its last entry. Every way of creating the
    /// process passes exactly this, so that a variable set twice (an inherited `PATH`, then
    /// a configured one) is never seen twice by the process, where `getenv` would return the
    /// first.
    pub fn environment(&self) -> Vec<(OsString, OsString)> {
        use std::collections::hash_map::Entry;
        let count = self.base_env.len() + self.env.len();
        let mut merged: Vec<(OsString, OsString)> = Vec::with_capacity(count);
        let mut places: HashMap<&OsStr, usize> = HashMap::with_capacity(count);
        for (key, value) in self.base_env.iter().chain(&self.env) {
            match places.entry(key.as_os_str()) {
                Entry::Occupied(place) => merged[*place.get()].1.clone_from(value),
                Entry::Vacant(place) => {
                    place.insert(merged.len());
                    merged.push((key.clone(), value.clone()));
                }
            }
        }
        merged
    }
}

/// What an instance started again after an exit runs ([`ProcessSpec::restarted`]).
#[derive(Clone)]
pub struct Restarted {
    /// Its arguments, without the program name.
    pub args: Vec<OsString>,
    /// Entries that replace those of the same name in [`ProcessSpec::env`] (or are added).
    pub env: Environment,
    /// Resolves once the instance may be started; the backoff begins after it. While it
    /// waits, the process is in `backoff`, and a stop or a detach ends supervision.
    pub after: Arc<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync>,
}

impl Restarted {
    /// Applies the arguments and environment to `spec`.
    pub(crate) fn apply_to(&self, spec: &mut ProcessSpec) {
        spec.args.clone_from(&self.args);
        for (key, value) in &self.env {
            match spec.env.iter_mut().rev().find(|(name, _)| name == key) {
                Some(entry) => entry.1.clone_from(value),
                None => spec.env.push((key.clone(), value.clone())),
            }
        }
    }
}

impl fmt::Debug for Restarted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Restarted").field("args", &self.args).field("env", &self.env).finish_non_exhaustive()
    }
}

/// A process's environment: `(name, value)` pairs, in order, a later pair of a name
/// winning. Its `Debug` prints the names only, never the values, which may be secrets; so
/// every type that holds one can derive `Debug` and print no secret.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Environment(pub Vec<(OsString, OsString)>);

impl fmt::Debug for Environment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.0.iter().map(|(name, _)| name)).finish()
    }
}

impl std::ops::Deref for Environment {
    type Target = Vec<(OsString, OsString)>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Environment {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl From<Vec<(OsString, OsString)>> for Environment {
    fn from(pairs: Vec<(OsString, OsString)>) -> Self {
        Self(pairs)
    }
}

impl FromIterator<(OsString, OsString)> for Environment {
    fn from_iter<I: IntoIterator<Item = (OsString, OsString)>>(pairs: I) -> Self {
        Self(pairs.into_iter().collect())
    }
}

impl<'a> IntoIterator for &'a mut Environment {
    type Item = &'a mut (OsString, OsString);
    type IntoIter = std::slice::IterMut<'a, (OsString, OsString)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter_mut()
    }
}

impl<'a> IntoIterator for &'a Environment {
    type Item = &'a (OsString, OsString);
    type IntoIter = std::slice::Iter<'a, (OsString, OsString)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// A listening socket that every instance of a process inherits, under a name (a
/// `LISTEN_FDNAMES` entry: no `:`).
#[derive(Debug, Clone)]
pub struct InheritedSocket {
    /// Its name.
    pub name: String,
    /// The socket, bound and listening; shared with whoever keeps it between instances.
    pub socket: Arc<OwnedFd>,
}

impl PartialEq for InheritedSocket {
    /// The same name and the same open socket.
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && Arc::ptr_eq(&self.socket, &other.socket)
    }
}

impl Eq for InheritedSocket {}

/// Changes applied to a running process in place, without restarting it.
///
/// `None` leaves a setting as it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessUpdate {
    /// A new kill policy, used by the next stop.
    pub kill: Option<KillPolicy>,
    /// A new restart policy, used from the next exit on.
    pub restart: Option<RestartPolicy>,
    /// New log limits, and where the lines go, used from the next write on.
    pub log_limits: Option<LogPolicy>,
    /// Where the lines go in the journal from now on ([`LogSpec::journal`]), if given.
    pub journal: Option<Arc<JournalSink>>,
    /// New checks: a readiness that passed is not asked again; liveness starts over.
    pub health: Option<HealthChecks>,
    /// New cgroup limits, written into the running instance's cgroup.
    pub limits: Option<ResourceLimits>,
    /// A new reload policy (`Some(None)`: the process can no longer reload), used by the
    /// next reload; a reload in flight ends as it began.
    pub reload: Option<Option<ReloadPolicy>>,
    /// Whether an exit is followed by a restart ([`ProcessSpec::restart_on_exit`]); `false`
    /// makes the next exit end supervision as `stopped`, and ends at once a supervision
    /// that waits to start the process again.
    pub restart_on_exit: Option<bool>,
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::error::SpecError;

    /// A spec of `web-proxy` running `/bin/true`, its files in a data dir that lives as long
    /// as the directory returned with it.
    fn web_spec() -> (tempfile::TempDir, ProcessSpec) {
        let temp = tempfile::tempdir().unwrap();
        let data = DataDir::open(temp.path()).unwrap();
        let spec = ProcessSpec::new(ProcessName::new("web-proxy").unwrap(), "/bin/true", &data);
        (temp, spec)
    }

    fn pair(key: &str, value: &str) -> (OsString, OsString) {
        (OsString::from(key), OsString::from(value))
    }

    #[test]
    fn names_follow_the_id_rule() {
        // Up to 134 bytes: the id of the proxy of a 128-byte service id.
        for good in ["web-proxy", "a", "A.b_c-1", &"x".repeat(128), &"x".repeat(134)] {
            assert!(ProcessName::new(good).is_ok(), "{good:?} should be valid");
        }
        for bad in ["", "..", "-web", ".hidden", "a/b", "a b", "a\0b", &"x".repeat(135)] {
            assert!(ProcessName::new(bad).is_err(), "{bad:?} should be invalid");
        }
    }

    #[test]
    fn every_proxy_id_is_a_process_name() {
        let longest = tether_state::ServiceId::new("s".repeat(tether_state::MAX_SERVICE_ID_LEN)).unwrap().proxy_id();
        assert_eq!(longest.as_str().len(), tether_state::MAX_PROXY_ID_LEN);
        assert_eq!(ProcessName::new(longest.as_str()).unwrap(), ProcessName::of_proxy(&longest));
    }

    #[test]
    fn debug_output_hides_environment_values() {
        let (_temp, mut spec) = web_spec();
        spec.env = vec![("TETHER_PROXY_TOKEN".into(), "s3cr3t".into())].into();
        spec.identity_env = spec.env.clone();
        spec.restarted = Some(Box::new(Restarted {
            args: Vec::new(),
            env: vec![("RESTART_TOKEN".into(), "s3cr3t".into())].into(),
            after: Arc::new(|| Box::pin(async {})),
        }));
        spec.reload = Some(Box::new(ReloadPolicy::new(ReloadAction::Signal(KillSignal::Hup))));
        let debug = format!("{spec:?}");
        for name in ["TETHER_PROXY_TOKEN", "RESTART_TOKEN", "reload", "restarted"] {
            assert!(debug.contains(name), "{name}: {debug}");
        }
        assert!(!debug.contains("s3cr3t"), "{debug}");
        // The builder's too, from the same derive: every field, no value of the environment.
        let builder = ProcessSpec::builder(ProcessName::new("web-proxy").unwrap(), "/bin/true")
            .env("TETHER_PROXY_TOKEN", "s3cr3t")
            .identity_env([("TETHER_PROXY_TOKEN", "s3cr3t")])
            .reload(ReloadPolicy::new(ReloadAction::Signal(KillSignal::Hup)));
        let debug = format!("{builder:?}");
        assert!(debug.contains("TETHER_PROXY_TOKEN") && debug.contains("reload"), "{debug}");
        assert!(!debug.contains("s3cr3t"), "{debug}");
    }

    #[test]
    fn environment_has_each_variable_once_with_its_last_value() {
        let (_temp, mut spec) = web_spec();
        spec.env = vec![
            pair("PATH", "/usr/bin:/bin"),
            pair("HOME", "/root"),
            pair("TETHER_PROXY_ID", "web-proxy"),
            pair("PATH", "/opt/envoy/bin"),
            pair("LOG_LEVEL", "info"),
            pair("LOG_LEVEL", "debug"),
        ]
        .into();
        assert_eq!(
            spec.environment(),
            [
                pair("PATH", "/opt/envoy/bin"),
                pair("HOME", "/root"),
                pair("TETHER_PROXY_ID", "web-proxy"),
                pair("LOG_LEVEL", "debug"),
            ]
        );
    }

    #[test]
    fn the_shared_layer_comes_first_and_env_replaces_its_entries() {
        let (_temp, mut spec) = web_spec();
        spec.base_env = Arc::new(vec![pair("PATH", "/usr/bin:/bin"), pair("HOME", "/root")].into());
        spec.env = vec![pair("TETHER_PROXY_ID", "web-proxy"), pair("PATH", "/opt/envoy/bin")].into();
        assert_eq!(
            spec.environment(),
            [pair("PATH", "/opt/envoy/bin"), pair("HOME", "/root"), pair("TETHER_PROXY_ID", "web-proxy")]
        );
    }

    #[test]
    fn a_built_spec_logs_in_the_directory_given_and_writes_no_pid_file_unless_asked() {
        use std::os::unix::fs::PermissionsExt;

        let temp = tempfile::tempdir().unwrap();
        let logs = temp.path().join("logs");
        let name = ProcessName::new("sleeper").unwrap();
        let spec = ProcessSpec::builder(name.clone(), "/bin/sleep")
            .args(["30", "31"])
            .env("PATH", "/bin")
            .envs([("HOME", "/"), ("PATH", "/usr/bin")])
            .logs(LogTarget::Dir(logs.clone()))
            .build()
            .unwrap();
        assert_eq!(spec.args, ["30", "31"]);
        assert_eq!(spec.environment(), [("PATH".into(), "/usr/bin".into()), ("HOME".into(), "/".into())]);
        assert_eq!(spec.logs.stdout.path(), logs.join("sleeper-stdout.log"));
        assert_eq!(spec.logs.stderr.path(), logs.join("sleeper-stderr.log"));
        assert_eq!(std::fs::metadata(&logs).unwrap().permissions().mode() & 0o777, 0o700, "created private");
        assert_eq!(spec.pid_file, None);
        assert_eq!(spec.working_dir, PathBuf::from("/"));
        assert!(spec.restart_on_exit);

        let asked = ProcessSpec::builder(name, "/bin/sleep")
            .logs(LogTarget::In(spec.logs.stdout.dir().clone()))
            .pid_file(temp.path().join("sleeper.pid"))
            .build()
            .unwrap();
        assert_eq!(asked.pid_file, Some(temp.path().join("sleeper.pid")));
        assert_eq!(asked.logs.stdout.dir(), spec.logs.stdout.dir());
    }

    #[test]
    fn a_spec_without_logs_or_with_a_pid_file_that_names_no_file_is_not_built() {
        let temp = tempfile::tempdir().unwrap();
        let builder = || ProcessSpec::builder(ProcessName::new("web-proxy").unwrap(), "/bin/true");
        let err = builder().build().unwrap_err();
        assert!(matches!(&err, SpecError::NoLogs { name } if name.as_str() == "web-proxy"), "{err:?}");
        assert_eq!(err.to_string(), "no log target for process web-proxy");

        let logs = LogTarget::Dir(temp.path().to_owned());
        for path in ["/", "run/.."] {
            let err = builder().logs(logs.clone()).pid_file(path).build().unwrap_err();
            assert!(matches!(&err, SpecError::PidFile { path: given } if given == Path::new(path)), "{err:?}");
        }

        let file = temp.path().join("file");
        std::fs::write(&file, "").unwrap();
        let err = builder().logs(LogTarget::Dir(file.join("logs"))).build().unwrap_err();
        assert!(matches!(&err, SpecError::LogDir { path, .. } if *path == file.join("logs")), "{err:?}");
        assert!(std::error::Error::source(&err).is_some(), "the cause is kept");
    }

    #[test]
    fn a_builder_s_debug_output_hides_environment_values() {
        let builder = ProcessSpec::builder(ProcessName::new("web-proxy").unwrap(), "/bin/true")
            .env("TETHER_PROXY_TOKEN", "s3cr3t")
            .identity_env([("TETHER_PROXY_TOKEN", "s3cr3t")]);
        let debug = format!("{builder:?}");
        assert!(debug.contains("TETHER_PROXY_TOKEN"), "{debug}");
        assert!(!debug.contains("s3cr3t"), "{debug}");
    }

    #[test]
    fn new_lays_files_out_as_in_the_spec() {
        let temp = tempfile::tempdir().unwrap();
        let data = DataDir::open(temp.path()).unwrap();
        let spec = ProcessSpec::new(ProcessName::new("web-proxy").unwrap(), "/bin/true", &data);
        assert_eq!(spec.pid_file, Some(temp.path().join("pids/web-proxy.pid")));
        assert_eq!(spec.logs.stdout.path(), temp.path().join("logs/web-proxy-stdout.log"));
        assert_eq!(spec.logs.stderr.path(), temp.path().join("logs/web-proxy-stderr.log"));
        assert_eq!(spec.logs.stdout.dir(), data.logs());
        assert_eq!(spec.logs.stdout.name(), "web-proxy-stdout.log");
    }
}
