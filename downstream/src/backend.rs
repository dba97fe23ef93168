//! [`SupervisorBackend`]: the engine's backend traits over `tether-proxy-daemon`'s
//! `Supervisor`, used without the adapter that crate ships behind its `manager` feature.
//!
//! This module translates between the two vocabularies (a catalog proxy into a
//! `ProcessSpec`, a `ProcessStatus` into a `BackendStatus`); the supervisor owns the
//! processes. Nothing here signals or reaps a process itself.

use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use tether_manager::{BackendError, BackendState, BackendStatus, ProxyBackend, ProxyHandle, async_trait, watch};
use tether_proxy_daemon::{
    HealthChecks, LogTarget, PrivateDir, ProcessHandle, ProcessName, ProcessSpec, ProcessState, ProcessStatus,
    ProcessUpdate, Supervisor,
};
use tether_state::{ManagedProxy, ProxyCommand};

/// The `PATH` a proxy starts with, before its own environment.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// A [`ProxyBackend`] that runs each proxy's command as an OS process, supervised (restarted
/// on its backoff, stopped with its kill policy) by a [`Supervisor`].
///
/// It runs external commands only, with their readiness and liveness checks; a proxy that
/// asks for the built-in proxy or for listeners fails to start ([`UnsupportedProxy`]). Its
/// handles record nothing for the snapshot, so it adopts nothing: after a restart of the
/// agent, every proxy is started afresh. Each proxy's output goes to
/// `<proxy id>-stdout.log` and `-stderr.log` in one log directory; no pid file is written.
#[derive(Debug, Clone)]
pub struct SupervisorBackend {
    supervisor: Supervisor,
    logs: PrivateDir,
}

impl SupervisorBackend {
    /// A backend whose processes write their logs in the directory `logs` (created if
    /// missing).
    ///
    /// # Errors
    ///
    /// When the log directory cannot be opened or made, or as [`Supervisor::new`].
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn new(logs: impl Into<PathBuf>) -> std::io::Result<Self> {
        let logs = PrivateDir::open_root(logs).map_err(std::io::Error::other)?;
        Ok(Self { supervisor: Supervisor::new()?, logs })
    }
}

#[async_trait]
impl ProxyBackend for SupervisorBackend {
    fn create(&self, proxy: Arc<ManagedProxy>) -> Box<dyn ProxyHandle> {
        Box::new(SupervisedProxy {
            supervisor: self.supervisor.clone(),
            logs: self.logs.clone(),
            proxy: Mutex::new(proxy),
            process: Mutex::new(None),
            status: watch::Sender::new(BackendStatus::default()),
        })
    }
    // `restore` and `adoption_candidates` keep their defaults: nothing is adopted.
}

/// Why [`SupervisorBackend`] cannot run a proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnsupportedProxy {
    /// The proxy has no `command`: it would run the `tether` binary's built-in proxy.
    BuiltIn,
    /// The proxy asks for listening sockets, which this backend does not bind.
    Listeners,
    /// The supervisor refused the process spec (its log files could not be opened, say).
    Spec(String),
}

impl fmt::Display for UnsupportedProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BuiltIn => f.write_str("the built-in proxy is not available here: give the proxy a command"),
            Self::Listeners => f.write_str("listeners are not supported by this backend"),
            Self::Spec(reason) => write!(f, "the process cannot be set up: {reason}"),
        }
    }
}

impl std::error::Error for UnsupportedProxy {}

/// One proxy of a [`SupervisorBackend`].
struct SupervisedProxy {
    supervisor: Supervisor,
    logs: PrivateDir,
    /// What it runs: the proxy it was created with, or last updated to.
    proxy: Mutex<Arc<ManagedProxy>>,
    /// The supervised process, from a successful start until a stop or a detach.
    process: Mutex<Option<ProcessHandle>>,
    status: watch::Sender<BackendStatus>,
}

