//! Services and their managed proxies, as validated domain values.
//!
//! Everything here is already valid: the config parser is the only way in from text, and
//! it refuses what these types cannot hold. This module decides which changes to a proxy
//! need a restart ([`ManagedProxy::change_to`]) so that no caller re-derives the rule.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::backoff::Backoff;
use crate::health::{Liveness, Readiness};
use crate::id::{ProxyId, ServiceId};
use crate::listener::{Listener, UpdatePolicy};
use crate::ordering::DependsOn;
use crate::reload::ReloadPolicy;
use crate::resources::ResourceLimits;
use crate::token::ProxyToken;

/// The opaque `config` table of a proxy, served to the proxy as JSON.
pub type ProxyConfigMap = serde_json::Map<String, serde_json::Value>;

/// A service in the catalog, with its managed proxy if it has one.
#[derive(Debug, Clone, PartialEq)]
pub struct Service {
    /// The id; defaults to the name in config files.
    pub id: ServiceId,
    /// The service's name.
    pub name: ServiceName,
    /// The address the service listens on; the built-in proxy forwards to it.
    pub address: String,
    /// The port the service listens on, if any.
    pub port: Option<u16>,
    /// Free-form tags.
    pub tags: Vec<String>,
    /// Free-form metadata.
    pub meta: BTreeMap<String, String>,
    /// The managed proxy, when the service has one.
    pub proxy: Option<ProxySpec>,
}

impl Service {
    /// The default service address.
    pub const DEFAULT_ADDRESS: &'static str = "127.0.0.1";

    /// A service with the given id and name, the default address and no proxy.
    pub fn new(id: ServiceId, name: ServiceName) -> Self {
        Self {
            id,
            name,
            address: Self::DEFAULT_ADDRESS.to_owned(),
            port: None,
            tags: Vec::new(),
            meta: BTreeMap::new(),
            proxy: None,
        }
    }

    /// The same service with a managed proxy of the given spec.
    #[must_use]
    pub fn with_proxy(mut self, proxy: ProxySpec) -> Self {
        self.proxy = Some(proxy);
        self
    }
}

/// A service name: not empty, at most 256 bytes, no control characters.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceName(Box<str>);

/// A service name that breaks the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid service name {name:?}: {reason}")]
pub struct NameError {
    /// The rejected name.
    pub name: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl ServiceName {
    /// The longest name, in bytes.
    pub const MAX_LEN: usize = 256;

    /// Validates `name`.
    ///
    /// # Errors
    ///
    /// [`NameError`] when it is empty, too long or holds control characters.
    pub fn new(name: impl Into<String>) -> Result<Self, NameError> {
        let name = name.into();
        let reason = if name.is_empty() {
            Some("it is empty")
        } else if name.len() > Self::MAX_LEN {
            Some("it is longer than 256 bytes")
        } else if name.chars().any(char::is_control) {
            Some("it contains control characters")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(NameError { name, reason }),
            None => Ok(Self(name.into_boxed_str())),
        }
    }

    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// How a managed proxy is run. `daemon` is the only mode: a long-running process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ExecMode {
    /// A long-running process, supervised and restarted when it exits.
    #[default]
    Daemon,
}

/// What a managed proxy runs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ProxyCommand {
    /// The agent's own `connect-proxy`, resolved to the running executable at each spawn,
    /// so that an upgrade that moves the binary neither breaks nor restarts proxies.
    #[default]
    BuiltIn,
    /// An external program.
    Exec(CommandLine),
}

/// A program and its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandLine {
    program: PathBuf,
    args: Vec<String>,
}

