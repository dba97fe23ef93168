//! The adapter between `tether-manager`'s backend traits and the [`Supervisor`]: the only
//! module that speaks both vocabularies.
//!
//! It builds a [`ProcessSpec`] from a `ManagedProxy` (the proxy's environment, log files,
//! pid file, policies), forwards the supervisor's observations as the manager's status, and
//! records in snapshots only what proves identity: never a token or an environment value.

mod epoch;
mod keep;
mod record;
mod restore;

use std::collections::{BTreeSet, HashMap};
use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tether_manager::{
    Adopted, BackendError, BackendRecord, BackendState, BackendStats, Histogram, Meter, ProxyBackend, ProxyHandle,
    ResourceUsage, StatusChanged,
};
use tether_state::lock;
use tether_state::persist::DataDir;
use tether_state::proxy_env;
use tether_state::{
    CommandLine, ListenAddress, Liveness, ManagedProxy, Probe, ProxyCommand, ProxyId, ProxyKind, Readiness,
    UpdateStrategy,
};
use tokio::sync::watch;

use crate::cgroup::Cgroups;
use crate::journal::JournalSink;
use crate::listen::ListenError;
use crate::spec::{
    HealthChecks, InheritedSocket, KillPolicy, ProcessName, ProcessSpec, ProcessUpdate, ReloadAction, ReloadOutcome,
    ReloadResult,
};
use crate::status::{ProcessState, ProcessStatus};
use crate::supervisor::{ProcessHandle, Supervisor};
use record::Record;

/// What the agent tells every proxy about itself (`TETHER_SOCKET`, and
/// `TETHER_HTTP_ADDR` when it serves one), and what runs a proxy whose `command` is the
/// built-in proxy: the agent's, which alone knows what its own binary is.
#[derive(Debug, Clone)]
pub struct AgentEnvironment {
    /// The absolute path of `agent.sock`.
    pub socket: PathBuf,
    /// The loopback HTTP address, when the agent serves one.
    pub http_addr: Option<String>,
    /// The program and arguments that run the built-in proxy.
    pub built_in: (PathBuf, Vec<OsString>),
    /// What must be done before each start of a proxy (the agent renders its templates),
    /// if anything.
    pub before_start: Option<Arc<dyn BeforeStart>>,
    /// The journal's native socket, for proxies whose output goes there
    /// ([`DEFAULT_JOURNAL_SOCKET`](crate::DEFAULT_JOURNAL_SOCKET) on a systemd host).
    pub journal_socket: PathBuf,
}

/// Work the agent does before each start of a proxy, such as writing the files the proxy
/// reads at start. A failure fails the start, which the engine retries on the proxy's
/// restart backoff, like any failed start.
#[async_trait]
pub trait BeforeStart: Send + Sync + std::fmt::Debug {
    /// Prepares `proxy`'s start.
    ///
    /// # Errors
    ///
    /// Why the proxy cannot start now; it becomes the proxy's error.
    async fn before_start(&self, proxy: Arc<ManagedProxy>) -> Result<(), Box<dyn std::error::Error + Send + Sync>>;
}

/// [`ProxyBackend`] for `exec_mode = "daemon"`: every proxy is an OS process supervised by
/// a [`Supervisor`].
#[derive(Debug, Clone)]
pub struct OsProcessBackend {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    supervisor: Supervisor,
    data: DataDir,
    environment: AgentEnvironment,
    /// The processes found by their environment at the last look for adoption
    /// candidates, by proxy id; each id's are taken by its `restore`.
    found: Mutex<HashMap<ProxyId, Vec<u32>>>,
    /// The open listening sockets of each proxy, held by its handles' specs: a socket is
    /// closed once no handle holds it, and shared by every handle of its proxy meanwhile
    /// (the old and the new instance of an update).
    listeners: Mutex<HashMap<ProxyId, Vec<OpenListener>>>,
    /// The live generations of the proxies with `update = "epoch"`, and their base ids.
    generations: Arc<epoch::Generations>,
    /// The agent's own `PATH` and `HOME`, the layer beneath every proxy's environment but
    /// those that inherit the whole of it: read once, shared by their specs.
    agent_env: Arc<crate::spec::Environment>,
    /// The backend's own tasks (a draining generation's wait, the sweep of unclaimed
    /// cgroups), aborted with the backend: a waiting drain then leaves its process running,
    /// for the next agent, which adopts it from the snapshot.
    background: Mutex<tokio::task::JoinSet<()>>,
}

/// A listener's address and its socket, while some handle holds it.
type OpenListener = (ListenAddress, Weak<OwnedFd>);

impl OsProcessBackend {
    /// A backend that lays out pid and log files in `data`.
    ///
    /// # Errors
    ///
    /// When the supervisor's machinery cannot start ([`Supervisor::new`]).
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn new(data: DataDir, environment: AgentEnvironment) -> std::io::Result<Self> {
        Self::with_cgroups(data, environment, None)
    }

    /// [`OsProcessBackend::new`], with every proxy instance in a cgroup of its own in
    /// `cgroups`, if given ([`Supervisor::with_cgroups`]); once restore has ended, the
    /// cgroups of the subtree that no adopted proxy claims are killed and removed.
    ///
    /// # Errors
    ///
    /// As [`OsProcessBackend::new`].
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn with_cgroups(
        data: DataDir,
        environment: AgentEnvironment,
        cgroups: Option<Cgroups>,
    ) -> std::io::Result<Self> {
        let found = Mutex::default();
        let listeners = Mutex::default();
        let supervisor = Supervisor::with_cgroups(data.notify_address(), cgroups)?;
        let generations = Arc::default();
        let background = Mutex::default();
        let agent_env = Arc::new(agent_paths().into());
        let shared = Shared { supervisor, data, environment, found, listeners, generations, agent_env, background };
        Ok(Self { shared: Arc::new(shared) })
    }

