//! `tether fleet rollout`: writes services to nodes' keys a batch of nodes at a time, and
//! goes on only once every node of the batch publishes the new revision running and ready.
//!
//! The rollout's state lives in etcd, at `<prefix>/rollouts/<service id>` for each of its
//! services: taken in a transaction that fails if any of them exists (a second rollout of a
//! service is refused), updated in transactions that fail if another CLI moved it meanwhile,
//! and deleted when the rollout ends, done or failed. It records the nodes, the batch reached
//! and the values the batch's keys held before, so that `--resume SERVICE_ID` continues a
//! rollout whose CLI died from that batch, and a rollback restores them.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tether_state::ServiceId;
use tether_state::config::{self, Format};

use super::status::FleetView;
use super::{etcd_failure, read_services, usage};
use crate::cli::OnFailure;
use crate::etcd::{self, Client, EtcdError, EtcdOptions, Layout, RolloutRecord as Record, rfc3339, timed};

/// How often the nodes' status is read while a batch is awaited.
const POLL: Duration = Duration::from_millis(50);

/// The rollout's keys in etcd, and the mod revision of the first as this CLI last wrote it.
struct Held {
    keys: Vec<String>,
    mod_revision: i64,
}

/// What `tether fleet rollout` was asked to do.
pub(crate) struct Request<'a> {
    pub(crate) file: Option<&'a Path>,
    pub(crate) nodes: &'a [String],
    pub(crate) max_parallel: usize,
    pub(crate) wait: Duration,
    pub(crate) on_failure: OnFailure,
    pub(crate) resume: Option<&'a str>,
}

fn rollout_key(prefix: &str, id: &str) -> String {
    format!("{prefix}/rollouts/{id}")
}

/// Runs `tether fleet rollout`.
pub(crate) async fn run(options: &EtcdOptions, prefix: &str, request: Request<'_>) -> anyhow::Result<ExitCode> {
    let (record, resumed) = match request.resume {
        Some(id) => {
            ServiceId::new(id).map_err(|err| usage(format!("--resume {id}: {err}")))?;
            (None, Some(id))
        }
        None => (Some(new_record(prefix, &request)?), None),
    };
    let client = options.connect().await.map_err(etcd_failure)?;
    let mut out = std::io::stdout().lock();
    let (mut record, mut held) = match (record, resumed) {
        (Some(record), _) => {
            let held = take(options, &client, prefix, &record).await?;
            (record, held)
        }
        (None, Some(id)) => {
            let key = rollout_key(prefix, id);
            let response = timed(options, "read", client.get(&key)).await?;
            let Some(kv) = response.kvs.first() else {
                return Err(anyhow::anyhow!("{key}: no rollout of service {id} is running"));
            };
            let record: Record = serde_json::from_slice(&kv.value)
                .map_err(|err| anyhow::anyhow!("{key}: not a rollout this tether can resume: {err}"))?;
            let keys: Vec<String> = record.services.keys().map(|id| rollout_key(prefix, id)).collect();
            let first = timed(options, "read", client.get(&keys[0])).await?;
            let mod_revision = first.kvs.first().map_or(0, |kv| kv.mod_revision);
            writeln!(
                out,
                "resuming the rollout of {} at node {} of {}",
                ids(&record),
                record.next + 1,
                record.nodes.len()
            )?;
            (record, Held { keys, mod_revision })
        }
        (None, None) => unreachable!("a rollout is new or resumed"),
    };
    let result = drive(options, &client, prefix, &mut record, &mut held, &mut out).await;
    // Done or failed, the rollout is over: its keys go, so that the next one may start. An
    // etcd that cannot be reached leaves them for `--resume`.
    let ended = match &result {
        Ok(_) => true,
        Err(err) => err.downcast_ref::<EtcdError>().is_none(),
    };
    if !ended {
        let id = record.services.keys().next().map(String::as_str).unwrap_or_default();
        return result.map_err(|err| {
            err.context(format!(
                "the rollout stopped: etcd failed; once it answers, continue it with `tether fleet rollout --resume {id}`"
            ))
        });
    }
    if ended {
        let ops = held.keys.iter().map(|key| etcd::delete_op(key)).collect();
        let request = etcd::pb::TxnRequest { compare: Vec::new(), success: ops, failure: Vec::new() };
        timed(options, "rollout end", client.txn(request)).await?;
    }
    result
}

