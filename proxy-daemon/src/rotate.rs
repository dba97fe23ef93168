//! Log rotation by copy-and-truncate, driven by inotify.
//!
//! This module owns the one thread that watches every supervised log file and rotates a
//! file once it passes its cap: the file is copied and truncated, so the process keeps
//! appending to the same fd, then `<file>.N-1` becomes `<file>.N`, …, and the copy
//! `<file>.1`. A copy never holds more than the cap: what a late rotation finds past it
//! becomes further copies, each at most the cap ([`rotate`]). A file that would reach its
//! threshold within a second at its rate has its first bytes copied as it grows
//! ([`Staged`]), so that between the check that finds it past its threshold and its
//! truncation only the bytes written since the last check are copied: on a busy disk,
//! copying a whole file took long enough for a fast writer to double it meanwhile. The thread is its own, not a task of the runtime, so that
//! how soon a fast writer's file is rotated depends on the kernel scheduling one thread,
//! never on a runtime busy with other work or a blocking pool's queue. It never
//! polls: a file is watched with `IN_MODIFY | IN_ONESHOT`, so a burst of writes costs one
//! wake-up, and the size is checked with one `stat`. The watch is re-armed after a pause
//! that follows how fast the file grows: at most a second for a file that grows slowly,
//! and short enough for a fast writer that the file cannot pass its threshold by more than
//! 2.5 % of its cap before the next check ([`rearm_delay`]). The threshold is the cap, less
//! what a fast writer would add while the file is copied or the thread waits for a core
//! ([`rotation_threshold`]), so that a live log stays within a tenth of its cap at 50 MB/s
//! unless the machine keeps the thread from running for tens of milliseconds. An idle agent therefore never
//! wakes up here. It never opens a log for the process and never deletes a live log file.
//!
//! The same thread sends the lines of a process whose output goes to the journal
//! ([`crate::journal`]): at each check of such a file it reads what was appended since the
//! last one, and it reads up to the end of a file before it truncates it, so that a
//! rotation loses no line for the journal but what is written while it copies.
//!
//! Every file is reached through the log directory's handle, never by path: a link
//! planted at a log's name or at a rotated copy's name is never followed, its target never
//! read, written or truncated. Copies are new 0600 files.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use tether_state::persist::{Durability, PersistError};

use crate::journal::{Handover, JournalSink, Sender, Tee};
use crate::spec::{LogFile, LogPolicy, LogSpec};

/// The longest a file that was just written stays unwatched: the rate limit of the checks
/// of a file that grows slowly.
const REARM_MAX: Duration = Duration::from_secs(1);

/// The shortest pause between two checks of one file, however fast it grows.
const REARM_MIN: Duration = Duration::from_millis(2);

/// How long a file stays unwatched after a check that found it at `size`, given the size
/// at which it is rotated (`threshold`) and how fast it grew since the check before
/// (`rate`, bytes per second; `None` when unknown): half the time it would take to pass
/// its threshold by a fortieth of its cap, so that however fast it grows it is checked again
/// before that (at once while the rate is not known yet); a second at most.
fn rearm_delay(size: u64, threshold: u64, max_size: u64, rate: Option<f64>) -> Duration {
    let headroom = (threshold + max_size / 40).saturating_sub(size) as f64;
    let seconds = match rate {
        Some(rate) if rate > 0.0 => headroom / rate / 2.0,
        Some(_) => return REARM_MAX,
        None => return REARM_MIN,
    };
    Duration::try_from_secs_f64(seconds).unwrap_or(REARM_MAX).clamp(REARM_MIN, REARM_MAX)
}

/// How fast a file grew from `before` to `size` in `elapsed`, in bytes a second; `None`
/// when it shrank (truncated by someone else) or no time passed.
fn growth(elapsed: Duration, before: u64, size: u64) -> Option<f64> {
    let seconds = elapsed.as_secs_f64();
    (size >= before && seconds > 0.0).then(|| (size - before) as f64 / seconds)
}

/// The rate to plan with after a new `sample` taken over `elapsed`: a faster sample at
/// once; a slower one lowers it by half at most, and only when it spans long enough to
/// mean something ([`RATE_SPAN`]), so that a check right after another (the watch re-armed,
/// then its first event) never reads a pause between two writes as a writer gone quiet.
fn next_rate(rate: Option<f64>, sample: Option<f64>, elapsed: Duration) -> Option<f64> {
    match (rate, sample) {
        (Some(rate), Some(sample)) if sample < rate => {
            Some(if elapsed >= RATE_SPAN { sample.max(rate / 2.0) } else { rate })
        }
        (rate, None) => rate,
        (_, sample) => sample,
    }
}

/// The shortest span whose growth may lower a file's rate: a second. A writer that a busy
/// machine starves for a while catches up in a burst, so a slower sample over a short span
/// says nothing of how fast the file may grow next; planning with it once let a check wait
/// 235 ms while a writer at 50 MB/s took its file from 5 to 13.7 MB. A writer that truly
/// slowed down is checked a little more often than it needs until a second shows it.
const RATE_SPAN: Duration = Duration::from_secs(1);

/// How long a busy machine may keep the rotation thread from running once a check is due:
/// a fast writer is rotated early by what it writes in that time too.
const SCHEDULING_SLACK: Duration = Duration::from_millis(20);

