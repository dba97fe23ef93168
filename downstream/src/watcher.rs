//! [`CatalogWatcher`]: follows a catalog's change notifications and reports which proxies
//! changed, as a reader of the catalog other than the engine would.
//!
//! This module owns the one task it spawns; dropping the watcher ends it.

use std::sync::Arc;

use tether_state::{Catalog, Changes, ProxyId, Revision};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// What changed in the catalog since the previous report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogChange {
    /// The catalog's revision that this report brings the reader up to.
    pub revision: Revision,
    /// Whether `upserted` is every proxy the catalog wants (the first report, or one after
    /// the reader fell further behind than the catalog remembers): any other is unwanted.
    pub complete: bool,
    /// The proxies that are new or changed, sorted.
    pub upserted: Vec<ProxyId>,
    /// The proxies that are no longer wanted, sorted.
    pub removed: Vec<ProxyId>,
}

impl From<Changes> for CatalogChange {
    fn from(changes: Changes) -> Self {
        let mut upserted: Vec<ProxyId> = changes.upserted.iter().map(|desired| desired.proxy.id().clone()).collect();
        let mut removed = changes.removed;
        upserted.sort();
        removed.sort();
        Self { revision: changes.revision, complete: changes.complete, upserted, removed }
    }
}

/// Reports the changes of a catalog as they happen, in a task of its own.
///
/// The first report is the whole desired set; each later one holds what changed since the
/// previous one. A reader that does not keep up misses nothing: the changes made meanwhile
/// are folded into its next report.
#[derive(Debug)]
pub struct CatalogWatcher {
    changes: mpsc::Receiver<CatalogChange>,
    task: JoinHandle<()>,
}

impl CatalogWatcher {
    /// Starts following `catalog`.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn spawn(catalog: Arc<dyn Catalog>) -> Self {
        // One report waits for the reader; the changes after it are read when it is taken.
        let (sender, changes) = mpsc::channel(1);
        let task = tokio::spawn(follow(catalog, sender));
        Self { changes, task }
    }

    /// The next report.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a report is taken only when this returns it.
    pub async fn next(&mut self) -> Option<CatalogChange> {
        self.changes.recv().await
    }
}

impl Drop for CatalogWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn follow(catalog: Arc<dyn Catalog>, sender: mpsc::Sender<CatalogChange>) {
    // Subscribed before the first read, so that a change made in between wakes the loop.
    let mut subscription = catalog.subscribe();
    let mut seen = None;
    loop {
        let change = CatalogChange::from(catalog.changes_since(seen));
        seen = Some(change.revision);
        let news = change.complete || !change.upserted.is_empty() || !change.removed.is_empty();
        if news && sender.send(change).await.is_err() {
            return;
        }
        if subscription.changed().await.is_none() {
            return;
        }
    }
}
