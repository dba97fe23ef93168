//! Tests of the snapshot stores and the deduplicating writer.

use std::os::unix::fs::PermissionsExt;

use tether_state::config::{self, Format};

use super::*;
use crate::status::Published;

fn service(json: &str) -> Service {
    config::parse_service(json, Format::Json, &config::Origin::Body).unwrap()
}

fn backend(value: serde_json::Value) -> BackendRecord {
    BackendRecord::new(&value).unwrap()
}

fn record(id: &str) -> ProxyRecord {
    ProxyRecord {
        id: ProxyId::parse(id).unwrap(),
        service: Some(service(r#"{ "name": "web", "proxy": {} }"#)),
        token: None,
        backend: backend(serde_json::json!({ "pid": 12 })),
    }
}

fn encoded(records: &[ProxyRecord]) -> BTreeMap<ProxyId, EncodedRecord> {
    records.iter().map(|record| (record.id.clone(), EncodedRecord::from_record(record).unwrap())).collect()
}

fn put(record: ProxyRecord) -> WriterMessage {
    WriterMessage::Put(record.id.clone(), EncodedRecord::from_record(&record).unwrap())
}

/// The file as the derived encoding of the whole snapshot pretty-prints it, with each
/// service compact (as a raw value).
fn pretty(snapshot: &Snapshot) -> String {
    #[derive(Serialize)]
    struct Record<'a> {
        id: &'a ProxyId,
        service: Option<Box<serde_json::value::RawValue>>,
        token: &'a Option<TokenFingerprint>,
        backend: &'a BackendRecord,
    }
    #[derive(Serialize)]
    struct File<'a> {
        version: u32,
        proxies: Vec<Record<'a>>,
    }
    let proxies = snapshot
        .proxies
        .iter()
        .map(|record| Record {
            id: &record.id,
            service: record.service.as_ref().map(|service| serde_json::value::to_raw_value(service).unwrap()),
            token: &record.token,
            backend: &record.backend,
        })
        .collect();
    serde_json::to_string_pretty(&File { version: SNAPSHOT_VERSION, proxies }).unwrap()
}

fn varied_records() -> Vec<ProxyRecord> {
    let full = ProxyRecord {
        id: ProxyId::parse("db-proxy").unwrap(),
        service: Some(service(
            r#"{
                "name": "db",
                "tags": [],
                "meta": { "team": "edge", "quote": "a \"b\"\nc" },
                "proxy": { "command": ["/bin/sleep", "3600"], "config": {}, "restart": { "max_delay": "1m" } }
            }"#,
        )),
        token: Some(serde_json::from_value(serde_json::json!("ab".repeat(32))).unwrap()),
        backend: backend(serde_json::json!({ "pid": 12, "boot_id": "b", "nested": { "list": [1, 2] } })),
    };
    let bare = ProxyRecord {
        id: ProxyId::parse("gone-proxy").unwrap(),
        service: None,
        token: None,
        backend: BackendRecord::none(),
    };
    vec![full, bare, record("web-proxy")]
}

#[test]
fn an_assembled_snapshot_is_the_pretty_encoding_of_the_whole_with_compact_services() {
    for proxies in [Vec::new(), vec![record("web-proxy")], varied_records()] {
        let snapshot = Snapshot::new(proxies);
        let encoded = EncodedSnapshot::encode(&snapshot).unwrap();
        assert_eq!(String::from_utf8(encoded.to_bytes()).unwrap(), pretty(&snapshot));
        assert_eq!(encoded.decode().unwrap(), snapshot);
        assert_eq!(encoded.len(), snapshot.proxies.len());
    }
}

#[test]
fn a_record_encoded_from_its_parts_equals_the_encoding_of_the_record() {
    for record in varied_records() {
        let service = record.service.as_ref().map(|service| EncodedService::new(std::sync::Arc::new(service.clone())));
        let parts = EncodedRecord::new(&record.id, service.as_ref(), record.token.as_ref(), &record.backend).unwrap();
        assert_eq!(parts, EncodedRecord::from_record(&record).unwrap(), "{record:?}");
    }
}