    /// The cgroup subtree of its proxies, if it uses one.
    pub fn cgroups(&self) -> Option<&Cgroups> {
        self.shared.supervisor.cgroups()
    }

    /// Makes every proxy hold a copy of `fd` until its exec ([`Supervisor::hold_until_exec`]).
    ///
    /// # Errors
    ///
    /// As [`Supervisor::hold_until_exec`].
    pub fn hold_until_exec(&self, fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
        self.shared.supervisor.hold_until_exec(fd)
    }

    /// Makes a keeper run as `program args…` the parent of every proxy from now on, with its
    /// socket in the data dir ([`DataDir::keeper_socket_path`]) and its errors appended to
    /// `logs/keeper.log` ([`Supervisor::use_keeper`]). Call it before the engine restores,
    /// so that the exits of the proxies it adopts are known.
    ///
    /// # Errors
    ///
    /// When a keeper is in use already, or its log file cannot be opened.
    pub async fn use_keeper(
        &self,
        program: impl Into<std::path::PathBuf>,
        arg0: impl Into<std::ffi::OsString>,
        args: Vec<std::ffi::OsString>,
    ) -> std::io::Result<()> {
        let data = &self.shared.data;
        let log = data.logs().open_append("keeper.log").map_err(std::io::Error::other)?;
        let keeper = crate::keeper::Keeper::new(program, args, data.keeper_socket_path()).arg0(arg0).stderr(log);
        self.shared.supervisor.use_keeper(keeper).await
    }

    /// The process spec that runs `proxy`: its own environment (agent's
    /// `PATH` and `HOME`, then `TETHER_*`, then the proxy's `env`; or the agent's whole
    /// environment with `inherit_env`), log and pid files under the data dir.
    ///
    /// The built-in proxy is resolved to the running executable here, at each spawn, so
    /// that an upgrade that replaces the binary neither breaks nor restarts proxies.
    pub fn process_spec(&self, proxy: &ManagedProxy) -> ProcessSpec {
        self.shared.process_spec(proxy)
    }
}

impl Shared {
    /// Runs `task` in the background, owned by the backend; forgets the tasks that ended.
    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut background = lock(&self.background);
        while background.try_join_next().is_some() {}
        background.spawn(task);
    }

    fn process_spec(&self, proxy: &ManagedProxy) -> ProcessSpec {
        let id = proxy.id();
        let spec = proxy.spec();
        let name = process_name(id);
        let (program, args): (PathBuf, Vec<OsString>) = match &spec.command {
            ProxyCommand::BuiltIn => self.environment.built_in.clone(),
            ProxyCommand::Exec(line) => (line.program().to_owned(), line.args().iter().map(OsString::from).collect()),
        };
        let args = match spec.kind {
            ProxyKind::Envoy { .. } => envoy_args(self.data.envoy_bootstrap_path(id), spec.update.strategy, args),
            _ => args,
        };
        // The agent's `PATH` and `HOME` are one layer that every proxy's spec shares; a
        // proxy that inherits the whole environment gets a copy of its own, as it is now.
        let (base_env, mut env) = if spec.inherit_env {
            (Arc::default(), agent_layer(spec))
        } else {
            (Arc::clone(&self.agent_env), Vec::new())
        };
        let identity_env = vec![
            (OsString::from(proxy_env::PROXY_ID), OsString::from(id.as_str())),
            (OsString::from(proxy_env::PROXY_TOKEN), OsString::from(proxy.token().expose())),
        ];
        env.extend(identity_env.iter().cloned());
        env.push((proxy_env::SERVICE_ID.into(), proxy.service().id.as_str().into()));
        env.push((proxy_env::SOCKET.into(), self.environment.socket.clone().into_os_string()));
        if let Some(addr) = &self.environment.http_addr {
            env.push((proxy_env::HTTP_ADDR.into(), addr.into()));
        }
        env.extend(configured_layer(spec));
        // Held as long as the process is supervised: no room for pairs that never come.
        env.shrink_to_fit();
        // The data dir's layout: pid file and logs named by the proxy id.
        let mut process = ProcessSpec::new(name, program, &self.data);
        process.args = args;
        process.env = env.into();
        process.base_env = base_env;
        process.working_dir = spec.working_dir.clone().unwrap_or_else(|| PathBuf::from("/"));
        process.user.clone_from(&spec.user);
        process.kill = kill_policy(proxy);
        process.restart = spec.restart;
        process.logs.limits = spec.log;
        process.logs.journal = self.journal_sink(proxy);
        process.health = HealthChecks::from(spec);
        process.reload.clone_from(&spec.reload);
        process.identity_env = identity_env.into();
        process.limits = spec.limits;
        process
    }
}

impl Shared {
    /// Where `proxy`'s lines go in the journal, if its output goes there: every line says
    /// whose it is, the proxy (as `journalctl -t` finds it) and its service.
    fn journal_sink(&self, proxy: &ManagedProxy) -> Option<Arc<JournalSink>> {
        if !proxy.spec().log.output.to_journal() {
            return None;
        }
        let id = proxy.id().as_str();
        Some(Arc::new(JournalSink {
            socket: self.environment.journal_socket.clone(),
            identifier: id.to_owned(),
            fields: vec![
                ("TETHER_PROXY".to_owned(), id.to_owned()),
                ("TETHER_SERVICE".to_owned(), proxy.service().id.as_str().to_owned()),
            ],
        }))
    }

