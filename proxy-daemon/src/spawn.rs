//! The one place where processes are created.
//!
//! This module owns process creation: the environment, the process group, the log
//! files, the working directory and the user switch. It never waits for, signals or
//! restarts a process (that is `supervisor`'s job), never runs a shell, and never
//! starts a thread per spawn. Without a user switch it adds no `pre_exec` hook, so the
//! standard library keeps its `posix_spawn` fast path.

use std::ffi::CString;
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Stdio;

use nix::fcntl::OFlag;
use tether_state::persist::PersistError;
use tether_state::{Probe, Readiness};

use crate::error::SpawnError;
use crate::proc::{self, Pidfd};
use crate::spec::{LogFile, ProcessSpec};

/// A freshly spawned process, not yet reaped, with a pidfd that proves which one it is.
#[derive(Debug)]
pub(crate) struct Spawned {
    /// A `std` child: it holds no descriptor (tokio's would hold a pidfd of its own).
    pub(crate) child: std::process::Child,
    pub(crate) pid: u32,
    pub(crate) pidfd: Pidfd,
    /// The read end of the notification pipe, when its readiness check is `fd`.
    pub(crate) notification: Option<OwnedFd>,
}

/// The ids a process switches to before exec.
struct Credentials {
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: Vec<libc::gid_t>,
}

/// Starts `spec`'s program in its own process group. Returns once the process exists.
///
/// Must be called from within a tokio runtime.
pub(crate) fn spawn(spec: &ProcessSpec) -> Result<Spawned, SpawnError> {
    if !spec.program.is_absolute() {
        // There is no `PATH` search: a relative name would be found relative to the working
        // directory, which is rarely what was meant.
        let source = io::Error::new(io::ErrorKind::InvalidInput, "the program must be an absolute path");
        return Err(SpawnError::Exec { program: spec.program.clone(), source });
    }
    let credentials = spec.user.as_deref().map(resolve_user).transpose()?;
    match fs::metadata(&spec.working_dir) {
        Ok(metadata) if metadata.is_dir() => {}
        Ok(_) => {
            return Err(SpawnError::WorkingDir {
                dir: spec.working_dir.clone(),
                source: io::Error::from_raw_os_error(libc::ENOTDIR),
            });
        }
        Err(source) => return Err(SpawnError::WorkingDir { dir: spec.working_dir.clone(), source }),
    }
    let stdout = open_log(&spec.logs.stdout)?;
    let stderr = open_log(&spec.logs.stderr)?;

    let mut command = std::process::Command::new(&spec.program); // std, for `process_group`
    command
        .args(&spec.args)
        .env_clear() // proxies get only what the spec says, never the agent's secrets
        .envs(spec.env.iter().map(|(key, value)| (key, value)))
        .current_dir(&spec.working_dir)
        .stdin(Stdio::null())
        .stdout(stdout) // O_APPEND files opened by us: they outlive an agent restart,
        .stderr(stderr) // where a pipe would hand the proxy a SIGPIPE when the agent dies
        .process_group(0); // own group: terminal Ctrl-C skips it, one killpg reaches its children
    if let Some(credentials) = credentials {
        switch_user_before_exec(&mut command, credentials);
    }
    let notification = match &spec.health.readiness {
        Some(Readiness { probe: Probe::Fd(fd), .. }) => {
            let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)
                .map_err(|errno| SpawnError::Exec { program: spec.program.clone(), source: errno.into() })?;
            give_fd_before_exec(&mut command, write.as_raw_fd(), *fd);
            Some((read, write))
        }
        _ => None,
    };
    let child = command.spawn().map_err(|source| SpawnError::Exec { program: spec.program.clone(), source })?;
    let pid = child.id();
    // The child is not reaped until we wait for it, so its pid cannot have been reused yet.
    let pidfd = match Pidfd::open(pid) {
        Ok(pidfd) => pidfd,
        Err(source) => {
            // Without a pidfd we cannot supervise it: kill it rather than leave it loose, and
            // reap it (SIGKILL ends it at once).
            let _already_gone = proc::signal_group(pid, nix::sys::signal::Signal::SIGKILL);
            let mut child = child;
            let _reaped = child.wait();
            return Err(SpawnError::Watch { pid, source });
        }
    };
    // The child has its copy of the write end; ours would hide its end of file.
    let notification = notification.map(|(read, _write)| read);
    Ok(Spawned { child, pid, pidfd, notification })
}

