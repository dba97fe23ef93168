//! The [`Supervisor`] and its per-process [`ProcessHandle`].
//!
//! This module owns the lifecycle of every supervised process: one tokio task per
//! process that learns of its exit through a pidfd, sweeps its process group, restarts
//! it per the restart policy, and stops or detaches it on command. It never polls,
//! never waits for a pid it did not spawn (adopted processes are watched, not reaped),
//! never signals a process group whose leader it has not proven to be the same process,
//! and never restarts a process after a stop.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::{oneshot, watch};

use crate::cgroup::{CgroupError, Cgroups, Usage};
use crate::control;
use crate::error::{DetachError, SpawnError};
use crate::journal::Handover;
use crate::notify::NotifyHub;
use crate::pidfile::PidFiles;
use crate::probe::{ProbeDurations, ProbeStats};
use crate::proc::{self, Identity};
use crate::rotate::Rotator;
use crate::spawn;
use crate::spec::{Environment, ProcessName, ProcessSpec, ProcessUpdate, ReloadOutcome, ReloadResult};
use crate::status::{ProcessStatus, SupervisedProcess};

mod adopt;
mod checks;
mod instance;
mod lines;
mod reload;
mod task;
mod watched;

pub(crate) use reload::ReloadReply;

#[cfg(feature = "manager")] // the engine adapter's
pub(crate) use adopt::Proven;
use instance::{Instance, InstanceKind};
use task::Task;

/// Spawns, supervises, restarts, stops and adopts OS processes.
///
/// Cheap to clone: clones share one log-rotation task and one pid-file writer. Each
/// supervised process is one tokio task, owned by its [`ProcessHandle`].
#[derive(Clone)]
pub struct Supervisor {
    shared: Arc<Shared>,
}

struct Shared {
    boot_id: String,
    /// Boot time (seconds since the epoch) and clock ticks per second, to turn a start
    /// time from `/proc/<pid>/stat` into a `SystemTime`.
    boot_time: Option<(u64, u64)>,
    pid_files: PidFiles,
    rotator: Rotator,
    next_key: AtomicU64,
    /// The notification socket of every supervised process (bound on first use).
    notify: Arc<NotifyHub>,
    /// How long probes took.
    probes: Arc<ProbeStats>,
    /// A cgroup per instance, when the caller gave a subtree; process groups otherwise.
    cgroups: Option<Cgroups>,
    /// Every process under supervision, by its supervising task's key (the order
    /// supervision began in): its name and its status. A task takes its entry out as its
    /// supervision ends.
    processes: Mutex<BTreeMap<u64, (ProcessName, control::StatusView)>>,
    /// The keepers that are the parents of its processes, once it uses them
    /// ([`Supervisor::use_keeper`]); else its own spawn threads are.
    keepers: tokio::sync::OnceCell<crate::keeper::Keepers>,
    /// Copies of what every child holds until its exec ([`Supervisor::hold_until_exec`]),
    /// handed to a keeper with each spawn.
    held: Mutex<Arc<Vec<std::os::fd::OwnedFd>>>,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor").field("boot_id", &self.shared.boot_id).finish_non_exhaustive()
    }
}

impl Supervisor {
    /// Starts the shared machinery: the log-rotation task and the pid-file writer thread.
    ///
    /// # Errors
    ///
    /// When the boot id cannot be read, inotify cannot be initialised, or the pid-file
    /// thread cannot be started.
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn new() -> io::Result<Self> {
        let nonce = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
        Self::with_notify_socket(format!("@tether-notify-{}-{nonce:08x}", std::process::id()))
    }

    /// [`Supervisor::new`], with the notification socket at `address`: an abstract socket
    /// name, `@` and up to 107 bytes. A caller that adopts processes after a restart gives
    /// the same address each time, so that adopted processes still reach it.
    ///
    /// # Errors
    ///
    /// As [`Supervisor::new`].
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn with_notify_socket(address: impl Into<String>) -> io::Result<Self> {
        Self::with_cgroups(address, None)
    }