    /// The sockets of `proxy`'s listeners, in its order: those its other handles hold, then
    /// those `taken` from an instance an earlier agent started, else bound now.
    fn listeners(&self, proxy: &ManagedProxy, mut taken: Vec<OwnedFd>) -> Result<Vec<InheritedSocket>, ListenError> {
        let wanted = &proxy.spec().listeners;
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let mut open = lock(&self.listeners);
        // This proxy's entry only: a start costs the same however many proxies have
        // listeners. (A closed socket leaves a dead reference of a few bytes behind.)
        let held = open.entry(proxy.id().clone()).or_default();
        held.retain(|(_, socket)| socket.strong_count() > 0);
        let mut sockets = Vec::with_capacity(wanted.len());
        for listener in wanted {
            let existing = held.iter().find(|(address, _)| *address == listener.address).and_then(|(_, s)| s.upgrade());
            let socket = match existing {
                Some(socket) => socket,
                None => {
                    let fd = match taken.iter().position(|fd| crate::listen::listens_on(fd, &listener.address)) {
                        Some(at) => taken.swap_remove(at),
                        None => crate::listen::bind(&listener.address)?,
                    };
                    let socket = Arc::new(fd);
                    held.push((listener.address.clone(), Arc::downgrade(&socket)));
                    socket
                }
            };
            sockets.push(InheritedSocket { name: listener.name.as_str().to_owned(), socket });
        }
        Ok(sockets)
    }
}

/// The layer of a proxy's environment that comes from the agent, first: its whole
/// environment with `inherit_env` (but tether's own variables), else its `PATH` and `HOME`.
fn agent_layer(spec: &tether_state::ProxySpec) -> Vec<(OsString, OsString)> {
    if spec.inherit_env {
        std::env::vars_os().filter(|(key, _)| !key.to_string_lossy().starts_with(proxy_env::PREFIX)).collect()
    } else {
        agent_paths()
    }
}

/// The agent's own `PATH` and `HOME`, those it has.
fn agent_paths() -> Vec<(OsString, OsString)> {
    ["PATH", "HOME"].into_iter().filter_map(|key| Some((OsString::from(key), std::env::var_os(key)?))).collect()
}

/// The layer of a proxy's environment that its `env` sets, last: it replaces the others.
fn configured_layer(spec: &tether_state::ProxySpec) -> impl Iterator<Item = (OsString, OsString)> + '_ {
    spec.env.iter().map(|(key, value)| (OsString::from(key), OsString::from(value)))
}

/// A program of a proxy that this host does not have ([`missing_programs`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MissingProgram {
    /// Where the proxy names it, below `[service.proxy]`: `command`, `readiness.exec` or
    /// `liveness.exec`.
    pub field: &'static str,
    /// The name, and the `PATH` it was looked for in.
    pub error: crate::ProgramNotFound,
}

/// The programs of a proxy (its `command`'s, its `exec` probes') that are bare names not
/// found on this host: looked for as its start will look for them, in the `PATH` of the
/// environment this process would give it (its `env`'s `PATH`, else this process's own),
/// as this process's user.
///
/// Worth a warning, not an error: the program may be installed before the proxy starts,
/// and a start that fails for want of it is retried on the restart backoff. The built-in
/// proxy is the agent's own executable and is never missing.
pub fn missing_programs(spec: &tether_state::ProxySpec) -> Vec<MissingProgram> {
    let mut named: Vec<(&'static str, &CommandLine)> = Vec::new();
    if let ProxyCommand::Exec(command) = &spec.command {
        named.push(("command", command));
    }
    if let Some(Readiness { probe: Probe::Exec(command), .. }) = spec.readiness.as_deref() {
        named.push(("readiness.exec", command));
    }
    if let Some(Liveness { probe: Probe::Exec(command), .. }) = spec.liveness.as_deref() {
        named.push(("liveness.exec", command));
    }
    if let Some(reload) = &spec.reload {
        if let ReloadAction::Exec(command) = &reload.action {
            named.push(("reload.exec", command));
        }
        if let Some(check) = &reload.check {
            named.push(("reload.check", check));
        }
    }
    if named.is_empty() {
        return Vec::new();
    }
    let mut env = agent_layer(spec);
    env.extend(configured_layer(spec));
    named
        .into_iter()
        .filter_map(|(field, command)| {
            let error = crate::find_program(command.program(), &env).err()?;
            Some(MissingProgram { field, error })
        })
        .collect()
}

/// A process name for a proxy id; both follow the same rule.
fn process_name(id: &ProxyId) -> ProcessName {
    ProcessName::of_proxy(id)
}

fn kill_policy(proxy: &ManagedProxy) -> KillPolicy {
    proxy.spec().kill
}

#[async_trait]
impl ProxyBackend for OsProcessBackend {
    fn create(&self, proxy: Arc<ManagedProxy>) -> Box<dyn ProxyHandle> {
        // The listeners are taken now, before the engine stops the instance this one
        // replaces: held by both handles, they stay open in between.
        let listeners = self.shared.listeners(&proxy, Vec::new());
        let handle = OsProxyHandle::new(self.shared.clone(), proxy.id().clone(), Some(proxy));
        handle.lock().listeners = Some(Box::new(listeners));
        Box::new(handle)
    }

    async fn restore(
        &self,
        id: ProxyId,
        record: BackendRecord,
        desired: Option<Arc<ManagedProxy>>,
    ) -> Option<Box<dyn ProxyHandle>> {
        self.restore_proxy(id, record, desired).await
    }

    async fn adoption_candidates(&self) -> Vec<(ProxyId, BackendRecord)> {
        // Candidates come from pid files and from the environment of every process that
        // names this agent's socket: an agent killed between a spawn and its pid-file write,
        // or whose write failed, leaves instances that only their environment tells of.
        // Proof needs the proxy's id and token, which only `restore` with the desired proxy
        // can check.
        let mut ids: BTreeSet<ProxyId> = BTreeSet::new();
        for name in self.shared.data.pids().names().unwrap_or_default() {
            let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".pid")) else { continue };
            if let Ok(id) = ProxyId::parse(id) {
                ids.insert(id);
            }
        }
        let socket = [(OsString::from(proxy_env::SOCKET), self.shared.environment.socket.clone().into_os_string())];
        let mut found: HashMap<ProxyId, Vec<u32>> = HashMap::new();
        for (pid, id) in self.shared.supervisor.find_by_environment(&socket, proxy_env::PROXY_ID) {
            let Some(id) = id.to_str().and_then(|id| ProxyId::parse(id).ok()) else { continue };
            found.entry(id).or_default().push(pid);
        }
        ids.extend(found.keys().cloned());
        *lock(&self.shared.found) = found;
        ids.into_iter().map(|id| (id, Record::candidate())).collect()
    }

    async fn restored(&self) {
        // In the background: a start-up does not wait for orphans to die.
        if let Some(cgroups) = self.shared.supervisor.cgroups().cloned() {
            self.shared.spawn(async move {
                let stopped = cgroups.sweep_unclaimed().await;
                if stopped > 0 {
                    tracing::warn!(stopped, "stopped processes in proxy cgroups that no proxy claims");
                }
            });
        }
    }
}

