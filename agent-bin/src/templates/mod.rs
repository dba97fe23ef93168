//! `[[service.proxy.template]]`: files of a proxy's that the agent renders from the catalog.
//!
//! [`Templates`] renders every template of a proxy before each of its starts (as the
//! backend's [`BeforeStart`], so that a template that cannot render fails the start, which
//! the engine retries on the restart backoff), and again, debounced by each template's
//! `wait`, after a change of the data it reads: any catalog change, and a change of the
//! readiness of a service that it lists with `instances`. A file whose bytes are unchanged
//! is not rewritten; a changed one triggers its `on_change`. A render error after the
//! first start keeps the last good file in place and the proxy running; the error is kept
//! here (shown in the proxy's status), told as a `template-failed` event and counted.
//!
//! It decides nothing about processes: a restart goes through the engine's
//! `ManagerHandle::restart`.

mod fleet;
mod render;
mod write;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::SystemTime;

use async_trait::async_trait;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use tether_manager::{ManagerHandle, ProxyEvent};
use tether_proxy_daemon::BeforeStart;
use tether_state::config::DisplayPath;
use tether_state::lock;
use tether_state::{Catalog, LocalState, ManagedProxy, OnChange, ProxyId, ReloadResult, Template, TemplateSource};
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub(crate) use render::InstanceSource;
pub(crate) use render::check_syntax;
use render::{Instance, RenderError, ServiceData, SharedData};
use write::{Owner, WriteError, Written};

use crate::etcd::{EtcdOptions, Layout};

/// Why one template of a proxy did not put its file in place.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TemplateError {
    /// Its `source` file could not be read.
    #[error("template {}: cannot read its source {}", DisplayPath(.destination), DisplayPath(.source_path))]
    Source { destination: PathBuf, source_path: PathBuf, source: std::io::Error },
    /// It did not render.
    #[error("template {}: {source}", DisplayPath(.destination))]
    Render { destination: PathBuf, source: RenderError },
    /// Its file could not be written.
    #[error("template {}", DisplayPath(.destination))]
    Write { destination: PathBuf, source: WriteError },
    /// The proxy's `user`, who owns the file, is not known.
    #[error("template {}: unknown user {user:?}", DisplayPath(.destination))]
    User { destination: PathBuf, user: String },
    /// Another proxy's template writes the same file (a config file and etcd, say, which
    /// are not validated together): the first to render keeps it.
    #[error("template {}: the file is also the destination of a template of {owner}, which keeps it", DisplayPath(.destination))]
    Taken { destination: PathBuf, owner: ProxyId },
    /// Its new file was refused by the proxy's reload check, and the previous one is back.
    #[error("template {}: the reload was refused, and the previous file is back: {reason}", DisplayPath(.destination))]
    Refused { destination: PathBuf, reason: String },
}

/// A template whose file changed: what it wrote, and what the file held before (`None`: no
/// file).
struct Changed {
    template: Template,
    written: Vec<u8>,
    previous: Option<Vec<u8>>,
}

/// What a render of a proxy's templates did: the files that changed, and the first error.
struct Rendering {
    changed: Vec<Changed>,
    error: Option<TemplateError>,
}

/// What happened to a template, as the events stream tells it.
#[derive(Debug, Clone)]
pub(crate) struct TemplateEvent {
    pub(crate) time: SystemTime,
    pub(crate) proxy: ProxyId,
    /// `template-rendered` (a new file is in place) or `template-failed`.
    pub(crate) event: &'static str,
    pub(crate) detail: String,
}

/// The agent's templates: the renderer behind the backend's start, the watcher of the data
/// they read, and what they tell (errors, events, counters). Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct Templates {
    shared: Arc<Shared>,
}

struct Shared {
    catalog: LocalState,
    node: Option<String>,
    /// The engine, once it exists: readiness for `instances`, restarts for `on_change`.
    manager: Arc<OnceLock<ManagerHandle>>,
    /// Where `instances(name)` looks.
    instances: Arc<dyn InstanceSource>,
    /// The names whose fleet instances changed, taken by [`Templates::run`]; `None` without
    /// a fleet.
    fleet_changes: Mutex<Option<mpsc::UnboundedReceiver<String>>>,
    /// Ends the fleet's watches with the renderer.
    fleet_stop: CancellationToken,
    board: Mutex<Board>,
    events: broadcast::Sender<TemplateEvent>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Templates").field("node", &self.node).finish_non_exhaustive()
    }
}

