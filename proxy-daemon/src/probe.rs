//! Running one health probe against an instance: `tcp` (a connect), `http` (a plain-HTTP
//! `GET` that answers 2xx) and `exec` (a program that exits 0), each bounded by its timeout.
//!
//! This module owns probe I/O and nothing else: when to probe, and what a result means for
//! the process, is `supervisor/checks.rs`'s. An `exec` probe starts through the one spawn
//! path, like the proxy, and leaves nothing running however it ends: a probe that outlives
//! its timeout, or whose future is dropped, has its process group killed.

use std::ffi::OsString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nix::sys::signal::Signal;
use tether_state::{CommandLine, HttpTarget, Probe, TcpTarget};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::proc::{self, Pidfd};
use crate::spawn::{self, Spawned};
use crate::spec::ProcessSpec;

/// The upper bounds, in seconds, of the buckets of [`ProbeDurations`].
pub const PROBE_BUCKETS: [f64; 8] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0];

/// How long the probes the supervisor ran took, as a histogram: counts per bucket of
/// [`PROBE_BUCKETS`] (and one past the last), their sum and their count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProbeDurations {
    /// Probes per bucket, not cumulative; the last counts those over the last bound.
    pub buckets: [u64; PROBE_BUCKETS.len() + 1],
    /// Their total duration, in seconds.
    pub sum_seconds: f64,
    /// How many ran.
    pub count: u64,
}

/// The supervisor's probe-duration histogram, updated without a lock.
#[derive(Debug, Default)]
pub(crate) struct ProbeStats {
    buckets: [AtomicU64; PROBE_BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
}

impl ProbeStats {
    pub(crate) fn record(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        let bucket = PROBE_BUCKETS.iter().position(|bound| seconds <= *bound).unwrap_or(PROBE_BUCKETS.len());
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> ProbeDurations {
        let buckets = std::array::from_fn(|index| self.buckets[index].load(Ordering::Relaxed));
        ProbeDurations {
            count: buckets.iter().sum(),
            buckets,
            sum_seconds: Duration::from_nanos(self.sum_nanos.load(Ordering::Relaxed)).as_secs_f64(),
        }
    }
}

/// How a probe went: `Err` says what it saw, for the proxy's `error`.
pub(crate) type Outcome = Result<(), String>;

/// Runs `probe` once against the instance of `spec`, within `timeout`.
///
/// `notify`, `log_line` and `fd` are not probed here: they are told by the instance itself.
pub(crate) async fn run(probe: &Probe, timeout: Duration, spec: &ProcessSpec) -> Outcome {
    let probing = async {
        match probe {
            Probe::Tcp(target) => tcp(target).await,
            Probe::Http(target) => http(target).await,
            Probe::Exec(command) => exec(command, spec).await,
            other => Err(format!("a {} probe is not run by the agent", other.kind())),
        }
    };
    match tokio::time::timeout(timeout, probing).await {
        Ok(outcome) => outcome,
        Err(_elapsed) => Err(format!("no answer within {}", humantime::format_duration(timeout))),
    }
}

async fn tcp(target: &TcpTarget) -> Outcome {
    if let Ok(address) = target.as_str().parse::<std::net::SocketAddr>() {
        return tcp_to(address).await.map_err(|err| format!("connect: {err}"));
    }
    let stream = connect(target).await?;
    // Reset rather than close: no FIN exchange and no TIME_WAIT per probe, which is most of
    // a probe's cost on loopback; the peer sees a connection that went away.
    let _best_effort = socket_linger_zero(&stream);
    Ok(())
}

/// A `tcp` probe of a literal address, at the cost of a blocking connect when the peer
/// answers at once (loopback, nearly always): the socket meets the runtime's poller only
/// when the handshake is still under way after the `connect` call, which saves registering
/// and deregistering it and a wake-up of the runtime per probe.
async fn tcp_to(address: std::net::SocketAddr) -> std::io::Result<()> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrStorage, connect, getsockopt, setsockopt, socket, sockopt,
    };
    use std::os::fd::AsFd;

