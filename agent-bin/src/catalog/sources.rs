//! The agent's sources of services — config dirs and API registrations — merged into one
//! `LocalState`, with registrations and tokens persisted under the data dir.
//!
//! This module applies policy at the catalog's door (the settings the API may not make,
//! which `policy` defines; config-vs-API ownership) and keeps the catalog and the data dir
//! in step. It never starts a process.
//!
//! An API registration is written to disk, with its proxy's token, before it enters the
//! catalog: the engine acts on a change at once, and must never start a proxy that is not
//! durably registered, or whose token a crash could lose. The client is answered once the
//! registration is durable and in the catalog; a failed write changes nothing.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tether_state::config::{ConfigErrors, ConfigFile, ConfigLoader, ConnectSection, DisplayPath, LoadStats};
use tether_state::lock;
use tether_state::persist::{DataDir, LoadedRegistrations, PersistError};
use tether_state::{
    CatalogError, DependsOn, Intention, Intentions, LocalState, ProxyId, ProxyToken, ReplaceReport, Service, ServiceId,
    Source, SourceKind, cycle_text, dependency_cycles,
};

use super::policy::{self, ApiSetting};

/// Why a registration or deregistration was refused. Nothing was changed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RegisterError {
    /// The body sets what runs or how (`command`, `user`, `working_dir`, `inherit_env`, a
    /// loader variable in `env`) and the agent does not allow API commands (HTTP 403).
    #[error(
        "{}the register API may not set `{setting}`{} unless the agent runs with --allow-api-commands",
        id.as_ref().map(|id| format!("service {id}: ")).unwrap_or_default(),
        setting.note()
    )]
    CommandRefused {
        /// The service, when the body names a valid id.
        id: Option<ServiceId>,
        /// The first refused setting.
        setting: ApiSetting,
    },
    /// Its `depends_on` closes a dependency cycle with services of the catalog (400).
    #[error("service {id}: field `proxy.depends_on`: dependency cycle: {cycle}")]
    Cycle {
        /// The service.
        id: ServiceId,
        /// The cycle, as `a-proxy -> b-proxy -> a-proxy`.
        cycle: String,
    },
    /// The catalog refused it: conflict with a config file (409) or unknown id (404).
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// The data dir could not be written (500): the catalog is as it was before the
    /// request.
    #[error("service {id} was not changed: cannot persist the registration")]
    Persist {
        /// The service.
        id: ServiceId,
        /// Why.
        #[source]
        source: PersistError,
    },
}

/// Why a reload was refused. The previous config stays in force.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReloadError {
    /// A config file is invalid.
    #[error(transparent)]
    Config(#[from] ConfigErrors),
    /// The new config takes a service id that an API registration owns.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// The new `[connect]` table's certificate authority cannot be loaded.
    #[error(transparent)]
    Connect(Box<dyn std::error::Error + Send + Sync>),
}

/// What a successful reload did.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReloadReport {
    /// What changed in the catalog.
    pub(crate) catalog: ReplaceReport,
    /// Which config files were read again and which were unchanged.
    pub(crate) files: LoadStats,
}

/// The catalog and the files behind it.
pub(crate) struct Sources {
    state: LocalState,
    data: DataDir,
    /// The config dirs and the files behind the catalog's config services; one reload at a
    /// time.
    config: Mutex<ConfigState>,
    allow_api_commands: bool,
    /// Held while an API registration or deregistration changes the catalog and the data
    /// dir, so that a rollback never undoes another request's change.
    api_changes: Mutex<()>,
    /// The tokens last written to `tokens.json`. Held while a snapshot of the catalog's
    /// tokens is taken and written, so that an older snapshot never overwrites a newer one.
    saved_tokens: Mutex<Option<BTreeMap<ProxyId, ProxyToken>>>,
    /// The `tokens.json` write that follows API registrations ([`Sources::save_tokens_soon`]).
    tokens_soon: Mutex<TokensSoon>,
    /// The `[connect]` table and intentions of the config applied.
    connect: Mutex<ConnectSection>,
    /// The fleet's intentions, each with its etcd key, as last read (none without a fleet).
    fleet_intentions: Mutex<Vec<(Intention, String)>>,
    /// The intentions in force: the config files' merged with the fleet's ([`merge`]).
    intentions: Mutex<Arc<Intentions>>,
    /// Bumped whenever the intentions in force or their default change (a reload, the
    /// fleet's keys), for the blocking queries of the built-in proxies, which close the
    /// connections that a change denies.
    intentions_index: tokio::sync::watch::Sender<u64>,
}

/// The intentions in force: the config files' rules and, after them, the fleet's, with the
/// files' default. A source and destination pair that both define is the files' (the node's
/// own word); the fleet's rule is left out, with a warning naming its key. Between pairs,
/// the most precise rule decides, wherever it came from.
fn merge(section: &ConnectSection, fleet: &[(Intention, String)]) -> Intentions {
    let files = section.intentions();
    let mut rules = files.rules().to_vec();
    for (rule, key) in fleet {
        let same_pair = |own: &Intention| own.source() == rule.source() && own.destination() == rule.destination();
        if let Some(own) = files.rules().iter().find(|own| same_pair(own)) {
            let file = section.intention_file(own).map(DisplayPath).map(|path| path.to_string()).unwrap_or_default();
            tracing::warn!(%key, %file, rule = %rule, "an intention of the config files decides this pair; the fleet's key is left out");
            continue;
        }
        rules.push(rule.clone());
    }
    // The files' pairs are unique, and so are etcd's keys, so no pair repeats.
    Intentions::new(rules, files.default_action()).unwrap_or_else(|_| files.clone())
}

