//! Taking processes back: adoption from a snapshot's identity, from a pid file or from a
//! process found by its environment, and stopping a second instance found so.
//!
//! Every way in proves the process first, with a pidfd opened before `/proc` is read and
//! liveness checked after; a process that is not proven is never signalled. A caller that
//! finds several instances of one spec proves each ([`Proven`]), looks at them (which
//! serves, which is the oldest), and only then adopts one and stops the others.

use std::ffi::{OsStr, OsString};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::time::SystemTime;

use tokio::time::Instant;

use super::{Instance, InstanceKind, ProcessHandle, Supervisor};
use crate::proc::{self, Identity, Pidfd};
use crate::spec::ProcessSpec;
use crate::status::ProcessStatus;

impl Supervisor {
    /// Takes back a detached process, if `identity` proves that it is still the same one.
    ///
    /// Proof: the boot id matches, a pidfd for `identity.pid` can be opened, and then the
    /// process's start time and process group match `identity`, and it was still alive
    /// after they were read (so the pidfd cannot refer to a reused pid). Without proof the
    /// process is left alone, never signalled, and `None` is returned. An adopted process
    /// is not our child: its exit is learned through the pidfd, and it is then restarted
    /// from `spec` like any other.
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn adopt(&self, spec: ProcessSpec, identity: &Identity) -> Option<ProcessHandle> {
        let span = tracing::info_span!("proxy.adopt", proxy = %spec.name, pid = identity.pid);
        let _entered = span.enter();
        let proven = self.prove(identity)?;
        self.adopt_proven(spec, proven, true)
    }

    /// Proves that `identity` still denotes a live process (the proof of
    /// [`Supervisor::adopt`], without the cgroup, which the adoption checks), without
    /// adopting it. Call within a span that names the process: refusals are logged.
    pub(crate) fn prove(&self, identity: &Identity) -> Option<Proven> {
        if identity.boot_id != self.shared.boot_id {
            tracing::info!("not adopting: the machine rebooted since the process was detached");
            return None;
        }
        let pidfd = open_pidfd(identity.pid)?;
        let stat = match proc::read_stat(identity.pid) {
            Ok(stat) => stat,
            Err(error) => {
                tracing::info!(%error, "not adopting: cannot read the process's stat");
                return None;
            }
        };
        if stat.start_time != identity.start_time || stat.pgid != identity.pgid {
            tracing::info!("not adopting: the pid belongs to another process now");
            return None;
        }
        Some(Proven { pidfd, pid: identity.pid, stat, recorded_cgroup: identity.cgroup.clone() })
    }

    /// Takes back the process named in `spec.pid_file`, if its environment proves that it
    /// is this spec's process ([`Supervisor::adopt_by_environment`]). A spec without a pid
    /// file, or a missing or malformed pid file, proves nothing: `None`.
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn adopt_from_pid_file(&self, spec: ProcessSpec) -> Option<ProcessHandle> {
        let pid = read_pid_file(&spec)?;
        self.adopt_by_environment(spec, pid)
    }

    /// Takes back process `pid`, if its environment proves that it is this spec's process.
    ///
    /// Proof: a pidfd for the pid can be opened, and then every pair of
    /// `spec.identity_env` appears in its `/proc/<pid>/environ`, it leads its own process
    /// group, and it was still alive after those were read. With an empty `identity_env`
    /// or failed proof, the process is left alone, never signalled, and `None` is
    /// returned. The pid file, if the spec has one, is written for the adopted process.
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn adopt_by_environment(&self, spec: ProcessSpec, pid: u32) -> Option<ProcessHandle> {
        let span = tracing::info_span!("proxy.adopt", proxy = %spec.name, pid);
        let _entered = span.enter();
        let proven = environment_proof(&spec, pid)?;
        self.adopt_proven(spec, proven, true)
    }

    /// Proves that `pid` is `spec`'s process by its environment (the proof of
    /// [`Supervisor::adopt_by_environment`]), without adopting it. Call within a span that
    /// names the process: refusals are logged.
    #[cfg_attr(not(feature = "manager"), allow(dead_code))] // the engine adapter's
    pub(crate) fn prove_by_environment(&self, spec: &ProcessSpec, pid: u32) -> Option<Proven> {
        environment_proof(spec, pid)
    }