    /// [`Supervisor::with_notify_socket`], with every instance in a cgroup of its own in
    /// `cgroups` when it is given: entered before its program runs, killed as a whole on a
    /// stop and after its main process exits, limited by its spec's `limits`.
    ///
    /// # Errors
    ///
    /// As [`Supervisor::new`].
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn with_cgroups(address: impl Into<String>, cgroups: Option<Cgroups>) -> io::Result<Self> {
        let shared = Shared {
            boot_id: proc::read_boot_id()?,
            boot_time: read_boot_time(),
            pid_files: PidFiles::start()?,
            rotator: Rotator::start()?,
            next_key: AtomicU64::new(0),
            notify: Arc::new(NotifyHub::new(address.into())),
            probes: Arc::default(),
            cgroups,
            processes: Mutex::default(),
            keepers: tokio::sync::OnceCell::new(),
            held: Mutex::default(),
        };
        Ok(Self { shared: Arc::new(shared) })
    }

    /// The cgroup subtree of its instances, if it uses one.
    pub fn cgroups(&self) -> Option<&Cgroups> {
        self.shared.cgroups.as_ref()
    }

    /// Makes every process spawned in this process from now on (by any supervisor) hold a
    /// copy of `fd` from its creation to its exec, where it is closed (it stays
    /// close-on-exec). A lock held through an open file description, such as an agent's
    /// `flock` of its data dir, is thus held by a child until the exec that gives it its
    /// environment, even if this process dies before.
    ///
    /// Processes are created by one thread with a descriptor table of its own, so that a
    /// spawn costs the same with 10 descriptors open or 10 000; this is how a descriptor of
    /// the process reaches that table.
    ///
    /// # Errors
    ///
    /// When that thread cannot start, or `fd` cannot be passed to it.
    pub fn hold_until_exec(&self, fd: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
        spawn::hold_until_exec(fd)?;
        let copy = fd.try_clone_to_owned()?;
        let mut held = tether_state::lock(&self.shared.held);
        let mut more: Vec<std::os::fd::OwnedFd> = held.iter().map(|fd| fd.try_clone()).collect::<io::Result<_>>()?;
        more.push(copy);
        *held = Arc::new(more);
        Ok(())
    }

