//! Listening sockets that outlive the processes which serve them: bound here, handed to
//! every instance (`spawn`), and taken back from a running instance after an agent
//! restart, through its pidfd.
//!
//! This module owns the sockets' creation and recognition; it never decides which process
//! gets one.

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, SockaddrLike, SockaddrStorage, UnixAddr, sockopt};
/// Where a listener listens: tether-state's, one vocabulary with the config's `listeners`.
pub use tether_state::ListenAddress;

use crate::proc::Pidfd;

/// Why a listener could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {address}: {reason}")]
pub struct ListenError {
    /// The address.
    pub address: String,
    /// Why, for display.
    pub reason: String,
}

impl ListenError {
    fn new(address: &ListenAddress, reason: impl std::fmt::Display) -> Self {
        Self { address: address.to_string(), reason: reason.to_string() }
    }
}

/// Binds `address` and listens, with the kernel's largest backlog, so that connections
/// wait there while no instance accepts. TCP sockets get `SO_REUSEADDR` (a restarted
/// agent binds again beside connections in `TIME_WAIT`). A Unix socket file left by an
/// earlier agent is replaced when nothing listens on it; the new one is mode 0666, like
/// systemd's default: its directory decides who may connect.
///
/// # Errors
///
/// [`ListenError`] naming the address: in use, unresolvable, not permitted, …
pub fn bind(address: &ListenAddress) -> Result<OwnedFd, ListenError> {
    let error = |reason: &dyn std::fmt::Display| ListenError::new(address, reason);
    match address {
        ListenAddress::Tcp(target) => {
            let resolved: SocketAddr = target
                .as_str()
                .to_socket_addrs()
                .map_err(|e| error(&format!("cannot resolve it: {e}")))?
                .next()
                .ok_or_else(|| error(&"it resolves to no address"))?;
            let family = if resolved.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
            let fd = socket::socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).map_err(|e| error(&e))?;
            socket::setsockopt(&fd, sockopt::ReuseAddr, &true).map_err(|e| error(&e))?;
            socket::bind(fd.as_raw_fd(), &SockaddrStorage::from(resolved)).map_err(|e| error(&describe(e)))?;
            listen(&fd).map_err(|e| error(&e))?;
            Ok(fd)
        }
        ListenAddress::Unix(path) => {
            let unix = UnixAddr::new(path.as_path()).map_err(|e| error(&e))?;
            let fd = socket::socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)
                .map_err(|e| error(&e))?;
            match socket::bind(fd.as_raw_fd(), &unix) {
                Ok(()) => {}
                Err(nix::errno::Errno::EADDRINUSE) if is_stale(path) => {
                    std::fs::remove_file(path).map_err(|e| error(&format!("cannot replace a stale socket: {e}")))?;
                    socket::bind(fd.as_raw_fd(), &unix).map_err(|e| error(&describe(e)))?;
                }
                Err(errno) => return Err(error(&describe(errno))),
            }
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(|e| error(&e))?;
            listen(&fd).map_err(|e| error(&e))?;
            Ok(fd)
        }
    }
}

fn listen(fd: &OwnedFd) -> nix::Result<()> {
    socket::listen(fd, socket::Backlog::MAXCONN)
}

fn describe(errno: nix::errno::Errno) -> String {
    match errno {
        nix::errno::Errno::EADDRINUSE => "the address is in use".to_owned(),
        nix::errno::Errno::EACCES => "permission denied (a port below 1024 needs root)".to_owned(),
        other => other.desc().to_owned(),
    }
}

/// Whether the socket file at `path` is one nobody listens on any more: a connect is
/// refused. Anything else (a live listener, not a socket) keeps it.
fn is_stale(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    let is_socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
    is_socket
        && matches!(
            std::os::unix::net::UnixStream::connect(path),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused
        )
}