/// Usage from each proxy's cgroup (none without cgroups), and the supervisor's probe
/// durations and ignored notifications.
impl Meter for OsProcessBackend {
    fn usage(&self, _id: &ProxyId, pid: u32) -> Option<ResourceUsage> {
        let usage = self.shared.supervisor.cgroups()?.usage_of(pid)?;
        Some(ResourceUsage {
            cpu: Duration::from_secs_f64(usage.cpu_seconds),
            memory_bytes: usage.memory_bytes,
            tasks: usage.tasks,
        })
    }

    fn stats(&self) -> BackendStats {
        let durations = self.shared.supervisor.probe_durations();
        BackendStats {
            probe_durations: Some(Histogram {
                bounds: &crate::PROBE_BUCKETS,
                counts: durations.buckets.to_vec(),
                sum_seconds: durations.sum_seconds,
            }),
            foreign_notifications: self.shared.supervisor.foreign_notifications(),
        }
    }
}

impl OsProcessBackend {
    /// The spec an adopted process is supervised with: the desired proxy's when there is
    /// one; otherwise just enough to stop it (it is not restarted if it exits).
    fn adoption_spec(&self, id: &ProxyId, desired: Option<&ManagedProxy>, kill: KillPolicy) -> ProcessSpec {
        match desired {
            Some(proxy) => self.shared.process_spec(proxy),
            None => {
                let mut spec = ProcessSpec::new(process_name(id), "/nonexistent", &self.shared.data);
                spec.pid_file = Some(self.shared.data.pid_file(id));
                spec.kill = kill;
                spec.restart_on_exit = false;
                spec
            }
        }
    }

    /// A spec that proves a process to be `id`'s instance started from this data dir: the
    /// id and this agent's own socket in its environment. Without the token it proves
    /// only enough to stop the process, never to keep it as the wanted proxy.
    fn stop_spec(&self, id: &ProxyId, desired: Option<&ManagedProxy>) -> ProcessSpec {
        let kill = desired.map(kill_policy).unwrap_or_default();
        let mut spec = self.adoption_spec(id, None, kill);
        spec.identity_env = vec![
            (OsString::from(proxy_env::PROXY_ID), OsString::from(id.as_str())),
            (OsString::from(proxy_env::SOCKET), self.shared.environment.socket.clone().into_os_string()),
        ]
        .into();
        spec
    }

    /// The pids found for `id` by [`ProxyBackend::adoption_candidates`], taken once.
    fn take_found(&self, id: &ProxyId) -> Vec<u32> {
        lock(&self.shared.found).remove(id).unwrap_or_default()
    }
}

/// A handle's status, and whom to tell of each change: the engine, once it asked
/// ([`ProxyHandle::on_status_change`]), which then reads it with
/// [`ProxyHandle::status_now`] and needs neither a task nor a channel per proxy.
///
/// The status of a handle whose process is its own alone is read from the process, never
/// copied; a generation's (which lists the proxy's generations), and the last one once the
/// process is gone, are held. The channel of [`ProxyHandle::status`] is made for its first
/// receiver and dropped at a change once none is left (a `watch` channel costs about 480
/// bytes, most of them its wakers). Every change of the status goes through it. Clones
/// share it.
#[derive(Clone)]
struct StatusSender(Arc<StatusCell>);

struct StatusCell {
    held: Mutex<HeldStatus>,
    changed: OnceLock<StatusChanged>,
}

#[derive(Default)]
struct HeldStatus {
    /// The status when it is not its process's alone.
    own: Option<Box<tether_manager::BackendStatus>>,
    /// The process whose status is read when there is no `own`.
    process: Option<crate::control::StatusView>,
    channel: Option<watch::Sender<tether_manager::BackendStatus>>,
}

impl HeldStatus {
    /// Hands `status` to the channel's receivers, if any is left.
    fn forward(&mut self, status: impl FnOnce() -> tether_manager::BackendStatus) {
        if let Some(channel) = &self.channel {
            if channel.receiver_count() == 0 {
                self.channel = None;
            } else {
                channel.send_replace(status());
            }
        }
    }
}

impl std::fmt::Debug for StatusSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatusSender")
            .field("status", &self.now())
            .field("told", &self.0.changed.get().is_some())
            .finish()
    }
}

impl StatusSender {
    fn new() -> Self {
        Self(Arc::new(StatusCell { held: Mutex::default(), changed: OnceLock::new() }))
    }