    /// Stops process `pid`, if its environment proves that it is this spec's process (the
    /// proof of [`Supervisor::adopt_by_environment`]), with the spec's kill policy. Its pid
    /// file is left as it is: this is for a second instance, whose file names the first.
    /// `None` when nothing was proven, and nothing was signalled.
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub async fn stop_by_environment(&self, spec: ProcessSpec, pid: u32) -> Option<ProcessStatus> {
        let handle = {
            let span = tracing::info_span!("proxy.adopt", proxy = %spec.name, pid);
            let _entered = span.enter();
            let proven = environment_proof(&spec, pid)?;
            self.adopt_proven(spec, proven, false)?
        };
        Some(handle.stop().await)
    }

    /// Every process that may be an instance started by a supervisor: its environment holds
    /// every pair of `required`, it leads its own process group but not a session (every
    /// spawned process gets a group of its own and stays in its supervisor's session, while
    /// a daemonised helper that called `setsid()` leads a session), and its parent's
    /// environment does not hold them (a worker that an instance made a group leader has
    /// its parent's environment; an instance's parent is its supervisor, or init once the
    /// supervisor is gone). Returns each one's pid and the value of `key` in its environment
    /// (empty if unset), sorted by pid.
    ///
    /// A hint, not a proof: adopt or stop what it finds only through
    /// [`Supervisor::adopt_by_environment`] or [`Supervisor::stop_by_environment`]. Costs
    /// one read of `/proc/<pid>/stat` and `/proc/<pid>/environ` for every process of the
    /// machine.
    pub fn find_by_environment(&self, required: &[(OsString, OsString)], key: &str) -> Vec<(u32, OsString)> {
        let mut matching = Vec::new();
        proc::visit_processes(|pid, stat, environ| {
            if proc::environ_contains(environ, required) {
                let value = proc::environ_value(environ, key.as_bytes()).unwrap_or_default();
                matching.push((pid, stat, OsStr::from_bytes(value).to_owned()));
            }
        });
        let pids: std::collections::HashSet<u32> = matching.iter().map(|(pid, _, _)| *pid).collect();
        let mut found: Vec<(u32, OsString)> = matching
            .into_iter()
            .filter(|(pid, stat, _)| stat.pgid == *pid && stat.sid != *pid && !pids.contains(&stat.ppid))
            .map(|(pid, _, value)| (pid, value))
            .collect();
        found.sort();
        found
    }

    /// Finishes an adoption once `/proc` has vouched for the process: with cgroups, it must
    /// be in a cgroup of this spec's process (the recorded one, if its identity names one)
    /// or, started without one, in none of the subtree; and the pidfd, opened before `/proc`
    /// was read, must still refer to a live process.
    /// `write_pid_file`: whether the pid file is to name it (not for a second instance).
    /// Call within a span that names the process: refusals are logged.
    pub(crate) fn adopt_proven(
        &self,
        spec: ProcessSpec,
        proven: Proven,
        write_pid_file: bool,
    ) -> Option<ProcessHandle> {
        let Proven { pidfd, pid, stat, recorded_cgroup } = proven;
        let recorded = recorded_cgroup.as_deref();
        let cgroup = match &self.shared.cgroups {
            Some(cgroups) => match cgroups.membership(pid) {
                Ok(Some(name)) => {
                    let of_spec = name.rsplit_once('@').is_some_and(|(process, _)| process == spec.name.as_str());
                    if !of_spec || recorded.is_some_and(|recorded| recorded != &*name) {
                        tracing::info!(cgroup = %name, "not adopting: the process is in another cgroup");
                        return None;
                    }
                    Some(name)
                }
                Ok(None) if recorded.is_some() => {
                    tracing::info!("not adopting: the process left its cgroup");
                    return None;
                }
                // Started while cgroups were not used: supervised through its group.
                Ok(None) => None,
                Err(error) => {
                    tracing::info!(%error, "not adopting: cannot read the process's cgroup");
                    return None;
                }
            },
            None => None,
        };
        if !matches!(pidfd.has_exited(), Ok(false)) {
            tracing::info!("not adopting: the process exited during the checks");
            return None;
        }
        let started_at = self.shared.start_time_to_system_time(stat.start_time).unwrap_or_else(SystemTime::now);
        let age = SystemTime::now().duration_since(started_at).unwrap_or_default();
        let now = Instant::now();
        // A keeper's child: its keeper tells how it ends.
        let process = crate::keeper::Kept { pid, start_time: stat.start_time };
        let kind = match self.shared.keepers.get().and_then(|keepers| keepers.owner(process)) {
            Some(link) => InstanceKind::Kept(link),
            None => InstanceKind::Adopted,
        };
        let instance = Instance {
            kind,
            pidfd,
            pid,
            pgid: stat.pgid,
            start_time: Some(stat.start_time),
            started: now.checked_sub(age).unwrap_or(now),
            notification: None,
            log_offsets: None,
            log_sizes: None,
            cgroup,
        };
        if let (Some(cgroups), Some(name)) = (&self.shared.cgroups, &instance.cgroup) {
            cgroups.claim(name);
        }
        tracing::info!("process adopted");
        let identity = self.shared.identity(&instance);
        Some(self.supervise(spec, instance, ProcessStatus::running(pid, started_at, identity, true), write_pid_file))
    }
}