/// Whether `fd` is a listening stream socket bound to `address`.
pub fn listens_on(fd: &impl AsFd, address: &ListenAddress) -> bool {
    if !matches!(socket::getsockopt(fd, sockopt::AcceptConn), Ok(true)) {
        return false;
    }
    let Ok(bound) = socket::getsockname::<SockaddrStorage>(fd.as_fd().as_raw_fd()) else { return false };
    match address {
        ListenAddress::Tcp(target) => {
            let bound = match (bound.as_sockaddr_in(), bound.as_sockaddr_in6()) {
                (Some(v4), _) => SocketAddr::from(std::net::SocketAddrV4::from(*v4)),
                (_, Some(v6)) => SocketAddr::from(std::net::SocketAddrV6::from(*v6)),
                _ => return false,
            };
            target.as_str().to_socket_addrs().is_ok_and(|mut resolved| resolved.any(|wanted| wanted == bound))
        }
        ListenAddress::Unix(path) => {
            bound.family() == Some(AddressFamily::Unix)
                && bound.as_unix_addr().and_then(UnixAddr::path).is_some_and(|bound| bound == path)
        }
    }
}

/// Copies of every listening socket that process `pid` holds, taken through `pidfd`
/// (`pidfd_getfd`): the process keeps its own. Needs the right to trace the process (root,
/// or its user where ptrace is not restricted); `/proc/<pid>/fd` only names candidates,
/// and every copy comes from the process that `pidfd` refers to.
///
/// # Errors
///
/// When `/proc/<pid>/fd` cannot be read.
#[cfg_attr(not(feature = "manager"), allow(dead_code))] // the engine adapter's
pub(crate) fn take_listening(pidfd: &Pidfd, pid: u32) -> io::Result<Vec<OwnedFd>> {
    take_sockets(pidfd.as_raw_fd(), pid, |fd| matches!(socket::getsockopt(fd, sockopt::AcceptConn), Ok(true)))
}

/// Copies of the listening TCP sockets of process `pid` that others may join
/// (`SO_REUSEPORT`), each once, with its inode: what `keep_listening` keeps of a
/// generation. A socket without `SO_REUSEPORT` is left alone: while a copy of it is open,
/// the next generation could not bind its address.
///
/// # Errors
///
/// When `/proc/<pid>/fd` cannot be read.
#[cfg_attr(not(feature = "manager"), allow(dead_code))] // the engine adapter's
pub(crate) fn take_reusable_tcp(pidfd: BorrowedFd<'_>, pid: u32) -> io::Result<Vec<(u64, OwnedFd)>> {
    let reusable_tcp = |fd: &OwnedFd| {
        matches!(socket::getsockopt(fd, sockopt::AcceptConn), Ok(true))
            && matches!(socket::getsockopt(fd, sockopt::ReusePort), Ok(true))
            && matches!(socket::getsockopt(fd, sockopt::SockType), Ok(SockType::Stream))
            && socket::getsockname::<SockaddrStorage>(fd.as_raw_fd())
                .is_ok_and(|bound| matches!(bound.family(), Some(AddressFamily::Inet | AddressFamily::Inet6)))
    };
    let mut taken: Vec<(u64, OwnedFd)> = Vec::new();
    for fd in take_sockets(pidfd.as_raw_fd(), pid, reusable_tcp)? {
        let inode = nix::sys::stat::fstat(&fd).map_err(io::Error::from)?.st_ino;
        if taken.iter().all(|(known, _)| *known != inode) {
            taken.push((inode, fd));
        }
    }
    Ok(taken)
}

/// Copies, through `pidfd`, of the sockets of process `pid` that `wanted` accepts.
#[cfg_attr(not(feature = "manager"), allow(dead_code))]
fn take_sockets(pidfd: RawFd, pid: u32, wanted: impl Fn(&OwnedFd) -> bool) -> io::Result<Vec<OwnedFd>> {
    let mut taken = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(entry) = entry else { continue };
        let Some(number) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let is_socket =
            std::fs::read_link(entry.path()).is_ok_and(|link| link.to_string_lossy().starts_with("socket:"));
        if !is_socket {
            continue;
        }
        match get_fd(pidfd, number) {
            Ok(fd) if wanted(&fd) => taken.push(fd),
            Ok(_) => {}
            Err(error) => {
                tracing::debug!(pid, fd = number, %error, "cannot take a descriptor from the process");
            }
        }
    }
    Ok(taken)
}