/// A template's last render: when, what it did (`rendered`, `unchanged` or `failed`), and
/// its error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LastRender {
    pub(crate) at: SystemTime,
    pub(crate) result: &'static str,
    pub(crate) error: Option<String>,
}

#[derive(Default)]
struct Board {
    /// The last render of each template, by proxy and destination.
    last: HashMap<ProxyId, BTreeMap<PathBuf, LastRender>>,
    /// Renders by proxy and result.
    renders: BTreeMap<(ProxyId, &'static str), u64>,
    /// The service names each template asked `instances` for, at its last render.
    instances_of: HashMap<(ProxyId, PathBuf), BTreeSet<String>>,
    /// The destinations whose directory was cleared of an earlier agent's temporaries.
    swept: HashSet<PathBuf>,
    /// The proxy that writes each destination: the first to render it, while it wants it.
    writers: HashMap<PathBuf, ProxyId>,
}

impl Templates {
    /// Templates of the proxies of `catalog`: `instances` from the fleet of `fleet` (etcd
    /// and the node's layout, `--node`) when the agent follows one, else from `catalog`.
    /// Inside a tokio runtime.
    pub(crate) fn new(catalog: LocalState, fleet: Option<(EtcdOptions, &Layout)>) -> Self {
        let (events, _) = broadcast::channel(256);
        let manager: Arc<OnceLock<ManagerHandle>> = Arc::default();
        let node = fleet.as_ref().map(|(_, layout)| layout.node().to_owned());
        let fleet_stop = CancellationToken::new();
        let (instances, fleet_changes): (Arc<dyn InstanceSource>, _) = match fleet {
            Some((etcd, layout)) => {
                let (changed, changes) = mpsc::unbounded_channel();
                (Arc::new(fleet::FleetInstances::new(etcd, layout, changed, fleet_stop.clone())), Some(changes))
            }
            None => {
                let local = LocalInstances { catalog: catalog.clone(), node: node.clone(), manager: manager.clone() };
                (Arc::new(local), None)
            }
        };
        let shared = Shared {
            catalog,
            node,
            manager,
            instances,
            fleet_changes: Mutex::new(fleet_changes),
            fleet_stop,
            board: Mutex::new(Board::default()),
            events,
        };
        Self { shared: Arc::new(shared) }
    }

    /// Where the ready instances of a service are found: the fleet's, when the agent follows
    /// etcd, else its own catalog's. The one source of the agent, for the xDS server and the
    /// built-in proxies' upstreams too.
    pub(crate) fn instances(&self) -> Arc<dyn InstanceSource> {
        self.shared.instances.clone()
    }

    /// Gives the templates the engine: before it, every proxy counts as not ready.
    pub(crate) fn set_manager(&self, manager: ManagerHandle) {
        let _ = self.shared.manager.set(manager);
    }

    /// The error of a proxy's templates, if one failed at its last render.
    pub(crate) fn error(&self, proxy: &ProxyId) -> Option<String> {
        lock(&self.shared.board).last.get(proxy).and_then(|last| last.values().find_map(|render| render.error.clone()))
    }

    /// The last render of each of a proxy's templates, by destination; empty before its first.
    pub(crate) fn last_renders(&self, proxy: &ProxyId) -> Vec<(PathBuf, LastRender)> {
        let board = lock(&self.shared.board);
        board
            .last
            .get(proxy)
            .map(|last| last.iter().map(|(path, render)| (path.clone(), render.clone())).collect())
            .unwrap_or_default()
    }

    /// Template events from now on.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<TemplateEvent> {
        self.shared.events.subscribe()
    }

    /// The metrics of renders.
    pub(crate) fn collector(&self) -> Box<dyn Collector> {
        Box::new(RenderCollector(self.clone()))
    }