    /// Makes `keeper` the parent of every process this supervisor starts from now on (but
    /// for probes and reload programs, which end with it), so that its processes outlive it
    /// whatever they do when their parent dies: a keeper that runs at `keeper`'s socket is
    /// used (or, of another build, retired: it keeps its children until they exit, and
    /// their exits are still told here), else one is started with the first spawn.
    /// Call it before adopting what an earlier supervisor left running, so that the exits
    /// of adopted children of a keeper are known too.
    ///
    /// # Errors
    ///
    /// When a keeper is in use already.
    pub async fn use_keeper(&self, keeper: crate::keeper::Keeper) -> io::Result<()> {
        if self.shared.keepers.initialized() {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, "a keeper is in use already"));
        }
        let keepers = crate::keeper::Keepers::find(keeper).await;
        self.shared
            .keepers
            .set(keepers)
            .map_err(|_| io::Error::new(io::ErrorKind::AlreadyExists, "a keeper is in use already"))
    }

    /// The notification socket's address, as `NOTIFY_SOCKET` tells it to processes whose
    /// checks use `notify`.
    pub fn notify_socket(&self) -> &str {
        self.shared.notify.address()
    }

    /// How long the readiness and liveness probes it ran took (`tcp`, `http`, `exec`).
    pub fn probe_durations(&self) -> ProbeDurations {
        self.shared.probes.snapshot()
    }

    /// Every process it (or a clone of it) supervises, in the order supervision began:
    /// those it spawned or adopted, until their supervision ends. A process waiting to
    /// restart is listed, without a pid; one that was stopped is not listed once
    /// [`ProcessHandle::stop`] has returned, nor one detached once
    /// [`ProcessHandle::detach`] has; one whose handle was dropped, or whose supervision
    /// failed, leaves the list as its supervising task ends, just after.
    ///
    /// Each status is the last observed, as [`ProcessHandle::status`] returns it.
    pub fn processes(&self) -> Vec<SupervisedProcess> {
        let processes = self.shared.lock_processes();
        processes
            .values()
            .map(|(name, status)| SupervisedProcess { name: name.clone(), status: status.get() })
            .collect()
    }

    /// Notifications ignored so far because their sender was no supervised instance (nor in
    /// one's process group).
    pub fn foreign_notifications(&self) -> u64 {
        self.shared.notify.foreign()
    }

    /// Starts `spec` and supervises it. Returns once the process exists.
    ///
    /// The process is created on a thread of the supervisor's, so awaiting this leaves the
    /// caller's worker thread free; a few processes are in the making at once, and further
    /// calls wait their turn. The pid file is written shortly after, by the pid-file writer.
    ///
    /// # Errors
    ///
    /// [`SpawnError`] when the process could not be started; nothing is left running.
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub async fn spawn(&self, mut spec: ProcessSpec) -> Result<ProcessHandle, SpawnError> {
        checks::set_notify_env(&mut spec, self.shared.notify.address());
        if checks::uses_notify(&spec.health) {
            // Bound before the process exists, so that its first notice finds the socket.
            // Should it fail, the instance's checks report it.
            if let Err(error) = self.shared.notify.ensure_bound() {
                tracing::warn!(%error, address = %self.shared.notify.address(), "cannot bind the notification socket");
            }
        }
        let instance = Instance::spawn(&spec, &self.shared, None).await?;
        let pid = instance.pid;
        tracing::info!(proxy = %spec.name, pid, program = %spec.program.display(), "process started");
        let identity = self.shared.identity(&instance);
        let ready = checks::starts_ready(&spec);
        Ok(self.supervise(spec, instance, ProcessStatus::running(pid, SystemTime::now(), identity, ready), true))
    }

    fn supervise(
        &self,
        mut spec: ProcessSpec,
        instance: Instance,
        status: ProcessStatus,
        write_pid_file: bool,
    ) -> ProcessHandle {
        // The instances it restarts are told the notification socket (an adopted one was
        // told by whoever started it).
        checks::set_notify_env(&mut spec, self.shared.notify.address());
        // It proved an adopted instance; a supervised process is never proved again, and
        // every supervised process would hold it.
        spec.identity_env = Environment::default();
        let key = self.shared.next_key.fetch_add(1, Ordering::Relaxed);
        if let (true, Some(pid_file)) = (write_pid_file, &spec.pid_file) {
            self.shared.pid_files.write(pid_file, instance.pid);
        }
        // Made only for output that goes to the journal: most processes never need one.
        let journal = spec.logs.journal_sink(&spec.name).map(|sink| (sink, Arc::new(Handover::default()), 0));
        let handover = journal.as_ref().map(|(_, handover, _)| Arc::clone(handover));
        self.shared.rotator.watch(key, &spec.logs, journal, instance.pid, instance.log_sizes);
        let ready = status.ready;
        let (commands, receiver) = control::link(status);
        let name = spec.name.clone();
        self.shared.lock_processes().insert(key, (name.clone(), commands.view()));
        let last_pid = write_pid_file.then_some(instance.pid);
        let task = Task::new(key, spec, Arc::clone(&self.shared), receiver, last_pid, handover);
        let task = tokio::spawn(InProxySpan { name: name.clone(), future: task.run(instance, ready) });
        ProcessHandle { name, commands, task, cgroups: self.shared.cgroups.clone() }
    }
}

