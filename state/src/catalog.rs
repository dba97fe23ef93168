//! The catalog: the services the agent should run proxies for, and change notifications.
//!
//! [`LocalState`] is an in-memory value shared between tasks. Writers never block on
//! readers: a mutation takes a short lock, bumps the catalog's revision, and publishes it
//! on a watch channel. Readers ask what changed since the revision they last saw, so a
//! missed wake-up never loses a change, and many changes between two reads fold into one.
//! This module performs no I/O and spawns no tasks.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

use crate::id::{ProxyId, ServiceId};
use crate::service::{ManagedProxy, Service};
use crate::token::{ProxyToken, TokenError};

/// A point in the catalog's history: the catalog's revision counts its mutations, and each
/// entry carries the revision of its own last change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Revision(u64);

impl Revision {
    /// The revision before any change.
    pub const ZERO: Revision = Revision(0);

    /// Wraps a raw number, for fakes and persisted indexes.
    pub fn new(raw: u64) -> Self {
        Self(raw)
    }

    /// The raw number.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Who put a service into the catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Source {
    /// A config file, replaced as a whole on reload.
    Config {
        /// The file that defines the service.
        file: PathBuf,
    },
    /// The register API; persisted under `registrations/`.
    Api,
    /// Another source, such as a cluster store, named by the caller.
    External(String),
}

impl Source {
    /// The kind of source, without its details.
    pub fn kind(&self) -> SourceKind {
        match self {
            Self::Config { .. } => SourceKind::Config,
            Self::Api => SourceKind::Api,
            Self::External(name) => SourceKind::External(name.clone()),
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config { file } => write!(f, "config file {}", crate::config::DisplayPath(file)),
            Self::Api => f.write_str("the API"),
            Self::External(name) => write!(f, "{name}"),
        }
    }
}

/// The kind of a [`Source`]: what a bulk replace or a removal applies to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SourceKind {
    /// Config files.
    Config,
    /// The register API.
    Api,
    /// Another named source.
    External(String),
}

impl fmt::Display for SourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config => f.write_str("config files"),
            Self::Api => f.write_str("the API"),
            Self::External(name) => f.write_str(name),
        }
    }
}

/// A catalog mutation that was refused. Nothing was changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CatalogError {
    /// The service belongs to another source.
    #[error("service {id} is defined by {owner}, not by {requested}")]
    Conflict {
        /// The service.
        id: ServiceId,
        /// The source that owns it.
        owner: Source,
        /// The source that tried to change it.
        requested: SourceKind,
    },
    /// The service is not in the catalog.
    #[error("service {id} is not registered")]
    NotFound {
        /// The service.
        id: ServiceId,
    },
    /// The same id appears twice in one bulk replace.
    #[error("service {id} appears twice")]
    Duplicate {
        /// The service.
        id: ServiceId,
    },
    /// A token for a new proxy could not be made.
    #[error("cannot make a token for proxy {id}")]
    Token {
        /// The proxy.
        id: ProxyId,
        /// Why.
        #[source]
        source: TokenError,
    },
}

/// One service in the catalog.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The service.
    pub service: Arc<Service>,
    /// Who put it there.
    pub source: Source,
    /// The revision of its last change.
    pub revision: Revision,
    /// Its managed proxy, if the service has one.
    pub proxy: Option<Arc<ManagedProxy>>,
}

/// A proxy the catalog wants running, at the revision of its last change.
#[derive(Debug, Clone)]
pub struct DesiredProxy {
    /// The revision of the service's last change.
    pub revision: Revision,
    /// The proxy.
    pub proxy: Arc<ManagedProxy>,
}

/// What changed in the catalog, as returned by [`Catalog::changes_since`].
#[derive(Debug, Clone, Default)]
pub struct Changes {
    /// The catalog's revision this answer reflects; pass it to the next call.
    pub revision: Revision,
    /// When true, `upserted` is the whole desired set and any proxy not in it is unwanted;
    /// `removed` is then empty.
    pub complete: bool,
    /// Proxies that are new or changed (or, when `complete`, all of them), by id.
    pub upserted: Vec<DesiredProxy>,
    /// Proxies that are no longer wanted.
    pub removed: Vec<ProxyId>,
}

/// What a bulk replace did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplaceReport {
    /// Services added.
    pub added: usize,
    /// Services whose definition changed.
    pub changed: usize,
    /// Services removed.
    pub removed: usize,
}

/// Creates change notifications: the writer's half of a [`Subscription`].
///
/// Notifying never blocks and never waits for a reader. Fakes of [`Catalog`] use it too.
#[derive(Debug)]
pub struct ChangeNotifier(watch::Sender<Revision>);