fn ids(record: &Record) -> String {
    record.services.keys().cloned().collect::<Vec<_>>().join(",")
}

/// Checks the input and makes the record of a new rollout.
fn new_record(prefix: &str, request: &Request<'_>) -> anyhow::Result<Record> {
    let Some(file) = request.file else { return Err(usage("a rollout needs FILE, or --resume SERVICE_ID".into())) };
    if request.nodes.is_empty() {
        return Err(usage("--nodes: at least one node".into()));
    }
    if request.max_parallel == 0 {
        return Err(usage("--max-parallel: at least 1".into()));
    }
    let mut seen = std::collections::BTreeSet::new();
    for node in request.nodes {
        Layout::new(prefix, node).map_err(|err| usage(format!("--nodes: {err}")))?;
        if !seen.insert(node) {
            return Err(usage(format!("--nodes: node {node} is named twice")));
        }
    }
    let services = read_services(file, "roll out")?;
    let mut values = BTreeMap::new();
    for service in &services {
        values.insert(service.id.to_string(), config::to_service_text(service, Format::Json)?);
    }
    Ok(Record {
        services: values,
        nodes: request.nodes.to_vec(),
        max_parallel: request.max_parallel,
        wait_ms: u64::try_from(request.wait.as_millis()).unwrap_or(u64::MAX),
        on_failure: request.on_failure,
        next: 0,
        previous: BTreeMap::new(),
        started_at: rfc3339(std::time::SystemTime::now()),
    })
}

/// Takes the rollout's keys in one transaction, or says which rollout holds them.
async fn take(options: &EtcdOptions, client: &Client, prefix: &str, record: &Record) -> anyhow::Result<Held> {
    let keys: Vec<String> = record.services.keys().map(|id| rollout_key(prefix, id)).collect();
    let value = serde_json::to_vec(record)?;
    let request = etcd::pb::TxnRequest {
        compare: keys.iter().map(|key| etcd::mod_revision_is(key, 0)).collect(),
        success: keys.iter().map(|key| etcd::put_op(key, value.clone(), 0)).collect(),
        failure: Vec::new(),
    };
    let response = timed(options, "rollout start", client.txn(request)).await?;
    if response.succeeded {
        return Ok(Held { keys, mod_revision: etcd::revision(response.header.as_ref()) });
    }
    for (id, key) in record.services.keys().zip(&keys) {
        let held = timed(options, "read", client.get(key)).await?;
        if let Some(kv) = held.kvs.first() {
            let other = serde_json::from_slice::<Record>(&kv.value).ok();
            let nodes = other.as_ref().map_or_else(|| "?".to_owned(), |other| other.nodes.join(","));
            let since = other.as_ref().map_or("?", |other| other.started_at.as_str());
            return Err(anyhow::anyhow!(
                "service {id}: another rollout is running (nodes {nodes}, since {since}; its state is {key}); \
                 refused. If its command died, continue it with `tether fleet rollout --resume {id}`"
            ));
        }
    }
    Err(anyhow::anyhow!("service {}: the rollout's keys changed while it started; try again", ids(record)))
}

/// Writes `record` over the rollout's keys, if no other CLI moved them.
async fn save(options: &EtcdOptions, client: &Client, record: &Record, held: &mut Held) -> anyhow::Result<()> {
    let value = serde_json::to_vec(record)?;
    let request = etcd::pb::TxnRequest {
        compare: vec![etcd::mod_revision_is(&held.keys[0], held.mod_revision)],
        success: held.keys.iter().map(|key| etcd::put_op(key, value.clone(), 0)).collect(),
        failure: Vec::new(),
    };
    let response = timed(options, "rollout update", client.txn(request)).await?;
    if !response.succeeded {
        return Err(anyhow::anyhow!(
            "{}: the rollout was changed by another command (a second --resume?); this one stops",
            held.keys[0]
        ));
    }
    held.mod_revision = etcd::revision(response.header.as_ref());
    Ok(())
}

