//! The fleet's instances: the ready instances that every agent publishes under
//! `<prefix>/instances/<name>/<node>/<service id>`, read and then watched for each name that
//! a reader asks for (a template's `instances(name)`, an Envoy's upstream, a built-in proxy's
//! upstream), and only for those. An agent has one, which all of them share.
//!
//! This module owns one watching task per name, a cache of what each last found, and the
//! wake-ups that tell the renderer which names changed and the other readers that something
//! did. It writes nothing to etcd.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tether_state::lock;
use tokio::sync::{mpsc, watch};
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
    /// Bumped on every change, for the xDS server and the built-in proxies' upstreams.
    generation: watch::Sender<u64>,
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
            generation: watch::channel(0).0,
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
        let mut known = inner.learn(name);
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

    fn known(&self, name: &str) -> Option<Vec<Instance>> {
        self.inner.learn(name).get(name).cloned().flatten()
    }

    fn changes(&self) -> Option<watch::Receiver<u64>> {
        Some(self.inner.generation.subscribe())
    }
}

impl Inner {
    /// What is known, with a watch of `name` started if it had none.
    fn learn(self: &Arc<Self>, name: &str) -> std::sync::MutexGuard<'_, HashMap<String, Option<Vec<Instance>>>> {
        let mut known = lock(&self.known);
        if !known.contains_key(name) {
            known.insert(name.to_owned(), None);
            self.runtime.spawn(watch(self.clone(), name.to_owned()));
        }
        known
    }
}

/// Follows `name`'s prefix until the source stops; what was last found stays known while
/// etcd is away.
async fn watch(inner: Arc<Inner>, name: String) {
    let prefix = format!("{}{name}/", inner.prefix);
    etcd::follow_prefix(&inner.etcd, &prefix, "the fleet's instances", &inner.stop, |kvs| store(&inner, &name, kvs))
        .await;
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
        inner.generation.send_modify(|generation| *generation += 1);
    }
}
