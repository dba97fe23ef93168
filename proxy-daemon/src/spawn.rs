//! The one place where processes are created.
//!
//! This module owns process creation: the environment, the process group, the log
//! files, the working directory, the user switch and the descriptors handed over
//! (listeners, a notification pipe). It never waits for, signals or restarts a process
//! (that is `supervisor`'s job), never runs a shell, and never starts a thread per spawn.
//! Without a user switch or a handed descriptor it adds no `pre_exec` hook, so the
//! standard library keeps its `posix_spawn` fast path.
//!
//! A bare program name is looked for in the `PATH` of the process's own environment
//! (`program`): first here, as the agent's user, which fails a name found nowhere before
//! anything is made and gives the plain spawn the path it runs; then, wherever code runs in
//! the child, by the child itself, place after place, as the user it has become.

use std::ffi::{CString, OsString};
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Stdio;

use nix::fcntl::OFlag;
use tether_state::persist::PersistError;
use tether_state::{Probe, Readiness};

use crate::error::SpawnError;
use crate::proc::{self, Pidfd};
use crate::program;
use crate::spec::{LogFile, ProcessSpec};

mod clone;
mod thread;

pub(crate) use thread::{MAX_FDS, hold_until_exec};

/// A freshly spawned process, not yet reaped, with a pidfd that proves which one it is.
#[derive(Debug)]
pub(crate) struct Spawned {
    /// Our child, to reap: it holds no descriptor (tokio's would hold a pidfd of its own).
    pub(crate) child: Child,
    pub(crate) pid: u32,
    pub(crate) pidfd: Pidfd,
    /// The read end of the notification pipe, when its readiness check is `fd`.
    pub(crate) notification: Option<OwnedFd>,
}

/// Our child, until it is reaped: its pid, and its exit status once [`Child::try_wait`] or
/// [`Child::wait`] has reaped it (the pid may then belong to another process).
#[derive(Debug)]
pub(crate) struct Child {
    pid: u32,
    status: Option<std::process::ExitStatus>,
}

impl Child {
    fn new(pid: u32) -> Self {
        Self { pid, status: None }
    }

    pub(crate) fn id(&self) -> u32 {
        self.pid
    }

    /// Ends a child that nobody will supervise: killed with its process group (at once),
    /// and reaped.
    fn abandon(mut self) {
        let _already_gone = proc::signal_group(self.pid, nix::sys::signal::Signal::SIGKILL);
        let _reaped = self.wait();
    }

    /// Reaps it if it has exited.
    pub(crate) fn try_wait(&mut self) -> io::Result<Option<std::process::ExitStatus>> {
        self.reap(libc::WNOHANG)
    }

    /// Waits for it to exit, and reaps it.
    pub(crate) fn wait(&mut self) -> io::Result<std::process::ExitStatus> {
        self.reap(0)?.ok_or_else(|| io::Error::other("waitpid returned without a status"))
    }

    fn reap(&mut self, flags: libc::c_int) -> io::Result<Option<std::process::ExitStatus>> {
        use std::os::unix::process::ExitStatusExt;
        if let Some(status) = self.status {
            return Ok(Some(status));
        }
        let pid = libc::pid_t::try_from(self.pid).map_err(|_| io::Error::from_raw_os_error(libc::ECHILD))?;
        loop {
            let mut status = 0;
            #[allow(unsafe_code)]
            // SAFETY: waitpid on our own, unreaped child, with a status integer owned here.
            let waited = unsafe { libc::waitpid(pid, &mut status, flags) };
            match waited {
                0 => return Ok(None),
                waited if waited == pid => {
                    let status = std::process::ExitStatus::from_raw(status);
                    self.status = Some(status);
                    return Ok(Some(status));
                }
                _ => {
                    let error = io::Error::last_os_error();
                    if error.kind() != io::ErrorKind::Interrupted {
                        return Err(error);
                    }
                }
            }
        }
    }
}

/// Opens `cgroup.procs` of the cgroup whose directory is `cgroup`, for a child to write
/// itself into.
fn open_procs(cgroup: &OwnedFd) -> io::Result<OwnedFd> {
    let flags = OFlag::O_WRONLY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
    Ok(nix::fcntl::openat(cgroup, "cgroup.procs", flags, nix::sys::stat::Mode::empty())?)
}

/// The ids a process switches to before exec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Credentials {
    pub(crate) uid: libc::uid_t,
    pub(crate) gid: libc::gid_t,
    pub(crate) groups: Vec<libc::gid_t>,
}

