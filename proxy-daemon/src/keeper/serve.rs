//! The keeper process: the parent of the processes its supervisors start.
//!
//! One thread, one loop: it accepts supervisors on its listening socket (its own user's
//! only), creates processes when asked ([`crate::spawn::create`], as a spawn thread does),
//! and reaps its children once they exit, after it has swept their process groups (while the
//! unreaped leader still holds the group's id), telling every connected supervisor how each
//! ended. Exits that no supervisor was connected to hear are kept, a bounded number, for the
//! next one. It exits once it has no child left and either no supervisor is connected or it
//! was retired. It never signals a process that is not its child's group, and never starts a
//! process of its own accord.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, mpsc};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::socket::{self, SockFlag};
use tether_state::lock;

use super::wire::{Answer, Exit, Kept, MAX_MESSAGE, Request, build};
use super::{receive, send};
use crate::proc;

/// How many exits the keeper keeps for a supervisor that is not connected.
const UNHEARD: usize = 4096;

/// Runs a keeper on the descriptors its supervisor handed it: 3, its listening socket, and
/// 4, the supervisor's connection. Returns once it has nothing left to keep.
///
/// This is the whole of a keeper process's work: a program that a supervisor starts as its
/// keeper calls it from `main` before anything else, with no runtime and no other thread.
///
/// # Errors
///
/// When 3 or 4 is not a socket (the program was not started as a keeper), or when the
/// loop's own descriptors cannot be made.
pub fn serve_inherited() -> io::Result<()> {
    let listener = inherited(3)?;
    let first = inherited(4)?;
    // Whatever else the supervisor's process held open without close-on-exec (what its own
    // parent gave it, say) is not the proxies' business: every child would inherit it.
    close_from(5);
    serve(listener, Some(first))
}

/// Closes every descriptor from `first` on.
fn close_from(first: RawFd) {
    #[allow(unsafe_code)]
    // SAFETY: close_range(2) takes two descriptor numbers and flags; at the keeper's start no
    // Rust value owns a descriptor from `first` on (only 0 to 4 are taken).
    let closed = unsafe { libc::syscall(libc::SYS_close_range, first as libc::c_uint, libc::c_uint::MAX, 0) };
    if closed < 0 {
        for fd in first..1024 {
            #[allow(unsafe_code)]
            // SAFETY: as above; closing a number that is not open fails harmlessly.
            let _ = unsafe { libc::close(fd) };
        }
    }
}

/// Takes descriptor `fd`, which must be a socket, and makes it close-on-exec.
fn inherited(fd: RawFd) -> io::Result<OwnedFd> {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::zeroed();
    #[allow(unsafe_code)]
    // SAFETY: fstat writes one `stat` into the place given, which is ours and of that type.
    let done = unsafe { libc::fstat(fd, stat.as_mut_ptr()) };
    if done != 0 {
        return Err(io::Error::other(format!("descriptor {fd} is not open: this runs only as a supervisor's keeper")));
    }
    #[allow(unsafe_code)]
    // SAFETY: fstat succeeded, so it filled the struct in.
    let mode = unsafe { stat.assume_init() }.st_mode;
    if mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(io::Error::other(format!(
            "descriptor {fd} is not a socket: this runs only as a supervisor's keeper"
        )));
    }
    #[allow(unsafe_code)]
    // SAFETY: `fd` is open (fstat said so) and nothing else in this process owns it: it was
    // handed over at exec, and the keeper takes each of its two descriptors once.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC))?;
    Ok(fd)
}

/// The keeper's loop.
pub(crate) fn serve(listener: OwnedFd, first: Option<OwnedFd>) -> io::Result<()> {
    // A session of its own: no terminal's signals, no group shared with the agent.
    let _already_leader = nix::unistd::setsid();
    let _ = nix::unistd::chdir("/");
    // A supervisor that went away must not end the keeper through a write.
    #[allow(unsafe_code)]
    // SAFETY: setting a signal's disposition to "ignore" installs no handler.
    unsafe {
        nix::sys::signal::signal(Signal::SIGPIPE, nix::sys::signal::SigHandler::SigIgn)?;
    }
    // Exits arrive as readable data, not as a handler. Children do not inherit the mask:
    // every way of creating one empties it before the exec.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    mask.thread_block()?;
    let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)?;
    let children = Arc::new(Mutex::new(HashMap::new()));
    let creators = Creators::start(&children)?;
    let mut keeper = Keeper {
        listener: Some(listener),
        supervisors: Vec::new(),
        next_peer: 0,
        children,
        creators,
        unheard: VecDeque::new(),
        retired: false,
        buffer: vec![0; MAX_MESSAGE],
        exited_unregistered: false,
    };
    if let Some(first) = first {
        keeper.add_peer(first);
    }
    loop {
        if keeper.creators.in_flight == 0
            && lock(&keeper.children).is_empty()
            && (keeper.retired || keeper.supervisors.is_empty())
        {
            return Ok(());
        }
        let (signalled, created, accept, readable) = keeper.wait(signals.as_fd())?;
        if signalled {
            while let Ok(Some(_)) = signals.read_signal() {}
        }
        if created {
            keeper.answer_spawns();
        }
        if signalled || (created && keeper.exited_unregistered) {
            keeper.reap();
        }
        if accept {
            keeper.accept();
        }
        for index in readable {
            if keeper.supervisors[index].open {
                let open = keeper.serve_one(index);
                keeper.supervisors[index].open &= open;
            }
        }
        for supervisor in &mut keeper.supervisors {
            supervisor.flush();
        }
        keeper.supervisors.retain(|supervisor| supervisor.open);
    }
}