/// The config side of the catalog.
struct ConfigState {
    loader: ConfigLoader,
    /// The files whose services the catalog holds, by path: those of the last config
    /// applied. Only reloads change the catalog's config services (the API and other
    /// sources cannot take their ids), so these are exactly the catalog's.
    applied: HashMap<PathBuf, ConfigFile>,
}

/// How the catalog's config services differ from a new set of config files: the services
/// to put in place (new, changed, or moved to another file) and the ids gone from every
/// file.
struct ConfigDelta<'a> {
    upserts: Vec<(&'a Arc<Service>, &'a Path)>,
    removals: Vec<ServiceId>,
}

/// Compares `files` with the files behind the catalog's config services. Files that were
/// not read again are skipped without looking at their services.
fn config_delta<'a>(applied: &'a HashMap<PathBuf, ConfigFile>, files: &'a [ConfigFile]) -> ConfigDelta<'a> {
    let mut before: HashMap<&ServiceId, (&Arc<Service>, &Path)> = HashMap::new();
    let mut after: HashMap<&ServiceId, (&Arc<Service>, &Path)> = HashMap::new();
    let mut present = HashSet::new();
    for file in files {
        present.insert(file.path());
        match applied.get(file.path()) {
            Some(old) if old.same_read(file) => continue,
            Some(old) => before.extend(old.services().iter().map(|service| (&service.id, (service, old.path())))),
            None => {}
        }
        after.extend(file.services().iter().map(|service| (&service.id, (service, file.path()))));
    }
    for (path, old) in applied {
        if !present.contains(path.as_path()) {
            before.extend(old.services().iter().map(|service| (&service.id, (service, old.path()))));
        }
    }
    // Ids are unique across all files (the loader refuses duplicates), so a service in a
    // file that was not read again appears in neither map.
    let upserts = after.iter().filter(|(id, now)| before.get(*id) != Some(*now)).map(|(_, now)| *now).collect();
    let removals = before.keys().filter(|id| !after.contains_key(*id)).map(|id| (*id).clone()).collect();
    ConfigDelta { upserts, removals }
}

impl Sources {
    /// Loads tokens, config dirs and registrations, in that order, into a new catalog.
    ///
    /// # Errors
    ///
    /// Every config error ([`ConfigErrors`]): the agent must not start on an invalid config.
    pub(crate) fn open(
        data: DataDir,
        config_dirs: Vec<PathBuf>,
        allow_api_commands: bool,
    ) -> Result<Self, ConfigErrors> {
        let tokens = data.tokens().load();
        if let Some(damaged) = &tokens.damaged {
            tracing::warn!(path = %DisplayPath(&damaged.path), problem = %damaged.problem, "token file damaged; proxies get new tokens");
        }
        // Read now, entered after the config: a registration's file holds its proxy's token
        // when it was written before `tokens.json` was (a crash between the two), and that
        // token is the one its running proxy has.
        let registrations = data.registrations().load();
        let mut restored = tokens.tokens;
        if let Ok(loaded) = &registrations {
            restored.extend(loaded.tokens.iter().map(|(proxy, token)| (proxy.clone(), token.clone())));
        }
        let sources = Self {
            state: LocalState::with_tokens(restored),
            data,
            config: Mutex::new(ConfigState { loader: ConfigLoader::new(config_dirs), applied: HashMap::new() }),
            allow_api_commands,
            api_changes: Mutex::new(()),
            saved_tokens: Mutex::new(None),
            tokens_soon: Mutex::default(),
            connect: Mutex::new(ConnectSection::default()),
            fleet_intentions: Mutex::default(),
            intentions: Mutex::default(),
            intentions_index: tokio::sync::watch::channel(1).0,
        };
        {
            let mut config = lock(&sources.config);
            // `[connect]` and the intentions are checked with the rest of the files; the
            // catalog takes only the services, and the agent the CA (`connect_section`).
            let loaded = config.loader.load_files()?;
            *lock(&sources.intentions) = Arc::new(loaded.connect.intentions().clone());
            *lock(&sources.connect) = loaded.connect;
            if let Err(err) = sources.apply_config(&mut config.applied, loaded.files) {
                // The loader already refused duplicates; a token failure is all that is left.
                tracing::error!(error = %crate::error::error_chain(&err), "cannot load the config into the catalog");
            }
        }
        sources.load_registrations(registrations);
        sources.save_tokens();
        Ok(sources)
    }

    fn load_registrations(&self, registrations: Result<LoadedRegistrations, PersistError>) {
        let loaded = match registrations {
            Ok(loaded) => loaded,
            Err(err) => {
                tracing::error!(error = %crate::error::error_chain(&err), "cannot read API registrations");
                return;
            }
        };
        for damaged in &loaded.damaged {
            tracing::warn!(path = %DisplayPath(&damaged.path), problem = %damaged.problem, "registration damaged and moved aside");
        }
        for service in loaded.services {
            let id = service.id.clone();
            if let Err(err) = self.check_command_policy(&service) {
                tracing::error!(service = %id, error = %err, "persisted registration not loaded");
                continue;
            }
            if let Err(err) = self.state.upsert(service, Source::Api) {
                tracing::error!(service = %id, error = %crate::error::error_chain(&err), "persisted registration not loaded");
            }
        }
    }

