//! `tether agent`: wires the catalog, the engine, the process backend and the control API
//! together, and turns signals into reloads and shutdowns.
//!
//! Two shutdowns, never confused: *close* (SIGTERM/SIGINT) stops the API, detaches every
//! proxy and writes the snapshot, so that the next agent adopts them; *kill* (`tether
//! leave`) stops every proxy in parallel and removes the snapshot.

pub(crate) mod dev;
mod serve;

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tether_manager::{FileSnapshotStore, Manager, ManagerConfig};
use tether_proxy_daemon::{AgentEnvironment, Cgroups, OsProcessBackend};
use tether_state::config::DisplayPath;
use tether_state::persist::DataDir;
use tokio::net::{TcpListener, UnixListener};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::api::{self, ApiState, LeaveRequest};
use crate::catalog::sources::Sources;
use crate::catalog::{held, policy};
use crate::connect::{self, Connect};
use crate::error::UsageError;
use crate::fleet::FleetOptions;
use crate::fleet::follow::{Coalesce, FleetCollector, Follower};
use crate::fleet::publish::Publisher;
use crate::fleet::status::FleetReader;
use crate::metrics::Metrics;
use crate::templates::Templates;
use crate::xds::Xds;
use crate::xds::bootstrap::XdsTarget;
use crate::xds::sidecar::{BeforeStarts, EnvoyBootstraps};

/// What `tether agent` runs with, after `--dev` has been resolved.
pub(crate) struct AgentOptions {
    pub(crate) config_dirs: Vec<PathBuf>,
    pub(crate) data_dir: PathBuf,
    pub(crate) http_addr: Option<SocketAddr>,
    /// Serve the proxies' output on `http_addr` too (`--http-logs`).
    pub(crate) http_logs: bool,
    /// Serve xDS on this loopback TCP address too (`--xds-address`).
    pub(crate) xds_address: Option<SocketAddr>,
    pub(crate) allow_root: bool,
    pub(crate) allow_api_commands: bool,
    pub(crate) sync_quiescent: Duration,
    pub(crate) sync_max_delay: Duration,
    /// Stop every proxy on any exit, not only on `leave` (`--dev`).
    pub(crate) stop_proxies_on_exit: bool,
    /// Follow this node's services in etcd (`--etcd`, `--node`).
    pub(crate) fleet: Option<FleetOptions>,
    /// Where proxies' cgroups go (`--cgroup-root`, `--no-cgroups`).
    pub(crate) cgroups: CgroupChoice,
    /// The journal's native socket (`--journal-socket`).
    pub(crate) journal_socket: PathBuf,
}

/// Where the agent puts its proxies' cgroups.
#[derive(Debug, Clone)]
pub(crate) enum CgroupChoice {
    /// Under its own cgroup, if it can.
    Own,
    /// Under this directory of a cgroup2 hierarchy.
    Under(PathBuf),
    /// Nowhere: process groups only (`--no-cgroups`).
    Off,
}

/// The proxies' cgroup subtree, or `None` with the reason logged once. A `--cgroup-root`
/// that cannot be used is a usage error: the operator asked for it by name.
fn open_cgroups(choice: &CgroupChoice, data: &DataDir) -> Result<Option<Cgroups>, UsageError> {
    let base = match choice {
        CgroupChoice::Off => {
            tracing::info!("cgroups off (--no-cgroups): proxies are fenced by process groups");
            return Ok(None);
        }
        CgroupChoice::Own => None,
        CgroupChoice::Under(dir) => Some(dir.as_path()),
    };
    let owner = std::path::absolute(data.root()).unwrap_or_else(|_| data.root().to_owned());
    match Cgroups::open(base, &owner) {
        Ok(cgroups) => {
            let controllers =
                if cgroups.controllers().is_empty() { "none".to_owned() } else { cgroups.controllers().join(" ") };
            tracing::info!(subtree = %cgroups.dir().display(), controllers = %controllers, "a cgroup per proxy");
            Ok(Some(cgroups))
        }
        Err(unavailable) if base.is_some() => Err(UsageError(format!("--cgroup-root: {unavailable}"))),
        Err(unavailable) => {
            tracing::warn!(reason = %unavailable, "cgroups unavailable: proxies are fenced by process groups");
            Ok(None)
        }
    }
}

