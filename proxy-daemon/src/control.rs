//! The commands a [`ProcessHandle`](crate::ProcessHandle) sends to the task that supervises
//! its process: stop (or finish a stop that an earlier supervisor began), detach, and
//! changes applied in place; and the process's status, which both ends read, with the
//! observer that the task tells of every change of it.
//!
//! This module owns that one-to-one link and nothing else. It is a slot of pending commands
//! and the waiting task's waker, not a queue: a handle sends few commands in its life, and every
//! supervised process pays for the link while it runs, so it must stay a few words. It
//! never loses a command that was accepted, and it refuses commands once the task no
//! longer takes them.

use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use tokio::sync::{oneshot, watch};

use crate::error::DetachError;
use crate::proc::Identity;
use crate::spec::ProcessUpdate;
use crate::status::ProcessStatus;
use crate::supervisor::ReloadReply;

/// Told of every change of a process's status, in order, from its supervising task.
pub(crate) type Observer = Box<dyn Fn(&ProcessStatus) + Send + Sync>;

/// Where a detach sends the identity of the process it left running.
pub(crate) type DetachReply = oneshot::Sender<Result<Identity, DetachError>>;

/// What the task has to do, taken all at once. When several are pending, in-place changes
/// apply first, then a stop wins over a detach, and a detach over a dropped handle: the
/// order in which a handle can have sent them.
#[derive(Debug, Default)]
pub(crate) struct Commands {
    /// Changes to apply in place, merged in the order they were sent. Boxed: the link
    /// lasts as long as its process, and an update is rare and large.
    pub(crate) update: Option<Box<ProcessUpdate>>,
    /// Stop the process, and how.
    pub(crate) stop: Option<Stop>,
    /// Leave the process running and report its identity.
    pub(crate) detach: Option<DetachReply>,
    /// The handle is gone: leave the process running, unsupervised.
    pub(crate) handle_gone: bool,
    /// Reloads asked, each waiting for a verdict: one reload answers every one asked
    /// before it began.
    pub(crate) reload: Vec<ReloadReply>,
}

impl Commands {
    fn is_empty(&self) -> bool {
        self.update.is_none()
            && self.stop.is_none()
            && self.detach.is_none()
            && !self.handle_gone
            && self.reload.is_empty()
    }
}

/// How a stop ends the process. Of two stops asked, the one that signals wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Stop {
    /// It was asked to stop already, by a supervisor that died since: wait up to its kill
    /// timeout for it to exit, without a second kill signal (which makes many proxies drop
    /// the connections they are finishing), then SIGKILL its group.
    Awaited,
    /// Its kill signal, then SIGKILL after its kill timeout.
    Signalled,
}

#[derive(Debug, Default)]
struct Pending {
    commands: Commands,
    /// The task's, while it waits for commands: woken by the next one.
    waiting: Option<Waker>,
    /// The task takes no more commands.
    closed: bool,
}

struct Link {
    pending: Mutex<Pending>,
    /// The status, and whom to tell of its changes. One lock: the observer is told of every
    /// change once, in order, and of none twice, and a subscription misses none.
    status: Mutex<StatusSlot>,
}

/// A process's status where its handle and its task both reach it. The channel that
/// [`Sender::subscribe`] hands out is made on the first subscription: most processes are
/// followed through an observer, and a channel costs about 500 bytes a process.
struct StatusSlot {
    current: ProcessStatus,
    observer: Option<Observer>,
    channel: Option<watch::Sender<ProcessStatus>>,
    /// The task has ended: no change comes any more, and a subscription sees its sender gone.
    ended: bool,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("pending", &self.pending).finish_non_exhaustive()
    }
}

impl std::fmt::Debug for StatusView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("StatusView").field(&self.get()).finish()
    }
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Every critical section only moves plain values in or out.
        tether_state::lock(&self.pending)
    }

    fn status(&self) -> MutexGuard<'_, StatusSlot> {
        // An observer that panicked left nothing half-changed here.
        tether_state::lock(&self.status)
    }

    fn read_status<T>(&self, read: impl FnOnce(&ProcessStatus) -> T) -> T {
        read(&self.status().current)
    }
}