/// How many processes may be in the making at once, each from its preparation (cgroup, log
/// files) until it runs or failed: enough that the spawn thread always finds the next one
/// ready while the runtime's workers prepare more, few enough that a burst of starts holds
/// a handful of descriptors, not one set per proxy.
const IN_FLIGHT: usize = 8;

static SLOTS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(IN_FLIGHT);

/// A place among the processes in the making ([`slot`]), held from the preparation of one
/// until it runs or failed.
pub(crate) struct Slot {
    _permit: Option<tokio::sync::SemaphorePermit<'static>>,
}

/// Waits for a place among the processes in the making, in the order asked.
pub(crate) async fn slot() -> Slot {
    // The semaphore is never closed.
    Slot { _permit: SLOTS.acquire().await.ok() }
}

/// Starts `spec`'s program in its own process group, and in the cgroup whose directory is
/// `cgroup` if one is given: born in it (`clone3`), or where that is refused, entering it
/// before anything else happens in the child. Returns once the process has exec'd; while
/// it waits for that, the caller's worker thread is free for other tasks.
///
/// Must be called from within a tokio runtime, holding a [`Slot`].
pub(crate) async fn spawn(spec: &ProcessSpec, cgroup: Option<&OwnedFd>, _slot: &Slot) -> Result<Spawned, SpawnError> {
    queue(spec, cgroup, Birth::IntoCgroup)?.finish(&spec.program).await
}

/// A process created by a keeper: its keeper, which tells how it ends, and what the caller
/// needs of it, as for [`Spawned`].
#[derive(Debug)]
pub(crate) struct KeptSpawn {
    pub(crate) link: std::sync::Arc<crate::keeper::Link>,
    pub(crate) process: crate::keeper::Kept,
    pub(crate) pidfd: Pidfd,
    pub(crate) notification: Option<OwnedFd>,
}

/// [`spawn`], by the keeper of `link`, whose child the process is; `held` are held by the
/// child until its exec.
///
/// # Cancel safety
///
/// A process created for a caller that stopped waiting is killed.
pub(crate) async fn spawn_kept(
    spec: &ProcessSpec,
    cgroup: Option<&OwnedFd>,
    link: std::sync::Arc<crate::keeper::Link>,
    held: &[OwnedFd],
    _slot: &Slot,
) -> Result<KeptSpawn, SpawnError> {
    let prepared = Prepared::new(spec, cgroup.is_some(), Birth::IntoCgroup)?;
    let (process, pidfd) = link
        .spawn(&prepared.creation, held, &prepared.passed(spec, cgroup))
        .await
        .map_err(|source| SpawnError::Exec { program: spec.program.clone(), source })?;
    // The keeper had its copies of the log files and of the pipe's write end: ours close.
    let Prepared { pipe, .. } = prepared;
    Ok(KeptSpawn { link, process, pidfd, notification: pipe.map(|(read, _write)| read) })
}

/// Starts a keeper: `program args…` with `fds` as its descriptors 3 and 4, its standard
/// input and output on `/dev/null`, its errors to `stderr` (else `/dev/null`). It makes a
/// session of its own; it is this process's child until this process dies.
pub(crate) fn start_keeper(
    program: &std::path::Path,
    arg0: &std::ffi::OsStr,
    args: &[OsString],
    fds: [BorrowedFd<'_>; 2],
    stderr: Option<File>,
) -> io::Result<std::process::Child> {
    let mut command = std::process::Command::new(program);
    command
        .arg0(arg0)
        .args(args)
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr.map_or_else(Stdio::null, Stdio::from));
    give_fds_before_exec(&mut command, vec![(fds[0].as_raw_fd(), 3), (fds[1].as_raw_fd(), 4)]);
    command.spawn()
}

/// How a child gets into its cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Birth {
    /// Born there (`clone3`), unless that is refused.
    IntoCgroup,
    /// It writes itself into `cgroup.procs` before its exec: the way where `clone3` is
    /// refused, chosen directly by the tests of that way.
    #[cfg_attr(not(test), allow(dead_code))]
    EnteringCgroup,
}

