//! Leaf certificates of the catalog's services, kept valid: [`Leaves`] issues one for each
//! service that has a managed proxy, through the [`CertificateAuthority`] seam, renews it at a
//! random point between 60 and 80 % of its life, retries a failed issue on a backoff, and
//! publishes what it holds ([`LeafBoard`]) and what happened ([`LeafEvent`]).
//!
//! The seam signs; this module decides when. It reads no file and performs no cryptography:
//! the agent supplies the authority (its certificate and key, or a CA of its own) and may
//! replace it on a reload. A private key travels only inside [`IssuedLeaf`], whose key never
//! shows in `Debug`.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tether_state::{
    Backoff, CaRoot, Catalog, Datacenter, IssuedLeaf, LeafRequest, ServiceId, ServiceName, SpiffeId, TrustDomain,
};
use tokio::sync::{broadcast, mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::BoxError;

/// Signs leaf certificates for the services of the mesh, and says which roots it trusts.
///
/// The agent provides the implementations (an operator's CA from files, or a CA the agent
/// made for itself); tests use `MockCertificateAuthority` (enable the `mock` feature outside
/// this crate).
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
pub trait CertificateAuthority: Send + Sync {
    /// The roots the mesh trusts: the one the leaves chain to first (`active`), then the
    /// others being rotated in or out.
    fn roots(&self) -> Vec<CaRoot>;

    /// Signs a new leaf, with a new private key, valid from now for `request.ttl`.
    ///
    /// Signing is CPU work of a fraction of a millisecond: no file is read, nothing waits.
    ///
    /// # Errors
    ///
    /// [`CaError::Sign`] when the leaf cannot be made.
    fn issue(&self, request: LeafRequest) -> Result<IssuedLeaf, CaError>;
}

/// Why a certificate authority could not sign.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CaError {
    /// The leaf of one service could not be made.
    #[error("cannot sign a leaf certificate for service {service}")]
    Sign {
        /// The service.
        service: ServiceId,
        /// Why.
        #[source]
        source: BoxError,
    },
}

/// What every leaf carries and how it is kept: the identity's parts, the lifetime, and the
/// waits between failed attempts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafPolicy {
    /// The trust domain of every identity.
    pub trust_domain: TrustDomain,
    /// The datacenter of every identity.
    pub datacenter: Datacenter,
    /// How long each leaf is valid.
    pub ttl: Duration,
    /// The waits between failed attempts to issue a leaf.
    pub retry: Backoff,
}

impl LeafPolicy {
    /// The first wait after a failed issue.
    pub const RETRY_FIRST: Duration = Duration::from_secs(1);
    /// The longest wait between failed issues.
    pub const RETRY_MAX: Duration = Duration::from_secs(60);

    /// Leaves of `ttl` in `trust_domain` and `datacenter`, retried after 1 s, 2 s, … up to a
    /// minute.
    pub fn new(trust_domain: TrustDomain, datacenter: Datacenter, ttl: Duration) -> Self {
        Self { trust_domain, datacenter, ttl, retry: Backoff::new(Self::RETRY_FIRST, Self::RETRY_MAX) }
    }
}

/// What [`Leaves`] holds for one service.
#[derive(Debug, Clone, Default)]
pub struct LeafStatus {
    /// The service's name, which its identity carries.
    pub name: Option<ServiceName>,
    /// The valid leaf, if there is one.
    pub leaf: Option<Arc<IssuedLeaf>>,
    /// The board's index when `leaf` was put in place (0: never): a blocking query waits
    /// for it to pass the index it was given.
    pub index: u64,
    /// When the leaf is renewed (or the next attempt is made, after a failure).
    pub next_attempt: Option<SystemTime>,
    /// Why the last attempt failed, or why there is no valid leaf; `None` while all is well.
    pub error: Option<String>,
    /// Failed attempts since the last success.
    pub failures: u32,
}

/// Every service's leaf, and the roots, as last published. Each change raises `index`.
#[derive(Debug, Clone, Default)]
pub struct LeafBoard {
    /// The board's index: raised by every change of a leaf or of the roots.
    pub index: u64,
    /// The index at which the roots last changed.
    pub roots_index: u64,
    /// The trusted roots, the active one first.
    pub roots: Arc<[CaRoot]>,
    /// The trust domain of the leaves.
    pub trust_domain: Option<TrustDomain>,
    /// Each service's leaf, by service id.
    pub services: BTreeMap<ServiceId, LeafStatus>,
}