impl Shared {
    fn lock_processes(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, (ProcessName, control::StatusView)>> {
        // Every critical section only inserts, removes or clones.
        tether_state::lock(&self.processes)
    }

    /// Takes the process of task `key` out of the list: its supervision has ended.
    fn forget_process(&self, key: u64) {
        self.lock_processes().remove(&key);
    }

    fn identity(&self, instance: &Instance) -> Option<Identity> {
        Some(Identity {
            pid: instance.pid,
            pgid: instance.pgid,
            start_time: instance.start_time?,
            boot_id: self.boot_id.clone(),
            cgroup: instance.cgroup.as_deref().map(str::to_owned),
        })
    }

    fn start_time_to_system_time(&self, start_time: u64) -> Option<SystemTime> {
        let (boot_secs, ticks_per_second) = self.boot_time?;
        let since_boot = Duration::from_secs_f64(start_time as f64 / ticks_per_second as f64);
        Some(SystemTime::UNIX_EPOCH + Duration::from_secs(boot_secs) + since_boot)
    }
}

/// Reads `btime` from `/proc/stat` and the clock tick rate.
fn read_boot_time() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let boot_secs = text.lines().find_map(|line| line.strip_prefix("btime "))?.trim().parse().ok()?;
    let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok()??;
    Some((boot_secs, u64::try_from(ticks).ok().filter(|&ticks| ticks > 0)?))
}

/// The caller's side of one supervised process.
///
/// Dropping the handle ends supervision and leaves the process running, like
/// [`ProcessHandle::detach`] without the identity: an agent that shuts down must not
/// turn into a restart of every proxy.
#[derive(Debug)]
pub struct ProcessHandle {
    name: ProcessName,
    commands: control::Sender,
    task: tokio::task::JoinHandle<()>,
    cgroups: Option<Cgroups>,
}

impl ProcessHandle {
    /// Whether the running process was started from `spec`: the same command line, the
    /// same working directory, and every variable of [`ProcessSpec::environment`] in its
    /// environment (the agent's own `PATH` and `HOME` excepted, which may legitimately have
    /// changed).
    /// `false` when nothing runs or `/proc` cannot tell.
    pub fn runs(&self, spec: &ProcessSpec) -> bool {
        let Some(pid) = self.commands.read_status(|status| status.figures.pid) else { return false };
        let mut expected = vec![spec.program.clone().into_os_string()];
        expected.extend(spec.args.iter().cloned());
        let same_command = proc::read_cmdline(pid).is_ok_and(|words| words == expected);
        let same_dir = proc::read_cwd(pid).is_ok_and(|dir| dir == spec.working_dir);
        let mut pairs = spec.environment();
        pairs.retain(|(key, _)| key != "PATH" && key != "HOME");
        let same_env = proc::read_environ(pid).is_ok_and(|environ| proc::environ_contains(&environ, &pairs));
        same_command && same_dir && same_env
    }

    /// The name of the process, as given in its spec.
    pub fn name(&self) -> &ProcessName {
        &self.name
    }

    /// The last observed status.
    pub fn status(&self) -> ProcessStatus {
        self.commands.status()
    }

    /// The status as it changes, to read without the handle.
    #[cfg_attr(not(feature = "manager"), allow(dead_code))] // the engine adapter's
    pub(crate) fn view(&self) -> control::StatusView {
        self.commands.view()
    }

    /// A subscription to every change of the status.
    pub fn subscribe(&self) -> watch::Receiver<ProcessStatus> {
        self.commands.subscribe()
    }

    /// Calls `observer` with the current status at once, then after every change, from the
    /// supervising task, in order, until supervision ends; replaces an earlier observer.
    ///
    /// A subscription costs its owner a task (or a select arm) per process; an observer
    /// costs nothing between changes. It runs while the status is locked: keep it short,
    /// and never call this handle from it.
    pub fn observe(&self, observer: impl Fn(&ProcessStatus) + Send + Sync + 'static) {
        self.commands.observe(Box::new(observer));
    }

    /// Stops the process: its kill signal to the process group, up to its kill timeout
    /// for the main process to exit, then SIGKILL to the group; reaps it and removes the
    /// pid file. Returns the final status (state `stopped`, or `failed` if supervision
    /// had already ended that way).
    ///
    /// Idempotent: later calls return the same final status. A stopped process is never
    /// restarted, whatever exit event arrives late.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the stop proceeds once requested, even if the future is dropped.
    pub async fn stop(&self) -> ProcessStatus {
        self.stop_as(control::Stop::Signalled).await
    }

