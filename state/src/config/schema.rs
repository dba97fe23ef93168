//! The schema's private `serde` structs, as read: every value validated as it is read,
//! unknown keys refused. The schema as written is in `written.rs`.
//!
//! Only valid [`Service`] values leave this module; it performs no I/O.

use super::*;

// ---------------------------------------------------------------------------------------
// The schema, as read.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileDef {
    #[serde(default)]
    pub(super) service: Vec<Validated>,
    pub(super) connect: Option<ConnectDef>,
    #[serde(default)]
    pub(super) intention: Vec<IntentionDef>,
}

/// A service that passed every check; the struct-level checks run in `TryFrom`.
#[derive(Deserialize)]
#[serde(try_from = "ServiceDef")]
pub(super) struct Validated(pub(super) Service);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ServiceDef {
    name: ServiceName,
    id: Option<ServiceId>,
    address: Option<Address>,
    port: Option<u16>,
    tags: Option<Vec<Tag>>,
    meta: Option<BTreeMap<MetaKey, NoNul>>,
    proxy: Option<ProxyDef>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ProxyDef {
    exec_mode: Option<ExecModeDef>,
    kind: Option<KindDef>,
    admin_port: Option<u16>,
    command: Option<CommandDef>,
    working_dir: Option<AbsolutePath>,
    env: Option<BTreeMap<EnvKey, NoNul>>,
    inherit_env: Option<bool>,
    user: Option<UserName>,
    kill_signal: Option<KillSignal>,
    kill_timeout: Option<HumanDuration>,
    log_max_size: Option<ByteSize>,
    log_keep: Option<LogKeep>,
    log_target: Option<LogTargetDef>,
    config: Option<ConfigDef>,
    restart: Option<RestartDef>,
    readiness: Option<ReadinessDef>,
    liveness: Option<LivenessDef>,
    listener: Option<ListenersDef>,
    update: Option<UpdateDef>,
    update_timeout: Option<PositiveDuration>,
    drain_timeout: Option<PositiveDuration>,
    max_generations: Option<MaxGenerations>,
    keep_listening: Option<bool>,
    memory_max: Option<MemoryMax>,
    cpus: Option<Cpus>,
    pids_max: Option<PidsMax>,
    reload: Option<ReloadDef>,
    template: Option<TemplatesDef>,
    depends_on: Option<DependsOn>,
}

/// A `readiness` or `liveness` table as written: exactly one probe kind, its timing, and
/// (liveness only) its failure threshold. The checks that involve several keys run in
/// `TryFrom`, so that their errors name the table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ProbeDef {
    tcp: Option<TcpDef>,
    http: Option<HttpDef>,
    exec: Option<CommandDef>,
    notify: Option<bool>,
    log_line: Option<PatternDef>,
    fd: Option<NotifyFd>,
    interval: Option<PositiveDuration>,
    timeout: Option<PositiveDuration>,
    failures: Option<u32>,
}

impl ProbeDef {
    /// The one probe the table names.
    fn probe(&mut self) -> Result<Probe, String> {
        let mut probes = Vec::new();
        if let Some(tcp) = self.tcp.take() {
            probes.push(Probe::Tcp(tcp.0));
        }
        if let Some(http) = self.http.take() {
            probes.push(Probe::Http(http.0));
        }
        if let Some(exec) = self.exec.take() {
            probes.push(Probe::Exec(exec.0));
        }
        if self.notify == Some(true) {
            probes.push(Probe::Notify);
        }
        if let Some(pattern) = self.log_line.take() {
            probes.push(Probe::LogLine(pattern.0));
        }
        if let Some(fd) = self.fd.take() {
            probes.push(Probe::Fd(fd.0));
        }
        match probes.len() {
            1 => Ok(probes.remove(0)),
            0 => Err("no probe: give exactly one of tcp, http, exec, notify = true, log_line, fd".to_owned()),
            _ => {
                let kinds: Vec<&str> = probes.iter().map(Probe::kind).collect();
                Err(format!("{} probes ({}): give exactly one", kinds.len(), kinds.join(", ")))
            }
        }
    }
}

