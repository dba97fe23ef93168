//! The thread that creates every process of this process, with a descriptor table of its
//! own.
//!
//! A new process starts with a copy of its creator's descriptor table, and its exec closes
//! every close-on-exec entry of it: both cost one step per open descriptor. An agent holds
//! a pidfd per supervised process, so that with N proxies each spawn would cost O(N) and a
//! bring-up O(N²). This thread leaves the process's table at its start (`unshare`), keeps
//! nothing of it, and receives for each spawn only the descriptors the child needs (its log
//! files, its listeners, its notification pipe), passed over a socket pair (`SCM_RIGHTS`).
//! Its children copy a table of a few entries, however many processes run.
//!
//! This module moves jobs and descriptors; what the job runs is `spawn.rs`'s.

use std::cell::RefCell;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::{Mutex, OnceLock, mpsc};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

/// The most descriptors one job receives: two log files, a cgroup, a notification pipe
/// and the listeners.
pub(crate) const MAX_FDS: usize = tether_state::config::MAX_LISTENERS + 4;

type Job = Box<dyn FnOnce(io::Result<Vec<OwnedFd>>) + Send>;

struct SpawnThread {
    /// Held while a job's descriptors and the job itself are sent, so that they pair up.
    queue: Mutex<(mpsc::Sender<(Job, usize)>, UnixDatagram)>,
}

static THREAD: OnceLock<Result<SpawnThread, String>> = OnceLock::new();

thread_local! {
    /// Descriptors every child holds until its exec ([`hold_until_exec`]).
    static HELD: RefCell<Vec<OwnedFd>> = const { RefCell::new(Vec::new()) };
}

/// Runs `job` on the spawn thread with copies of `fds` in its table, in order, and returns
/// what it returns.
///
/// # Errors
///
/// When the thread cannot start or the descriptors cannot be passed.
pub(crate) fn run<T: Send + 'static>(
    fds: &[BorrowedFd<'_>],
    job: impl FnOnce(Vec<OwnedFd>) -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("more than {MAX_FDS} descriptors to hand over"),
        ));
    }
    let thread = THREAD
        .get_or_init(|| start().map_err(|error| error.to_string()))
        .as_ref()
        .map_err(|error| io::Error::other(format!("cannot start the spawn thread: {error}")))?;
    let (reply, answer) = mpsc::sync_channel(1);
    let job: Job = Box::new(move |received| {
        let _caller_gone = reply.send(received.and_then(job));
    });
    {
        let queue = thread.queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !fds.is_empty() {
            let raws: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
            let sent = sendmsg::<()>(
                queue.1.as_raw_fd(),
                &[io::IoSlice::new(&[0])],
                &[ControlMessage::ScmRights(&raws)],
                MsgFlags::empty(),
                None,
            )?;
            if sent != 1 {
                return Err(io::Error::other("the descriptors were not sent"));
            }
        }
        queue.0.send((job, fds.len())).map_err(|_| io::Error::other("the spawn thread has stopped"))?;
    }
    answer.recv().map_err(|_| io::Error::other("the spawn thread dropped the job"))?
}

/// Makes every process spawned from now on hold a copy of `fd` from its creation to its
/// exec (it stays close-on-exec). A lock held through an open file description (`flock`)
/// is thus held by a child until its exec, even if this process dies before.
///
/// # Errors
///
/// As [`run`].
pub(crate) fn hold_until_exec(fd: BorrowedFd<'_>) -> io::Result<()> {
    run(&[fd], |fds| {
        HELD.with(|held| held.borrow_mut().extend(fds));
        Ok(())
    })
}