/// `pidfd_getfd(2)`: a close-on-exec copy of descriptor `number` of the process.
#[cfg_attr(not(feature = "manager"), allow(dead_code))]
fn get_fd(pidfd: RawFd, number: i32) -> io::Result<OwnedFd> {
    #[allow(unsafe_code)]
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number and flags, and returns a new
    // descriptor that we own, or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, number, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("pidfd_getfd returned a bad fd"))?;
    #[allow(unsafe_code)]
    // SAFETY: the kernel just returned this descriptor to us, and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tcp_listener_is_bound_recognised_and_refused_twice() {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = probe.local_addr().unwrap().port();
        drop(probe);
        let address = ListenAddress::parse(&format!("127.0.0.1:{port}")).unwrap();
        let fd = bind(&address).unwrap();
        assert!(listens_on(&fd, &address));
        assert!(!listens_on(&fd, &ListenAddress::parse("127.0.0.1:1").unwrap()));
        let error = bind(&address).unwrap_err();
        assert_eq!(error.to_string(), format!("cannot listen on 127.0.0.1:{port}: the address is in use"));
        // Connections wait in the backlog while nobody accepts.
        std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    }

    #[test]
    fn a_stale_unix_socket_is_replaced_and_a_live_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("web.sock");
        let address = ListenAddress::Unix(path.clone());
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap()); // leaves the file
        let fd = bind(&address).unwrap();
        assert!(listens_on(&fd, &address));
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o666);
        let error = bind(&address).unwrap_err();
        assert!(error.to_string().ends_with("the address is in use"), "{error}");
        std::os::unix::net::UnixStream::connect(&path).unwrap();
        std::fs::write(dir.path().join("file"), "not a socket").unwrap();
        let error = bind(&ListenAddress::Unix(dir.path().join("file"))).unwrap_err();
        assert!(error.to_string().ends_with("the address is in use"), "{error}");
    }

    #[tokio::test]
    async fn listening_sockets_are_taken_from_a_process() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = ListenAddress::parse(&listener.local_addr().unwrap().to_string()).unwrap();
        let pid = std::process::id();
        let pidfd = Pidfd::open(pid).unwrap();
        let taken = take_listening(&pidfd, pid).unwrap();
        assert!(taken.iter().any(|fd| listens_on(fd, &address)), "{} sockets taken", taken.len());
    }

    #[test]
    fn only_reusable_tcp_listeners_are_kept_each_once() {
        let reusable = socket::socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
        socket::setsockopt(&reusable, sockopt::ReusePort, &true).unwrap();
        let any = socket::SockaddrIn::new(127, 0, 0, 1, 0);
        socket::bind(reusable.as_raw_fd(), &any).unwrap();
        socket::listen(&reusable, socket::Backlog::new(8).unwrap()).unwrap();
        // A second descriptor of the same socket, and a listener others may not join.
        let again = reusable.try_clone().unwrap();
        let plain = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let pid = std::process::id();
        let pidfd = crate::proc::pidfd_open(pid).unwrap();
        let taken = take_reusable_tcp(pidfd.as_fd(), pid).unwrap();
        let inode = |fd: &dyn AsFd| nix::sys::stat::fstat(fd).unwrap().st_ino;
        let inodes: Vec<u64> = taken.iter().map(|(inode, _)| *inode).collect();
        assert_eq!(inodes.iter().filter(|i| **i == inode(&reusable)).count(), 1, "{inodes:?}");
        assert!(!inodes.contains(&inode(&plain)), "a socket without SO_REUSEPORT is not kept");
        assert!(taken.iter().all(|(inode, fd)| nix::sys::stat::fstat(fd).unwrap().st_ino == *inode));
        drop(again);
    }
}
