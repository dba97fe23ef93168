//! The agent's fleet follower: keeps the catalog's etcd services equal to this node's keys.
//!
//! It starts from a consistent read at a revision R (or from `fleet.json`'s revision, which
//! the persisted set reflects), then watches from R + 1, so that no event is lost or applied
//! twice. A task of its own reads the watch as fast as etcd delivers it, keeping only the
//! latest event of each key, and is the one that says when the connection is lost; the
//! follower takes what is due of it as one change set — one atomic `replace_source` of the
//! whole set, so that a transaction that moves services between keys lands at once, and an
//! unchanged service is a no-op. Keys are coalesced as the engine coalesces proxies: a key
//! that was quiet for `--sync-quiescent` applies at once; one that keeps changing is held
//! until it has been quiet that long, at most `--sync-max-delay`, so that a burst of
//! thousands of puts on a few keys costs a few applies and delays no other key. A compacted
//! start revision triggers a full re-read. When etcd is unreachable the last known set stays in force
//! (in the catalog and in `fleet.json`), and the follower reconnects with capped,
//! jittered backoff, resuming where it stopped. It never starts a process and never fails
//! the agent: every problem is logged, counted and retried. The moment the store is lost
//! and the moment it is back are told as [`StoreEvent`]s (the API's events stream), and
//! since when it is lost is in the status.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use tether_state::persist::DataDir;
use tether_state::{Backoff, CatalogError, Service, Source};
use tokio::sync::{Notify, broadcast};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::publish::Revisions;
use super::store::FleetStore;
use super::{Desired, SOURCE_NAME, source_kind};
use crate::catalog::sources::Sources;
use crate::etcd::{self, Client, EtcdError, EtcdOptions, Layout, WatchStream, jittered, timed};

/// What the follower shows: the API's `GET /v1/agent/fleet` and the `tether_fleet_*` metrics.
#[derive(Debug, Clone, Default)]
pub(crate) struct FleetStatus {
    pub(crate) node: String,
    pub(crate) prefix: String,
    /// The etcd client URLs the agent was given.
    pub(crate) endpoints: Vec<String>,
    /// Whether a watch on etcd is established now.
    pub(crate) connected: bool,
    /// Since when the store is unreachable: set by the first failure after a watch was
    /// established (or at start), cleared when a watch is established again.
    pub(crate) unreachable_since: Option<SystemTime>,
    /// The etcd revision the applied set reflects (0: none read yet).
    pub(crate) revision: i64,
    /// Services applied to the catalog.
    pub(crate) services: usize,
    /// Keys skipped, with why: invalid values, or ids that another source owns.
    pub(crate) invalid: BTreeMap<String, String>,
    /// The last connection or watch error, while disconnected.
    pub(crate) last_error: Option<String>,
    counters: Counters,
}

#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    events: u64,
    applies: u64,
    full_reads: u64,
    compactions: u64,
    connect_failures: u64,
    persist_failures: u64,
}

/// The store lost or back, as the events stream tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoreEvent {
    pub(crate) time: SystemTime,
    /// `store-unreachable` or `store-reachable`.
    pub(crate) event: &'static str,
    pub(crate) detail: String,
}

/// The follower's status, shared with the API and the metrics collector, and the
/// [`StoreEvent`]s its changes make.
#[derive(Debug, Clone)]
pub(crate) struct SharedStatus {
    status: Arc<Mutex<FleetStatus>>,
    told: broadcast::Sender<StoreEvent>,
}

impl Default for SharedStatus {
    fn default() -> Self {
        // Two changes a session at most: a slow reader that misses some still has the status.
        let (told, _) = broadcast::channel(16);
        Self { status: Arc::default(), told }
    }
}