/// Everything the creation of one process needs, prepared from its spec: plain data, with
/// the descriptors it is handed passed beside it, so that the process can be created on a
/// spawn thread of this process or by a keeper ([`crate::keeper`]), the same way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Creation {
    /// What a plain spawn runs: the program as found in `PATH` by this process's user.
    pub(crate) found: PathBuf,
    /// The program as configured: `argv[0]`, and what a child that runs code looks for.
    pub(crate) program: PathBuf,
    pub(crate) args: Vec<OsString>,
    /// The whole environment, in order (a later entry of a name wins).
    pub(crate) env: Vec<(OsString, OsString)>,
    /// Where a child that runs code before its exec looks for the program, in order.
    pub(crate) candidates: Vec<PathBuf>,
    pub(crate) dir: PathBuf,
    /// The names of the listeners it is handed, in order (`LISTEN_FDNAMES`).
    pub(crate) listeners: Vec<String>,
    pub(crate) credentials: Option<Credentials>,
    /// Where each handed descriptor goes, in the order they are passed.
    pub(crate) targets: Vec<RawFd>,
    /// Whether a cgroup's directory is passed, after the log files.
    pub(crate) cgroup: bool,
    pub(crate) birth: Birth,
}

/// A process prepared for its creation: its [`Creation`] and the descriptors it needs.
struct Prepared {
    creation: Creation,
    stdout: File,
    stderr: File,
    /// Its notification pipe (read end, write end), when its readiness check is `fd`.
    pipe: Option<(OwnedFd, OwnedFd)>,
}

impl Prepared {
    /// Prepares `spec`'s process: finds its program, resolves its user, checks its working
    /// directory and opens its log files, so that what can fail here fails before anything
    /// is made.
    fn new(spec: &ProcessSpec, cgroup: bool, birth: Birth) -> Result<Self, SpawnError> {
        let exec_error = |source| SpawnError::Exec { program: spec.program.clone(), source };
        if spec.program.is_relative() && !program::is_bare_name(&spec.program) {
            // It would be found relative to the working directory, which is rarely what was
            // meant (the config refuses it too).
            let source = io::Error::new(
                io::ErrorKind::InvalidInput,
                "a relative path: give an absolute path, or a bare name to look up in PATH",
            );
            return Err(exec_error(source));
        }
        let env = spec.environment();
        let path = program::search_path(&env);
        // Looked for as this process's user before anything is made, so that a name found
        // nowhere fails here, naming the PATH searched. What is found is what a plain spawn
        // runs; a child that runs code before its exec looks again, as the user it has become.
        let found = program::find_in(&spec.program, &path)?;
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
        if cgroup && spec.working_dir.as_os_str().as_encoded_bytes().contains(&0) {
            return Err(SpawnError::WorkingDir {
                dir: spec.working_dir.clone(),
                source: io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the path"),
            });
        }
        let stdout = open_log(&spec.logs.stdout)?;
        let stderr = open_log(&spec.logs.stderr)?;
        if let Some(sink) = spec.logs.journal_sink(&spec.name) {
            sink.reachable().map_err(|source| SpawnError::Journal {
                name: spec.name.as_str().to_owned(),
                socket: sink.socket.clone(),
                source,
            })?;
        }
        // Descriptors the child holds at fixed numbers: the listeners from 3, then the write
        // end of its notification pipe.
        let mut targets: Vec<RawFd> = (3..).take(spec.listeners.len()).collect();
        let pipe = match spec.health.readiness.as_deref() {
            Some(Readiness { probe: Probe::Fd(fd), .. }) => {
                let pipe =
                    nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).map_err(|e| exec_error(e.into()))?;
                targets.push(RawFd::try_from(*fd).unwrap_or(RawFd::MAX));
                Some(pipe)
            }
            _ => None,
        };
        let creation = Creation {
            found,
            program: spec.program.clone(),
            args: spec.args.clone(),
            candidates: program::candidates(&spec.program, &path),
            env,
            dir: spec.working_dir.clone(),
            listeners: spec.listeners.iter().map(|listener| listener.name.as_str().to_owned()).collect(),
            credentials,
            targets,
            cgroup,
            birth,
        };
        Ok(Self { creation, stdout, stderr, pipe })
    }

    /// The descriptors its creation is handed, in the order [`create`] takes them: the log
    /// files, the cgroup's directory, then the listeners and the pipe's write end.
    fn passed<'a>(&'a self, spec: &'a ProcessSpec, cgroup: Option<&'a OwnedFd>) -> Vec<BorrowedFd<'a>> {
        let mut passed = vec![self.stdout.as_fd(), self.stderr.as_fd()];
        passed.extend(cgroup.map(AsFd::as_fd));
        passed.extend(spec.listeners.iter().map(|listener| listener.socket.as_fd()));
        passed.extend(self.pipe.as_ref().map(|(_, write)| write.as_fd()));
        passed
    }
}

