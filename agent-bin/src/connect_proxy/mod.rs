//! `tether connect-proxy`: the built-in TCP proxy, normally started by the agent.
//!
//! It reads its identity from `TETHER_*`, fetches its config from the agent (through its
//! socket, or at its `--http-addr` when the proxy's user may not open the socket) and follows
//! changes through blocking queries: a new bind address gets a new listener (the old one
//! closes; established connections keep flowing), a new upstream applies to new
//! connections. It keeps forwarding while the agent is away, and reconnects with backoff.
//!
//! When the agent has a CA (`mesh.rs`), its public listener takes mutual TLS only: a client
//! certificate that chains to the agent's roots, whose SPIFFE id names a service that the
//! intentions let through; a connection that a later intention denies is closed. Each
//! `config.upstreams` entry is a local plaintext listener whose connections go out over
//! mutual TLS to a ready instance of the destination, which must prove the destination's
//! identity. Each refusal is reported to the agent, which counts it and tells it as an event
//! (or, when the proxy reaches the agent at its HTTP address, only logged here).
//! Without a CA the public listener forwards plaintext, and upstreams have nowhere to go.
//!
//! Handed a listener by the agent (socket activation: `LISTEN_FDS`, `LISTEN_PID`), it
//! serves that one, TCP or Unix, instead of binding. On SIGINT or SIGTERM it stops
//! accepting and lets the connections in flight finish (a second signal ends them): the
//! next instance accepts what waits in the agent's listener meanwhile.

mod mesh;

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tether_state::{ServiceName, proxy_env};

use anyhow::Context;
use hyper::StatusCode;
use tether_state::Backoff;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream, lookup_host};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::api::dto::{CaRootsDto, IntentionsDto, LeafDto, ProxyConfigDto, RefusalDto, TOKEN_HEADER, UpstreamDto};
use crate::client::{self, AgentAt};
use crate::error::UsageError;
use crate::xds::resources::{Upstream, read_upstreams};
use mesh::{Answer, MeshTls};

/// The pauses between two attempts to reach the agent: 100 ms, doubling up to 5 s.
const RETRY_BACKOFF: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));

/// The buffer of each direction of a forwarded connection, when it is copied through this
/// process rather than spliced.
const COPY_BUFFER: usize = 256 * 1024;

/// The pipe of each direction of a spliced connection: 1 MiB, the default
/// `fs.pipe-max-size`, halves the proxy's CPU per byte against 64 KiB. The kernel may give
/// less (a user over `fs.pipe-user-pages-soft`); splicing works with any size.
const SPLICE_PIPE: usize = 1024 * 1024;

/// The pause after a failed accept.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// How long one blocking query may wait at the agent.
const QUERY_WAIT: Duration = Duration::from_secs(300);

/// How long an upstream connection may take to connect and finish its handshake, per
/// instance tried.
const UPSTREAM_CONNECT: Duration = Duration::from_secs(5);

/// How many refusals may wait to be reported to the agent; more are only logged.
const REPORT_BACKLOG: usize = 64;

/// Where to listen and where to forward, from the proxy's config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Route {
    /// Where to listen; `None` when the agent handed a listener over.
    pub(crate) bind: Option<String>,
    /// The local service; `None` for a service with no port, which only reaches its
    /// upstreams: its inbound connections are closed.
    pub(crate) upstream: Option<String>,
    /// The service's id, whose leaf the proxy proves, and its name, which intentions name.
    pub(crate) service_id: String,
    pub(crate) service_name: String,
    /// `config.upstreams`: a local listener per entry, out over mutual TLS.
    pub(crate) upstreams: Vec<Upstream>,
}

impl Route {
    /// The route a config describes: `bind_address` (default 127.0.0.1) and `bind_port`
    /// (required unless `handed` a listener); `local_service_address` or else the
    /// service's address and port, if it has one.
    pub(crate) fn from_config(config: &ProxyConfigDto, handed: bool) -> Result<Self, String> {
        let get_str = |key: &str| config.config.get(key).and_then(|v| v.as_str());
        let bind_address = get_str("bind_address").unwrap_or("127.0.0.1");
        let bind_port =
            config.config.get("bind_port").and_then(serde_json::Value::as_u64).and_then(|p| u16::try_from(p).ok());
        let bind = match (handed, bind_port) {
            (true, _) => None,
            (false, Some(port)) => Some(join_host_port(bind_address, port)),
            (false, None) => {
                return Err("config.bind_port is required: the port the built-in proxy listens on (1-65535), \
                     unless the proxy has a listener"
                    .to_owned());
            }
        };
        let upstream = match get_str("local_service_address") {
            Some(address) => Some(address.to_owned()),
            None => config.service.port.map(|port| join_host_port(&config.service.address, port)),
        };
        let upstreams =
            read_upstreams(&config.config).map_err(|(field, problem)| format!("config.{field}: {problem}"))?;
        Ok(Self {
            bind,
            upstream,
            service_id: config.service.id.clone(),
            service_name: config.service.name.clone(),
            upstreams,
        })
    }
}

fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

/// Who the proxy is to the agent, and where it reaches the agent.
struct Identity {
    proxy_id: String,
    token: String,
    agent: AgentAt,
}

fn identity() -> Result<Identity, UsageError> {
    let var = |name: &str| {
        std::env::var(name).map_err(|_| {
            UsageError(format!("{name} is not set: connect-proxy is started by the agent, which sets TETHER_*"))
        })
    };
    let http = match std::env::var(proxy_env::HTTP_ADDR) {
        Ok(address) => Some(address.parse().map_err(|err| {
            UsageError(format!("{}: `{address}` is not an address and port: {err}", proxy_env::HTTP_ADDR))
        })?),
        Err(_) => None,
    };
    Ok(Identity {
        proxy_id: var(proxy_env::PROXY_ID)?,
        token: var(proxy_env::PROXY_TOKEN)?,
        agent: agent_at(PathBuf::from(var(proxy_env::SOCKET)?), http)?,
    })
}

/// The agent's socket, unless this proxy's user may not open it (it is the agent's user's
/// alone) and the agent serves its read endpoints at `http` (`--http-addr`), which carry
/// all that the proxy asks for. Closed with no HTTP address, the proxy could never get its
/// config: that is an error, so that its state shows it rather than a proxy that runs and
/// listens nowhere.
fn agent_at(socket: PathBuf, http: Option<std::net::SocketAddr>) -> Result<AgentAt, UsageError> {
    use nix::unistd::{AccessFlags, access};
    match (access(&socket, AccessFlags::W_OK), http) {
        (Err(nix::errno::Errno::EACCES | nix::errno::Errno::EPERM), Some(address)) => {
            tracing::info!(socket = %socket.display(), %address, "the agent's socket is closed to this user; asking the agent at its HTTP address");
            Ok(AgentAt::Http(address))
        }
        (Err(nix::errno::Errno::EACCES | nix::errno::Errno::EPERM), None) => Err(UsageError(format!(
            "cannot open the agent's socket {}: it is the agent's user's alone; \
             a proxy with another `user` reaches the agent at its --http-addr, which this agent does not serve",
            socket.display()
        ))),
        // Absent, the agent may be starting: asked again on the backoff.
        _ => Ok(AgentAt::Socket(socket)),
    }
}