impl SharedStatus {
    fn lock(&self) -> MutexGuard<'_, FleetStatus> {
        tether_state::lock(&self.status)
    }

    /// A copy of the status now.
    pub(crate) fn get(&self) -> FleetStatus {
        self.lock().clone()
    }

    /// The store's changes from now on.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<StoreEvent> {
        self.told.subscribe()
    }

    /// A watch is established: the store is reachable, which is told when it was not.
    fn set_connected(&self, now: SystemTime) {
        let mut shown = self.lock();
        shown.connected = true;
        shown.last_error = None;
        if let Some(since) = shown.unreachable_since.take() {
            let lost = now.duration_since(since).unwrap_or_default();
            let detail = format!(
                "watching etcd again after {:.1} s; the agent follows its node's keys from where it stopped",
                lost.as_secs_f64()
            );
            // No subscriber is no error.
            let _ = self.told.send(StoreEvent { time: now, event: "store-reachable", detail });
        }
    }

    /// The store cannot be reached (`error`): said at once, and told at the first failure
    /// since it was last reachable.
    fn set_unreachable(&self, error: String, now: SystemTime) {
        let mut shown = self.lock();
        shown.connected = false;
        if shown.unreachable_since.is_none() {
            shown.unreachable_since = Some(now);
            let detail = format!(
                "etcd at {} unreachable: {error}; every proxy runs on, on the last known set",
                shown.endpoints.join(",")
            );
            let _ = self.told.send(StoreEvent { time: now, event: "store-unreachable", detail });
        }
        shown.last_error = Some(error);
    }
}

/// Why a session with etcd ended.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    #[error("the watch stream failed")]
    Stream(#[source] etcd::Error),
    #[error("etcd closed the watch stream")]
    StreamEnded,
    #[error("etcd canceled the watch: {reason}")]
    Canceled { reason: String },
}

/// How the follower coalesces change sets: the engine's `--sync-quiescent` and
/// `--sync-max-delay`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Coalesce {
    pub(crate) quiescent: Duration,
    pub(crate) max_delay: Duration,
}

/// Follows one node's keys in etcd into the catalog.
pub(crate) struct Follower {
    layout: Layout,
    etcd: EtcdOptions,
    coalesce: Coalesce,
    sources: Arc<Sources>,
    store: FleetStore,
    desired: Desired,
    status: SharedStatus,
    /// What the status publisher learns of each applied set.
    revisions: Revisions,
}

impl Follower {
    /// Loads the last known set from `fleet.json` into the catalog, so that the engine's
    /// first reconcile (and its adoption of running proxies) already sees it.
    pub(crate) fn new(
        layout: Layout,
        etcd: EtcdOptions,
        coalesce: Coalesce,
        sources: Arc<Sources>,
        data: &DataDir,
    ) -> Self {
        let store = FleetStore::in_data_dir(data);
        let status = SharedStatus::default();
        {
            let mut shown = status.lock();
            shown.node = layout.node().to_owned();
            shown.prefix = layout.prefix().to_owned();
            shown.endpoints.clone_from(&etcd.endpoints);
        }
        let revisions = Revisions::default();
        let mut follower =
            Self { layout, etcd, coalesce, sources, store, desired: Desired::default(), status, revisions };
        if let Some(persisted) = follower.store.load(&follower.layout) {
            tracing::info!(
                services = persisted.services.len(),
                revision = persisted.revision,
                "fleet: last known set loaded from fleet.json"
            );
            follower.apply(persisted);
        }
        follower
    }

    pub(crate) fn status(&self) -> SharedStatus {
        self.status.clone()
    }

    /// The revisions of each applied set, for the status publisher.
    pub(crate) fn revisions(&self) -> Revisions {
        self.revisions.clone()
    }

