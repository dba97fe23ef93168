//! Process identity on Linux: pidfds, `/proc/<pid>/stat`, the boot id, and [`Identity`].
//!
//! This module owns every system call that refers to a process by number, and the
//! proof that a number still denotes the same process. It never signals a process
//! through a bare pid, and it never reads `/proc` about a pid without holding a pidfd
//! that was opened first, so that a reused pid cannot be mistaken for the original.

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::Signal;
use tokio::io::unix::AsyncFd;

/// What proves that a pid still denotes the process that was detached.
///
/// The caller stores it (for example in a snapshot) and hands it back to
/// [`Supervisor::adopt`](crate::Supervisor::adopt). A pid alone proves nothing, because
/// pids are reused; the start time (in clock ticks since boot) and the boot id together
/// identify one process on one machine.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Identity {
    /// The pid of the main process.
    pub pid: u32,
    /// Its process group.
    pub pgid: u32,
    /// Field 22 of `/proc/<pid>/stat`: its start time, in clock ticks after boot.
    pub start_time: u64,
    /// `/proc/sys/kernel/random/boot_id` when it ran.
    pub boot_id: String,
    /// The name of its cgroup in the supervisor's subtree, when it was started in one: an
    /// adoption also checks that it is still there.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub cgroup: Option<String>,
}

/// The fields of `/proc/<pid>/stat` that identity checks use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stat {
    /// The parent's pid.
    pub(crate) ppid: u32,
    pub(crate) pgid: u32,
    /// The session id.
    pub(crate) sid: u32,
    pub(crate) start_time: u64,
}

/// Parses the fields after the command name, which may itself hold spaces and `)`.
pub(crate) fn parse_stat(text: &str) -> Option<Stat> {
    let after_comm = &text[text.rfind(')')? + 1..];
    // Field 3 (state) is the first after the command name; field N is at index N - 3.
    let fields: Vec<&str> = after_comm.split_ascii_whitespace().collect();
    Some(Stat {
        ppid: fields.get(4 - 3)?.parse().ok()?,
        pgid: fields.get(5 - 3)?.parse().ok()?,
        sid: fields.get(6 - 3)?.parse().ok()?,
        start_time: fields.get(22 - 3)?.parse().ok()?,
    })
}

/// Reads `/proc/<pid>/stat`. Only meaningful while a pidfd of `pid` is held.
pub(crate) fn read_stat(pid: u32) -> io::Result<Stat> {
    use std::io::Read;
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, "malformed /proc/<pid>/stat");
    // One read, with room for any stat line (52 numbers and a short command name): the
    // kernel makes the whole line at once, so a line without its newline did not fit.
    let mut buffer = [0u8; 2048];
    let read = fs::File::open(format!("/proc/{pid}/stat"))?.read(&mut buffer)?;
    let line = buffer[..read].strip_suffix(b"\n").ok_or_else(malformed)?;
    parse_stat(&String::from_utf8_lossy(line)).ok_or_else(malformed)
}

/// Reads the boot id of the running kernel.
pub(crate) fn read_boot_id() -> io::Result<String> {
    Ok(fs::read_to_string("/proc/sys/kernel/random/boot_id")?.trim().to_owned())
}

/// Whether every `KEY=VALUE` pair appears in the NUL-separated `environ` blob.
pub(crate) fn environ_contains(environ: &[u8], pairs: &[(std::ffi::OsString, std::ffi::OsString)]) -> bool {
    pairs.iter().all(|(key, value)| {
        environ.split(|&b| b == 0).any(|entry| {
            let (key, value) = (key.as_bytes(), value.as_bytes());
            entry.len() == key.len() + 1 + value.len()
                && entry.starts_with(key)
                && entry[key.len()] == b'='
                && entry.ends_with(value)
        })
    })
}

/// Reads `/proc/<pid>/environ`. Only meaningful while a pidfd of `pid` is held.
pub(crate) fn read_environ(pid: u32) -> io::Result<Vec<u8>> {
    fs::read(format!("/proc/{pid}/environ"))
}

