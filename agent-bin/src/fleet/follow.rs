//! The agent's fleet follower: keeps the catalog's etcd services equal to this node's keys.
//!
//! It starts from a consistent read at a revision R (or from `fleet.json`'s revision, which
//! the persisted set reflects), then watches from R + 1, so that no event is lost or applied
//! twice. A task of its own reads the watch as fast as etcd delivers it, keeping only the
//! latest event of each key, and is the one that says when the connection is lost; the
//! follower takes everything delivered so far as one change set — one atomic
//! `replace_source` of the whole set, so that a transaction that moves services between
//! keys lands at once, and an unchanged service is a no-op. Change sets are coalesced as the
//! engine coalesces changes: the first after a quiet period applies at once, later ones wait
//! until the watch has been quiet for `--sync-quiescent`, at most `--sync-max-delay`, so that
//! a burst of thousands of puts costs a few applies. A compacted start revision triggers a
//! full re-read. When etcd is unreachable the last known set stays in force
//! (in the catalog and in `fleet.json`), and the follower reconnects with capped,
//! jittered backoff, resuming where it stopped. It never starts a process and never fails
//! the agent: every problem is logged, counted and retried.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use tether_state::persist::DataDir;
use tether_state::{Backoff, CatalogError, Service, Source};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::etcd::{self, Client, WatchStream};
use super::publish::Revisions;
use super::store::FleetStore;
use super::{Desired, EtcdError, EtcdOptions, Layout, SOURCE_NAME, source_kind, timed};
use crate::catalog::sources::Sources;

/// The delays between two connection attempts: 250 ms, doubled after each failure up to
/// 10 s, each spread by [`JITTER_PER_MILLE`].
const RECONNECT_BACKOFF: Backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(10));
/// How far each reconnect delay is spread, in thousandths of itself either way: ± 20%.
const JITTER_PER_MILLE: u32 = 200;

/// What the follower shows: the API's `GET /v1/agent/fleet` and the `tether_fleet_*` metrics.
#[derive(Debug, Clone, Default)]
pub(crate) struct FleetStatus {
    pub(crate) node: String,
    pub(crate) prefix: String,
    /// Whether a watch on etcd is established now.
    pub(crate) connected: bool,
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

/// The follower's status, shared with the API and the metrics collector.
#[derive(Debug, Clone, Default)]
pub(crate) struct SharedStatus(Arc<Mutex<FleetStatus>>);

impl SharedStatus {
    fn lock(&self) -> MutexGuard<'_, FleetStatus> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A copy of the status now.
    pub(crate) fn get(&self) -> FleetStatus {
        self.lock().clone()
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
        let mut backoff = RECONNECT_BACKOFF;
        loop {
            let ended = tokio::select! {
                () = stop.cancelled() => return,
                ended = self.session(&mut backoff) => ended,
            };
            let Err(ended) = ended;
            let error = crate::error::error_chain(&ended);
            let wait = jittered(backoff.next());
            {
                let mut shown = self.status.lock();
                shown.connected = false;
                shown.counters.connect_failures += 1;
                shown.last_error = Some(error.clone());
            }
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
            {
                let mut shown = self.status.lock();
                shown.connected = true;
                shown.last_error = None;
            }
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
        let reader = tokio::spawn(read_watch(stream, inbox.clone(), self.status.clone()));
        let _reader = AbortOnDrop(reader);
        let mut burst = Burst::new(self.coalesce);
        loop {
            let deadline = burst.deadline();
            let woken = tokio::select! {
                () = inbox.notify.notified() => true,
                () = sleep_until(deadline) => false,
            };
            let now = Instant::now();
            let (delivered, ended) = {
                let mut inbox = inbox.lock();
                let ended = inbox.ended.take();
                // Taken now: at once after a quiet period, when the burst is due, or when the
                // watch ended; otherwise the reader keeps merging into it.
                let apply_now =
                    ended.is_some() || (woken && !inbox.events.is_empty() && burst.changed(now)) || burst.due(now);
                (apply_now.then(|| std::mem::take(&mut *inbox)), ended)
            };
            if let Some(delivered) = delivered {
                burst.applied();
                if !delivered.events.is_empty() {
                    self.apply_delivered(delivered);
                }
            }
            if let Some(ended) = ended {
                return ended;
            }
        }
    }

    /// Applies the latest event of each key that the watch delivered, as one change set.
    fn apply_delivered(&mut self, delivered: Delivered) {
        let mut next = self.desired.clone();
        for (key, event) in &delivered.events {
            match event {
                Some((value, mod_revision)) => {
                    next.put_at(&self.layout, key, value, *mod_revision);
                }
                None => next.delete(&self.layout, key),
            }
        }
        next.revision = next.revision.max(delivered.revision);
        self.status.lock().counters.events += delivered.count;
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
    /// The latest event of each key: its value and mod revision, or `None` for a delete.
    /// Only the latest counts: a change set applies the state each key reached.
    events: BTreeMap<Vec<u8>, Option<(Vec<u8>, i64)>>,
    /// The highest revision delivered.
    revision: i64,
    /// How many events were delivered.
    count: u64,
    /// How the watch ended, once it has: a compaction revision, or why it failed.
    ended: Option<Result<i64, SessionError>>,
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
        self.delivered.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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
            let mut delivered = inbox.lock();
            delivered.count += response.events.len() as u64;
            for event in response.events {
                let Some(kv) = event.kv else { continue };
                delivered.revision = delivered.revision.max(kv.mod_revision);
                let state = match event.r#type {
                    t if t == etcd::pb::event::EventType::Delete as i32 => None,
                    _ => Some((kv.value, kv.mod_revision)),
                };
                delivered.events.insert(kv.key, state);
            }
            drop(delivered);
            inbox.notify.notify_one();
        }
        // A burst is always ready to read: give the runtime's other tasks their turn.
        tokio::task::coop::consume_budget().await;
    };
    if let Err(err) = &ended {
        let mut shown = status.lock();
        shown.connected = false;
        shown.last_error = Some(crate::error::error_chain(err));
    }
    inbox.lock().ended = Some(ended);
    inbox.notify.notify_one();
}