/// The `reload` table, checked: exactly one of `signal` and `exec`.
pub(super) struct ReloadDef(ReloadPolicy);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReloadFields {
    signal: Option<ReloadSignal>,
    exec: Option<CommandDef>,
    check: Option<CommandDef>,
    watch: Option<Vec<WatchPath>>,
    timeout: Option<PositiveDuration>,
}

impl<'de> Deserialize<'de> for ReloadDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let def = ReloadFields::deserialize(deserializer)?;
        let action = match (def.signal, def.exec) {
            (Some(signal), None) => ReloadAction::Signal(signal.0),
            (None, Some(exec)) => ReloadAction::Exec(exec.0),
            (Some(_), Some(_)) => {
                return Err(de::Error::custom("both `signal` and `exec`: a reload does exactly one"));
            }
            (None, None) => {
                return Err(de::Error::custom(
                    "no reload action: give exactly one of signal = \"SIG...\" or exec = [\"program\", ...]",
                ));
            }
        };
        let mut policy = ReloadPolicy::new(action);
        policy.check = def.check.map(|c| c.0);
        policy.watch = def.watch.unwrap_or_default().into_iter().map(|w| w.0).collect();
        if let Some(timeout) = def.timeout {
            policy.timeout = timeout.0;
        }
        Ok(Self(policy))
    }
}

/// A reload's `signal`.
struct ReloadSignal(KillSignal);

impl<'de> Deserialize<'de> for ReloadSignal {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        match KillSignal::from_name(&raw) {
            Some(KillSignal::Kill) | None => {
                let names: Vec<&str> =
                    KillSignal::ALL.iter().filter(|s| **s != KillSignal::Kill).map(|s| s.name()).collect();
                Err(de::Error::custom(format!("unknown reload signal {raw:?}: expected one of {}", names.join(", "))))
            }
            Some(signal) => Ok(Self(signal)),
        }
    }
}

/// A watched path: absolute.
struct WatchPath(PathBuf);

impl<'de> Deserialize<'de> for WatchPath {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        no_nul(&raw).map_err(de::Error::custom)?;
        let path = PathBuf::from(&raw);
        if !path.is_absolute() || path.file_name().is_none() {
            return Err(de::Error::custom(format!(
                "watched path {raw:?} must be an absolute path to a file or a directory"
            )));
        }
        Ok(Self(path))
    }
}

/// A `readiness` table, checked.
pub(super) struct ReadinessDef(Readiness);

impl<'de> Deserialize<'de> for ReadinessDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut def = ProbeDef::deserialize(deserializer)?;
        if def.failures.is_some() {
            return Err(de::Error::custom("`failures` applies to liveness only: readiness is probed until it passes"));
        }
        let mut readiness = Readiness::new(def.probe().map_err(de::Error::custom)?);
        if let Some(interval) = def.interval {
            readiness.interval = interval.0;
        }
        if let Some(timeout) = def.timeout {
            readiness.timeout = timeout.0;
        }
        Ok(Self(readiness))
    }
}

/// A `liveness` table, checked.
pub(super) struct LivenessDef(Liveness);

impl<'de> Deserialize<'de> for LivenessDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut def = ProbeDef::deserialize(deserializer)?;
        let probe = def.probe().map_err(de::Error::custom)?;
        if !probe.checks_liveness() {
            return Err(de::Error::custom(format!(
                "a `{}` probe tells only readiness; liveness takes tcp, http, exec or notify = true",
                probe.kind()
            )));
        }
        let mut liveness = Liveness::new(probe);
        if let Some(interval) = def.interval {
            liveness.interval = interval.0;
        }
        if let Some(timeout) = def.timeout {
            liveness.timeout = timeout.0;
        }
        match def.failures {
            Some(0) => return Err(de::Error::custom("`failures` must be at least 1")),
            Some(failures) => liveness.failures = failures,
            None => {}
        }
        Ok(Self(liveness))
    }
}

/// A `tcp` probe's `HOST:PORT`.
pub(super) struct TcpDef(TcpTarget);