    fn lock(&self) -> MutexGuard<'_, HeldStatus> {
        lock(&self.0.held)
    }

    fn subscribe(&self) -> watch::Receiver<tether_manager::BackendStatus> {
        let process = {
            let held = self.lock();
            if let Some(channel) = &held.channel {
                return channel.subscribe();
            }
            held.process.clone()
        };
        match process {
            // Made under the process's lock, then this one, as its observer takes them: no
            // change can come between the status read and the channel that forwards the next.
            Some(process) => process.read_status(|current| Self::open_channel(&mut self.lock(), || translate(current))),
            None => Self::open_channel(&mut self.lock(), tether_manager::BackendStatus::default),
        }
    }

    /// A receiver of `held`'s channel, made now if there is none, from the held status or
    /// else `current`.
    fn open_channel(
        held: &mut HeldStatus,
        current: impl FnOnce() -> tether_manager::BackendStatus,
    ) -> watch::Receiver<tether_manager::BackendStatus> {
        if let Some(channel) = &held.channel {
            return channel.subscribe();
        }
        let status = held.own.as_deref().cloned().unwrap_or_else(current);
        let (channel, receiver) = watch::channel(status);
        held.channel = Some(channel);
        receiver
    }

    /// The status now. The process is read outside this lock: its observer, which holds
    /// the process's lock, takes this one ([`StatusSender::process_changed`]).
    fn now(&self) -> tether_manager::BackendStatus {
        let (own, process) = {
            let held = self.lock();
            (held.own.as_deref().cloned(), held.process.clone())
        };
        own.or_else(|| process.map(|process| process.read_status(translate))).unwrap_or_default()
    }

    /// From now on, reads the status from `process` while no status is held.
    fn follow(&self, process: crate::control::StatusView) {
        self.lock().process = Some(process);
    }

    /// The followed process's status is now `current`.
    fn process_changed(&self, current: &ProcessStatus) {
        {
            let mut held = self.lock();
            if held.own.is_none() {
                held.forward(|| translate(current));
            }
        }
        self.tell();
    }

    fn send_replace(&self, status: tether_manager::BackendStatus) {
        {
            let mut held = self.lock();
            held.forward(|| status.clone());
            held.own = Some(Box::new(status));
        }
        self.tell();
    }

    /// Changes the held status (the default one when none is held yet: only a generation,
    /// which follows no process, is changed so).
    fn send_if_modified(&self, modify: impl FnOnce(&mut tether_manager::BackendStatus) -> bool) {
        let modified = {
            let mut held = self.lock();
            let own = held.own.get_or_insert_default();
            let modified = modify(own);
            if modified {
                let status = (**own).clone();
                held.forward(|| status);
            }
            modified
        };
        if modified {
            self.tell();
        }
    }

    /// Called after the new status is readable, outside the lock.
    fn tell(&self) {
        if let Some(changed) = self.0.changed.get() {
            changed();
        }
    }
}

/// One proxy: its spec, its supervised process, and its status as the manager sees it.
struct OsProxyHandle {
    shared: Arc<Shared>,
    id: ProxyId,
    state: Mutex<HandleState>,
    status: StatusSender,
    /// What its process runs, when restore took it over.
    adopted: Adopted,
}

struct HandleState {
    proxy: Option<Arc<ManagedProxy>>,
    process: Option<ProcessHandle>,
    /// The last identity seen, kept after a detach for the final snapshot.
    record: Option<Record>,
    /// The listeners its start hands over, taken when it was created (boxed: held only
    /// until the start, by a handle that lives as long as its process).
    listeners: Option<Box<Result<Vec<InheritedSocket>, ListenError>>>,
    /// Its generation's key among the proxy's generations, for `update = "epoch"`.
    generation: Option<u64>,
}

impl OsProxyHandle {
    fn new(shared: Arc<Shared>, id: ProxyId, proxy: Option<Arc<ManagedProxy>>) -> Self {
        let status = StatusSender::new();
        Self {
            shared,
            id,
            state: Mutex::new(HandleState { proxy, process: None, record: None, listeners: None, generation: None }),
            status,
            adopted: Adopted::AsRecorded,
        }
    }

    fn lock(&self) -> MutexGuard<'_, HandleState> {
        lock(&self.state)
    }

    /// Takes over `process`: its status is forwarded from now on.
    fn attach(&self, process: ProcessHandle) {
        let status = self.status.clone();
        let current = process.status();
        let mut state = self.lock();
        let kill = state.proxy.as_deref().map(kill_policy).unwrap_or_default();
        state.record = current.identity.clone().map(|identity| Record { identity, kill, epoch: None });
        // Told from the supervising task: no task of its own to forward the statuses.
        match state.generation {
            // A generation's status lists its proxy's generations, kept in step with them.
            Some(key) => {
                let (generations, id) = (self.shared.generations.clone(), self.id.clone());
                process.observe(move |current| {
                    generations.observe(&id, key, current, Some((translate(current), &status)));
                });
            }
            None => {
                status.follow(process.view());
                process.observe(move |current| status.process_changed(current));
            }
        }
        state.process = Some(process);
    }

    /// What the snapshot records of its generation, for `update = "epoch"`.
    fn epoch_record(&self, key: Option<u64>) -> Option<record::EpochRecord> {
        let (epoch, base_id, draining) = self.shared.generations.recorded(&self.id, key?)?;
        Some(record::EpochRecord { epoch, base_id, draining })
    }

    fn take_process(&self) -> Option<ProcessHandle> {
        let mut state = self.lock();
        let process = state.process.take();
        if let (Some(process), Some(record)) = (&process, &mut state.record) {
            if let Some(identity) = process.status().identity {
                record.identity = identity;
            }
        }
        process
    }
}

/// What the engine is shown of what the supervisor observed: the state mapped (the one
/// place a supervisor's state becomes the seam's), the figures handed on whole.
fn translate(status: &ProcessStatus) -> tether_manager::BackendStatus {
    tether_manager::BackendStatus {
        state: status.state.into(),
        figures: status.figures.clone(),
        generations: Vec::new(),
    }
}