    /// Finishes the stop of a process that was asked to stop already, by a supervisor that
    /// died since: [`ProcessHandle::stop`] without the kill signal, which the process had
    /// (a second one makes many proxies drop the connections they are finishing). Waits up
    /// to its kill timeout for it to exit, then SIGKILLs the group.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the stop proceeds once requested, even if the future is dropped.
    #[cfg_attr(not(feature = "manager"), allow(dead_code))] // the engine adapter's
    pub(crate) async fn finish_stop(&self) -> ProcessStatus {
        self.stop_as(control::Stop::Awaited).await
    }

    async fn stop_as(&self, how: control::Stop) -> ProcessStatus {
        let _already_ended = self.commands.stop(how);
        let mut status = self.commands.subscribe();
        let result = status.wait_for(|status| status.state.is_final()).await.map(|status| status.clone());
        result.unwrap_or_else(|_task_gone| self.commands.status())
    }

    /// Ends supervision and leaves the process running; returns the [`Identity`] through
    /// which [`Supervisor::adopt`] can take it back. The pid file stays.
    ///
    /// # Errors
    ///
    /// [`DetachError::NotRunning`] when no process exists (it is waiting to restart, or
    /// has stopped); [`DetachError::Identity`] when its identity cannot be read. In both
    /// cases supervision has ended.
    ///
    /// # Cancel safety
    ///
    /// Not cancel-safe: if the future is dropped, supervision still ends, but the
    /// identity is lost.
    pub async fn detach(self) -> Result<Identity, DetachError> {
        let (reply, identity) = oneshot::channel();
        let not_running = |commands: &control::Sender| DetachError::NotRunning { state: commands.status().state };
        if self.commands.detach(reply).is_err() {
            return Err(not_running(&self.commands));
        }
        let result = identity.await.unwrap_or_else(|_task_gone| Err(not_running(&self.commands)));
        let _panicked = self.task.await;
        result
    }

    /// Reloads the process in place, as its spec's [`reload`](ProcessSpec::reload) says,
    /// and returns the verdict, also shown in its status's `reloads`. `None` when it has no
    /// reload policy. Reloads of one process never overlap: one asked while another runs
    /// runs after it, and answers every caller that asked meanwhile.
    ///
    /// A reload never stops the process: a failed check refuses it (nothing is signalled),
    /// and a verdict that does not come within the timeout leaves it running. An exit during
    /// the reload fails it, and the process is restarted as after any exit.
    ///
    /// The reload is asked when this is called; the future, which borrows nothing of the
    /// handle, waits for its verdict.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the reload runs to its end once asked, even if the future is dropped.
    pub fn reload(&self) -> impl Future<Output = Option<ReloadOutcome>> + Send + 'static {
        let (reply, verdict) = oneshot::channel();
        let asked = self.commands.reload(reply).is_ok();
        let status = self.commands.view();
        async move {
            let answer = if asked { verdict.await.ok() } else { None };
            answer.unwrap_or_else(|| {
                // Supervision ended before the verdict: the process stopped or was detached.
                let state = status.get().state;
                Some(ReloadOutcome::now(ReloadResult::Failed, Some(format!("the process is {state}"))))
            })
        }
    }

    /// Applies in-place changes (kill policy, restart policy, log limits, checks, cgroup
    /// limits) without a restart. Does nothing once supervision has ended.
    ///
    /// # Errors
    ///
    /// [`CgroupError`] when new cgroup limits cannot be written into the running
    /// instance's cgroup (a controller is missing); every other change is applied, and
    /// the next instance gets the new limits, or fails to start naming the controller.
    pub fn update(&self, update: ProcessUpdate) -> Result<(), CgroupError> {
        let cgroup = self.commands.read_status(|status| status.identity.as_ref().and_then(|i| i.cgroup.clone()));
        let written = match (&update.limits, &self.cgroups, cgroup) {
            (Some(limits), Some(cgroups), Some(cgroup)) => cgroups.set_limits(&cgroup, limits),
            _ => Ok(()),
        };
        let _already_ended = self.commands.update(update);
        written
    }

    /// What the running instance's cgroup has used: `None` without cgroups, or while no
    /// instance runs.
    pub fn usage(&self) -> Option<Usage> {
        let cgroups = self.cgroups.as_ref()?;
        self.commands.read_status(|status| cgroups.usage_in(status.identity.as_ref()?.cgroup.as_deref()?))
    }
}