/// The coalescing of change sets, as the engine coalesces a proxy's changes: the first
/// delivery after a quiet period applies at once; one that follows within `quiescent` is
/// held until the watch has been quiet for `quiescent`, and at most `max_delay` after the
/// first held one.
struct Burst {
    coalesce: Coalesce,
    /// When the last delivery was seen.
    last: Option<Instant>,
    /// When the first delivery still held was seen.
    held_since: Option<Instant>,
}

impl Burst {
    fn new(coalesce: Coalesce) -> Self {
        Self { coalesce, last: None, held_since: None }
    }

    /// Records a delivery at `now`; whether it applies at once.
    fn changed(&mut self, now: Instant) -> bool {
        let quiet = self.last.is_none_or(|last| now.duration_since(last) >= self.coalesce.quiescent);
        self.last = Some(now);
        if quiet && self.held_since.is_none() {
            return true;
        }
        self.held_since.get_or_insert(now);
        false
    }

    /// When what is held must apply.
    fn deadline(&self) -> Option<Instant> {
        let held_since = self.held_since?;
        let quiet_at = self.last.unwrap_or(held_since) + self.coalesce.quiescent;
        Some(quiet_at.min(held_since + self.coalesce.max_delay))
    }

    fn due(&self, now: Instant) -> bool {
        self.deadline().is_some_and(|deadline| deadline <= now)
    }

    /// What was held has been applied.
    fn applied(&mut self) {
        self.held_since = None;
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

/// Aborts a task when dropped: the reader ends with the follow that owns it.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `delay` ± 20%, so that a fleet of agents does not reconnect in lockstep; the clock's
/// nanoseconds are random enough for that.
pub(crate) fn jittered(delay: Duration) -> Duration {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
    Backoff::jitter(delay, JITTER_PER_MILLE, u64::from(nanos))
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

    #[test]
    fn a_burst_applies_its_first_change_at_once_then_when_quiet_or_at_the_maximum_delay() {
        let coalesce = Coalesce { quiescent: Duration::from_millis(500), max_delay: Duration::from_secs(5) };
        let mut burst = Burst::new(coalesce);
        let start = Instant::now();
        assert!(burst.changed(start), "the first change after a quiet period applies at once");
        burst.applied();
        assert_eq!(burst.deadline(), None);
        // Changes every 100 ms: held, until 5 s after the first held one.
        for step in 1..=60 {
            let now = start + Duration::from_millis(100 * step);
            let due = burst.due(now);
            if due {
                assert_eq!(now, start + Duration::from_millis(5_100), "released at the maximum delay");
                burst.applied();
            }
            assert!(!burst.changed(now) || due, "step {step}");
        }
        // Quiet for the window: what is held applies then.
        let last = start + Duration::from_millis(6_000);
        assert_eq!(burst.deadline(), Some(last + Duration::from_millis(500)));
        burst.applied();
        // And after a quiet period the next change applies at once again.
        assert!(burst.changed(last + Duration::from_secs(1)));
    }

    #[test]
    fn jitter_stays_within_a_fifth_of_the_delay() {
        for _ in 0..100 {
            let wait = jittered(Duration::from_secs(10));
            assert!(wait >= Duration::from_secs(8) && wait <= Duration::from_secs(12), "{wait:?}");
        }
    }
}
