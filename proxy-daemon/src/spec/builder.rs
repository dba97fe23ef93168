//! [`ProcessSpecBuilder`]: a [`ProcessSpec`] from a name, a program and where its output
//! goes, with no data dir.
//!
//! This module owns the defaults of a spec (in [`ProcessSpecBuilder::new`]) and the rule
//! that names a process's log files in a directory. Its only I/O is opening the log
//! directory of [`LogTarget::Dir`], once, when the spec is built.

use std::ffi::OsString;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use tether_state::persist::{DataDir, PersistError, PrivateDir};

use super::{
    Environment, HealthChecks, InheritedSocket, KillPolicy, LogFile, LogPolicy, LogSpec, ProcessName, ProcessSpec,
    ReloadPolicy, ResourceLimits, RestartPolicy,
};
use crate::error::SpecError;

/// Where a process's output goes ([`ProcessSpecBuilder::logs`]).
///
/// Whichever way the directory is given, every file in it is opened relative to the
/// directory's descriptor without following a symbolic link, created with mode 0600 (an
/// existing file's mode is set to 0600), and a link planted at a file's name is replaced,
/// never written through.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LogTarget {
    /// `<name>-stdout.log` and `<name>-stderr.log` in the directory at this path, opened
    /// when the spec is built: created (0700) if missing, its mode set to 0700. The path
    /// itself may go through a symbolic link (the caller chose it); nothing below it does.
    ///
    /// Each spec built so holds a descriptor of its own for the directory; to share one
    /// among many processes, open it once ([`PrivateDir::open_root`]) and give
    /// [`LogTarget::In`].
    Dir(PathBuf),
    /// `<name>-stdout.log` and `<name>-stderr.log` in a directory opened already.
    In(PrivateDir),
    /// These two files (two different names).
    Files {
        /// The file stdout is appended to.
        stdout: LogFile,
        /// The file stderr is appended to.
        stderr: LogFile,
    },
}

impl LogTarget {
    /// The two files for the process `name`, opening the directory if given by path.
    fn files(self, name: &ProcessName) -> Result<(LogFile, LogFile), SpecError> {
        let dir = match self {
            Self::Files { stdout, stderr } => return Ok((stdout, stderr)),
            Self::In(dir) => dir,
            Self::Dir(path) => PrivateDir::open_root(&path).map_err(|error| SpecError::LogDir {
                source: match error {
                    PersistError::Write { source, .. } | PersistError::Read { source, .. } => source,
                    other => io::Error::other(other),
                },
                path,
            })?,
        };
        Ok(log_files_in(&dir, name))
    }
}

/// The log files of process `name` in `dir`: `<name>-stdout.log` and `<name>-stderr.log`,
/// the names of the data dir's `logs/`.
pub(super) fn log_files_in(dir: &PrivateDir, name: &ProcessName) -> (LogFile, LogFile) {
    let (stdout, stderr) = DataDir::log_file_names(name);
    (LogFile::new(dir.clone(), stdout), LogFile::new(dir.clone(), stderr))
}

/// Builds a [`ProcessSpec`] ([`ProcessSpec::builder`]).
///
/// Only [`logs`](Self::logs) must be given; everything else has the default that the
/// method setting it names. `Debug` prints environment variable names but never their
/// values, which may be secrets.
///
/// # Examples
///
/// ```
/// use tether_proxy_daemon::{LogTarget, ProcessName, ProcessSpec};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let logs = tempfile::tempdir()?;
/// let spec = ProcessSpec::builder(ProcessName::new("sleeper")?, "/bin/sleep")
///     .arg("30")
///     .env("PATH", "/usr/bin:/bin")
///     .logs(LogTarget::Dir(logs.path().to_owned()))
///     .build()?;
/// assert_eq!(spec.logs.stdout.path(), logs.path().join("sleeper-stdout.log"));
/// assert_eq!(spec.pid_file, None);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until it is built"]
pub struct ProcessSpecBuilder {
    name: ProcessName,
    program: PathBuf,
    args: Vec<OsString>,
    env: Environment,
    working_dir: PathBuf,
    user: Option<String>,
    kill: KillPolicy,
    restart: RestartPolicy,
    restart_on_exit: bool,
    logs: Option<LogTarget>,
    log_limits: LogPolicy,
    health: HealthChecks,
    listeners: Vec<InheritedSocket>,
    pid_file: Option<PathBuf>,
    identity_env: Environment,
    limits: ResourceLimits,
    reload: Option<ReloadPolicy>,
}

impl ProcessSpecBuilder {
    /// A builder for `name` running `program` ([`ProcessSpec::program`]), with every
    /// default: no arguments, an empty environment, working directory `/`, this process's
    /// user, the config file's kill, restart and log policies, restarted after every exit,
    /// no checks, listeners, cgroup limits or pid file.
    pub(super) fn new(name: ProcessName, program: PathBuf) -> Self {
        Self {
            name,
            program,
            args: Vec::new(),
            env: Environment::default(),
            working_dir: PathBuf::from("/"),
            user: None,
            kill: KillPolicy::default(),
            restart: RestartPolicy::default(),
            restart_on_exit: true,
            logs: None,
            log_limits: LogPolicy::default(),
            health: HealthChecks::default(),
            listeners: Vec::new(),
            pid_file: None,
            identity_env: Environment::default(),
            limits: ResourceLimits::default(),
            reload: None,
        }
    }