/// A supervisor's state as the engine's backend seam reports it. `stopped` (supervision
/// ended) is shown as `stopping`: the engine drops a handle once its stop returns, and a
/// proxy it shows `stopped` is one it holds down, its own decision.
impl From<ProcessState> for BackendState {
    fn from(state: ProcessState) -> Self {
        match state {
            ProcessState::Starting => Self::Starting,
            ProcessState::Running => Self::Running,
            ProcessState::Backoff => Self::Backoff,
            ProcessState::Stopping | ProcessState::Stopped => Self::Stopping,
            ProcessState::Failed => Self::Failed,
        }
    }
}

#[async_trait]
impl ProxyHandle for OsProxyHandle {
    async fn start(&self) -> Result<(), BackendError> {
        let Some(proxy) = self.lock().proxy.clone() else {
            return Err(BackendError::Start { id: self.id.clone(), source: "no spec to start the proxy from".into() });
        };
        if let Some(before_start) = &self.shared.environment.before_start {
            before_start
                .before_start(proxy.clone())
                .await
                .map_err(|source| BackendError::Start { id: self.id.clone(), source })?;
        }
        let mut spec = self.shared.process_spec(&proxy);
        let listeners = self.lock().listeners.take().map(|listeners| *listeners);
        spec.listeners = match listeners {
            Some(Ok(sockets)) => sockets,
            Some(Err(error)) => return Err(BackendError::Start { id: self.id.clone(), source: Box::new(error) }),
            None => self
                .shared
                .listeners(&proxy, Vec::new())
                .map_err(|error| BackendError::Start { id: self.id.clone(), source: Box::new(error) })?,
        };
        // A generation of its own, with its epoch, for a proxy that hands over by itself. A
        // start with no current generation whose process runs (only generations that drain,
        // or a current one that exited and waits on its backoff) is a cold start, once those
        // that drain have exited: the new generation could not take over from them.
        let hands_over = proxy.spec().update.strategy == UpdateStrategy::Epoch;
        if hands_over && self.shared.generations.without_parent(&self.id) {
            tracing::info!(proxy = %self.id, "waiting for the old generations to exit before a cold start");
            Arc::clone(&self.shared.generations).alone(self.id.clone(), u64::MAX).await;
        }
        let begun = hands_over.then(|| {
            self.shared.generations.keep_listening(&self.id, proxy.spec().update.keep_listening);
            let begun = self.shared.generations.begin(&self.id, Some(self.status.clone()), None, None);
            self.shared.generations.apply(&mut spec, &self.id, begun);
            tracing::info!(proxy = %self.id, epoch = begun.epoch, base_id = begun.base_id, "starting a generation");
            begun
        });
        let process = match self.shared.supervisor.spawn(spec).await {
            Ok(process) => process,
            Err(source) => {
                if let Some(begun) = begun {
                    self.shared.generations.end(&self.id, begun.key);
                }
                return Err(BackendError::Start { id: self.id.clone(), source: Box::new(source) });
            }
        };
        self.lock().generation = begun.map(|begun| begun.key);
        self.attach(process);
        Ok(())
    }

    async fn drain(&self) -> Result<(), BackendError> {
        let (key, proxy) = {
            let state = self.lock();
            (state.generation, state.proxy.clone())
        };
        let (Some(key), Some(proxy)) = (key, proxy) else { return self.stop().await };
        let Some(process) = self.take_process() else { return Ok(()) };
        let current = process.status();
        let Some(identity) = current.identity.clone().filter(|_| current.figures.pid.is_some()) else {
            // No process (it exited, and waits to start again): nothing drains.
            let last = process.stop().await;
            self.status.send_replace(translate(&last));
            return Ok(());
        };
        // Not signalled: it exits by itself once drained, and is not started again.
        let no_restart = ProcessUpdate { restart_on_exit: Some(false), ..ProcessUpdate::default() };
        if let Err(error) = process.update(no_restart) {
            tracing::warn!(proxy = %self.id, %error, "cannot update the draining generation's cgroup");
        }
        let timeout = proxy.spec().update.drain_timeout;
        let draining = epoch::Draining {
            epoch: self.epoch_record(Some(key)).map_or(0, |record| record.epoch),
            identity,
            kill: kill_policy(&proxy),
            until: std::time::SystemTime::now() + timeout,
        };
        tracing::info!(proxy = %self.id, pid = current.figures.pid, epoch = draining.epoch, "the old generation drains");
        self.shared.generations.drain(&self.id, key, draining);
        self.lock().record = None;
        let cut = self.shared.generations.cut_signal(&self.id);
        self.shared.spawn(epoch::await_drain(self.id.clone(), process, timeout, cut));
        Ok(())
    }

    async fn stop(&self) -> Result<(), BackendError> {
        let Some(process) = self.take_process() else { return Ok(()) };
        let last = process.stop().await;
        self.status.send_replace(translate(&last));
        self.lock().record = None;
        match (last.state, last.figures.error) {
            (ProcessState::Stopped, _) | (ProcessState::Failed, None) => Ok(()),
            (_, Some(error)) => Err(BackendError::Stop { id: self.id.clone(), source: error.into() }),
            (state, None) => {
                Err(BackendError::Stop { id: self.id.clone(), source: format!("ended as {state}").into() })
            }
        }
    }

    async fn reload(&self) -> Option<ReloadOutcome> {
        let asked = {
            let state = self.lock();
            state.proxy.as_ref()?.spec().reload.as_ref()?;
            state.process.as_ref().map(ProcessHandle::reload)
        };
        match asked {
            Some(verdict) => verdict.await,
            None => Some(ReloadOutcome::now(ReloadResult::Failed, Some("the proxy has no process".to_owned()))),
        }
    }

    async fn detach(&self) {
        let Some(process) = self.take_process() else { return };
        match process.detach().await {
            Ok(identity) => {
                let mut state = self.lock();
                let kill = state.record.as_ref().map(|record| record.kill).unwrap_or_default();
                state.record = Some(Record { identity, kill, epoch: None });
            }
            Err(err) => tracing::info!(proxy = %self.id, error = %err, "nothing to detach"),
        }
    }

