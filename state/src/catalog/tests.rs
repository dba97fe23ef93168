//! Tests of the catalog: deltas, sources, tokens, and the notification guarantees with real tasks.

use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::service::{ProxySpec, ServiceName};

fn service(id: &str) -> Service {
    Service::new(ServiceId::new(id).unwrap(), ServiceName::new(id).unwrap()).with_proxy(ProxySpec::default())
}

fn bare(id: &str) -> Service {
    Service::new(ServiceId::new(id).unwrap(), ServiceName::new(id).unwrap())
}

fn config(file: &str) -> Source {
    Source::Config { file: file.into() }
}

fn sid(id: &str) -> ServiceId {
    ServiceId::new(id).unwrap()
}

fn ids(changes: &Changes) -> (Vec<String>, Vec<String>) {
    let mut upserted: Vec<String> = changes.upserted.iter().map(|d| d.proxy.id().to_string()).collect();
    let mut removed: Vec<String> = changes.removed.iter().map(ToString::to_string).collect();
    upserted.sort();
    removed.sort();
    (upserted, removed)
}

#[test]
fn deltas_hold_only_what_changed_since() {
    let state = LocalState::new();
    state.upsert(service("a"), Source::Api).unwrap();
    state.upsert(service("b"), Source::Api).unwrap();
    let seen = state.changes_since(None);
    assert!(seen.complete);
    assert_eq!(ids(&seen).0, ["a-proxy", "b-proxy"]);

    let mut changed = service("a");
    changed.port = Some(1);
    state.upsert(changed, Source::Api).unwrap();
    state.remove(&sid("b"), &SourceKind::Api).unwrap();
    state.upsert(service("c"), Source::Api).unwrap();
    let delta = state.changes_since(Some(seen.revision));
    assert!(!delta.complete);
    assert_eq!(ids(&delta), (vec!["a-proxy".into(), "c-proxy".into()], vec!["b-proxy".into()]));
    assert!(delta.upserted.iter().all(|d| d.revision > seen.revision));

    let nothing = state.changes_since(Some(delta.revision));
    assert_eq!(ids(&nothing), (vec![], vec![]));
    assert_eq!(nothing.revision, delta.revision);
}

#[test]
fn an_identical_upsert_changes_nothing() {
    let state = LocalState::new();
    let first = state.upsert(service("a"), Source::Api).unwrap();
    let subscription = state.subscribe();
    let again = state.upsert(service("a"), Source::Api).unwrap();
    assert_eq!(first, again);
    assert!(!subscription.0.has_changed().unwrap());
}

#[test]
fn a_service_that_loses_its_proxy_removes_the_proxy() {
    let state = LocalState::new();
    state.upsert(service("a"), Source::Api).unwrap();
    let seen = state.revision();
    state.upsert(bare("a"), Source::Api).unwrap();
    assert_eq!(ids(&state.changes_since(Some(seen))), (vec![], vec!["a-proxy".into()]));
    assert!(state.changes_since(None).upserted.is_empty());
    assert!(state.tokens().is_empty());
}

#[test]
fn proxies_are_picked_and_found_without_a_copy_of_the_catalog() {
    let state = LocalState::new();
    for id in ["a", "b", "c"] {
        state.upsert(service(id), Source::Api).unwrap();
    }
    state.upsert(bare("d"), Source::Api).unwrap();
    let picked: Vec<String> =
        state.proxies_where(|proxy| proxy.id().as_str() != "b-proxy").iter().map(|p| p.id().to_string()).collect();
    assert_eq!(picked, ["a-proxy", "c-proxy"]);
    assert!(state.proxies_where(|_| false).is_empty());
    let proxy = |id: &str| ProxyId::parse(id).unwrap();
    assert!(state.has_proxy(&proxy("a-proxy")));
    // A service without a proxy, and a proxy of no service, are not there.
    assert!(!state.has_proxy(&proxy("d-proxy")));
    assert!(!state.has_proxy(&proxy("e-proxy")));
    state.upsert(bare("a"), Source::Api).unwrap();
    assert!(!state.has_proxy(&proxy("a-proxy")));
}