impl ChangeNotifier {
    /// A notifier whose subscribers start at `revision`.
    pub fn new(revision: Revision) -> Self {
        Self(watch::Sender::new(revision))
    }

    /// Tells every subscriber that the catalog is now at `revision`.
    pub fn notify(&self, revision: Revision) {
        self.0.send_replace(revision);
    }

    /// A new subscription; its first [`Subscription::changed`] waits for the next notify.
    pub fn subscribe(&self) -> Subscription {
        Subscription(self.0.subscribe())
    }
}

/// A reader's half of change notifications.
#[derive(Debug, Clone)]
pub struct Subscription(watch::Receiver<Revision>);

impl Subscription {
    /// Waits until the catalog changes after the last call, and returns its revision then.
    /// Returns `None` once the catalog is gone.
    ///
    /// Changes made before the wait started are not missed: they complete it at once. Any
    /// number of changes between two calls complete one call.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped call loses nothing, and the next call sees the change.
    pub async fn changed(&mut self) -> Option<Revision> {
        self.0.changed().await.ok()?;
        Some(*self.0.borrow_and_update())
    }

    /// The latest revision published, without waiting.
    pub fn current(&self) -> Revision {
        *self.0.borrow()
    }
}

/// What the reconcile engine reads: the desired proxies and a way to learn of changes.
///
/// [`LocalState`] is the production implementation; tests can use `MockCatalog` (enable
/// the `mock` feature outside this crate) or a fake built on [`ChangeNotifier`].
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
pub trait Catalog: Send + Sync {
    /// What changed after `since`: only the entries whose revision is later, or the whole
    /// desired set (`complete`) when `since` is `None` or older than the catalog remembers.
    fn changes_since(&self, since: Option<Revision>) -> Changes;

    /// Notifications of changes.
    fn subscribe(&self) -> Subscription;
}

/// How many removals the catalog remembers beyond its live entries before readers that are
/// that far behind get a complete answer instead of a delta.
const TOMBSTONE_SLACK: usize = 1024;

/// The catalog of services, shared between the API, config reloads and the engine.
///
/// Cloning is cheap and every clone sees the same catalog.
///
/// ```
/// use tether_state::{Catalog, LocalState, ProxySpec, Service, ServiceId, ServiceName, Source};
///
/// let state = LocalState::new();
/// let web = Service::new(ServiceId::new("web").unwrap(), ServiceName::new("web").unwrap())
///     .with_proxy(ProxySpec::default());
/// state.upsert(web, Source::Api).unwrap();
/// let changes = state.changes_since(None);
/// assert_eq!(changes.upserted[0].proxy.id().as_str(), "web-proxy");
/// assert!(state.changes_since(Some(changes.revision)).upserted.is_empty());
/// ```
#[derive(Clone)]
pub struct LocalState {
    shared: Arc<Shared>,
}

struct Shared {
    inner: Mutex<Inner>,
    notifier: ChangeNotifier,
}

#[derive(Default)]
struct Inner {
    revision: u64,
    entries: BTreeMap<ServiceId, Entry>,
    /// Every live entry and every remembered removal, by the revision of its last change.
    journal: BTreeSet<(u64, ServiceId)>,
    /// Removed services, with the revision of their removal.
    tombstones: HashMap<ServiceId, u64>,
    /// Readers older than this get a complete answer.
    floor: u64,
    /// Tokens restored from storage, waiting for their service to be added.
    restored_tokens: HashMap<ProxyId, ProxyToken>,
}

impl fmt::Debug for LocalState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.lock();
        f.debug_struct("LocalState").field("revision", &inner.revision).field("services", &inner.entries.len()).finish()
    }
}

impl Default for LocalState {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalState {
    /// An empty catalog.
    pub fn new() -> Self {
        Self::with_tokens(BTreeMap::new())
    }

    /// An empty catalog that gives each proxy the token it had before, when one is known,
    /// so that an agent restart does not change tokens (and so restart proxies).
    pub fn with_tokens(tokens: BTreeMap<ProxyId, ProxyToken>) -> Self {
        let inner = Inner { restored_tokens: tokens.into_iter().collect(), ..Inner::default() };
        Self { shared: Arc::new(Shared { inner: Mutex::new(inner), notifier: ChangeNotifier::new(Revision::ZERO) }) }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while the lock was held cannot leave `Inner` half-updated: every mutation
        // prepares its changes first and applies them with infallible steps.
        crate::lock(&self.shared.inner)
    }