    async fn update(&self, proxy: Arc<ManagedProxy>) -> Result<(), BackendError> {
        let spec = proxy.spec();
        let kill = kill_policy(&proxy);
        let update = ProcessUpdate {
            kill: Some(kill),
            restart: Some(spec.restart),
            log_limits: Some(spec.log),
            journal: self.shared.journal_sink(&proxy),
            health: Some(HealthChecks::from(spec)),
            limits: Some(spec.limits),
            reload: Some(spec.reload.as_deref().cloned()),
            restart_on_exit: None,
        };
        let mut state = self.lock();
        if state.generation.is_some() {
            self.shared.generations.keep_listening(&self.id, spec.update.keep_listening);
        }
        let written = state.process.as_ref().map_or(Ok(()), |process| process.update(update));
        if let Some(record) = &mut state.record {
            record.kill = kill;
        }
        state.proxy = Some(proxy);
        written.map_err(|source| BackendError::Update { id: self.id.clone(), source: source.into() })
    }

    fn status(&self) -> watch::Receiver<tether_manager::BackendStatus> {
        self.status.subscribe()
    }

    fn status_now(&self) -> tether_manager::BackendStatus {
        self.status.now()
    }

    fn on_status_change(&self, changed: StatusChanged) -> bool {
        self.status.0.changed.set(changed).is_ok()
    }

    fn adopted(&self) -> Adopted {
        self.adopted
    }

    fn record(&self) -> BackendRecord {
        let mut state = self.lock();
        let live = state.process.as_ref().and_then(|p| p.status().identity);
        if let Some(identity) = live {
            let kill = state.proxy.as_deref().map(kill_policy).unwrap_or_default();
            state.record = Some(Record { identity, kill, epoch: None });
        }
        let epoch = self.epoch_record(state.generation);
        if let (Some(record), Some(epoch)) = (&mut state.record, epoch) {
            record.epoch = Some(epoch);
        }
        state.record.as_ref().map_or_else(BackendRecord::none, Record::encode)
    }
}