impl<'de> Deserialize<'de> for TcpDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        TcpTarget::parse(&raw).map(Self).map_err(de::Error::custom)
    }
}

/// An `http` probe's URL.
pub(super) struct HttpDef(HttpTarget);

impl<'de> Deserialize<'de> for HttpDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        HttpTarget::parse(&raw).map(Self).map_err(de::Error::custom)
    }
}

/// A `log_line` probe's regular expression.
pub(super) struct PatternDef(LinePattern);

impl<'de> Deserialize<'de> for PatternDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        LinePattern::new(&raw).map(Self).map_err(de::Error::custom)
    }
}

/// The descriptor of an `fd` probe: 3 or more (0 to 2 are the standard streams).
pub(super) struct NotifyFd(u32);

/// The highest notification descriptor: below the usual soft limit of open files.
const MAX_NOTIFY_FD: u32 = 1023;

impl<'de> Deserialize<'de> for NotifyFd {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let fd = u32::deserialize(deserializer)?;
        if !(3..=MAX_NOTIFY_FD).contains(&fd) {
            return Err(de::Error::custom(format!(
                "invalid descriptor {fd}: must be 3 to {MAX_NOTIFY_FD} (0 to 2 are the standard streams)"
            )));
        }
        Ok(Self(fd))
    }
}

/// A duration that is not zero: an interval or a timeout.
pub(super) struct PositiveDuration(Duration);

impl<'de> Deserialize<'de> for PositiveDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let HumanDuration(duration) = HumanDuration::deserialize(deserializer)?;
        if duration.is_zero() {
            return Err(de::Error::custom("must be more than zero"));
        }
        Ok(Self(duration))
    }
}

/// `max_generations`: at least the generation that serves and the one that takes over.
pub(super) struct MaxGenerations(u32);

impl<'de> Deserialize<'de> for MaxGenerations {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let max = u32::deserialize(deserializer)?;
        if max < UpdatePolicy::MIN_GENERATIONS {
            return Err(de::Error::custom(format!(
                "max_generations {max} is too few: a hot restart runs the generation that serves and the one that \
                 takes over at once, so at least {}",
                UpdatePolicy::MIN_GENERATIONS
            )));
        }
        Ok(Self(max))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RestartDef {
    free_attempts: Option<u32>,
    max_delay: Option<HumanDuration>,
    healthy_after: Option<HumanDuration>,
}

#[derive(Deserialize, Serialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
pub(super) enum ExecModeDef {
    Daemon,
}

impl TryFrom<ServiceDef> for Validated {
    type Error = String;

    fn try_from(mut def: ServiceDef) -> Result<Self, String> {
        let id = match def.id {
            Some(id) => id,
            None => ServiceId::new(def.name.as_str())
                .map_err(|err| format!("no `id` is given, so the name must be a valid id: {err}"))?,
        };
        let mut service = Service::new(id, def.name);
        if let Some(address) = def.address {
            service.address = address.0;
        }
        service.port = def.port;
        service.tags = def.tags.unwrap_or_default().into_iter().map(|t| t.0).collect();
        service.meta = def.meta.unwrap_or_default().into_iter().map(|(k, v)| (k.0, v.0)).collect();
        if let Some(proxy) = &mut def.proxy {
            check_kind(proxy)?;
            check_epoch(proxy)?;
        }
        service.proxy = def.proxy.map(ProxySpec::from);
        if let Some(proxy) = &service.proxy {
            check_descriptors(proxy)?;
            check_reloads(proxy)?;
        }
        Ok(Self(service))
    }
}

/// `kind` as written: the one kind of proxy the agent does more for than run its command.
#[derive(Deserialize, Serialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(super) enum KindDef {
    Envoy,
}

/// The words of `command` that the agent itself gives an Envoy of `kind = "envoy"`.
const ENVOY_OWN_FLAGS: [&str; 5] = ["-c", "--config-path", "--config-yaml", "--restart-epoch", "--base-id"];