    /// The catalog, for the engine and the API.
    pub(crate) fn state(&self) -> &LocalState {
        &self.state
    }

    /// The data dir.
    pub(crate) fn data(&self) -> &DataDir {
        &self.data
    }

    /// The `[connect]` table and the intentions of the config in force.
    pub(crate) fn connect_section(&self) -> ConnectSection {
        lock(&self.connect).clone()
    }

    /// The intentions in force: the config files' and the fleet's, merged.
    pub(crate) fn intentions(&self) -> Arc<Intentions> {
        lock(&self.intentions).clone()
    }

    /// Puts the fleet's intentions (each with its key) in force beside the config files'.
    pub(crate) fn set_fleet_intentions(&self, rules: Vec<(Intention, String)>) {
        *lock(&self.fleet_intentions) = rules;
        self.merge_intentions();
    }

    /// Merges the files' intentions and the fleet's again, and bumps the index if that
    /// changed what is in force.
    fn merge_intentions(&self) {
        let merged = merge(&lock(&self.connect), &lock(&self.fleet_intentions));
        let mut current = lock(&self.intentions);
        if current.rules() != merged.rules() || current.default_action() != merged.default_action() {
            *current = Arc::new(merged);
            drop(current);
            self.intentions_index.send_modify(|index| *index += 1);
        }
    }

    /// The index of the intentions in force, bumped by every change of them.
    pub(crate) fn intentions_index(&self) -> tokio::sync::watch::Receiver<u64> {
        self.intentions_index.subscribe()
    }

    /// Re-reads the config dirs; only the files that changed are parsed again. All or
    /// nothing: on any error every error is logged and the previous config stays in force.
    /// The agent reloads through [`Sources::reload_with`], which also loads the CA.
    #[cfg(test)]
    pub(crate) fn reload(&self) -> Result<ReloadReport, ReloadError> {
        self.reload_with(|_| Ok::<(), ReloadError>(())).map(|(report, ())| report)
    }

    /// Re-reads the config dirs, as the reload above, with `prepare` run on the new
    /// `[connect]` table before anything changes (the agent loads the CA there): its error
    /// refuses the reload whole, logged like any other. Its result is returned beside the
    /// report, for the caller to put in force.
    pub(crate) fn reload_with<T, E>(
        &self,
        prepare: impl FnOnce(&ConnectSection) -> Result<T, E>,
    ) -> Result<(ReloadReport, T), ReloadError>
    where
        E: Into<ReloadError>,
    {
        let mut config = lock(&self.config);
        let loaded = config.loader.load_files();
        let files = config.loader.last_stats();
        let loaded = loaded.inspect_err(|errors| {
            // One event per error, so that each log line names one file.
            for error in errors {
                tracing::error!(error = %crate::error::error_chain(error), "config reload refused");
            }
        })?;
        let prepared = prepare(&loaded.connect).map_err(Into::into).inspect_err(|err| {
            tracing::error!(error = %crate::error::error_chain(err), "config reload refused");
        })?;
        let catalog = self.apply_config(&mut config.applied, loaded.files).inspect_err(|err| {
            // A config service that an API registration owns: the registration stays.
            tracing::error!(error = %crate::error::error_chain(err), "config reload refused");
        })?;
        *lock(&self.connect) = loaded.connect;
        self.merge_intentions();
        drop(config);
        self.save_tokens();
        Ok((ReloadReport { catalog, files }, prepared))
    }

    /// Makes the catalog's config services those of `files`, atomically, and remembers
    /// `files` as applied. Only the services of the files that changed reach the catalog.
    ///
    /// # Errors
    ///
    /// [`CatalogError`]; the catalog and `applied` are then unchanged.
    fn apply_config(
        &self,
        applied: &mut HashMap<PathBuf, ConfigFile>,
        files: Vec<ConfigFile>,
    ) -> Result<ReplaceReport, CatalogError> {
        let delta = config_delta(applied, &files);
        let upserts = delta
            .upserts
            .into_iter()
            // The loader's own services, shared: the catalog keeps the same values.
            .map(|(service, file)| (Arc::clone(service), Source::Config { file: file.to_owned() }))
            .collect();
        let report = self.state.change_source(&SourceKind::Config, upserts, &delta.removals)?;
        *applied = files.into_iter().map(|file| (file.path().to_owned(), file)).collect();
        Ok(report)
    }

    fn check_command_policy(&self, service: &Service) -> Result<(), RegisterError> {
        if self.allow_api_commands {
            return Ok(());
        }
        match policy::refused_setting(service) {
            Some(setting) => Err(RegisterError::CommandRefused { id: Some(service.id.clone()), setting }),
            None => Ok(()),
        }
    }

