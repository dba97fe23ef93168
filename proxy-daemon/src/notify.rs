//! systemd's notification protocol (`sd_notify`), received for every supervised process on
//! one datagram socket of the supervisor: `READY=1`, `STATUS=…`, `WATCHDOG=1` and
//! `WATCHDOG=trigger` reach the instance they come from, proven by the sender's pid.
//!
//! This module owns that socket and the routing of its datagrams; what a notice means is
//! `supervisor/checks.rs`'s. The socket is bound on first use (a supervisor whose processes
//! never notify holds none), in the abstract namespace, so that no file is involved and a
//! name stays reachable across a restart of the supervising side. The kernel stamps each
//! datagram with its sender's pid (`SO_PASSCRED`): a datagram from a process outside the
//! group of a registered instance is ignored and counted, never routed.

use std::collections::HashMap;
use std::io::{self, IoSliceMut};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::sys::socket::{self, ControlMessageOwned, MsgFlags, sockopt};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use crate::proc;

/// What an instance said about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Notice {
    /// `READY=1`.
    Ready,
    /// `STATUS=text`.
    Status(String),
    /// `WATCHDOG=1`.
    Watchdog,
    /// `WATCHDOG=trigger`: it asks to be treated as failed.
    WatchdogTrigger,
    /// `RELOADING=1`: it began to reload its configuration, at `MONOTONIC_USEC` (its
    /// `CLOCK_MONOTONIC`, in microseconds) when the same datagram says when.
    Reloading(Option<u64>),
}

/// The largest datagram read; systemd's own limit for a notification is this size.
const MAX_DATAGRAM: usize = 4096;

/// The supervisor's notification socket and its routes, by process group.
#[derive(Debug)]
pub(crate) struct NotifyHub {
    /// `@name`: the socket's abstract address, as `NOTIFY_SOCKET` names it.
    address: String,
    state: Mutex<HubState>,
    foreign: AtomicU64,
}

#[derive(Debug, Default)]
struct HubState {
    /// Set once the socket is bound and its reader runs.
    bound: bool,
    routes: HashMap<u32, mpsc::UnboundedSender<Notice>>,
    /// Notices of a group of this process's children that has no route yet: an instance
    /// can notify between its spawn and its registration. Kept for [`PENDING_FOR`].
    pending: Vec<(u32, Instant, Notice)>,
    /// Besides this process, the processes whose children the supervised instances are: its
    /// keepers.
    parents: Vec<u32>,
}

/// How long the notices of a child's group wait for its registration.
const PENDING_FOR: Duration = Duration::from_secs(5);
/// The most notices kept waiting; beyond, the oldest go.
const MAX_PENDING: usize = 256;

/// Receives one instance's notices; dropping it stops the routing.
#[derive(Debug)]
pub(crate) struct Route {
    hub: Arc<NotifyHub>,
    pgid: u32,
    pub(crate) notices: mpsc::UnboundedReceiver<Notice>,
}

impl Drop for Route {
    fn drop(&mut self) {
        self.hub.lock().routes.remove(&self.pgid);
    }
}

impl NotifyHub {
    /// A hub at the abstract address `address` (`@` and a name), not bound yet.
    pub(crate) fn new(address: String) -> Self {
        Self { address, state: Mutex::default(), foreign: AtomicU64::new(0) }
    }

    /// What `NOTIFY_SOCKET` says.
    /// Counts the children of `pid` (a keeper) as this process's own: their notices may
    /// arrive before they are registered, and wait for it.
    pub(crate) fn add_parent(&self, pid: u32) {
        let mut state = self.lock();
        if !state.parents.contains(&pid) {
            state.parents.push(pid);
        }
    }

    pub(crate) fn address(&self) -> &str {
        &self.address
    }