/// The size past which a file is rotated: its cap, less what it would grow by during a
/// rotation (twice the last one's length at its current rate) and while the thread waits
/// for a core ([`SCHEDULING_SLACK`]), at most a tenth of the cap. The live file then stays
/// near the cap, instead of past it by what a fast writer wrote while the file was being
/// copied or the thread waited; the copies hold at most the cap in any case ([`rotate`]).
fn rotation_threshold(max_size: u64, rate: Option<f64>, rotation_took: Duration) -> u64 {
    let during = rate.unwrap_or(0.0) * (rotation_took.as_secs_f64() * 2.0 + SCHEDULING_SLACK.as_secs_f64());
    let early = (during as u64).min(max_size / 10);
    max_size - early
}

/// One stream of one supervised process.
/// A process's key and a stream (0 stdout, 1 stderr) in one word: a key in three tables of
/// two entries per process, where every byte counts twice.
type FileKey = u64;

fn file_key(process: u64, stream: u8) -> FileKey {
    process << 1 | u64::from(stream & 1)
}

enum Command {
    Watch(Box<Watch>),
    Limits { process: u64, limits: LogPolicy, journal: Option<(Arc<JournalSink>, Arc<Handover>)> },
    Forget { process: u64 },
}

/// An instance's log files to watch.
struct Watch {
    process: u64,
    files: [LogFile; 2],
    limits: LogPolicy,
    /// Where its lines go in the journal, if they do, with where the last instance's lines
    /// end and which instance this is ([`Handover::hold`]; 0 for the first).
    journal: Option<(Arc<JournalSink>, Arc<Handover>, u64)>,
    pid: u32,
    /// The files' sizes before the instance was started, where its lines begin; `None`
    /// when not known (an adopted instance): from their ends.
    from: Option<[u64; 2]>,
}

/// The sending side of the rotation thread. Dropping it ends the thread and joins it.
#[derive(Debug)]
pub(crate) struct Rotator {
    /// `None` once dropped.
    commands: Option<mpsc::Sender<Command>>,
    /// One byte written per command (and at the end) wakes the thread.
    wake: OwnedFd,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Rotator {
    /// Starts the rotation thread.
    pub(crate) fn start() -> io::Result<Self> {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
        let (woken, wake) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)?;
        let (commands, receiver) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tether-rotate".to_owned())
            .spawn(move || run(&inotify, &woken, &receiver))?;
        Ok(Self { commands: Some(commands), wake, thread: Some(thread) })
    }

    fn send(&self, command: Command) {
        if let Some(commands) = &self.commands {
            let _thread_gone = commands.send(command);
            self.wake();
        }
    }

    fn wake(&self) {
        // A full pipe already wakes the thread.
        let _ = nix::unistd::write(&self.wake, &[1]);
    }

    /// Watches the two log files of `process`, whose instance `pid` writes them from
    /// `from` on (their sizes before it started, if known), replacing any earlier
    /// registration; the lines go to `journal` too, if given, with the process's
    /// [`Handover`] and the generation of this instance ([`Handover::hold`]; 0 for the first).
    pub(crate) fn watch(
        &self,
        process: u64,
        logs: &LogSpec,
        journal: Option<(Arc<JournalSink>, Arc<Handover>, u64)>,
        pid: u32,
        from: Option<[u64; 2]>,
    ) {
        let files = [logs.stdout.clone(), logs.stderr.clone()];
        let limits = logs.limits;
        self.send(Command::Watch(Box::new(Watch { process, files, limits, journal, pid, from })));
    }

    /// Changes the limits of `process`'s files, and where their lines go.
    pub(crate) fn set_limits(
        &self,
        process: u64,
        limits: LogPolicy,
        journal: Option<(Arc<JournalSink>, Arc<Handover>)>,
    ) {
        self.send(Command::Limits { process, limits, journal });
    }

    /// Stops watching `process`'s files.
    pub(crate) fn forget(&self, process: u64) {
        self.send(Command::Forget { process });
    }
}

impl Drop for Rotator {
    fn drop(&mut self) {
        // The thread ends once it finds the channel closed: at most one rotation from now.
        self.commands = None;
        self.wake();
        if let Some(thread) = self.thread.take() {
            let _panicked = thread.join();
        }
    }
}

/// `Inotify` with the `AsRawFd` that `AsyncFd` needs.
pub(crate) struct InotifyFd(pub(crate) Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

struct Watched {
    file: LogFile,
    limits: LogPolicy,
    watch: Option<WatchDescriptor>,
    /// When the file was last checked, and its size then: its growth tells the next pause.
    checked: Option<(Instant, u64)>,
    /// How fast it grew between its last two checks, in bytes a second. (Single
    /// precision, and the rotation's length in microseconds below: every supervised process
    /// has two of these, and a planning figure needs no more.)
    rate: Option<f32>,
    /// How long its growth has been measured, in milliseconds, up to [`RATE_SPAN`]: until
    /// then its rate plans no pause ([`Watched::planning_rate`]).
    measured_millis: u16,
    /// How long its last rotation took, in microseconds.
    rotation_took_micros: u32,
    /// The copy of its first bytes made while it nears its threshold ([`Staged`]).
    staged: Option<Box<Staged>>,
    /// The instance that writes it.
    pid: u32,
    /// Its lines on their way to the journal, if they go there.
    tee: Option<Box<Tee>>,
}

impl Watched {
    /// The rate that plans the pause before the next check: none until the growth has been
    /// measured over [`RATE_SPAN`]. A writer's first milliseconds say little of its pace (a
    /// first sample of 64 KiB over 6 ms once read as 11.6 MB/s planned a 451 ms pause in
    /// which a writer at 50 MB/s took its file to 22 MB), so a new file is checked at the
    /// shortest pause for its first second of writes.
    fn planning_rate(&self) -> Option<f64> {
        self.rate.filter(|_| u128::from(self.measured_millis) >= RATE_SPAN.as_millis()).map(f64::from)
    }

    fn threshold(&self) -> u64 {
        let took = Duration::from_micros(u64::from(self.rotation_took_micros));
        rotation_threshold(self.limits.max_size, self.rate.map(f64::from), took)
    }
}

struct State<'a> {
    inotify: &'a Inotify,
    journal: Sender,
    /// Boxed: the table keeps a fifth or more of its slots free, each as large as its value.
    files: HashMap<FileKey, Box<Watched>>,
    by_watch: HashMap<WatchDescriptor, FileKey>,
    /// Files to watch again, the earliest deadline first.
    rearm: BinaryHeap<Reverse<(Instant, FileKey)>>,
}