#[test]
fn tokens_survive_updates_and_are_new_after_removal() {
    let state = LocalState::new();
    state.upsert(service("a"), Source::Api).unwrap();
    let token = state.tokens()[&sid("a").proxy_id()].clone();
    let mut changed = service("a");
    changed.proxy.as_mut().unwrap().user = Some("nobody".into());
    state.upsert(changed, Source::Api).unwrap();
    assert_eq!(state.tokens()[&sid("a").proxy_id()], token);
    state.remove(&sid("a"), &SourceKind::Api).unwrap();
    state.upsert(service("a"), Source::Api).unwrap();
    assert_ne!(state.tokens()[&sid("a").proxy_id()], token);
}

#[test]
fn a_token_asked_for_before_an_upsert_is_the_one_the_upsert_gives() {
    let state = LocalState::new();
    let proxy = sid("a").proxy_id();
    let token = state.token_for(&proxy).unwrap();
    assert_eq!(state.token_for(&proxy).unwrap(), token, "kept until the upsert");
    assert!(state.tokens().is_empty(), "not in the catalog yet");
    let revision = state.revision();
    state.upsert(service("a"), Source::Api).unwrap();
    assert_eq!(state.tokens()[&proxy], token);
    assert_eq!(state.token_for(&proxy).unwrap(), token, "the proxy's own");
    assert!(state.revision() > revision);
}

#[test]
fn restored_tokens_are_given_back_to_their_proxies() {
    let token = ProxyToken::generate().unwrap();
    let state = LocalState::with_tokens(BTreeMap::from([(sid("a").proxy_id(), token.clone())]));
    state.upsert(service("a"), Source::Api).unwrap();
    state.upsert(service("b"), Source::Api).unwrap();
    let tokens = state.tokens();
    assert_eq!(tokens[&sid("a").proxy_id()], token);
    assert_ne!(tokens[&sid("b").proxy_id()], token);
}

#[test]
fn sources_cannot_take_each_others_services() {
    let state = LocalState::new();
    state.replace_source(&SourceKind::Config, vec![(service("web"), config("web.toml"))]).unwrap();
    let err = state.upsert(service("web"), Source::Api).unwrap_err();
    assert_eq!(err.to_string(), "service web is defined by config file web.toml, not by the API");
    let err = state.remove(&sid("web"), &SourceKind::Api).unwrap_err();
    assert!(matches!(err, CatalogError::Conflict { .. }), "{err:?}");
    let err = state.remove(&sid("nope"), &SourceKind::Api).unwrap_err();
    assert_eq!(err.to_string(), "service nope is not registered");
    assert_eq!(state.len(), 1);
}

#[test]
fn replace_source_is_all_or_nothing() {
    let state = LocalState::new();
    state.upsert(service("api-owned"), Source::Api).unwrap();
    state.replace_source(&SourceKind::Config, vec![(service("a"), config("a.toml"))]).unwrap();
    let before = state.revision();

    let err = state
        .replace_source(
            &SourceKind::Config,
            vec![(service("b"), config("b.toml")), (service("api-owned"), config("b.toml"))],
        )
        .unwrap_err();
    assert!(matches!(err, CatalogError::Conflict { .. }), "{err:?}");
    let err = state
        .replace_source(&SourceKind::Config, vec![(service("b"), config("b.toml")), (service("b"), config("c.toml"))])
        .unwrap_err();
    assert!(matches!(err, CatalogError::Duplicate { .. }), "{err:?}");
    assert_eq!(state.revision(), before);
    assert!(state.get(&sid("a")).is_some() && state.get(&sid("b")).is_none());
}

#[test]
fn replace_source_adds_changes_and_removes_only_its_kind() {
    let state = LocalState::new();
    state.upsert(service("api"), Source::Api).unwrap();
    state
        .replace_source(&SourceKind::Config, vec![(service("a"), config("x.toml")), (service("b"), config("x.toml"))])
        .unwrap();
    let seen = state.revision();
    let mut changed = service("b");
    changed.tags = vec!["v2".into()];
    let report = state
        .replace_source(&SourceKind::Config, vec![(changed, config("x.toml")), (service("c"), config("y.toml"))])
        .unwrap();
    assert_eq!(report, ReplaceReport { added: 1, changed: 1, removed: 1 });
    let delta = state.changes_since(Some(seen));
    assert_eq!(ids(&delta), (vec!["b-proxy".into(), "c-proxy".into()], vec!["a-proxy".into()]));
    assert_eq!(delta.revision.get(), seen.get() + 1, "one bulk replace is one revision");
    assert!(state.get(&sid("api")).is_some());
}