#[tokio::test]
async fn file_store_round_trips_with_a_version_and_mode_0600() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileSnapshotStore::new(dir.path().join("snapshot.json"));
    assert!(store.load().await.unwrap().is_none());
    let snapshot = Snapshot::new(vec![record("web-proxy")]);
    store.save(EncodedSnapshot::encode(&snapshot).unwrap()).await.unwrap();
    assert_eq!(store.load().await.unwrap(), Some(snapshot));
    let text = std::fs::read_to_string(store.path()).unwrap();
    assert!(text.contains("\"version\": 2"), "{text}");
    let mode = std::fs::metadata(store.path()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
}

#[tokio::test]
async fn corrupt_file_is_moved_aside_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("snapshot.json");
    for damaged in ["{not json", r#"{"version": 99, "proxies": []}"#, r#"{"version": 1, "proxies": [], "extra": 1}"#] {
        std::fs::write(&path, damaged).unwrap();
        let err = FileSnapshotStore::new(&path).load().await.unwrap_err();
        let SnapshotError::Corrupt { moved_to, .. } = &err else { panic!("{err:?}") };
        assert_eq!(moved_to.as_deref(), Some(dir.path().join("snapshot.json.corrupt").as_path()));
        assert!(!path.exists());
        assert!(err.to_string().starts_with("the snapshot"), "{err}");
    }
}

#[tokio::test]
async fn writer_skips_content_that_did_not_change() {
    let store = Arc::new(MemorySnapshotStore::with_snapshot(Snapshot::new(vec![record("web-proxy")])));
    let (sender, messages) = mpsc::unbounded_channel();
    let records = encoded(&[record("web-proxy")]);
    let saved = encoded(&store.snapshot().unwrap().proxies);
    let published = Published::new();
    let task = tokio::spawn(writer(store.clone(), messages, records, Some(saved), published.clone()));
    let flush = |sender: &WriterSender| {
        let (reply, answer) = oneshot::channel();
        sender.send(WriterMessage::Flush(reply)).unwrap();
        answer
    };
    sender.send(put(record("web-proxy"))).unwrap();
    flush(&sender).await.unwrap().unwrap();
    assert_eq!(*store.saves().borrow(), 0, "equal content is not written again");
    sender.send(put(record("db-proxy"))).unwrap();
    sender.send(WriterMessage::Remove(ProxyId::parse("db-proxy").unwrap())).unwrap();
    flush(&sender).await.unwrap().unwrap();
    assert_eq!(*store.saves().borrow(), 0, "a burst that ends where it started writes nothing");
    sender.send(WriterMessage::Remove(ProxyId::parse("web-proxy").unwrap())).unwrap();
    flush(&sender).await.unwrap().unwrap();
    assert_eq!(*store.saves().borrow(), 1);
    assert_eq!(store.snapshot().unwrap().proxies, []);
    assert_eq!(published.lock().stats.snapshot_writes, 1, "only real writes are counted");
    drop(sender);
    task.await.unwrap();
}