impl CommandLine {
    /// A command line from its words: the program, then its arguments.
    ///
    /// The program is an absolute path, or a bare name (no `/`) that the proxy's start looks
    /// up in the `PATH` of the proxy's environment, as `execvp` does.
    ///
    /// # Errors
    ///
    /// When there is no program, or when it is a relative path with a `/` (`bin/envoy`):
    /// that would be found relative to a working directory, which is rarely what was meant,
    /// and neither systemd nor s6 takes one.
    ///
    /// ```
    /// use tether_state::CommandLine;
    ///
    /// assert!(CommandLine::from_words(vec!["envoy".into(), "-c".into(), "/etc/envoy.yaml".into()]).is_ok());
    /// assert!(CommandLine::from_words(vec!["/usr/bin/envoy".into()]).is_ok());
    /// assert!(CommandLine::from_words(vec!["bin/envoy".into()]).unwrap_err().contains("relative path"));
    /// assert!(CommandLine::from_words(Vec::new()).is_err());
    /// ```
    pub fn from_words(words: Vec<String>) -> Result<Self, String> {
        let mut words = words.into_iter();
        let Some(program) = words.next().filter(|p| !p.is_empty()).map(PathBuf::from) else {
            return Err("command must name a program; leave `command` out for the built-in proxy".to_owned());
        };
        if program.is_relative() && program.as_os_str().as_encoded_bytes().contains(&b'/') {
            return Err(format!(
                "program {:?} is a relative path: give an absolute path, or a bare name (no `/`) to look up in PATH",
                program.display().to_string()
            ));
        }
        Ok(Self { program, args: words.collect() })
    }

    /// The program: an absolute path, or a bare name looked up in the `PATH` of the
    /// proxy's environment.
    pub fn program(&self) -> &Path {
        &self.program
    }

    /// The arguments after the program.
    pub fn args(&self) -> &[String] {
        &self.args
    }

    /// The program followed by its arguments, as written in config files.
    pub fn to_words(&self) -> Vec<String> {
        let mut words = Vec::with_capacity(self.args.len() + 1);
        words.push(self.program.to_string_lossy().into_owned());
        words.extend(self.args.iter().cloned());
        words
    }
}

/// A signal a proxy may be asked to stop with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum KillSignal {
    /// `SIGINT`, the default: what Envoy and most proxies treat as "drain and exit".
    #[default]
    Int,
    /// `SIGTERM`.
    Term,
    /// `SIGQUIT`.
    Quit,
    /// `SIGHUP`.
    Hup,
    /// `SIGUSR1`.
    Usr1,
    /// `SIGUSR2`.
    Usr2,
    /// `SIGKILL`: no grace at all.
    Kill,
}

impl KillSignal {
    /// Every signal that may be configured.
    pub const ALL: [KillSignal; 7] = [Self::Int, Self::Term, Self::Quit, Self::Hup, Self::Usr1, Self::Usr2, Self::Kill];

    /// The signal's name, such as `SIGINT`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Int => "SIGINT",
            Self::Term => "SIGTERM",
            Self::Quit => "SIGQUIT",
            Self::Hup => "SIGHUP",
            Self::Usr1 => "SIGUSR1",
            Self::Usr2 => "SIGUSR2",
            Self::Kill => "SIGKILL",
        }
    }

    /// Parses `SIGINT`, `sigint` or `INT`.
    pub fn from_name(name: &str) -> Option<Self> {
        let upper = name.to_ascii_uppercase();
        let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
        Self::ALL.into_iter().find(|signal| &signal.name()[3..] == bare)
    }
}

impl From<KillSignal> for nix::sys::signal::Signal {
    /// The OS signal: the one mapping, exhaustive, so that a new variant cannot be sent as
    /// another signal.
    fn from(signal: KillSignal) -> Self {
        use nix::sys::signal::Signal;
        match signal {
            KillSignal::Int => Signal::SIGINT,
            KillSignal::Term => Signal::SIGTERM,
            KillSignal::Quit => Signal::SIGQUIT,
            KillSignal::Hup => Signal::SIGHUP,
            KillSignal::Usr1 => Signal::SIGUSR1,
            KillSignal::Usr2 => Signal::SIGUSR2,
            KillSignal::Kill => Signal::SIGKILL,
        }
    }
}

