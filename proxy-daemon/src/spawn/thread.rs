//! The threads that create every process of this process, each with a descriptor table of
//! its own.
//!
//! A new process starts with a copy of its creator's descriptor table, and its exec closes
//! every close-on-exec entry of it: both cost one step per open descriptor. An agent holds
//! a pidfd per supervised process, so that with N proxies each spawn would cost O(N) and a
//! bring-up O(N²). A spawn thread leaves the process's table at its start (`unshare`), keeps
//! nothing of it, and receives for each spawn only the descriptors the child needs (its log
//! files, its listeners, its notification pipe), passed over a socket pair (`SCM_RIGHTS`).
//! Its children copy a table of a few entries, however many processes run.
//!
//! There is one spawn thread per core (a few at most): each is suspended from a child's
//! creation to its exec, and with several, the execs of a burst of starts run side by side.
//! A job goes to the thread with the fewest jobs waiting.
//!
//! Nothing may run on a spawn thread that uses a descriptor of the process's table by
//! number: the number means another file there, or nothing. Waking an async task is such a
//! thing (a runtime wakes its I/O driver through a descriptor), so the results of jobs are
//! handed out by one more thread, with the process's table: the relay.
//!
//! This module moves jobs, results and descriptors; what the job runs is `spawn.rs`'s.

use std::cell::RefCell;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

/// The most descriptors one job receives: two log files, a cgroup, a notification pipe
/// and the listeners.
pub(crate) const MAX_FDS: usize = tether_state::config::MAX_LISTENERS + 4;

/// A job's result on its way to whoever waits for it, run on the relay thread.
type Delivery = Box<dyn FnOnce() + Send>;

/// A job: it runs on the spawn thread with the descriptors it was given, and returns the
/// delivery of its result.
type Job = Box<dyn FnOnce(io::Result<Vec<OwnedFd>>) -> Delivery + Send>;

/// Makes a [`Job`] of `work`, whose result, or the error of its panic, goes to `deliver`
/// on the relay thread. Nothing of `deliver` is used or dropped on the spawn thread.
fn job<T: Send + 'static>(
    work: impl FnOnce(Vec<OwnedFd>) -> io::Result<T> + Send + 'static,
    deliver: impl FnOnce(io::Result<T>) + Send + 'static,
) -> Job {
    Box::new(move |received| {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| received.and_then(work)))
            .unwrap_or_else(|_| Err(io::Error::other("the spawn job panicked")));
        Box::new(move || deliver(result))
    })
}

/// The spawn threads, each with a table of its own and its own queue.
struct Lanes {
    first: Lane,
    others: Vec<Lane>,
}

/// One spawn thread.
struct Lane {
    /// Held while a job's descriptors and the job itself are sent, so that they pair up.
    queue: Mutex<(mpsc::Sender<(Job, usize)>, UnixDatagram)>,
    /// Jobs given to it and not done yet: a job goes to the lane with the fewest.
    pending: Arc<AtomicUsize>,
}

/// As many spawn threads as the machine runs threads at once, up to this: a process is
/// created by one thread suspended until the child's exec (`CLONE_VFORK`), so that with
/// one thread the execs of a burst of starts take turns on one core.
const MAX_LANES: usize = 4;

static LANES: OnceLock<Lanes> = OnceLock::new();

/// Held while the spawn threads are being started.
static STARTING: Mutex<()> = Mutex::new(());

thread_local! {
    /// Descriptors every child holds until its exec ([`hold_until_exec`]).
    static HELD: RefCell<Vec<OwnedFd>> = const { RefCell::new(Vec::new()) };
}

/// Runs `job` on a spawn thread with copies of `fds` in its table, in order, and returns
/// what it returns, blocking the caller until then.
///
/// # Errors
///
/// When the thread cannot start or the descriptors cannot be passed.
#[cfg(test)]
pub(crate) fn run<T: Send + 'static>(
    fds: &[BorrowedFd<'_>],
    job: impl FnOnce(Vec<OwnedFd>) -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    let lanes = lanes()?;
    run_on(lanes.least_busy(), fds, job)
}

fn run_on<T: Send + 'static>(
    lane: &Lane,
    fds: &[BorrowedFd<'_>],
    job: impl FnOnce(Vec<OwnedFd>) -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    let (reply, answer) = mpsc::sync_channel(1);
    lane.submit(
        fds,
        self::job(job, move |result| {
            let _caller_gone = reply.send(result);
        }),
    )?;
    answer.recv().map_err(|_| dropped())?
}