/// The arguments of a proxy of `kind = "envoy"`: `-c` and its bootstrap, with
/// `update = "epoch"` the restart epoch and base id (replaced per generation), then those of
/// its `command`.
fn envoy_args(bootstrap: PathBuf, update: UpdateStrategy, given: Vec<OsString>) -> Vec<OsString> {
    let mut args = vec![OsString::from("-c"), bootstrap.into_os_string()];
    if update == UpdateStrategy::Epoch {
        args.extend(
            [
                "--restart-epoch",
                tether_state::RESTART_EPOCH_PLACEHOLDER,
                "--base-id",
                tether_state::BASE_ID_PLACEHOLDER,
            ]
            .map(OsString::from),
        );
    }
    args.extend(given);
    args
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tether_manager::ProxyState;
    use tether_state::config::{Format, Origin, parse_service};

    use super::*;

    fn proxy(lines: &str) -> tether_state::ProxySpec {
        let text = format!("name = \"web\"\n[proxy]\n{lines}\n");
        parse_service(&text, Format::Toml, &Origin::Body).unwrap().proxy.unwrap()
    }

    #[test]
    fn a_supervisor_state_is_named_as_the_engine_shows_it() {
        use ProcessState::{Backoff, Failed, Running, Starting, Stopped, Stopping};
        for state in [Starting, Running, Backoff, Stopping, Failed] {
            assert_eq!(state.as_str(), ProxyState::from(BackendState::from(state)).as_str());
        }
        // Supervision ended: the engine is told `stopping` and drops the handle; the name
        // is the engine's own `stopped`.
        assert_eq!(BackendState::from(Stopped), BackendState::Stopping);
        assert_eq!(Stopped.as_str(), ProxyState::Stopped.as_str());
    }

    /// A status that counts the changes it tells, and the count.
    fn counting_status() -> (StatusSender, Arc<AtomicUsize>) {
        let status = StatusSender::new();
        let told = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&told);
        assert!(status.0.changed.set(Box::new(move || _ = counted.fetch_add(1, Ordering::SeqCst))).is_ok());
        (status, told)
    }

    #[test]
    fn a_status_is_held_without_a_channel_until_one_is_asked_for_and_the_channel_goes_with_its_last_receiver() {
        let (status, told) = counting_status();
        let running = |pid| tether_manager::BackendStatus {
            state: BackendState::Running,
            figures: tether_state::ProcessFigures { pid: Some(pid), ..Default::default() },
            generations: Vec::new(),
        };

        status.send_replace(running(10));
        assert!(status.lock().channel.is_none(), "no channel before a receiver");
        assert_eq!(status.now(), running(10));
        assert_eq!(told.load(Ordering::SeqCst), 1);

        let mut receiver = status.subscribe();
        assert_eq!(*receiver.borrow_and_update(), running(10));
        status.send_if_modified(|held| {
            held.figures.restarts = 1;
            true
        });
        assert!(receiver.has_changed().unwrap());
        assert_eq!(receiver.borrow_and_update().figures.restarts, 1);
        status.send_if_modified(|_| false);
        assert!(!receiver.has_changed().unwrap(), "no change, no wake-up");
        assert_eq!(told.load(Ordering::SeqCst), 2);

        drop(receiver);
        status.send_replace(running(11));
        assert!(status.lock().channel.is_none(), "the channel went with its last receiver");
        assert_eq!(status.now(), running(11));
        assert_eq!(*status.subscribe().borrow(), running(11), "a new receiver starts from the last status");
    }

    #[test]
    fn a_status_that_follows_its_process_is_read_from_it_until_a_last_status_is_held() {
        let (status, told) = counting_status();
        let (commands, task) =
            crate::control::link(ProcessStatus::running(41, std::time::SystemTime::now(), None, false));
        status.follow(commands.view());
        let observer = status.clone();
        commands.observe(Box::new(move |current| observer.process_changed(current)));
        let mut receiver = status.subscribe();
        assert_eq!(
            receiver.borrow_and_update().figures.pid,
            Some(41),
            "a new receiver starts from the process's status"
        );

        assert_eq!(status.now().state, BackendState::Starting);
        let started = |current: &mut ProcessStatus| {
            current.state = ProcessState::Running;
            current.figures.pid = Some(42);
            true
        };
        assert!(task.publish(started));
        assert_eq!(status.now().state, BackendState::Running);
        assert_eq!(status.now().figures.pid, Some(42));
        assert!(status.lock().own.is_none(), "nothing copied of the process's status");
        assert!(receiver.has_changed().unwrap());
        assert_eq!(receiver.borrow_and_update().figures.pid, Some(42));

        // Once the process is gone, its last status is held, whatever it tells after.
        let mut last = status.now();
        last.state = BackendState::Stopping;
        status.send_replace(last.clone());
        assert!(task.publish(|current| {
            current.figures.pid = None;
            true
        }));
        assert_eq!(status.now(), last);
        assert_eq!(*receiver.borrow_and_update(), last);
        // Each change told: the start (and the observer's first call), the last status, the exit.
        assert_eq!(told.load(Ordering::SeqCst), 4);
    }

    #[test]
    fn an_envoy_of_kind_envoy_gets_its_bootstrap_then_the_epoch_placeholders_then_its_own_words() {
        let words = |update: UpdateStrategy| {
            envoy_args(PathBuf::from("/data/envoy/web-proxy.json"), update, vec!["--concurrency".into(), "1".into()])
        };
        assert_eq!(
            words(UpdateStrategy::Epoch),
            ["-c", "/data/envoy/web-proxy.json", "--restart-epoch", "{restart_epoch}", "--base-id", "{base_id}"]
                .into_iter()
                .chain(["--concurrency", "1"])
                .map(OsString::from)
                .collect::<Vec<_>>()
        );
        assert_eq!(
            words(UpdateStrategy::Restart),
            ["-c", "/data/envoy/web-proxy.json", "--concurrency", "1"].map(OsString::from).to_vec()
        );
    }

    #[tokio::test]
    async fn a_proxy_keeps_its_files_in_the_data_dir() {
        let temp = tempfile::tempdir().unwrap();
        let data = DataDir::open(temp.path()).unwrap();
        let built_in = ("/usr/libexec/tether/proxy".into(), Vec::new());
        let environment = AgentEnvironment {
            socket: data.socket_path(),
            http_addr: None,
            built_in,
            before_start: None,
            journal_socket: crate::DEFAULT_JOURNAL_SOCKET.into(),
        };
        let backend = OsProcessBackend::new(data.clone(), environment).unwrap();
        let service =
            parse_service("name = \"web\"\n[proxy]\ncommand = [\"/bin/sleep\", \"30\"]\n", Format::Toml, &Origin::Body)
                .unwrap();
        let token = tether_state::ProxyToken::generate().unwrap();
        let proxy = ManagedProxy::new(Arc::new(service), token).unwrap();

        let spec = backend.process_spec(&proxy);
        assert_eq!(spec.name.as_str(), "web-proxy");
        assert_eq!(spec.pid_file, Some(temp.path().join("pids/web-proxy.pid")));
        assert_eq!(spec.logs.stdout.path(), temp.path().join("logs/web-proxy-stdout.log"));
        assert_eq!(spec.logs.stderr.path(), temp.path().join("logs/web-proxy-stderr.log"));
        assert_eq!(spec.logs.stdout.dir(), data.logs(), "through the data dir's own handle");
        assert_eq!((spec.program.as_os_str(), spec.args.as_slice()), ("/bin/sleep".as_ref(), ["30".into()].as_slice()));
    }

    #[test]
    fn missing_programs_are_bare_names_found_nowhere_in_the_path_the_proxy_gets() {
        assert_eq!(missing_programs(&proxy("")), [], "the built-in proxy");
        assert_eq!(
            missing_programs(&proxy("command = [\"sh\", \"-c\", \"true\"]\nenv = { PATH = \"/bin:/usr/bin\" }")),
            []
        );
        assert_eq!(missing_programs(&proxy("command = [\"/nonexistent/envoy\"]")), [], "a path is not looked for");

        let missing = missing_programs(&proxy(
            "command = [\"tether-not-installed-xyz\", \"-c\"]\nenv = { PATH = \"/nonexistent/bin\" }\n\
             [proxy.readiness]\nexec = [\"tether-no-check-xyz\"]\n[proxy.liveness]\nexec = [\"/nonexistent/check\"]\n\
             [proxy.reload]\nsignal = \"SIGHUP\"\ncheck = [\"tether-no-reload-check-xyz\"]",
        ));
        let found: Vec<(&str, String)> =
            missing.iter().map(|missing| (missing.field, missing.error.to_string())).collect();
        assert_eq!(
            found,
            [
                ("command", "program `tether-not-installed-xyz` not found in PATH `/nonexistent/bin`".to_owned()),
                ("readiness.exec", "program `tether-no-check-xyz` not found in PATH `/nonexistent/bin`".to_owned()),
                (
                    "reload.check",
                    "program `tether-no-reload-check-xyz` not found in PATH `/nonexistent/bin`".to_owned()
                ),
            ]
        );

        // Without `env.PATH`, the agent's own.
        let missing = missing_programs(&proxy("command = [\"tether-not-installed-xyz\"]"));
        let agent_path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
        assert_eq!(missing.len(), 1);
        assert_eq!(missing[0].error.path, agent_path);
    }
}
