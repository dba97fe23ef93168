//! Restore, before the first reconcile: the snapshot's records and the backend's adoption
//! candidates, each handed to the backend with the catalog's proxy of that id, one at a time
//! so that a cancelled turn loses nothing; then the snapshot writer starts from what was
//! adopted.
//!
//! This module only adopts what the backend proves; it never starts, stops or restarts a
//! proxy (the first reconcile decides that).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use tether_state::{ManagedProxy, ProxyId};
use tokio_util::sync::CancellationToken;

use super::{Manager, Slot};
use crate::backend::Adopted;
use crate::plan::{Observed, Origin};
use crate::snapshot::{EncodedRecord, EncodedService, ProxyRecord};

/// What is left to do of the restore that precedes the first reconcile.
pub(super) enum RestoreStage {
    Load,
    Adopt {
        /// Each record, and whether it is an adoption candidate (not a snapshot record).
        queue: VecDeque<(ProxyRecord, bool)>,
        wanted: HashMap<ProxyId, Arc<ManagedProxy>>,
        /// The records of the snapshot as loaded, encoded: what the file says now.
        saved: Option<BTreeMap<ProxyId, EncodedRecord>>,
    },
    Done,
}

impl Manager {
    /// Restores what the snapshot (or the backend's candidates) says runs. Returns false if
    /// `shutdown` was cancelled first.
    pub(super) async fn restore_snapshot(&mut self, shutdown: &CancellationToken) -> bool {
        if let RestoreStage::Load = self.restore {
            let loaded = tokio::select! {
                () = shutdown.cancelled() => return false,
                loaded = self.store.load() => loaded,
            };
            let (mut records, saved) = match loaded {
                Ok(Some(snapshot)) if snapshot.migrated_from.is_some() => {
                    // Written again in the current format as soon as the writer starts,
                    // even if no record changes.
                    tracing::info!(version = snapshot.migrated_from, "snapshot of an older format; migrating it");
                    (snapshot.proxies, None)
                }
                Ok(Some(snapshot)) => {
                    // Kept encoded, as the writer compares it: the records are moved, not copied.
                    let saved: BTreeMap<ProxyId, EncodedRecord> = snapshot
                        .proxies
                        .iter()
                        .filter_map(|record| Some((record.id.clone(), encode(record)?)))
                        .collect();
                    (snapshot.proxies, Some(saved))
                }
                Ok(None) => (Vec::new(), None),
                Err(err) => {
                    tracing::warn!(error = %crate::error_chain(&err), "snapshot unusable; adopting the backend's candidates instead");
                    (Vec::new(), None)
                }
            };
            let mut seen = HashSet::new();
            records.retain(|record| seen.insert(record.id.clone()));
            // The backend's candidates come after the snapshot's records: they cover a
            // proxy started after the last snapshot write (an agent killed in between), and
            // one whose record cannot be proven any more. A candidate of an id already
            // adopted is skipped, so nothing is taken over twice.
            let mut candidate_ids = HashSet::new();
            let candidates = self.candidates(shutdown).await;
            let mut queue: VecDeque<_> = records.into_iter().map(|record| (record, false)).collect();
            queue.extend(
                candidates
                    .into_iter()
                    .filter(|record| candidate_ids.insert(record.id.clone()))
                    .map(|record| (record, true)),
            );
            seen.extend(candidate_ids);
            // What the catalog wants of those proxies: the backend restarts an adopted
            // process from it, and proves candidates with its token.
            let wanted = if queue.is_empty() {
                HashMap::new()
            } else {
                self.catalog
                    .changes_since(None)
                    .upserted
                    .into_iter()
                    .filter(|desired| seen.contains(desired.proxy.id()))
                    .map(|desired| (desired.proxy.id().clone(), desired.proxy))
                    .collect()
            };
            self.restore = RestoreStage::Adopt { queue, wanted, saved };
        }
        // One record per turn, so that a cancelled turn leaves the record queued.
        while matches!(&self.restore, RestoreStage::Adopt { queue, .. } if !queue.is_empty()) {
            if !self.restore_one(shutdown).await {
                return false;
            }
        }
        if let RestoreStage::Adopt { saved, .. } = std::mem::replace(&mut self.restore, RestoreStage::Done) {
            self.start_writer(saved);
            self.backend.restored().await;
        }
        true
    }