/// A new link, its process's status at first `status`: the handle's end and the task's end.
pub(crate) fn link(status: ProcessStatus) -> (Sender, Receiver) {
    let link = Arc::new(Link {
        pending: Mutex::default(),
        status: Mutex::new(StatusSlot { current: status, observer: None, channel: None, ended: false }),
    });
    (Sender(Arc::clone(&link)), Receiver(link))
}

/// A process's status, for whoever lists processes; it outlives neither handle nor task
/// in use, only in memory.
#[derive(Clone)]
pub(crate) struct StatusView(Arc<Link>);

impl StatusView {
    /// The last status.
    pub(crate) fn get(&self) -> ProcessStatus {
        self.0.read_status(ProcessStatus::clone)
    }

    /// What `read` makes of the last status, read in place.
    #[cfg_attr(not(feature = "manager"), allow(dead_code))] // the engine adapter's
    pub(crate) fn read_status<T>(&self, read: impl FnOnce(&ProcessStatus) -> T) -> T {
        self.0.read_status(read)
    }
}

/// The handle's end. Dropping it tells the task that the handle is gone.
#[derive(Debug)]
pub(crate) struct Sender(Arc<Link>);

impl Sender {
    /// Hands `add`'s command to the task; `false` (and nothing sent) once the task no
    /// longer takes commands.
    fn send(&self, add: impl FnOnce(&mut Commands)) -> bool {
        let mut pending = self.0.lock();
        if pending.closed {
            return false;
        }
        add(&mut pending.commands);
        let waiting = pending.waiting.take();
        drop(pending);
        // A task that is not waiting finds the command at its next look.
        if let Some(waker) = waiting {
            waker.wake();
        }
        true
    }

    /// Asks the task to stop the process, as `how` says.
    pub(crate) fn stop(&self, how: Stop) -> bool {
        self.send(|commands| commands.stop = commands.stop.max(Some(how)))
    }

    /// Asks the task to detach the process and answer on `reply`. `Err` gives `reply`
    /// back when the task no longer takes commands.
    pub(crate) fn detach(&self, reply: DetachReply) -> Result<(), DetachReply> {
        let mut reply = Some(reply);
        if self.send(|commands| commands.detach = reply.take()) {
            return Ok(());
        }
        Err(reply.unwrap_or_else(|| unreachable!("a refused command is not taken")))
    }

    /// Tells `observer` of the current status, then of every change, until the task ends;
    /// replaces an earlier observer.
    pub(crate) fn observe(&self, observer: Observer) {
        let mut slot = self.0.status();
        observer(&slot.current);
        slot.observer = Some(observer);
    }

    /// The last status.
    pub(crate) fn status(&self) -> ProcessStatus {
        self.read_status(ProcessStatus::clone)
    }

    /// What `read` makes of the last status, read in place.
    pub(crate) fn read_status<T>(&self, read: impl FnOnce(&ProcessStatus) -> T) -> T {
        self.0.read_status(read)
    }

    /// A channel of the status: the last one, then every change until the task ends (then
    /// its sender is gone).
    pub(crate) fn subscribe(&self) -> watch::Receiver<ProcessStatus> {
        let mut slot = self.0.status();
        if let Some(channel) = &slot.channel {
            return channel.subscribe();
        }
        let (channel, receiver) = watch::channel(slot.current.clone());
        if !slot.ended {
            slot.channel = Some(channel);
        }
        receiver
    }

    /// The status, for a list of processes.
    pub(crate) fn view(&self) -> StatusView {
        StatusView(Arc::clone(&self.0))
    }