pin_project_lite::pin_project! {
    /// A supervising task's future, run inside a span `proxy{proxy=<name>}` made for each
    /// poll: its events read as from that proxy, and no span is kept between polls. A span
    /// kept for the life of the process costs about 370 bytes a proxy in the subscriber's
    /// registry; a task is polled only when something happens to its process.
    ///
    /// A root span each time: not a child of whatever action started the process.
    struct InProxySpan<F> {
        name: ProcessName,
        #[pin]
        future: F,
    }
}

impl<F: Future> Future for InProxySpan<F> {
    type Output = F::Output;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<F::Output> {
        let this = self.project();
        let span = tracing::info_span!(parent: None, "proxy", proxy = %this.name);
        let _entered = span.enter();
        this.future.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tether_state::persist::DataDir;

    use super::*;
    use crate::spec::ProcessName;
    use crate::status::{ExitReason, ProcessState};

    const LIMIT: Duration = Duration::from_secs(10);

    /// `/bin/sh -c script`, with a kill timeout of `kill_timeout`.
    fn shell(data: &DataDir, name: &str, script: &str, kill_timeout: Duration) -> ProcessSpec {
        let mut spec = ProcessSpec::new(ProcessName::new(name).unwrap(), "/bin/sh", data);
        spec.args = vec!["-c".into(), script.into()];
        spec.kill.timeout = kill_timeout;
        spec
    }

    #[tokio::test]
    async fn finishing_a_stop_sends_no_signal_and_waits_for_the_exit() {
        let dir = tempfile::tempdir().unwrap();
        let data = DataDir::open(dir.path()).unwrap();
        let supervisor = Supervisor::new().unwrap();
        let signalled = dir.path().join("signalled");
        // Finishes its work (a fifth of a second) and exits 0, unless its kill signal (SIGINT,
        // the default) comes first.
        let script = format!("trap 'touch {}; exit 1' INT; sleep 0.2 & wait; exit 0", signalled.display());
        let spec = shell(&data, "draining", &script, Duration::from_secs(5));

        let handle = supervisor.spawn(spec.clone()).await.unwrap();
        let last = tokio::time::timeout(LIMIT, handle.finish_stop()).await.unwrap();
        assert_eq!((last.state, last.figures.last_exit), (ProcessState::Stopped, Some(ExitReason::Code(0))));
        assert!(!signalled.exists(), "no kill signal was sent");

        // For contrast: a stop signals it.
        let handle = supervisor.spawn(spec).await.unwrap();
        // Its trap is set once its first line ran: wait for the shell to reach `wait`.
        let pid = handle.status().figures.pid.unwrap();
        let started = Instant::now();
        while !std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).is_ok_and(|c| !c.is_empty()) {
            assert!(started.elapsed() < LIMIT, "the shell never started its work");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let last = tokio::time::timeout(LIMIT, handle.stop()).await.unwrap();
        assert_eq!((last.state, last.figures.last_exit), (ProcessState::Stopped, Some(ExitReason::Code(1))));
        assert!(signalled.exists(), "a stop sends the kill signal");
    }

    #[tokio::test]
    async fn finishing_a_stop_kills_a_process_that_does_not_exit_within_its_kill_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let data = DataDir::open(dir.path()).unwrap();
        let supervisor = Supervisor::new().unwrap();
        let spec = shell(&data, "stuck", "exec sleep 30", Duration::from_millis(200));
        let handle = supervisor.spawn(spec).await.unwrap();
        let started = Instant::now();
        let last = tokio::time::timeout(LIMIT, handle.finish_stop()).await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(200), "killed after {:?}", started.elapsed());
        assert_eq!((last.state, last.figures.last_exit), (ProcessState::Stopped, Some(ExitReason::Signal(9))));
    }
}