/// `kind = "envoy"`: `command` names Envoy and leaves its config and hot restart to the
/// agent; `update` defaults to "epoch", and an `admin_port` without a readiness check gets
/// Envoy's admin `/ready` as one. `admin_port` belongs to `kind = "envoy"` alone.
fn check_kind(proxy: &mut ProxyDef) -> Result<(), String> {
    let Some(KindDef::Envoy) = proxy.kind else {
        if proxy.admin_port.is_some() {
            return Err(
                "`proxy.admin_port` applies to kind = \"envoy\" only: remove it, or set kind = \"envoy\"".to_owned()
            );
        }
        return Ok(());
    };
    if proxy.user.is_some() {
        return Err(
            "`proxy.user` cannot be used with kind = \"envoy\": the bootstrap that the agent writes is readable \
                    by the agent's user only; run Envoy through `command` and `tether envoy bootstrap` instead"
                .to_owned(),
        );
    }
    if proxy.admin_port == Some(0) {
        return Err("`proxy.admin_port` must be a port from 1 to 65535; leave it out for a free port".to_owned());
    }
    match &proxy.command {
        None => {
            proxy.command = Some(CommandDef(CommandLine::from_words(vec!["envoy".to_owned()])?));
        }
        Some(command) => {
            let program = command.0.program();
            let name = program.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
            if !name.contains("envoy") {
                return Err(format!(
                    "`proxy.command` runs {:?}, which is not Envoy, and kind = \"envoy\" runs Envoy: name an Envoy \
                     binary (its file name contains \"envoy\"), leave `command` out for `envoy` from PATH, or remove \
                     `kind`",
                    program.display().to_string()
                ));
            }
            if let Some(own) = command.0.args().iter().find(|arg| {
                ENVOY_OWN_FLAGS.iter().any(|flag| arg.as_str() == *flag || arg.starts_with(&format!("{flag}=")))
            }) {
                return Err(format!(
                    "`proxy.command` holds {own:?}, which kind = \"envoy\" sets itself (the bootstrap, and the \
                     restart epoch and base id of update = \"epoch\"): remove it"
                ));
            }
        }
    }
    if proxy.update.is_none() {
        proxy.update = Some(UpdateDef::Epoch);
    }
    if let (Some(port), None) = (proxy.admin_port, &proxy.readiness) {
        let url = format!("http://127.0.0.1:{port}/ready");
        let mut readiness = Readiness::new(Probe::Http(HttpTarget::parse(&url)?));
        readiness.interval = ENVOY_READY_INTERVAL;
        proxy.readiness = Some(ReadinessDef(readiness));
    }
    Ok(())
}

/// How often a `kind = "envoy"` proxy with an `admin_port` and no readiness table is asked
/// whether it is ready.
const ENVOY_READY_INTERVAL: Duration = Duration::from_millis(200);

/// `drain_timeout`, `max_generations` and `keep_listening` belong to `update = "epoch"`, which alone replaces
/// the placeholders `{restart_epoch}` and `{base_id}`: with another `update` they are
/// refused rather than passed on as they are written.
fn check_epoch(proxy: &ProxyDef) -> Result<(), String> {
    if matches!(proxy.update, Some(UpdateDef::Epoch)) {
        // The sockets are kept from a generation once it is ready: without a check, that is
        // as soon as it runs, before it listens.
        if proxy.keep_listening == Some(true) && proxy.readiness.is_none() {
            return Err("`proxy.keep_listening` needs a readiness check that passes once the proxy listens \
                        (Envoy's admin /ready, say): add [service.proxy.readiness]"
                .to_owned());
        }
        return Ok(());
    }
    let update = match proxy.update {
        Some(UpdateDef::Overlap) => "overlap",
        _ => "restart",
    };
    for (key, given) in [
        ("drain_timeout", proxy.drain_timeout.is_some()),
        ("max_generations", proxy.max_generations.is_some()),
        ("keep_listening", proxy.keep_listening.is_some()),
    ] {
        if given {
            return Err(format!(
                "`proxy.{key}` applies to update = \"epoch\" only, and this proxy's update is \"{update}\": \
                 remove it, or set update = \"epoch\""
            ));
        }
    }
    let words = proxy.command.iter().flat_map(|command| command.0.to_words());
    let placeholder = words
        .filter_map(|word| crate::epoch_placeholder_in(&word).map(|p| ("command", p)))
        .chain(
            proxy
                .env
                .iter()
                .flatten()
                .filter_map(|(_, value)| crate::epoch_placeholder_in(&value.0).map(|p| ("env", p))),
        )
        .next();
    if let Some((field, placeholder)) = placeholder {
        return Err(format!(
            "`proxy.{field}` holds {placeholder}, which only update = \"epoch\" replaces, and this proxy's update is \
             \"{update}\": set update = \"epoch\", or remove the placeholder"
        ));
    }
    Ok(())
}