impl fmt::Display for KillSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a proxy is stopped: `signal` to its process group, then SIGKILL after `timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KillPolicy {
    /// Sent first, to the whole process group.
    pub signal: KillSignal,
    /// How long to wait for the proxy to exit before SIGKILL.
    pub timeout: Duration,
}

impl Default for KillPolicy {
    fn default() -> Self {
        Self { signal: KillSignal::Int, timeout: Duration::from_secs(5) }
    }
}

/// The first delay of the restart backoff, once the free attempts are used up.
const FIRST_RESTART_DELAY: Duration = Duration::from_secs(1);

/// When an exited proxy is started again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Restarts without delay before backoff starts.
    pub free_attempts: u32,
    /// The cap of the exponential backoff 1s, 2s, 4s, …
    pub max_delay: Duration,
    /// A run this long resets the attempt count.
    pub healthy_after: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self { free_attempts: 3, max_delay: Duration::from_secs(60), healthy_after: Duration::from_secs(10) }
    }
}

impl RestartPolicy {
    /// The shortest wait before a failed start is tried again, free attempts included: a
    /// program that cannot start at all must not spin whoever retries it.
    pub const MIN_RETRY_DELAY: Duration = Duration::from_millis(100);

    /// The delay before restart number `attempt` (1 for the first restart after a run
    /// shorter than `healthy_after`): zero for the first `free_attempts`, then 1s, 2s, 4s,
    /// … capped at `max_delay` (a [`Backoff`] that starts at one second).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tether_state::RestartPolicy;
    ///
    /// let policy = RestartPolicy::default();
    /// assert_eq!(policy.delay_before(3), Duration::ZERO);
    /// assert_eq!(policy.delay_before(4), Duration::from_secs(1));
    /// assert_eq!(policy.delay_before(6), Duration::from_secs(4));
    /// assert_eq!(policy.delay_before(100), Duration::from_secs(60));
    /// ```
    pub fn delay_before(&self, attempt: u32) -> Duration {
        match attempt.checked_sub(self.free_attempts) {
            Some(past_free @ 1..) => Backoff::new(FIRST_RESTART_DELAY, self.max_delay).delay(past_free - 1),
            _ => Duration::ZERO,
        }
    }

    /// The delay before start attempt `attempt` when the attempt before it could not even
    /// start the process (a missing program, no descriptor left): [`delay_before`], but
    /// never under [`MIN_RETRY_DELAY`], free attempts included.
    ///
    /// [`delay_before`]: Self::delay_before
    /// [`MIN_RETRY_DELAY`]: Self::MIN_RETRY_DELAY
    ///
    /// ```
    /// use std::time::Duration;
    /// use tether_state::RestartPolicy;
    ///
    /// let policy = RestartPolicy::default();
    /// assert_eq!(policy.delay_after_failed_start(1), Duration::from_millis(100));
    /// assert_eq!(policy.delay_after_failed_start(5), Duration::from_secs(2));
    /// ```
    pub fn delay_after_failed_start(&self, attempt: u32) -> Duration {
        self.delay_before(attempt).max(Self::MIN_RETRY_DELAY)
    }

    /// The attempt number of the restart that follows a run of `run`, given the attempt
    /// number of the restart that began it (0 for the first start): a run of
    /// `healthy_after` starts the count again at 1.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tether_state::RestartPolicy;
    ///
    /// let policy = RestartPolicy::default(); // healthy after 10s
    /// assert_eq!(policy.next_attempt(7, Duration::from_millis(9_999)), 8);
    /// assert_eq!(policy.next_attempt(7, Duration::from_secs(10)), 1);
    /// ```
    pub fn next_attempt(&self, previous_attempt: u32, run: Duration) -> u32 {
        if run >= self.healthy_after { 1 } else { previous_attempt.saturating_add(1) }
    }
}

/// Where a proxy's output goes and how large its log files may grow: each file (stdout
/// and stderr separately) is rotated past `max_size`, keeping `keep` rotated copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogPolicy {
    /// Rotate a log file once it is larger than this many bytes (default 64 MiB).
    pub max_size: u64,
    /// Rotated files kept per stream, `<file>.1` (newest) to `<file>.<keep>` (default 5).
    /// With 0, a file past its cap is only truncated.
    pub keep: u32,
    /// Where each line goes: the log files, the journal, or both (default the files).
    pub output: LogOutput,
}

impl Default for LogPolicy {
    fn default() -> Self {
        Self { max_size: 64 * 1024 * 1024, keep: 5, output: LogOutput::Files }
    }
}

impl LogPolicy {
    /// The rotated copies kept per stream: `keep`, but none when the output goes to the
    /// journal alone (the live file is then only where lines wait to be sent).
    ///
    /// ```
    /// use tether_state::{LogOutput, LogPolicy};
    ///
    /// assert_eq!(LogPolicy { output: LogOutput::Both, ..LogPolicy::default() }.copies_kept(), 5);
    /// assert_eq!(LogPolicy { output: LogOutput::Journal, ..LogPolicy::default() }.copies_kept(), 0);
    /// ```
    pub fn copies_kept(&self) -> u32 {
        match self.output {
            LogOutput::Journal => 0,
            LogOutput::Files | LogOutput::Both => self.keep,
        }
    }
}