#[test]
fn change_source_changes_only_what_it_names_at_one_revision_or_nothing() {
    let state = LocalState::new();
    state.upsert(service("api"), Source::Api).unwrap();
    state
        .replace_source(&SourceKind::Config, vec![(service("a"), config("x.toml")), (service("b"), config("x.toml"))])
        .unwrap();
    let seen = state.revision();
    let report = state
        .change_source(&SourceKind::Config, vec![(service("c"), config("y.toml"))], &[sid("a"), sid("api")])
        .unwrap();
    assert_eq!(report, ReplaceReport { added: 1, changed: 0, removed: 1 }, "another kind's id is not removed");
    let delta = state.changes_since(Some(seen));
    assert_eq!(ids(&delta), (vec!["c-proxy".into()], vec!["a-proxy".into()]));
    assert_eq!(delta.revision.get(), seen.get() + 1, "one change is one revision");
    assert!(state.get(&sid("b")).is_some() && state.get(&sid("api")).is_some(), "unnamed services stay");

    let before = state.revision();
    let err = state
        .change_source(
            &SourceKind::Config,
            vec![(service("d"), config("y.toml")), (service("api"), config("y.toml"))],
            &[sid("b")],
        )
        .unwrap_err();
    assert!(matches!(err, CatalogError::Conflict { .. }), "{err:?}");
    assert_eq!(state.revision(), before);
    assert!(state.get(&sid("b")).is_some() && state.get(&sid("d")).is_none(), "a refused change changes nothing");
}

#[test]
fn a_service_moving_between_files_is_not_a_change() {
    let state = LocalState::new();
    state.replace_source(&SourceKind::Config, vec![(service("a"), config("x.toml"))]).unwrap();
    let seen = state.revision();
    let report = state.replace_source(&SourceKind::Config, vec![(service("a"), config("y.toml"))]).unwrap();
    assert_eq!(report, ReplaceReport::default());
    assert_eq!(ids(&state.changes_since(Some(seen))), (vec![], vec![]));
    assert_eq!(state.get(&sid("a")).unwrap().source, config("y.toml"));
}

#[test]
fn readers_far_behind_get_a_complete_answer() {
    let state = LocalState::new();
    let start = state.revision();
    for n in 0..(TOMBSTONE_SLACK * 3) {
        let id = format!("s{n}");
        state.upsert(service(&id), Source::Api).unwrap();
        state.remove(&sid(&id), &SourceKind::Api).unwrap();
    }
    state.upsert(service("live"), Source::Api).unwrap();
    let changes = state.changes_since(Some(start));
    assert!(changes.complete);
    assert_eq!(ids(&changes).0, ["live-proxy"]);
    let inner = state.lock();
    assert!(inner.journal.len() <= TOMBSTONE_SLACK + 1, "journal grew to {}", inner.journal.len());
    drop(inner);
    // A future revision (from another catalog) is answered completely too.
    assert!(state.changes_since(Some(Revision::new(u64::MAX))).complete);
}