/// Writes `values` (service id to value, `None`: delete) to `node`'s keys in one
/// transaction; returns its revision, which is the mod revision of each key put.
async fn write_node(
    options: &EtcdOptions,
    client: &Client,
    prefix: &str,
    node: &str,
    values: &BTreeMap<String, Option<String>>,
) -> anyhow::Result<i64> {
    let layout = Layout::new(prefix, node).map_err(|err| usage(err.to_string()))?;
    let mut ops = Vec::new();
    for (id, value) in values {
        let key = layout.key(&ServiceId::new(id)?);
        ops.push(match value {
            Some(value) => etcd::put_op(&key, value.clone().into_bytes(), 0),
            None => etcd::delete_op(&key),
        });
    }
    let request = etcd::pb::TxnRequest { compare: Vec::new(), success: ops, failure: Vec::new() };
    let response = timed(options, "write", client.txn(request)).await?;
    Ok(etcd::revision(response.header.as_ref()))
}

/// The batches from `record.next` on, each done before the next starts.
async fn drive(
    options: &EtcdOptions,
    client: &Client,
    prefix: &str,
    record: &mut Record,
    held: &mut Held,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    let wait = Duration::from_millis(record.wait_ms);
    while record.next < record.nodes.len() {
        let end = (record.next + record.max_parallel.max(1)).min(record.nodes.len());
        let batch: Vec<String> = record.nodes[record.next..end].to_vec();
        if record.previous.is_empty() {
            // What the batch's keys hold now, recorded before anything is written: a
            // rollback restores it, and a resumed rollout does not read its own values.
            for node in &batch {
                let layout = Layout::new(prefix, node).map_err(|err| usage(err.to_string()))?;
                let mut values = BTreeMap::new();
                for id in record.services.keys() {
                    let key = layout.key(&ServiceId::new(id)?);
                    let response = timed(options, "read", client.get(&key)).await?;
                    let value = response.kvs.first().map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
                    values.insert(id.clone(), value);
                }
                record.previous.insert(node.clone(), values);
            }
            save(options, client, record, held).await?;
        }
        let view = super::status::read(options, client, prefix).await?;
        if let Some(down) = batch.iter().find(|node| view.get(*node).is_none_or(|seen| seen.up.is_none())) {
            writeln!(out, "{down}: down (no live status); the rollout stops before writing it")?;
            return fail(options, client, prefix, record, &[], out).await;
        }
        let new: BTreeMap<String, Option<String>> =
            record.services.iter().map(|(id, value)| (id.clone(), Some(value.clone()))).collect();
        let mut written = Vec::new();
        let mut targets = BTreeMap::new();
        for node in &batch {
            let revision = write_node(options, client, prefix, node, &new).await?;
            writeln!(out, "{node}: wrote {} (revision {revision})", ids(record))?;
            written.push(node.clone());
            targets.insert(node.clone(), revision);
        }
        out.flush()?;
        if let Err(failure) = await_batch(options, client, prefix, &service_ids(record), &targets, wait, out).await? {
            writeln!(out, "{failure}")?;
            return fail(options, client, prefix, record, &written, out).await;
        }
        record.next = end;
        record.previous.clear();
        save(options, client, record, held).await?;
    }
    writeln!(out, "rollout of {} done on {} nodes", ids(record), record.nodes.len())?;
    Ok(ExitCode::SUCCESS)
}

fn service_ids(record: &Record) -> Vec<String> {
    record.services.keys().cloned().collect()
}

/// How long the status read of a batch that waits is tried again through etcd's failures
/// (a member lost, a new leader elected): reads change nothing, so a retry is safe.
const READ_RETRY_FOR: Duration = Duration::from_secs(20);

