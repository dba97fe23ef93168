//! A supervisor's side of its keepers: the one it spawns through, started when first needed
//! or found running, and the older ones it only hears exits from.
//!
//! A [`Link`] is one connection to one keeper, read by a task of its own that hands each
//! answer to whoever waits for it. A keeper of another build (an agent upgraded in place) is
//! retired: it takes no more spawns and exits once its last child has, while this side still
//! hears of its children's exits.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
use tether_state::lock;
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

use super::wire::{Answer, Exit, Kept, MAX_MESSAGE, Request, build};
use super::{Keeper, receive, send};
use crate::proc::Pidfd;
use crate::spawn::Creation;

/// How long a keeper may take to answer its first message.
const WELCOME_TIMEOUT: Duration = Duration::from_secs(10);

/// How long an exit may take to be told once the process's pidfd said it exited: the keeper
/// reaps at once, so this bounds only a keeper that hangs.
const EXIT_TIMEOUT: Duration = Duration::from_secs(5);

/// How many exits a link keeps that nobody asked for (processes no longer supervised).
const KEPT_EXITS: usize = 4096;

/// The keepers of one supervisor.
pub(crate) struct Keepers {
    keeper: Keeper,
    /// The keeper that new processes are spawned through, once there is one.
    current: tokio::sync::Mutex<Option<Arc<Link>>>,
    /// Every keeper heard from: the current one, those that went away, and those of other
    /// builds, retired, heard from until their children are gone.
    links: Mutex<Vec<Arc<Link>>>,
    /// The keeper processes this supervisor started, reaped when they exit.
    started: Mutex<tokio::task::JoinSet<()>>,
}

impl Keepers {
    /// Finds the keeper listening at `keeper`'s socket, if one is: one of this build spawns
    /// from now on; one of another build is retired. Either way its children's exits are
    /// heard from here on.
    pub(crate) async fn find(keeper: Keeper) -> Self {
        let keepers =
            Self { keeper, current: tokio::sync::Mutex::new(None), links: Mutex::default(), started: Mutex::default() };
        match Link::connect(&keepers.keeper.socket).await {
            Ok(Some(link)) if link.build == build() => {
                tracing::info!(keeper = link.pid, children = link.children(), "found the keeper of the proxies");
                lock(&keepers.links).push(link.clone());
                *keepers.current.lock().await = Some(link);
            }
            Ok(Some(link)) => {
                tracing::info!(
                    keeper = link.pid,
                    build = %link.build,
                    children = link.children(),
                    "found a keeper of another version: it keeps its proxies until they are replaced"
                );
                link.retire().await;
                lock(&keepers.links).push(link);
            }
            Ok(None) => {}
            Err(error) => tracing::warn!(%error, "cannot reach the keeper; a new one will be started"),
        }
        keepers
    }

    /// The keeper to spawn through: the current one, or a new one.
    pub(crate) async fn current(&self) -> io::Result<Arc<Link>> {
        let mut current = self.current.lock().await;
        if let Some(link) = current.as_ref().filter(|link| !link.is_closed()) {
            return Ok(link.clone());
        }
        let link = self.start().await?;
        let mut links = lock(&self.links);
        // One that went away and has no child left to tell of is of no more use.
        links.retain(|link| !link.is_closed());
        links.push(link.clone());
        drop(links);
        *current = Some(link.clone());
        Ok(link)
    }

    /// The keeper whose child `process` is, if any.
    pub(crate) fn owner(&self, process: Kept) -> Option<Arc<Link>> {
        lock(&self.links).iter().find(|link| link.owns(process)).cloned()
    }

    /// Starts a keeper: binds its socket under a temporary name, starts the program with
    /// the socket and one end of a connection, then puts the socket in place.
    async fn start(&self) -> io::Result<Arc<Link>> {
        let keeper = &self.keeper;
        let path = &keeper.socket;
        let temporary = temporary_path(path);
        let _ = std::fs::remove_file(&temporary);
        let listener = listen(&temporary)?;
        let (ours, theirs) = socket::socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        )?;
        let stderr = keeper.stderr.as_ref().map(File::try_clone).transpose()?;
        let fds = [listener.as_fd(), theirs.as_fd()];
        let started = crate::spawn::start_keeper(&keeper.program, &keeper.arg0, &keeper.args, fds, stderr);
        drop((listener, theirs));
        let child = match started {
            Ok(child) => child,
            Err(error) => {
                let _ = std::fs::remove_file(&temporary);
                return Err(error);
            }
        };
        let pid = child.id();
        // The keeper is our child until we die: reaped here when it exits.
        match Pidfd::open(pid) {
            Ok(pidfd) => {
                let mut child = child;
                lock(&self.started).spawn(async move {
                    let _ = pidfd.exited().await;
                    let _reaped = child.try_wait();
                });
            }
            Err(error) => tracing::warn!(pid, %error, "cannot watch the keeper; it stays a zombie once it exits"),
        }
        std::fs::rename(&temporary, path)?;
        let link = Link::open(ours).await?;
        if link.build != build() {
            return Err(io::Error::other(format!("the keeper started is of another build ({})", link.build)));
        }
        tracing::info!(keeper = link.pid, "started the keeper of the proxies");
        Ok(link)
    }
}