/// Runs the proxy until SIGINT or SIGTERM.
pub(crate) async fn run() -> anyhow::Result<ExitCode> {
    let identity = Arc::new(identity()?);
    let handed = handed_listener().context("taking the listener the agent handed over")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let stop = CancellationToken::new();
    let (routes, route) = watch::channel(None::<Route>);
    let (security_sender, security) = watch::channel(Security::Unknown);
    let (intentions_sender, intentions) = watch::channel(None::<Arc<tether_state::Intentions>>);
    let (reports, reported) = mpsc::channel(REPORT_BACKLOG);
    let shared = Shared { security, intentions, reports, identity: identity.clone() };
    let mut tasks = JoinSet::new();
    tasks.spawn(follow_config(identity.clone(), routes, handed.is_some(), stop.clone()));
    tasks.spawn(follow_mesh(identity.clone(), route.clone(), security_sender, intentions_sender, stop.clone()));
    tasks.spawn(report(identity.clone(), route.clone(), reported, stop.clone()));
    tasks.spawn(serve_upstreams(route.clone(), shared.clone(), stop.clone()));
    tasks.spawn(serve(route, handed, shared, stop.clone()));
    tokio::select! {
        _ = sigint.recv() => tracing::info!("SIGINT: no longer accepting; finishing the connections in flight"),
        _ = sigterm.recv() => tracing::info!("SIGTERM: no longer accepting; finishing the connections in flight"),
        Some(ended) = tasks.join_next() => {
            stop.cancel();
            ended.context("a proxy task failed")??;
        }
    }
    stop.cancel();
    loop {
        tokio::select! {
            ended = tasks.join_next() => match ended {
                Some(ended) => ended.context("a proxy task failed")??,
                None => break,
            },
            _ = sigint.recv() => break,
            _ = sigterm.recv() => break,
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether the public listener takes mutual TLS.
#[derive(Clone)]
enum Security {
    /// Not known yet: nothing is accepted, so that no connection passes unchecked.
    Unknown,
    /// The agent has no CA: plaintext.
    Plain,
    /// The agent's CA, this proxy's leaf.
    Mesh(Arc<MeshTls>),
}

/// What every connection task reads.
#[derive(Clone)]
struct Shared {
    security: watch::Receiver<Security>,
    /// The intentions that decide who may connect to this service, once known.
    intentions: watch::Receiver<Option<Arc<tether_state::Intentions>>>,
    reports: mpsc::Sender<RefusalDto>,
    identity: Arc<Identity>,
}

impl Shared {
    /// Logs a refused (or closed) connection and hands it to the reporter.
    fn refuse(&self, reason: &'static str, detail: String) {
        tracing::warn!(reason, %detail, "connection refused");
        // A full backlog: the log line above is the only trace.
        let _ = self.reports.try_send(RefusalDto { reason: reason.to_owned(), detail });
    }
}

/// Follows the roots, the service's leaf and the intentions, and publishes the TLS in force.
async fn follow_mesh(
    identity: Arc<Identity>,
    mut route: watch::Receiver<Option<Route>>,
    security: watch::Sender<Security>,
    intentions: watch::Sender<Option<Arc<tether_state::Intentions>>>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    // The service is known from the config's first answer.
    let service_id = tokio::select! {
        () = stop.cancelled() => return Ok(()),
        found = route.wait_for(Option::is_some) => match found {
            Ok(route) => route.as_ref().map(|route| route.service_id.clone()).unwrap_or_default(),
            Err(_) => return Ok(()),
        },
    };
    let roots = watch::channel(None::<Answer<CaRootsDto>>);
    let leaf = watch::channel(None::<Answer<LeafDto>>);
    let (roots_sender, mut roots_receiver) = roots;
    let (leaf_sender, mut leaf_receiver) = leaf;
    let roots_path = "/v1/agent/connect/ca/roots".to_owned();
    let leaf_path = format!("/v1/agent/connect/ca/leaf/{service_id}");
    let intentions_path = format!("/v1/agent/connect/intentions/{service_id}");
    let follow_roots = mesh::follow(
        &identity,
        &roots_path,
        mesh::roots_index,
        |answer| {
            roots_sender.send_replace(Some(answer));
        },
        &stop,
    );
    let follow_leaf = mesh::follow(
        &identity,
        &leaf_path,
        mesh::leaf_index,
        |answer| {
            leaf_sender.send_replace(Some(answer));
        },
        &stop,
    );
    let follow_intentions = mesh::follow(
        &identity,
        &intentions_path,
        mesh::intentions_index,
        |answer: Answer<IntentionsDto>| match answer {
            Answer::Value(answer) => match mesh::intentions_of(&answer) {
                Ok(decided) => {
                    tracing::info!(rules = decided.rules().len(), default = %decided.default_action(), "intentions");
                    intentions.send_replace(Some(Arc::new(decided)));
                }
                Err(problem) => tracing::error!(%problem, "the agent sent intentions this proxy cannot read"),
            },
            Answer::NotEnabled => {
                intentions.send_replace(None);
            }
        },
        &stop,
    );
    let combine = async {
        loop {
            let next = match (&*roots_receiver.borrow_and_update(), &*leaf_receiver.borrow_and_update()) {
                (Some(Answer::NotEnabled), _) | (_, Some(Answer::NotEnabled)) => Some(Security::Plain),
                (Some(Answer::Value(roots)), Some(Answer::Value(leaf))) => match MeshTls::new(roots, leaf) {
                    Ok(tls) => {
                        tracing::info!(serial = %leaf.serial, spiffe_id = %leaf.spiffe_id, roots = roots.roots.len(), "mutual TLS");
                        Some(Security::Mesh(Arc::new(tls)))
                    }
                    Err(problem) => {
                        tracing::error!(%problem, "cannot use the leaf and roots; keeping the previous ones");
                        None
                    }
                },
                _ => None,
            };
            if let Some(next) = next {
                security.send_replace(next);
            }
            tokio::select! {
                changed = roots_receiver.changed() => if changed.is_err() { return },
                changed = leaf_receiver.changed() => if changed.is_err() { return },
            }
        }
    };
    tokio::select! {
        () = follow_roots => {}
        () = follow_leaf => {}
        () = follow_intentions => {}
        () = combine => {}
    }
    Ok(())
}

/// Sends each refusal to the agent, which counts it and tells it as an event.
async fn report(
    identity: Arc<Identity>,
    route: watch::Receiver<Option<Route>>,
    mut reported: mpsc::Receiver<RefusalDto>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    loop {
        let refusal = tokio::select! {
            () = stop.cancelled() => return Ok(()),
            refusal = reported.recv() => match refusal {
                Some(refusal) => refusal,
                None => return Ok(()),
            },
        };
        let AgentAt::Socket(socket) = &identity.agent else {
            // The HTTP address takes no reports: the refusal is only in this proxy's log.
            tracing::info!(reason = refusal.reason, detail = refusal.detail, "connection refused");
            continue;
        };
        let Some(service_id) = route.borrow().as_ref().map(|route| route.service_id.clone()) else { continue };
        let Ok(body) = serde_json::to_vec(&refusal) else { continue };
        let path = format!("/v1/agent/connect/refused/{service_id}");
        let headers = [(TOKEN_HEADER, identity.token.as_str())];
        match client::put_with(socket, &path, &headers, body).await {
            Ok(response) if response.status.is_success() => {}
            Ok(response) => tracing::debug!(status = %response.status, "the agent did not take a refusal report"),
            Err(err) => tracing::debug!(error = %crate::error::error_chain(&err), "cannot report a refusal"),
        }
    }
}

/// Fetches the config and follows it through blocking queries, publishing each route.
async fn follow_config(
    identity: Arc<Identity>,
    routes: watch::Sender<Option<Route>>,
    handed: bool,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let mut index: Option<u64> = None;
    let mut backoff = RETRY_BACKOFF;
    let path_base = format!("/v1/agent/proxy/{}/config", identity.proxy_id);
    while !stop.is_cancelled() {
        let path = match index {
            Some(index) => format!("{path_base}?index={index}&wait={}s", QUERY_WAIT.as_secs()),
            None => path_base.clone(),
        };
        let headers = [(TOKEN_HEADER, identity.token.as_str())];
        let answer = tokio::select! {
            () = stop.cancelled() => return Ok(()),
            answer = client::request_with(&identity.agent, &path, &headers, QUERY_WAIT + Duration::from_secs(30)) => answer,
        };
        let config = match answer {
            Ok(response) if response.status == StatusCode::OK => {
                serde_json::from_slice::<ProxyConfigDto>(&response.body)
                    .map_err(|err| format!("the agent sent a config this proxy cannot read: {err}"))
            }
            Ok(response) => {
                Err(format!("the agent refused the config request: {}: {}", response.status, response.error_message()))
            }
            Err(err) => Err(crate::error::error_chain(&err)),
        };
        match config {
            Ok(config) => {
                backoff.reset();
                index = Some(config.index);
                match Route::from_config(&config, handed) {
                    Ok(route) => {
                        routes.send_if_modified(|current| {
                            let changed = current.as_ref() != Some(&route);
                            if changed {
                                let bind = route.bind.as_deref().unwrap_or("the handed listener");
                                let upstream = route.upstream.as_deref().unwrap_or("nowhere (the service has no port)");
                                tracing::info!(%bind, %upstream, "route");
                                *current = Some(route);
                            }
                            changed
                        });
                    }
                    Err(problem) => {
                        tracing::error!(proxy = %identity.proxy_id, %problem, "config unusable; keeping the previous route")
                    }
                }
            }
            Err(problem) => {
                // The agent may be restarting: keep forwarding, and ask again later.
                let retry = backoff.next();
                tracing::warn!(proxy = %identity.proxy_id, %problem, retry_ms = retry.as_millis(), "cannot get the config");
                tokio::select! {
                    () = stop.cancelled() => return Ok(()),
                    () = tokio::time::sleep(retry) => {}
                }
            }
        }
    }
    Ok(())
}

/// Tells the agent, through systemd's notification protocol, that the proxy is ready and
/// where it listens, if `NOTIFY_SOCKET` names a socket (its readiness check is `notify`).
fn notify_ready(bind: &str) {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let target = target.to_string_lossy();
    let address = match target.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
        None => SocketAddr::from_pathname(target.as_ref()),
    };
    let sent = address.and_then(|address| {
        let socket = UnixDatagram::unbound()?;
        socket.send_to_addr(format!("READY=1\nSTATUS=listening on {bind}").as_bytes(), &address)
    });
    if let Err(error) = sent {
        tracing::warn!(socket = %target, %error, "cannot notify readiness");
    }
}

/// A listener: bound here for the route, or handed over by the agent.
enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// An accepted connection.
enum Client {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Listener {
    async fn accept(&self) -> io::Result<(Client, String)> {
        match self {
            Self::Tcp(listener) => {
                listener.accept().await.map(|(stream, peer)| (Client::Tcp(stream), peer.to_string()))
            }
            Self::Unix(listener) => {
                listener.accept().await.map(|(stream, _)| (Client::Unix(stream), "unix".to_owned()))
            }
        }
    }
}

/// The listener the agent handed over (descriptor 3, when `LISTEN_PID` is this process and
/// `LISTEN_FDS` at least 1), with its address for display.
fn handed_listener() -> anyhow::Result<Option<(Listener, String)>> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let ours = std::env::var("LISTEN_PID").ok().and_then(|pid| pid.parse::<u32>().ok()) == Some(std::process::id());
    let count = std::env::var("LISTEN_FDS").ok().and_then(|n| n.parse::<u32>().ok()).unwrap_or(0);
    if !ours || count == 0 {
        return Ok(None);
    }
    // SAFETY: socket activation hands descriptor 3 to this process, open and owned by
    // nobody else in it; it is taken once, here.
    #[allow(unsafe_code)]
    let fd = unsafe { OwnedFd::from_raw_fd(3) };
    let address = nix::sys::socket::getsockname::<nix::sys::socket::SockaddrStorage>(3)
        .context("descriptor 3 is not a socket")?;
    let listener = if let Some(unix) = address.as_unix_addr() {
        let listener = std::os::unix::net::UnixListener::from(fd);
        listener.set_nonblocking(true)?;
        let shown = unix.path().map_or_else(|| "an unnamed socket".to_owned(), |path| path.display().to_string());
        (Listener::Unix(UnixListener::from_std(listener)?), shown)
    } else {
        let listener = std::net::TcpListener::from(fd);
        listener.set_nonblocking(true)?;
        let shown = listener.local_addr()?.to_string();
        (Listener::Tcp(TcpListener::from_std(listener)?), shown)
    };
    Ok(Some(listener))
}

/// Listens on the route's bind address, or the handed listener, and forwards every
/// connection to the route's upstream: plaintext, or once its client proved an identity
/// that the intentions let through. Once stopped, it accepts no more and waits for the
/// connections in flight.
async fn serve(
    mut route: watch::Receiver<Option<Route>>,
    handed: Option<(Listener, String)>,
    mut shared: Shared,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let mut connections = JoinSet::new();
    let fixed = handed.is_some();
    let mut listener: Option<(String, Listener)> = handed.map(|(listener, shown)| (shown, listener));
    let mut announced = false;
    loop {
        let current = route.borrow_and_update().clone();
        let security = shared.security.borrow_and_update().clone();
        if let Some(wanted) = current.as_ref().and_then(|route| route.bind.as_ref()).filter(|_| !fixed) {
            if listener.as_ref().map(|(bind, _)| bind) != Some(wanted) {
                match TcpListener::bind(wanted).await {
                    Ok(bound) => {
                        tracing::info!(bind = %wanted, "listening");
                        listener = Some((wanted.clone(), Listener::Tcp(bound)));
                    }
                    Err(err) => {
                        tracing::error!(bind = %wanted, error = %err, "cannot listen; keeping the previous listener")
                    }
                }
            }
        }
        let known = !matches!(security, Security::Unknown);
        if let (false, true, Some(_), Some((shown, _))) = (announced, known, &current, &listener) {
            // Ready once it listens with somewhere to forward, and knows whether it takes
            // mutual TLS (readiness `notify = true`).
            notify_ready(shown);
            announced = true;
        }
        let accept = async {
            match (&listener, &current, known) {
                (Some((_, listener)), Some(_), true) => listener.accept().await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            () = stop.cancelled() => break,
            changed = route.changed() => if changed.is_err() { break },
            changed = shared.security.changed() => if changed.is_err() { break },
            accepted = accept => match accepted {
                Ok((client, peer)) => {
                    let Some(current) = current else { continue };
                    match (security, client) {
                        (Security::Mesh(tls), Client::Tcp(client)) => {
                            connections.spawn(inbound(client, peer, current, tls, shared.clone()));
                        }
                        (Security::Mesh(_), Client::Unix(_)) => {
                            tracing::warn!("mutual TLS is served on TCP listeners only; connection closed");
                        }
                        (_, client) => match current.upstream.clone() {
                            Some(upstream) => {
                                connections.spawn(forward(client, peer, upstream));
                            }
                            None => tracing::warn!(%peer, "the service has no port to forward to; connection closed"),
                        },
                    }
                }
                Err(err) => {
                    // Out of descriptors or memory: the listener stays readable, so accepting
                    // again at once would spin. Let established connections end first.
                    tracing::warn!(error = %err, pause_ms = ACCEPT_PAUSE.as_millis(), "accept failed");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    // No more accepts: what waits in a handed listener is the next instance's.
    drop(listener);
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// Connects to the local service.
async fn connect_upstream(peer: &str, upstream: &str) -> Option<TcpStream> {
    let target = match lookup_host(upstream).await.map(|mut addrs| addrs.next()) {
        Ok(Some(target)) => target,
        Ok(None) | Err(_) => {
            tracing::warn!(%peer, %upstream, "cannot resolve the upstream");
            return None;
        }
    };
    match TcpStream::connect(target).await {
        Ok(server) => {
            let _ = server.set_nodelay(true);
            Some(server)
        }
        Err(err) => {
            tracing::warn!(%peer, %upstream, error = %err, "cannot connect to the upstream");
            None
        }
    }
}

async fn forward(client: Client, peer: String, upstream: String) {
    let Some(mut server) = connect_upstream(&peer, &upstream).await else { return };
    let forwarded = match Forwarding::choose(client) {
        Forwarding::Splice { client, up, down } => splice::both_ways(&client, &server, &up, &down).await,
        Forwarding::Copy(Client::Tcp(mut client)) => copy::both_ways(&mut client, &mut server).await,
        Forwarding::Copy(Client::Unix(mut client)) => copy::both_ways(&mut client, &mut server).await,
    };
    if let Err(err) = forwarded {
        tracing::debug!(%peer, error = %err, "connection ended with an error");
    }
}

/// One inbound connection in the mesh: the handshake (a client certificate that chains to
/// the roots), the caller's identity, the intentions; then the bytes, until either end
/// closes or an intention comes to deny the caller.
async fn inbound(client: TcpStream, peer: String, route: Route, tls: Arc<MeshTls>, mut shared: Shared) {
    let _ = client.set_nodelay(true);
    let mut stream = match tls.acceptor.accept(client).await {
        Ok(stream) => stream,
        Err(err) => {
            if let Some((reason, detail)) = mesh::handshake_refusal(&err) {
                shared.refuse(reason, format!("from {peer}: {detail}"));
            }
            return;
        }
    };
    let spiffe = stream.get_ref().1.peer_certificates().and_then(|certs| certs.first()).and_then(mesh::spiffe_of);
    let source = match spiffe.as_deref().map(|id| mesh::service_of(id, &tls.trust_domain)) {
        Some(Ok(source)) => source,
        Some(Err(problem)) => return shared.refuse("bad-identity", format!("from {peer}: {problem}")),
        None => return shared.refuse("bad-identity", format!("from {peer}: the certificate has no SPIFFE id")),
    };
    let Ok(destination) = ServiceName::new(route.service_name.as_str()) else { return };
    let spiffe = spiffe.unwrap_or_default();
    let decide = |intentions: &Option<Arc<tether_state::Intentions>>| match intentions {
        Some(intentions) => mesh::allowed(intentions, &source, &destination),
        None => Err("the intentions are not known yet".to_owned()),
    };
    // The intentions come with the first answers; until then nothing is let through.
    let verdict = {
        let known = tokio::time::timeout(UPSTREAM_CONNECT, shared.intentions.wait_for(Option::is_some)).await;
        match known {
            Ok(Ok(intentions)) => decide(&intentions),
            _ => Err("the intentions are not known yet".to_owned()),
        }
    };
    if let Err(denied) = verdict {
        return shared.refuse("denied", format!("{spiffe} from {peer}: {denied}"));
    }
    let Some(upstream) = route.upstream.as_deref() else {
        return tracing::warn!(%peer, "the service has no port to forward to; connection closed");
    };
    let Some(mut server) = connect_upstream(&peer, upstream).await else { return };
    let forwarded = copy::both_ways(&mut stream, &mut server);
    tokio::pin!(forwarded);
    loop {
        tokio::select! {
            ended = &mut forwarded => {
                if let Err(err) = ended {
                    tracing::debug!(%peer, error = %err, "connection ended with an error");
                }
                return;
            }
            changed = shared.intentions.changed() => {
                if changed.is_err() {
                    // The proxy is stopping: the connection finishes as it is.
                    return drop(forwarded.await);
                }
                let verdict = decide(&shared.intentions.borrow_and_update());
                if let Err(denied) = verdict {
                    // Dropping the streams closes both ends.
                    return shared.refuse("denied", format!("established connection of {spiffe} from {peer} closed: {denied}"));
                }
            }
        }
    }
}

/// Serves a local listener per `config.upstreams` entry, each followed by the instances of
/// its destination; a listener whose entry goes away stops accepting and lets its
/// connections finish.
async fn serve_upstreams(
    mut route: watch::Receiver<Option<Route>>,
    shared: Shared,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let mut running: HashMap<Upstream, CancellationToken> = HashMap::new();
    let mut tasks = JoinSet::new();
    loop {
        let (service_id, wanted) = match &*route.borrow_and_update() {
            Some(route) => (route.service_id.clone(), route.upstreams.clone()),
            None => (String::new(), Vec::new()),
        };
        running.retain(|upstream, token| {
            let keep = wanted.contains(upstream);
            if !keep {
                token.cancel();
            }
            keep
        });
        for upstream in wanted {
            if running.contains_key(&upstream) {
                continue;
            }
            let token = stop.child_token();
            running.insert(upstream.clone(), token.clone());
            tasks.spawn(serve_upstream(upstream, service_id.clone(), shared.clone(), token));
        }
        tokio::select! {
            () = stop.cancelled() => break,
            changed = route.changed() => if changed.is_err() { break },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// One upstream: its listener, the instances of its destination (a blocking query), and a
/// connection out over mutual TLS for each connection in.
async fn serve_upstream(upstream: Upstream, service_id: String, shared: Shared, stop: CancellationToken) {
    let address = std::net::SocketAddr::new(upstream.local_bind_address, upstream.local_bind_port);
    let listener = match TcpListener::bind(address).await {
        Ok(listener) => listener,
        Err(err) => {
            tracing::error!(destination = %upstream.destination_name, %address, error = %err, "cannot listen for the upstream");
            return;
        }
    };
    tracing::info!(destination = %upstream.destination_name, %address, "upstream listening");
    let (instances_sender, instances) = watch::channel(None::<Arc<UpstreamDto>>);
    let path = format!("/v1/agent/connect/upstream/{service_id}/{}", upstream.destination_name);
    let identity = shared.identity.clone();
    let follow = mesh::follow(
        &identity,
        &path,
        |answer: &UpstreamDto| answer.index,
        |answer| {
            let value = match answer {
                Answer::Value(answer) => Some(Arc::new(answer)),
                Answer::NotEnabled => None,
            };
            instances_sender.send_replace(value);
        },
        &stop,
    );
    tokio::pin!(follow);
    let turn = Arc::new(AtomicUsize::new(0));
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            () = &mut follow => break,
            accepted = listener.accept() => match accepted {
                Ok((client, peer)) => {
                    let destination = instances.borrow().clone();
                    let security = shared.security.borrow().clone();
                    connections.spawn(outbound(client, peer.to_string(), destination, security, turn.clone()));
                }
                Err(err) => {
                    tracing::warn!(error = %err, pause_ms = ACCEPT_PAUSE.as_millis(), "accept failed");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// One connection to an upstream: out over mutual TLS to an instance of the destination, the
/// next in turn first, the others after it when one fails.
async fn outbound(
    mut client: TcpStream,
    peer: String,
    destination: Option<Arc<UpstreamDto>>,
    security: Security,
    turn: Arc<AtomicUsize>,
) {
    let _ = client.set_nodelay(true);
    let Security::Mesh(tls) = security else {
        return tracing::warn!(%peer, "the agent has no CA: an upstream has no mutual TLS to speak; connection closed");
    };
    let Some(destination) = destination.filter(|destination| !destination.instances.is_empty()) else {
        return tracing::warn!(%peer, "the upstream's destination has no ready instance; connection closed");
    };
    let config = match tls.client(&destination.spiffe_id) {
        Ok(config) => config,
        Err(problem) => return tracing::error!(%problem, "cannot make the upstream's TLS config"),
    };
    let connector = tokio_rustls::TlsConnector::from(config);
    let count = destination.instances.len();
    let first = turn.fetch_add(1, Ordering::Relaxed) % count;
    for offset in 0..count {
        let instance = &destination.instances[(first + offset) % count];
        let target = format!("{}:{}", instance.address, instance.port);
        let attempt = async {
            let server = TcpStream::connect(target.as_str()).await.map_err(|err| err.to_string())?;
            let _ = server.set_nodelay(true);
            // The name is not checked (the verifier checks the SPIFFE id); an IP address
            // sends no SNI.
            let name =
                rustls_pki_types::ServerName::IpAddress(server.peer_addr().map_err(|err| err.to_string())?.ip().into());
            connector.connect(name, server).await.map_err(|err| err.to_string())
        };
        match tokio::time::timeout(UPSTREAM_CONNECT, attempt).await {
            Ok(Ok(mut server)) => {
                if let Err(err) = copy::both_ways(&mut client, &mut server).await {
                    tracing::debug!(%peer, error = %err, "upstream connection ended with an error");
                }
                return;
            }
            Ok(Err(problem)) => {
                tracing::warn!(%peer, instance = %instance.service_id, %target, %problem, "upstream instance failed; trying the next")
            }
            Err(_) => {
                tracing::warn!(%peer, instance = %instance.service_id, %target, "upstream instance timed out; trying the next")
            }
        }
    }
    tracing::warn!(%peer, destination = %destination.destination, "no instance of the upstream's destination answered; connection closed");
}

/// How the bytes of one connection cross this process: the one choice between the two
/// ways, made once per connection.
///
/// Splicing needs a socket at each end whose bytes this process does not have to see; any
/// end that must be read here (a Unix client, a TLS session) takes the copy.
enum Forwarding {
    /// TCP to TCP, through a pipe per direction (`up`: client to server).
    Splice { client: TcpStream, up: splice::Pipe, down: splice::Pipe },
    /// Through a buffer of this process per direction.
    Copy(Client),
}

impl Forwarding {
    fn choose(client: Client) -> Self {
        let Client::Tcp(client) = client else { return Self::Copy(client) };
        let _ = client.set_nodelay(true);
        match (splice::Pipe::new(), splice::Pipe::new()) {
            (Ok(up), Ok(down)) => Self::Splice { client, up, down },
            (Err(err), _) | (_, Err(err)) => {
                // Out of file descriptors for pipes: copy through this process instead.
                tracing::debug!(error = %err, "no pipe for splicing; copying");
                Self::Copy(Client::Tcp(client))
            }
        }
    }
}

/// Forwarding through this process's memory: each direction reads into a buffer and writes
/// it out. The way for ends whose bytes must be seen here.
mod copy {
    use std::io;

    use tokio::io::{AsyncRead, AsyncWrite};

    /// Forwards `client` to `server` and back until both directions have ended, passing a
    /// half-close on.
    pub(super) async fn both_ways<A, B>(client: &mut A, server: &mut B) -> io::Result<()>
    where
        A: AsyncRead + AsyncWrite + Unpin + ?Sized,
        B: AsyncRead + AsyncWrite + Unpin + ?Sized,
    {
        tokio::io::copy_bidirectional_with_sizes(client, server, super::COPY_BUFFER, super::COPY_BUFFER).await.map(drop)
    }
}

/// Zero-copy forwarding: each direction moves pages from one socket into a pipe and from
/// the pipe into the other socket with `splice(2)`, so that the bytes never enter this
/// process. On loopback this halves the proxy's CPU per byte against copying through a
/// buffer, and the CPU it saves is left to the two ends of the connection.
mod splice {
    use std::io;
    use std::os::fd::{AsFd, OwnedFd};

    use nix::fcntl::{FcntlArg, OFlag, SpliceFFlags, fcntl};
    use nix::sys::socket::{Shutdown, setsockopt, shutdown, sockopt};
    use tokio::io::Interest;
    use tokio::net::TcpStream;

    /// A pipe that holds the bytes of one direction between the two splices.
    pub(super) struct Pipe {
        read: OwnedFd,
        write: OwnedFd,
        capacity: usize,
    }

    impl Pipe {
        pub(super) fn new() -> io::Result<Self> {
            let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)?;
            let wanted = i32::try_from(super::SPLICE_PIPE).unwrap_or(i32::MAX);
            // Refused beyond the user's pipe quota: the pipe keeps the size it has.
            let _ = fcntl(&write, FcntlArg::F_SETPIPE_SZ(wanted));
            let capacity = fcntl(&write, FcntlArg::F_GETPIPE_SZ)?;
            Ok(Self { read, write, capacity: usize::try_from(capacity).unwrap_or(4096).max(4096) })
        }
    }

    /// Forwards `client` to `server` and back until both directions have ended.
    ///
    /// A direction that fails (a peer reset its connection) ends both: the other end is
    /// reset too, rather than closed in order, so that it does not take a truncated stream
    /// for a whole one.
    pub(super) async fn both_ways(client: &TcpStream, server: &TcpStream, up: &Pipe, down: &Pipe) -> io::Result<()> {
        let forwarded = tokio::try_join!(one_way(client, server, up), one_way(server, client, down)).map(drop);
        if forwarded.is_err() {
            for end in [client, server] {
                // A zero linger makes the close that follows a reset.
                let _ = setsockopt(end, sockopt::Linger, &libc::linger { l_onoff: 1, l_linger: 0 });
            }
        }
        forwarded
    }

    /// Moves bytes from `from` to `to` through `pipe` until `from` ends, then ends `to`'s
    /// writing side, as the peer did.
    async fn one_way(from: &TcpStream, to: &TcpStream, pipe: &Pipe) -> io::Result<()> {
        let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
        let mut in_pipe = 0;
        loop {
            if in_pipe == 0 {
                // The pipe is empty, so a refusal can only mean that `from` has nothing yet.
                let read = from
                    .async_io(Interest::READABLE, || {
                        Ok(nix::fcntl::splice(from.as_fd(), None, &pipe.write, None, pipe.capacity, flags)?)
                    })
                    .await?;
                if read == 0 {
                    break;
                }
                in_pipe = read;
            }
            // The pipe holds bytes, so a refusal can only mean that `to` is full.
            let written = to
                .async_io(Interest::WRITABLE, || {
                    Ok(nix::fcntl::splice(&pipe.read, None, to.as_fd(), None, in_pipe, flags)?)
                })
                .await?;
            in_pipe -= written;
        }
        match shutdown(std::os::fd::AsRawFd::as_raw_fd(to), Shutdown::Write) {
            // The peer may have closed already: nothing is left to end.
            Ok(()) | Err(nix::errno::Errno::ENOTCONN) => Ok(()),
            Err(err) => Err(err.into()),
        }
    }
}