/// The rotation thread: waits for inotify's events, the commands (told by a byte on
/// `woken`) and the next re-arm deadline, until the commands' channel closes.
fn run(inotify: &Inotify, woken: &OwnedFd, commands: &mpsc::Receiver<Command>) {
    let mut state = State {
        inotify,
        journal: Sender::new(),
        files: HashMap::new(),
        by_watch: HashMap::new(),
        rearm: BinaryHeap::new(),
    };
    loop {
        let next_rearm = state.rearm.peek().map(|Reverse((deadline, _))| *deadline);
        let timeout = match next_rearm {
            None => PollTimeout::NONE,
            Some(deadline) => {
                // Rounded up: a wake-up before the deadline would only wait again.
                let wait = deadline.saturating_duration_since(Instant::now()) + Duration::from_micros(999);
                PollTimeout::try_from(wait).unwrap_or(PollTimeout::MAX)
            }
        };
        let mut fds = [PollFd::new(inotify.as_fd(), PollFlags::POLLIN), PollFd::new(woken.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(error) => {
                tracing::error!(%error, "cannot wait for log events; log rotation stopped");
                return;
            }
        }
        let mut drained = [0; 64];
        while matches!(nix::unistd::read(woken, &mut drained), Ok(n) if n > 0) {}
        loop {
            match commands.try_recv() {
                Ok(command) => state.apply(command),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
        match inotify.read_events() {
            Ok(events) => {
                for event in events {
                    state.on_event(event.wd, event.mask);
                }
            }
            Err(nix::errno::Errno::EAGAIN) => {}
            Err(error) => tracing::warn!(%error, "failed to read inotify events"),
        }
        let now = Instant::now();
        while let Some(&Reverse((deadline, key))) = state.rearm.peek() {
            if deadline > now {
                break;
            }
            state.rearm.pop();
            state.arm(key);
        }
    }
}

impl State<'_> {
    fn apply(&mut self, command: Command) {
        match command {
            Command::Watch(watch) => {
                let Watch { process, files, limits, journal, pid, from } = *watch;
                for (stream, file) in (0u8..).zip(files) {
                    let key = file_key(process, stream);
                    let from = from.map(|sizes| sizes[usize::from(stream)]);
                    // The lines of the instance before, up to where this one's begin.
                    let (watch, tee) = match self.files.remove(&key) {
                        Some(mut old) => {
                            self.forward(&mut old, true);
                            (old.watch, old.tee)
                        }
                        None => (None, None),
                    };
                    let mut watched = Watched {
                        file,
                        limits,
                        watch,
                        checked: None,
                        rate: None,
                        measured_millis: 0,
                        rotation_took_micros: 0,
                        staged: None,
                        pid,
                        tee,
                    };
                    let sink = journal.as_ref().map(|(sink, handover, _)| (sink, handover));
                    watched.tee = tee_for(&mut watched, sink, stream, from);
                    self.files.insert(key, Box::new(watched));
                }
                if let Some((_, handover, generation)) = &journal {
                    handover.release(*generation);
                }
                for stream in 0..2 {
                    self.arm(file_key(process, stream));
                }
            }
            Command::Limits { process, limits, journal } => {
                for stream in 0..2 {
                    if let Some(mut file) = self.files.remove(&file_key(process, stream)) {
                        file.limits = limits;
                        if journal.is_none() {
                            self.forward(&mut file, false);
                        }
                        let sink = journal.as_ref().map(|(sink, handover)| (sink, handover));
                        file.tee = tee_for(&mut file, sink, stream, None);
                        self.files.insert(file_key(process, stream), file);
                    }
                }
                for stream in 0..2 {
                    self.check(file_key(process, stream));
                }
            }
            Command::Forget { process } => {
                for stream in 0..2 {
                    let Some(mut watched) = self.files.remove(&file_key(process, stream)) else { continue };
                    // Its last lines, which an event not yet read may tell of.
                    self.forward(&mut watched, true);
                    if let Some(watch) = watched.watch {
                        self.by_watch.remove(&watch);
                        // A one-shot watch that already fired is gone: EINVAL is expected.
                        let _already_removed = self.inotify.rm_watch(watch);
                    }
                }
            }
        }
    }

    fn on_event(&mut self, watch: WatchDescriptor, mask: AddWatchFlags) {
        let Some(key) = self.by_watch.remove(&watch) else {
            return; // the IN_IGNORED that follows every one-shot event, or a forgotten file
        };
        if let Some(file) = self.files.get_mut(&key) {
            if file.watch == Some(watch) {
                file.watch = None;
            }
        }
        if mask.contains(AddWatchFlags::IN_IGNORED) {
            // The file was deleted or its file system unmounted: the next start of the
            // process creates it again and registers it anew.
            return;
        }
        let size = self.check(key);
        let Some(watched) = self.files.get(&key) else { return };
        let delay = rearm_delay(size, watched.threshold(), watched.limits.max_size, watched.planning_rate());
        self.rearm.push(Reverse((Instant::now() + delay, key)));
    }

    /// Watches `key`'s file (again), then checks it: writes since the last event may
    /// already have taken it past its cap.
    fn arm(&mut self, key: FileKey) {
        let Some(watched) = self.files.get_mut(&key) else {
            return; // forgotten while it waited to be re-armed
        };
        // inotify has no `*at` form, so the watch is placed by path. It only decides when to
        // check: a watch misplaced by a planted link costs a needless check, and the check
        // itself goes through the directory's handle. IN_DONT_FOLLOW watches a link at the
        // name itself, which never reports a write.
        let path = watched.file.path();
        let flags = AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_ONESHOT | AddWatchFlags::IN_DONT_FOLLOW;
        match self.inotify.add_watch(&path, flags) {
            Ok(watch) => {
                watched.watch = Some(watch);
                self.by_watch.insert(watch, key);
            }
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "failed to watch log file");
                return;
            }
        }
        self.check(key);
    }

    /// Sends the lines `watched`'s file gained since the last look to the journal (up to
    /// where its instance's lines end, [`Handover`]); with `gone`, the rest of an incomplete
    /// line too: its writer is gone. Nothing for a file whose lines do not go there.
    fn forward(&mut self, watched: &mut Watched, gone: bool) {
        let Some(tee) = &mut watched.tee else { return };
        let log = &watched.file;
        let Ok(Some((live, size))) = open_live(log) else { return };
        tee.forward_reported(&mut self.journal, &live, size, log);
        if gone {
            // Not sent (the journal is gone too): the line is in the log file.
            let _not_sent = tee.finish(&mut self.journal);
        }
    }

    /// Rotates `key`'s file if it is past its threshold; returns its size after the check
    /// (0 after a rotation, or when it cannot be read). Notes the file's growth, and sends
    /// its new lines to the journal if they go there.
    fn check(&mut self, key: FileKey) -> u64 {
        let Some(watched) = self.files.get_mut(&key) else {
            return 0;
        };
        let (log, limits) = (watched.file.clone(), watched.limits);
        // Most checks find a small file: one stat says so, without opening it.
        let seen = log.dir().regular_size(log.name());
        if let (Some(tee), Some(size)) = (&mut watched.tee, seen) {
            if size != tee.offset() {
                if let Ok(Some((live, size))) = open_live(&log) {
                    tee.forward_reported(&mut self.journal, &live, size, &log);
                }
            }
        }
        let now = Instant::now();
        if let Some(size) = seen {
            if let Some((then, before)) = watched.checked {
                let span = u16::try_from(now.duration_since(then).as_millis()).unwrap_or(u16::MAX);
                let most = u16::try_from(RATE_SPAN.as_millis()).unwrap_or(u16::MAX);
                watched.measured_millis = watched.measured_millis.saturating_add(span).min(most);
                let sample = growth(now.duration_since(then), before, size);
                let rate = next_rate(watched.rate.map(f64::from), sample, now.duration_since(then));
                watched.rate = rate.map(|rate| rate as f32);
            }
            watched.checked = Some((now, size));
        }
        let threshold = watched.threshold();
        if let Some(size) = seen.filter(|&size| size <= threshold) {
            if nears_threshold(size, threshold, watched.rate.map(f64::from)) {
                let staged = watched.staged.take();
                watched.staged = stage(&log, limits, staged);
            } else {
                // A writer that slowed down: nothing is held for it meanwhile.
                watched.staged = None;
            }
            return size;
        }
        let staged = watched.staged.take();
        let (live, size) = match open_live(&log) {
            Ok(Some(live)) => live,
            Ok(None) => {
                tracing::debug!(path = %log.path().display(), "no log file to check");
                return 0;
            }
            Err(error) => {
                tracing::warn!(path = %log.path().display(), error = %cause(&error), "log file not checked for rotation");
                return 0;
            }
        };
        if size <= threshold {
            return size;
        }
        if let Some(tee) = self.files.get_mut(&key).and_then(|watched| watched.tee.as_mut()) {
            // Up to the end before it is truncated: the lines written while it is copied
            // are lost to the journal as to the copies.
            let end = live.metadata().map_or(size, |metadata| metadata.len());
            tee.forward_reported(&mut self.journal, &live, end, &log);
        }
        // The copy blocks this thread, and only this one.
        let started = Instant::now();
        let rotated = rotate(&log, &live, limits, staged.map(|staged| *staged));
        let ended = Instant::now();
        if let Some(watched) = self.files.get_mut(&key) {
            watched.rotation_took_micros = u32::try_from(ended.duration_since(started).as_micros()).unwrap_or(u32::MAX);
            watched.checked = Some((ended, 0));
            if let (Some(tee), Ok(_)) = (&mut watched.tee, &rotated) {
                tee.truncated();
            }
        }
        match rotated {
            Ok(copies) => tracing::info!(path = %log.path().display(), size, copies, "log file rotated"),
            Err(error) => {
                tracing::warn!(path = %error_path(&error), error = %cause(&error), "failed to rotate log file")
            }
        }
        0
    }
}