#[tokio::test]
async fn failed_writes_are_counted_and_retried_on_the_next_change() {
    let mut store = MockSnapshotStore::new();
    let mut seq = mockall::Sequence::new();
    store.expect_save().times(1).in_sequence(&mut seq).returning(|_| Err(SnapshotError::WriterGone));
    store.expect_save().times(1).in_sequence(&mut seq).returning(|_| Ok(()));
    let (sender, messages) = mpsc::unbounded_channel();
    let published = Published::new();
    let task = tokio::spawn(writer(Arc::new(store), messages, BTreeMap::new(), None, published.clone()));
    sender.send(put(record("web-proxy"))).unwrap();
    let (reply, answer) = oneshot::channel();
    sender.send(WriterMessage::Flush(reply)).unwrap();
    assert!(answer.await.unwrap().is_err());
    assert_eq!(published.lock().stats.snapshot_failures, 1);
    let (reply, answer) = oneshot::channel();
    sender.send(WriterMessage::Flush(reply)).unwrap();
    answer.await.unwrap().unwrap();
    assert_eq!(published.lock().stats.snapshot_writes, 1);
    drop(sender);
    task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_failed_write_is_retried_on_its_own_with_backoff() {
    let mut store = MockSnapshotStore::new();
    let mut seq = mockall::Sequence::new();
    let start = tokio::time::Instant::now();
    let (times, attempts) = std::sync::mpsc::channel();
    for outcome in [false, false, true] {
        let times = times.clone();
        store.expect_save().times(1).in_sequence(&mut seq).returning(move |_| {
            times.send(tokio::time::Instant::now() - start).unwrap();
            if outcome { Ok(()) } else { Err(SnapshotError::WriterGone) }
        });
    }
    let (sender, messages) = mpsc::unbounded_channel::<WriterMessage>();
    let published = Published::new();
    let records = encoded(&[record("web-proxy")]);
    let task = tokio::spawn(writer(Arc::new(store), messages, records, None, published.clone()));
    let mut seen = Vec::new();
    for _ in 0..3 {
        // Paused time: waiting on the channel lets the clock run to the writer's timer.
        seen.push(
            tokio::time::timeout(Duration::from_secs(60), async {
                loop {
                    if let Ok(at) = attempts.try_recv() {
                        return at;
                    }
                    tokio::task::yield_now().await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await
            .unwrap(),
        );
    }
    let seconds: Vec<u64> = seen.iter().map(|d| d.as_secs()).collect();
    assert_eq!(seconds, [0, 1, 3], "a first try, then 1 s, then 2 s later");
    let stats = published.handle().stats();
    assert_eq!((stats.snapshot_failures, stats.snapshot_writes), (2, 1));
    drop(sender);
    task.await.unwrap();
}

/// `snapshot.json` as the agent wrote it in format version 1: two proxies, `web-proxy` with
/// SIGTERM and 2 s as its kill policy, and the process backend's flat records.
const VERSION_1: &str = include_str!("v1.json");

#[tokio::test]
async fn a_version_1_snapshot_is_read_whole_and_written_again_as_the_current_version() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileSnapshotStore::new(dir.path().join("snapshot.json"));
    std::fs::write(store.path(), VERSION_1).unwrap();
    let snapshot = store.load().await.unwrap().expect("a snapshot");
    assert_eq!(snapshot.migrated_from, Some(1));
    let ids: Vec<&str> = snapshot.proxies.iter().map(|record| record.id.as_str()).collect();
    assert_eq!(ids, ["api-proxy", "web-proxy"]);
    let web = &snapshot.proxies[1];
    let spec = web.service.as_ref().and_then(|service| service.proxy.as_ref()).expect("a typed service");
    assert_eq!((spec.kill.signal, spec.kill.timeout), (tether_state::KillSignal::Term, Duration::from_secs(2)));
    assert_eq!(
        web.token.as_ref().map(ToString::to_string).as_deref(),
        Some("807203504612427a3b4e41d242418918d6ff9e241e01976390c8a954e83491e1")
    );
    // The backend's record reaches it as it was written, for the backend to migrate.
    let backend: serde_json::Value = web.backend.parse().unwrap();
    assert_eq!((backend["pid"].as_u64(), backend["kill_signal"].as_str()), (Some(596), Some("SIGTERM")));

    store.save(EncodedSnapshot::encode(&snapshot).unwrap()).await.unwrap();
    let text = std::fs::read_to_string(store.path()).unwrap();
    assert!(text.starts_with("{\n  \"version\": 2,"), "{text}");
    let again = store.load().await.unwrap().unwrap();
    assert_eq!(again.migrated_from, None);
    assert_eq!(again.proxies, snapshot.proxies);
}