    /// Refuses a register body that makes a setting the API may not make, before the body
    /// is validated: whoever may not set `command` learns that, not what is wrong with the
    /// value. [`Sources::register`] checks the parsed service again.
    ///
    /// # Errors
    ///
    /// [`RegisterError::CommandRefused`].
    pub(crate) fn check_register_body(&self, text: &str) -> Result<(), RegisterError> {
        if self.allow_api_commands {
            return Ok(());
        }
        match policy::refused_in_body(text) {
            Some((id, setting)) => Err(RegisterError::CommandRefused { id, setting }),
            None => Ok(()),
        }
    }

    /// Registers (or replaces) a service through the API and persists it. Returns once the
    /// registration is durable; a new proxy's token is then durable in the registration's
    /// file, and `tokens.json`, with every proxy's token, follows with
    /// [`Sources::save_tokens`], which the caller runs once it has answered.
    ///
    /// # Errors
    ///
    /// [`RegisterError`]; the catalog and the registrations on disk are then as they were.
    pub(crate) fn register(&self, service: Service) -> Result<(), RegisterError> {
        self.check_command_policy(&service)?;
        let _api = lock(&self.api_changes);
        self.check_cycle(&service)?;
        let id = service.id.clone();
        match self.state.get(&id) {
            Some(entry) if entry.source.kind() != SourceKind::Api => {
                return Err(CatalogError::Conflict { id, owner: entry.source, requested: SourceKind::Api }.into());
            }
            Some(entry) => self.replace_registration(service, &entry.service)?,
            None => self.add_registration(service)?,
        }
        tracing::info!(service = %id, "service registered");
        Ok(())
    }

    /// Refuses `service` when its `depends_on` closes a cycle with what the catalog holds.
    /// Only proxies with a `depends_on` can be on a cycle, so a service without one costs
    /// nothing.
    fn check_cycle(&self, service: &Service) -> Result<(), RegisterError> {
        let Some(proxy) = service.proxy.as_ref().filter(|proxy| !proxy.depends_on.is_empty()) else { return Ok(()) };
        let entries = self.state.entries();
        let mut proxies: Vec<(ProxyId, &DependsOn)> = vec![(service.id.proxy_id(), &proxy.depends_on)];
        for entry in &entries {
            if entry.service.id == service.id {
                continue;
            }
            if let Some(other) = entry.service.proxy.as_ref() {
                proxies.push((entry.service.id.proxy_id(), &other.depends_on));
            }
        }
        let own = service.id.proxy_id();
        match dependency_cycles(&proxies).into_iter().find(|cycle| cycle.contains(&own)) {
            Some(cycle) => Err(RegisterError::Cycle { id: service.id.clone(), cycle: cycle_text(&cycle) }),
            None => Ok(()),
        }
    }

    /// A new service: to disk first, its registration and its proxy's token, so that the
    /// engine, which acts on a change at once, never starts a proxy that was not registered
    /// or whose token a crash could lose; then into the catalog. The token is written in
    /// the registration's own file, one fsync for both, and `tokens.json`, which holds every
    /// proxy's token, is written after, off the way to its start and to the answer; where
    /// the file system keeps no token in a file, `tokens.json` is written first.
    fn add_registration(&self, service: Service) -> Result<(), RegisterError> {
        let registrations = self.data.registrations();
        let id = service.id.clone();
        let token = service.proxy.as_ref().map(|_| self.state.token_for(&id.proxy_id())).transpose()?;
        let saved = match &token {
            Some(token) => registrations.save_with_token(&service, token),
            None => registrations.save(&service).map(|()| true),
        };
        let saved = saved.and_then(|kept| match (kept, &token) {
            (false, Some(token)) => self.save_tokens_with(&id.proxy_id(), token),
            _ => Ok(()),
        });
        if let Err(source) = saved {
            // Nothing entered the catalog: no proxy started, and the client is told that the
            // service is not registered. A registration file that was written goes again.
            if let Err(err) = registrations.remove(&id) {
                tracing::error!(service = %id, error = %crate::error::error_chain(&err), "cannot remove an unregistered service's file");
            }
            return Err(RegisterError::Persist { id, source });
        }
        // Config reloads and the fleet refuse ids that the API owns, but one may have taken
        // this id while it was written: then the registration is undone on disk.
        if let Err(err) = self.state.upsert(service, Source::Api) {
            if let Err(undo) = registrations.remove(&id) {
                tracing::error!(service = %id, error = %crate::error::error_chain(&undo), "cannot remove a refused registration");
            }
            return Err(err.into());
        }
        Ok(())
    }

    /// Writes `tokens.json` with every proxy's token and `token` for `proxy`, a proxy not in
    /// the catalog yet.
    fn save_tokens_with(&self, proxy: &ProxyId, token: &ProxyToken) -> Result<(), PersistError> {
        let mut saved_tokens = lock(&self.saved_tokens);
        let mut tokens = self.state.tokens();
        tokens.insert(proxy.clone(), token.clone());
        let saved = self.data.tokens().save(&tokens);
        // Written or not, the tokens file's content is known only when it was written.
        *saved_tokens = saved.is_ok().then_some(tokens);
        drop(saved_tokens);
        if saved.is_err() {
            // The tokens file lists what the catalog holds, not the token kept for a retry.
            self.save_tokens();
        }
        saved
    }