/// The journal's side of a file, taken from `watched`: its own, now for the instance that
/// writes it, when its lines go to `journal`; a new one from `from` (else the file's end)
/// when it had none, or one for another journal; none when they do not go there.
fn tee_for(
    watched: &mut Watched,
    journal: Option<(&Arc<JournalSink>, &Arc<Handover>)>,
    stream: u8,
    from: Option<u64>,
) -> Option<Box<Tee>> {
    let (journal, handover) = journal?;
    if let Some(mut tee) = watched.tee.take().filter(|tee| tee.is_for(journal)) {
        tee.set_pid(watched.pid);
        return Some(tee);
    }
    let from = from.or_else(|| watched.file.dir().regular_size(watched.file.name())).unwrap_or(0);
    Some(Box::new(Tee::new(Arc::clone(journal), stream, watched.pid, from, Arc::clone(handover))))
}

/// Opens the live log file without following a link, and measures it; `None` if there is
/// none. A link, a special file or a file with other hard links at its name is an error:
/// rotating it would copy or truncate something that is not the proxy's log.
fn open_live(log: &LogFile) -> Result<Option<(File, u64)>, PersistError> {
    let Some(live) = log.dir().open_regular(log.name())? else {
        return Ok(None);
    };
    let size = live.metadata().map_err(|source| PersistError::Read { path: log.path(), source })?.len();
    Ok(Some((live, size)))
}