fn start() -> io::Result<SpawnThread> {
    let (ours, theirs) = UnixDatagram::pair()?;
    let (jobs, queue) = mpsc::channel::<(Job, usize)>();
    let (ready, started) = mpsc::sync_channel::<io::Result<()>>(1);
    let kept = theirs.as_raw_fd();
    std::thread::Builder::new().name("tether-spawn".to_owned()).spawn(move || {
        let table = own_table(kept);
        let failed = table.is_err();
        let _caller_gone = ready.send(table);
        if failed {
            return;
        }
        for (job, count) in queue {
            let received = if count == 0 { Ok(Vec::new()) } else { receive(&theirs, count) };
            // A job that panics fails its own spawn (its caller sees the reply dropped), never
            // the thread that every later spawn needs.
            let _panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(received)));
        }
    })?;
    started.recv().map_err(|_| io::Error::other("the spawn thread died at its start"))??;
    Ok(SpawnThread { queue: Mutex::new((jobs, ours)) })
}

/// Gives this thread a descriptor table of its own, with only the standard streams and
/// `kept`.
fn own_table(kept: RawFd) -> io::Result<()> {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_FILES)?;
    close_range(3, kept - 1)?;
    close_range(kept + 1, RawFd::MAX)
}

fn close_range(first: RawFd, last: RawFd) -> io::Result<()> {
    if first > last {
        return Ok(());
    }
    #[allow(unsafe_code)]
    // SAFETY: close_range(2) takes two descriptor numbers and flags; it closes descriptors
    // of this thread's own table, which no Rust value of this thread owns (the table was
    // just unshared, and the only one kept is outside the range).
    let done = unsafe { libc::syscall(libc::SYS_close_range, first as libc::c_uint, last as libc::c_uint, 0) };
    if done < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Receives the `count` descriptors of one job, close-on-exec.
fn receive(socket: &UnixDatagram, count: usize) -> io::Result<Vec<OwnedFd>> {
    let mut byte = [0u8; 1];
    let mut iov = [io::IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let message = recvmsg::<()>(socket.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let mut fds = Vec::with_capacity(count);
    for control in message.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raws) = control {
            #[allow(unsafe_code)]
            // SAFETY: the kernel just installed these descriptors in this thread's table for
            // this message; nothing else owns them.
            fds.extend(raws.into_iter().map(|raw| unsafe { OwnedFd::from_raw_fd(raw) }));
        }
    }
    if fds.len() == count {
        Ok(fds)
    } else {
        Err(io::Error::other(format!("{} of {count} descriptors arrived", fds.len())))
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    #[test]
    fn jobs_get_their_descriptors_in_a_table_of_their_own() {
        let (left, right) = UnixDatagram::pair().unwrap();
        // Many descriptors in this process's table: none of them reaches the thread's.
        let crowd: Vec<OwnedFd> = (0..200).map(|_| std::fs::File::open("/dev/null").unwrap().into()).collect();
        let highest = crowd.iter().map(AsRawFd::as_raw_fd).max().unwrap();
        let (open, received) = run(&[right.as_fd()], move |fds| {
            let open = std::fs::read_dir("/proc/thread-self/fd")?.count();
            let socket = UnixDatagram::from(fds.into_iter().next().unwrap());
            socket.send(b"through the thread's copy")?;
            Ok((open, socket.as_raw_fd()))
        })
        .unwrap();
        assert!(open < 10, "the spawn thread's table holds {open} descriptors");
        assert!(received < highest, "numbered in the thread's own table: {received}");
        let mut buffer = [0u8; 64];
        let n = left.recv(&mut buffer).unwrap();
        assert_eq!(&buffer[..n], b"through the thread's copy");
        drop(crowd);
    }

    #[test]
    fn a_held_descriptor_is_in_the_table_that_children_copy() {
        use std::os::unix::fs::MetadataExt;
        let file = tempfile::tempfile().unwrap();
        let inode = file.metadata().unwrap().ino();
        hold_until_exec(file.as_fd()).unwrap();
        let held = run(&[], move |_| {
            let mut found = false;
            for entry in std::fs::read_dir("/proc/thread-self/fd")? {
                found |= std::fs::metadata(entry?.path()).is_ok_and(|m| m.ino() == inode);
            }
            Ok(found)
        })
        .unwrap();
        assert!(held, "the spawn thread's table holds the file");
    }
}