/// `.keeper.<pid>` beside `path`: short, for a socket's path has little room.
fn temporary_path(path: &Path) -> PathBuf {
    path.with_file_name(format!(".keeper.{}", std::process::id()))
}

/// A listening `SOCK_SEQPACKET` socket at `path`, mode 0600 from its creation.
fn listen(path: &Path) -> io::Result<OwnedFd> {
    let fd = socket::socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)?;
    nix::sys::stat::fchmod(&fd, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
    socket::bind(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    socket::listen(&fd, Backlog::new(64)?)?;
    Ok(fd)
}

/// One connection to one keeper.
pub(crate) struct Link {
    shared: Arc<Shared>,
    /// The keeper's build and pid, as it said.
    pub(crate) build: String,
    pub(crate) pid: u32,
    reader: tokio::task::AbortHandle,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("build", &self.build).field("pid", &self.pid).finish_non_exhaustive()
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

struct Shared {
    socket: AsyncFd<OwnedFd>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next_seq: u64,
    welcome: Option<oneshot::Sender<(String, u32)>>,
    pending: HashMap<u64, oneshot::Sender<io::Result<(Kept, OwnedFd)>>>,
    /// The keeper's children, as far as this side knows.
    children: HashSet<Kept>,
    /// Exits told and not asked for yet, and their order, oldest first.
    exits: HashMap<Kept, i32>,
    order: VecDeque<Kept>,
    waiting: HashMap<Kept, Vec<oneshot::Sender<Option<i32>>>>,
    closed: bool,
}

impl Link {
    /// Connects to the keeper at `path`: `None` when none listens there.
    async fn connect(path: &Path) -> io::Result<Option<Arc<Self>>> {
        let fd = socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )?;
        match socket::connect(fd.as_raw_fd(), &UnixAddr::new(path)?) {
            Ok(()) => {}
            Err(nix::errno::Errno::ENOENT | nix::errno::Errno::ECONNREFUSED) => return Ok(None),
            Err(error) => return Err(error.into()),
        }
        match Self::open(fd).await {
            Ok(link) => Ok(Some(link)),
            // A keeper that exits as we connect (nothing left to keep) is none.
            Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Starts reading `socket` (connected, non-blocking) and says hello.
    async fn open(socket: OwnedFd) -> io::Result<Arc<Self>> {
        #[allow(unsafe_code)]
        // SAFETY: the `AsyncFd` owns the `OwnedFd`, so the fd stays open and refers to the
        // same socket until the `AsyncFd` is dropped.
        let socket = unsafe {
            AsyncFd::register_with_interest(socket, tokio::io::Interest::READABLE | tokio::io::Interest::WRITABLE)
        }?;
        let shared = Arc::new(Shared { socket, state: Mutex::default() });
        let (welcome_tx, welcome_rx) = oneshot::channel();
        lock(&shared.state).welcome = Some(welcome_tx);
        let reader = tokio::spawn(read(shared.clone())).abort_handle();
        let welcome = async {
            shared.post(&Request::Hello.encode(), &[]).await?;
            match tokio::time::timeout(WELCOME_TIMEOUT, welcome_rx).await {
                Ok(Ok(welcome)) => Ok(welcome),
                Ok(Err(_)) => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the keeper hung up")),
                Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "the keeper did not answer")),
            }
        };
        match welcome.await {
            Ok((build, pid)) => Ok(Arc::new(Self { shared, build, pid, reader })),
            Err(error) => {
                reader.abort();
                Err(error)
            }
        }
    }

    fn is_closed(&self) -> bool {
        lock(&self.shared.state).closed
    }

    fn children(&self) -> usize {
        lock(&self.shared.state).children.len()
    }

    /// Whether `process` is a child of this keeper's, as far as this side knows.
    pub(crate) fn owns(&self, process: Kept) -> bool {
        lock(&self.shared.state).children.contains(&process)
    }

    /// Tells the keeper to take no more spawns and to exit once childless.
    async fn retire(&self) {
        if let Err(error) = self.shared.post(&Request::Retire.encode(), &[]).await {
            tracing::warn!(keeper = self.pid, %error, "cannot retire the keeper");
        }
    }

    /// Has the keeper create the process `creation` describes, from `fds` (after `held`,
    /// which its child holds until its exec). Returns once it exists, with its pidfd.
    ///
    /// # Cancel safety
    ///
    /// A process created for a caller that stopped waiting is killed.
    pub(crate) async fn spawn(
        &self,
        creation: &Creation,
        held: &[OwnedFd],
        fds: &[BorrowedFd<'_>],
    ) -> io::Result<(Kept, Pidfd)> {
        let (tx, rx) = oneshot::channel();
        let seq = {
            let mut state = lock(&self.shared.state);
            if state.closed {
                return Err(io::Error::other("the keeper went away"));
            }
            state.next_seq += 1;
            let seq = state.next_seq;
            state.pending.insert(seq, tx);
            seq
        };
        let request =
            Request::Spawn { seq, held: u32::try_from(held.len()).unwrap_or(0), creation: Box::new(creation.clone()) };
        let mut raw: Vec<RawFd> = held.iter().map(AsRawFd::as_raw_fd).collect();
        raw.extend(fds.iter().map(AsRawFd::as_raw_fd));
        if let Err(error) = self.shared.post(&request.encode(), &raw).await {
            lock(&self.shared.state).pending.remove(&seq);
            return Err(error);
        }
        let (process, pidfd) = rx.await.map_err(|_| io::Error::other("the keeper went away"))??;
        Ok((process, Pidfd::from_owned(pidfd)?))
    }

    /// How `process` ended, as its keeper tells once it reaped it: `None` if the keeper
    /// went away, or did not tell in time.
    pub(crate) async fn exit_status(&self, process: Kept) -> Option<i32> {
        let rx = {
            let mut state = lock(&self.shared.state);
            if let Some(status) = state.exits.remove(&process) {
                return Some(status);
            }
            if state.closed {
                return None;
            }
            let (tx, rx) = oneshot::channel();
            state.waiting.entry(process).or_default().push(tx);
            rx
        };
        tokio::time::timeout(EXIT_TIMEOUT, rx).await.ok().and_then(Result::ok).flatten()
    }
}

impl Shared {
    /// Sends one message, waiting while the socket is full.
    async fn post(&self, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
        if bytes.len() > MAX_MESSAGE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the command line and environment are too large to hand to the keeper",
            ));
        }
        self.socket.async_io(tokio::io::Interest::WRITABLE, |fd| send(fd.as_fd(), bytes, fds, true)).await
    }

    fn handle(&self, answer: Answer, mut fds: Vec<OwnedFd>) {
        let mut state = lock(&self.state);
        match answer {
            Answer::Welcome { build, pid, children, exits } => {
                state.children.extend(children);
                for exit in exits {
                    state.heard(exit);
                }
                if let Some(welcome) = state.welcome.take() {
                    let _gone = welcome.send((build, pid));
                }
            }
            Answer::Spawned { seq, process } => {
                state.children.insert(process);
                let Some(pidfd) = fds.pop() else { return };
                let waiter = state.pending.remove(&seq);
                drop(state);
                if let Some(Err(Ok((_, pidfd)))) = waiter.map(|waiter| waiter.send(Ok((process, pidfd)))) {
                    // Nobody waits for it any more: it would run unsupervised.
                    kill(&pidfd);
                }
            }
            Answer::Failed { seq, errno, message } => {
                let error = if errno != 0 { io::Error::from_raw_os_error(errno) } else { io::Error::other(message) };
                if let Some(waiter) = state.pending.remove(&seq) {
                    let _gone = waiter.send(Err(error));
                }
            }
            Answer::Exited(exit) => state.heard(exit),
        }
    }

    fn close(&self) {
        let mut state = lock(&self.state);
        state.closed = true;
        state.welcome = None;
        for (_, waiter) in state.pending.drain() {
            let _gone = waiter.send(Err(io::Error::other("the keeper went away")));
        }
        for (_, waiters) in state.waiting.drain() {
            for waiter in waiters {
                let _gone = waiter.send(None);
            }
        }
    }
}

