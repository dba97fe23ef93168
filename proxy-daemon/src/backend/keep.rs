//! `keep_listening`: copies of the listening sockets of a proxy's serving generation, held
//! by the agent so that a crash of the proxy leaves its ports listening.
//!
//! While a copy is open the kernel keeps the socket, and a connection that arrives while no
//! process of the proxy accepts waits in its backlog instead of being refused. The next
//! generation binds its own sockets beside the kept ones (both have `SO_REUSEPORT`, as
//! Envoy's listeners do by default); once it is ready the copies are closed, and the kernel
//! moves what waited in them to the new sockets (`net.ipv4.tcp_migrate_req`).

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::OnceLock;

use tether_state::ProxyId;

use crate::proc::{self, Identity};

/// The sysctl that has the kernel move a closed listener's waiting connections to another
/// socket of its `SO_REUSEPORT` group (Linux 5.14 and later); per network namespace.
const MIGRATE_REQ: &str = "/proc/sys/net/ipv4/tcp_migrate_req";

/// The sockets kept of one proxy, each with its inode.
#[derive(Debug, Default)]
pub(super) struct Kept {
    sockets: Vec<(u64, OwnedFd)>,
}

impl Kept {
    /// Keeps the listening sockets of the process `identity` names (the generation that
    /// serves, ready), and closes the copies of any other socket: the generation serves on
    /// sockets of its own, to which the kernel moves what waited in the others. Taking
    /// nothing keeps what was kept: the generation does not listen yet (a check that answers
    /// for the old generation during a hot restart, say), and the old sockets are all that
    /// do. Returns whether the generation listens on anything it could keep.
    pub(super) fn take_from(&mut self, id: &ProxyId, identity: &Identity) -> bool {
        migration_on();
        match take(identity) {
            Ok(taken) if taken.is_empty() => false,
            Ok(taken) => {
                let unchanged = taken.len() == self.sockets.len()
                    && taken.iter().all(|(inode, _)| self.sockets.iter().any(|(kept, _)| kept == inode));
                if !unchanged {
                    let released =
                        self.sockets.iter().filter(|(inode, _)| taken.iter().all(|(new, _)| new != inode)).count();
                    let kept = taken.len();
                    tracing::info!(proxy = %id, pid = identity.pid, kept, released, "keeping the listening sockets of the generation that serves");
                }
                self.sockets = taken;
                true
            }
            // Gone: its supervisor tells the exit, and the sockets kept wait for the next one.
            Err(_) if proc::read_stat(identity.pid).is_ok_and(|stat| stat.start_time != identity.start_time) => false,
            Err(_) if proc::read_stat(identity.pid).is_err() => false,
            Err(error) => {
                tracing::warn!(proxy = %id, pid = identity.pid, %error, "cannot keep the listening sockets of the proxy: a crash will refuse connections until it listens again");
                false
            }
        }
    }

    /// Closes every copy: the proxy runs no more.
    pub(super) fn release(&mut self, id: &ProxyId) {
        if !self.sockets.is_empty() {
            tracing::info!(proxy = %id, released = self.sockets.len(), "closing the kept listening sockets");
            self.sockets.clear();
        }
    }
}

/// Copies of the listening sockets of `identity`'s process, through a pidfd proven to be
/// that process's (its start time read after the pidfd was opened).
fn take(identity: &Identity) -> io::Result<Vec<(u64, OwnedFd)>> {
    let pidfd = proc::pidfd_open(identity.pid)?;
    if proc::read_stat(identity.pid)?.start_time != identity.start_time {
        return Err(io::Error::new(io::ErrorKind::NotFound, "the process has exited"));
    }
    crate::listen::take_reusable_tcp(pidfd.as_fd(), identity.pid)
}

/// Turns `net.ipv4.tcp_migrate_req` on, once per agent, where it is off and the agent may:
/// without it, the connections that waited in a kept socket are reset when it is closed.
fn migration_on() {
    static CHECKED: OnceLock<()> = OnceLock::new();
    CHECKED.get_or_init(|| match std::fs::read_to_string(MIGRATE_REQ) {
        Ok(value) if value.trim() != "0" => {}
        Ok(_) => match std::fs::write(MIGRATE_REQ, "1\n") {
            Ok(()) => tracing::info!(
                "set net.ipv4.tcp_migrate_req = 1, so that the connections waiting in a kept listening socket move to the next generation's"
            ),
            Err(error) => tracing::warn!(
                %error,
                "net.ipv4.tcp_migrate_req is 0 and cannot be set: connections that wait in a kept listening socket are reset, not moved, when the next generation listens"
            ),
        },
        Err(error) => tracing::warn!(
            %error,
            "this kernel cannot move waiting connections between listening sockets (net.ipv4.tcp_migrate_req): they are reset when the next generation listens"
        ),
    });
}