/// Warns, once per proxy at start, of each program that this host does not have, as
/// `tether validate` does: its start fails until the program is installed (and is retried
/// on the restart backoff meanwhile).
fn warn_of_missing_programs(state: &tether_state::LocalState) {
    for entry in state.entries() {
        let Some(proxy) = &entry.proxy else { continue };
        for missing in tether_proxy_daemon::missing_programs(proxy.spec()) {
            tracing::warn!(
                proxy = %proxy.id(),
                service = %entry.service.id,
                source = %entry.source,
                field = %format_args!("proxy.{}", missing.field),
                program = %missing.error.program.display(),
                path = %missing.error.path.to_string_lossy(),
                denied = missing.error.denied,
                "program not found in PATH; the proxy cannot start until it is installed"
            );
        }
    }
}

/// How the agent is told to end.
enum Ending {
    /// SIGTERM or SIGINT: leave proxies running for the next agent.
    Close(&'static str),
    /// `tether leave`: stop every proxy, then answer the request.
    Leave(LeaveRequest),
}

/// Holds the data dir's lock for the agent's lifetime, so that two agents never manage the
/// same proxies.
struct DataDirLock {
    file: nix::fcntl::Flock<std::fs::File>,
}

impl std::os::fd::AsFd for DataDirLock {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }
}

/// How long the lock may stay taken before the agent gives up: a proxy that a crashed agent
/// was spawning holds the lock until its exec, which is a matter of milliseconds.
const LOCK_WAIT: Duration = Duration::from_secs(3);

async fn lock_data_dir(data: &DataDir) -> anyhow::Result<DataDirLock> {
    // Through the root's handle: a link planted at `agent.lock` is replaced, never followed.
    let mut file = data.root_dir().open_append("agent.lock").context("cannot open the data dir's lock")?;
    let deadline = tokio::time::Instant::now() + LOCK_WAIT;
    loop {
        match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Ok(DataDirLock { file: lock }),
            Err((unlocked, nix::errno::Errno::EWOULDBLOCK)) if tokio::time::Instant::now() < deadline => {
                file = unlocked;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err((_, errno)) => {
                return Err(anyhow::anyhow!(
                    "another agent is running with the data dir {} ({errno})",
                    DisplayPath(data.root())
                ));
            }
        }
    }
}