/// A template that reloads its proxy needs the proxy's `reload` table.
fn check_reloads(proxy: &ProxySpec) -> Result<(), String> {
    if proxy.reload.is_some() {
        return Ok(());
    }
    match proxy.templates.iter().position(|t| t.on_change == crate::OnChange::Reload) {
        Some(index) => Err(format!(
            "`proxy.template[{index}].on_change` is \"reload\", but the proxy has no [service.proxy.reload] table: \
             add one, or use \"restart\" or \"none\""
        )),
        None => Ok(()),
    }
}

impl From<ProxyDef> for ProxySpec {
    fn from(def: ProxyDef) -> Self {
        let kill_default = KillPolicy::default();
        let restart_default = RestartPolicy::default();
        let log_default = LogPolicy::default();
        let restart = def.restart.unwrap_or(RestartDef { free_attempts: None, max_delay: None, healthy_after: None });
        ProxySpec {
            exec_mode: match def.exec_mode {
                Some(ExecModeDef::Daemon) | None => ExecMode::Daemon,
            },
            kind: match def.kind {
                Some(KindDef::Envoy) => ProxyKind::Envoy { admin_port: def.admin_port },
                None => ProxyKind::Plain,
            },
            command: def.command.map_or(ProxyCommand::BuiltIn, |c| ProxyCommand::Exec(c.0)),
            working_dir: def.working_dir.map(|p| p.0),
            env: def.env.unwrap_or_default().into_iter().map(|(k, v)| (k.0, v.0)).collect(),
            inherit_env: def.inherit_env.unwrap_or(false),
            user: def.user.map(|u| u.0),
            kill: KillPolicy {
                signal: def.kill_signal.unwrap_or(kill_default.signal),
                timeout: def.kill_timeout.map_or(kill_default.timeout, |d| d.0),
            },
            restart: RestartPolicy {
                free_attempts: restart.free_attempts.unwrap_or(restart_default.free_attempts),
                max_delay: restart.max_delay.map_or(restart_default.max_delay, |d| d.0),
                healthy_after: restart.healthy_after.map_or(restart_default.healthy_after, |d| d.0),
            },
            log: LogPolicy {
                max_size: def.log_max_size.map_or(log_default.max_size, |s| s.0),
                keep: def.log_keep.map_or(log_default.keep, |k| k.0),
                output: def.log_target.map_or(log_default.output, LogOutput::from),
            },
            config: def.config.map(|c| c.0).unwrap_or_default(),
            readiness: def.readiness.map(|r| Box::new(r.0)),
            liveness: def.liveness.map(|l| Box::new(l.0)),
            listeners: def.listener.map(|l| l.0).unwrap_or_default(),
            update: UpdatePolicy {
                strategy: match def.update {
                    Some(UpdateDef::Overlap) => UpdateStrategy::Overlap,
                    Some(UpdateDef::Epoch) => UpdateStrategy::Epoch,
                    Some(UpdateDef::Restart) | None => UpdateStrategy::Restart,
                },
                timeout: def.update_timeout.map_or(UpdatePolicy::default().timeout, |d| d.0),
                drain_timeout: def.drain_timeout.map_or(UpdatePolicy::DRAIN_TIMEOUT, |d| d.0),
                max_generations: def.max_generations.map_or(UpdatePolicy::MAX_GENERATIONS, |m| m.0),
                keep_listening: def.keep_listening.unwrap_or(false),
            },
            limits: ResourceLimits {
                memory_max: def.memory_max.map(|m| m.0),
                cpus: def.cpus.map(|c| c.0),
                pids_max: def.pids_max.map(|p| p.0),
            },
            templates: def.template.map(|t| t.resolve(def.reload.is_some())).unwrap_or_default(),
            reload: def.reload.map(|r| Box::new(r.0)),
            depends_on: def.depends_on.unwrap_or_default(),
        }
    }
}