/// What happened to a service's leaf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeafEventKind {
    /// The service's first leaf (or the first after a change of CA, name or lifetime).
    Issued,
    /// A leaf replaced the previous one before it expired.
    Renewed,
    /// An attempt to issue failed; it is retried on the backoff.
    Failed,
    /// The leaf expired before a renewal succeeded.
    Expired,
}

impl LeafEventKind {
    /// The event's name in the events stream: `leaf-issued`, `leaf-renewed`, `leaf-failed`,
    /// `leaf-expired`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Issued => "leaf-issued",
            Self::Renewed => "leaf-renewed",
            Self::Failed => "leaf-failed",
            Self::Expired => "leaf-expired",
        }
    }
}

/// One thing that happened to a service's leaf. It never carries the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafEvent {
    /// The service.
    pub service: ServiceId,
    /// What happened.
    pub kind: LeafEventKind,
    /// The serial of the leaf now held, if any.
    pub serial: Option<String>,
    /// When that leaf expires.
    pub not_after: Option<SystemTime>,
    /// Why an attempt failed.
    pub error: Option<String>,
}

/// What the agent asks of a running [`Leaves`].
enum Command {
    Replace { ca: Arc<dyn CertificateAuthority>, policy: LeafPolicy },
}

/// The reading side of [`Leaves`]: the board, its events, and the replacement of the CA.
/// Cloning is cheap.
#[derive(Clone)]
pub struct LeavesHandle {
    board: watch::Receiver<LeafBoard>,
    events: broadcast::Sender<LeafEvent>,
    commands: mpsc::UnboundedSender<Command>,
}

impl LeavesHandle {
    /// The board as last published.
    pub fn board(&self) -> watch::Ref<'_, LeafBoard> {
        self.board.borrow()
    }

    /// A receiver of every later board, for blocking queries.
    pub fn watch(&self) -> watch::Receiver<LeafBoard> {
        self.board.clone()
    }

    /// The events from now on.
    pub fn events(&self) -> broadcast::Receiver<LeafEvent> {
        self.events.subscribe()
    }

    /// Replaces the certificate authority and the policy: every leaf is issued again by the
    /// new one. A leaf that the new one cannot issue keeps its current one while it is valid.
    pub fn replace(&self, ca: Arc<dyn CertificateAuthority>, policy: LeafPolicy) {
        // A send fails only once the loop has ended, when nothing is left to replace.
        let _ = self.commands.send(Command::Replace { ca, policy });
    }
}

/// One service's schedule.
struct Slot {
    name: ServiceName,
    /// When to issue next: renewal, retry, or now.
    due: Instant,
    /// When the current leaf expires.
    expires: Option<Instant>,
    backoff: Backoff,
    /// Whether it has held a leaf since the CA or its identity changed.
    issued: bool,
}

/// Keeps a valid leaf certificate for each service of the catalog that has a managed proxy.
pub struct Leaves {
    catalog: Arc<dyn Catalog>,
    ca: Arc<dyn CertificateAuthority>,
    policy: LeafPolicy,
    slots: HashMap<ServiceId, Slot>,
    board: watch::Sender<LeafBoard>,
    events: broadcast::Sender<LeafEvent>,
    commands: mpsc::UnboundedReceiver<Command>,
    handle: LeavesHandle,
}

/// How many events a slow reader may fall behind by before it misses some.
const EVENT_BACKLOG: usize = 1024;

impl Leaves {
    /// Leaves for the services of `catalog`, signed by `ca` under `policy`. Nothing is issued
    /// before [`Leaves::run`]; [`Leaves::issue_all`] issues the first leaves at once.
    pub fn new(catalog: Arc<dyn Catalog>, ca: Arc<dyn CertificateAuthority>, policy: LeafPolicy) -> Self {
        let board = watch::Sender::new(LeafBoard {
            roots: ca.roots().into(),
            trust_domain: Some(policy.trust_domain.clone()),
            ..LeafBoard::default()
        });
        let (events, _) = broadcast::channel(EVENT_BACKLOG);
        let (commands_tx, commands) = mpsc::unbounded_channel();
        let handle = LeavesHandle { board: board.subscribe(), events: events.clone(), commands: commands_tx };
        Self { catalog, ca, policy, slots: HashMap::new(), board, events, commands, handle }
    }

    /// The handle through which the API and the metrics read the leaves.
    pub fn handle(&self) -> LeavesHandle {
        self.handle.clone()
    }

    /// Takes in the catalog's services and issues every leaf that is due, now: at the agent's
    /// start, so that the proxies find their leaves from their first request.
    pub fn issue_all(&mut self) {
        let changes = self.catalog.changes_since(None);
        self.apply_changes(changes);
        self.issue_due(Instant::now());
    }