    /// Follows etcd until `stop` is cancelled.
    ///
    /// # Cancel safety
    ///
    /// Meant to run in its own task until `stop`; every catalog change and file write it
    /// makes is complete before its next await.
    pub(crate) async fn run(mut self, stop: CancellationToken) {
        let mut backoff = etcd::RECONNECT;
        loop {
            let ended = tokio::select! {
                () = stop.cancelled() => return,
                ended = self.session(&mut backoff) => ended,
            };
            let Err(ended) = ended;
            let error = crate::error::error_chain(&ended);
            let wait = jittered(backoff.next());
            self.status.lock().counters.connect_failures += 1;
            self.status.set_unreachable(error.clone(), SystemTime::now());
            tracing::warn!(
                error,
                retry_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                services = self.desired.services.len(),
                "fleet: etcd unreachable; the last known set stays in force"
            );
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Connects, catches up, and follows the watch until something fails.
    async fn session(&mut self, backoff: &mut Backoff) -> Result<Infallible, SessionError> {
        let client = self.etcd.connect().await?;
        // The fleet's intentions on the same connection, for as long as this session lasts:
        // one member serves both of the node's watches.
        let mut intentions = tokio::task::JoinSet::new();
        let intentions_prefix = self.layout.intentions_prefix();
        intentions.spawn(super::intentions::follow(client.clone(), intentions_prefix, self.sources.clone()));
        let prefix = self.layout.services_prefix();
        // Where etcd is now: a store that went back (restored from a backup, replaced by a
        // new cluster) cannot be resumed from our revision.
        let head = timed(&self.etcd, "read", client.count_prefix(&prefix)).await?;
        let now = etcd::revision(head.header.as_ref());
        let mut start = if self.desired.revision > 0 && self.desired.revision <= now {
            tracing::info!(revision = self.desired.revision, "fleet: resuming the watch after the last known revision");
            self.desired.revision + 1
        } else {
            self.full_read(&client).await? + 1
        };
        loop {
            let stream = timed(&self.etcd, "watch", client.watch_prefix(&prefix, start)).await?;
            self.status.set_connected(SystemTime::now());
            backoff.reset();
            let compacted = self.follow(stream).await?;
            self.status.lock().counters.compactions += 1;
            tracing::warn!(
                start,
                compacted,
                "fleet: the watch's start revision was compacted; reading every key again"
            );
            start = self.full_read(&client).await? + 1;
        }
    }

    /// Applies what the watch delivers, in coalesced change sets, until the stream fails;
    /// returns the compaction revision when etcd cancels the watch because its start
    /// revision was compacted. What was delivered before the stream ended is applied first.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe between change sets: dropping it stops the reader and loses only events
    /// not yet applied, which a new watch from the applied revision delivers again.
    async fn follow(&mut self, stream: WatchStream) -> Result<i64, SessionError> {
        let inbox = Arc::new(Inbox::default());
        // Dropping the set (this follow ending, or cancelled) aborts the reader.
        let mut reader = tokio::task::JoinSet::new();
        reader.spawn(read_watch(stream, inbox.clone(), self.status.clone()));
        let mut burst = Burst::new(self.coalesce);
        let mut deadline = None;
        loop {
            tokio::select! {
                () = inbox.notify.notified() => {}
                () = sleep_until(deadline) => {}
            }
            let now = Instant::now();
            let (due, ended) = {
                let mut delivered = inbox.lock();
                let ended = delivered.ended.take();
                // Once the watch ended, everything it delivered applies.
                let due = burst.take_due(&mut delivered, now, ended.is_some());
                deadline = burst.deadline(&delivered);
                (due, ended)
            };
            if let Some(due) = due {
                self.apply_delivered(due);
            }
            if let Some(ended) = ended {
                return ended;
            }
        }
    }

    /// Applies the latest event of each key that is due, as one change set.
    fn apply_delivered(&mut self, due: Due) {
        let mut next = self.desired.clone();
        for (key, event) in &due.events {
            match &event.state {
                Some((value, mod_revision)) => {
                    next.put_at(&self.layout, key, value, *mod_revision);
                }
                None => next.delete(&self.layout, key),
            }
        }
        next.revision = next.revision.max(due.revision);
        self.status.lock().counters.events += due.count;
        // Comparing, encoding and writing the whole set are work for a blocking thread, not
        // for the runtime's workers, which serve the API and the signals meanwhile.
        off_the_runtime(|| self.apply(next));
    }

    /// Reads every key of the node at one revision and applies it; returns the revision.
    async fn full_read(&mut self, client: &Client) -> Result<i64, SessionError> {
        let prefix = self.layout.services_prefix();
        let response = timed(&self.etcd, "read", client.get_prefix(&prefix)).await?;
        let revision = etcd::revision(response.header.as_ref());
        let mut next = Desired { revision, ..Desired::default() };
        for kv in &response.kvs {
            next.put_at(&self.layout, &kv.key, &kv.value, kv.mod_revision);
        }
        let next = self.desired.carry_over(&self.layout, next);
        self.status.lock().counters.full_reads += 1;
        tracing::info!(revision, keys = response.kvs.len(), "fleet: read every key");
        self.apply(next);
        Ok(revision)
    }

    /// Makes `next` the desired set: one atomic replace of the catalog's etcd services,
    /// then `fleet.json`.
    fn apply(&mut self, next: Desired) {
        for (key, problem) in &next.invalid {
            if self.desired.invalid.get(key) != Some(problem) {
                tracing::warn!(key = %key, error = %problem, "fleet: value skipped");
            }
        }
        let mut services: Vec<(Service, Source)> =
            next.services.values().map(|service| (service.clone(), Source::External(SOURCE_NAME.to_owned()))).collect();
        let mut conflicts = BTreeMap::new();
        loop {
            match self.sources.state().replace_source(&source_kind(), services.clone()) {
                Ok(report) => {
                    if report.added + report.changed + report.removed > 0 {
                        self.status.lock().counters.applies += 1;
                        tracing::info!(
                            added = report.added,
                            changed = report.changed,
                            removed = report.removed,
                            revision = next.revision,
                            "fleet: set applied"
                        );
                    }
                    break;
                }
                Err(CatalogError::Conflict { id, owner, .. }) => {
                    let key = self.layout.key(&id);
                    let problem = format!("service {id} is defined by {owner}; the fleet's value is skipped");
                    if !self.status.lock().invalid.contains_key(&key) {
                        tracing::warn!(key = %key, error = %problem, "fleet: value skipped");
                    }
                    conflicts.insert(key, problem);
                    services.retain(|(service, _)| service.id != id);
                }
                Err(err) => {
                    tracing::error!(error = %crate::error::error_chain(&err), "fleet: cannot apply the set; the previous one stays in force");
                    services.clear();
                    break;
                }
            }
        }
        self.sources.save_tokens();
        let state = self.sources.state();
        let applied = services.iter().filter_map(|(service, _)| {
            let entry = state.get(&service.id)?;
            let mod_revision = *next.mod_revisions.get(&service.id)?;
            (entry.source.kind() == source_kind()).then_some((service.id.clone(), entry.revision, mod_revision))
        });
        self.revisions.record(next.revision, applied.collect::<Vec<_>>());
        let persist_failed = if next != self.desired {
            match self.store.save(&self.layout, &next) {
                Ok(()) => false,
                Err(err) => {
                    tracing::error!(error = %crate::error::error_chain(&err), "fleet: cannot persist the set");
                    true
                }
            }
        } else {
            false
        };
        {
            let mut shown = self.status.lock();
            shown.revision = next.revision;
            shown.services = services.len();
            shown.invalid = next.invalid.clone();
            shown.invalid.extend(conflicts);
            shown.counters.persist_failures += u64::from(persist_failed);
        }
        self.desired = next;
    }
}

/// What the watch reader delivered that the follower has not taken yet.
#[derive(Default)]
struct Delivered {
    /// The latest event of each key. Only the latest counts: a change set applies the state
    /// each key reached.
    events: BTreeMap<Vec<u8>, Event>,
    /// The highest revision delivered.
    revision: i64,
    /// How many events were delivered.
    count: u64,
    /// How the watch ended, once it has: a compaction revision, or why it failed.
    ended: Option<Result<i64, SessionError>>,
}

/// The latest event of a key not applied yet.
struct Event {
    /// Its value and mod revision, or `None` for a delete.
    state: Option<(Vec<u8>, i64)>,
    /// The revision of the event.
    revision: i64,
    /// When the first event of the key not applied yet was delivered.
    first: Instant,
    /// When its latest event was delivered.
    last: Instant,
}

/// What the follower takes of [`Delivered`] to apply.
struct Due {
    events: BTreeMap<Vec<u8>, Event>,
    /// The revision the set reflects once these are applied: the highest delivered, or, while
    /// keys are held, just below the oldest held event, so that a watch resumed from it
    /// delivers them again.
    revision: i64,
    count: u64,
}

/// Where the reader leaves what it delivered, and how it wakes the follower.
#[derive(Default)]
struct Inbox {
    delivered: Mutex<Delivered>,
    notify: Notify,
}

impl Inbox {
    fn lock(&self) -> MutexGuard<'_, Delivered> {
        // Every critical section only moves values in or out.
        tether_state::lock(&self.delivered)
    }
}

/// Reads the watch until it ends, merging each response into `inbox`. It is the one that
/// sees the connection fail, and says so in `status` at once, whatever the follower is busy
/// with.
async fn read_watch(mut stream: WatchStream, inbox: Arc<Inbox>, status: SharedStatus) {
    let ended = loop {
        let response = match stream.message().await {
            Ok(Some(response)) => response,
            Ok(None) => break Err(SessionError::StreamEnded),
            Err(err) => break Err(SessionError::Stream(err)),
        };
        if response.compact_revision > 0 {
            break Ok(response.compact_revision);
        }
        if response.canceled {
            break Err(SessionError::Canceled { reason: response.cancel_reason });
        }
        if !response.events.is_empty() {
            let now = Instant::now();
            let mut delivered = inbox.lock();
            delivered.count += response.events.len() as u64;
            for event in response.events {
                let Some(kv) = event.kv else { continue };
                let revision = kv.mod_revision;
                delivered.revision = delivered.revision.max(revision);
                let state = match event.r#type {
                    t if t == etcd::pb::event::EventType::Delete as i32 => None,
                    _ => Some((kv.value, revision)),
                };
                let first = delivered.events.get(&kv.key).map_or(now, |held| held.first);
                delivered.events.insert(kv.key, Event { state, revision, first, last: now });
            }
            drop(delivered);
            inbox.notify.notify_one();
        }
        // A burst is always ready to read: give the runtime's other tasks their turn.
        tokio::task::coop::consume_budget().await;
    };
    if let Err(err) = &ended {
        status.set_unreachable(crate::error::error_chain(err), SystemTime::now());
    }
    inbox.lock().ended = Some(ended);
    inbox.notify.notify_one();
}