/// Queues `job` to run on a spawn thread with copies of `fds` in its table, in order.
/// The copies are made before this returns: the caller may close its own at once. Its
/// result comes through the returned [`Reply`], which a task awaits while its worker
/// thread goes on with other tasks (the next spawn's preparation, say). A result that
/// nobody waits for any more (the task was cancelled) is dropped, on the relay thread or
/// with the reply: what it holds must clean up after itself.
///
/// # Errors
///
/// As [`run`].
pub(crate) fn queue<T: Send + 'static>(
    fds: &[BorrowedFd<'_>],
    job: impl FnOnce(Vec<OwnedFd>) -> io::Result<T> + Send + 'static,
) -> io::Result<Reply<T>> {
    let (reply, answer) = tokio::sync::oneshot::channel();
    lanes()?.least_busy().submit(
        fds,
        self::job(job, move |result| {
            let _caller_gone = reply.send(result);
        }),
    )?;
    Ok(Reply(answer))
}

/// The result of a job given to [`queue`], to come.
pub(crate) struct Reply<T>(tokio::sync::oneshot::Receiver<io::Result<T>>);

impl<T> Reply<T> {
    /// Waits for the job's result.
    ///
    /// # Errors
    ///
    /// The job's own, or when the thread dropped the job.
    pub(crate) async fn wait(self) -> io::Result<T> {
        self.0.await.map_err(|_| dropped())?
    }
}

fn dropped() -> io::Error {
    io::Error::other("the spawn thread dropped the job")
}

/// The spawn threads, started by the first spawn. A start that failed (no thread could be
/// made, say) is the error of that spawn only: the next one tries again.
fn lanes() -> io::Result<&'static Lanes> {
    if let Some(lanes) = LANES.get() {
        return Ok(lanes);
    }
    let _starting = tether_state::lock(&STARTING);
    if let Some(lanes) = LANES.get() {
        return Ok(lanes);
    }
    let lanes = Lanes::start().map_err(|error| io::Error::other(format!("cannot start the spawn threads: {error}")))?;
    Ok(LANES.get_or_init(|| lanes))
}

impl Lanes {
    fn start() -> io::Result<Self> {
        let (relay, deliveries) = mpsc::channel::<Delivery>();
        std::thread::Builder::new().name("tether-spawned".to_owned()).spawn(move || {
            for delivery in deliveries {
                // A delivery that panics loses its own result, never the thread.
                let _panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(delivery));
            }
        })?;
        let count = std::thread::available_parallelism().map_or(1, usize::from).clamp(1, MAX_LANES);
        let first = Lane::start(relay.clone())?;
        let others = (1..count).map(|_| Lane::start(relay.clone())).collect::<io::Result<_>>()?;
        Ok(Self { first, others })
    }

    fn all(&self) -> impl Iterator<Item = &Lane> {
        std::iter::once(&self.first).chain(&self.others)
    }

    fn least_busy(&self) -> &Lane {
        let load = |lane: &Lane| lane.pending.load(Ordering::Relaxed);
        self.others.iter().fold(&self.first, |best, lane| if load(lane) < load(best) { lane } else { best })
    }
}

impl Lane {
    fn start(relay: mpsc::Sender<Delivery>) -> io::Result<Self> {
        let (ours, theirs) = UnixDatagram::pair()?;
        let (jobs, queue) = mpsc::channel::<(Job, usize)>();
        let (ready, started) = mpsc::sync_channel::<io::Result<()>>(1);
        let pending = Arc::new(AtomicUsize::new(0));
        let done = Arc::clone(&pending);
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
                // A job catches its own panic (see `job`): it fails that spawn only.
                let delivery = job(received);
                done.fetch_sub(1, Ordering::Relaxed);
                if let Err(mpsc::SendError(undelivered)) = relay.send(delivery) {
                    // The relay ended, which it does not while this thread lives: dropped
                    // here, the delivery could wake a task, through a descriptor of another
                    // table.
                    std::mem::forget(undelivered);
                }
            }
        })?;
        started.recv().map_err(|_| io::Error::other("the spawn thread died at its start"))??;
        Ok(Self { queue: Mutex::new((jobs, ours)), pending })
    }

    /// Sends `fds` and then `job` to this lane's thread.
    fn submit(&self, fds: &[BorrowedFd<'_>], job: Job) -> io::Result<()> {
        if fds.len() > MAX_FDS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("more than {MAX_FDS} descriptors to hand over"),
            ));
        }
        let queue = tether_state::lock(&self.queue);
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
        self.pending.fetch_add(1, Ordering::Relaxed);
        queue.0.send((job, fds.len())).map_err(|_| {
            self.pending.fetch_sub(1, Ordering::Relaxed);
            io::Error::other("the spawn thread has stopped")
        })
    }
}