/// Prepares `spec`'s process and queues its creation on the spawn thread.
fn queue(spec: &ProcessSpec, cgroup: Option<&OwnedFd>, birth: Birth) -> Result<Pending, SpawnError> {
    let prepared = Prepared::new(spec, cgroup.is_some(), birth)?;
    let creation = prepared.creation.clone();
    // Created on the spawn thread, from copies of these descriptors in its small table.
    let reply = thread::queue(&prepared.passed(spec, cgroup), move |fds| {
        create(&creation, fds).map(|pid| Unclaimed(Child::new(pid)))
    })
    .map_err(|source| SpawnError::Exec { program: spec.program.clone(), source })?;
    // The spawn thread holds copies of the log files and of the pipe's write end from here
    // on; ours are closed now (the child's end of file on the pipe needs that).
    let Prepared { pipe, .. } = prepared;
    let notification = pipe.map(|(read, _write)| read);
    Ok(Pending { reply, notification })
}

/// Creates the process `creation` describes, from `fds` (as [`Prepared::passed`] orders
/// them), and returns its pid once it has exec'd. Runs where the process's parent is: on a
/// spawn thread, or in a keeper.
pub(crate) fn create(creation: &Creation, fds: Vec<OwnedFd>) -> io::Result<u32> {
    let mut fds = fds.into_iter();
    let (Some(stdout), Some(stderr)) = (fds.next(), fds.next()) else {
        return Err(io::Error::other("the log files did not reach the process's creator"));
    };
    let cgroup = if creation.cgroup { fds.next() } else { None };
    let handed: Vec<OwnedFd> = fds.collect();
    if handed.len() != creation.targets.len() {
        return Err(io::Error::other("the handed descriptors did not reach the process's creator"));
    }
    let targets = &creation.targets;
    // A child that runs code before its exec execs itself, from what is prepared here: it
    // looks for the program as the user it has become, and `LISTEN_PID` must be its own
    // pid, known only after the fork. A child born in its cgroup execs the same way.
    let runs_code = !handed.is_empty() || cgroup.is_some() || creation.credentials.is_some();
    let mut exec = runs_code.then(|| Exec::new(creation)).transpose()?;
    let mut procs = None;
    if let (Some(cgroup), Birth::EnteringCgroup) = (&cgroup, creation.birth) {
        procs = Some(open_procs(cgroup)?);
    } else if let (Some(cgroup), Some(exec)) = (&cgroup, exec.as_mut()) {
        let dir = CString::new(creation.dir.as_os_str().as_encoded_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the working directory"))?;
        let pairs: Vec<(RawFd, RawFd)> = handed.iter().map(AsRawFd::as_raw_fd).zip(targets.iter().copied()).collect();
        let mut plan = clone::ChildPlan {
            candidates: exec.candidates.iter().map(|candidate| candidate.as_ptr()).collect(),
            argv: exec.argv.iter().map(|&address| address as *const libc::c_char).collect(),
            envp: exec.envp.iter().map(|&address| address as *const libc::c_char).collect(),
            dir,
            dev_null: CString::from(c"/dev/null"),
            stdout: stdout.as_raw_fd(),
            stderr: stderr.as_raw_fd(),
            copies: vec![-1; pairs.len()],
            handed: pairs,
            credentials: creation.credentials.as_ref().map(|c| (c.uid, c.gid, c.groups.clone())),
            listen_pid: exec.listen_pid.take().map(|buffer| (buffer, exec.listen_pid_slot)),
            failed: 0,
        };
        match clone::spawn_into(&mut plan, cgroup.as_raw_fd()) {
            Ok(pid) => return Ok(pid),
            Err(clone::CloneError::Failed(error)) => return Err(error),
            Err(clone::CloneError::Unsupported) => {
                // The standard library's way: the child enters through `cgroup.procs`.
                if let Some((buffer, _)) = plan.listen_pid.take() {
                    exec.listen_pid = Some(buffer);
                }
                procs = Some(open_procs(cgroup)?);
            }
        }
    }
    let mut command = std::process::Command::new(&creation.found); // std, for `process_group`
    command
        .arg0(&creation.program) // the name as configured, as `execvp` passes it
        .args(&creation.args)
        .env_clear() // proxies get only what the spec says, never the agent's secrets
        .envs(creation.env.iter().map(|(key, value)| (key, value)))
        .current_dir(&creation.dir)
        .stdin(Stdio::null())
        .stdout(File::from(stdout)) // O_APPEND files opened by us: they outlive an agent
        .stderr(File::from(stderr)) // restart, where a pipe would hand the proxy a SIGPIPE
        .process_group(0); // own group: terminal Ctrl-C skips it, one killpg reaches its children
    // First: no later hook, and nothing the program does, runs outside the cgroup.
    if let Some(procs) = &procs {
        enter_cgroup_before_exec(&mut command, procs.as_raw_fd());
    }
    if let Some(credentials) = creation.credentials.clone() {
        switch_user_before_exec(&mut command, credentials);
    }
    if !handed.is_empty() {
        let pairs = handed.iter().map(AsRawFd::as_raw_fd).zip(targets.iter().copied()).collect();
        give_fds_before_exec(&mut command, pairs);
    }
    if let Some(exec) = exec {
        exec_from_child(&mut command, exec);
    }
    // `handed` and `procs` live until the child has its copies.
    let child = command.spawn().map(|child| child.id());
    drop((handed, procs, cgroup));
    child
}

/// A child just created, until its creator claims it. Should the creator be gone (its start
/// was cancelled while the process was being made), the process is killed and reaped when
/// this is dropped: none runs unsupervised.
struct Unclaimed(Child);

impl Unclaimed {
    fn claim(self) -> Child {
        let unclaimed = std::mem::ManuallyDrop::new(self);
        Child { pid: unclaimed.0.pid, status: unclaimed.0.status }
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        Child { pid: self.0.pid, status: self.0.status }.abandon();
    }
}

/// A process in the making: queued on the spawn thread, its creation to be awaited.
struct Pending {
    reply: thread::Reply<Unclaimed>,
    /// The read end of its notification pipe, if it has one.
    notification: Option<OwnedFd>,
}

impl Pending {
    /// Waits until the process has exec'd (or failed to), and opens its pidfd. `program`
    /// names it in an error.
    async fn finish(self, program: &std::path::Path) -> Result<Spawned, SpawnError> {
        let Self { reply, notification } = self;
        let child =
            reply.wait().await.map_err(|source| SpawnError::Exec { program: program.to_owned(), source })?.claim();
        let pid = child.id();
        // The child is not reaped until we wait for it, so its pid cannot have been reused yet.
        let pidfd = match Pidfd::open(pid) {
            Ok(pidfd) => pidfd,
            Err(source) => {
                // Without a pidfd we cannot supervise it: kill it rather than leave it loose.
                child.abandon();
                return Err(SpawnError::Watch { pid, source });
            }
        };
        Ok(Spawned { child, pid, pidfd, notification })
    }
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

/// Makes the child hold each `source` (a descriptor of the parent, close-on-exec) as its
/// `target`, open across exec: the listeners, and s6's notification-fd.
///
/// Every source is first copied above every target, so that no placement overwrites a
/// source still to be placed; the copies are close-on-exec and vanish at the exec.
fn give_fds_before_exec(command: &mut std::process::Command, handed: Vec<(RawFd, RawFd)>) {
    let above = handed.iter().map(|&(_, target)| target).max().unwrap_or(2).saturating_add(1);
    let mut copies: Vec<RawFd> = vec![-1; handed.len()];
    #[allow(unsafe_code)]
    // SAFETY: the hook runs in the forked child, where only async-signal-safe calls are
    // allowed: it makes raw system calls (fcntl, dup2) on integers, writes into a vector
    // allocated in the parent (never grown), and builds its error from errno without
    // allocating.
    unsafe {
        command.pre_exec(move || {
            for (copy, &(source, _)) in copies.iter_mut().zip(&handed) {
                *copy = libc::fcntl(source, libc::F_DUPFD_CLOEXEC, above);
                if *copy < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            for (&copy, &(_, target)) in copies.iter().zip(&handed) {
                // dup2 clears close-on-exec on the target.
                if libc::dup2(copy, target) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// What a child execs, prepared in the parent: the places where the program may be, its
/// arguments and its environment, with `LISTEN_FDS`, `LISTEN_FDNAMES` and a slot for
/// `LISTEN_PID` when it inherits listeners, so that the child only writes its pid and
/// tries each place.
struct Exec {
    /// The program itself, or where a bare name may be, in order ([`program::candidates`]).
    candidates: Vec<CString>,
    /// Owns what `argv` and `envp` point to.
    _strings: Vec<CString>,
    /// Addresses of NUL-terminated strings, then 0: `char *const argv[]`.
    argv: Vec<usize>,
    envp: Vec<usize>,
    /// `LISTEN_PID=` and room for any pid, NUL-terminated once written; `None` without
    /// listeners.
    listen_pid: Option<Box<[u8; 32]>>,
    /// Where in `envp` the `LISTEN_PID` entry goes.
    listen_pid_slot: usize,
}

const LISTEN_PID_PREFIX: &[u8] = b"LISTEN_PID=";

/// Completes `buffer` (`LISTEN_PID=` and room) with `pid` in decimal and a NUL, without
/// allocating: it runs in a child between its birth and its exec.
fn write_listen_pid(buffer: &mut [u8; 32], mut pid: u32) {
    let mut digits = [0u8; 10];
    let mut start = digits.len();
    loop {
        start -= 1;
        digits[start] = b'0' + (pid % 10) as u8;
        pid /= 10;
        if pid == 0 {
            break;
        }
    }
    let end = LISTEN_PID_PREFIX.len() + digits.len() - start;
    buffer[LISTEN_PID_PREFIX.len()..end].copy_from_slice(&digits[start..]);
    buffer[end] = 0;
}

impl Exec {
    fn new(creation: &Creation) -> io::Result<Self> {
        use std::os::unix::ffi::OsStrExt;
        let c_string = |bytes: &[u8]| {
            CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the command"))
        };
        let candidates = creation
            .candidates
            .iter()
            .map(|candidate| c_string(candidate.as_os_str().as_bytes()))
            .collect::<io::Result<Vec<_>>>()?;
        let mut strings = vec![c_string(creation.program.as_os_str().as_bytes())?];
        strings.extend(creation.args.iter().map(|arg| c_string(arg.as_bytes())).collect::<io::Result<Vec<_>>>()?);
        let arg_count = strings.len();
        let reserved = |key: &[u8]| matches!(key, b"LISTEN_FDS" | b"LISTEN_PID" | b"LISTEN_FDNAMES");
        for (key, value) in &creation.env {
            if !reserved(key.as_bytes()) {
                strings.push(c_string(&[key.as_bytes(), b"=", value.as_bytes()].concat())?);
            }
        }
        let listens = !creation.listeners.is_empty();
        if listens {
            strings.push(c_string(format!("LISTEN_FDS={}", creation.listeners.len()).as_bytes())?);
            strings.push(c_string(format!("LISTEN_FDNAMES={}", creation.listeners.join(":")).as_bytes())?);
        }
        let pointers = |strings: &[CString]| {
            let mut pointers: Vec<usize> = strings.iter().map(|s| s.as_ptr() as usize).collect();
            pointers.push(0);
            pointers
        };
        let argv = pointers(&strings[..arg_count]);
        let mut envp = pointers(&strings[arg_count..]);
        // The slot for LISTEN_PID, before the terminating null.
        let listen_pid_slot = envp.len() - 1;
        let listen_pid = listens.then(|| {
            envp.insert(listen_pid_slot, 0);
            let mut listen_pid = Box::new([0u8; 32]);
            listen_pid[..LISTEN_PID_PREFIX.len()].copy_from_slice(LISTEN_PID_PREFIX);
            listen_pid
        });
        Ok(Self { candidates, _strings: strings, argv, envp, listen_pid, listen_pid_slot })
    }
}

/// Makes the child exec itself from `exec`: with `LISTEN_PID` its own pid, and the program
/// looked for as the user it has become ([`exec_first`]). Registered last, after every
/// other hook.
fn exec_from_child(command: &mut std::process::Command, mut exec: Exec) {
    #[allow(unsafe_code)]
    // SAFETY: the hook runs in the forked child, where only async-signal-safe calls are
    // allowed: getpid and execve, digits written into a buffer allocated in the parent,
    // pointers (prepared in the parent to strings it owns) stored into a vector that is
    // never grown, and a walk over vectors the parent filled. `exec_first` returns only on
    // failure, with the errno, which `io::Error::from_raw_os_error` wraps without
    // allocating.
    unsafe {
        command.pre_exec(move || {
            // The whole struct, not only the fields used below: `_strings` must live as
            // long as the pointers to it (a closure would capture fields one by one).
            let exec = &mut exec;
            if let Some(listen_pid) = exec.listen_pid.as_mut() {
                write_listen_pid(listen_pid, libc::getpid().unsigned_abs());
                exec.envp[exec.listen_pid_slot] = listen_pid.as_ptr() as usize;
            }
            let errno = exec_first(
                exec.candidates.iter().map(|candidate| candidate.as_ptr()),
                exec.argv.as_ptr().cast::<*const libc::c_char>(),
                exec.envp.as_ptr().cast::<*const libc::c_char>(),
            );
            Err(io::Error::from_raw_os_error(errno))
        });
    }
}

/// In a child, between its creation and its exec: execs the first of `candidates` that can
/// be, as `execvpe` does (past places where nothing is, and past those this user may not
/// execute). Returns only when none could, with the errno to report: the one that ended the
/// search, else `EACCES` when some place was refused, else the last place's.
///
/// # Safety
///
/// `candidates` yields NUL-terminated strings and `argv` and `envp` are null-terminated
/// arrays of them, all valid until the exec. It makes system calls and compares integers,
/// nothing else: fit for a child that may not allocate.
#[allow(unsafe_code)]
unsafe fn exec_first(
    candidates: impl Iterator<Item = *const libc::c_char>,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> i32 {
    let mut denied = false;
    let mut last = libc::ENOENT;
    for candidate in candidates {
        // SAFETY: as the caller promises; execve returns only on failure.
        let errno = unsafe {
            libc::execve(candidate, argv, envp);
            *libc::__errno_location()
        };
        match program::after_failure(errno) {
            program::Next::Absent => last = errno,
            program::Next::Denied => denied = true,
            program::Next::Stop => return errno,
        }
    }
    if denied { libc::EACCES } else { last }
}

/// Makes the child enter the cgroup whose `cgroup.procs` is `procs` between fork and exec.
fn enter_cgroup_before_exec(command: &mut std::process::Command, procs: RawFd) {
    #[allow(unsafe_code)]
    // SAFETY: the hook runs in the forked child and only calls `cgroup::enter`, one `write`,
    // which is async-signal-safe; `procs` stays open in the parent until the spawn returned.
    unsafe {
        command.pre_exec(move || crate::cgroup::enter(procs));
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
    use std::path::Path;

    use tether_state::persist::DataDir;

    use super::*;

    /// Both ways into a cgroup, as root where cgroup2 is writable: the child is in its
    /// cgroup from its exec on, and a program that cannot run is an error that leaves no
    /// process behind.
    #[tokio::test]
    #[allow(clippy::print_stderr)] // a skipped test says why
    async fn a_child_is_in_its_cgroup_whichever_way_it_got_there() {
        let temp = tempfile::tempdir().unwrap();
        let cgroups = match crate::cgroup::Cgroups::open(None, temp.path()) {
            Ok(cgroups) => cgroups,
            Err(unavailable) => {
                eprintln!("skipped: {unavailable}");
                return;
            }
        };
        let data = DataDir::open(temp.path().join("data")).unwrap();
        for birth in [Birth::IntoCgroup, Birth::EnteringCgroup] {
            let name = crate::spec::ProcessName::new("cgroup-proxy").unwrap();
            let cgroup = cgroups.create(name.as_str(), &tether_state::ResourceLimits::default()).unwrap();
            let mut spec = ProcessSpec::new(name.clone(), "/bin/sleep", &data);
            spec.args = vec!["30".into()];
            let Spawned { mut child, pid, .. } =
                queue(&spec, Some(&cgroup.dir), birth).unwrap().finish(&spec.program).await.unwrap();
            let member = cgroups.membership(pid);
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
            child.wait().unwrap();
            assert_eq!(member.unwrap().as_deref(), Some(&*cgroup.name), "{birth:?}");

            let mut missing = ProcessSpec::new(name, "/nonexistent/program", &data);
            missing.args = Vec::new();
            let error = match queue(&missing, Some(&cgroup.dir), birth) {
                Ok(pending) => pending.finish(&missing.program).await.unwrap_err(),
                Err(error) => error,
            };
            assert!(
                matches!(&error, SpawnError::Exec { source, .. } if source.raw_os_error() == Some(libc::ENOENT)),
                "{birth:?}: {error:?}"
            );
            cgroups.sweep(&cgroup.name).await;
        }
        // Nothing was left in the cgroups, so the subtree goes.
        cgroups.remove_if_empty();
        assert!(!cgroups.dir().exists());
    }

    /// The entries of `/proc/<pid>/environ` once the exec has recorded them (`until` is one
    /// of them), or whatever was there at the deadline.
    async fn environ_of(pid: u32, until: &str) -> Vec<String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let environ = fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let entries: Vec<String> = environ
                .split(|&b| b == 0)
                .filter(|entry| !entry.is_empty())
                .map(|entry| String::from_utf8_lossy(entry).into_owned())
                .collect();
            if entries.iter().any(|entry| entry == until) || std::time::Instant::now() > deadline {
                return entries;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// Both ways into a cgroup (born there, or entering through `cgroup.procs`, the way
    /// where `clone3` is refused), as root where cgroup2 is writable: the child gets each
    /// variable once, with the value of its last entry, finds a bare name in that `PATH`,
    /// and a name found nowhere fails before anything is made, naming the `PATH`.
    #[tokio::test]
    #[allow(clippy::print_stderr)] // a skipped test says why
    async fn both_ways_into_a_cgroup_find_a_bare_name_in_the_last_path_and_pass_each_variable_once() {
        let temp = tempfile::tempdir().unwrap();
        let cgroups = match crate::cgroup::Cgroups::open(None, temp.path()) {
            Ok(cgroups) => cgroups,
            Err(unavailable) => {
                eprintln!("skipped: {unavailable}");
                return;
            }
        };
        let data = DataDir::open(temp.path().join("data")).unwrap();
        let bin = temp.path().join("bin");
        fs::create_dir(&bin).unwrap();
        fs::copy("/bin/sleep", bin.join("tether-sleep")).unwrap();
        let path = format!("{}:{}", temp.path().join("missing").display(), bin.display());
        let layers = |path: &str| -> Vec<(OsString, OsString)> {
            [("PATH", "/usr/bin:/bin"), ("LAYER", "agent"), ("PATH", path), ("LAYER", "env")]
                .into_iter()
                .map(|(key, value)| (key.into(), value.into()))
                .collect()
        };
        for birth in [Birth::IntoCgroup, Birth::EnteringCgroup] {
            let name = crate::spec::ProcessName::new("env-proxy").unwrap();
            let cgroup = cgroups.create(name.as_str(), &tether_state::ResourceLimits::default()).unwrap();
            let mut spec = ProcessSpec::new(name.clone(), "tether-sleep", &data);
            spec.args = vec!["30".into()];
            spec.env = layers(&path).into();
            let Spawned { mut child, pid, .. } =
                queue(&spec, Some(&cgroup.dir), birth).unwrap().finish(&spec.program).await.unwrap();
            let mut environ = environ_of(pid, "LAYER=env").await;
            environ.sort_unstable();
            let exe = fs::read_link(format!("/proc/{pid}/exe"));
            let member = cgroups.membership(pid);
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
            child.wait().unwrap();
            assert_eq!(environ, ["LAYER=env".to_owned(), format!("PATH={path}")], "{birth:?}");
            assert_eq!(exe.unwrap(), bin.join("tether-sleep"), "{birth:?}");
            assert_eq!(member.unwrap().as_deref(), Some(&*cgroup.name), "{birth:?}");

            let mut missing = ProcessSpec::new(name, "sleep", &data);
            missing.env = layers(&bin.to_string_lossy()).into();
            let error = queue(&missing, Some(&cgroup.dir), birth).map(|_| ()).unwrap_err();
            assert!(
                matches!(&error, SpawnError::ProgramNotFound(e) if e.path == bin.as_os_str()),
                "{birth:?}: {error:?}"
            );
            cgroups.sweep(&cgroup.name).await;
        }
        cgroups.remove_if_empty();
    }

    /// A child that nobody claims (its start was cancelled while it was being made) is
    /// killed and reaped: nothing of it is left, not even a zombie.
    #[tokio::test]
    async fn an_unclaimed_child_is_killed_and_reaped() {
        let temp = tempfile::tempdir().unwrap();
        let data = DataDir::open(temp.path()).unwrap();
        let mut spec = ProcessSpec::new(crate::spec::ProcessName::new("unclaimed").unwrap(), "/bin/sleep", &data);
        spec.args = vec!["30".into()];
        let slot = slot().await;
        let Spawned { child, pid, .. } = spawn(&spec, None, &slot).await.unwrap();
        assert!(Path::new(&format!("/proc/{pid}")).exists());
        drop(Unclaimed(child));
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "{pid} is gone, reaped");
    }

    #[test]
    fn listen_pid_is_written_in_decimal_and_terminated() {
        for (pid, text) in [(7, "LISTEN_PID=7"), (4_194_304, "LISTEN_PID=4194304"), (u32::MAX, "LISTEN_PID=4294967295")]
        {
            let mut buffer = [0xffu8; 32];
            buffer[..LISTEN_PID_PREFIX.len()].copy_from_slice(LISTEN_PID_PREFIX);
            write_listen_pid(&mut buffer, pid);
            let written = std::ffi::CStr::from_bytes_until_nul(&buffer).unwrap();
            assert_eq!(written.to_str().unwrap(), text);
        }
    }

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