impl SupervisedProxy {
    fn proxy(&self) -> Arc<ManagedProxy> {
        self.proxy.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn take_process(&self) -> Option<ProcessHandle> {
        self.process.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

#[async_trait]
impl ProxyHandle for SupervisedProxy {
    async fn start(&self) -> Result<(), BackendError> {
        let proxy = self.proxy();
        let start_error = |source| BackendError::Start { id: proxy.id().clone(), source };
        let spec = process_spec(&proxy, &self.logs).map_err(|unsupported| start_error(Box::new(unsupported)))?;
        let process = self.supervisor.spawn(spec).await.map_err(|spawn| start_error(Box::new(spawn)))?;
        // Called at once with the current status, then on every change, from the supervising
        // task: the engine sees `running` as soon as this returns.
        let status = self.status.clone();
        process.observe(move |observed| {
            status.send_replace(backend_status(observed));
        });
        *self.process.lock().unwrap_or_else(PoisonError::into_inner) = Some(process);
        Ok(())
    }

    async fn stop(&self) -> Result<(), BackendError> {
        let Some(process) = self.take_process() else { return Ok(()) };
        let last = process.stop().await;
        if last.state == ProcessState::Failed {
            // Supervision ended before the stop could prove the process gone: it may still run.
            let reason = last.figures.error.unwrap_or_else(|| "supervision failed".to_owned());
            *self.process.lock().unwrap_or_else(PoisonError::into_inner) = Some(process);
            return Err(BackendError::Stop { id: self.proxy().id().clone(), source: reason.into() });
        }
        Ok(())
    }

    async fn detach(&self) {
        if let Some(process) = self.take_process() {
            // An error says that no process runs (waiting for its restart, or gone): there is
            // nothing left to leave running.
            let _identity = process.detach().await;
        }
    }

    async fn update(&self, proxy: Arc<ManagedProxy>) -> Result<(), BackendError> {
        let spec = proxy.spec();
        let update = ProcessUpdate {
            kill: Some(spec.kill),
            restart: Some(spec.restart),
            log_limits: Some(spec.log),
            health: Some(HealthChecks::from(spec)),
            ..ProcessUpdate::default()
        };
        if let Some(process) = self.process.lock().unwrap_or_else(PoisonError::into_inner).as_ref() {
            // Only cgroup limits can fail to apply, and this backend runs without cgroups.
            process
                .update(update)
                .map_err(|error| BackendError::Update { id: proxy.id().clone(), source: Box::new(error) })?;
        }
        *self.proxy.lock().unwrap_or_else(PoisonError::into_inner) = proxy;
        Ok(())
    }

    fn status(&self) -> watch::Receiver<BackendStatus> {
        self.status.subscribe()
    }
    // `record` keeps its default: nothing is adopted, so nothing needs proving.
}

/// What the supervisor runs for `proxy`.
fn process_spec(proxy: &ManagedProxy, logs: &PrivateDir) -> Result<ProcessSpec, UnsupportedProxy> {
    let spec = proxy.spec();
    let ProxyCommand::Exec(command) = &spec.command else { return Err(UnsupportedProxy::BuiltIn) };
    if !spec.listeners.is_empty() {
        return Err(UnsupportedProxy::Listeners);
    }
    // Layers, later ones winning: a default PATH, the agent's own environment when the proxy
    // inherits it, then the proxy's.
    let inherited = if spec.inherit_env { std::env::vars_os().collect() } else { Vec::new() };
    let mut builder = ProcessSpec::builder(ProcessName::of_proxy(proxy.id()), command.program())
        .args(command.args())
        .env("PATH", DEFAULT_PATH)
        .envs(inherited)
        .envs(spec.env.iter())
        .working_dir(spec.working_dir.clone().unwrap_or_else(|| PathBuf::from("/")))
        .kill(spec.kill)
        .restart(spec.restart)
        .log_limits(spec.log)
        .health(HealthChecks::from(spec))
        .logs(LogTarget::In(logs.clone()));
    if let Some(user) = &spec.user {
        builder = builder.user(user.clone());
    }
    builder.build().map_err(|error| UnsupportedProxy::Spec(error.to_string()))
}

/// What the engine is shown of what the supervisor observed.
fn backend_status(observed: &ProcessStatus) -> BackendStatus {
    let state = match observed.state {
        ProcessState::Starting => BackendState::Starting,
        ProcessState::Running => BackendState::Running,
        ProcessState::Backoff => BackendState::Backoff,
        // The engine drops the handle once its stop returns: `stopped` is its own to show.
        ProcessState::Stopping | ProcessState::Stopped => BackendState::Stopping,
        ProcessState::Failed => BackendState::Failed,
        // A state added to the supervisor after this was written: never shown as running.
        _ => BackendState::Failed,
    };
    BackendStatus { state, figures: observed.figures.clone(), generations: Vec::new() }
}