impl State {
    fn heard(&mut self, exit: Exit) {
        self.children.remove(&exit.process);
        if let Some(waiters) = self.waiting.remove(&exit.process) {
            for waiter in waiters {
                let _gone = waiter.send(Some(exit.status));
            }
            return;
        }
        if self.order.len() == KEPT_EXITS {
            if let Some(oldest) = self.order.pop_front() {
                self.exits.remove(&oldest);
            }
        }
        self.order.push_back(exit.process);
        self.exits.insert(exit.process, exit.status);
    }
}

/// SIGKILL through a pidfd (the keeper sweeps its group once it exits).
fn kill(pidfd: &OwnedFd) {
    #[allow(unsafe_code)]
    // SAFETY: `pidfd_send_signal(2)` takes a pidfd, a signal number, a null siginfo and flags;
    // it touches no memory of ours.
    let _ = unsafe {
        libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), libc::SIGKILL, std::ptr::null::<u8>(), 0)
    };
}

/// The reading task of a link: hands every answer to whoever waits for it, until the keeper
/// hangs up.
async fn read(shared: Arc<Shared>) {
    let mut buffer = vec![0u8; MAX_MESSAGE];
    loop {
        let received =
            shared.socket.async_io(tokio::io::Interest::READABLE, |fd| receive(fd.as_fd(), &mut buffer, true)).await;
        let (length, fds) = match received {
            Ok(Some(received)) => received,
            Ok(None) => break,
            Err(error) => {
                tracing::warn!(%error, "lost the keeper");
                break;
            }
        };
        match Answer::decode(&buffer[..length]) {
            Ok(answer) => shared.handle(answer, fds),
            Err(error) => {
                tracing::warn!(%error, "the keeper said something this agent does not understand");
                break;
            }
        }
    }
    shared.close();
}