    /// Renders every template of `proxy` and puts each file in place; one that fails does
    /// not keep the others from rendering. Returns the templates whose files changed, each
    /// with what its file held before, and the first error.
    fn render_proxy(&self, proxy: &ManagedProxy) -> Rendering {
        let templates = &proxy.spec().templates;
        self.forget_other_templates(proxy.id(), templates);
        let mut rendering = Rendering { changed: Vec::new(), error: None };
        if templates.is_empty() {
            return rendering;
        }
        let shared = SharedData {
            node: self.shared.node.clone(),
            services: {
                let mut services: Vec<ServiceData> =
                    self.shared.catalog.entries().iter().map(|e| ServiceData::from(&*e.service)).collect();
                services.sort_by(|a, b| a.id.cmp(&b.id));
                services
            },
        };
        let service = ServiceData::from(proxy.service());
        for template in templates {
            match self.render_one(proxy, template, &service, &shared) {
                Ok((Written::Replaced { previous }, written)) => {
                    self.record(proxy.id(), template, "rendered", None);
                    rendering.changed.push(Changed { template: template.clone(), written, previous });
                }
                Ok((Written::Unchanged, _)) => self.record(proxy.id(), template, "unchanged", None),
                Err(error) => {
                    self.record(proxy.id(), template, "failed", Some(&error));
                    rendering.error.get_or_insert(error);
                }
            }
        }
        rendering
    }

    /// Forgets what is kept of a proxy's templates that it no longer has (its config
    /// changed), so that a stale error is never shown.
    fn forget_other_templates(&self, proxy: &ProxyId, templates: &[Template]) {
        let kept = |destination: &Path| templates.iter().any(|t| t.destination == destination);
        let mut board = lock(&self.shared.board);
        if let Some(last) = board.last.get_mut(proxy) {
            last.retain(|destination, _| kept(destination));
            if last.is_empty() {
                board.last.remove(proxy);
            }
        }
        board.instances_of.retain(|(id, destination), _| id != proxy || kept(destination));
    }

    /// Forgets the errors and names kept of proxies that left the catalog.
    fn forget_gone(&self) {
        // Asked of the catalog for each proxy the board knows (those with templates), not by a
        // copy of the catalog: this runs on every change of it.
        let catalog = &self.shared.catalog;
        let mut board = lock(&self.shared.board);
        board.last.retain(|id, _| catalog.has_proxy(id));
        board.instances_of.retain(|(id, _), _| catalog.has_proxy(id));
        board.writers.retain(|_, id| catalog.has_proxy(id));
    }

    /// Makes `proxy` the writer of `destination`, unless another proxy that still has a
    /// template there writes it.
    fn claim(&self, proxy: &ManagedProxy, destination: &Path) -> Result<(), TemplateError> {
        let mut board = lock(&self.shared.board);
        if let Some(owner) = board.writers.get(destination).filter(|owner| *owner != proxy.id()) {
            let still_writes = self
                .shared
                .catalog
                .get(&owner.service_id())
                .and_then(|entry| entry.proxy)
                .is_some_and(|other| other.spec().templates.iter().any(|t| t.destination == destination));
            if still_writes {
                return Err(TemplateError::Taken { destination: destination.to_owned(), owner: owner.clone() });
            }
        }
        board.writers.insert(destination.to_owned(), proxy.id().clone());
        Ok(())
    }