/// Runs the agent until a signal or `leave`.
pub(crate) async fn run(options: AgentOptions) -> anyhow::Result<ExitCode> {
    if let Some(addr) = options.http_addr.filter(|addr| !addr.ip().is_loopback()) {
        return Err(UsageError(format!("--http-addr {addr} is not a loopback address")).into());
    }
    // Tokens travel in the clear over it: the loopback only, as for --http-addr.
    if let Some(addr) = options.xds_address.filter(|addr| !addr.ip().is_loopback()) {
        return Err(UsageError(format!("--xds-address {addr} is not a loopback address")).into());
    }
    let nofile = serve::raise_descriptor_limit();
    let caps = serve::ConnectionCaps::for_limit(nofile);
    tracing::info!(nofile, unix_connections = caps.unix, tcp_connections = caps.tcp, "descriptor limit");
    let data = DataDir::open(&options.data_dir).context("preparing the data dir")?;
    let lock = lock_data_dir(&data).await?;
    for path in data.remove_temporaries() {
        tracing::info!(path = %DisplayPath(&path), "removed a temporary file that an earlier agent's crash left");
    }
    let sources = match Sources::open(data.clone(), options.config_dirs.clone(), options.allow_api_commands) {
        Ok(sources) => Arc::new(sources),
        Err(errors) => return Err(UsageError(format!("invalid config:\n{errors}")).into()),
    };
    warn_of_missing_programs(sources.state());
    // The CA before anything starts: an agent whose CA cannot be loaded does not start, and
    // the proxies find their leaves from their first request.
    let connect = Arc::new(Connect::new(sources.state().clone()));
    if let Err(err) = connect::at_start(&connect, &sources.connect_section(), &data) {
        return Err(UsageError(format!("invalid config:\n{}", crate::error::error_chain(&err))).into());
    }
    // Rendered before each start, through the backend; re-rendered by their own task.
    let templates = Templates::new(
        sources.state().clone(),
        options.fleet.as_ref().map(|fleet| (fleet.etcd.clone(), &fleet.layout)),
    );
    // Before the engine's first reconcile, so that it adopts the fleet's running proxies.
    let follower = options.fleet.as_ref().map(|fleet| {
        let coalesce = Coalesce { quiescent: options.sync_quiescent, max_delay: options.sync_max_delay };
        Follower::new(fleet.layout.clone(), fleet.etcd.clone(), coalesce, sources.clone(), &data)
    });
    let fleet_status = follower.as_ref().map(Follower::status);
    let running_as_root = nix::unistd::geteuid().is_root();
    // The bootstraps of `kind = "envoy"` reach the agent through the xDS socket.
    let xds_socket =
        std::path::absolute(data.root().join(crate::xds::SOCKET_NAME)).context("resolving the xDS socket path")?;
    let envoy_bootstraps = EnvoyBootstraps::new(data.clone(), XdsTarget::Socket(xds_socket.clone()));
    let socket_path = std::path::absolute(data.socket_path()).context("resolving the socket path")?;
    let environment = AgentEnvironment {
        socket: socket_path.clone(),
        http_addr: options.http_addr.map(|addr| addr.to_string()),
        built_in: built_in_proxy(),
        before_start: Some(Arc::new(BeforeStarts(vec![Arc::new(templates.clone()), Arc::new(envoy_bootstraps)]))),
        journal_socket: options.journal_socket.clone(),
    };
    let cgroups = open_cgroups(&options.cgroups, &data)?;
    // Whichever way the agent ends from here, a start that failed included, it leaves no
    // empty subtree behind; one that still holds proxies stays for the next agent.
    let _subtree = cgroups.clone().map(RemoveIfEmpty);
    let backend = Arc::new(
        OsProcessBackend::with_cgroups(data.clone(), environment, cgroups.clone())
            .context("starting the process backend")?,
    );
    // A proxy being spawned holds the data dir's lock until its exec, which gives it the
    // identity that the next agent looks for: that agent cannot look too early.
    backend
        .hold_until_exec(std::os::fd::AsFd::as_fd(&lock))
        .context("handing the data dir's lock to the spawn thread")?;
    // The parent of the proxies is the keeper, which outlives this agent: a proxy that asks
    // to die with its parent (Envoy does) survives the agent's crash, upgrade or SIGTERM.
    // `/proc/self/exe`: the keeper is this very build, even if an upgrade replaced the file.
    backend
        .use_keeper("/proc/self/exe", own_executable(), vec![crate::cli::KEEPER.into()])
        .await
        .context("looking for the keeper of the proxies")?;
    let store = Arc::new(FileSnapshotStore::in_data_dir(&data));
    // Proxies held down by `tether stop` stay stopped across agent restarts.
    let held = Arc::new(held::Held::load(&data));
    let config = ManagerConfig {
        sync_quiescent: options.sync_quiescent,
        sync_max_delay: options.sync_max_delay,
        running_as_root,
        allow_root: options.allow_root,
        users: policy::system_users(),
        held: held.ids(),
        ..ManagerConfig::default()
    };
    let catalog = Arc::new(sources.state().clone());
    let mut manager = Manager::new(catalog, backend.clone(), store, config).with_meter(backend.clone());
    let handle = manager.handle();
    templates.set_manager(handle.clone());

    // Usage is measured where the backend has cgroups: without them, no family at all.
    let mut metrics = Metrics::new(handle.clone(), cgroups.is_some());
    if let Some(status) = &fleet_status {
        metrics.register(Box::new(FleetCollector(status.clone())));
    }
    metrics.register(templates.collector());
    metrics.register(connect::collector(connect.clone()));
    let api_stop = CancellationToken::new();
    // Envoy's config over ADS, from the catalog and its upstreams' ready instances: the
    // templates' one source (the fleet's, when the agent follows etcd); in the mesh, with
    // Connect's leaves, roots and intentions.
    let xds = Xds::new(
        sources.state().clone(),
        templates.instances(),
        crate::xds::MeshSource { connect: connect.clone(), sources: sources.clone() },
        api_stop.child_token(),
    );
    metrics.register(xds.collector());
    let (leave_tx, mut leave_rx) = mpsc::channel::<LeaveRequest>(1);
    let api_state = ApiState {
        sources: sources.clone(),
        manager: handle.clone(),
        leave: leave_tx,
        metrics: Arc::new(metrics),
        shutdown: api_stop.clone(),
        fleet: fleet_status,
        held: held.clone(),
        templates: templates.clone(),
        connect: connect.clone(),
        xds: xds.clone(),
        history: api::history::History::default(),
        fleet_reader: options
            .fleet
            .as_ref()
            .map(|fleet| Arc::new(FleetReader::new(fleet.etcd.clone(), fleet.layout.prefix().to_owned()))),
    };
    tokio::spawn(api::history::record(api_state.clone()));
    let mut servers = JoinSet::new();
    let unix = bind_socket(&socket_path)?;
    servers.spawn(serve::serve(
        unix,
        api::socket_router(api_state.clone(), serve::ConnectionCaps::streams(caps.unix)),
        "socket",
        caps.unix,
        api_stop.clone(),
    ));
    if let Some(addr) = options.http_addr {
        let tcp = TcpListener::bind(addr).await.with_context(|| format!("cannot listen on --http-addr {addr}"))?;
        tracing::info!(%addr, "serving the read endpoints over HTTP");
        servers.spawn(serve::serve(
            tcp,
            api::http_router(api_state, serve::ConnectionCaps::streams(caps.tcp), options.http_logs),
            "http",
            caps.tcp,
            api_stop.clone(),
        ));
    }
    servers.spawn(serve_xds(xds.clone().serve_unix(bind_socket(&xds_socket)?), "socket"));
    if let Some(addr) = options.xds_address {
        let tcp = TcpListener::bind(addr).await.with_context(|| format!("cannot listen on --xds-address {addr}"))?;
        tracing::info!(%addr, "serving xDS over TCP");
        servers.spawn(serve_xds(xds.clone().serve_tcp(tcp), "tcp"));
    }
    servers.spawn(xds.follow(handle.clone()));
    tracing::info!(socket = %DisplayPath(&socket_path), services = sources.state().len(), root = running_as_root, "agent started");

    let mut sighup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let fleet_stop = CancellationToken::new();
    let fleet_revoke = CancellationToken::new();
    let publisher = match (&options.fleet, &follower) {
        (Some(fleet), Some(follower)) => Some(tokio::spawn(
            Publisher::new(
                fleet.layout.clone(),
                fleet.etcd.clone(),
                fleet.ttl,
                handle.clone(),
                sources.state().clone(),
                follower.revisions(),
            )
            .run(fleet_stop.clone(), fleet_revoke.clone()),
        )),
        _ => None,
    };
    let fleet_task = follower.map(|follower| tokio::spawn(follower.run(fleet_stop.clone())));
    let engine_stop = CancellationToken::new();
    let templates_stop = CancellationToken::new();
    let templates_task = tokio::spawn(templates.run(templates_stop.clone()));
    // The engine runs in its own task, so that a slow reload never stalls reconciling.
    let mut engine = tokio::spawn({
        let stop = engine_stop.clone();
        async move {
            manager.run(stop).await;
            manager
        }
    });
    let ending = loop {
        tokio::select! {
            _ = &mut engine => return Err(anyhow::anyhow!("the engine stopped on its own")),
            _ = sighup.recv() => {
                tracing::info!("SIGHUP: reloading the config");
                match api::reload_config(sources.clone(), &connect).await {
                    Ok(report) => tracing::info!(
                        added = report.catalog.added,
                        changed = report.catalog.changed,
                        removed = report.catalog.removed,
                        files_read = report.files.read,
                        files_unchanged = report.files.reused,
                        "config reloaded"
                    ),
                    Err(_) => tracing::error!("config reload refused; the previous config stays in force"),
                }
            }
            _ = sigterm.recv() => break Ending::Close("SIGTERM"),
            _ = sigint.recv() => break Ending::Close("SIGINT"),
            Some(request) = leave_rx.recv() => break Ending::Leave(request),
        }
    };
    // Nothing re-renders or asks for a restart while the agent ends.
    templates_stop.cancel();
    let _ = templates_task.await;
    // The catalog stops changing before the engine stops reading it. An agent that leaves
    // takes its status with it; one that closes leaves it to expire, or to the next agent.
    if matches!(ending, Ending::Leave(_)) {
        fleet_revoke.cancel();
    }
    fleet_stop.cancel();
    if let Some(task) = fleet_task {
        if let Err(err) = task.await {
            tracing::error!(error = %err, "the fleet follower failed");
        }
    }
    if let Some(task) = publisher {
        if let Err(err) = task.await {
            tracing::error!(error = %err, "the fleet status publisher failed");
        }
    }
    connect.shutdown().await;
    engine_stop.cancel();
    let manager = engine.await.context("the engine task failed")?;
    match ending {
        Ending::Leave(request) => {
            tracing::info!("leave: stopping every proxy");
            let result = manager.kill().await;
            // Removed whatever the outcome: every proxy that could be stopped is, and one that
            // could not keeps its pid file and its identity in its environment, through which
            // the next agent finds it. The answer names the ones that did not stop.
            remove_snapshot(&data);
            let reply = result.as_ref().map(|_| ()).map_err(|err| crate::error::error_chain(err));
            let _ = request.send(reply);
            // Let the answer reach the client before the socket closes.
            stop_servers(&api_stop, &mut servers).await;
            let _ = std::fs::remove_file(&socket_path);
            let _ = std::fs::remove_file(&xds_socket);
            result.context("stopping the proxies")?;
        }
        Ending::Close(signal) => {
            if options.stop_proxies_on_exit {
                tracing::info!(signal, "shutting down; stopping every proxy");
            } else {
                tracing::info!(signal, "shutting down; proxies keep running");
            }
            stop_servers(&api_stop, &mut servers).await;
            let _ = std::fs::remove_file(&socket_path);
            let _ = std::fs::remove_file(&xds_socket);
            if options.stop_proxies_on_exit {
                manager.kill().await.context("stopping the proxies")?;
                remove_snapshot(&data);
            } else {
                manager.close().await.context("writing the snapshot")?;
            }
        }
    }
    tracing::info!("agent stopped");
    Ok(ExitCode::SUCCESS)
}

