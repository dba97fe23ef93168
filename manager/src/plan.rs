//! The engine's decisions, as a pure function of what is wanted and what is known to run.
//!
//! This module owns the rule "what to do next for one proxy" and nothing else: it performs
//! no I/O, holds no handles, spawns nothing and never looks at time. Whether a change needs
//! a restart is `tether_state::ManagedProxy::change_to`'s decision, never re-derived here.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use tether_state::{ManagedProxy, ProxyChange, Service, TokenFingerprint};

/// Policy inputs of a decision.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Policy {
    /// The agent runs as uid 0 and root is not allowed: proxies that would run as uid 0 are
    /// refused.
    pub(crate) refuse_root: bool,
    /// The `user` names that have uid 0, as the agent's lookup last answered for them. The
    /// engine keeps it current ([`Policy::note_uid`]) before it decides for a proxy that
    /// names a user, so that the decision itself stays a function of its inputs.
    pub(crate) root_users: BTreeSet<String>,
}

/// Why policy refuses a proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal<'a> {
    /// The proxy has no `user`: it would run as the agent, which is uid 0.
    NoUser,
    /// The proxy's `user` has uid 0.
    RootUser(&'a str),
}

impl fmt::Display for Refusal<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("refusing to run the proxy as root: ")?;
        match self {
            Self::NoUser => f.write_str("it has no `user`, so it would run as the agent, uid 0")?,
            Self::RootUser(user) => write!(f, "its `user` {user:?} is uid 0")?,
        }
        f.write_str(" (set a `user` that is not root, or allow root with --allow-root)")
    }
}

impl Policy {
    /// Why `proxy` may not run under this policy, if it may not.
    pub(crate) fn refusal<'a>(&self, proxy: &'a ManagedProxy) -> Option<Refusal<'a>> {
        if !self.refuse_root {
            return None;
        }
        match proxy.spec().user.as_deref() {
            None => Some(Refusal::NoUser),
            Some(user) if self.root_users.contains(user) => Some(Refusal::RootUser(user)),
            Some(_) => None,
        }
    }

    /// Records what the agent's lookup answered for `user`: its uid, or `None` when the name
    /// does not resolve (such a proxy is not refused: its start fails and says why).
    pub(crate) fn note_uid(&mut self, user: &str, uid: Option<u32>) {
        if uid == Some(0) {
            // Looked up first: most answers change nothing, and need no allocation.
            if !self.root_users.contains(user) {
                self.root_users.insert(user.to_owned());
            }
        } else {
            self.root_users.remove(user);
        }
    }
}

/// What a restored proxy was started from, as its snapshot record says.
#[derive(Debug, Clone)]
pub(crate) struct Origin {
    pub(crate) service: Arc<Service>,
    pub(crate) token: TokenFingerprint,
}

impl Origin {
    /// The proxy it runs, if its token is `wanted`'s (a token is recorded only by its
    /// fingerprint, so only the wanted token can rebuild it).
    fn applied(&self, wanted: &ManagedProxy) -> Option<ManagedProxy> {
        if wanted.token().fingerprint() != self.token {
            return None;
        }
        ManagedProxy::new(self.service.clone(), wanted.token().clone())
    }
}

/// What the engine knows of one proxy, when no action runs on it.
#[derive(Debug, Clone)]
pub(crate) enum Observed {
    /// Nothing runs: never started, stopped, or waiting for a free action slot.
    Idle,
    /// Runs `applied`.
    Running { applied: Arc<ManagedProxy> },
    /// Taken over from an earlier agent; runs what `origin` says, or something unknown.
    Adopted { origin: Option<Origin> },
    /// Refused by policy when `wanted` was wanted.
    Blocked { wanted: Arc<ManagedProxy> },
    /// An action failed when `wanted` was wanted; `has_process` if something may still run.
    Failed { wanted: Option<Arc<ManagedProxy>>, has_process: bool },
}

impl Observed {
    /// Whether a process (or possibly one) is behind this proxy.
    pub(crate) fn has_process(&self) -> bool {
        match self {
            Self::Running { .. } | Self::Adopted { .. } => true,
            Self::Failed { has_process, .. } => *has_process,
            Self::Idle | Self::Blocked { .. } => false,
        }
    }
}

/// The next step for one proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Action {
    /// Build a handle and start it.
    Start,
    /// Stop the process.
    Stop,
    /// Stop the process, then start the wanted proxy.
    Restart,
    /// Apply the wanted proxy to the running process.
    Update,
    /// Record that policy refuses the wanted proxy.
    Block,
    /// Drop the entry: nothing runs and nothing is wanted.
    Forget,
}

fn same(a: &ManagedProxy, b: &ManagedProxy) -> bool {
    a.change_to(b) == ProxyChange::Unchanged
}

/// What to do for one proxy that no action runs on: `desired` is what the catalog wants
/// (`None`: nothing), `observed` what the engine knows (`None`: never seen).
pub(crate) fn decide(
    desired: Option<&Arc<ManagedProxy>>,
    observed: Option<&Observed>,
    policy: &Policy,
) -> Option<Action> {
    let Some(wanted) = desired else {
        return match observed? {
            // A failed stop is retried on the next change to the proxy, not in a loop.
            Observed::Failed { wanted: None, has_process: true } => None,
            other if other.has_process() => Some(Action::Stop),
            _ => Some(Action::Forget),
        };
    };
    let observed = observed.unwrap_or(&Observed::Idle);
    if policy.refusal(wanted).is_some() {
        return match observed {
            Observed::Blocked { wanted: was } if same(was, wanted) => None,
            Observed::Failed { wanted: Some(was), .. } if same(was, wanted) => None,
            other if other.has_process() => Some(Action::Stop),
            _ => Some(Action::Block),
        };
    }
    match observed {
        Observed::Idle | Observed::Blocked { .. } => Some(Action::Start),
        Observed::Failed { wanted: Some(was), .. } if same(was, wanted) => None,
        Observed::Failed { has_process: true, .. } => Some(Action::Restart),
        Observed::Failed { has_process: false, .. } => Some(Action::Start),
        Observed::Running { applied } => match applied.change_to(wanted) {
            ProxyChange::Unchanged => None,
            ProxyChange::InPlace => Some(Action::Update),
            ProxyChange::Restart => Some(Action::Restart),
        },
        // An adopted handle has not been given its proxy yet: even an unchanged one gets an
        // update, so that the backend knows what to restart it as after an exit.
        Observed::Adopted { origin } => match origin.as_ref().and_then(|origin| origin.applied(wanted)) {
            Some(old) if old.change_to(wanted) != ProxyChange::Restart => Some(Action::Update),
            _ => Some(Action::Restart),
        },
    }
}

/// [`decide`] for every proxy that is wanted or known, in id order.
#[cfg(test)]
pub(crate) fn plan(
    desired: &std::collections::HashMap<tether_state::ProxyId, Arc<ManagedProxy>>,
    observed: &std::collections::HashMap<tether_state::ProxyId, Observed>,
    policy: &Policy,
) -> Vec<(tether_state::ProxyId, Action)> {
    let ids: std::collections::BTreeSet<&tether_state::ProxyId> = desired.keys().chain(observed.keys()).collect();
    ids.into_iter().filter_map(|id| Some((id.clone(), decide(desired.get(id), observed.get(id), policy)?))).collect()
}

#[cfg(test)]
mod tests;