/// The most one rotated copy holds: the cap and the tenth past it that a log may reach.
pub(crate) fn piece_size(max_size: u64) -> u64 {
    max_size + max_size / 10
}

/// The name of the `index`-th rotated copy of the log file `name`.
pub(crate) fn rotated_name(name: &str, index: u32) -> String {
    format!("{name}.{index}")
}

/// How far ahead of its threshold, at its current rate, a file's first bytes are copied
/// while it grows ([`stage`]).
const STAGE_AHEAD: Duration = Duration::from_secs(1);

/// Whether a file at `size` would pass its `threshold` within [`STAGE_AHEAD`] at `rate`
/// (bytes a second): then its first bytes are copied as it grows.
fn nears_threshold(size: u64, threshold: u64, rate: Option<f64>) -> bool {
    rate.is_some_and(|rate| size as f64 + rate * STAGE_AHEAD.as_secs_f64() >= threshold as f64)
}

/// The first bytes of a live log, copied while it grows towards its threshold, so that its
/// rotation has only the bytes written since to copy before it truncates the file: what a
/// fast writer adds between the check that finds it past its threshold and the truncation
/// is then what it writes while a tail is copied, not while the whole file is.
#[derive(Debug)]
struct Staged {
    /// The copy, under a temporary name of the log's directory (which a crash leaves for
    /// the next agent to remove), to become `<log>.1`.
    copy: tether_state::persist::Temporary,
    /// How many of the live file's first bytes it holds.
    length: u64,
    /// The live file's device and inode: a copy of another file is of no use.
    of: (u64, u64),
    /// The live file, held open so that its inode number is not given to another file
    /// while the copy is kept.
    _live: File,
}

/// The device and inode of `file`.
fn identity(file: &File) -> io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let metadata = file.metadata()?;
    Ok((metadata.dev(), metadata.ino()))
}

/// Copies the bytes `log` gained since `staged` was last brought up to date into it (a
/// piece's worth at most, [`piece_size`]), starting a new copy when there is none, or when
/// the file was replaced or truncated since; `None` when the file cannot be copied (the
/// rotation then copies it whole).
fn stage(log: &LogFile, limits: LogPolicy, staged: Option<Box<Staged>>) -> Option<Box<Staged>> {
    if limits.copies_kept() == 0 {
        return None; // nothing is kept: a rotation only truncates
    }
    let (live, size) = open_live(log).ok()??;
    let of = identity(&live).ok()?;
    let mut staged = match staged.filter(|staged| staged.of == of && staged.length <= size) {
        Some(staged) => staged,
        None => {
            let copy = log.dir().create_temporary(rotated_name(log.name(), 1)).ok()?;
            let held = live.try_clone().ok()?;
            Box::new(Staged { copy, length: 0, of, _live: held })
        }
    };
    let wanted = size.min(piece_size(limits.max_size)).saturating_sub(staged.length);
    staged.length += copy_from(&live, staged.length, wanted, staged.copy.file()).ok()?;
    Some(staged)
}

/// Appends up to `length` bytes of `live`, from `offset`, to `copy`; returns how many.
fn copy_from(live: &File, offset: u64, length: u64, mut copy: &File) -> io::Result<u64> {
    let mut live = live;
    io::Seek::seek(&mut live, io::SeekFrom::Start(offset))?;
    io::copy(&mut live.take(length), &mut copy)
}

