//! The agent's status out: what runs on this node, written to etcd under a lease of the
//! agent's own, so that `tether fleet status` and rollouts see every node from one place.
//!
//! Keys (all under the lease, so that they vanish a TTL after the agent dies):
//!
//! - `<prefix>/status/<node>`: `{"started_at", "version", "revision"}`, `revision` being the
//!   etcd revision of the desired set the follower has applied;
//! - `<prefix>/status/<node>/proxies/<proxy id>`: one per proxy, its state and the etcd mod
//!   revision of the desired key its running instance was started from (`null` for proxies
//!   that do not come from etcd);
//! - `<prefix>/instances/<service name>/<node>/<service id>`: one per ready instance, for
//!   discovery, removed as soon as it is not ready.
//!
//! The publisher keeps what it wrote and writes only keys whose value changed, in one
//! transaction per flush: a status change is written within [`COALESCE`] of the first change
//! of a burst, and an idle agent writes nothing but lease renewals. When etcd is
//! unreachable proxies keep running; on return the publisher renews its lease, or grants a
//! new one if it expired, and writes every key again. Nothing secret is written: no token,
//! environment or command line.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use tether_manager::{ManagerHandle, ProxyStatus};
use tether_state::{Backoff, Catalog, LocalState, Revision, ServiceId};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::etcd::{self, Client, EtcdError, EtcdOptions, Instance, Layout, NodeRecord, PublishedProxy, rfc3339, timed};

/// How long a burst of changes is gathered before a flush: well within the 100 ms in which a
/// change is to be visible, and long enough that a proxy's start (`starting`, then `running`)
/// is one write.
pub(crate) const COALESCE: Duration = Duration::from_millis(20);

/// Operations per transaction: etcd refuses more than 128 by default.
const OPS_PER_TXN: usize = 100;

/// How many catalog revisions of one service are remembered: an instance that serves while
/// the next one starts is one or two behind.
const REMEMBERED: usize = 8;

/// What the follower tells the publisher: the etcd revision of the applied set, and for each
/// etcd service, which catalog revision holds which etcd mod revision.
#[derive(Debug, Clone, Default)]
pub(crate) struct Revisions(Arc<RevisionsInner>);

#[derive(Debug, Default)]
struct RevisionsInner {
    book: Mutex<Book>,
    changed: Notify,
}

#[derive(Debug, Default)]
struct Book {
    applied: i64,
    by_service: HashMap<ServiceId, VecDeque<(Revision, i64)>>,
}

impl Revisions {
    fn lock(&self) -> MutexGuard<'_, Book> {
        tether_state::lock(&self.0.book)
    }

    /// Records that the follower applied the set of etcd revision `applied`, in which
    /// service `id` (now at catalog revision `catalog`) was read from mod revision `etcd`.
    pub(crate) fn record(&self, applied: i64, services: impl IntoIterator<Item = (ServiceId, Revision, i64)>) {
        let mut book = self.lock();
        book.applied = applied;
        for (id, catalog, etcd) in services {
            let known = book.by_service.entry(id).or_default();
            match known.iter_mut().find(|(revision, _)| *revision == catalog) {
                Some(entry) => entry.1 = etcd,
                None => {
                    known.push_back((catalog, etcd));
                    if known.len() > REMEMBERED {
                        known.pop_front();
                    }
                }
            }
        }
        drop(book);
        self.0.changed.notify_one();
    }

    /// The etcd mod revision of the definition at catalog revision `catalog` of `id`.
    fn etcd_revision(&self, id: &ServiceId, catalog: Revision) -> Option<i64> {
        let book = self.lock();
        book.by_service.get(id)?.iter().find(|(revision, _)| *revision == catalog).map(|(_, etcd)| *etcd)
    }

    fn applied(&self) -> i64 {
        self.lock().applied
    }
}

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    #[error("lease {0:x} expired")]
    Expired(i64),
    #[error("the status transaction was not applied")]
    NotApplied,
}