#[tokio::test]
async fn a_change_before_the_wait_is_not_missed() {
    let state = LocalState::new();
    let mut subscription = state.subscribe();
    state.upsert(service("a"), Source::Api).unwrap();
    let revision = tokio::time::timeout(Duration::from_secs(10), subscription.changed()).await.unwrap().unwrap();
    assert_eq!(revision, state.revision());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_changes_fold_into_one_wake_up_and_none_is_lost() {
    let state = LocalState::new();
    let mut subscription = state.subscribe();
    let writer = state.clone();
    let writes = 1_000;
    let task = tokio::spawn(async move {
        for n in 0..writes {
            writer.upsert(service(&format!("s{n}")), Source::Api).unwrap();
        }
    });
    // The reader follows the writer with deltas; whatever the interleaving, it ends with
    // every service seen exactly as the catalog holds it.
    let mut seen = std::collections::BTreeSet::new();
    let mut last = None;
    let mut wake_ups = 0;
    while seen.len() < writes {
        let changes = state.changes_since(last);
        for desired in &changes.upserted {
            seen.insert(desired.proxy.id().clone());
        }
        last = Some(changes.revision);
        if seen.len() < writes {
            tokio::time::timeout(Duration::from_secs(10), subscription.changed()).await.unwrap().unwrap();
            wake_ups += 1;
        }
    }
    task.await.unwrap();
    assert_eq!(seen.len(), writes);
    assert!(wake_ups <= writes, "{wake_ups} wake-ups for {writes} writes");
}

#[tokio::test]
async fn a_burst_between_two_reads_is_one_wake_up() {
    let state = LocalState::new();
    let mut subscription = state.subscribe();
    for n in 0..100 {
        state.upsert(service(&format!("s{n}")), Source::Api).unwrap();
    }
    let revision = tokio::time::timeout(Duration::from_secs(10), subscription.changed()).await.unwrap().unwrap();
    assert_eq!(revision.get(), 100);
    // Nothing further is pending: the whole burst was one wake-up.
    assert!(!subscription.0.has_changed().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_never_wait_for_a_reader_that_does_not_read() {
    let state = LocalState::new();
    // Subscribers that never read must not slow down or block a writer.
    let _idle: Vec<Subscription> = (0..100).map(|_| state.subscribe()).collect();
    let writer = state.clone();
    let done = tokio::task::spawn_blocking(move || {
        for n in 0..10_000 {
            writer.upsert(service(&format!("s{n}")), Source::Api).unwrap();
        }
    });
    tokio::time::timeout(Duration::from_secs(30), done).await.expect("writer blocked").unwrap();
    assert_eq!(state.len(), 10_000);
}

#[tokio::test]
async fn subscription_ends_when_the_catalog_is_gone() {
    let state = LocalState::new();
    let mut subscription = state.subscribe();
    drop(state);
    assert_eq!(tokio::time::timeout(Duration::from_secs(10), subscription.changed()).await.unwrap(), None);
}

#[derive(Debug, Clone)]
enum Op {
    Upsert(u8, u16),
    Bare(u8),
    Remove(u8),
    Replace(Vec<(u8, u16)>),
    Read,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..12, 0u16..3).prop_map(|(id, port)| Op::Upsert(id, port)),
        1 => (0u8..12).prop_map(Op::Bare),
        2 => (0u8..12).prop_map(Op::Remove),
        1 => prop::collection::vec((12u8..20, 0u16..3), 0..5).prop_map(Op::Replace),
        3 => Just(Op::Read),
    ]
}

proptest! {
    /// A reader that follows with deltas always ends up with exactly the desired set.
    #[test]
    fn following_deltas_reconstructs_the_desired_set(ops in prop::collection::vec(op(), 1..60)) {
        let state = LocalState::new();
        let mut mirror: BTreeMap<ProxyId, (Revision, Arc<ManagedProxy>)> = BTreeMap::new();
        let mut last: Option<Revision> = None;
        let mut read = |state: &LocalState, mirror: &mut BTreeMap<ProxyId, (Revision, Arc<ManagedProxy>)>| {
            let changes = state.changes_since(last);
            if changes.complete {
                mirror.clear();
            }
            for id in &changes.removed {
                mirror.remove(id);
            }
            for desired in changes.upserted {
                mirror.insert(desired.proxy.id().clone(), (desired.revision, desired.proxy));
            }
            last = Some(changes.revision);
        };
        for op in ops {
            match op {
                Op::Upsert(id, port) => {
                    let mut s = service(&format!("s{id}"));
                    s.port = Some(port);
                    state.upsert(s, Source::Api).unwrap();
                }
                Op::Bare(id) => {
                    state.upsert(bare(&format!("s{id}")), Source::Api).unwrap();
                }
                Op::Remove(id) => {
                    let _ = state.remove(&sid(&format!("s{id}")), &SourceKind::Api);
                }
                Op::Replace(entries) => {
                    let mut unique = BTreeMap::new();
                    for (id, port) in entries {
                        unique.insert(id, port);
                    }
                    let services = unique.into_iter().map(|(id, port)| {
                        let mut s = service(&format!("s{id}"));
                        s.port = Some(port);
                        (s, config("f.toml"))
                    }).collect();
                    state.replace_source(&SourceKind::Config, services).unwrap();
                }
                Op::Read => read(&state, &mut mirror),
            }
        }
        read(&state, &mut mirror);
        let full = state.changes_since(None);
        let expected: BTreeMap<ProxyId, (Revision, Arc<ManagedProxy>)> =
            full.upserted.into_iter().map(|d| (d.proxy.id().clone(), (d.revision, d.proxy))).collect();
        prop_assert_eq!(mirror.len(), expected.len());
        for (id, (revision, proxy)) in &expected {
            let (seen_revision, seen_proxy) = &mirror[id];
            prop_assert_eq!(seen_revision, revision);
            prop_assert_eq!(&**seen_proxy, &**proxy);
        }
    }
}