/// Makes every process spawned from now on hold a copy of `fd` from its creation to its
/// exec (it stays close-on-exec). A lock held through an open file description (`flock`)
/// is thus held by a child until its exec, even if this process dies before.
///
/// # Errors
///
/// As [`run`].
pub(crate) fn hold_until_exec(fd: BorrowedFd<'_>) -> io::Result<()> {
    for lane in lanes()?.all() {
        run_on(lane, &[fd], |fds| {
            HELD.with(|held| held.borrow_mut().extend(fds));
            Ok(())
        })?;
    }
    Ok(())
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
        for lane in lanes().unwrap().all() {
            let held = run_on(lane, &[], move |_| {
                let mut found = false;
                for entry in std::fs::read_dir("/proc/thread-self/fd")? {
                    found |= std::fs::metadata(entry?.path()).is_ok_and(|m| m.ino() == inode);
                }
                Ok(found)
            })
            .unwrap();
            assert!(held, "every spawn thread's table holds the file");
        }
    }

    #[test]
    fn a_job_goes_to_the_lane_with_the_fewest_waiting() {
        let relay = {
            let (relay, deliveries) = mpsc::channel::<Delivery>();
            std::thread::spawn(move || deliveries.into_iter().for_each(|delivery| delivery()));
            relay
        };
        let lanes = Lanes { first: Lane::start(relay.clone()).unwrap(), others: vec![Lane::start(relay).unwrap()] };
        // The first lane busy with a job that waits for a word from here.
        let (go, wait) = mpsc::channel::<()>();
        let (done, finished) = mpsc::channel::<()>();
        lanes
            .first
            .submit(
                &[],
                job(
                    move |_| wait.recv().map_err(io::Error::other),
                    move |_| {
                        let _ = done.send(());
                    },
                ),
            )
            .unwrap();
        assert!(std::ptr::eq(lanes.least_busy(), &lanes.others[0]), "the idle lane");
        go.send(()).unwrap();
        finished.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        eventually(|| lanes.first.pending.load(Ordering::Relaxed) == 0);
        assert!(std::ptr::eq(lanes.least_busy(), &lanes.first), "both idle: the first");
    }

    /// A task on a runtime whose only thread waits in its I/O driver is woken by a job's
    /// result: the wake-up comes from a thread with the process's descriptor table.
    #[test]
    fn a_result_wakes_a_task_parked_in_the_io_driver() {
        let (answer, answered) = mpsc::channel();
        // No timer on the runtime: its thread parks in the driver until woken.
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_io().build().unwrap();
            let result = runtime.block_on(async {
                let reply = queue(&[], |_| {
                    // Long enough for the runtime's thread to park.
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    Ok(42)
                })?;
                reply.wait().await
            });
            let _ = answer.send(result.map_err(|error| error.to_string()));
        });
        let result = answered.recv_timeout(std::time::Duration::from_secs(10)).expect("woken within 10 s");
        assert_eq!(result.unwrap(), 42);
    }

    /// A result whose task stopped waiting is dropped (on the relay), not kept or leaked:
    /// what it holds cleans up after itself.
    #[test]
    fn a_result_nobody_waits_for_is_dropped() {
        struct Dropped(mpsc::Sender<()>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                let _ = self.0.send(());
            }
        }
        let (go, wait) = mpsc::channel::<()>();
        let (dropped, seen) = mpsc::channel::<()>();
        let reply = queue(&[], move |_| {
            wait.recv().map_err(io::Error::other)?;
            Ok(Dropped(dropped))
        })
        .unwrap();
        drop(reply);
        go.send(()).unwrap();
        seen.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
    }

    fn eventually(condition: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !condition() {
            assert!(std::time::Instant::now() < deadline, "not within 10 s");
            std::thread::yield_now();
        }
    }
}