/// The coalescing of keys, as the engine coalesces a proxy's changes: a key whose event
/// comes after the key was quiet for `quiescent` applies at once; one that follows an applied
/// event of the same key within `quiescent` is held until the key has been quiet for
/// `quiescent`, and at most `max_delay` after its first held event. A key that keeps changing
/// never delays another.
struct Burst {
    coalesce: Coalesce,
    /// When each recently applied key's last applied event was delivered; forgotten once older
    /// than the window.
    applied: BTreeMap<Vec<u8>, Instant>,
}

impl Burst {
    fn new(coalesce: Coalesce) -> Self {
        Self { coalesce, applied: BTreeMap::new() }
    }

    /// Whether `event` of `key` applies at `now`.
    fn is_due(&self, key: &[u8], event: &Event, now: Instant) -> bool {
        let quiescent = self.coalesce.quiescent;
        let after_quiet =
            self.applied.get(key).is_none_or(|applied| event.first.saturating_duration_since(*applied) >= quiescent);
        after_quiet
            || now.saturating_duration_since(event.last) >= quiescent
            || now.saturating_duration_since(event.first) >= self.coalesce.max_delay
    }

    /// Takes the events of `delivered` that are due at `now` (every one with `all`), and
    /// with them every other event of the same revisions, so that a transaction lands whole;
    /// `None` when none is.
    fn take_due(&mut self, delivered: &mut Delivered, now: Instant, all: bool) -> Option<Due> {
        let due_revisions: std::collections::BTreeSet<i64> = delivered
            .events
            .iter()
            .filter(|(key, event)| all || self.is_due(key, event, now))
            .map(|(_, event)| event.revision)
            .collect();
        if due_revisions.is_empty() {
            return None;
        }
        let (events, held): (BTreeMap<_, _>, BTreeMap<_, _>) = std::mem::take(&mut delivered.events)
            .into_iter()
            .partition(|(_, event)| due_revisions.contains(&event.revision));
        delivered.events = held;
        let revision = match delivered.events.values().map(|event| event.revision).min() {
            Some(oldest_held) => oldest_held - 1,
            None => delivered.revision,
        };
        let window = self.coalesce.quiescent;
        self.applied.retain(|_, applied| now.saturating_duration_since(*applied) < window);
        for (key, event) in &events {
            self.applied.insert(key.clone(), event.last);
        }
        Some(Due { events, revision, count: std::mem::take(&mut delivered.count) })
    }