/// Runs one of the xDS server's listeners, logging why it ended if it failed.
async fn serve_xds(serving: impl Future<Output = Result<(), tonic::transport::Error>>, listener: &'static str) {
    if let Err(err) = serving.await {
        tracing::error!(listener, error = %crate::error::error_chain(&err), "the xDS server failed");
    }
}

/// What runs the built-in proxy: this binary, with the subcommand that serves it.
fn built_in_proxy() -> (PathBuf, Vec<std::ffi::OsString>) {
    (own_executable(), vec![crate::cli::CONNECT_PROXY.into()])
}

/// The running executable. When an upgrade replaced the file, the kernel reports the old
/// inode as `<path> (deleted)`: the new binary is at `<path>`, and a new proxy runs it.
fn own_executable() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
    match exe.to_str().and_then(|path| path.strip_suffix(" (deleted)")) {
        Some(path) => PathBuf::from(path),
        None => exe,
    }
}

/// Removes the proxies' cgroup subtree when dropped, if nothing is left in it: after
/// `leave`, with `--dev`, or when the agent fails before it started a proxy.
struct RemoveIfEmpty(Cgroups);

impl Drop for RemoveIfEmpty {
    fn drop(&mut self) {
        self.0.remove_if_empty();
    }
}

/// How long open requests may take to finish once the API stops.
const DRAIN: Duration = Duration::from_secs(2);