/// Where a proxy's output lines go (`log_target`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogOutput {
    /// The log files, rotated as the [`LogPolicy`] says.
    #[default]
    Files,
    /// The system journal; the live log file holds only the latest lines, with no copies.
    Journal,
    /// Both the log files and the journal.
    Both,
}

impl LogOutput {
    /// Whether lines are sent to the journal.
    pub fn to_journal(self) -> bool {
        matches!(self, LogOutput::Journal | LogOutput::Both)
    }

    /// The name in the config (`files`, `journal` or `both`).
    pub fn as_str(self) -> &'static str {
        match self {
            LogOutput::Files => "files",
            LogOutput::Journal => "journal",
            LogOutput::Both => "both",
        }
    }
}

/// What the agent does for a proxy beyond running its command: `kind` in the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ProxyKind {
    /// Nothing: the command runs as it is written.
    #[default]
    Plain,
    /// Envoy fed by the agent's xDS server: before each start the agent writes the proxy's
    /// bootstrap ([`crate::persist::DataDir::envoy_bootstrap_path`]) and the command is
    /// given `-c` and that file.
    Envoy {
        /// Envoy's admin port on 127.0.0.1; `None`: a free port, chosen before each start.
        admin_port: Option<u16>,
    },
}

/// The `[service.proxy]` table: how a service's managed proxy runs.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ProxySpec {
    /// How the proxy is run.
    pub exec_mode: ExecMode,
    /// What the agent does for it beyond running its command.
    pub kind: ProxyKind,
    /// What runs.
    pub command: ProxyCommand,
    /// The working directory (absolute), or the agent's when absent.
    pub working_dir: Option<PathBuf>,
    /// Added to the proxy's environment, after the `TETHER_*` variables.
    pub env: BTreeMap<String, String>,
    /// Pass the agent's whole environment through instead of a clean one.
    pub inherit_env: bool,
    /// The user (and its group) the proxy runs as.
    pub user: Option<String>,
    /// How the proxy is stopped.
    pub kill: KillPolicy,
    /// When the proxy is restarted.
    pub restart: RestartPolicy,
    /// How large its log files may grow.
    pub log: LogPolicy,
    /// Opaque configuration served to the proxy.
    pub config: ProxyConfigMap,
    /// When a started instance counts as ready; without one, once it runs. (Boxed, as are
    /// `liveness` and `reload`: most proxies have none, and an agent holds a spec per proxy.)
    pub readiness: Option<Box<Readiness>>,
    /// When a running instance is restarted because it stopped answering.
    pub liveness: Option<Box<Liveness>>,
    /// Sockets the agent binds and hands to every instance, in descriptor order from 3.
    pub listeners: Vec<Listener>,
    /// How a restart-requiring change replaces the running instance.
    pub update: UpdatePolicy,
    /// Its cgroup's limits, applied in place when they change.
    pub limits: ResourceLimits,
    /// How it reloads its files without a restart, when it can.
    pub reload: Option<Box<ReloadPolicy>>,
    /// Files the agent renders for it from the catalog, before each start and when their
    /// data changes.
    pub templates: Vec<crate::Template>,
    /// What must have started, or be ready, before it starts; stopped after it. A change
    /// applies in place: the engine orders starts and stops by it, the process never sees it.
    pub depends_on: DependsOn,
}

/// A service's managed proxy as the engine sees it: its id, its service, its spec and its
/// token, with the invariant that the service has a proxy.
#[derive(Debug, Clone, PartialEq)]
pub struct ManagedProxy {
    id: ProxyId,
    service: Arc<Service>,
    token: ProxyToken,
}

/// What a change from one version of a proxy to another requires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyChange {
    /// Nothing differs.
    Unchanged,
    /// Only what can be applied to the running process differs: `config`, the kill,
    /// restart, log and reload policies, or the service's name, address, port, tags or meta.
    InPlace,
    /// The command, working directory, environment, `inherit_env`, user, listeners,
    /// templates or token differs:
    /// the process must be stopped and started again.
    Restart,
}