/// Copies `live` (the log file `log`, opened by [`open_live`]) into new files, truncates
/// it, then shifts the rotated copies and puts the new ones in place, the newest as
/// `<log>.1`; returns how many copies it made.
///
/// A copy holds at most a tenth more than `limits.max_size` ([`piece_size`]): a file found
/// further past its cap (a rotation that came late, or a writer that went on while it was
/// copied) is copied in pieces of that size, each shifted along like a rotation of its
/// own, the oldest bytes in the highest index, and only the newest `limits.keep` of them
/// (older bytes would only be shifted out). So the cap holds for every copy whatever the
/// write rate. `staged`, a copy of the file's first bytes made while it grew, is the first
/// piece's beginning when it is of this file and those bytes are kept.
///
/// The file is truncated as soon as the copies are made, before any name changes, so that
/// what a fast writer adds before the truncation, and loses with it (as with any
/// copy-and-truncate), is what it writes while the bytes not staged are copied.
///
/// Renames move a link at a rotated name along, never following it; each copy is a new
/// 0600 file renamed over `<log>.1`, replacing whatever was there; only `live` is
/// truncated. Rotated copies are in the crash durability class: nothing is fsynced, as
/// the log itself is not; a copy not yet renamed when the agent dies keeps a temporary
/// name, which the next agent removes.
fn rotate(log: &LogFile, live: &File, limits: LogPolicy, staged: Option<Staged>) -> Result<u32, PersistError> {
    let (dir, name) = (log.dir(), log.name());
    let read_error = |source| PersistError::Read { path: log.path(), source };
    let piece = piece_size(limits.max_size);
    let mut pieces = Vec::new();
    let keep = limits.copies_kept();
    if keep > 0 {
        let size = live.metadata().map_err(read_error)?.len();
        // More than `keep` pieces: the oldest would only be shifted out, so they are skipped.
        let mut offset = size.saturating_sub(piece.saturating_mul(u64::from(keep)));
        let of = identity(live).map_err(read_error)?;
        let mut staged = staged.filter(|staged| offset == 0 && staged.of == of && staged.length <= size);
        while pieces.len() < keep as usize {
            let (copy, mut length) = match staged.take() {
                Some(Staged { copy, length, .. }) => (copy, length),
                None => (dir.create_temporary(rotated_name(name, 1))?, 0),
            };
            let copy_error = |source| PersistError::Write { path: dir.path().join(copy.name()), source };
            length += copy_from(live, offset + length, piece - length, copy.file()).map_err(copy_error)?;
            pieces.push(copy);
            offset += length;
            let size = live.metadata().map_err(read_error)?.len();
            if length < piece || size <= offset {
                break; // the end of the file: the rest fitted in this piece
            }
        }
    }
    live.set_len(0).map_err(|source| PersistError::Write { path: log.path(), source })?;
    let copies = u32::try_from(pieces.len()).unwrap_or(u32::MAX);
    for copy in pieces {
        for index in (1..keep).rev() {
            dir.rename(rotated_name(name, index), rotated_name(name, index + 1))?;
        }
        copy.persist(Durability::Crash)?;
    }
    Ok(copies)
}

/// The file a persistence error is about.
fn error_path(error: &PersistError) -> String {
    match error {
        PersistError::Write { path, .. } | PersistError::Read { path, .. } | PersistError::Encode { path, .. } => {
            path.display().to_string()
        }
        _ => String::new(),
    }
}