    fn render_one(
        &self,
        proxy: &ManagedProxy,
        template: &Template,
        service: &ServiceData,
        shared: &SharedData,
    ) -> Result<(Written, Vec<u8>), TemplateError> {
        let destination = template.destination.clone();
        self.claim(proxy, &destination)?;
        let text = match &template.source {
            TemplateSource::Inline(text) => std::borrow::Cow::Borrowed(text.as_str()),
            TemplateSource::File(path) => match std::fs::read_to_string(path) {
                Ok(text) => std::borrow::Cow::Owned(text),
                Err(source) => return Err(TemplateError::Source { destination, source_path: path.clone(), source }),
            },
        };
        let name = destination.to_string_lossy();
        let rendered = render::render(&name, &text, service, shared, self.shared.instances.clone(), template.max_size)
            .map_err(|source| TemplateError::Render { destination: destination.clone(), source })?;
        lock(&self.shared.board).instances_of.insert((proxy.id().clone(), destination.clone()), rendered.instances_of);
        let owner = owner(proxy).map_err(|user| TemplateError::User { destination: destination.clone(), user })?;
        if lock(&self.shared.board).swept.insert(destination.clone()) {
            // A crash between a write and its rename leaves a temporary beside the file.
            for path in tether_state::persist::remove_abandoned_temporaries(&destination).unwrap_or_default() {
                tracing::info!(path = %DisplayPath(&path), "removed a temporary file that an earlier agent's crash left");
            }
        }
        let written = write::write_if_changed(&destination, rendered.text.as_bytes(), template.mode, owner)
            .map_err(|source| TemplateError::Write { destination, source })?;
        Ok((written, rendered.text.into_bytes()))
    }

    /// Counts a render, keeps or clears its error, and tells of a new file or a failure.
    fn record(&self, proxy: &ProxyId, template: &Template, result: &'static str, error: Option<&TemplateError>) {
        let mut board = lock(&self.shared.board);
        *board.renders.entry((proxy.clone(), result)).or_default() += 1;
        let text = error.map(|error| crate::error::error_chain(error));
        let last = LastRender { at: SystemTime::now(), result, error: text.clone() };
        board.last.entry(proxy.clone()).or_default().insert(template.destination.clone(), last);
        let event = match text {
            Some(text) => {
                tracing::warn!(proxy = %proxy, destination = %DisplayPath(&template.destination), error = %text, "template failed");
                Some(("template-failed", text))
            }
            None => (result == "rendered").then(|| {
                tracing::info!(proxy = %proxy, destination = %DisplayPath(&template.destination), "template rendered");
                ("template-rendered", DisplayPath(&template.destination).to_string())
            }),
        };
        drop(board);
        if let Some((event, detail)) = event {
            let _ =
                self.shared.events.send(TemplateEvent { time: SystemTime::now(), proxy: proxy.clone(), event, detail });
        }
    }

