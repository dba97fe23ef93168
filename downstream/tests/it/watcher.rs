//! The agent's catalog watcher: the whole set first, then each change, and nothing missed
//! when the reader falls behind.

use std::sync::Arc;

use tether_downstream::{CatalogChange, CatalogWatcher};
use tether_state::{ServiceId, Source, SourceKind};

use crate::support::{catalog, id, service, within};

async fn next(watcher: &mut CatalogWatcher) -> CatalogChange {
    within("a report of the watcher", watcher.next()).await.expect("the watcher runs")
}

#[tokio::test]
async fn the_watcher_reports_the_whole_set_then_each_change() {
    let catalog = catalog(&[service("web"), service("api")]);
    let mut watcher = CatalogWatcher::spawn(Arc::new(catalog.clone()));

    let first = next(&mut watcher).await;
    assert!(first.complete);
    assert_eq!(first.upserted, [id("api"), id("web")]);

    catalog.upsert(service("db"), Source::Api).unwrap();
    let added = next(&mut watcher).await;
    assert!(!added.complete);
    assert_eq!((added.upserted, added.removed), (vec![id("db")], vec![]));

    catalog.remove(&ServiceId::new("web").unwrap(), &SourceKind::Api).unwrap();
    let removed = next(&mut watcher).await;
    assert_eq!((removed.upserted, removed.removed), (vec![], vec![id("web")]));
    assert_eq!(removed.revision, catalog.revision());
}

#[tokio::test]
async fn a_reader_that_falls_behind_misses_no_change() {
    let catalog = catalog(&[]);
    let mut watcher = CatalogWatcher::spawn(Arc::new(catalog.clone()));
    assert!(next(&mut watcher).await.upserted.is_empty());

    let names: Vec<String> = (0..20).map(|n| format!("s{n:02}")).collect();
    for name in &names {
        catalog.upsert(service(name), Source::Api).unwrap();
    }
    // However the burst was folded into reports, together they hold every change.
    let mut seen = Vec::new();
    while seen.len() < names.len() {
        let change = next(&mut watcher).await;
        assert!(change.removed.is_empty());
        seen.extend(change.upserted);
    }
    seen.sort();
    let expected: Vec<_> = names.iter().map(|name| id(name)).collect();
    assert_eq!(seen, expected);
}
