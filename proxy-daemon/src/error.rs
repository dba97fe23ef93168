//! The errors of this crate, one type per operation.
//!
//! This module owns the error types and their messages. It never formats a cause into a
//! message (causes are `#[source]`s) and never carries environment values, which may be
//! secrets, but the `PATH` a program was looked for in, which only lists directories.

use std::ffi::OsString;
use std::io;
use std::path::PathBuf;

use crate::spec::ProcessName;
use crate::status::ProcessState;

/// A process name that breaks the id rule: an ASCII letter or digit, then letters, digits,
/// `.`, `_` and `-`, at most 134 bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid process name {name:?}: it must match ^[A-Za-z0-9][A-Za-z0-9._-]{{0,133}}$")]
pub struct InvalidName {
    /// The rejected name.
    pub name: String,
}

/// A bare program name that no directory of the `PATH` searched holds as a file that may
/// be executed ([`find_program`](crate::find_program)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "program `{}` not found in PATH `{}`{}",
    .program.display(),
    .path.to_string_lossy(),
    if *.denied { " (a file of that name may not be executed)" } else { "" }
)]
#[non_exhaustive]
pub struct ProgramNotFound {
    /// The name looked for.
    pub program: PathBuf,
    /// The `PATH` searched: the environment's, or `execvp`'s default when it has none.
    pub path: OsString,
    /// Whether some directory holds a file of that name that may not be executed (by the
    /// user who looked), rather than none at all: `execvp`'s `EACCES`.
    pub denied: bool,
}

/// Why [`ProcessSpecBuilder::build`](crate::ProcessSpecBuilder::build) made no spec.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// No [`LogTarget`](crate::LogTarget) was given: every process's output goes to files.
    #[error("no log target for process {name}")]
    NoLogs {
        /// The process.
        name: ProcessName,
    },

    /// The log directory could not be created or opened.
    #[error("cannot open log directory `{}`", .path.display())]
    LogDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },

    /// The pid file's path names no file (it is `/` or ends in `..`).
    #[error("pid file path `{}` names no file", .path.display())]
    PidFile {
        /// The path given.
        path: PathBuf,
    },
}

/// Why a process could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpawnError {
    /// The program could not be executed (missing, not executable, not found in `PATH` by
    /// the user the process switched to, or the user switch failed in the child).
    #[error("failed to execute `{}`", .program.display())]
    Exec {
        /// The program.
        program: PathBuf,
        /// The cause reported by the child or by `posix_spawn`.
        #[source]
        source: io::Error,
    },

    /// The program is a bare name that no directory of the `PATH` of the process's
    /// environment holds.
    #[error(transparent)]
    ProgramNotFound(#[from] ProgramNotFound),

    /// The user to run as does not exist.
    #[error("unknown user {user:?}")]
    UnknownUser {
        /// The user name from the spec.
        user: String,
    },

    /// The user database could not be read.
    #[error("failed to look up user {user:?}")]
    UserLookup {
        /// The user name from the spec.
        user: String,
        /// The cause.
        #[source]
        source: io::Error,
    },

    /// The working directory is not a usable directory.
    #[error("working directory `{}` is not usable", .dir.display())]
    WorkingDir {
        /// The working directory from the spec.
        dir: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },

    /// The process's output goes to the journal, and no journal listens at its socket.
    #[error("{name}: log_target sends its output to the journal, which does not listen at `{}`", .socket.display())]
    Journal {
        /// The process's name (the proxy id).
        name: String,
        /// The journal's socket.
        socket: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A log file could not be opened or created.
    #[error("failed to open log file `{}`", .path.display())]
    OpenLog {
        /// The log file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },

    /// The instance's cgroup could not be made as its spec says (a limit without its
    /// controller, a cgroup file that could not be written).
    #[error(transparent)]
    Cgroup(#[from] crate::cgroup::CgroupError),

    /// The keeper, the parent of the supervisor's processes, could not be started or
    /// reached; the start is retried like any other that failed.
    #[error("the keeper of the processes is not available")]
    Keeper {
        /// The cause.
        #[source]
        source: io::Error,
    },

    /// The process started, but the supervisor could not watch it, so it was killed.
    #[error("failed to watch pid {pid}")]
    Watch {
        /// The pid of the killed process.
        pid: u32,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// Why [`ProcessHandle::detach`](crate::ProcessHandle::detach) returned no identity.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DetachError {
    /// There was no process to detach: it had exited and was waiting to restart, or had
    /// stopped or failed. Supervision has ended all the same.
    #[error("no running process to detach (state {state})")]
    NotRunning {
        /// The state the process was in.
        state: ProcessState,
    },

    /// The identity of the running process could not be read. The process keeps running,
    /// unsupervised.
    #[error("failed to read the identity of pid {pid}")]
    Identity {
        /// The pid of the process.
        pid: u32,
        /// The cause.
        #[source]
        source: io::Error,
    },
}