    /// Adds or replaces one service on behalf of `source`.
    ///
    /// An identical definition changes nothing: no new revision, no notification. A service
    /// that gains a proxy gets a new token; one that keeps its proxy keeps its token.
    ///
    /// # Errors
    ///
    /// [`CatalogError::Conflict`] if another kind of source owns the id;
    /// [`CatalogError::Token`] if a token cannot be made.
    pub fn upsert(&self, service: impl Into<Arc<Service>>, source: Source) -> Result<Revision, CatalogError> {
        let service: Arc<Service> = service.into();
        let mut inner = self.lock();
        if let Some(existing) = inner.entries.get(&service.id) {
            if existing.source.kind() != source.kind() {
                return Err(CatalogError::Conflict {
                    id: service.id.clone(),
                    owner: existing.source.clone(),
                    requested: source.kind(),
                });
            }
        }
        let prepared = inner.prepare(service, source)?;
        if let Some(prepared) = prepared {
            let revision = inner.revision + 1;
            inner.apply(prepared, revision);
            inner.revision = revision;
            self.shared.notifier.notify(Revision(revision));
        }
        Ok(Revision(inner.revision))
    }

    /// Removes one service on behalf of `source`.
    ///
    /// # Errors
    ///
    /// [`CatalogError::NotFound`] if there is no such service; [`CatalogError::Conflict`]
    /// if another kind of source owns it (a config file's service cannot be deregistered
    /// through the API).
    pub fn remove(&self, id: &ServiceId, source: &SourceKind) -> Result<Revision, CatalogError> {
        let mut inner = self.lock();
        let Some(existing) = inner.entries.get(id) else {
            return Err(CatalogError::NotFound { id: id.clone() });
        };
        if &existing.source.kind() != source {
            return Err(CatalogError::Conflict {
                id: id.clone(),
                owner: existing.source.clone(),
                requested: source.clone(),
            });
        }
        let revision = inner.revision + 1;
        inner.delete(id, revision);
        inner.revision = revision;
        inner.prune_tombstones();
        self.shared.notifier.notify(Revision(revision));
        Ok(Revision(revision))
    }

    /// Replaces every service of `kind` with `services`, atomically: either the whole new
    /// set is in place, or (on error) nothing changed. Used for config reloads.
    ///
    /// # Errors
    ///
    /// [`CatalogError::Conflict`] if a service id is owned by another kind of source,
    /// [`CatalogError::Duplicate`] if an id appears twice, [`CatalogError::Token`] if a
    /// token cannot be made.
    pub fn replace_source<S: Into<Arc<Service>>>(
        &self,
        kind: &SourceKind,
        services: Vec<(S, Source)>,
    ) -> Result<ReplaceReport, CatalogError> {
        let services: Vec<(Arc<Service>, Source)> =
            services.into_iter().map(|(s, source)| (s.into(), source)).collect();
        let mut inner = self.lock();
        let wanted: BTreeSet<&ServiceId> = services.iter().map(|(service, _)| &service.id).collect();
        let gone: Vec<ServiceId> = inner
            .entries
            .iter()
            .filter(|(id, entry)| &entry.source.kind() == kind && !wanted.contains(id))
            .map(|(id, _)| id.clone())
            .collect();
        self.change_locked(&mut inner, kind, services, gone)
    }

    /// Changes some services of `kind`, atomically: puts every one of `upserts` in place
    /// and removes every id of `removals`, at one revision, or (on error) changes nothing.
    /// A removal of an id that `kind` does not hold is skipped. Used when only part of a
    /// source changed, so that the rest is not compared again.
    ///
    /// # Errors
    ///
    /// As [`LocalState::replace_source`].
    pub fn change_source<S: Into<Arc<Service>>>(
        &self,
        kind: &SourceKind,
        upserts: Vec<(S, Source)>,
        removals: &[ServiceId],
    ) -> Result<ReplaceReport, CatalogError> {
        let upserts: Vec<(Arc<Service>, Source)> = upserts.into_iter().map(|(s, source)| (s.into(), source)).collect();
        let mut inner = self.lock();
        let gone = removals
            .iter()
            .filter(|id| inner.entries.get(*id).is_some_and(|entry| &entry.source.kind() == kind))
            .filter(|id| !upserts.iter().any(|(service, _)| &service.id == *id))
            .cloned()
            .collect();
        self.change_locked(&mut inner, kind, upserts, gone)
    }

