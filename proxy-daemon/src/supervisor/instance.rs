//! One running instance of a supervised process: how it is started (spawned, or created
//! by the keeper), reaped and swept, whatever its parent.

use std::sync::Arc;

use nix::sys::signal::Signal;
use tokio::time::Instant;

use super::{Shared, checks, lines};
use crate::cgroup::Cgroups;
use crate::error::SpawnError;
use crate::proc::{self, Pidfd};
use crate::spawn::{self, Spawned};
use crate::spec::ProcessSpec;
use crate::status::ExitReason;

/// One running instance of a supervised process.
pub(super) struct Instance {
    pub(super) kind: InstanceKind,
    /// Opened while the process could not have been reaped, so it is the right one.
    pub(super) pidfd: Pidfd,
    pub(super) pid: u32,
    pub(super) pgid: u32,
    /// Known for adopted processes; read from `/proc` on demand for our children.
    pub(super) start_time: Option<u64>,
    pub(super) started: Instant,
    /// The read end of its notification pipe (readiness `fd`), until its checks take it.
    pub(super) notification: Option<std::os::fd::OwnedFd>,
    /// Where its output starts in its log files (readiness `log_line`).
    pub(super) log_offsets: Option<[lines::Start; 2]>,
    /// The sizes of its log files before it started, where its lines for the journal
    /// begin; `None` for an adopted instance, or output that does not go there.
    pub(super) log_sizes: Option<[u64; 2]>,
    /// The name of its cgroup, when it runs in one.
    pub(super) cgroup: Option<Box<str>>,
}

pub(super) enum InstanceKind {
    /// Our child: we reap it, once its pidfd says that it exited. A `std` child holds no
    /// descriptor, so the pidfd is the only one a supervised process costs.
    Child(spawn::Child),
    /// A keeper's child: the keeper sweeps its group, reaps it and tells how it ended.
    Kept(Arc<crate::keeper::Link>),
    /// Adopted: its parent (init or a subreaper) reaps it.
    Adopted,
}

impl Instance {
    /// Starts an instance of `spec`, in a new cgroup of `cgroups` if given: the one way a
    /// first start and a restart create one.
    /// `spare`: the empty cgroup of the instance it replaces, to take over.
    pub(super) async fn spawn(
        spec: &ProcessSpec,
        shared: &Shared,
        spare: Option<Box<str>>,
    ) -> Result<Self, SpawnError> {
        let cgroups = shared.cgroups.as_ref();
        // A place among the processes in the making, before anything is made for this one.
        let slot = spawn::slot().await;
        // Where its output starts, read before it can write any (readiness `log_line`).
        let log_offsets = checks::watches_lines(spec).then(|| lines::offsets(spec));
        let log_sizes = spec.logs.limits.output.to_journal().then(|| spec.logs.sizes());
        let cgroup = match (cgroups, spare) {
            (Some(cgroups), Some(spare)) => Some(cgroups.reuse(spare, &spec.limits)?),
            (Some(cgroups), None) => Some(cgroups.create(spec.name.as_str(), &spec.limits)?),
            (None, _) => None,
        };
        let dir = cgroup.as_ref().map(|cgroup| &cgroup.dir);
        let spawned = match shared.keepers.get() {
            Some(keepers) => {
                let held = tether_state::lock(&shared.held).clone();
                let kept = match keepers.current().await {
                    Ok(link) => {
                        // Before the process exists: its first notice may come before its
                        // registration, and waits for it only if its parent is known.
                        shared.notify.add_parent(link.pid);
                        spawn::spawn_kept(spec, dir, link, &held, &slot).await
                    }
                    Err(source) => Err(SpawnError::Keeper { source }),
                };
                kept.map(|kept| {
                    let spawn::KeptSpawn { link, process, pidfd, notification } = kept;
                    (InstanceKind::Kept(link), process.pid, pidfd, notification, Some(process.start_time))
                })
            }
            None => spawn::spawn(spec, dir, &slot).await.map(|spawned| {
                let Spawned { child, pid, pidfd, notification } = spawned;
                // Our child is not reaped until we wait for it, so its /proc entry is its own.
                let start_time = proc::read_stat(pid).ok().map(|stat| stat.start_time);
                (InstanceKind::Child(child), pid, pidfd, notification, start_time)
            }),
        };
        drop(slot);
        let cgroup = cgroup.map(|cgroup| cgroup.name);
        let (kind, pid, pidfd, notification, start_time) = match spawned {
            Ok(spawned) => spawned,
            Err(error) => {
                // Nothing entered it: the child that would have is gone.
                if let (Some(cgroups), Some(name)) = (cgroups, &cgroup) {
                    cgroups.remove_empty(name);
                }
                return Err(error);
            }
        };
        Ok(Self {
            kind,
            pidfd,
            pid,
            pgid: pid,
            start_time,
            started: Instant::now(),
            notification,
            log_offsets,
            log_sizes,
            cgroup,
        })
    }