    /// Asks the task to reload the process and answer on `reply`. `Err` gives `reply` back
    /// when the task no longer takes commands.
    pub(crate) fn reload(&self, reply: ReloadReply) -> Result<(), ReloadReply> {
        let mut reply = Some(reply);
        if self.send(|commands| commands.reload.extend(reply.take())) {
            return Ok(());
        }
        Err(reply.unwrap_or_else(|| unreachable!("a refused command is not taken")))
    }

    /// Asks the task to apply `update` in place.
    pub(crate) fn update(&self, update: ProcessUpdate) -> bool {
        self.send(|commands| {
            let earlier = commands.update.take().map(|earlier| *earlier).unwrap_or_default();
            commands.update = Some(Box::new(ProcessUpdate {
                kill: update.kill.or(earlier.kill),
                restart: update.restart.or(earlier.restart),
                log_limits: update.log_limits.or(earlier.log_limits),
                journal: update.journal.or(earlier.journal),
                health: update.health.or(earlier.health),
                limits: update.limits.or(earlier.limits),
                reload: update.reload.or(earlier.reload),
                restart_on_exit: update.restart_on_exit.or(earlier.restart_on_exit),
            }));
        })
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.send(|commands| commands.handle_gone = true);
    }
}

/// The task's end. Dropping it (the task ended, or was aborted) closes the link, and a
/// detach that was not taken is answered by the drop of its reply.
#[derive(Debug)]
pub(crate) struct Receiver(Arc<Link>);

