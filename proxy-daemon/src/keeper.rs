//! Keepers: the processes that are the parents of what a supervisor starts, so that its
//! processes outlive it.
//!
//! A program may ask to die with its parent (`prctl(PR_SET_PDEATHSIG)`; Envoy does): if the
//! supervisor's own process were the parent, its crash, its upgrade or its `SIGTERM` would
//! end such a process. With a [`Keeper`] ([`crate::Supervisor::use_keeper`]), processes are
//! created by a small process of their own, started by the supervisor from its own program,
//! which outlives the supervisor and is found again by the next one through its socket: it
//! creates processes exactly as the supervisor's own spawn threads do, hands each
//! one's pidfd back, sweeps each one's process group once its leader exits, reaps it and
//! tells the supervisor its exit status. Signals, adoption by proof, cgroups, listeners and
//! notifications stay the supervisor's: the keeper only creates and reaps.
//!
//! This module owns the keeper's protocol (`wire`), its loop (`serve`) and the supervisor's
//! side of it (`link`). It never signals a process other than a child of the keeper's
//! whose leader exited (its group) or whose supervisor never heard of it.

use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

mod link;
mod serve;
mod wire;

pub(crate) use link::{Keepers, Link};
pub use serve::serve_inherited;
pub(crate) use wire::Kept;

/// How a supervisor starts its keeper, and where it finds one that is running.
///
/// The program is started with the keeper's listening socket as descriptor 3 and the
/// supervisor's connection as descriptor 4; it must call [`serve_inherited`] (for the
/// `tether` binary, its hidden `keeper` command does). The socket is a path that only the
/// supervisor's user can reach (in a private directory): the keeper also refuses any other
/// user's connection.
#[derive(Debug)]
pub struct Keeper {
    pub(crate) program: PathBuf,
    pub(crate) arg0: OsString,
    pub(crate) args: Vec<OsString>,
    pub(crate) socket: PathBuf,
    pub(crate) stderr: Option<File>,
}

impl Keeper {
    /// A keeper run as `program args…`, listening on `socket`.
    pub fn new(program: impl Into<PathBuf>, args: Vec<OsString>, socket: impl Into<PathBuf>) -> Self {
        let program = program.into();
        Self { arg0: program.clone().into_os_string(), program, args, socket: socket.into(), stderr: None }
    }

    /// The name it runs under (`argv[0]`), where it differs from the program's path: a
    /// program run as `/proc/self/exe`, so that the keeper is the very build of the
    /// supervisor that starts it even after an upgrade replaced the file, is better named.
    #[must_use]
    pub fn arg0(mut self, name: impl Into<OsString>) -> Self {
        self.arg0 = name.into();
        self
    }

    /// Where the keeper's own errors go (else nowhere).
    #[must_use]
    pub fn stderr(mut self, file: File) -> Self {
        self.stderr = Some(file);
        self
    }

    /// The socket's path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

/// Sends one message with `fds` beside it, without raising SIGPIPE; with `nonblocking`, a
/// full socket is `WouldBlock`.
pub(crate) fn send(socket: BorrowedFd<'_>, bytes: &[u8], fds: &[RawFd], nonblocking: bool) -> io::Result<()> {
    let iov = [io::IoSlice::new(bytes)];
    let rights = [ControlMessage::ScmRights(fds)];
    let control: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    let mut flags = MsgFlags::MSG_NOSIGNAL;
    if nonblocking {
        flags |= MsgFlags::MSG_DONTWAIT;
    }
    loop {
        match sendmsg::<()>(socket.as_raw_fd(), &iov, control, flags, None) {
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EINTR) => {}
            Err(error) => return Err(error.into()),
        }
    }
}

/// The most descriptors one message carries: a spawn's, and the ones its children hold.
const MAX_FDS: usize = crate::spawn::MAX_FDS + 4;

/// Receives one message into `buffer` and the descriptors beside it (close-on-exec):
/// its length, or `None` once the other side hung up. With `nonblocking`, nothing to read is
/// `WouldBlock`.
pub(crate) fn receive(
    socket: BorrowedFd<'_>,
    buffer: &mut [u8],
    nonblocking: bool,
) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut iov = [io::IoSliceMut::new(buffer)];
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut flags = MsgFlags::MSG_CMSG_CLOEXEC;
    if nonblocking {
        flags |= MsgFlags::MSG_DONTWAIT;
    }
    let message = loop {
        match recvmsg::<()>(socket.as_raw_fd(), &mut iov, Some(&mut space), flags) {
            Ok(message) => break message,
            Err(nix::errno::Errno::EINTR) => {}
            Err(error) => return Err(error.into()),
        }
    };
    let mut fds = Vec::new();
    for control in message.cmsgs()? {
        if let ControlMessageOwned::ScmRights(received) = control {
            for fd in received {
                #[allow(unsafe_code)]
                // SAFETY: the kernel just installed this descriptor in our table for us.
                fds.push(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) });
            }
        }
    }
    let length = message.bytes;
    if message.flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC) {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a keeper message was cut short"));
    }
    if length == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some((length, fds)))
}