/// A connected supervisor, and what is still to be sent to it.
struct Peer {
    /// Which supervisor it is, for answers that come back from a creator thread.
    id: u64,
    socket: OwnedFd,
    /// Messages not sent yet (the socket's buffer was full), with the descriptor each
    /// carries and the child a `Spawned` answer names.
    outbox: VecDeque<Outgoing>,
    /// False once it hung up, or fell too far behind.
    open: bool,
}

struct Outgoing {
    bytes: Vec<u8>,
    fd: Option<OwnedFd>,
    /// The child that a `Spawned` answer hands over: killed should the answer never arrive.
    spawned: Option<u32>,
}

/// How many messages may wait for a supervisor that does not read: far more than a stop of
/// every proxy at once produces, far less than would matter to the keeper's memory.
const MAX_OUTBOX: usize = 1 << 20;

impl Peer {
    fn new(id: u64, socket: OwnedFd) -> Self {
        // Room for a burst of exits without waiting for the supervisor (capped by the system).
        let _ = socket::setsockopt(&socket, socket::sockopt::SndBuf, &(1 << 20));
        Self { id, socket, outbox: VecDeque::new(), open: true }
    }

    /// Queues a message and sends what it can without waiting.
    fn post(&mut self, bytes: Vec<u8>, fd: Option<OwnedFd>, spawned: Option<u32>) {
        if self.outbox.len() >= MAX_OUTBOX {
            self.open = false;
        }
        self.outbox.push_back(Outgoing { bytes, fd, spawned });
        self.flush();
    }

    fn flush(&mut self) {
        while self.open {
            let Some(next) = self.outbox.front() else { return };
            let fds: Vec<RawFd> = next.fd.iter().map(AsRawFd::as_raw_fd).collect();
            match send(self.socket.as_fd(), &next.bytes, &fds, true) {
                Ok(()) => {
                    self.outbox.pop_front();
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => self.open = false,
            }
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Children handed to a supervisor that never heard of them: nobody supervises them.
        for outgoing in &self.outbox {
            if let Some(pid) = outgoing.spawned {
                let _gone = proc::signal_group(pid, Signal::SIGKILL);
            }
        }
    }
}

/// Every child not reaped yet, with its start time: registered by the creator thread that
/// made it before anything else may reap it ([`Keeper::reap`] leaves a child it does not
/// know of for later).
type Children = Arc<Mutex<HashMap<u32, u64>>>;

/// One spawn for a creator thread: whose it is, and what it needs.
struct Job {
    peer: u64,
    seq: u64,
    creation: Box<crate::spawn::Creation>,
    /// Held by the child until its exec, then closed here.
    held: Vec<OwnedFd>,
    passed: Vec<OwnedFd>,
}

/// How a job went: the child, its start time and its pidfd.
struct Created {
    peer: u64,
    seq: u64,
    result: io::Result<(u32, u64, OwnedFd)>,
}

/// The threads that create processes, each suspended from a child's creation to its exec,
/// so that the execs of a burst run side by side (as the supervisor's own spawn threads do).
/// They live as long as the keeper: a child's parent-death signal follows the thread that
/// created it, not the process.
struct Creators {
    jobs: mpsc::Sender<Job>,
    done: mpsc::Receiver<Created>,
    /// Readable once a job is done: one byte per job.
    wake: OwnedFd,
    /// Jobs given and not answered yet.
    in_flight: usize,
}

/// As many creator threads as the machine runs threads at once, up to this.
const MAX_CREATORS: usize = 4;

impl Creators {
    fn start(children: &Children) -> io::Result<Self> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let (finished, done) = mpsc::channel::<Created>();
        let (wake, woken) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)?;
        let queue = Arc::new(Mutex::new(queue));
        let woken = Arc::new(woken);
        let count = std::thread::available_parallelism().map_or(1, usize::from).clamp(1, MAX_CREATORS);
        for _ in 0..count {
            let (queue, finished, woken, children) =
                (Arc::clone(&queue), finished.clone(), Arc::clone(&woken), Arc::clone(children));
            std::thread::Builder::new().name("tether-keeper".to_owned()).spawn(move || {
                loop {
                    let Ok(job) = lock(&queue).recv() else { return };
                    let Job { peer, seq, creation, held, passed } = job;
                    let result = crate::spawn::create(&creation, passed).and_then(|pid| {
                        // Registered before anything may reap it: the stat and the pidfd are
                        // the child's.
                        let start_time = proc::read_stat(pid).map(|stat| stat.start_time).unwrap_or(0);
                        let pidfd = proc::pidfd_open(pid);
                        lock(&children).insert(pid, start_time);
                        match pidfd {
                            Ok(pidfd) => Ok((pid, start_time, pidfd)),
                            Err(error) => {
                                let _gone = proc::signal_group(pid, Signal::SIGKILL);
                                Err(io::Error::other(format!("cannot watch the new process {pid}: {error}")))
                            }
                        }
                    });
                    drop(held);
                    if finished.send(Created { peer, seq, result }).is_err() {
                        return;
                    }
                    let _ = nix::unistd::write(&*woken, &[1]);
                }
            })?;
        }
        Ok(Self { jobs, done, wake, in_flight: 0 })
    }
}

