//! Domain types, validation, the catalog and its change notifications for tether, the
//! node-local agent that keeps managed proxy processes in step with a catalog of services.
//!
//! - [`ServiceId`] and [`ProxyId`]: validated ids, safe to use as file names.
//! - [`Service`], [`ProxySpec`] and [`ManagedProxy`]: what a service and its managed proxy
//!   are, with the config's defaults, and [`ManagedProxy::change_to`]: whether a change needs a
//!   restart or applies in place.
//! - [`config`]: the TOML/JSON schema, with errors that name file, line and field.
//! - [`ConnectConfig`] and [`Intentions`]: the service mesh's identity settings and who may
//!   connect to whom, decided by [`Intentions::decide`].
//! - [`LocalState`] and the [`Catalog`] trait: the desired set, with revisions, and
//!   [`Subscription`]s that never miss a change and fold bursts into one wake-up.
//! - `persist` (feature `persist`, which tether's own crates turn on): the agent's data dir,
//!   its layout, atomic writes, API registrations and tokens.
//! - [`Backoff`]: the capped exponential waits of every retry loop, and
//!   [`RestartPolicy::delay_before`]: the restart schedule built on it.
//!
//! The crate spawns no tasks and installs nothing global; only `persist` and
//! [`config::load_dirs`] touch the file system.
//!
//! # Example
//!
//! A downstream program builds a catalog from config text and waits for a change:
//!
//! ```
//! use tether_state::config::{parse_file, Format, Origin};
//! use tether_state::{Catalog, LocalState, Source, SourceKind};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let text = r#"
//! [[service]]
//! name = "web"
//! port = 8080
//! [service.proxy]
//! command = ["/usr/bin/envoy", "-c", "/etc/envoy/web.yaml"]
//! "#;
//! let services = parse_file(text, Format::Toml, &Origin::Body).unwrap();
//! let state = LocalState::new();
//! let entries = services.into_iter().map(|s| (s, Source::Config { file: "web.toml".into() })).collect();
//! state.replace_source(&SourceKind::Config, entries).unwrap();
//!
//! let mut subscription = state.subscribe();
//! let seen = state.changes_since(None);
//! assert_eq!(seen.upserted.len(), 1);
//!
//! // Another task registers a service; the subscriber wakes up and reads only the change.
//! let writer = state.clone();
//! tokio::spawn(async move {
//!     let api = parse_file("[[service]]\nname = \"db\"\n[service.proxy]\n", Format::Toml, &Origin::Body).unwrap();
//!     writer.upsert(api.into_iter().next().unwrap(), Source::Api).unwrap();
//! });
//! let revision = subscription.changed().await.unwrap();
//! let changes = state.changes_since(Some(seen.revision));
//! assert_eq!(changes.revision, revision);
//! assert_eq!(changes.upserted[0].proxy.id().as_str(), "db-proxy");
//! # }
//! ```
//!
//! # Cargo features
//!
//! | feature | default | what it does |
//! |---|---|---|
//! | `mock` | off | exports `MockCatalog`, a [`mockall`](https://docs.rs/mockall) mock of the [`Catalog`] trait |
//!
//! # Testing against the mocks
//!
//! Code that reads a catalog through the [`Catalog`] trait can be tested against
//! `MockCatalog`, which answers what each test tells it to. Enable the `mock` feature from
//! `[dev-dependencies]` only, so that it stays out of release builds:
//!
//! ```toml
//! [dev-dependencies]
//! tether-state = { version = "0.1", features = ["mock"] }
//! ```
//!
//! A test of a function that lists the proxies a catalog wants (compiled and run by
//! `cargo test --doc --features mock`):
//!
#![cfg_attr(feature = "mock", doc = "```")]
#![cfg_attr(not(feature = "mock"), doc = "```ignore")]
//! use std::sync::Arc;
//!
//! use tether_state::{
//!     Catalog, Changes, DesiredProxy, ManagedProxy, MockCatalog, ProxySpec, ProxyToken, Revision, Service,
//!     ServiceId, ServiceName,
//! };
//!
//! /// The code under test: the ids of the proxies that `catalog` wants running, sorted.
//! fn wanted(catalog: &dyn Catalog) -> Vec<String> {
//!     let changes = catalog.changes_since(None);
//!     let mut ids: Vec<String> = changes.upserted.iter().map(|desired| desired.proxy.id().to_string()).collect();
//!     ids.sort();
//!     ids
//! }
//!
//! let web = Service::new(ServiceId::new("web").unwrap(), ServiceName::new("web").unwrap())
//!     .with_proxy(ProxySpec::default());
//! let proxy = Arc::new(ManagedProxy::new(Arc::new(web), ProxyToken::generate().unwrap()).unwrap());
//!
//! let mut catalog = MockCatalog::new();
//! catalog.expect_changes_since().withf(|since| since.is_none()).times(1).returning(move |_| Changes {
//!     revision: Revision::new(1),
//!     complete: true,
//!     upserted: vec![DesiredProxy { revision: Revision::new(1), proxy: proxy.clone() }],
//!     removed: Vec::new(),
//! });
//!
//! assert_eq!(wanted(&catalog), ["web-proxy"]);
//! // Dropping the mock checks that every expectation was met.
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod backoff;
mod catalog;
pub mod config;
mod connect;
mod exit;
mod figures;
mod health;
mod id;
mod listener;
mod ordering;
#[cfg(feature = "persist")]
pub mod persist;
pub mod proxy_env;
mod reload;
mod resources;
mod service;
mod template;
mod token;