/// Calls `visit` with the pid, the stat and the environment of every process whose
/// `/proc` entries can be read (those of processes gone meanwhile, or of another user's
/// without the privilege, cannot).
///
/// A hint, not a proof: what it finds must be proven again through a pidfd.
pub(crate) fn visit_processes(mut visit: impl FnMut(u32, Stat, &[u8])) {
    let Ok(entries) = fs::read_dir("/proc") else { return };
    let mut path = String::new();
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        path.clear();
        let _infallible = write!(path, "/proc/{pid}/stat");
        let Some(stat) = fs::read_to_string(&path).ok().as_deref().and_then(parse_stat) else { continue };
        if let Ok(environ) = read_environ(pid) {
            visit(pid, stat, &environ);
        }
    }
}

/// The value of `key` in the NUL-separated `environ` blob.
pub(crate) fn environ_value<'a>(environ: &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
    environ.split(|&b| b == 0).find_map(|entry| entry.strip_prefix(key)?.strip_prefix(b"="))
}

/// The command line of `pid`: its NUL-separated words.
pub(crate) fn read_cmdline(pid: u32) -> io::Result<Vec<std::ffi::OsString>> {
    use std::os::unix::ffi::OsStrExt;
    let raw = std::fs::read(format!("/proc/{pid}/cmdline"))?;
    let raw = raw.strip_suffix(&[0]).unwrap_or(&raw);
    Ok(raw.split(|b| *b == 0).map(|word| std::ffi::OsStr::from_bytes(word).to_owned()).collect())
}

/// The working directory of `pid`.
pub(crate) fn read_cwd(pid: u32) -> io::Result<std::path::PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/cwd"))
}

/// Reads the pid in a pid file: one decimal number, optionally followed by a newline.
pub(crate) fn parse_pid_file(text: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(text).ok()?;
    let pid: u32 = text.trim_end_matches('\n').parse().ok()?;
    (pid > 1 && i32::try_from(pid).is_ok()).then_some(pid)
}

/// Opens a pidfd for `pid`, close-on-exec (as every pidfd is). `ESRCH` when no such process
/// exists.
pub(crate) fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    #[allow(unsafe_code)]
    // SAFETY: `pidfd_open(2)` takes a pid and flags and returns a new fd or -1; it
    // touches no memory of ours. PIDFD_NONBLOCK is not needed: we only poll the fd.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("pidfd_open returned a bad fd"))?;
    #[allow(unsafe_code)]
    // SAFETY: `fd` was just returned by the kernel, is open, and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A pidfd: a reference to one process that stays valid however its pid is reused.
///
/// It becomes readable when the process exits, which is how the supervisor learns of
/// the exit of any process, its own children included, without polling.
#[derive(Debug)]
pub(crate) struct Pidfd(AsyncFd<OwnedFd>);

impl Pidfd {
    /// Opens a pidfd for `pid`. `ESRCH` when no such process exists.
    ///
    /// Must be called from within a tokio runtime (the fd is registered with its reactor).
    pub(crate) fn open(pid: u32) -> io::Result<Self> {
        Self::from_owned(pidfd_open(pid)?)
    }

    /// Watches `fd`, a pidfd opened elsewhere (a keeper's, for its child).
    ///
    /// Must be called from within a tokio runtime (the fd is registered with its reactor).
    pub(crate) fn from_owned(fd: OwnedFd) -> io::Result<Self> {
        #[allow(unsafe_code)]
        // SAFETY: the `AsyncFd` owns the `OwnedFd`, so the fd stays open and refers to the
        // same pidfd until the `AsyncFd` is dropped, and `as_raw_fd` always returns it.
        let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }?;
        Ok(Self(fd))
    }

    /// The pidfd's descriptor, for system calls that take one.
    #[cfg_attr(not(feature = "manager"), allow(dead_code))]
    pub(crate) fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }

    /// Sends `signal` to the process itself (not its group), through the pidfd, so that it
    /// can only reach the process the pidfd was opened for.
    pub(crate) fn send_signal(&self, signal: Signal) -> io::Result<()> {
        #[allow(unsafe_code)]
        // SAFETY: `pidfd_send_signal(2)` takes a pidfd, a signal number, a null `siginfo`
        // (the kernel fills in a `kill`-like one) and flags; it touches no memory of ours.
        let sent = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                signal as libc::c_int,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if sent < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
    }

    /// Whether the process has exited, without waiting.
    pub(crate) fn has_exited(&self) -> io::Result<bool> {
        let mut fds = [PollFd::new(self.0.get_ref().as_fd(), PollFlags::POLLIN)];
        let ready = poll(&mut fds, PollTimeout::ZERO)?;
        Ok(ready > 0)
    }

    /// Waits until the process has exited.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping the future loses nothing; the exit stays observable.
    pub(crate) async fn exited(&self) -> io::Result<()> {
        std::future::poll_fn(|cx| self.poll_exited(cx)).await
    }

    /// Whether the process has exited; else `cx`'s waker is woken once it has. A waiting
    /// task keeps no future for it.
    pub(crate) fn poll_exited(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        // The readiness is never cleared: a pidfd stays readable once its process exited.
        self.0.poll_read_ready(cx).map_ok(drop)
    }
}