    /// A changed service: to disk first, so that a failed write leaves its running proxy
    /// alone, then into the catalog.
    fn replace_registration(&self, service: Service, old: &Service) -> Result<(), RegisterError> {
        let registrations = self.data.registrations();
        let id = service.id.clone();
        // Each definition is written with its proxy's token, as a new one is.
        let save = |service: &Service| match service.proxy.as_ref().map(|_| self.state.token_for(&id.proxy_id())) {
            Some(Ok(token)) => registrations.save_with_token(service, &token).map(drop),
            _ => registrations.save(service),
        };
        save(&service).map_err(|source| RegisterError::Persist { id: id.clone(), source })?;
        if let Err(err) = self.state.upsert(service, Source::Api) {
            // The id is the API's, so only a token for a new proxy can have failed: the old
            // definition stays in force, and on disk too.
            if let Err(undo) = save(old) {
                tracing::error!(service = %id, error = %crate::error::error_chain(&undo), "cannot restore the previous registration");
            }
            return Err(err.into());
        }
        self.save_tokens();
        Ok(())
    }

    /// Deregisters a service registered through the API.
    ///
    /// # Errors
    ///
    /// [`RegisterError`]; the catalog is then as it was.
    pub(crate) fn deregister(&self, id: &ServiceId) -> Result<(), RegisterError> {
        let _api = lock(&self.api_changes);
        if let Some(entry) = self.state.get(id) {
            if entry.source.kind() != SourceKind::Api {
                return Err(
                    CatalogError::Conflict { id: id.clone(), owner: entry.source, requested: SourceKind::Api }.into()
                );
            }
        }
        self.data.registrations().remove(id).map_err(|source| RegisterError::Persist { id: id.clone(), source })?;
        self.state.remove(id, &SourceKind::Api)?;
        self.save_tokens();
        tracing::info!(service = %id, "service deregistered");
        Ok(())
    }

    /// Writes `tokens.json` soon, off the way of what the caller answers: once
    /// [`TOKENS_SETTLE`] has passed, and at most once per [`TOKENS_INTERVAL`], with every
    /// token of that moment. For tokens that are already durable elsewhere (a registration's
    /// file keeps its proxy's): the file holds every proxy's token and grows with their
    /// number, and writing it at each of a burst of registrations would cost each one more
    /// than the registration itself.
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub(crate) fn save_tokens_soon(self: &Arc<Self>) {
        let now = tokio::time::Instant::now();
        let due = {
            let mut soon = lock(&self.tokens_soon);
            if soon.scheduled {
                return;
            }
            soon.scheduled = true;
            soon.last.map_or(now + TOKENS_SETTLE, |last| (last + TOKENS_INTERVAL).max(now + TOKENS_SETTLE))
        };
        let sources = Arc::clone(self);
        drop(tokio::spawn(async move {
            tokio::time::sleep_until(due).await;
            let write = tokio::task::spawn_blocking(move || {
                {
                    // Cleared before the tokens are read: a registration from now on asks
                    // for a write of its own.
                    let mut soon = lock(&sources.tokens_soon);
                    soon.scheduled = false;
                    soon.last = Some(tokio::time::Instant::now());
                }
                sources.save_tokens();
            });
            if let Err(err) = write.await {
                tracing::error!(error = %err, "the write of proxy tokens did not finish");
            }
        }));
    }

    /// Persists every proxy's token, unless they are those written last; the fleet
    /// follower calls it after each change too.
    pub(crate) fn save_tokens(&self) {
        let mut saved = lock(&self.saved_tokens);
        let tokens = self.state.tokens();
        if saved.as_ref() == Some(&tokens) {
            return;
        }
        match self.data.tokens().save(&tokens) {
            Ok(()) => *saved = Some(tokens),
            Err(err) => {
                // Written or not, the file's content is unknown now: write it next time.
                *saved = None;
                tracing::error!(error = %crate::error::error_chain(&err), "cannot persist proxy tokens");
            }
        }
    }
}

/// How long a `tokens.json` write asked for by [`Sources::save_tokens_soon`] waits, so
/// that the registrations of a burst share it.
const TOKENS_SETTLE: Duration = Duration::from_millis(100);

/// At most one such write in this long.
const TOKENS_INTERVAL: Duration = Duration::from_secs(1);

/// The state of the `tokens.json` write that follows API registrations.
#[derive(Default)]
struct TokensSoon {
    /// A write is due: a later request joins it.
    scheduled: bool,
    /// When the last such write began.
    last: Option<tokio::time::Instant>,
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;

    use tether_state::{ProxySpec, ServiceName};

    use super::*;

    fn service(id: &str, port: u16) -> Service {
        let mut service =
            Service::new(ServiceId::new(id).unwrap(), ServiceName::new(id).unwrap()).with_proxy(ProxySpec::default());
        service.port = Some(port);
        service
    }

    fn open(root: &Path) -> (Sources, DataDir) {
        let config = root.join("config");
        std::fs::create_dir_all(&config).unwrap();
        let data = DataDir::open(root.join("data")).unwrap();
        (Sources::open(data.clone(), vec![config], false).unwrap(), data)
    }

