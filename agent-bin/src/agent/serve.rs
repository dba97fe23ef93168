//! Serves the control API on a listener, within the agent's share of descriptors for it.
//!
//! Every connection holds a descriptor, and the agent needs descriptors of its own to
//! supervise proxies (pidfds, log files, the pipes of a spawn). So each listener may hold
//! only so many connections at once, a fixed share of `RLIMIT_NOFILE` (`ConnectionCaps`),
//! and a connection over its listener's cap is accepted and closed at once. Every
//! connection then has `HEADER_TIMEOUT` to send a request head, counted from when it
//! connects or from the end of its previous answer, so that a silent or a slow client gives
//! its slot back; a request that is being answered (a blocking query may wait minutes) is
//! never cut.
//!
//! This module owns the accept loops and the connections' tasks; it never parses HTTP
//! (hyper does) and never decides what a request means (the routers of `api` do).

use std::future::Future;
use std::io;
use std::time::{Duration, Instant};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How long a connection may take to send a whole request head, counted from when it
/// connects or finishes its previous answer: an idle keep-alive connection is closed after
/// this long too.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long an accept loop pauses after a failure that is not the client's (no descriptor
/// left, no memory): accepting again at once would spin until something closes.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// How often at most an accept loop warns about the connections it closes or fails to
/// accept, so that a flood of connections does not become a flood of log lines.
const WARN_INTERVAL: Duration = Duration::from_secs(10);

/// The most connections the TCP address holds at once: it serves a browser, a scraper and
/// proxies that prefer TCP, and any local user can connect to it.
const TCP_CAP: usize = 256;

/// The most connections the socket holds at once: every built-in proxy keeps one open (its
/// blocking query), and only the agent's user can connect to it.
const UNIX_CAP: usize = 16_384;

/// How many connections each listener may hold at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConnectionCaps {
    pub(crate) unix: usize,
    pub(crate) tcp: usize,
}

impl ConnectionCaps {
    /// The caps for a process that may open `nofile` descriptors: at most a quarter of them
    /// for the socket and an eighth for the TCP address, so that five eighths always stay
    /// with supervision and the agent's own files.
    pub(crate) fn for_limit(nofile: u64) -> Self {
        let nofile = usize::try_from(nofile).unwrap_or(usize::MAX);
        Self { unix: (nofile / 4).clamp(1, UNIX_CAP), tcp: (nofile / 8).clamp(1, TCP_CAP) }
    }

    /// How many of a listener's `cap` connections may hold an answer that stays open (an
    /// event stream, a log follow, a blocking query): all but a quarter, and at least one
    /// less, so that the reads that answer at once always find a connection.
    pub(crate) fn streams(cap: usize) -> usize {
        cap - (cap / 4).clamp(1.min(cap), cap)
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, and returns the soft limit in force.
///
/// Proxies inherit the raised limit.
pub(crate) fn raise_descriptor_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(limits) => limits,
        Err(errno) => {
            // Every Linux has this limit; if it cannot be read, assume the usual default.
            tracing::warn!(error = %errno, "cannot read the descriptor limit; assuming 1024");
            return 1024;
        }
    };
    if soft >= hard {
        return soft;
    }
    match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
        Ok(()) => hard,
        Err(errno) => {
            tracing::warn!(error = %errno, soft, hard, "cannot raise the descriptor limit");
            soft
        }
    }
}

/// A listener the API can be served on.
pub(crate) trait Accept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;

    /// Accepts the next connection.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as tokio's `accept`: a dropped call loses no connection.
    fn accept(&self) -> impl Future<Output = io::Result<Self::Io>> + Send;
}

impl Accept for TcpListener {
    type Io = TcpStream;

    async fn accept(&self) -> io::Result<TcpStream> {
        TcpListener::accept(self).await.map(|(stream, _)| stream)
    }
}

impl Accept for UnixListener {
    type Io = UnixStream;

    async fn accept(&self) -> io::Result<UnixStream> {
        UnixListener::accept(self).await.map(|(stream, _)| stream)
    }
}