    /// Re-renders templates after changes of their data until `stop` is cancelled.
    ///
    /// # Cancel safety
    ///
    /// Meant to run as a task of its own; restarts it asked for are aborted with it.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let _fleet_stop = self.shared.fleet_stop.clone().drop_guard();
        let Some(manager) = self.shared.manager.get().cloned() else { return };
        let mut fleet_changes = tether_state::lock(&self.shared.fleet_changes).take();
        let mut catalog = self.shared.catalog.subscribe();
        let mut statuses = manager.subscribe();
        let mut ready: HashMap<ProxyId, bool> =
            manager.status_unmeasured().into_iter().map(|status| (status.id.clone(), status.ready())).collect();
        let mut due: HashMap<(ProxyId, PathBuf), Instant> = HashMap::new();
        let mut restarts = JoinSet::new();
        // Proxies adopted from an earlier agent did not start here: their files are checked now.
        self.mark_all(&mut due);
        loop {
            let next = due.values().min().copied();
            tokio::select! {
                () = stop.cancelled() => return,
                changed = catalog.changed() => {
                    if changed.is_none() {
                        return;
                    }
                    // Every template sees `service` and `services`.
                    self.mark_all(&mut due);
                    self.forget_gone();
                }
                event = statuses.recv() => match event {
                    Ok(ProxyEvent::Changed(status)) => {
                        let now_ready = status.ready();
                        if ready.insert(status.id.clone(), now_ready) != Some(now_ready) {
                            let name = self.shared.catalog.get(&status.service).map(|e| e.service.name.as_str().to_owned());
                            if let Some(name) = name {
                                self.mark_asking(&mut due, |names| names.contains(&name));
                            }
                        }
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        ready = manager.status_unmeasured().into_iter().map(|status| (status.id.clone(), status.ready())).collect();
                        self.mark_asking(&mut due, |names| !names.is_empty());
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                () = sleep_until(next) => {
                    let now = Instant::now();
                    let ready_now: BTreeSet<ProxyId> =
                        due.iter().filter(|(_, at)| **at <= now).map(|((proxy, _), _)| proxy.clone()).collect();
                    due.retain(|_, at| *at > now);
                    for proxy in ready_now {
                        self.rerender(&manager, &proxy, &mut restarts).await;
                    }
                }
                Some(name) = async { fleet_changes.as_mut()?.recv().await }, if fleet_changes.is_some() => {
                    self.mark_asking(&mut due, |names| names.contains(&name));
                }
                Some(_) = restarts.join_next(), if !restarts.is_empty() => {}
            }
        }
    }

    /// Sets a render time, `wait` from now, for every template of the catalog that has none
    /// yet: changes within the window render once.
    fn mark_all(&self, due: &mut HashMap<(ProxyId, PathBuf), Instant>) {
        let now = Instant::now();
        // Only the proxies with templates are copied out of the catalog: this runs on every
        // change of it, and most proxies have none.
        for proxy in self.shared.catalog.proxies_where(|proxy| !proxy.spec().templates.is_empty()) {
            for template in &proxy.spec().templates {
                due.entry((proxy.id().clone(), template.destination.clone())).or_insert(now + template.wait);
            }
        }
    }

    /// [`Templates::mark_all`] for the templates whose last render asked `instances` for
    /// names that `select` picks. Only those are looked at, not the catalog: a readiness
    /// change of each proxy of a bring-up would otherwise walk every proxy, a cost that
    /// grows with the square of their number.
    fn mark_asking(&self, due: &mut HashMap<(ProxyId, PathBuf), Instant>, select: impl Fn(&BTreeSet<String>) -> bool) {
        let now = Instant::now();
        let board = lock(&self.shared.board);
        for (key, names) in &board.instances_of {
            if !select(names) || due.contains_key(key) {
                continue;
            }
            let (proxy_id, destination) = key;
            let proxy = self.shared.catalog.get(&proxy_id.service_id()).and_then(|entry| entry.proxy);
            let Some(proxy) = proxy.filter(|proxy| proxy.id() == proxy_id) else { continue };
            if let Some(template) = proxy.spec().templates.iter().find(|template| template.destination == *destination)
            {
                due.insert(key.clone(), now + template.wait);
            }
        }
    }

    /// Renders the templates of `proxy` again and, when a file changed while it runs, does
    /// what that file's `on_change` asks: a restart (which reads every file) wins over a
    /// reload; a refused reload puts the previous files back.
    async fn rerender(&self, manager: &ManagerHandle, proxy_id: &ProxyId, restarts: &mut JoinSet<()>) {
        let Some(proxy) = self.shared.catalog.get(&proxy_id.service_id()).and_then(|entry| entry.proxy) else {
            return;
        };
        let this = self.clone();
        let rendering = proxy.clone();
        let rendered = tokio::task::spawn_blocking(move || this.render_proxy(&rendering)).await;
        // The files that did change act even when a sibling failed: its error is kept.
        let Ok(Rendering { changed, .. }) = rendered else { return };
        if changed.is_empty() {
            return;
        }
        let running = manager.proxy(proxy_id).is_some_and(|status| status.figures.pid.is_some());
        if !running {
            return;
        }
        let restart = changed.iter().any(|change| change.template.on_change == OnChange::Restart);
        let reloaded: Vec<_> =
            changed.into_iter().filter(|change| change.template.on_change == OnChange::Reload).collect();
        let manager = manager.clone();
        let id = proxy_id.clone();
        if restart {
            restarts.spawn(async move {
                tracing::info!(proxy = %id, "a template's file changed: restarting the proxy");
                if let Err(err) = manager.restart(&id).await {
                    tracing::warn!(proxy = %id, error = %err, "restart after a template change failed");
                }
            });
        } else if !reloaded.is_empty() {
            let this = self.clone();
            restarts.spawn(async move {
                tracing::info!(proxy = %id, "a template's file changed: reloading the proxy");
                match manager.reload(&id).await {
                    Ok(outcome) if outcome.result == ReloadResult::Refused => {
                        let reason = outcome.error.unwrap_or_else(|| "its check failed".to_owned());
                        let _ = tokio::task::spawn_blocking(move || this.put_back(&proxy, reloaded, &reason)).await;
                    }
                    Ok(outcome) if !outcome.result.succeeded() => {
                        let error = outcome.error.unwrap_or_default();
                        tracing::warn!(proxy = %id, result = %outcome.result, error = %error, "reload after a template change did not apply");
                    }
                    Ok(_) => {}
                    Err(err) => tracing::warn!(proxy = %id, error = %err, "reload after a template change failed"),
                }
            });
        }
    }

    /// Puts back the files that a refused reload was asked for (unless a newer render
    /// replaced one meanwhile), and says why on each.
    fn put_back(&self, proxy: &ManagedProxy, changes: Vec<Changed>, reason: &str) {
        let owner = owner(proxy).ok().flatten();
        for Changed { template, written, previous } in changes {
            let destination = template.destination.clone();
            let refused = |destination| TemplateError::Refused { destination, reason: reason.to_owned() };
            let error = match previous {
                Some(previous) => match write::put_back(&destination, &written, &previous, template.mode, owner) {
                    Ok(_) => refused(destination),
                    Err(source) => TemplateError::Write { destination, source },
                },
                // There was no file before this one: nothing to put back, and the refusal stands.
                None => refused(destination),
            };
            self.record(proxy.id(), &template, "failed", Some(&error));
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The owner of a proxy's rendered files: its `user` when the agent runs as root; `Err`
/// with the name when that user is unknown.
fn owner(proxy: &ManagedProxy) -> Result<Owner, String> {
    let Some(user) = &proxy.spec().user else { return Ok(None) };
    if !nix::unistd::geteuid().is_root() {
        return Ok(None);
    }
    let found = match user.parse::<u32>() {
        Ok(uid) => nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)),
        Err(_) => nix::unistd::User::from_name(user),
    };
    match found {
        Ok(Some(found)) => Ok(Some((found.uid, found.gid))),
        _ => Err(user.clone()),
    }
}

#[async_trait]
impl BeforeStart for Templates {
    async fn before_start(&self, proxy: Arc<ManagedProxy>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        if proxy.spec().templates.is_empty() {
            return Ok(());
        }
        let this = self.clone();
        match tokio::task::spawn_blocking(move || this.render_proxy(&proxy)).await {
            Ok(Rendering { error: None, .. }) => Ok(()),
            Ok(Rendering { error: Some(error), .. }) => Err(Box::new(error)),
            Err(join) => Err(Box::new(join)),
        }
    }
}

/// `instances(name)` from this agent's own catalog: each service named `name` that has no
/// proxy, or whose proxy is `running`. An agent that follows etcd reads the fleet's instead
/// ([`fleet::FleetInstances`]).
struct LocalInstances {
    catalog: LocalState,
    node: Option<String>,
    /// The engine, for readiness, once it exists.
    manager: Arc<OnceLock<ManagerHandle>>,
}

impl InstanceSource for LocalInstances {
    fn instances(&self, name: &str) -> Result<Vec<Instance>, String> {
        let manager = self.manager.get();
        Ok(self
            .catalog
            .entries()
            .iter()
            .filter(|entry| entry.service.name.as_str() == name)
            .filter(|entry| match &entry.proxy {
                None => true,
                Some(proxy) => manager.and_then(|m| m.proxy(proxy.id())).is_some_and(|status| status.ready()),
            })
            .map(|entry| Instance::of(self.node.as_deref(), entry))
            .collect())
    }
}

/// `tether_template_renders_total{proxy, result}`.
#[derive(Debug)]
struct RenderCollector(Templates);

impl Collector for RenderCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let renders = lock(&self.0.shared.board).renders.clone();
        let counter = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
            "tether_template_renders",
            "Renders of a proxy's templates, by result: rendered (a new file), unchanged, failed",
            None,
            counter.metric_type(),
        )?;
        for ((proxy, result), count) in &renders {
            let labels = [("proxy", proxy.as_str()), ("result", *result)];
            ConstCounter::new(*count).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