    /// Appends an argument.
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Appends arguments (default none).
    pub fn args<I>(mut self, args: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Appends an environment variable; a later entry of a name replaces an earlier one
    /// ([`ProcessSpec::env`]). The process gets only what is given here (default nothing,
    /// not even `PATH`).
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Appends environment variables, as [`env`](Self::env) does for each.
    pub fn envs<I, K, V>(mut self, vars: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<OsString>,
        V: Into<OsString>,
    {
        self.env.extend(vars.into_iter().map(|(key, value)| (key.into(), value.into())));
        self
    }

    /// The working directory (default `/`).
    pub fn working_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.working_dir = dir.into();
        self
    }

    /// Runs the process as this user (default: this process's own).
    pub fn user(mut self, user: impl Into<String>) -> Self {
        self.user = Some(user.into());
        self
    }

    /// How the process is stopped (default [`KillPolicy::default`]).
    pub fn kill(mut self, kill: KillPolicy) -> Self {
        self.kill = kill;
        self
    }

    /// When it is restarted after an exit (default [`RestartPolicy::default`]).
    pub fn restart(mut self, restart: RestartPolicy) -> Self {
        self.restart = restart;
        self
    }

    /// Whether an exit is followed by a restart at all ([`ProcessSpec::restart_on_exit`],
    /// default `true`).
    pub fn restart_on_exit(mut self, restart: bool) -> Self {
        self.restart_on_exit = restart;
        self
    }

    /// Where its output goes: required.
    pub fn logs(mut self, target: LogTarget) -> Self {
        self.logs = Some(target);
        self
    }

    /// The size limits of its log files (default [`LogPolicy::default`]).
    pub fn log_limits(mut self, limits: LogPolicy) -> Self {
        self.log_limits = limits;
        self
    }

    /// Writes a pid file at `path` ([`ProcessSpec::pid_file`]; default none).
    pub fn pid_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.pid_file = Some(path.into());
        self
    }

    /// How it reloads in place ([`ProcessSpec::reload`]; default: it cannot).
    pub fn reload(mut self, reload: ReloadPolicy) -> Self {
        self.reload = Some(reload);
        self
    }

    /// Its readiness and liveness checks (default none).
    pub fn health(mut self, health: HealthChecks) -> Self {
        self.health = health;
        self
    }

    /// Listening sockets handed to every instance ([`ProcessSpec::listeners`]; default
    /// none).
    pub fn listeners(mut self, listeners: impl IntoIterator<Item = InheritedSocket>) -> Self {
        self.listeners.extend(listeners);
        self
    }

    /// Environment entries that prove a process found by its pid file or its environment
    /// is this one ([`ProcessSpec::identity_env`]; default none). They are not added to
    /// the environment: give them to [`env`](Self::env) too.
    pub fn identity_env<I, K, V>(mut self, vars: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<OsString>,
        V: Into<OsString>,
    {
        self.identity_env.extend(vars.into_iter().map(|(key, value)| (key.into(), value.into())));
        self
    }

    /// The limits of each instance's cgroup, when the supervisor uses cgroups (default
    /// none).
    pub fn limits(mut self, limits: ResourceLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The spec.
    ///
    /// # Errors
    ///
    /// [`SpecError::NoLogs`] when [`logs`](Self::logs) was not given;
    /// [`SpecError::LogDir`] when the directory of [`LogTarget::Dir`] cannot be created or
    /// opened; [`SpecError::PidFile`] when the pid file's path names no file (`/`, `..`).
    pub fn build(mut self) -> Result<ProcessSpec, SpecError> {
        if let Some(path) = &self.pid_file {
            if path.file_name().is_none() {
                return Err(SpecError::PidFile { path: path.clone() });
            }
        }
        let Some(target) = self.logs.take() else {
            return Err(SpecError::NoLogs { name: self.name });
        };
        let (stdout, stderr) = target.files(&self.name)?;
        Ok(self.with_log_files(stdout, stderr))
    }

    /// The spec, with these log files.
    pub(super) fn with_log_files(self, stdout: LogFile, stderr: LogFile) -> ProcessSpec {
        ProcessSpec {
            name: self.name,
            program: self.program,
            args: self.args,
            env: self.env,
            base_env: Arc::default(),
            working_dir: self.working_dir,
            user: self.user,
            kill: self.kill,
            restart: self.restart,
            restart_on_exit: self.restart_on_exit,
            restarted: None,
            logs: LogSpec { stdout, stderr, limits: self.log_limits, journal: None },
            health: self.health,
            listeners: self.listeners,
            pid_file: self.pid_file,
            identity_env: self.identity_env,
            limits: self.limits,
            reload: self.reload.map(Box::new),
        }
    }
}