    /// Kills what is left of the instance once its main process has exited or been
    /// killed: its cgroup as a whole, whose removal is awaited, or else its process group.
    /// Before the reap: until then the group id cannot be reused.
    pub(super) async fn sweep(&mut self, cgroups: Option<&Cgroups>) {
        self.sweep_group();
        if let (Some(cgroups), Some(name)) = (cgroups, self.cgroup.take()) {
            cgroups.sweep(&name).await;
        }
    }

    /// [`Instance::sweep`], keeping its cgroup, once empty, for the next instance.
    pub(super) async fn clear(&mut self, cgroups: Option<&Cgroups>) -> Option<Box<str>> {
        self.sweep_group();
        let (cgroups, name) = (cgroups?, self.cgroup.take()?);
        cgroups.reusable(&name).await.then_some(name)
    }

    /// SIGKILLs the process group, unless a keeper is the parent: it sweeps the group itself
    /// before it reaps the leader, so that the group id it signals is still the leader's.
    pub(super) fn sweep_group(&self) {
        if !matches!(self.kind, InstanceKind::Kept(_)) {
            let _empty = proc::signal_group(self.pgid, Signal::SIGKILL);
        }
    }

    /// Reaps the exited main process, if it is ours, and reads how it ended; a keeper's
    /// child's end is what its keeper tells.
    pub(super) async fn reap(self) -> Option<ExitReason> {
        if let InstanceKind::Kept(link) = &self.kind {
            let process = crate::keeper::Kept { pid: self.pid, start_time: self.start_time.unwrap_or(0) };
            let status = link.exit_status(process).await;
            if status.is_none() {
                tracing::warn!(pid = self.pid, "the keeper did not tell how the process ended");
            }
            return status
                .and_then(|status| ExitReason::from_status(std::os::unix::process::ExitStatusExt::from_raw(status)));
        }
        let InstanceKind::Child(mut child) = self.kind else { return None };
        // The pidfd said it exited, so the wait does not block; should it ever, it blocks a
        // thread of the blocking pool, not the runtime.
        let waited = match child.try_wait() {
            Ok(Some(status)) => Ok(status),
            Ok(None) => match tokio::task::spawn_blocking(move || child.wait()).await {
                Ok(waited) => waited,
                Err(join) => Err(std::io::Error::other(join)),
            },
            Err(error) => Err(error),
        };
        match waited {
            Ok(status) => ExitReason::from_status(status),
            Err(error) => {
                tracing::warn!(pid = self.pid, %error, "failed to reap process");
                None
            }
        }
    }

    /// Leaves the process running, unsupervised. Our child is still reaped when it exits,
    /// so that it does not stay a zombie for the rest of the agent's life.
    pub(super) fn release(self) {
        let InstanceKind::Child(mut child) = self.kind else { return };
        let pidfd = self.pidfd;
        tokio::spawn(async move {
            if pidfd.exited().await.is_ok() {
                let _status = child.try_wait();
            }
        });
    }
}