/// Declares a string newtype that validates while it is deserialized.
macro_rules! checked_string {
    ($(#[$doc:meta])* $name:ident, $check:expr) => {
        $(#[$doc])*
        #[derive(PartialEq, Eq, PartialOrd, Ord)]
        struct $name(String);

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let raw = String::deserialize(deserializer)?;
                let check: fn(&str) -> Result<(), String> = $check;
                check(&raw).map_err(de::Error::custom)?;
                Ok(Self(raw))
            }
        }
    };
}

pub(super) fn no_nul(s: &str) -> Result<(), String> {
    if s.contains('\0') { Err("must not contain NUL bytes".to_owned()) } else { Ok(()) }
}

checked_string!(
    /// A value that can be passed to a process: no NUL.
    NoNul,
    no_nul
);
checked_string!(
    /// A service address: a host name or IP address.
    Address,
    |s| {
        if s.is_empty() || s.len() > 253 {
            return Err(format!("invalid address {s:?}: must be 1 to 253 bytes"));
        }
        if s.chars().any(|c| c.is_whitespace() || c.is_control() || c == '/') {
            return Err(format!("invalid address {s:?}: must be a host name or an IP address"));
        }
        Ok(())
    }
);
checked_string!(
    /// A tag: not empty, no control characters.
    Tag,
    |s| {
        if s.is_empty() || s.chars().any(char::is_control) {
            return Err(format!("invalid tag {s:?}: must be non-empty, without control characters"));
        }
        Ok(())
    }
);
checked_string!(
    /// A meta key: not empty, no control characters.
    MetaKey,
    |s| {
        if s.is_empty() || s.chars().any(char::is_control) {
            return Err(format!("invalid meta key {s:?}: must be non-empty, without control characters"));
        }
        Ok(())
    }
);
checked_string!(
    /// An environment variable name the proxy may be given.
    EnvKey,
    |s| {
        let mut chars = s.chars();
        let well_formed = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !well_formed {
            return Err(format!("invalid environment variable name {s:?}: must match ^[A-Za-z_][A-Za-z0-9_]*$"));
        }
        if s.starts_with(crate::proxy_env::PREFIX) {
            return Err(format!("environment variable {s} is reserved: tether sets the TETHER_* variables itself"));
        }
        Ok(())
    }
);
checked_string!(
    /// A user name (or numeric uid) to run the proxy as.
    UserName,
    |s| {
        if s.is_empty() || s.len() > 256 || s.chars().any(|c| c.is_whitespace() || c.is_control() || c == ':' || c == '/') {
            return Err(format!("invalid user {s:?}: must be a user name or a numeric uid"));
        }
        Ok(())
    }
);

pub(super) struct AbsolutePath(PathBuf);

impl<'de> Deserialize<'de> for AbsolutePath {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        no_nul(&raw).map_err(de::Error::custom)?;
        let path = PathBuf::from(&raw);
        if !path.is_absolute() {
            return Err(de::Error::custom(format!("working_dir {raw:?} must be an absolute path")));
        }
        Ok(Self(path))
    }
}

pub(super) struct CommandDef(CommandLine);

impl<'de> Deserialize<'de> for CommandDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let words = Vec::<String>::deserialize(deserializer)?;
        if words.iter().any(|w| w.contains('\0')) {
            return Err(de::Error::custom("command words must not contain NUL bytes"));
        }
        CommandLine::from_words(words).map(Self).map_err(de::Error::custom)
    }
}

/// The opaque `config` table. Any value JSON can hold is accepted; TOML's `nan` and `inf`
/// are refused here, because `serde_json` would quietly turn them into `null`, which the
/// proxy never asked for and which TOML cannot even write back.
pub(super) struct ConfigDef(ProxyConfigMap);