/// Serves `router` on `listener` until `stop` is cancelled, with at most `cap` connections
/// open at once. Then it stops accepting, lets every open connection finish the answer it
/// is writing, and returns once they are all closed; the caller bounds that wait.
pub(crate) async fn serve<L: Accept>(
    listener: L,
    router: Router,
    name: &'static str,
    cap: usize,
    stop: CancellationToken,
) {
    let mut connections = JoinSet::new();
    let mut over_cap = Throttled::default();
    let mut failed = Throttled::default();
    loop {
        // Every branch is cancel-safe: `cancelled`, `join_next` and `accept` lose nothing.
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            Some(ended) = connections.join_next() => {
                log_panic(name, ended);
                continue;
            }
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok(stream) => {
                while let Some(ended) = connections.try_join_next() {
                    log_panic(name, ended);
                }
                if connections.len() >= cap {
                    // Closing at once, rather than leaving it in the backlog, tells the
                    // client now, and keeps the backlog free for when a slot opens.
                    drop(stream);
                    if let Some(closed) = over_cap.note() {
                        tracing::warn!(listener = name, cap, closed, "connection cap reached; closing new connections");
                    }
                    continue;
                }
                connections.spawn(serve_connection(stream, router.clone(), stop.clone()));
            }
            // The client gave up before we took its connection: nothing to do.
            Err(err)
                if matches!(
                    err.kind(),
                    io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::Interrupted
                ) => {}
            Err(err) => {
                // EMFILE, ENFILE, ENOBUFS, ENOMEM: the connection waits in the backlog until
                // something is freed; pause instead of failing the same way in a loop.
                if let Some(failures) = failed.note() {
                    tracing::warn!(listener = name, error = %err, failures, "cannot accept connections; pausing");
                }
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(ACCEPT_PAUSE) => {}
                }
            }
        }
    }
    drop(listener);
    while let Some(ended) = connections.join_next().await {
        log_panic(name, ended);
    }
}

/// Serves one connection until the client closes it, it times out, or `stop` asks it to
/// finish its current answer and close.
async fn serve_connection<Io>(stream: Io, router: Router, stop: CancellationToken)
where
    Io: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut http = http1::Builder::new();
    // hyper starts this timer whenever it waits for a request head: at the start and after
    // each answer. It is not running while a request is being answered.
    http.timer(TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT);
    let connection = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router));
    tokio::pin!(connection);
    let served = tokio::select! {
        served = connection.as_mut() => served,
        () = stop.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(err) = served {
        // A client that hung up or timed out: routine, and one per connection.
        tracing::debug!(error = %err, "connection closed with an error");
    }
}

fn log_panic(listener: &'static str, ended: Result<(), tokio::task::JoinError>) {
    if let Err(err) = ended {
        if err.is_panic() {
            tracing::error!(listener, error = %err, "a connection's task panicked");
        }
    }
}

/// Counts events and says when to log them: at the first, then at most once per
/// [`WARN_INTERVAL`], with how many happened since the last line.
#[derive(Default)]
struct Throttled {
    count: u64,
    last: Option<Instant>,
}

impl Throttled {
    /// Counts one event; returns the count to log, if a line is due.
    fn note(&mut self) -> Option<u64> {
        self.count += 1;
        let now = Instant::now();
        if self.last.is_some_and(|last| now.duration_since(last) < WARN_INTERVAL) {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.count))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_leave_most_descriptors_to_supervision() {
        for nofile in [8, 64, 256, 1024, 4096, 20_000, 65_536, 524_288, 1 << 30, u64::MAX] {
            let caps = ConnectionCaps::for_limit(nofile);
            let listeners = u64::try_from(caps.unix + caps.tcp).unwrap();
            assert!(listeners <= nofile.saturating_mul(3) / 8, "{nofile}: {caps:?}");
            assert!(caps.tcp <= TCP_CAP && caps.unix <= UNIX_CAP, "{nofile}: {caps:?}");
        }
        assert_eq!(ConnectionCaps::for_limit(1024), ConnectionCaps { unix: 256, tcp: 128 });
        assert_eq!(ConnectionCaps::for_limit(65_536), ConnectionCaps { unix: 16_384, tcp: 256 });
    }

    #[test]
    fn streams_always_leave_connections_to_the_reads_that_answer_at_once() {
        for cap in [0, 1, 2, 3, 16, 255, 256, 16_384] {
            let streams = ConnectionCaps::streams(cap);
            assert!(streams < cap || cap == 0, "{cap}: {streams}");
        }
        assert_eq!(ConnectionCaps::streams(16), 12);
        assert_eq!(ConnectionCaps::streams(256), 192);
        assert_eq!(ConnectionCaps::streams(16_384), 12_288);
    }

    #[test]
    fn a_burst_of_events_is_logged_once_with_its_count() {
        let mut throttled = Throttled::default();
        assert_eq!(throttled.note(), Some(1));
        assert_eq!((0..1000).filter_map(|_| throttled.note()).count(), 0);
        throttled.last = throttled.last.and_then(|last| last.checked_sub(WARN_INTERVAL));
        assert_eq!(throttled.note(), Some(1001));
    }
}
