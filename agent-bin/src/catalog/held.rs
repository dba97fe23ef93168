//! The proxies held down by the operator (`tether stop`), kept in `held.json` in the data
//! dir so that they stay stopped across agent restarts and config reloads until `tether
//! start` releases them.
//!
//! This module owns that file and nothing else; the engine decides what a hold means.
//! Durability class: an operator's decision must survive a power loss, as registrations do
//! (file and directory fsynced).

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard};

use tether_state::ProxyId;
use tether_state::persist::{DataDir, Durability, PersistError, PrivateDir};

const FILE: &str = "held.json";

/// The held proxies, as the file says.
pub(crate) struct Held {
    dir: PrivateDir,
    ids: Mutex<BTreeSet<ProxyId>>,
}

impl Held {
    /// Reads `held.json`; a missing file holds nothing, and a damaged one is moved aside
    /// with a warning (the proxies it held then run).
    pub(crate) fn load(data: &DataDir) -> Self {
        let dir = data.root_dir().clone();
        let ids = match dir.read(FILE) {
            Ok(None) => BTreeSet::new(),
            Ok(Some(text)) => match serde_json::from_slice::<BTreeSet<ProxyId>>(&text) {
                Ok(ids) => ids,
                Err(err) => {
                    let moved = dir.quarantine(FILE).map(|to| to.display().to_string()).unwrap_or_default();
                    tracing::warn!(error = %err, moved_to = moved, "held.json is damaged and was moved aside; no proxy is held");
                    BTreeSet::new()
                }
            },
            Err(err) => {
                tracing::warn!(error = %crate::error::error_chain(&err), "cannot read held.json; no proxy is held");
                BTreeSet::new()
            }
        };
        Self { dir, ids: Mutex::new(ids) }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeSet<ProxyId>> {
        tether_state::lock(&self.ids)
    }

    /// The held proxies.
    pub(crate) fn ids(&self) -> BTreeSet<ProxyId> {
        self.lock().clone()
    }

    /// Holds `id` down, or releases it, and writes the file when that changes it.
    ///
    /// # Errors
    ///
    /// [`PersistError`] when the file cannot be written; the set is then as before.
    pub(crate) fn set(&self, id: &ProxyId, hold: bool) -> Result<(), PersistError> {
        let mut ids = self.lock();
        let mut next = ids.clone();
        let changed = if hold { next.insert(id.clone()) } else { next.remove(id) };
        if !changed {
            return Ok(());
        }
        let text = serde_json::to_vec_pretty(&next).unwrap_or_default();
        self.dir.write_atomic(FILE, Durability::PowerLoss, &text)?;
        *ids = next;
        Ok(())
    }
}