/// A live process proven to be an instance of some spec (by its recorded identity, or by its
/// environment), not supervised yet: the pidfd through which it was proven, and what
/// `/proc` said of it meanwhile. Dropping it leaves the process alone.
#[derive(Debug)]
pub(crate) struct Proven {
    pidfd: Pidfd,
    pid: u32,
    stat: proc::Stat,
    /// The cgroup its recorded identity names, if it was proven by one.
    recorded_cgroup: Option<String>,
}

#[cfg_attr(not(feature = "manager"), allow(dead_code))] // the engine adapter's
impl Proven {
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// When it started, in clock ticks after boot: of two instances, the smaller started
    /// first.
    pub(crate) fn start_time(&self) -> u64 {
        self.stat.start_time
    }

    /// Copies of every listening socket it holds, taken through the pidfd it was proven
    /// with (see [`crate::listen::take_listening`]); it keeps its own.
    ///
    /// # Errors
    ///
    /// When its descriptors cannot be read (it is gone).
    pub(crate) fn listening_sockets(&self) -> std::io::Result<Vec<OwnedFd>> {
        crate::listen::take_listening(&self.pidfd, self.pid)
    }
}

/// The pid that `spec.pid_file` names, if it is a readable pid file (not behind a link).
fn read_pid_file(spec: &ProcessSpec) -> Option<u32> {
    let pid = crate::pidfile::read(spec.pid_file.as_deref()?);
    if pid.is_none() {
        tracing::debug!(proxy = %spec.name, "no readable pid file");
    }
    pid
}

/// Proves that `pid` is `spec`'s process by the identity in its environment; see
/// [`Supervisor::adopt_by_environment`]. Call within a span that names the process:
/// refusals are logged.
fn environment_proof(spec: &ProcessSpec, pid: u32) -> Option<Proven> {
    if spec.identity_env.is_empty() {
        tracing::info!("not adopting: the spec has no identity to prove");
        return None;
    }
    let pidfd = open_pidfd(pid)?;
    let proven = proc::read_environ(pid).map(|environ| proc::environ_contains(&environ, &spec.identity_env));
    if !matches!(proven, Ok(true)) {
        tracing::info!("not adopting: the pid's environment does not hold the identity");
        return None;
    }
    match proc::read_stat(pid) {
        Ok(stat) if stat.pgid == pid => Some(Proven { pidfd, pid, stat, recorded_cgroup: None }),
        _ => {
            tracing::info!("not adopting: the process does not lead its own group");
            None
        }
    }
}

fn open_pidfd(pid: u32) -> Option<Pidfd> {
    match Pidfd::open(pid) {
        Ok(pidfd) => Some(pidfd),
        Err(error) => {
            tracing::info!(%error, "not adopting: the process is gone");
            None
        }
    }
}