    /// Datagrams ignored so far because their sender was no registered instance's.
    pub(crate) fn foreign(&self) -> u64 {
        self.foreign.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, HubState> {
        // Every critical section only moves plain values in or out.
        tether_state::lock(&self.state)
    }

    /// Routes the notices of the process group `pgid` (an instance and its children) to
    /// the returned route, binding the socket first if need be.
    ///
    /// # Errors
    ///
    /// When the socket cannot be bound.
    pub(crate) fn register(self: &Arc<Self>, pgid: u32) -> io::Result<Route> {
        self.ensure_bound()?;
        let (sender, notices) = mpsc::unbounded_channel();
        let mut state = self.lock();
        let waiting = std::mem::take(&mut state.pending);
        for (group, _, notice) in waiting {
            if group == pgid {
                let _receiver_here = sender.send(notice);
            } else {
                state.pending.push((group, Instant::now(), notice));
            }
        }
        state.routes.insert(pgid, sender);
        Ok(Route { hub: Arc::clone(self), pgid, notices })
    }

    /// Binds the socket, if it is not yet, so that a process told its address can reach it
    /// from its first instruction.
    ///
    /// # Errors
    ///
    /// When the socket cannot be bound.
    pub(crate) fn ensure_bound(self: &Arc<Self>) -> io::Result<()> {
        let mut state = self.lock();
        if !state.bound {
            let socket = bind(&self.address)?;
            tokio::spawn(Arc::clone(self).receive(socket));
            state.bound = true;
        }
        Ok(())
    }

    async fn receive(self: Arc<Self>, socket: AsyncFd<OwnedFd>) {
        let mut buffer = vec![0_u8; MAX_DATAGRAM];
        loop {
            let received = socket.async_io(tokio::io::Interest::READABLE, |fd| read_datagram(fd, &mut buffer)).await;
            match received {
                Ok((length, pid)) => self.route(&buffer[..length], pid),
                Err(error) => {
                    tracing::error!(%error, address = %self.address, "notification socket failed; notices are lost");
                    self.lock().bound = false;
                    return;
                }
            }
        }
    }

    fn route(&self, datagram: &[u8], pid: Option<u32>) {
        if let Some(sender) = pid.and_then(|pid| self.lock().routes.get(&pid).cloned()) {
            for notice in parse(datagram) {
                let _instance_gone = sender.send(notice);
            }
            return;
        }
        // A child of the instance, in its group (systemd's NotifyAccess=all, bounded to the
        // instance's process group), or an instance not registered yet.
        let group = pid.and_then(|pid| proc::read_stat(pid).ok()).map(|stat| stat.pgid);
        let mut state = self.lock();
        if let Some(sender) = group.and_then(|pgid| state.routes.get(&pgid)) {
            for notice in parse(datagram) {
                let _instance_gone = sender.send(notice);
            }
            return;
        }
        let ours = group
            .and_then(|pgid| proc::read_stat(pgid).ok())
            .is_some_and(|leader| leader.ppid == std::process::id() || state.parents.contains(&leader.ppid));
        match group.filter(|_| ours) {
            Some(pgid) => {
                let now = Instant::now();
                state.pending.retain(|(_, at, _)| now.duration_since(*at) < PENDING_FOR);
                for notice in parse(datagram) {
                    if state.pending.len() >= MAX_PENDING {
                        state.pending.remove(0);
                    }
                    state.pending.push((pgid, now, notice));
                }
            }
            None => {
                drop(state);
                self.foreign.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(?pid, "notification from a process that is no supervised instance; ignored");
            }
        }
    }
}

/// Binds a datagram socket at the abstract `address` with `SO_PASSCRED` on.
fn bind(address: &str) -> io::Result<AsyncFd<OwnedFd>> {
    let name = address
        .strip_prefix('@')
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("not an abstract address: {address:?}")))?;
    let socket = std::os::unix::net::UnixDatagram::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(
        name.as_bytes(),
    )?)?;
    socket.set_nonblocking(true)?;
    let socket = OwnedFd::from(socket);
    socket::setsockopt(&socket, sockopt::PassCred, &true)?;
    #[allow(unsafe_code)]
    // SAFETY: the `AsyncFd` owns the `OwnedFd`, so the fd stays open and refers to the same
    // socket until the `AsyncFd` is dropped, and `as_raw_fd` always returns it.
    let registered = unsafe { AsyncFd::register_with_interest(socket, tokio::io::Interest::READABLE) }?;
    Ok(registered)
}

/// Reads one datagram and the pid the kernel stamped it with.
fn read_datagram(fd: &OwnedFd, buffer: &mut [u8]) -> io::Result<(usize, Option<u32>)> {
    let mut control = nix::cmsg_space!(nix::libc::ucred);
    let mut iov = [IoSliceMut::new(buffer)];
    let message = socket::recvmsg::<()>(
        fd.as_raw_fd(),
        &mut iov,
        Some(&mut control),
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC,
    )
    .map_err(io::Error::from)?;
    let pid = message.cmsgs().map_err(io::Error::from)?.find_map(|cmsg| match cmsg {
        ControlMessageOwned::ScmCredentials(credentials) => u32::try_from(credentials.pid()).ok(),
        _ => None,
    });
    Ok((message.bytes.min(MAX_DATAGRAM), pid))
}

/// The notices of one datagram: newline-separated `KEY=VALUE` assignments; unknown keys
/// (`MAINPID=`, …) are ignored, as systemd ignores what it does not use. `MONOTONIC_USEC=`
/// stamps the datagram's `RELOADING=1`, wherever it stands in it.
pub(crate) fn parse(datagram: &[u8]) -> Vec<Notice> {
    let text = String::from_utf8_lossy(datagram);
    let stamp = text.lines().find_map(|line| line.strip_prefix("MONOTONIC_USEC=")?.parse::<u64>().ok());
    text.lines()
        .filter_map(|line| match line.split_once('=')? {
            ("READY", "1") => Some(Notice::Ready),
            ("STATUS", text) => Some(Notice::Status(text.to_owned())),
            ("WATCHDOG", "1") => Some(Notice::Watchdog),
            ("WATCHDOG", "trigger") => Some(Notice::WatchdogTrigger),
            ("RELOADING", "1") => Some(Notice::Reloading(stamp)),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagrams_are_read_as_systemd_reads_them() {
        assert_eq!(
            parse(b"READY=1\nSTATUS=Serving 3 listeners\nMAINPID=42\nWATCHDOG=1\n"),
            [Notice::Ready, Notice::Status("Serving 3 listeners".into()), Notice::Watchdog]
        );
        assert_eq!(parse(b"WATCHDOG=trigger"), [Notice::WatchdogTrigger]);
        assert_eq!(parse(b"READY=0\nRELOADING=0\nnonsense"), []);
        assert_eq!(parse(b"RELOADING=1"), [Notice::Reloading(None)]);
        assert_eq!(parse(b"RELOADING=1\nMONOTONIC_USEC=123456"), [Notice::Reloading(Some(123_456))]);
        assert_eq!(
            parse(b"MONOTONIC_USEC=7\nRELOADING=1\nSTATUS=x"),
            [Notice::Reloading(Some(7)), Notice::Status("x".into())]
        );
        assert_eq!(parse(b"STATUS="), [Notice::Status(String::new())]);
    }
}