struct Keeper {
    /// Closed once retired.
    listener: Option<OwnedFd>,
    supervisors: Vec<Peer>,
    next_peer: u64,
    children: Children,
    creators: Creators,
    /// Exits that happened while no supervisor was connected, oldest first.
    unheard: VecDeque<Exit>,
    retired: bool,
    buffer: Vec<u8>,
    /// A child exited before its creator registered it: reaped once a creation is told.
    /// Without such a child, a creation reaps nothing, and no `waitid` is spent on it
    /// (each one walks every child: at 10 000 children, once per creation made bring-up
    /// quadratic).
    exited_unregistered: bool,
}

impl Keeper {
    /// Waits until something is to be done: SIGCHLD, a supervisor to accept, the indices of
    /// supervisors with a message (or gone).
    fn wait(&self, signals: BorrowedFd<'_>) -> io::Result<(bool, bool, bool, Vec<usize>)> {
        let mut fds =
            vec![PollFd::new(signals, PollFlags::POLLIN), PollFd::new(self.creators.wake.as_fd(), PollFlags::POLLIN)];
        if let Some(listener) = &self.listener {
            fds.push(PollFd::new(listener.as_fd(), PollFlags::POLLIN));
        }
        let first_supervisor = fds.len();
        fds.extend(self.supervisors.iter().map(|supervisor| {
            let events =
                if supervisor.outbox.is_empty() { PollFlags::POLLIN } else { PollFlags::POLLIN | PollFlags::POLLOUT };
            PollFd::new(supervisor.socket.as_fd(), events)
        }));
        loop {
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => break,
                Err(nix::errno::Errno::EINTR) => {}
                Err(error) => return Err(error.into()),
            }
        }
        let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|events| !events.is_empty());
        let signalled = ready(&fds[0]);
        let created = ready(&fds[1]);
        let accept = self.listener.is_some() && ready(&fds[2]);
        let readable = fds[first_supervisor..].iter().enumerate().filter(|(_, fd)| ready(fd)).map(|(i, _)| i).collect();
        Ok((signalled, created, accept, readable))
    }

    /// Accepts one supervisor, if it runs as the keeper's own user (or as root).
    fn accept(&mut self) {
        let Some(listener) = &self.listener else { return };
        let Ok(connection) = socket::accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC) else { return };
        #[allow(unsafe_code)]
        // SAFETY: accept4 just returned this descriptor; nothing else owns it.
        let connection = unsafe { OwnedFd::from_raw_fd(connection) };
        let allowed = socket::getsockopt(&connection, socket::sockopt::PeerCredentials)
            .is_ok_and(|peer| peer.uid() == 0 || peer.uid() == nix::unistd::geteuid().as_raw());
        if allowed {
            self.add_peer(connection);
        }
    }

    fn add_peer(&mut self, socket: OwnedFd) {
        self.next_peer += 1;
        self.supervisors.push(Peer::new(self.next_peer, socket));
    }

    /// Reads and answers one message of supervisor `index`; false once it is gone.
    fn serve_one(&mut self, index: usize) -> bool {
        let (length, fds) = match receive(self.supervisors[index].socket.as_fd(), &mut self.buffer, true) {
            Ok(Some(received)) => received,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => return true,
            Ok(None) | Err(_) => return false,
        };
        let request = match Request::decode(&self.buffer[..length]) {
            Ok(request) => request,
            // A supervisor that speaks another language is not one of ours.
            Err(_) => return false,
        };
        match request {
            Request::Hello => {
                let children =
                    lock(&self.children).iter().map(|(&pid, &start_time)| Kept { pid, start_time }).collect();
                let exits = self.unheard.drain(..).collect();
                let welcome = Answer::Welcome { build: build(), pid: std::process::id(), children, exits };
                self.supervisors[index].post(welcome.encode(), None, None);
                true
            }
            Request::Retire => {
                self.retired = true;
                self.listener = None;
                true
            }
            Request::Spawn { seq, held, creation } => {
                let refused = |message: &str| Answer::Failed { seq, errno: 0, message: message.to_owned() }.encode();
                let held = usize::try_from(held).unwrap_or(usize::MAX);
                if self.retired {
                    self.supervisors[index].post(refused("the keeper was retired"), None, None);
                } else if held > fds.len() {
                    self.supervisors[index].post(refused("the spawn's descriptors did not arrive"), None, None);
                } else {
                    // The held ones stay in this table until the child has its copies.
                    let mut held_fds = fds;
                    let passed = held_fds.split_off(held);
                    let job = Job { peer: self.supervisors[index].id, seq, creation, held: held_fds, passed };
                    if self.creators.jobs.send(job).is_ok() {
                        self.creators.in_flight += 1;
                    } else {
                        self.supervisors[index].post(refused("the keeper cannot create processes"), None, None);
                    }
                }
                true
            }
        }
    }

    /// Answers the spawns that the creator threads finished. A child whose supervisor is
    /// gone is killed: nobody would supervise it.
    fn answer_spawns(&mut self) {
        let mut drained = [0u8; 64];
        while matches!(nix::unistd::read(&self.creators.wake, &mut drained), Ok(n) if n > 0) {}
        while let Ok(Created { peer, seq, result }) = self.creators.done.try_recv() {
            self.creators.in_flight = self.creators.in_flight.saturating_sub(1);
            let to = self.supervisors.iter_mut().find(|supervisor| supervisor.id == peer && supervisor.open);
            match (result, to) {
                (Ok((pid, start_time, pidfd)), Some(to)) => {
                    let spawned = Answer::Spawned { seq, process: Kept { pid, start_time } };
                    to.post(spawned.encode(), Some(pidfd), Some(pid));
                }
                (Ok((pid, _, _)), None) => {
                    let _gone = proc::signal_group(pid, Signal::SIGKILL);
                }
                (Err(error), Some(to)) => {
                    let failed =
                        Answer::Failed { seq, errno: error.raw_os_error().unwrap_or(0), message: error.to_string() };
                    to.post(failed.encode(), None, None);
                }
                (Err(_), None) => {}
            }
        }
    }

    /// Reaps every child that exited: first its process group is swept (SIGKILL), while the
    /// unreaped leader holds the group's id, then it is reaped and its exit told.
    fn reap(&mut self) {
        self.exited_unregistered = false;
        loop {
            let mut info = std::mem::MaybeUninit::<libc::siginfo_t>::zeroed();
            #[allow(unsafe_code)]
            // SAFETY: waitid writes one siginfo_t into the place given, which is ours and of
            // that type; WNOWAIT leaves the child to be reaped below.
            let waited = unsafe {
                libc::waitid(libc::P_ALL, 0, info.as_mut_ptr(), libc::WEXITED | libc::WNOHANG | libc::WNOWAIT)
            };
            if waited != 0 {
                return; // ECHILD: no child at all
            }
            #[allow(unsafe_code)]
            // SAFETY: waitid returned 0, so the siginfo is initialised (zeroed, or filled in).
            let pid = unsafe { info.assume_init().si_pid() };
            let Ok(pid) = u32::try_from(pid) else { return };
            if pid == 0 {
                return; // children, none exited
            }
            if !lock(&self.children).contains_key(&pid) {
                // Its creator has not registered it yet: reaped once it has told of it.
                self.exited_unregistered = true;
                return;
            }
            let _empty = proc::signal_group(pid, Signal::SIGKILL);
            let mut status = 0;
            #[allow(unsafe_code)]
            // SAFETY: waitpid on our own exited child, with a status integer owned here.
            let reaped = unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) };
            if reaped <= 0 {
                return;
            }
            let start_time = lock(&self.children).remove(&pid).unwrap_or(0);
            self.tell(Exit { process: Kept { pid, start_time }, status });
        }
    }

    /// Tells every connected supervisor of `exit`, or keeps it for the next one.
    fn tell(&mut self, exit: Exit) {
        let message = Answer::Exited(exit).encode();
        let mut heard = false;
        for supervisor in self.supervisors.iter_mut().filter(|supervisor| supervisor.open) {
            supervisor.post(message.clone(), None, None);
            heard |= supervisor.open;
        }
        if !heard {
            if self.unheard.len() == UNHEARD {
                self.unheard.pop_front();
            }
            self.unheard.push_back(exit);
        }
    }
}
