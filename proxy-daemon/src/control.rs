//! The commands a [`ProcessHandle`](crate::ProcessHandle) sends to the task that supervises
//! its process: stop (or finish a stop that an earlier supervisor began), detach, and
//! changes applied in place; and the observer that the task tells of every change of the
//! status.
//!
//! This module owns that one-to-one link and nothing else. It is a slot of pending commands
//! and a wake-up, not a queue: a handle sends few commands in its life, and every
//! supervised process pays for the link while it runs, so it must stay a few words. It
//! never loses a command that was accepted, and it refuses commands once the task no
//! longer takes them.

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{Notify, oneshot, watch};

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
    /// The task takes no more commands.
    closed: bool,
}

#[derive(Default)]
struct Link {
    pending: Mutex<Pending>,
    wake: Notify,
    /// Held while the status changes and the observer is told, so that it is told of every
    /// change once, in order, and of none twice.
    observer: Mutex<Option<Observer>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("pending", &self.pending).finish_non_exhaustive()
    }
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Every critical section only moves plain values in or out.
        tether_state::lock(&self.pending)
    }

    fn observer(&self) -> MutexGuard<'_, Option<Observer>> {
        // An observer that panicked left nothing half-changed here.
        tether_state::lock(&self.observer)
    }
}

/// A new link: the handle's end and the task's end.
pub(crate) fn link() -> (Sender, Receiver) {
    let link = Arc::new(Link::default());
    (Sender(Arc::clone(&link)), Receiver(link))
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
        drop(pending);
        // A wake-up with no waiter is kept for the task's next wait.
        self.0.wake.notify_one();
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
    pub(crate) fn observe(&self, status: &watch::Receiver<ProcessStatus>, observer: Observer) {
        let mut slot = self.0.observer();
        observer(&status.borrow());
        *slot = Some(observer);
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
        loop {
            if let Some(taken) = self.take() {
                return taken;
            }
            // A command sent after the check left a wake-up that ends this wait at once.
            self.0.wake.notified().await;
        }
    }

    /// The pending commands, if any. Not inlined into `recv`, whose future would otherwise
    /// keep room for them across its wait.
    #[inline(never)]
    fn take(&self) -> Option<Commands> {
        let taken = std::mem::take(&mut self.0.lock().commands);
        (!taken.is_empty()).then_some(taken)
    }

    /// Changes `status` with `change` (which says whether it changed anything), and tells
    /// the observer, if there is one, of the new status. Returns what `change` returned.
    pub(crate) fn publish(
        &self,
        status: &watch::Sender<ProcessStatus>,
        change: impl FnOnce(&mut ProcessStatus) -> bool,
    ) -> bool {
        let observer = self.0.observer();
        let changed = status.send_if_modified(change);
        if let (true, Some(observer)) = (changed, observer.as_ref()) {
            observer(&status.borrow());
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
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::spec::KillPolicy;

    #[tokio::test]
    async fn commands_sent_before_the_wait_are_taken_together_with_updates_merged() {
        let (sender, receiver) = link();
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
        let (sender, receiver) = link();
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
        let (sender, receiver) = link();
        let (reply, answer) = oneshot::channel();
        assert!(sender.detach(reply).is_ok());
        drop(receiver);
        assert!(answer.await.is_err(), "the detach that was not taken is dropped");
        assert!(!sender.stop(Stop::Signalled));
        let (reply, _answer) = oneshot::channel();
        assert!(sender.detach(reply).is_err(), "the reply is handed back");
    }
}