    /// When the first held event of `delivered` is due.
    fn deadline(&self, delivered: &Delivered) -> Option<Instant> {
        let quiescent = self.coalesce.quiescent;
        delivered.events.values().map(|event| (event.last + quiescent).min(event.first + self.coalesce.max_delay)).min()
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Runs `work` where it may block: beside the runtime's workers when the runtime has
/// several, in place otherwise.
fn off_the_runtime<T>(work: impl FnOnce() -> T) -> T {
    let flavor = tokio::runtime::Handle::try_current().map(|handle| handle.runtime_flavor());
    match flavor {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

/// The `tether_fleet_*` metrics, read from the follower's status at scrape time.
#[derive(Debug)]
pub(crate) struct FleetCollector(pub(crate) SharedStatus);

impl Collector for FleetCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let status = self.0.get();
        for (name, help, value) in [
            (
                "tether_fleet_connected",
                "Whether the watch on etcd is established (1) or not (0)",
                i64::from(status.connected),
            ),
            ("tether_fleet_revision", "The etcd revision the applied fleet set reflects", status.revision),
            ("tether_fleet_services", "Fleet services applied to the catalog", to_i64(status.services)),
            (
                "tether_fleet_invalid_keys",
                "Fleet keys skipped: invalid values or ids owned by another source",
                to_i64(status.invalid.len()),
            ),
        ] {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let counters = status.counters;
        for (name, help, value) in [
            ("tether_fleet_events", "Watch events received from etcd", counters.events),
            ("tether_fleet_applies", "Change sets from etcd that changed the catalog", counters.applies),
            ("tether_fleet_full_reads", "Full reads of the node's keys", counters.full_reads),
            ("tether_fleet_compactions", "Watches whose start revision was compacted", counters.compactions),
            ("tether_fleet_connect_failures", "Sessions with etcd that failed or ended", counters.connect_failures),
            ("tether_fleet_persist_failures", "Writes of fleet.json that failed", counters.persist_failures),
        ] {
            let counter = ConstCounter::new(value);
            counter.encode(encoder.encode_descriptor(name, help, None, counter.metric_type())?)?;
        }
        Ok(())
    }
}

fn to_i64(value: usize) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Delivers a put of `key` at `now`, as the reader does.
    fn deliver(delivered: &mut Delivered, key: &str, revision: i64, now: Instant) {
        let first = delivered.events.get(key.as_bytes()).map_or(now, |held| held.first);
        let event = Event { state: Some((b"{}".to_vec(), revision)), revision, first, last: now };
        delivered.events.insert(key.as_bytes().to_vec(), event);
        delivered.revision = delivered.revision.max(revision);
        delivered.count += 1;
    }

    fn keys(due: &Option<Due>) -> Vec<String> {
        due.iter().flat_map(|due| due.events.keys().map(|key| String::from_utf8_lossy(key).into_owned())).collect()
    }

    #[test]
    fn the_store_lost_is_told_once_and_its_return_once_but_not_the_first_connection() {
        let status = SharedStatus::default();
        status.lock().endpoints = vec!["http://127.0.0.1:1".into(), "http://127.0.0.1:2".into()];
        let mut told = status.subscribe();
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let at = |seconds: u64| start + Duration::from_secs(seconds);

        status.set_connected(at(0));
        assert!(told.try_recv().is_err(), "the first watch is no return");

        status.set_unreachable("stream ended".into(), at(10));
        status.set_unreachable("connection refused".into(), at(12));
        let lost = told.try_recv().unwrap();
        assert_eq!((lost.event, lost.time), ("store-unreachable", at(10)));
        assert!(lost.detail.contains("http://127.0.0.1:1,http://127.0.0.1:2"), "{}", lost.detail);
        assert!(lost.detail.contains("stream ended"), "{}", lost.detail);
        assert!(told.try_recv().is_err(), "a second failure while lost is not told again");
        let shown = status.get();
        assert_eq!((shown.connected, shown.unreachable_since), (false, Some(at(10))));
        assert_eq!(shown.last_error.as_deref(), Some("connection refused"), "the last error is the latest");

        status.set_connected(at(43));
        let back = told.try_recv().unwrap();
        assert_eq!((back.event, back.time), ("store-reachable", at(43)));
        assert!(back.detail.contains("after 33.0 s"), "{}", back.detail);
        let shown = status.get();
        assert_eq!((shown.connected, shown.unreachable_since, shown.last_error), (true, None, None));
        status.set_connected(at(50));
        assert!(told.try_recv().is_err(), "a new watch while reachable is not told");
    }

    #[test]
    fn an_agent_that_never_reached_the_store_tells_it_is_unreachable() {
        let status = SharedStatus::default();
        let mut told = status.subscribe();
        status.set_unreachable("connection refused".into(), SystemTime::UNIX_EPOCH);
        assert_eq!(told.try_recv().unwrap().event, "store-unreachable");
        status.set_connected(SystemTime::UNIX_EPOCH + Duration::from_secs(1));
        assert_eq!(told.try_recv().unwrap().event, "store-reachable");
    }

    #[test]
    fn a_key_that_keeps_changing_is_held_until_quiet_or_the_maximum_delay_and_delays_no_other() {
        let coalesce = Coalesce { quiescent: Duration::from_millis(500), max_delay: Duration::from_secs(5) };
        let mut burst = Burst::new(coalesce);
        let mut delivered = Delivered::default();
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);

        // The first change of a key applies at once.
        deliver(&mut delivered, "hot", 1, at(0));
        let due = burst.take_due(&mut delivered, at(0), false);
        assert_eq!(keys(&due), ["hot"]);
        assert_eq!(due.unwrap().revision, 1);

        // It changes every 100 ms: held; a new key meanwhile applies at once, and the set's
        // revision stays below the held event.
        deliver(&mut delivered, "hot", 2, at(100));
        assert!(burst.take_due(&mut delivered, at(100), false).is_none());
        assert_eq!(burst.deadline(&delivered), Some(at(600)));
        deliver(&mut delivered, "cold", 3, at(150));
        let due = burst.take_due(&mut delivered, at(150), false);
        assert_eq!(keys(&due), ["cold"]);
        assert_eq!(due.unwrap().revision, 1, "the held event at 2 is delivered again after a resume");
        let mut revision = 3;
        for ms in (200..5_100).step_by(100) {
            revision += 1;
            deliver(&mut delivered, "hot", revision, at(ms));
            assert!(burst.take_due(&mut delivered, at(ms), false).is_none(), "held at {ms} ms");
        }
        // Its first held event was at 100 ms: released 5 s later, with its latest value.
        assert_eq!(burst.deadline(&delivered), Some(at(5_100)));
        let due = burst.take_due(&mut delivered, at(5_100), false).unwrap();
        assert_eq!((due.events.len(), due.revision), (1, revision));
        assert_eq!(due.events[b"hot".as_slice()].revision, revision);

        // Quiet for the window after its last change: what is held applies then.
        deliver(&mut delivered, "hot", revision + 1, at(5_200));
        assert!(burst.take_due(&mut delivered, at(5_600), false).is_none());
        assert_eq!(keys(&burst.take_due(&mut delivered, at(5_700), false)), ["hot"]);
        // After a quiet period, the next change applies at once again.
        deliver(&mut delivered, "hot", revision + 2, at(7_000));
        assert_eq!(keys(&burst.take_due(&mut delivered, at(7_000), false)), ["hot"]);
    }

    #[test]
    fn a_transaction_lands_whole_and_an_ended_watch_applies_everything() {
        let coalesce = Coalesce { quiescent: Duration::from_millis(500), max_delay: Duration::from_secs(5) };
        let mut burst = Burst::new(coalesce);
        let mut delivered = Delivered::default();
        let start = Instant::now();
        deliver(&mut delivered, "a", 1, start);
        assert!(burst.take_due(&mut delivered, start, false).is_some());
        // `a` changes again (held) in the same revision as `b` (due): both apply.
        deliver(&mut delivered, "a", 2, start + Duration::from_millis(10));
        deliver(&mut delivered, "b", 2, start + Duration::from_millis(10));
        assert_eq!(keys(&burst.take_due(&mut delivered, start + Duration::from_millis(10), false)), ["a", "b"]);
        // Held, until the watch ends.
        deliver(&mut delivered, "a", 3, start + Duration::from_millis(20));
        assert!(burst.take_due(&mut delivered, start + Duration::from_millis(20), false).is_none());
        assert_eq!(keys(&burst.take_due(&mut delivered, start + Duration::from_millis(20), true)), ["a"]);
    }

    #[test]
    fn jitter_stays_within_a_fifth_of_the_delay() {
        for _ in 0..100 {
            let wait = jittered(Duration::from_secs(10));
            assert!(wait >= Duration::from_secs(8) && wait <= Duration::from_secs(12), "{wait:?}");
        }
    }
}