    async fn restore_one(&mut self, shutdown: &CancellationToken) -> bool {
        let RestoreStage::Adopt { queue, wanted, .. } = &mut self.restore else { return true };
        let Some((record, _)) = queue.front() else { return true };
        if self.slots.contains_key(&record.id) {
            // Its snapshot record was adopted: the candidate of the same id is that process.
            queue.pop_front();
            return true;
        }
        let (id, backend_record) = (record.id.clone(), record.backend.clone());
        let desired = wanted.get(&id).cloned();
        let restored = tokio::select! {
            () = shutdown.cancelled() => return false,
            restored = self.backend.restore(id.clone(), backend_record, desired) => restored,
        };
        let RestoreStage::Adopt { queue, wanted, .. } = &mut self.restore else { return true };
        let Some((mut record, candidate)) = queue.pop_front() else { return true };
        match restored {
            Some(handle) => {
                tracing::info!(proxy = %id, "proxy adopted");
                self.published.lock().stats.adopted += 1;
                // What the process runs decides whether the first reconcile keeps it or
                // replaces it. A candidate that the backend proved against the wanted proxy
                // runs that proxy, by the backend's contract; so does another process than
                // the record's that the backend kept and proved. A process whose spec is not
                // known has no origin, and is replaced (its record says so, should the agent
                // die before).
                let adopted = handle.adopted();
                let runs_wanted = match adopted {
                    Adopted::AsRecorded => candidate,
                    Adopted::Desired => true,
                    Adopted::Unknown => false,
                };
                // The wanted proxy's service is shared with the catalog, not copied.
                let mut shared = None;
                match wanted.get(&id) {
                    Some(proxy) if runs_wanted => {
                        shared = Some(Arc::clone(proxy.shared_service()));
                        record.service = Some(proxy.service().clone());
                        record.token = Some(proxy.token().fingerprint());
                    }
                    // The process its record names, or a candidate no longer wanted.
                    _ if adopted == Adopted::AsRecorded => {}
                    _ => {
                        tracing::info!(proxy = %id, "the adopted process may run another spec; it will be replaced");
                        record.service = None;
                        record.token = None;
                    }
                }
                let origin = origin_of(&record);
                let service = shared.or_else(|| record.service.take().map(Arc::new)).map(EncodedService::new);
                let mut slot = Slot::new();
                slot.observed = Observed::Adopted { origin };
                self.slots.insert(id.clone(), Box::new(slot));
                self.install(&id, handle.into(), service, record.token);
                self.publish(&id);
            }
            None => {
                tracing::info!(proxy = %id, "snapshot record dropped: its process cannot be proven to be the same");
                self.published.lock().stats.dropped += 1;
            }
        }
        true
    }

    async fn candidates(&self, shutdown: &CancellationToken) -> Vec<ProxyRecord> {
        let found = tokio::select! {
            () = shutdown.cancelled() => return Vec::new(),
            found = self.backend.adoption_candidates() => found,
        };
        found.into_iter().map(|(id, backend)| ProxyRecord { id, service: None, token: None, backend }).collect()
    }
}

/// `record` encoded as the snapshot holds it; `None`, with a warning, if it cannot be.
fn encode(record: &ProxyRecord) -> Option<EncodedRecord> {
    EncodedRecord::from_record(record)
        .inspect_err(|err| tracing::warn!(proxy = %record.id, error = %err, "cannot encode a snapshot record"))
        .ok()
}

/// What a snapshot record says its process was started from, if it says so readably.
fn origin_of(record: &ProxyRecord) -> Option<Origin> {
    let service = record.service.as_ref()?;
    if service.id.proxy_id() != record.id || service.proxy.is_none() {
        return None;
    }
    Some(Origin { service: Arc::new(service.clone()), token: record.token.clone()? })
}
