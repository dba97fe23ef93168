//! `tether connect-proxy`: the built-in TCP proxy, normally started by the agent.
//!
//! It reads its identity from `TETHER_*`, fetches its config from the agent and follows
//! changes through blocking queries: a new bind address gets a new listener (the old one
//! closes; established connections keep flowing), a new upstream applies to new
//! connections. It keeps forwarding while the agent is away, and reconnects with backoff.
//!
//! Handed a listener by the agent (socket activation: `LISTEN_FDS`, `LISTEN_PID`), it
//! serves that one, TCP or Unix, instead of binding. On SIGINT or SIGTERM it stops
//! accepting and lets the connections in flight finish (a second signal ends them): the
//! next instance accepts what waits in the agent's listener meanwhile.

use std::io;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use tether_state::proxy_env;

use anyhow::Context;
use hyper::StatusCode;
use tether_state::Backoff;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream, lookup_host};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::api::dto::{ProxyConfigDto, TOKEN_HEADER};
use crate::client;
use crate::error::UsageError;

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

/// Where to listen and where to forward, from the proxy's config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Route {
    /// Where to listen; `None` when the agent handed a listener over.
    pub(crate) bind: Option<String>,
    pub(crate) upstream: String,
}

impl Route {
    /// The route a config describes: `bind_address` (default 127.0.0.1) and `bind_port`
    /// (required unless `handed` a listener); `local_service_address` or else the
    /// service's address and port.
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
            Some(address) => address.to_owned(),
            None => {
                let port =
                    config.service.port.ok_or("the service has no port: set it, or config.local_service_address")?;
                join_host_port(&config.service.address, port)
            }
        };
        Ok(Self { bind, upstream })
    }
}

fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

struct Identity {
    proxy_id: String,
    token: String,
    socket: PathBuf,
}

fn identity() -> Result<Identity, UsageError> {
    let var = |name: &str| {
        std::env::var(name).map_err(|_| {
            UsageError(format!("{name} is not set: connect-proxy is started by the agent, which sets TETHER_*"))
        })
    };
    Ok(Identity {
        proxy_id: var(proxy_env::PROXY_ID)?,
        token: var(proxy_env::PROXY_TOKEN)?,
        socket: var(proxy_env::SOCKET)?.into(),
    })
}

/// Runs the proxy until SIGINT or SIGTERM.
pub(crate) async fn run() -> anyhow::Result<ExitCode> {
    let identity = identity()?;
    let handed = handed_listener().context("taking the listener the agent handed over")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let stop = CancellationToken::new();
    let (routes, route) = watch::channel(None::<Route>);
    let mut tasks = JoinSet::new();
    tasks.spawn(follow_config(identity, routes, handed.is_some(), stop.clone()));
    tasks.spawn(serve(route, handed, stop.clone()));
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

/// Fetches the config and follows it through blocking queries, publishing each route.
async fn follow_config(
    identity: Identity,
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
            answer = client::request_with(&identity.socket, &path, &headers, QUERY_WAIT + Duration::from_secs(30)) => answer,
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
                                tracing::info!(%bind, upstream = %route.upstream, "route");
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
/// connection to the route's upstream. Once stopped, it accepts no more and waits for the
/// connections in flight.
async fn serve(
    mut route: watch::Receiver<Option<Route>>,
    handed: Option<(Listener, String)>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let mut connections = JoinSet::new();
    let fixed = handed.is_some();
    let mut listener: Option<(String, Listener)> = handed.map(|(listener, shown)| (shown, listener));
    let mut announced = false;
    loop {
        let current = route.borrow_and_update().clone();
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
        if let (false, Some(_), Some((shown, _))) = (announced, &current, &listener) {
            // Ready once it listens with somewhere to forward (readiness `notify = true`).
            notify_ready(shown);
            announced = true;
        }
        let accept = async {
            match (&listener, &current) {
                (Some((_, listener)), Some(_)) => listener.accept().await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            () = stop.cancelled() => break,
            changed = route.changed() => if changed.is_err() { break },
            accepted = accept => match accepted {
                Ok((client, peer)) => {
                    let upstream = current.as_ref().map(|r| r.upstream.clone()).unwrap_or_default();
                    connections.spawn(forward(client, peer, upstream));
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

async fn forward(client: Client, peer: String, upstream: String) {
    let target = match lookup_host(&upstream).await.map(|mut addrs| addrs.next()) {
        Ok(Some(target)) => target,
        Ok(None) | Err(_) => {
            tracing::warn!(%peer, %upstream, "cannot resolve the upstream");
            return;
        }
    };
    let mut server = match TcpStream::connect(target).await {
        Ok(server) => server,
        Err(err) => {
            tracing::warn!(%peer, %upstream, error = %err, "cannot connect to the upstream");
            return;
        }
    };
    let _ = server.set_nodelay(true);
    let forwarded = match Forwarding::choose(client) {
        Forwarding::Splice { client, up, down } => splice::both_ways(&client, &server, &up, &down).await,
        Forwarding::Copy(Client::Tcp(mut client)) => copy::both_ways(&mut client, &mut server).await,
        Forwarding::Copy(Client::Unix(mut client)) => copy::both_ways(&mut client, &mut server).await,
    };
    if let Err(err) = forwarded {
        tracing::debug!(%peer, error = %err, "connection ended with an error");
    }
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