/// Opens a log file for appending, creating it (0600), relative to its directory's handle:
/// a link planted at its name is replaced, never written through.
fn open_log(log: &LogFile) -> Result<File, SpawnError> {
    log.dir().open_append(log.name()).map_err(|err| match err {
        PersistError::Write { path, source } | PersistError::Read { path, source } => {
            SpawnError::OpenLog { path, source }
        }
        other => SpawnError::OpenLog { path: log.path(), source: io::Error::other(other) },
    })
}

/// Looks up `user`'s uid, primary gid and supplementary groups.
fn resolve_user(user: &str) -> Result<Credentials, SpawnError> {
    let lookup_error =
        |source: nix::errno::Errno| SpawnError::UserLookup { user: user.to_owned(), source: source.into() };
    let Some(entry) = nix::unistd::User::from_name(user).map_err(lookup_error)? else {
        return Err(SpawnError::UnknownUser { user: user.to_owned() });
    };
    let name = CString::new(user).map_err(|_| SpawnError::UnknownUser { user: user.to_owned() })?;
    let groups = nix::unistd::getgrouplist(&name, entry.gid).map_err(lookup_error)?;
    Ok(Credentials {
        uid: entry.uid.as_raw(),
        gid: entry.gid.as_raw(),
        groups: groups.into_iter().map(|gid| gid.as_raw()).collect(),
    })
}

/// Makes the child hold `source` (a descriptor of the parent, close-on-exec) as descriptor
/// `target`, open across exec: s6's notification-fd.
fn give_fd_before_exec(command: &mut std::process::Command, source: RawFd, target: u32) {
    let target = RawFd::try_from(target).unwrap_or(RawFd::MAX);
    #[allow(unsafe_code)]
    // SAFETY: the hook runs in the forked child, where only async-signal-safe calls are
    // allowed: it makes two raw system calls (dup2 or fcntl) on plain integers, and builds
    // its error from errno without allocating.
    unsafe {
        command.pre_exec(move || {
            let done = if source == target {
                // dup2 onto itself keeps close-on-exec: clear it instead.
                libc::fcntl(target, libc::F_SETFD, 0)
            } else {
                libc::dup2(source, target)
            };
            if done < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
        });
    }
}

/// Makes the child drop to `credentials` between fork and exec.
///
/// The standard library's `uid`/`gid` would clear the supplementary groups, and its
/// `groups` is unstable, so the whole switch happens here, in order: groups, gid, uid.
fn switch_user_before_exec(command: &mut std::process::Command, credentials: Credentials) {
    let Credentials { uid, gid, groups } = credentials;
    #[allow(unsafe_code)]
    // SAFETY: the hook runs in the forked child, where only async-signal-safe calls are
    // allowed. It makes three raw system calls (setgroups, setgid, setuid) on data
    // prepared in the parent, reads `groups` without allocating, and builds its error
    // from errno with `io::Error::last_os_error`, which does not allocate either.
    unsafe {
        command.pre_exec(move || {
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::setgid(gid) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::setuid(uid) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    use tether_state::persist::DataDir;

    use super::*;

    #[test]
    fn a_link_planted_at_a_log_file_is_replaced_and_its_target_left_alone() {
        let temp = tempfile::tempdir().unwrap();
        let data = DataDir::open(temp.path().join("data")).unwrap();
        let target = temp.path().join("target");
        fs::write(&target, "not tether's\n").unwrap();
        fs::set_permissions(&target, fs::Permissions::from_mode(0o644)).unwrap();
        let log = LogFile::new(data.logs().clone(), "web-proxy-stdout.log");
        std::os::unix::fs::symlink(&target, log.path()).unwrap();

        open_log(&log).unwrap().write_all(b"the proxy's output\n").unwrap();
        let metadata = fs::symlink_metadata(log.path()).unwrap();
        assert!(metadata.is_file());
        assert_eq!(metadata.permissions().mode() & 0o777, 0o600);
        assert_eq!(fs::read_to_string(log.path()).unwrap(), "the proxy's output\n");
        assert_eq!(fs::read_to_string(&target).unwrap(), "not tether's\n");
        assert_eq!(fs::metadata(&target).unwrap().permissions().mode() & 0o777, 0o644);
    }

    #[test]
    fn a_directory_in_place_of_a_log_file_is_an_open_log_error() {
        let temp = tempfile::tempdir().unwrap();
        let data = DataDir::open(temp.path()).unwrap();
        let log = LogFile::new(data.logs().clone(), "web-proxy-stderr.log");
        fs::create_dir(log.path()).unwrap();
        let error = open_log(&log).unwrap_err();
        assert!(matches!(&error, SpawnError::OpenLog { path, .. } if *path == log.path()), "{error:?}");
        assert!(log.path().is_dir());
    }
}
