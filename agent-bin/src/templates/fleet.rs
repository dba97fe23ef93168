//! `instances(name)` across the fleet: the ready instances that every agent publishes under
//! `<prefix>/instances/<name>/<node>/<service id>`, read and then watched for each name a
//! template asks for, and only for those.
//!
//! This module owns one watching task per name, a cache of what each last found, and the
//! wake-ups that tell the renderer which names changed. It writes nothing to etcd.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tether_state::Backoff;
use tether_state::lock;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::render::{Instance, InstanceSource};
use crate::etcd::{self, EtcdOptions, Layout};

/// How long a render waits for the first answer about a name before it fails (and keeps its
/// last good file).
const FIRST_ANSWER: Duration = Duration::from_secs(5);

/// The fleet's instances, as [`InstanceSource`].
pub(crate) struct FleetInstances {
    inner: Arc<Inner>,
}

struct Inner {
    etcd: EtcdOptions,
    /// `<prefix>/instances/`.
    prefix: String,
    runtime: tokio::runtime::Handle,
    /// What is known of each name asked for: `None` until its first answer.
    known: Mutex<HashMap<String, Option<Vec<Instance>>>>,
    answered: Condvar,
    /// The names whose instances changed, for the renderer.
    changed: mpsc::UnboundedSender<String>,
    stop: CancellationToken,
}

impl FleetInstances {
    /// A source over the fleet of `layout` in the etcd of `etcd`, telling `changed` of each
    /// name whose instances change; its watches end when `stop` is cancelled. Inside a tokio
    /// runtime.
    pub(crate) fn new(
        etcd: EtcdOptions,
        layout: &Layout,
        changed: mpsc::UnboundedSender<String>,
        stop: CancellationToken,
    ) -> Self {
        let inner = Inner {
            etcd,
            prefix: format!("{}/instances/", layout.prefix()),
            runtime: tokio::runtime::Handle::current(),
            known: Mutex::default(),
            answered: Condvar::new(),
            changed,
            stop,
        };
        Self { inner: Arc::new(inner) }
    }
}

impl InstanceSource for FleetInstances {
    /// Blocks, at most [`FIRST_ANSWER`], until the name's first answer: renders run on
    /// blocking threads.
    fn instances(&self, name: &str) -> Result<Vec<Instance>, String> {
        let inner = &self.inner;
        let mut known = lock(&inner.known);
        if !known.contains_key(name) {
            known.insert(name.to_owned(), None);
            inner.runtime.spawn(watch(inner.clone(), name.to_owned()));
        }
        let deadline = std::time::Instant::now() + FIRST_ANSWER;
        loop {
            if let Some(Some(found)) = known.get(name) {
                return Ok(found.clone());
            }
            let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) else {
                return Err(format!(
                    "the fleet's instances of {name:?} are not known: etcd did not answer within {}",
                    humantime::format_duration(FIRST_ANSWER)
                ));
            };
            known = inner.answered.wait_timeout(known, left).unwrap_or_else(|poisoned| poisoned.into_inner()).0;
        }
    }
}

/// Follows `name`'s prefix until the source stops, reconnecting on its backoff; what was
/// last found stays known meanwhile.
async fn watch(inner: Arc<Inner>, name: String) {
    let mut backoff = etcd::RECONNECT;
    loop {
        let error = tokio::select! {
            () = inner.stop.cancelled() => return,
            Err(error) = follow(&inner, &name, &mut backoff) => error,
        };
        let wait = etcd::jittered(backoff.next());
        tracing::warn!(name = %name, error = %error, retry_in = ?wait, "cannot follow the fleet's instances");
        tokio::select! {
            () = inner.stop.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// Reads `name`'s instances, then reads them again on every change, until an error.
async fn follow(inner: &Inner, name: &str, backoff: &mut Backoff) -> Result<Infallible, String> {
    let prefix = format!("{}{name}/", inner.prefix);
    let error = |err: &dyn std::error::Error| crate::error::error_chain(err);
    let client = inner.etcd.connect().await.map_err(|err| error(&err))?;
    let range = client.get_prefix(&prefix).await.map_err(|err| error(&err))?;
    let revision = etcd::revision(range.header.as_ref());
    store(inner, name, &range.kvs);
    backoff.reset();
    let mut stream = client.watch_prefix(&prefix, revision + 1).await.map_err(|err| error(&err))?;
    loop {
        match stream.message().await.map_err(|err| error(&err))? {
            // Read whole again: one small prefix, and no event order to get right.
            Some(_) => {
                let range = client.get_prefix(&prefix).await.map_err(|err| error(&err))?;
                store(inner, name, &range.kvs);
            }
            None => return Err("etcd ended the watch".to_owned()),
        }
    }
}

/// Keeps what the keys under `name`'s prefix say, and tells the renderer if it changed.
fn store(inner: &Inner, name: &str, kvs: &[etcd::pb::KeyValue]) {
    let mut found: Vec<Instance> = kvs
        .iter()
        .filter_map(|kv| match serde_json::from_slice::<Instance>(&kv.value) {
            Ok(instance) => Some(instance),
            Err(err) => {
                let key = String::from_utf8_lossy(&kv.key);
                tracing::warn!(key = %key, error = %err, "skipping an instance key that is not an instance");
                None
            }
        })
        .collect();
    found.sort();
    let mut known = lock(&inner.known);
    let before = known.insert(name.to_owned(), Some(found.clone()));
    drop(known);
    inner.answered.notify_all();
    if before != Some(Some(found)) {
        let _ = inner.changed.send(name.to_owned());
    }
}