/// Stops accepting requests, lets open ones finish within [`DRAIN`], then drops the rest.
async fn stop_servers(stop: &CancellationToken, servers: &mut JoinSet<()>) {
    stop.cancel();
    let drained = tokio::time::timeout(DRAIN, async { while servers.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!("requests still open after the drain period; closing them");
        servers.abort_all();
        while servers.join_next().await.is_some() {}
    }
}

fn remove_snapshot(data: &DataDir) {
    match std::fs::remove_file(data.snapshot_path()) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => tracing::warn!(error = %err, "cannot remove the snapshot"),
    }
}

/// Binds `agent.sock` with mode 0600, replacing a stale socket left by a crashed agent
/// (the data dir lock proves no other agent uses it).
///
/// The mode is set on the socket before `bind` creates its file, which takes the socket's
/// mode (Linux): a `chmod` by path afterwards would follow a link planted there meanwhile.
/// Removing the stale file removes a link itself, never its target.
fn bind_socket(path: &std::path::Path) -> anyhow::Result<UnixListener> {
    use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};

    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => return Err(err).with_context(|| format!("cannot remove the stale socket {}", DisplayPath(path))),
    }
    let listen = || -> nix::Result<std::os::unix::net::UnixListener> {
        let flags = SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK;
        let fd = socket::socket(AddressFamily::Unix, SockType::Stream, flags, None)?;
        nix::sys::stat::fchmod(&fd, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
        socket::bind(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
        socket::listen(&fd, Backlog::new(1024)?)?;
        Ok(fd.into())
    };
    let listener = listen().with_context(|| format!("cannot listen on {}", DisplayPath(path)))?;
    UnixListener::from_std(listener).with_context(|| format!("cannot listen on {}", DisplayPath(path)))
}