    /// Puts `services` in place and deletes `gone` (ids that `kind` holds), at one revision.
    fn change_locked(
        &self,
        inner: &mut Inner,
        kind: &SourceKind,
        services: Vec<(Arc<Service>, Source)>,
        gone: Vec<ServiceId>,
    ) -> Result<ReplaceReport, CatalogError> {
        let mut seen = BTreeSet::new();
        for (service, _) in &services {
            if !seen.insert(&service.id) {
                return Err(CatalogError::Duplicate { id: service.id.clone() });
            }
            if let Some(existing) = inner.entries.get(&service.id) {
                if &existing.source.kind() != kind {
                    return Err(CatalogError::Conflict {
                        id: service.id.clone(),
                        owner: existing.source.clone(),
                        requested: kind.clone(),
                    });
                }
            }
        }
        let mut report = ReplaceReport::default();
        let mut prepared = Vec::with_capacity(services.len());
        for (service, source) in services {
            let existed = inner.entries.contains_key(&service.id);
            match inner.prepare(service, source)? {
                Some(ready) if existed => {
                    report.changed += usize::from(ready.content_changed);
                    prepared.push(ready);
                }
                Some(ready) => {
                    report.added += 1;
                    prepared.push(ready);
                }
                None => {}
            }
        }
        report.removed = gone.len();
        if prepared.is_empty() && gone.is_empty() {
            return Ok(report);
        }
        let revision = inner.revision + 1;
        for ready in prepared {
            inner.apply(ready, revision);
        }
        for id in &gone {
            inner.delete(id, revision);
        }
        inner.revision = revision;
        inner.prune_tombstones();
        self.shared.notifier.notify(Revision(revision));
        Ok(report)
    }

    /// One service's entry.
    pub fn get(&self, id: &ServiceId) -> Option<Entry> {
        self.lock().entries.get(id).cloned()
    }

    /// Every entry, ordered by id.
    pub fn entries(&self) -> Vec<Entry> {
        self.lock().entries.values().cloned().collect()
    }

    /// The managed proxies that `wanted` picks, ordered by service id: a reader that needs a
    /// few proxies of every change (those with templates, say) pays for those, not for a
    /// copy of every entry. `wanted` runs under the catalog's lock: it must be short and
    /// must not call the catalog.
    pub fn proxies_where(&self, wanted: impl Fn(&ManagedProxy) -> bool) -> Vec<Arc<ManagedProxy>> {
        self.lock()
            .entries
            .values()
            .filter_map(|entry| entry.proxy.as_ref())
            .filter(|proxy| wanted(proxy))
            .cloned()
            .collect()
    }

    /// Whether the catalog has proxy `id`.
    pub fn has_proxy(&self, id: &ProxyId) -> bool {
        self.lock()
            .entries
            .get(&id.service_id())
            .and_then(|entry| entry.proxy.as_ref())
            .is_some_and(|proxy| proxy.id() == id)
    }

    /// The number of services.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether the catalog has no services.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The catalog's current revision.
    pub fn revision(&self) -> Revision {
        Revision(self.lock().revision)
    }

    /// The token that the proxy `proxy` has, or that an upsert of its service would give it
    /// if it is not in the catalog: the one it had before, when one is known, else a new one,
    /// kept for that upsert. A caller can so persist a new proxy's token before the proxy
    /// enters the catalog, and so before an engine can start it.
    ///
    /// # Errors
    ///
    /// [`CatalogError::Token`] if a token cannot be made.
    pub fn token_for(&self, proxy: &ProxyId) -> Result<ProxyToken, CatalogError> {
        let mut inner = self.lock();
        let current = inner.entries.get(&proxy.service_id()).and_then(|entry| entry.proxy.as_ref());
        if let Some(current) = current {
            return Ok(current.token().clone());
        }
        if let Some(kept) = inner.restored_tokens.get(proxy) {
            return Ok(kept.clone());
        }
        let token = ProxyToken::generate().map_err(|source| CatalogError::Token { id: proxy.clone(), source })?;
        inner.restored_tokens.insert(proxy.clone(), token.clone());
        Ok(token)
    }