/// What went wrong, without the path (logged in its own field).
fn cause(error: &PersistError) -> String {
    match error {
        PersistError::Write { source, .. } | PersistError::Read { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;

    use tether_state::persist::{DataDir, UnsafeEntry};

    use super::*;

    #[test]
    fn a_fast_writer_is_checked_before_it_passes_its_cap_by_a_twentieth_and_a_slow_one_once_a_second() {
        const MIB: u64 = 1 << 20;
        let max = 10 * MIB;
        // 50 MB/s: wherever the file is, the next check comes before it passes the cap + 2.5 %.
        for size in [0, MIB, 5 * MIB, 9 * MIB, 10 * MIB, 10 * MIB + MIB / 8] {
            let delay = rearm_delay(size, max, max, Some(50e6));
            let grown = size as f64 + 50e6 * delay.as_secs_f64();
            assert!(grown <= (max + max / 40) as f64 || delay == REARM_MIN, "{size}: {delay:?}");
        }
        assert_eq!(rearm_delay(0, max, max, Some(1000.0)), REARM_MAX);
        assert_eq!(rearm_delay(MIB, max, max, Some(0.0)), REARM_MAX);
        assert_eq!(rearm_delay(MIB, max, max, None), REARM_MIN);
        assert_eq!(rearm_delay(20 * MIB, max, max, Some(50e6)), REARM_MIN);
    }

    #[test]
    fn a_rate_rises_at_once_and_falls_by_half_at_most_over_a_span_that_means_something() {
        let second = Duration::from_secs(1);
        assert_eq!(next_rate(None, Some(100.0), second), Some(100.0));
        assert_eq!(next_rate(Some(100.0), Some(500.0), Duration::from_millis(1)), Some(500.0));
        assert_eq!(next_rate(Some(100.0), Some(0.0), Duration::from_millis(1)), Some(100.0));
        assert_eq!(next_rate(Some(100.0), Some(0.0), second), Some(50.0));
        assert_eq!(next_rate(Some(100.0), Some(80.0), second), Some(80.0));
        assert_eq!(next_rate(Some(100.0), None, second), Some(100.0));
        assert_eq!(growth(second, 10, 5), None);
        assert_eq!(growth(Duration::ZERO, 5, 10), None);
        assert_eq!(growth(second / 2, 0, 100), Some(200.0));
    }

    #[test]
    fn a_fast_writer_is_rotated_early_by_what_it_writes_during_a_rotation_and_a_wait_and_a_slow_one_at_its_cap() {
        const MIB: u64 = 1 << 20;
        let max = 10 * MIB;
        // 50 MB/s and 5 ms a rotation: 1.5 MB early would be what it writes during the
        // copy and the scheduling slack; never more than a tenth early.
        assert_eq!(rotation_threshold(max, Some(50e6), Duration::from_millis(5)), max - max / 10);
        assert_eq!(rotation_threshold(max, Some(50e6), Duration::from_secs(1)), max - max / 10);
        // 10 MB/s: what 40 ms (twice 10 ms, and the slack) write.
        assert_eq!(rotation_threshold(max, Some(10e6), Duration::from_millis(10)), max - 400_000);
        // Before the first rotation, the slack alone.
        assert_eq!(rotation_threshold(max, Some(50e6), Duration::ZERO), max - 1_000_000);
        assert_eq!(rotation_threshold(max, Some(100.0), Duration::from_millis(10)), max - 4);
        assert_eq!(rotation_threshold(max, None, Duration::from_millis(10)), max);
    }

    #[test]
    fn a_rate_plans_pauses_only_once_it_was_measured_over_a_second() {
        let (_temp, log) = log_file();
        let mut watched = Watched {
            file: log,
            limits: LogPolicy { max_size: 10 << 20, keep: 3, ..LogPolicy::default() },
            watch: None,
            checked: None,
            rate: Some(11.6e6),
            measured_millis: 6,
            rotation_took_micros: 0,
            staged: None,
            pid: 0,
            tee: None,
        };
        assert_eq!(watched.planning_rate(), None, "6 ms of a writer's start say nothing of its pace");
        watched.measured_millis = 999;
        assert_eq!(watched.planning_rate(), None);
        watched.measured_millis = 1000;
        assert_eq!(watched.planning_rate(), Some(f64::from(11.6e6_f32)));
    }

    /// `web-proxy-stdout.log` in a new data dir's `logs/`.
    fn log_file() -> (tempfile::TempDir, LogFile) {
        let temp = tempfile::tempdir().unwrap();
        let data = DataDir::open(temp.path().join("data")).unwrap();
        let log = LogFile::new(data.logs().clone(), "web-proxy-stdout.log");
        (temp, log)
    }

    fn write_and_rotate(log: &LogFile, content: &str, keep: u32) {
        fs::write(log.path(), content).unwrap();
        let (live, _size) = open_live(log).unwrap().unwrap();
        rotate(log, &live, LogPolicy { max_size: 1 << 20, keep, ..LogPolicy::default() }, None).unwrap();
    }

    fn copy(log: &LogFile, index: u32) -> std::path::PathBuf {
        log.dir().path().join(rotated_name(log.name(), index))
    }

    fn mode(path: &Path) -> u32 {
        fs::symlink_metadata(path).unwrap().permissions().mode() & 0o777
    }

    /// A file outside the data dir, 0644, that must stay as it is.
    fn target(temp: &tempfile::TempDir) -> std::path::PathBuf {
        let path = temp.path().join("target");
        fs::write(&path, "not tether's\n").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        path
    }

    #[track_caller]
    fn assert_untouched(target: &Path) {
        assert_eq!(fs::read_to_string(target).unwrap(), "not tether's\n");
        assert_eq!(mode(target), 0o644);
    }

    #[test]
    fn rotation_shifts_copies_and_drops_the_oldest() {
        let (_temp, log) = log_file();
        for generation in 1..=4 {
            write_and_rotate(&log, &format!("generation {generation}"), 2);
        }
        assert_eq!(fs::read_to_string(log.path()).unwrap(), "");
        assert_eq!(fs::read_to_string(copy(&log, 1)).unwrap(), "generation 4");
        assert_eq!(fs::read_to_string(copy(&log, 2)).unwrap(), "generation 3");
        assert!(!copy(&log, 3).exists());
        assert_eq!(mode(&copy(&log, 1)), 0o600);
        assert_eq!(mode(&copy(&log, 2)), 0o600);
        let names: Vec<_> = fs::read_dir(log.dir().path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 3, "no temporary file is left: {names:?}");
    }

    #[test]
    fn a_file_found_past_its_cap_and_its_tenth_is_copied_in_pieces_oldest_highest() {
        let (_temp, log) = log_file();
        let rotate_now = |content: &str, keep| {
            fs::write(log.path(), content).unwrap();
            let (live, _size) = open_live(&log).unwrap().unwrap();
            let copies = rotate(&log, &live, LogPolicy { max_size: 40, keep, ..LogPolicy::default() }, None).unwrap();
            assert_eq!(fs::read_to_string(log.path()).unwrap(), "");
            copies
        };
        // A cap of 40 makes pieces of 44.
        let (a, b, c) = ("a".repeat(44), "b".repeat(44), "c".repeat(10));
        assert_eq!(rotate_now(&format!("{a}{b}{c}"), 5), 3);
        assert_eq!(fs::read_to_string(copy(&log, 3)).unwrap(), a);
        assert_eq!(fs::read_to_string(copy(&log, 2)).unwrap(), b);
        assert_eq!(fs::read_to_string(copy(&log, 1)).unwrap(), c);
        // Exactly a piece: one copy, no empty one after it.
        assert_eq!(rotate_now(&"d".repeat(44), 5), 1);
        assert_eq!(fs::read_to_string(copy(&log, 1)).unwrap(), "d".repeat(44));
        // No more pieces than it keeps: the newest.
        let (e, f, g) = ("e".repeat(44), "f".repeat(44), "g".repeat(44));
        assert_eq!(rotate_now(&format!("{e}{f}{g}"), 2), 2);
        assert_eq!(fs::read_to_string(copy(&log, 2)).unwrap(), f);
        assert_eq!(fs::read_to_string(copy(&log, 1)).unwrap(), g);
    }

    #[test]
    fn a_copy_staged_while_the_file_grew_is_completed_by_the_rotation_and_nothing_else_is_left() {
        let (_temp, log) = log_file();
        let limits = LogPolicy { max_size: 40, keep: 5, ..LogPolicy::default() };
        let append = |text: &str| {
            let mut file = fs::OpenOptions::new().append(true).create(true).open(log.path()).unwrap();
            io::Write::write_all(&mut file, text.as_bytes()).unwrap();
        };
        append(&"a".repeat(10));
        let staged = stage(&log, limits, None).unwrap();
        assert_eq!(staged.length, 10);
        append(&"b".repeat(20));
        let staged = stage(&log, limits, Some(staged)).unwrap();
        assert_eq!(staged.length, 30);
        // The rotation copies the rest, and a piece past it (pieces of 44).
        append(&"c".repeat(30));
        let (live, _size) = open_live(&log).unwrap().unwrap();
        assert_eq!(rotate(&log, &live, limits, Some(*staged)).unwrap(), 2);
        let whole = format!("{}{}{}", "a".repeat(10), "b".repeat(20), "c".repeat(30));
        assert_eq!(fs::read_to_string(copy(&log, 2)).unwrap(), whole[..44]);
        assert_eq!(fs::read_to_string(copy(&log, 1)).unwrap(), whole[44..]);
        assert_eq!(fs::read_to_string(log.path()).unwrap(), "");
        let names: Vec<_> = fs::read_dir(log.dir().path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 3, "no temporary file is left: {names:?}");
    }

    #[test]
    fn a_copy_staged_of_a_file_since_replaced_or_truncated_is_not_used() {
        let (_temp, log) = log_file();
        let limits = LogPolicy { max_size: 1 << 20, keep: 2, ..LogPolicy::default() };
        fs::write(log.path(), "old file").unwrap();
        let staged = stage(&log, limits, None).unwrap();
        fs::remove_file(log.path()).unwrap();
        fs::write(log.path(), "new file").unwrap();
        let (live, _size) = open_live(&log).unwrap().unwrap();
        rotate(&log, &live, limits, Some(*staged)).unwrap();
        assert_eq!(fs::read_to_string(copy(&log, 1)).unwrap(), "new file");

        fs::write(log.path(), "a longer first text").unwrap();
        let staged = stage(&log, limits, None).unwrap();
        fs::write(log.path(), "short").unwrap();
        // Staging again starts anew on a file shorter than what it holds.
        let staged = stage(&log, limits, Some(staged)).unwrap();
        assert_eq!(staged.length, 5);
        drop(staged);
        let names: Vec<_> = fs::read_dir(log.dir().path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "a dropped staged copy leaves nothing: {names:?}");
    }

    #[test]
    fn only_a_file_within_a_second_of_its_threshold_at_its_rate_is_staged() {
        assert!(nears_threshold(5_000_000, 10_000_000, Some(50e6)));
        assert!(!nears_threshold(5_000_000, 10_000_000, Some(1e6)));
        assert!(nears_threshold(9_500_000, 10_000_000, Some(1e6)));
        assert!(!nears_threshold(9_500_000, 10_000_000, None));
    }

    #[test]
    fn keeping_nothing_only_truncates() {
        let (_temp, log) = log_file();
        write_and_rotate(&log, "data", 0);
        assert_eq!(fs::read_to_string(log.path()).unwrap(), "");
        assert!(!copy(&log, 1).exists());
    }

    #[test]
    fn a_link_planted_at_a_rotated_name_is_replaced_or_moved_never_followed() {
        for keep in [1, 2, 3] {
            let (temp, log) = log_file();
            let target = target(&temp);
            std::os::unix::fs::symlink(&target, copy(&log, 1)).unwrap();
            write_and_rotate(&log, "tether's output", keep);
            assert_untouched(&target);
            let first = fs::symlink_metadata(copy(&log, 1)).unwrap();
            assert!(first.is_file(), "keep {keep}: the copy is a new regular file");
            assert_eq!(mode(&copy(&log, 1)), 0o600, "keep {keep}");
            assert_eq!(fs::read_to_string(copy(&log, 1)).unwrap(), "tether's output");
            if keep > 1 {
                assert!(fs::symlink_metadata(copy(&log, 2)).unwrap().file_type().is_symlink(), "moved along as a link");
            }
            // One more rotation pushes the link along or over the end, still unfollowed.
            write_and_rotate(&log, "more", keep);
            assert_untouched(&target);
        }
    }

    #[test]
    fn a_linked_live_log_is_neither_copied_nor_truncated() {
        let (temp, log) = log_file();
        let target = target(&temp);
        std::os::unix::fs::symlink(&target, log.path()).unwrap();
        let error = open_live(&log).unwrap_err();
        let PersistError::Write { source, .. } = &error else { panic!("{error:?}") };
        assert_eq!(source.get_ref().and_then(|e| e.downcast_ref::<UnsafeEntry>()), Some(&UnsafeEntry::SymbolicLink));
        assert!(!copy(&log, 1).exists());
        assert_untouched(&target);

        fs::remove_file(log.path()).unwrap();
        fs::hard_link(&target, log.path()).unwrap();
        let error = open_live(&log).unwrap_err();
        assert!(cause(&error).contains("hard links"), "{error:?}");
        assert_untouched(&target);
        assert!(open_live(&LogFile::new(log.dir().clone(), "missing.log")).unwrap().is_none());
    }
}