impl Receiver {
    /// Waits for commands and takes every pending one.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: commands are taken only in the poll that returns them.
    pub(crate) async fn recv(&self) -> Commands {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// Takes every pending command, or leaves `cx`'s waker to be woken by the next one. A
    /// poll of its own, so that a waiting task keeps no future for it: it costs each
    /// supervised process nothing while it waits.
    pub(crate) fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<Commands> {
        let mut pending = self.0.lock();
        if !pending.commands.is_empty() {
            pending.waiting = None;
            return Poll::Ready(std::mem::take(&mut pending.commands));
        }
        if !pending.waiting.as_ref().is_some_and(|waiting| waiting.will_wake(cx.waker())) {
            pending.waiting = Some(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Changes the status with `change` (which says whether it changed anything), and
    /// tells the observer and the subscribers, if there are any, of the new status.
    /// Returns what `change` returned.
    pub(crate) fn publish(&self, change: impl FnOnce(&mut ProcessStatus) -> bool) -> bool {
        let mut slot = self.0.status();
        let changed = change(&mut slot.current);
        if changed {
            if let Some(channel) = &slot.channel {
                channel.send_replace(slot.current.clone());
            }
            if let Some(observer) = &slot.observer {
                observer(&slot.current);
            }
        }
        changed
    }

    /// Takes no more commands; later sends fail, and pending ones are dropped.
    pub(crate) fn close(&self) {
        let dropped = {
            let mut pending = self.0.lock();
            pending.closed = true;
            std::mem::take(&mut pending.commands)
        };
        // Dropped outside the lock: an unanswered detach learns here that it failed.
        drop(dropped);
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.close();
        // The subscribers learn that no change comes any more; dropped outside the lock.
        let channel = {
            let mut slot = self.0.status();
            slot.ended = true;
            slot.channel.take()
        };
        drop(channel);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::spec::KillPolicy;

    #[tokio::test]
    async fn the_status_channel_is_made_on_the_first_subscription_and_closes_when_the_task_ends() {
        let first = ProcessStatus::running(1, std::time::SystemTime::UNIX_EPOCH, None, true);
        let (sender, receiver) = link(first);
        assert!(tether_state::lock(&sender.0.status).channel.is_none(), "no channel before a subscription");
        let told = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&told);
        sender.observe(Box::new(move |status| tether_state::lock(&seen).push(status.figures.restarts)));
        assert!(receiver.publish(|status| {
            status.figures.restarts = 1;
            true
        }));
        let mut subscribed = sender.subscribe();
        assert_eq!(subscribed.borrow_and_update().figures.restarts, 1, "the last status, not the first");
        assert!(!receiver.publish(|_| false), "an unchanged status tells nobody");
        assert!(receiver.publish(|status| {
            status.figures.restarts = 2;
            true
        }));
        let deadline = Duration::from_secs(10);
        tokio::time::timeout(deadline, subscribed.changed()).await.unwrap().unwrap();
        assert_eq!(subscribed.borrow().figures.restarts, 2);
        assert_eq!(*tether_state::lock(&told), [0, 1, 2], "the observer is told of each change once");
        assert_eq!(sender.status().figures.restarts, 2);

        drop(receiver);
        assert!(tokio::time::timeout(deadline, subscribed.changed()).await.unwrap().is_err(), "the task is gone");
        let late = sender.subscribe();
        assert_eq!(late.borrow().figures.restarts, 2);
        assert!(late.has_changed().is_err(), "a subscription after the end sees no sender");
        assert_eq!(sender.view().get(), sender.status());
    }

    #[tokio::test]
    async fn commands_sent_before_the_wait_are_taken_together_with_updates_merged() {
        let (sender, receiver) = link(ProcessStatus::running(1, std::time::SystemTime::UNIX_EPOCH, None, true));
        let kill = KillPolicy { timeout: Duration::from_secs(1), ..KillPolicy::default() };
        assert!(sender.update(ProcessUpdate { kill: Some(kill), ..ProcessUpdate::default() }));
        let limits = crate::spec::LogPolicy { max_size: 10, keep: 1, ..crate::spec::LogPolicy::default() };
        assert!(sender.update(ProcessUpdate { log_limits: Some(limits), ..ProcessUpdate::default() }));
        assert!(sender.stop(Stop::Signalled));
        assert!(sender.stop(Stop::Awaited), "a second stop is taken, and the first one's signal kept");
        let taken = tokio::time::timeout(Duration::from_secs(10), receiver.recv()).await.unwrap();
        assert_eq!(
            taken.update.map(|update| *update),
            Some(ProcessUpdate {
                kill: Some(kill),
                restart: None,
                log_limits: Some(limits),
                journal: None,
                health: None,
                limits: None,
                reload: None,
                restart_on_exit: None,
            })
        );
        assert!(taken.stop == Some(Stop::Signalled) && taken.detach.is_none() && !taken.handle_gone);
    }

    #[tokio::test]
    async fn a_waiting_task_wakes_for_a_command_and_for_a_dropped_handle() {
        let (sender, receiver) = link(ProcessStatus::running(1, std::time::SystemTime::UNIX_EPOCH, None, true));
        let (first_taken, first) = oneshot::channel();
        let waiting = tokio::spawn(async move {
            let _ = first_taken.send(receiver.recv().await.stop == Some(Stop::Awaited));
            receiver.recv().await.handle_gone
        });
        tokio::task::yield_now().await;
        assert!(sender.stop(Stop::Awaited));
        assert!(tokio::time::timeout(Duration::from_secs(10), first).await.unwrap().unwrap());
        // The task waits again, with nothing pending, when the handle goes.
        tokio::task::yield_now().await;
        drop(sender);
        assert!(tokio::time::timeout(Duration::from_secs(10), waiting).await.unwrap().unwrap());
    }

    #[tokio::test]
    async fn a_closed_link_refuses_commands_and_answers_a_pending_detach_by_dropping_it() {
        let (sender, receiver) = link(ProcessStatus::running(1, std::time::SystemTime::UNIX_EPOCH, None, true));
        let (reply, answer) = oneshot::channel();
        assert!(sender.detach(reply).is_ok());
        drop(receiver);
        assert!(answer.await.is_err(), "the detach that was not taken is dropped");
        assert!(!sender.stop(Stop::Signalled));
        let (reply, _answer) = oneshot::channel();
        assert!(sender.detach(reply).is_err(), "the reply is handed back");
    }
}