    /// Keeps the leaves until `stop` is cancelled: follows the catalog, renews and retries on
    /// time, and replaces the CA when asked.
    ///
    /// # Cancel safety
    ///
    /// Not cancel-safe: cancel `stop` instead of dropping the future.
    pub async fn run(mut self, stop: CancellationToken) {
        let mut subscription = self.catalog.subscribe();
        let mut revision = Some(self.catalog.changes_since(None).revision);
        // Whatever changed between `issue_all` and now is taken in by the first pass.
        self.issue_all();
        loop {
            let next = self.slots.values().map(Slot::next_wake).min();
            let sleep = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = stop.cancelled() => break,
                changed = subscription.changed() => {
                    if changed.is_none() {
                        break;
                    }
                    let changes = self.catalog.changes_since(revision);
                    revision = Some(changes.revision);
                    self.apply_changes(changes);
                }
                Some(command) = self.commands.recv() => self.apply_command(command),
                () = sleep => {}
            }
            self.issue_due(Instant::now());
        }
    }

    fn apply_command(&mut self, command: Command) {
        match command {
            Command::Replace { ca, policy } => {
                self.ca = ca;
                self.policy = policy;
                let now = Instant::now();
                for slot in self.slots.values_mut() {
                    slot.due = now;
                    slot.issued = false;
                    slot.backoff = self.policy.retry;
                }
                let roots: Arc<[CaRoot]> = self.ca.roots().into();
                let domain = self.policy.trust_domain.clone();
                self.board.send_modify(|board| {
                    board.index += 1;
                    board.roots_index = board.index;
                    board.roots = roots;
                    board.trust_domain = Some(domain);
                });
            }
        }
    }

    /// Takes in the services that changed: new ones are due at once, a renamed one gets a
    /// new identity at once, removed ones leave the board.
    fn apply_changes(&mut self, changes: tether_state::Changes) {
        let now = Instant::now();
        let mut wanted: Vec<(ServiceId, ServiceName)> = Vec::with_capacity(changes.upserted.len());
        for desired in &changes.upserted {
            let service = desired.proxy.service();
            wanted.push((service.id.clone(), service.name.clone()));
        }
        let mut removed: Vec<ServiceId> = changes.removed.iter().map(|proxy| proxy.service_id()).collect();
        if changes.complete {
            let present: std::collections::HashSet<&ServiceId> = wanted.iter().map(|(id, _)| id).collect();
            removed.extend(self.slots.keys().filter(|id| !present.contains(id)).cloned());
        }
        for id in &removed {
            self.slots.remove(id);
        }
        for (id, name) in wanted {
            match self.slots.get_mut(&id) {
                Some(slot) if slot.name == name => {}
                Some(slot) => {
                    slot.name = name;
                    slot.due = now;
                    slot.issued = false;
                    slot.backoff.reset();
                }
                None => {
                    let slot = Slot { name, due: now, expires: None, backoff: self.policy.retry, issued: false };
                    self.slots.insert(id, slot);
                }
            }
        }
        if !removed.is_empty() {
            self.board.send_modify(|board| {
                for id in &removed {
                    board.services.remove(id);
                }
                board.index += 1;
            });
        }
    }

    /// Issues every leaf that is due at `now`, and drops those that expired; publishes the
    /// board once.
    fn issue_due(&mut self, now: Instant) {
        let mut updates: Vec<(ServiceId, LeafStatus, LeafEvent)> = Vec::new();
        let wall = SystemTime::now();
        for (id, slot) in &mut self.slots {
            if slot.expires.is_some_and(|expires| expires <= now) && slot.due > now {
                // Expired while its renewal kept failing: a leaf past its life serves nobody.
                slot.expires = None;
                let status = LeafStatus {
                    name: Some(slot.name.clone()),
                    next_attempt: Some(wall + slot.due.saturating_duration_since(now)),
                    error: Some("the leaf certificate expired before a renewal succeeded".to_owned()),
                    failures: slot.backoff.retries(),
                    ..LeafStatus::default()
                };
                let event = LeafEvent {
                    service: id.clone(),
                    kind: LeafEventKind::Expired,
                    serial: None,
                    not_after: None,
                    error: status.error.clone(),
                };
                updates.push((id.clone(), status, event));
                continue;
            }
            if slot.due > now {
                continue;
            }
            let outcome = SpiffeId::service(&self.policy.trust_domain, &self.policy.datacenter, &slot.name)
                .map_err(|err| err.to_string())
                .and_then(|spiffe_id| {
                    let request = LeafRequest { service_id: id.clone(), spiffe_id, ttl: self.policy.ttl };
                    self.ca.issue(request).map_err(|err| tether_state::error_chain(&err))
                });
            match outcome {
                Ok(leaf) => {
                    // Read after signing, so that the leaf's life is never overestimated.
                    let life = leaf.not_after.duration_since(SystemTime::now()).unwrap_or_default();
                    slot.expires = Some(now + life);
                    slot.due = now + renewal_point(life, &leaf.serial);
                    slot.backoff.reset();
                    let kind = if slot.issued { LeafEventKind::Renewed } else { LeafEventKind::Issued };
                    slot.issued = true;
                    tracing::debug!(service = %id, serial = %leaf.serial, event = kind.as_str(), "leaf certificate");
                    let event = LeafEvent {
                        service: id.clone(),
                        kind,
                        serial: Some(leaf.serial.clone()),
                        not_after: Some(leaf.not_after),
                        error: None,
                    };
                    let status = LeafStatus {
                        name: Some(slot.name.clone()),
                        leaf: Some(Arc::new(leaf)),
                        next_attempt: Some(wall + slot.due.saturating_duration_since(now)),
                        ..LeafStatus::default()
                    };
                    updates.push((id.clone(), status, event));
                }
                Err(error) => {
                    let wait = slot.backoff.next();
                    slot.due = now + wait;
                    tracing::warn!(
                        service = %id,
                        attempt = slot.backoff.retries(),
                        backoff_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                        error = %error,
                        "cannot issue a leaf certificate; retrying"
                    );
                    let expiry = match slot.expires {
                        Some(expires) => {
                            format!(
                                "; the current leaf expires in {}s",
                                expires.saturating_duration_since(now).as_secs()
                            )
                        }
                        None => "; the service has no valid leaf".to_owned(),
                    };
                    let status = LeafStatus {
                        name: Some(slot.name.clone()),
                        next_attempt: Some(wall + wait),
                        error: Some(format!("leaf certificate not renewed: {error}{expiry}")),
                        failures: slot.backoff.retries(),
                        ..LeafStatus::default()
                    };
                    let event = LeafEvent {
                        service: id.clone(),
                        kind: LeafEventKind::Failed,
                        serial: None,
                        not_after: None,
                        error: Some(error),
                    };
                    updates.push((id.clone(), status, event));
                }
            }
        }
        if updates.is_empty() {
            return;
        }
        let mut events = Vec::with_capacity(updates.len());
        self.board.send_modify(|board| {
            board.index += 1;
            let index = board.index;
            for (id, mut status, event) in updates {
                let previous = board.services.remove(&id);
                if status.leaf.is_some() {
                    status.index = index;
                } else if event.kind == LeafEventKind::Failed {
                    // A failed attempt keeps the leaf that is still valid, and its index.
                    if let Some(previous) = previous {
                        status.leaf = previous.leaf;
                        status.index = previous.index;
                    }
                } else {
                    // Expired: the leaf is gone, and a blocking query learns it.
                    status.index = index;
                }
                board.services.insert(id, status);
                events.push(event);
            }
        });
        for event in events {
            // No receiver is no error: nobody is listening.
            let _ = self.events.send(event);
        }
    }
}

impl Slot {
    /// When the loop must look at this slot again: its due time, or its expiry if sooner.
    fn next_wake(&self) -> Instant {
        match self.expires {
            Some(expires) if expires < self.due => expires,
            _ => self.due,
        }
    }
}

/// When to renew a leaf of `life`: at a point between 60 and 80 % of it, picked by the
/// serial, which the CA draws at random, so that leaves issued together are not renewed
/// together.
///
/// ```
/// # use std::time::Duration;
/// # use tether_manager::renewal_point;
/// let life = Duration::from_secs(1000);
/// let at = renewal_point(life, "3a:7f:01");
/// assert!(at >= Duration::from_secs(600) && at <= Duration::from_secs(800));
/// ```
pub fn renewal_point(life: Duration, serial: &str) -> Duration {
    let mut hasher = DefaultHasher::new();
    serial.hash(&mut hasher);
    let per_mille = 600 + u32::try_from(hasher.finish() % 201).unwrap_or(0);
    life.checked_mul(per_mille).map_or_else(|| (life / 1000).saturating_mul(per_mille), |scaled| scaled / 1000)
}

#[cfg(test)]
mod tests;