    let family = if address.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let socket = socket(family, SockType::Stream, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)?;
    // Reset rather than close: no FIN exchange and no TIME_WAIT per probe, which is most of
    // a probe's cost on loopback; the peer sees a connection that went away.
    let _best_effort = setsockopt(&socket, sockopt::Linger, &nix::libc::linger { l_onoff: 1, l_linger: 0 });
    match connect(std::os::fd::AsRawFd::as_raw_fd(&socket), &SockaddrStorage::from(address)) {
        Ok(()) => return Ok(()),
        Err(nix::errno::Errno::EINPROGRESS) => {}
        Err(errno) => return Err(errno.into()),
    }
    let connected = |socket: &std::os::fd::OwnedFd| match getsockopt(socket, sockopt::SocketError)? {
        0 => Ok(()),
        code => Err(std::io::Error::from_raw_os_error(code)),
    };
    let mut done = [PollFd::new(socket.as_fd(), PollFlags::POLLOUT)];
    if poll(&mut done, PollTimeout::ZERO)? > 0 {
        return connected(&socket);
    }
    #[allow(unsafe_code)]
    // SAFETY: the `AsyncFd` owns the `OwnedFd`, so the fd stays open and refers to the same
    // socket until the `AsyncFd` is dropped, and `as_raw_fd` always returns it.
    let pending = unsafe { tokio::io::unix::AsyncFd::register_with_interest(socket, tokio::io::Interest::WRITABLE) }?;
    let _ready = pending.writable().await?;
    connected(pending.get_ref())
}

fn socket_linger_zero(stream: &TcpStream) -> std::io::Result<()> {
    nix::sys::socket::setsockopt(
        stream,
        nix::sys::socket::sockopt::Linger,
        &nix::libc::linger { l_onoff: 1, l_linger: 0 },
    )
    .map_err(std::io::Error::from)
}

/// Connects to `target`: an IP address at once, a name after its lookup (which runs on a
/// blocking thread, so the common case of a literal address skips it).
async fn connect(target: &TcpTarget) -> Result<TcpStream, String> {
    let connected = match target.as_str().parse::<std::net::SocketAddr>() {
        Ok(address) => TcpStream::connect(address).await,
        Err(_) => TcpStream::connect(target.as_str()).await,
    };
    connected.map_err(|err| format!("connect: {err}"))
}

/// The longest status line read: `HTTP/1.1 200 OK` and a generous reason phrase.
const MAX_STATUS_LINE: usize = 256;

