//! The agent's sources of services — config dirs and API registrations — merged into one
//! `LocalState`, with registrations and tokens persisted under the data dir.
//!
//! This module decides policy at the catalog's door (API commands, config-vs-API
//! ownership) and keeps the catalog and the data dir in step. It never starts a process.

use std::path::PathBuf;

use tether_state::config::{self, ConfigErrors, DisplayPath};
use tether_state::persist::{DataDir, PersistError};
use tether_state::{CatalogError, LocalState, ProxyCommand, ReplaceReport, Service, ServiceId, Source, SourceKind};

/// Why a registration or deregistration was refused. Nothing was changed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RegisterError {
    /// The body sets `command` and the agent does not allow it (HTTP 403).
    #[error(
        "service {id}: the register API may not set a proxy `command` unless the agent runs with --allow-api-commands"
    )]
    CommandRefused { id: ServiceId },
    /// The catalog refused it: conflict with a config file (409) or unknown id (404).
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// The data dir could not be written (500): the catalog was left as it was.
    #[error("cannot persist the registration")]
    Persist(#[source] PersistError),
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
}

/// The catalog and the files behind it.
pub(crate) struct Sources {
    state: LocalState,
    data: DataDir,
    config_dirs: Vec<PathBuf>,
    allow_api_commands: bool,
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
        let sources = Self { state: LocalState::with_tokens(tokens.tokens), data, config_dirs, allow_api_commands };
        let entries = config::load_dirs(&sources.config_dirs)?;
        let services = entries.into_iter().map(|e| (e.service, Source::Config { file: e.file })).collect();
        if let Err(err) = sources.state.replace_source(&SourceKind::Config, services) {
            // load_dirs already refused duplicates; a token failure is all that is left.
            tracing::error!(error = %crate::error_chain(&err), "cannot load the config into the catalog");
        }
        sources.load_registrations();
        sources.save_tokens();
        Ok(sources)
    }

    fn load_registrations(&self) {
        let loaded = match self.data.registrations().load() {
            Ok(loaded) => loaded,
            Err(err) => {
                tracing::error!(error = %crate::error_chain(&err), "cannot read API registrations");
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
                tracing::error!(service = %id, error = %crate::error_chain(&err), "persisted registration not loaded");
            }
        }
    }

    /// The catalog, for the engine and the API.
    pub(crate) fn state(&self) -> &LocalState {
        &self.state
    }

    /// Re-reads the config dirs. All or nothing: on any error every error is logged and the
    /// previous config stays in force.
    pub(crate) fn reload(&self) -> Result<ReplaceReport, ReloadError> {
        let entries = config::load_dirs(&self.config_dirs).inspect_err(|errors| {
            for error in &errors.0 {
                tracing::error!(error = %crate::error_chain(error), "config reload refused");
            }
        })?;
        let services = entries.into_iter().map(|e| (e.service, Source::Config { file: e.file })).collect();
        let report = self.state.replace_source(&SourceKind::Config, services).inspect_err(|err| {
            // A config service that an API registration owns: the registration stays.
            tracing::error!(error = %crate::error_chain(err), "config reload refused");
        })?;
        self.save_tokens();
        Ok(report)
    }

    fn check_command_policy(&self, service: &Service) -> Result<(), RegisterError> {
        let sets_command = service.proxy.as_ref().is_some_and(|p| matches!(p.command, ProxyCommand::Exec(_)));
        if sets_command && !self.allow_api_commands {
            return Err(RegisterError::CommandRefused { id: service.id.clone() });
        }
        Ok(())
    }

    /// Registers (or replaces) a service through the API and persists it.
    pub(crate) fn register(&self, service: Service) -> Result<(), RegisterError> {
        self.check_command_policy(&service)?;
        if let Some(entry) = self.state.get(&service.id) {
            if entry.source.kind() != SourceKind::Api {
                return Err(
                    CatalogError::Conflict { id: service.id, owner: entry.source, requested: SourceKind::Api }.into()
                );
            }
        }
        let registrations = self.data.registrations();
        registrations.save(&service).map_err(RegisterError::Persist)?;
        let id = service.id.clone();
        if let Err(err) = self.state.upsert(service, Source::Api) {
            // Lost a race with a config reload that took the id: undo the file.
            let _ = registrations.remove(&id);
            return Err(err.into());
        }
        self.save_tokens();
        tracing::info!(service = %id, "service registered");
        Ok(())
    }

    /// Deregisters a service registered through the API.
    pub(crate) fn deregister(&self, id: &ServiceId) -> Result<(), RegisterError> {
        if let Some(entry) = self.state.get(id) {
            if entry.source.kind() != SourceKind::Api {
                return Err(
                    CatalogError::Conflict { id: id.clone(), owner: entry.source, requested: SourceKind::Api }.into()
                );
            }
        }
        self.data.registrations().remove(id).map_err(RegisterError::Persist)?;
        self.state.remove(id, &SourceKind::Api)?;
        self.save_tokens();
        tracing::info!(service = %id, "service deregistered");
        Ok(())
    }

    /// Persists every proxy's token; the fleet follower calls it after each change too.
    pub(crate) fn save_tokens(&self) {
        if let Err(err) = self.data.tokens().save(&self.state.tokens()) {
            tracing::error!(error = %crate::error_chain(&err), "cannot persist proxy tokens");
        }
    }
}