/// The fleet's status, read again through etcd failures for up to [`READ_RETRY_FOR`].
async fn read_through_failures(
    options: &EtcdOptions,
    client: &Client,
    prefix: &str,
) -> Result<FleetView, super::EtcdError> {
    let started = Instant::now();
    loop {
        match super::status::read(options, client, prefix).await {
            Ok(view) => return Ok(view),
            Err(error) if started.elapsed() < READ_RETRY_FOR => {
                tracing::debug!(%error, "reading the fleet's status again");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(error) => return Err(error),
        }
    }
}

/// Waits until every node of `targets` runs every service of `ids` at its revision and
/// ready; `Ok(Err(why))` names the node and the proxy's error when one is down or is not
/// ready within `wait`.
async fn await_batch(
    options: &EtcdOptions,
    client: &Client,
    prefix: &str,
    ids: &[String],
    targets: &BTreeMap<String, i64>,
    wait: Duration,
    out: &mut impl Write,
) -> anyhow::Result<Result<(), String>> {
    let started = Instant::now();
    let mut pending: BTreeMap<String, i64> = targets.clone();
    loop {
        let view: FleetView = read_through_failures(options, client, prefix).await?;
        let mut still = BTreeMap::new();
        for (node, revision) in pending {
            let seen = view.get(&node).cloned().unwrap_or_default();
            if seen.up.is_none() {
                return Ok(Err(format!("{node}: down (its status expired) while on revision {revision}")));
            }
            if ids.iter().all(|id| seen.runs(id, revision)) {
                writeln!(
                    out,
                    "{node}: running and ready on revision {revision} ({:.1}s)",
                    started.elapsed().as_secs_f64()
                )?;
                out.flush()?;
            } else {
                still.insert(node, revision);
            }
        }
        pending = still;
        if pending.is_empty() {
            return Ok(Ok(()));
        }
        if started.elapsed() >= wait {
            let (node, revision) = pending.iter().next().map(|(n, r)| (n.clone(), *r)).unwrap_or_default();
            let seen = view.get(&node).cloned().unwrap_or_default();
            let mut problems = Vec::new();
            for id in ids {
                let proxy = ServiceId::new(id).map(|id| id.proxy_id().to_string()).unwrap_or_else(|_| id.clone());
                match seen.proxy_of(id) {
                    Some(p) if !seen.runs(id, revision) => problems.push(format!(
                        "{proxy} is {} on revision {}{}",
                        p.state,
                        p.revision.map_or_else(|| "-".to_owned(), |r| r.to_string()),
                        p.error.as_ref().map(|e| format!(": {e}")).unwrap_or_default()
                    )),
                    Some(_) => {}
                    None => problems.push(format!("{proxy} is not published")),
                }
            }
            return Ok(Err(format!(
                "{node}: not running and ready on revision {revision} within {}: {}",
                humantime::format_duration(wait),
                problems.join("; ")
            )));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Ends a failed rollout: no further node is touched; with `rollback`, the nodes of the
/// failed batch that were written get their previous values back, awaited the same way.
async fn fail(
    options: &EtcdOptions,
    client: &Client,
    prefix: &str,
    record: &Record,
    written: &[String],
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    let untouched = record.nodes.len() - record.next - written.len();
    if record.on_failure == OnFailure::Rollback && !written.is_empty() {
        let mut targets = BTreeMap::new();
        for node in written {
            let Some(previous) = record.previous.get(node) else { continue };
            let revision = write_node(options, client, prefix, node, previous).await?;
            writeln!(out, "{node}: rolled back (revision {revision})")?;
            if previous.values().all(Option::is_some) {
                targets.insert(node.clone(), revision);
            }
        }
        let wait = Duration::from_millis(record.wait_ms);
        if let Err(failure) = await_batch(options, client, prefix, &service_ids(record), &targets, wait, out).await? {
            writeln!(out, "rollback: {failure}")?;
        }
    }
    writeln!(out, "rollout of {} failed; {untouched} node(s) untouched", ids(record))?;
    Ok(ExitCode::FAILURE)
}