/// `CLOCK_MONOTONIC` now, in microseconds: the clock of sd_notify's `MONOTONIC_USEC`.
pub(crate) fn monotonic_usec() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    #[allow(unsafe_code)]
    // SAFETY: `clock_gettime(2)` writes one `timespec` into the place it is given, which is
    // ours and of that type.
    let _always = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    u64::try_from(now.tv_sec).unwrap_or(0) * 1_000_000 + u64::try_from(now.tv_nsec).unwrap_or(0) / 1_000
}

/// Sends `signal` to the process group `pgid`; an empty group is not an error.
pub(crate) fn signal_group(pgid: u32, signal: Signal) -> io::Result<()> {
    let Ok(raw) = i32::try_from(pgid) else {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    };
    // Refuse groups 0 and 1: `killpg(0)` is our own group and 1 is init's.
    if raw <= 1 {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    match nix::sys::signal::killpg(nix::unistd::Pid::from_raw(raw), signal) {
        Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
        Err(errno) => Err(errno.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_survives_parentheses_and_spaces_in_the_name() {
        let line = "4242 (we) ird (x)) S 1 4242 4242 0 -1 4194560 107 0 0 0 0 0 0 0 20 0 1 0 987654 1000 100 18446744073709551615";
        assert_eq!(parse_stat(line), Some(Stat { ppid: 1, pgid: 4242, sid: 4242, start_time: 987654 }));
        assert_eq!(parse_stat("4242 (x) S 1"), None);
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn own_stat_is_readable() {
        let stat = read_stat(std::process::id()).unwrap();
        assert!(stat.start_time > 0);
        assert_eq!(read_boot_id().unwrap().len(), 36);
    }

    #[test]
    fn environ_matching_is_exact() {
        let environ = b"A=1\0TETHER_PROXY_ID=web-proxy\0TETHER_PROXY_TOKEN=abc\0";
        let pair = |k: &str, v: &str| (k.into(), v.into());
        assert!(environ_contains(environ, &[pair("TETHER_PROXY_ID", "web-proxy"), pair("TETHER_PROXY_TOKEN", "abc")]));
        assert!(!environ_contains(environ, &[pair("TETHER_PROXY_TOKEN", "ab")]));
        assert!(!environ_contains(environ, &[pair("TETHER_PROXY_ID", "web")]));
        assert!(!environ_contains(environ, &[pair("A", "")]));
        assert!(!environ_contains(environ, &[pair("TETHER_PROXY", "ID=web-proxy")]));
        assert!(environ_contains(environ, &[]));
    }

    #[cfg(feature = "manager")]
    #[test]
    fn an_identity_survives_serialisation() {
        let identity =
            Identity { pid: 42, pgid: 42, start_time: 987_654, boot_id: read_boot_id().unwrap(), cgroup: None };
        let text = serde_json::to_string(&identity).unwrap();
        assert_eq!(serde_json::from_str::<Identity>(&text).unwrap(), identity);
    }

    #[test]
    fn pid_files_hold_one_number() {
        assert_eq!(parse_pid_file(b"1234\n"), Some(1234));
        assert_eq!(parse_pid_file(b"1234"), Some(1234));
        for bad in ["", "1", "0", "-5", "12 34", "abc", "99999999999"] {
            assert_eq!(parse_pid_file(bad.as_bytes()), None, "{bad:?}");
        }
    }
}