/// Writes this node's status to etcd.
pub(crate) struct Publisher {
    layout: Layout,
    etcd: EtcdOptions,
    ttl: Duration,
    manager: ManagerHandle,
    catalog: LocalState,
    revisions: Revisions,
    started_at: SystemTime,
    /// What etcd holds of ours, as last written in this session.
    written: BTreeMap<String, Vec<u8>>,
    /// The lease, kept across sessions while etcd still knows it.
    lease: Option<i64>,
}

impl Publisher {
    pub(crate) fn new(
        layout: Layout,
        etcd: EtcdOptions,
        ttl: Duration,
        manager: ManagerHandle,
        catalog: LocalState,
        revisions: Revisions,
    ) -> Self {
        Self {
            layout,
            etcd,
            ttl,
            manager,
            catalog,
            revisions,
            started_at: SystemTime::now(),
            written: BTreeMap::new(),
            lease: None,
        }
    }

    /// Publishes until `stop` is cancelled, reconnecting with backoff. With `revoke` cancelled
    /// too (the agent leaves), the lease is revoked so that the node's keys go at once.
    ///
    /// # Cancel safety
    ///
    /// Meant to run in its own task until `stop`.
    pub(crate) async fn run(mut self, stop: CancellationToken, revoke: CancellationToken) {
        let mut backoff = etcd::RECONNECT;
        loop {
            let ended = tokio::select! {
                () = stop.cancelled() => break,
                ended = self.session(&mut backoff) => ended,
            };
            let Err(ended) = ended;
            let wait = etcd::jittered(backoff.next());
            tracing::warn!(
                error = %crate::error::error_chain(&ended),
                retry_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                "fleet: cannot publish this node's status; proxies keep running"
            );
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(wait) => {}
            }
        }
        if let (true, Some(lease)) = (revoke.is_cancelled(), self.lease) {
            let revoked = async {
                let client = self.etcd.connect().await?;
                timed(&self.etcd, "lease revoke", client.lease_revoke(lease)).await
            };
            if let Err(err) = revoked.await {
                tracing::warn!(error = %crate::error::error_chain(&err), "fleet: cannot revoke the status lease; its keys expire with it");
            }
        }
    }

    fn ttl_seconds(&self) -> i64 {
        i64::try_from(self.ttl.as_secs()).unwrap_or(i64::MAX).max(1)
    }

    /// Takes a lease (the last one if etcd still has it), writes every key, and then writes
    /// what changes, until something fails.
    async fn session(&mut self, backoff: &mut Backoff) -> Result<Infallible, SessionError> {
        let client = self.etcd.connect().await?;
        let mut keep_alive = None;
        if let Some(lease) = self.lease {
            let mut stream = timed(&self.etcd, "lease keep-alive", client.lease_keep_alive(lease)).await?;
            if timed(&self.etcd, "lease keep-alive", stream.renew()).await? > 0 {
                keep_alive = Some(stream);
            } else {
                tracing::info!(lease = format_args!("{lease:x}"), "fleet: the status lease expired; taking a new one");
            }
        }
        let mut keep_alive = match keep_alive {
            Some(stream) => stream,
            None => {
                let granted = timed(&self.etcd, "lease grant", client.lease_grant(self.ttl_seconds())).await?;
                self.lease = Some(granted.id);
                timed(&self.etcd, "lease keep-alive", client.lease_keep_alive(granted.id)).await?
            }
        };
        let lease = self.lease.unwrap_or_default();
        // Everything again: what etcd holds of an earlier session is not known.
        self.written.clear();
        let mut events = self.manager.subscribe();
        let mut catalog = self.catalog.subscribe();
        self.flush(&client, lease).await?;
        tracing::info!(lease = format_args!("{lease:x}"), keys = self.written.len(), "fleet: status published");
        backoff.reset();
        let mut renew = tokio::time::interval(self.ttl / 3);
        renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        renew.tick().await;
        loop {
            tokio::select! {
                _ = renew.tick() => {
                    let ttl = timed(&self.etcd, "lease keep-alive", keep_alive.renew()).await?;
                    if ttl <= 0 {
                        self.lease = None;
                        return Err(SessionError::Expired(lease));
                    }
                    continue;
                }
                _ = events.recv() => {}
                _ = catalog.changed() => {}
                () = self.revisions.0.changed.notified() => {}
            }
            // A burst is gathered, then written once: each key at most once per flush.
            tokio::time::sleep(COALESCE).await;
            while events.try_recv().is_ok() {}
            self.flush(&client, lease).await?;
        }
    }

    /// Writes every key whose value differs from what was written, and deletes the keys that
    /// are gone, in transactions of at most [`OPS_PER_TXN`] operations.
    async fn flush(&mut self, client: &Client, lease: i64) -> Result<(), SessionError> {
        let wanted = self.values();
        let mut ops = Vec::new();
        for (key, value) in &wanted {
            if self.written.get(key) != Some(value) {
                ops.push(etcd::put_op(key, value.clone(), lease));
            }
        }
        for key in self.written.keys() {
            if !wanted.contains_key(key) {
                ops.push(etcd::delete_op(key));
            }
        }
        if ops.is_empty() {
            return Ok(());
        }
        tracing::debug!(writes = ops.len(), "fleet: publishing status");
        for chunk in ops.chunks(OPS_PER_TXN) {
            let request = etcd::pb::TxnRequest { compare: Vec::new(), success: chunk.to_vec(), failure: Vec::new() };
            let response = timed(&self.etcd, "status write", client.txn(request)).await?;
            if !response.succeeded {
                return Err(SessionError::NotApplied);
            }
        }
        self.written = wanted;
        Ok(())
    }

    /// Every key this node publishes now, with its value.
    fn values(&self) -> BTreeMap<String, Vec<u8>> {
        let mut values = BTreeMap::new();
        let node = NodeRecord {
            started_at: rfc3339(self.started_at),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            revision: self.revisions.applied(),
        };
        values.insert(self.layout.status_key(), encode(&node));
        // Unmeasured: usage is not published, and measuring would read every proxy's
        // cgroup on every flush.
        for status in self.manager.status_unmeasured() {
            let entry = self.catalog.get(&status.service);
            // A proxy whose service left the catalog runs on until it is stopped: whether its
            // instance came from etcd is then the book's to say, so that `fleet status` sees a
            // proxy of a deleted key as being removed.
            let from_etcd = entry.as_ref().is_none_or(|entry| entry.source.kind() == super::source_kind());
            let revision = match (from_etcd, status.applied_revision) {
                (true, Some(catalog)) => self.revisions.etcd_revision(&status.service, catalog),
                _ => None,
            };
            let service = entry.as_ref().map(|entry| &*entry.service);
            let value = published(&status, revision, service);
            values.insert(self.layout.proxy_status_key(&status.id), encode(&value));
            if let (true, Some(entry)) = (status.ready(), entry.as_ref()) {
                let instance = Instance::of(Some(self.layout.node()), entry);
                let service = &entry.service;
                values.insert(self.layout.instance_key(&service.name, &service.id), encode(&instance));
            }
        }
        values
    }
}

/// A record's value: its JSON.
fn encode(record: &impl serde::Serialize) -> Vec<u8> {
    // The records hold strings, numbers and string-keyed maps, which always encode.
    serde_json::to_vec(record).unwrap_or_else(|_| b"null".to_vec())
}

/// One proxy's status key's value: what runs, never how (no command, environment or token).
fn published(status: &ProxyStatus, revision: Option<i64>, service: Option<&tether_state::Service>) -> PublishedProxy {
    PublishedProxy {
        state: status.state.as_str().to_owned(),
        ready: status.ready(),
        pid: status.figures.pid,
        restarts: status.figures.restarts,
        since: status.figures.started_at.map(rfc3339),
        error: status.figures.error.clone(),
        revision,
        address: service.map(|s| s.address.clone()),
        port: service.and_then(|s| s.port),
        service: Some(status.service.to_string()),
        tags: service.map(|s| s.tags.clone()),
        meta: service.map(|s| s.meta.clone()),
    }
}