impl<'de> Deserialize<'de> for ConfigDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TableVisitor;

        impl<'de> Visitor<'de> for TableVisitor {
            type Value = ProxyConfigMap;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map")
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<ProxyConfigMap, A::Error> {
                read_config_map(map, 1)
            }
        }

        deserializer.deserialize_map(TableVisitor).map(Self)
    }
}

/// Reads the entries of a table inside `config` that is `depth` deep.
pub(super) fn read_config_map<'de, A: de::MapAccess<'de>>(
    mut map: A,
    depth: usize,
) -> Result<ProxyConfigMap, A::Error> {
    let mut values = ProxyConfigMap::new();
    while let Some(key) = map.next_key::<String>()? {
        let value = map.next_value_seed(ConfigValue { container_depth: depth })?;
        values.insert(key, value);
    }
    Ok(values)
}

/// One value inside `config`, read like `serde_json::Value` but without non-finite floats,
/// and no deeper than [`MAX_CONFIG_DEPTH`].
#[derive(Clone, Copy)]
pub(super) struct ConfigValue {
    /// How deep the table or array that holds the value is.
    container_depth: usize,
}

impl ConfigValue {
    /// The depth of a table or array read as this value, or an error past the limit. Checked
    /// before its entries are read, so that no input recurses further.
    fn nested<E: de::Error>(self) -> Result<usize, E> {
        let depth = self.container_depth + 1;
        if depth > MAX_CONFIG_DEPTH {
            return Err(E::custom(format!(
                "`config` nests tables and arrays more than {MAX_CONFIG_DEPTH} deep (counting `config` itself)"
            )));
        }
        Ok(depth)
    }
}

impl<'de> DeserializeSeed<'de> for ConfigValue {
    type Value = serde_json::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<serde_json::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ConfigValue {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any value JSON can hold")
    }

    fn visit_bool<E: de::Error>(self, value: bool) -> Result<Self::Value, E> {
        Ok(value.into())
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Self::Value, E> {
        Ok(value.into())
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Self::Value, E> {
        Ok(value.into())
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<Self::Value, E> {
        serde_json::Number::from_f64(value).map(serde_json::Value::Number).ok_or_else(|| {
            E::custom(format!("{value} cannot be passed to the proxy as JSON: use a finite number or a string"))
        })
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Self::Value, E> {
        Ok(value.into())
    }

    fn visit_string<E: de::Error>(self, value: String) -> Result<Self::Value, E> {
        Ok(value.into())
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        DeserializeSeed::deserialize(self, deserializer)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let depth = self.nested()?;
        let mut values = Vec::new();
        while let Some(value) = seq.next_element_seed(ConfigValue { container_depth: depth })? {
            values.push(value);
        }
        Ok(serde_json::Value::Array(values))
    }

    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        let depth = self.nested()?;
        read_config_map(map, depth).map(serde_json::Value::Object)
    }
}

pub(super) struct LogKeep(u32);

/// `log_target`: where a proxy's output goes.
#[derive(Deserialize, Serialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
pub(super) enum LogTargetDef {
    Files,
    Journal,
    Both,
}

impl From<LogTargetDef> for LogOutput {
    fn from(def: LogTargetDef) -> Self {
        match def {
            LogTargetDef::Files => LogOutput::Files,
            LogTargetDef::Journal => LogOutput::Journal,
            LogTargetDef::Both => LogOutput::Both,
        }
    }
}

impl From<LogOutput> for LogTargetDef {
    fn from(output: LogOutput) -> Self {
        match output {
            LogOutput::Files => LogTargetDef::Files,
            LogOutput::Journal => LogTargetDef::Journal,
            LogOutput::Both => LogTargetDef::Both,
        }
    }
}

impl<'de> Deserialize<'de> for LogKeep {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let keep = u32::deserialize(deserializer)?;
        if keep > 1000 {
            return Err(de::Error::custom(format!("log_keep {keep} is more than 1000 files")));
        }
        Ok(Self(keep))
    }
}

pub(super) struct HumanDuration(pub(super) Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        humantime::parse_duration(&raw).map(Self).map_err(|err| {
            de::Error::custom(format!("invalid duration {raw:?}: {err} (examples: \"500ms\", \"5s\", \"1m\")"))
        })
    }
}

/// A size in bytes: an integer, or a string such as `"64MiB"`, `"10MB"`, `"512KiB"`.
pub(super) struct ByteSize(u64);

/// The smallest log size cap: rotation of smaller files would churn.
pub(super) const MIN_LOG_SIZE: u64 = 4096;

impl ByteSize {
    fn parse(raw: &str) -> Result<u64, String> {
        let raw = raw.trim();
        let split = raw.find(|c: char| !c.is_ascii_digit()).unwrap_or(raw.len());
        let (digits, unit) = raw.split_at(split);
        let number: u64 = digits
            .parse()
            .map_err(|_| format!("invalid size {raw:?}: expected a number of bytes such as \"64MiB\""))?;
        let factor: u64 = match unit.trim() {
            "" | "B" => 1,
            "K" | "KB" => 1000,
            "KiB" => 1 << 10,
            "M" | "MB" => 1000 * 1000,
            "MiB" => 1 << 20,
            "G" | "GB" => 1000 * 1000 * 1000,
            "GiB" => 1 << 30,
            other => {
                return Err(format!(
                    "invalid size {raw:?}: unknown unit {other:?} (use B, KB, KiB, MB, MiB, GB or GiB)"
                ));
            }
        };
        number.checked_mul(factor).ok_or_else(|| format!("invalid size {raw:?}: too large"))
    }