pub use backoff::Backoff;
#[cfg(any(test, feature = "mock"))]
pub use catalog::MockCatalog;
pub use catalog::{
    Catalog, CatalogError, ChangeNotifier, Changes, DesiredProxy, Entry, LocalState, ReplaceReport, Revision, Source,
    SourceKind, Subscription,
};
pub use connect::{
    CaConfig, CaProvider, CaRoot, ConnectConfig, ConnectValueError, DATACENTER_RULE, DEFAULT_DATACENTER,
    DEFAULT_INTENTION, Datacenter, Decision, DuplicateIntentions, Intention, IntentionAction, IntentionTarget,
    Intentions, IssuedLeaf, LeafRequest, LeafTtl, MAX_TRUST_DOMAIN_LEN, PemPath, Precedence, PrivateKeyPem, SpiffeId,
    SpiffeNameError, TrustDomain, WILDCARD,
};
pub use exit::ExitReason;
pub use figures::ProcessFigures;
pub use health::{HttpTarget, LinePattern, Liveness, Probe, Readiness, TcpTarget};
pub use id::{
    IdError, MAX_PROXY_ID_LEN, MAX_SERVICE_ID_LEN, PROXY_SUFFIX, ProxyId, SERVICE_ID_RULE, ServiceId,
    check_process_name, check_service_id,
};
pub use listener::{
    BASE_ID_PLACEHOLDER, LISTENER_NAME_RULE, ListenAddress, Listener, ListenerName, RESTART_EPOCH_PLACEHOLDER,
    UpdatePolicy, UpdateStrategy, epoch_placeholder_in, substitute_epoch,
};
pub use ordering::{Condition, Dependency, DependsOn, cycle_text, dependency_cycles};
pub use reload::{ReloadAction, ReloadCounts, ReloadOutcome, ReloadPolicy, ReloadResult, Reloads, WATCH_DEBOUNCE};
pub use resources::{CpuLimit, ResourceLimits};
pub use service::{
    CommandLine, ExecMode, KillPolicy, KillSignal, LogOutput, LogPolicy, ManagedProxy, NameError, ProxyChange,
    ProxyCommand, ProxyConfigMap, ProxyKind, ProxySpec, RestartPolicy, Service, ServiceName,
};
pub use template::{
    DEFAULT_TEMPLATE_MAX_SIZE, DEFAULT_TEMPLATE_MODE, DEFAULT_TEMPLATE_WAIT, OnChange, Template, TemplateSource,
};
pub use token::{ProxyToken, TokenError, TokenFingerprint};

// The README is the crate's page on crates.io: its examples run as doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// Locks `mutex`, and goes on with its value should a holder have panicked: every critical
/// section of the workspace leaves its value whole (it only moves values in or out), so a
/// poisoned lock holds nothing broken, and one panic never turns into a panic of every
/// later holder.
///
/// ```
/// let counter = std::sync::Mutex::new(1);
/// *tether_state::lock(&counter) += 1;
/// assert_eq!(*tether_state::lock(&counter), 2);
/// ```
pub fn lock<T: ?Sized>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// An error and its sources on one line, `outer: inner: innermost`: how every tether crate
/// shows an error in a status, a log field or an API answer.
///
/// ```
/// use tether_state::{error_chain, ServiceId};
///
/// let err = ServiceId::new("a/b").unwrap_err();
/// assert!(error_chain(&err).starts_with("invalid service id \"a/b\""));
/// ```
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