    /// The token of every proxy in the catalog, for persisting.
    pub fn tokens(&self) -> BTreeMap<ProxyId, ProxyToken> {
        self.lock()
            .entries
            .values()
            .filter_map(|entry| entry.proxy.as_ref())
            .map(|proxy| (proxy.id().clone(), proxy.token().clone()))
            .collect()
    }
}

impl Catalog for LocalState {
    fn changes_since(&self, since: Option<Revision>) -> Changes {
        let inner = self.lock();
        let revision = Revision(inner.revision);
        let since = match since {
            Some(since) if since.0 >= inner.floor && since.0 <= inner.revision => since.0,
            _ => {
                let upserted = inner
                    .entries
                    .values()
                    .filter_map(|entry| {
                        let proxy = entry.proxy.clone()?;
                        Some(DesiredProxy { revision: entry.revision, proxy })
                    })
                    .collect();
                return Changes { revision, complete: true, upserted, removed: Vec::new() };
            }
        };
        let mut changes = Changes { revision, ..Changes::default() };
        let start = (since + 1, first_service_id());
        for (_, id) in inner.journal.range(start..) {
            match inner.entries.get(id) {
                Some(Entry { proxy: Some(proxy), revision, .. }) => {
                    changes.upserted.push(DesiredProxy { revision: *revision, proxy: proxy.clone() });
                }
                // A service without a proxy, or a removed one: its proxy, if any, is unwanted.
                Some(Entry { proxy: None, .. }) | None => changes.removed.push(id.proxy_id()),
            }
        }
        changes
    }

    fn subscribe(&self) -> Subscription {
        self.shared.notifier.subscribe()
    }
}

/// The smallest possible service id, as the lower bound of journal ranges.
fn first_service_id() -> ServiceId {
    ServiceId::new("0").unwrap_or_else(|_| unreachable!("\"0\" is a valid service id"))
}

/// A change checked and ready to apply without any further failure.
struct Prepared {
    service: Arc<Service>,
    source: Source,
    proxy: Option<Arc<ManagedProxy>>,
    /// False when only the source's details changed (a service moved between files).
    content_changed: bool,
}

impl Inner {
    /// Checks `service` against the current entry and makes its proxy, with its token.
    /// Returns `None` when nothing would change.
    fn prepare(&self, service: Arc<Service>, source: Source) -> Result<Option<Prepared>, CatalogError> {
        let existing = self.entries.get(&service.id);
        if let Some(existing) = existing {
            if *existing.service == *service {
                if existing.source == source {
                    return Ok(None);
                }
                return Ok(Some(Prepared {
                    service: existing.service.clone(),
                    source,
                    proxy: existing.proxy.clone(),
                    content_changed: false,
                }));
            }
        }
        // Shared with whoever gave it (a config loader keeps the same services).
        let proxy = if service.proxy.is_some() {
            let proxy_id = service.id.proxy_id();
            let token = match existing.and_then(|e| e.proxy.as_ref()) {
                Some(old) => old.token().clone(),
                None => match self.restored_tokens.get(&proxy_id) {
                    Some(token) => token.clone(),
                    None => ProxyToken::generate().map_err(|source| CatalogError::Token { id: proxy_id, source })?,
                },
            };
            ManagedProxy::new(service.clone(), token).map(Arc::new)
        } else {
            None
        };
        Ok(Some(Prepared { service, source, proxy, content_changed: true }))
    }

    fn apply(&mut self, prepared: Prepared, revision: u64) {
        let id = prepared.service.id.clone();
        if let Some(proxy) = &prepared.proxy {
            self.restored_tokens.remove(proxy.id());
        }
        if !prepared.content_changed {
            if let Some(entry) = self.entries.get_mut(&id) {
                entry.source = prepared.source;
            }
            return;
        }
        if let Some(old) = self.entries.get(&id) {
            self.journal.remove(&(old.revision.0, id.clone()));
        }
        if let Some(removed_at) = self.tombstones.remove(&id) {
            self.journal.remove(&(removed_at, id.clone()));
        }
        self.journal.insert((revision, id.clone()));
        let entry = Entry {
            service: prepared.service,
            source: prepared.source,
            revision: Revision(revision),
            proxy: prepared.proxy,
        };
        self.entries.insert(id, entry);
    }

    fn delete(&mut self, id: &ServiceId, revision: u64) {
        if let Some(old) = self.entries.remove(id) {
            self.journal.remove(&(old.revision.0, id.clone()));
            self.journal.insert((revision, id.clone()));
            self.tombstones.insert(id.clone(), revision);
        }
    }

    /// Forgets the oldest removals once there are many, raising the floor below which
    /// readers get a complete answer. Keeps the journal proportional to the catalog.
    fn prune_tombstones(&mut self) {
        let limit = self.entries.len().max(TOMBSTONE_SLACK);
        if self.tombstones.len() <= limit {
            return;
        }
        let mut oldest: Vec<(u64, ServiceId)> = self.tombstones.iter().map(|(id, &rev)| (rev, id.clone())).collect();
        oldest.sort_unstable();
        let excess = self.tombstones.len() - limit / 2;
        for (rev, id) in oldest.into_iter().take(excess) {
            self.tombstones.remove(&id);
            self.journal.remove(&(rev, id));
            self.floor = self.floor.max(rev);
        }
    }
}

#[cfg(test)]
mod tests;