    /// A directory where the registration of `id` would go: renaming over it fails.
    fn block_registration(data: &DataDir, id: &str) {
        let path = data.registrations_dir().join(format!("{id}.json"));
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("inside"), "").unwrap();
    }

    fn saved_tokens(data: &DataDir) -> Vec<ProxyId> {
        data.tokens().load().tokens.into_keys().collect()
    }

    #[test]
    fn the_fleets_intentions_join_the_files_and_a_pair_both_define_is_the_files() {
        let root = tempfile::tempdir().unwrap();
        let config = root.path().join("config");
        std::fs::create_dir_all(&config).unwrap();
        let rule = |source: &str, destination: &str, action: &str| {
            format!("[[intention]]\nsource = \"{source}\"\ndestination = \"{destination}\"\naction = \"{action}\"\n")
        };
        std::fs::write(config.join("mesh.toml"), rule("*", "db", "allow") + &rule("api", "db", "allow")).unwrap();
        let (sources, _) = open(root.path());
        let index = sources.intentions_index();
        let before = *index.borrow();
        let fleet = |source: &str, destination: &str, action| {
            let target = |name: &str| tether_state::IntentionTarget::parse(name).unwrap();
            let key = format!("/tether/intentions/{source}/{destination}");
            (Intention::new(target(source), target(destination), action), key)
        };
        use tether_state::IntentionAction::{Allow, Deny};
        sources.set_fleet_intentions(vec![fleet("web", "db", Deny), fleet("api", "db", Deny)]);
        let name = |name: &str| ServiceName::new(name).unwrap();
        let intentions = sources.intentions();
        // The fleet's exact rule decides over the files' wildcard; the files' exact rule
        // keeps its pair.
        let decided = |source: &str| intentions.decide(&name(source), &name("db")).action;
        assert_eq!((decided("web"), decided("api"), decided("cache")), (Deny, Allow, Allow));
        assert!(*index.borrow() > before, "the proxies' blocking query was not woken");
        let after = *index.borrow();
        sources.set_fleet_intentions(vec![fleet("web", "db", Deny), fleet("api", "db", Deny)]);
        assert_eq!(*index.borrow(), after, "the same reading changes nothing");
        sources.set_fleet_intentions(Vec::new());
        assert_eq!(sources.intentions().decide(&name("web"), &name("db")).action, Allow);
    }

    #[tokio::test]
    async fn registrations_of_a_burst_share_one_write_of_the_tokens_file_and_the_next_waits_its_interval() {
        let root = tempfile::tempdir().unwrap();
        let (sources, data) = open(root.path());
        let sources = Arc::new(sources);
        let proxy = |id: &str| ServiceId::new(id).unwrap().proxy_id();
        let inode = || std::fs::metadata(data.root().join("tokens.json")).unwrap().ino();
        let opened = inode();
        let began = std::time::Instant::now();
        for (id, port) in [("a", 1), ("b", 2), ("c", 3)] {
            sources.register(service(id, port)).unwrap();
            sources.save_tokens_soon();
        }
        // Each write replaces the file: its first new version already holds all three.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while inode() == opened {
            assert!(std::time::Instant::now() < deadline, "tokens.json was not written");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(saved_tokens(&data), [proxy("a"), proxy("b"), proxy("c")]);

        let written = inode();
        sources.register(service("d", 4)).unwrap();
        sources.save_tokens_soon();
        while inode() == written {
            assert!(std::time::Instant::now() < deadline + TOKENS_INTERVAL, "tokens.json was not written again");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The first write began after the settle, the second one interval after it.
        assert!(began.elapsed() >= TOKENS_SETTLE + TOKENS_INTERVAL, "written again {:?} in", began.elapsed());
        assert_eq!(saved_tokens(&data).len(), 4);
    }

    #[test]
    fn a_new_registration_that_cannot_be_persisted_never_enters_the_catalog() {
        let root = tempfile::tempdir().unwrap();
        let (sources, data) = open(root.path());
        sources.register(service("db", 5432)).unwrap();
        // As the API does once it has answered.
        sources.save_tokens();
        block_registration(&data, "web");
        let revision = sources.state().revision();

        let err = sources.register(service("web", 8080)).unwrap_err();
        assert!(matches!(&err, RegisterError::Persist { id, .. } if id.as_str() == "web"), "{err:?}");
        assert!(
            crate::error::error_chain(&err).starts_with("service web was not changed: cannot persist the registration"),
            "{}",
            crate::error::error_chain(&err)
        );
        let id = ServiceId::new("web").unwrap();
        assert!(sources.state().get(&id).is_none());
        // Never in the catalog: the engine, which acts on a change at once, saw nothing.
        assert_eq!(sources.state().revision(), revision);
        let changes = tether_state::Catalog::changes_since(sources.state(), Some(revision));
        assert!(changes.upserted.is_empty() && changes.removed.is_empty());
        assert_eq!(saved_tokens(&data), [ServiceId::new("db").unwrap().proxy_id()]);

        std::fs::remove_dir_all(data.registrations_dir().join("web.json")).unwrap();
        sources.register(service("web", 8080)).unwrap();
        assert!(sources.state().get(&id).is_some());
        assert!(data.registrations_dir().join("web.json").is_file());
        sources.save_tokens();
        assert_eq!(saved_tokens(&data).len(), 2);
    }

    #[test]
    fn a_changed_registration_that_cannot_be_persisted_leaves_the_running_one_alone() {
        let root = tempfile::tempdir().unwrap();
        let (sources, data) = open(root.path());
        sources.register(service("web", 8080)).unwrap();
        let id = ServiceId::new("web").unwrap();
        let before = sources.state().get(&id).unwrap();
        std::fs::remove_file(data.registrations_dir().join("web.json")).unwrap();
        block_registration(&data, "web");

        let err = sources.register(service("web", 9090)).unwrap_err();
        assert!(matches!(err, RegisterError::Persist { .. }), "{err:?}");
        let after = sources.state().get(&id).unwrap();
        assert_eq!(after.revision, before.revision);
        assert_eq!(after.service.port, Some(8080));
        assert_eq!(after.proxy.unwrap().token(), before.proxy.unwrap().token());
    }

    #[test]
    fn api_settings_that_need_the_flag_are_refused_and_not_loaded_back_without_it() {
        let root = tempfile::tempdir().unwrap();
        let config = root.path().join("config");
        std::fs::create_dir_all(&config).unwrap();
        let data = DataDir::open(root.path().join("data")).unwrap();
        let mut preloaded = service("web", 8080);
        let proxy = preloaded.proxy.as_mut().unwrap();
        proxy.env.insert("LD_PRELOAD".into(), "/tmp/evil.so".into());
        proxy.user = Some("nobody".into());

        let strict = Sources::open(data.clone(), vec![config.clone()], false).unwrap();
        let err = strict.register(preloaded.clone()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "service web: the register API may not set `proxy.user` unless the agent runs with --allow-api-commands"
        );
        preloaded.proxy.as_mut().unwrap().user = None;
        let err = strict.register(preloaded.clone()).unwrap_err();
        assert!(
            matches!(&err, RegisterError::CommandRefused { setting: ApiSetting::Env(name), .. } if name == "LD_PRELOAD")
        );
        assert!(err.to_string().contains("`proxy.env.LD_PRELOAD` (the dynamic loader or libc reads it)"), "{err}");
        assert!(strict.state().is_empty());
        drop(strict);

        let allowing = Sources::open(data.clone(), vec![config.clone()], true).unwrap();
        allowing.register(preloaded).unwrap();
        drop(allowing);
        // Registered while the flag was on: an agent without it leaves the file alone and
        // the service out.
        let strict = Sources::open(data.clone(), vec![config], false).unwrap();
        assert!(strict.state().is_empty());
        assert!(data.registrations_dir().join("web.json").is_file());
    }

    #[test]
    fn a_registration_that_closes_a_dependency_cycle_is_refused_and_changes_nothing() {
        let root = tempfile::tempdir().unwrap();
        let (sources, _data) = open(root.path());
        let depending = |name: &str, on: &str| {
            let mut service = service(name, 1000);
            let spec = service.proxy.as_mut().unwrap();
            spec.depends_on.insert(tether_state::Dependency::new(on).unwrap(), tether_state::Condition::Ready);
            service
        };
        sources.register(depending("a", "b")).unwrap();
        sources.register(depending("b", "c-proxy")).unwrap();
        let refused = sources.register(depending("c", "a")).unwrap_err();
        assert!(matches!(refused, RegisterError::Cycle { .. }), "{refused:?}");
        assert_eq!(
            refused.to_string(),
            "service c: field `proxy.depends_on`: dependency cycle: c-proxy -> a-proxy -> b-proxy -> c-proxy"
        );
        assert!(sources.state().get(&ServiceId::new("c").unwrap()).is_none());
        sources.register(depending("c", "d")).unwrap();
    }

    #[test]
    fn tokens_are_rewritten_only_when_they_change() {
        let root = tempfile::tempdir().unwrap();
        let (sources, data) = open(root.path());
        sources.register(service("web", 8080)).unwrap();
        // As the API does once it has answered.
        sources.save_tokens();
        let inode = || std::fs::metadata(data.tokens_path()).unwrap().ino();
        let written = inode();
        // Every atomic write makes a new inode: the same one means no write.
        sources.register(service("web", 9090)).unwrap();
        sources.reload().unwrap();
        sources.save_tokens();
        assert_eq!(inode(), written);
        sources.register(service("db", 5432)).unwrap();
        sources.save_tokens();
        assert_ne!(inode(), written);
        assert_eq!(saved_tokens(&data).len(), 2);
    }

    #[test]
    fn a_registered_proxy_keeps_its_token_when_the_agent_died_before_the_tokens_file_was_written() {
        let root = tempfile::tempdir().unwrap();
        let (sources, data) = open(root.path());
        sources.register(service("web", 8080)).unwrap();
        let proxy = ServiceId::new("web").unwrap().proxy_id();
        let token = sources.state().token_for(&proxy).unwrap();
        if !data.registrations().load().unwrap().tokens.contains_key(&proxy) {
            // A file system without extended attributes: tokens.json had it before the start.
            assert_eq!(data.tokens().load().tokens.get(&proxy), Some(&token));
            return;
        }
        drop(sources);
        // The file as it was before this registration: none for the proxy, or a token it had
        // in an earlier life (deregistered, then registered again).
        std::fs::remove_file(data.tokens_path()).unwrap();
        let (again, _) = open(root.path());
        assert_eq!(again.state().token_for(&proxy).unwrap(), token);
        assert_eq!(data.tokens().load().tokens.get(&proxy), Some(&token));
        drop(again);
        data.tokens().save(&BTreeMap::from([(proxy.clone(), ProxyToken::generate().unwrap())])).unwrap();
        let (again, _) = open(root.path());
        assert_eq!(again.state().token_for(&proxy).unwrap(), token);
    }

    /// The catalog's config services, as (service, file).
    fn config_services(sources: &Sources) -> Vec<(Service, PathBuf)> {
        let entries = sources.state().entries().into_iter();
        entries
            .filter_map(|entry| match entry.source {
                Source::Config { file } => Some(((*entry.service).clone(), file)),
                _ => None,
            })
            .collect()
    }

    /// What a full load of the config dir gives, as (service, file).
    fn from_scratch(config: &Path) -> Vec<(Service, PathBuf)> {
        let mut entries: Vec<_> = tether_state::config::load_dirs(&[config])
            .unwrap()
            .services
            .into_iter()
            .map(|entry| (entry.service, entry.file))
            .collect();
        entries.sort_by(|a, b| a.0.id.cmp(&b.0.id));
        entries
    }

    #[test]
    fn reloads_of_one_service_or_of_many_end_where_a_full_load_does() {
        let root = tempfile::tempdir().unwrap();
        let config = root.path().join("config");
        std::fs::create_dir_all(&config).unwrap();
        let write = |name: &str, text: &str| {
            // Through a new inode, so that every write is seen whatever the clock's grain.
            let temp = config.join(format!("{name}.partial"));
            std::fs::write(&temp, text).unwrap();
            std::fs::rename(&temp, config.join(name)).unwrap();
        };
        write("a.toml", "[[service]]\nname = \"a\"\n[[service]]\nname = \"b\"\nport = 1\n");
        let (sources, _data) = open(root.path());
        let check = |report: ReloadReport, expected: (usize, usize, usize)| {
            let got = (report.catalog.added, report.catalog.changed, report.catalog.removed);
            assert_eq!(got, expected);
            assert_eq!(config_services(&sources), from_scratch(&config));
        };
        assert_eq!(config_services(&sources), from_scratch(&config));
        check(sources.reload().unwrap(), (0, 0, 0));
        write("c.toml", "[[service]]\nname = \"c\"\n");
        check(sources.reload().unwrap(), (1, 0, 0));
        write("a.toml", "[[service]]\nname = \"a\"\n[[service]]\nname = \"b\"\nport = 2\n");
        check(sources.reload().unwrap(), (0, 1, 0));
        // Moved to another file, unchanged: only its source changes.
        write("a.toml", "[[service]]\nname = \"a\"\n");
        write("d.toml", "[[service]]\nname = \"b\"\nport = 2\n");
        check(sources.reload().unwrap(), (0, 0, 0));
        write("c.toml", "[[service]]\nname = \"c\"\n[[service]]\nname = \"e\"\n[[service]]\nname = \"f\"\n");
        check(sources.reload().unwrap(), (2, 0, 0));
        std::fs::remove_file(config.join("d.toml")).unwrap();
        check(sources.reload().unwrap(), (0, 0, 1));
        std::fs::remove_file(config.join("c.toml")).unwrap();
        check(sources.reload().unwrap(), (0, 0, 3));
    }

    #[test]
    fn a_config_service_that_an_api_registration_owns_is_refused_on_every_reload() {
        let root = tempfile::tempdir().unwrap();
        let (sources, _data) = open(root.path());
        let config = root.path().join("config");
        sources.register(service("web", 8080)).unwrap();
        std::fs::write(config.join("web.toml"), "[[service]]\nname = \"web\"\n").unwrap();
        for _ in 0..2 {
            let err = sources.reload().unwrap_err();
            assert!(matches!(err, ReloadError::Catalog(CatalogError::Conflict { .. })), "{err:?}");
            let entry = sources.state().get(&ServiceId::new("web").unwrap()).unwrap();
            assert_eq!(entry.source, Source::Api);
        }
        std::fs::remove_file(config.join("web.toml")).unwrap();
        let report = sources.reload().unwrap();
        assert_eq!(report.catalog, ReplaceReport::default());
        assert_eq!(sources.state().get(&ServiceId::new("web").unwrap()).unwrap().source, Source::Api);
    }

    #[test]
    fn a_reload_reads_only_the_config_files_that_changed() {
        let root = tempfile::tempdir().unwrap();
        let (sources, _data) = open(root.path());
        let config = root.path().join("config");
        std::fs::write(config.join("web.toml"), "[[service]]\nname = \"web\"\n").unwrap();
        let report = sources.reload().unwrap();
        assert_eq!(report.catalog.added, 1);
        assert_eq!(report.files, LoadStats { read: 1, reused: 0 });
        std::fs::write(config.join("bad.toml"), "[[service]]\nnmae = \"x\"\n").unwrap();
        assert!(matches!(sources.reload(), Err(ReloadError::Config(_))));
        assert_eq!(sources.state().len(), 1);
        std::fs::remove_file(config.join("bad.toml")).unwrap();
        std::fs::remove_file(config.join("web.toml")).unwrap();
        let report = sources.reload().unwrap();
        assert_eq!(report.catalog.removed, 1);
        assert_eq!(report.files, LoadStats::default());
    }
}