/// A `GET` over HTTP/1.1 with `Connection: close`; 2xx passes. Only the status line is read:
/// a probe needs no HTTP client, and a full one in the supervisor would cost more than the
/// probe.
async fn http(target: &HttpTarget) -> Outcome {
    let mut stream = connect(target.authority()).await?;
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: tether-probe\r\nAccept: */*\r\nConnection: close\r\n\r\n",
        target.path(),
        target.authority()
    );
    stream.write_all(request.as_bytes()).await.map_err(|err| format!("send: {err}"))?;
    let mut head = Vec::with_capacity(64);
    let mut buffer = [0_u8; 128];
    while !head.contains(&b'\n') && head.len() < MAX_STATUS_LINE {
        let read = stream.read(&mut buffer).await.map_err(|err| format!("receive: {err}"))?;
        if read == 0 {
            break;
        }
        head.extend_from_slice(&buffer[..read]);
    }
    let line = String::from_utf8_lossy(&head);
    let line = line.lines().next().unwrap_or_default();
    let mut words = line.split(' ');
    let status = match (words.next(), words.next()) {
        (Some(version), Some(code)) if version.starts_with("HTTP/1.") && code.len() == 3 => code.parse::<u16>().ok(),
        _ => None,
    };
    match status {
        Some(200..=299) => Ok(()),
        Some(code) => Err(format!("HTTP status {code}")),
        None => Err(format!("not an HTTP answer: {:?}", line.chars().take(64).collect::<String>())),
    }
}

/// The probe's process: killed with its group, and reaped, however the probe ends.
struct ProbeProcess {
    spawned: Option<Spawned>,
}

impl Drop for ProbeProcess {
    fn drop(&mut self) {
        let Some(Spawned { mut child, pid, pidfd, .. }) = self.spawned.take() else { return };
        // Not reaped yet, so the group id is still this process's.
        let _gone = proc::signal_group(pid, Signal::SIGKILL);
        reap_later(child.try_wait().ok().flatten().is_none().then_some((child, pidfd)));
    }
}

/// Reaps a killed probe once its pidfd says it exited, off the caller's path.
fn reap_later(pending: Option<(spawn::Child, Pidfd)>) {
    let Some((mut child, pidfd)) = pending else { return };
    tokio::spawn(async move {
        if pidfd.exited().await.is_ok() {
            let _status = child.try_wait();
        }
    });
}

async fn exec(command: &CommandLine, spec: &ProcessSpec) -> Outcome {
    let mut probe = spec.clone();
    probe.program = command.program().to_owned();
    probe.args = command.args().iter().map(OsString::from).collect();
    // The token proves a process to be an instance of the proxy: a probe does not get it,
    // so that a probe's process is never taken for an instance.
    probe.env.retain(|(key, _)| key != tether_state::proxy_env::PROXY_TOKEN);
    // Nor its listeners: a probe that held them would keep them open, and would look like
    // an instance that serves to an agent that finds it after a crash.
    probe.listeners = Vec::new();
    let slot = spawn::slot().await;
    let spawned = spawn::spawn(&probe, None, &slot)
        .await
        .map_err(|err| format!("cannot start: {}", tether_state::error_chain(&err)))?;
    drop(slot);
    let mut process = ProbeProcess { spawned: Some(spawned) };
    let exited = match &process.spawned {
        Some(spawned) => spawned.pidfd.exited().await,
        None => return Err("the probe vanished".to_owned()),
    };
    exited.map_err(|err| format!("cannot watch the probe: {err}"))?;
    let Some(Spawned { mut child, pid, .. }) = process.spawned.take() else {
        return Err("the probe vanished".to_owned());
    };
    // Whatever it left in its group goes with it.
    let _empty = proc::signal_group(pid, Signal::SIGKILL);
    match child.try_wait() {
        Ok(Some(status)) if status.success() => Ok(()),
        Ok(Some(status)) => match tether_state::ExitReason::from_status(status) {
            Some(reason) => Err(reason.to_string()),
            None => Err(format!("ended with {status}")),
        },
        Ok(None) => Err("cannot read the probe's exit status".to_owned()),
        Err(err) => Err(format!("cannot reap the probe: {err}")),
    }
}

#[cfg(test)]
mod tests {
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::time::Duration;

    use super::tcp_to;

    #[tokio::test]
    async fn a_tcp_probe_passes_on_a_listener_and_fails_on_a_closed_port_with_the_reason() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let open = listener.local_addr().unwrap();
        tcp_to(open).await.unwrap();
        listener.set_nonblocking(false).unwrap();
        assert!(listener.accept().is_ok(), "the listener saw the probe's connection");
        drop(listener);
        let refused = tcp_to(open).await.unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused, "{refused}");
        assert!(refused.to_string().starts_with("Connection refused"), "{refused}");
    }

    #[tokio::test]
    async fn a_handshake_still_under_way_is_awaited_not_taken_for_success() {
        // A listener whose accept queue is full drops further handshakes: a probe's connect
        // stays in progress, and waiting for it goes through the runtime.
        let socket = nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Inet,
            nix::sys::socket::SockType::Stream,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        nix::sys::socket::bind(std::os::fd::AsRawFd::as_raw_fd(&socket), &nix::sys::socket::SockaddrStorage::from(any))
            .unwrap();
        nix::sys::socket::listen(&socket, nix::sys::socket::Backlog::new(0).unwrap()).unwrap();
        let listener = TcpListener::from(socket);
        let address = listener.local_addr().unwrap();
        let mut queued = Vec::new();
        while let Ok(stream) = TcpStream::connect_timeout(&address, Duration::from_millis(200)) {
            queued.push(stream);
            assert!(queued.len() < 64, "the accept queue never filled");
        }
        let waited = tokio::time::timeout(Duration::from_millis(300), tcp_to(address)).await;
        assert!(waited.is_err(), "a connect with no answer is not a pass: {waited:?}");
        // Room again: the next handshake completes and the probe passes.
        drop(queued);
        listener.set_nonblocking(true).unwrap();
        while listener.accept().is_ok() {}
        tokio::time::timeout(Duration::from_secs(10), tcp_to(address)).await.expect("answered").unwrap();
    }
}