impl ManagedProxy {
    /// The managed proxy of `service`, or `None` if the service has no proxy.
    pub fn new(service: Arc<Service>, token: ProxyToken) -> Option<Self> {
        service.proxy.as_ref()?;
        Some(Self { id: service.id.proxy_id(), service, token })
    }

    /// The proxy's id, `<service id>-proxy`.
    pub fn id(&self) -> &ProxyId {
        &self.id
    }

    /// The service the proxy belongs to.
    pub fn service(&self) -> &Service {
        &self.service
    }

    /// The service the proxy belongs to, shared: the catalog's own value, which whoever keeps
    /// it beside the proxy (the engine's snapshot records) holds without a copy.
    pub fn shared_service(&self) -> &Arc<Service> {
        &self.service
    }

    /// How the proxy runs.
    pub fn spec(&self) -> &ProxySpec {
        match &self.service.proxy {
            Some(spec) => spec,
            None => unreachable!("ManagedProxy::new refuses services without a proxy"),
        }
    }

    /// The proxy's secret token.
    pub fn token(&self) -> &ProxyToken {
        &self.token
    }

    /// What going from `self` to `new` requires: a restart when the token or what shapes the
    /// process changes (exec mode, command, working directory, environment, `inherit_env`,
    /// user, listeners, templates), a change in place for everything else.
    ///
    /// This is the one place that classifies a setting; a new setting is added here.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tether_state::{ManagedProxy, ProxyChange, ProxySpec, ProxyToken, Service, ServiceId, ServiceName};
    ///
    /// let token = ProxyToken::generate().unwrap();
    /// let service = Service::new(ServiceId::new("web").unwrap(), ServiceName::new("web").unwrap())
    ///     .with_proxy(ProxySpec::default());
    /// let old = ManagedProxy::new(Arc::new(service.clone()), token.clone()).unwrap();
    ///
    /// let mut moved = service.clone();
    /// moved.port = Some(9090);
    /// let new = ManagedProxy::new(Arc::new(moved), token.clone()).unwrap();
    /// assert_eq!(old.change_to(&new), ProxyChange::InPlace);
    ///
    /// let mut user = service;
    /// user.proxy.as_mut().unwrap().user = Some("nobody".into());
    /// let new = ManagedProxy::new(Arc::new(user), token).unwrap();
    /// assert_eq!(old.change_to(&new), ProxyChange::Restart);
    /// ```
    pub fn change_to(&self, new: &ManagedProxy) -> ProxyChange {
        if Arc::ptr_eq(&self.service, &new.service) && self.token == new.token {
            return ProxyChange::Unchanged;
        }
        let (old_spec, new_spec) = (self.spec(), new.spec());
        let restart = self.token != new.token
            || old_spec.exec_mode != new_spec.exec_mode
            || old_spec.command != new_spec.command
            || old_spec.kind != new_spec.kind
            || old_spec.working_dir != new_spec.working_dir
            || old_spec.env != new_spec.env
            || old_spec.inherit_env != new_spec.inherit_env
            || old_spec.user != new_spec.user
            || old_spec.listeners != new_spec.listeners
            // The proxy reads its files at start: a changed template renders before the
            // new instance starts.
            || old_spec.templates != new_spec.templates;
        if restart {
            ProxyChange::Restart
        } else if self.service != new.service {
            ProxyChange::InPlace
        } else {
            ProxyChange::Unchanged
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn web() -> Service {
        Service::new(ServiceId::new("web").unwrap(), ServiceName::new("web").unwrap()).with_proxy(ProxySpec::default())
    }

    #[track_caller]
    fn change(edit: impl FnOnce(&mut Service)) -> ProxyChange {
        let token = ProxyToken::from_hex("00112233445566778899aabbccddeeff").unwrap();
        let old = ManagedProxy::new(Arc::new(web()), token.clone()).unwrap();
        let mut service = web();
        edit(&mut service);
        let new = ManagedProxy::new(Arc::new(service), token).unwrap();
        old.change_to(&new)
    }

    fn spec(service: &mut Service) -> &mut ProxySpec {
        service.proxy.as_mut().unwrap()
    }

    #[test]
    fn fields_that_shape_the_process_need_a_restart() {
        assert_eq!(
            change(|s| spec(s).command = ProxyCommand::Exec(CommandLine::from_words(vec!["/bin/true".into()]).unwrap())),
            ProxyChange::Restart
        );
        assert_eq!(change(|s| spec(s).working_dir = Some("/srv".into())), ProxyChange::Restart);
        assert_eq!(change(|s| drop(spec(s).env.insert("A".into(), "1".into()))), ProxyChange::Restart);
        assert_eq!(change(|s| spec(s).inherit_env = true), ProxyChange::Restart);
        assert_eq!(change(|s| spec(s).user = Some("nobody".into())), ProxyChange::Restart);
        let listener = crate::Listener {
            name: crate::ListenerName::new("public").unwrap(),
            address: crate::ListenAddress::parse("127.0.0.1:21000").unwrap(),
        };
        assert_eq!(change(|s| spec(s).listeners.push(listener)), ProxyChange::Restart);
        let template = crate::Template::new(crate::TemplateSource::Inline("x".into()), "/etc/web.conf".into());
        assert_eq!(change(|s| spec(s).templates.push(template)), ProxyChange::Restart);
    }

    #[test]
    fn a_new_token_needs_a_restart() {
        let service = Arc::new(web());
        let old = ManagedProxy::new(service.clone(), ProxyToken::generate().unwrap()).unwrap();
        let new = ManagedProxy::new(service, ProxyToken::generate().unwrap()).unwrap();
        assert_eq!(old.change_to(&new), ProxyChange::Restart);
    }

    #[test]
    fn policies_config_and_service_fields_apply_in_place() {
        assert_eq!(change(|s| spec(s).kill.signal = KillSignal::Term), ProxyChange::InPlace);
        assert_eq!(change(|s| spec(s).kill.timeout = Duration::from_secs(1)), ProxyChange::InPlace);
        assert_eq!(change(|s| spec(s).restart.free_attempts = 0), ProxyChange::InPlace);
        assert_eq!(change(|s| spec(s).limits.pids_max = Some(64)), ProxyChange::InPlace);
        assert_eq!(change(|s| spec(s).limits.memory_max = Some(64 << 20)), ProxyChange::InPlace);
        assert_eq!(change(|s| spec(s).log.keep = 1), ProxyChange::InPlace);
        let reload = crate::ReloadPolicy::new(crate::ReloadAction::Signal(KillSignal::Hup));
        assert_eq!(change(|s| spec(s).reload = Some(Box::new(reload))), ProxyChange::InPlace);
        assert_eq!(change(|s| drop(spec(s).config.insert("bind_port".into(), 1.into()))), ProxyChange::InPlace);
        assert_eq!(change(|s| s.address = "10.0.0.1".into()), ProxyChange::InPlace);
        assert_eq!(change(|s| s.port = Some(1)), ProxyChange::InPlace);
        assert_eq!(change(|s| s.tags.push("v2".into())), ProxyChange::InPlace);
        assert_eq!(change(|s| drop(s.meta.insert("k".into(), "v".into()))), ProxyChange::InPlace);
        assert_eq!(change(|s| s.name = ServiceName::new("Web").unwrap()), ProxyChange::InPlace);
        assert_eq!(
            change(|s| spec(s).readiness = Some(Box::new(Readiness::new(crate::Probe::Notify)))),
            ProxyChange::InPlace
        );
        assert_eq!(
            change(|s| spec(s).liveness = Some(Box::new(Liveness::new(crate::Probe::Notify)))),
            ProxyChange::InPlace
        );
        assert_eq!(change(|s| spec(s).update.strategy = crate::UpdateStrategy::Overlap), ProxyChange::InPlace);
        assert_eq!(change(|s| spec(s).update.timeout = Duration::from_secs(1)), ProxyChange::InPlace);
        let dependency = crate::Dependency::new("db").unwrap();
        assert_eq!(
            change(|s| {
                spec(s).depends_on.insert(dependency, crate::Condition::Ready);
            }),
            ProxyChange::InPlace
        );
    }

    #[test]
    fn an_equal_copy_is_unchanged() {
        assert_eq!(change(|_| {}), ProxyChange::Unchanged);
    }

    #[test]
    fn a_service_without_proxy_has_no_managed_proxy() {
        let bare = Service::new(ServiceId::new("db").unwrap(), ServiceName::new("db").unwrap());
        assert!(ManagedProxy::new(Arc::new(bare), ProxyToken::generate().unwrap()).is_none());
    }

    #[test]
    fn backoff_doubles_from_one_second_up_to_the_cap() {
        let policy = RestartPolicy {
            free_attempts: 2,
            max_delay: Duration::from_secs(10),
            healthy_after: Duration::from_secs(1),
        };
        let delays: Vec<u64> = (1..=8).map(|n| policy.delay_before(n).as_secs()).collect();
        assert_eq!(delays, [0, 0, 1, 2, 4, 8, 10, 10]);
        assert_eq!(policy.delay_before(u32::MAX), Duration::from_secs(10));
        let none_free = RestartPolicy { free_attempts: 0, ..policy };
        assert_eq!(none_free.delay_before(1), Duration::from_secs(1));
        let sub_second = RestartPolicy { max_delay: Duration::from_millis(300), ..none_free };
        assert_eq!(sub_second.delay_before(5), Duration::from_millis(300));
        let always_free = RestartPolicy { free_attempts: u32::MAX, ..policy };
        assert_eq!(always_free.delay_before(u32::MAX), Duration::ZERO, "no overflow at the top of the range");
        assert_eq!(always_free.delay_before(7), Duration::ZERO);
    }

    fn policy(free_attempts: u32, max_delay_secs: u64) -> RestartPolicy {
        RestartPolicy {
            free_attempts,
            max_delay: Duration::from_secs(max_delay_secs),
            healthy_after: Duration::from_secs(10),
        }
    }

    #[test]
    fn a_healthy_run_resets_the_count() {
        let policy = policy(3, 60);
        assert_eq!(policy.next_attempt(7, Duration::from_secs(10)), 1);
        assert_eq!(policy.next_attempt(7, Duration::from_millis(9_999)), 8);
        assert_eq!(policy.next_attempt(0, Duration::ZERO), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn backoff_waits_follow_the_schedule_in_paused_time() {
        let policy = policy(1, 4);
        let start = tokio::time::Instant::now();
        let mut attempt = 0;
        let mut waited = Vec::new();
        for _ in 0..5 {
            attempt = policy.next_attempt(attempt, Duration::from_millis(5));
            let before = tokio::time::Instant::now();
            tokio::time::sleep(policy.delay_before(attempt)).await;
            waited.push((tokio::time::Instant::now() - before).as_secs());
        }
        assert_eq!(waited, [0, 1, 2, 4, 4]);
        assert_eq!((tokio::time::Instant::now() - start).as_secs(), 11);
    }

    #[test]
    fn a_failed_start_waits_at_least_a_tenth_of_a_second() {
        let policy = RestartPolicy {
            free_attempts: 2,
            max_delay: Duration::from_secs(10),
            healthy_after: Duration::from_secs(1),
        };
        let delays: Vec<u128> = (1..=6).map(|n| policy.delay_after_failed_start(n).as_millis()).collect();
        assert_eq!(delays, [100, 100, 1000, 2000, 4000, 8000]);
        let tiny_cap = RestartPolicy { max_delay: Duration::from_millis(30), ..policy };
        assert_eq!(tiny_cap.delay_after_failed_start(9), Duration::from_millis(100));
    }

    #[test]
    fn signal_names_parse_with_or_without_prefix() {
        assert_eq!(KillSignal::from_name("SIGTERM"), Some(KillSignal::Term));
        assert_eq!(KillSignal::from_name("term"), Some(KillSignal::Term));
        assert_eq!(KillSignal::from_name("sigusr2"), Some(KillSignal::Usr2));
        assert_eq!(KillSignal::from_name("SIGSEGV"), None);
        assert_eq!(KillSignal::from_name(""), None);
        for signal in KillSignal::ALL {
            assert_eq!(KillSignal::from_name(signal.name()), Some(signal));
        }
    }

    #[test]
    fn every_signal_is_sent_as_the_one_it_names() {
        for signal in KillSignal::ALL {
            assert_eq!(nix::sys::signal::Signal::from(signal).as_str(), signal.name());
        }
    }

    #[test]
    fn service_names_refuse_empty_long_and_control() {
        assert!(ServiceName::new("My Web").is_ok());
        assert_eq!(ServiceName::new("").unwrap_err().reason, "it is empty");
        assert!(ServiceName::new("a".repeat(257)).is_err());
        assert!(ServiceName::new("a\tb").is_err());
    }
}