    fn checked(bytes: u64) -> Result<Self, String> {
        if bytes < MIN_LOG_SIZE {
            return Err(format!("log_max_size of {bytes} bytes is below the minimum of {MIN_LOG_SIZE}"));
        }
        Ok(Self(bytes))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_size(deserializer, ByteSize::checked)
    }
}

/// A size given as a number of bytes or a string such as `"64MiB"`, then `check`ed.
pub(super) fn deserialize_size<'de, D: Deserializer<'de>, T>(
    deserializer: D,
    check: fn(u64) -> Result<T, String>,
) -> Result<T, D::Error> {
    struct SizeVisitor<T>(fn(u64) -> Result<T, String>);

    impl<T> Visitor<'_> for SizeVisitor<T> {
        type Value = T;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a size such as \"64MiB\" or a number of bytes")
        }

        fn visit_u64<E: de::Error>(self, bytes: u64) -> Result<T, E> {
            (self.0)(bytes).map_err(E::custom)
        }

        fn visit_i64<E: de::Error>(self, bytes: i64) -> Result<T, E> {
            let bytes = u64::try_from(bytes).map_err(|_| E::custom("a size cannot be negative"))?;
            self.visit_u64(bytes)
        }

        fn visit_str<E: de::Error>(self, raw: &str) -> Result<T, E> {
            ByteSize::parse(raw).and_then(self.0).map_err(E::custom)
        }
    }

    deserializer.deserialize_any(SizeVisitor(check))
}

impl<'de> Deserialize<'de> for KillSignal {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        KillSignal::from_name(&raw).ok_or_else(|| {
            let names: Vec<&str> = KillSignal::ALL.iter().map(|s| s.name()).collect();
            de::Error::custom(format!("unknown kill_signal {raw:?}: expected one of {}", names.join(", ")))
        })
    }
}

impl Serialize for KillSignal {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Dependency {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        Dependency::new(raw).map_err(|err| de::Error::custom(format!("invalid dependency: {err}")))
    }
}

impl<'de> Deserialize<'de> for Condition {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        Condition::from_name(&raw)
            .ok_or_else(|| de::Error::custom(format!("unknown condition {raw:?}: expected \"started\" or \"ready\"")))
    }
}

impl<'de> Deserialize<'de> for ServiceName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        ServiceName::new(raw).map_err(de::Error::custom)
    }
}

impl Serialize for ServiceName {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}
