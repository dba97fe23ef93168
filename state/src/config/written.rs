//! The schema as written: every field explicit, so that a round trip is exact; and
//! `Service`'s serde in the schema's own form.

use super::*;

#[derive(Serialize)]
pub(super) struct FileOut<'a> {
    pub(super) service: Vec<ServiceOut<'a>>,
}

#[derive(Serialize)]
pub(super) struct ServiceOut<'a> {
    name: &'a ServiceName,
    id: &'a ServiceId,
    address: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    port: Option<u16>,
    tags: &'a [String],
    meta: &'a BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    proxy: Option<ProxyOut<'a>>,
}

#[derive(Serialize)]
pub(super) struct ProxyOut<'a> {
    exec_mode: ExecModeDef,
    #[serde(skip_serializing_if = "Option::is_none")]
    kind: Option<KindDef>,
    #[serde(skip_serializing_if = "Option::is_none")]
    admin_port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    command: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    working_dir: Option<&'a Path>,
    env: &'a BTreeMap<String, String>,
    inherit_env: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    user: Option<&'a str>,
    kill_signal: KillSignal,
    kill_timeout: String,
    log_max_size: u64,
    log_keep: u32,
    log_target: LogTargetDef,
    config: &'a ProxyConfigMap,
    restart: RestartOut,
    #[serde(skip_serializing_if = "Option::is_none")]
    readiness: Option<ProbeOut>,
    #[serde(skip_serializing_if = "Option::is_none")]
    liveness: Option<ProbeOut>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    listener: Vec<ListenerOut<'a>>,
    update: UpdateDef,
    update_timeout: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    drain_timeout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_generations: Option<u32>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    keep_listening: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    memory_max: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cpus: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pids_max: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reload: Option<ReloadOut<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    template: Vec<TemplateOut<'a>>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    depends_on: BTreeMap<&'a str, &'static str>,
}

#[derive(Serialize)]
pub(super) struct ReloadOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    signal: Option<KillSignal>,
    #[serde(skip_serializing_if = "Option::is_none")]
    exec: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    check: Option<Vec<String>>,
    #[serde(skip_serializing_if = "<[PathBuf]>::is_empty")]
    watch: &'a [PathBuf],
    timeout: String,
}

impl<'a> From<&'a ReloadPolicy> for ReloadOut<'a> {
    fn from(policy: &'a ReloadPolicy) -> Self {
        let (signal, exec) = match &policy.action {
            ReloadAction::Signal(signal) => (Some(*signal), None),
            ReloadAction::Exec(line) => (None, Some(line.to_words())),
        };
        Self {
            signal,
            exec,
            check: policy.check.as_ref().map(CommandLine::to_words),
            watch: &policy.watch,
            timeout: humantime::format_duration(policy.timeout).to_string(),
        }
    }
}

#[derive(Serialize)]
pub(super) struct ListenerOut<'a> {
    name: &'a str,
    address: String,
}

#[derive(Serialize, Default)]
pub(super) struct ProbeOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    tcp: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    http: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    exec: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    notify: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    log_line: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fd: Option<u32>,
    interval: String,
    timeout: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    failures: Option<u32>,
}

impl ProbeOut {
    fn new(probe: &Probe, interval: Duration, timeout: Duration, failures: Option<u32>) -> Self {
        let duration = |d: Duration| humantime::format_duration(d).to_string();
        let mut out = Self { interval: duration(interval), timeout: duration(timeout), failures, ..Self::default() };
        match probe {
            Probe::Tcp(target) => out.tcp = Some(target.as_str().to_owned()),
            Probe::Http(target) => out.http = Some(target.as_str().to_owned()),
            Probe::Exec(command) => out.exec = Some(command.to_words()),
            Probe::Notify => out.notify = Some(true),
            Probe::LogLine(pattern) => out.log_line = Some(pattern.as_str().to_owned()),
            Probe::Fd(fd) => out.fd = Some(*fd),
        }
        out
    }
}

#[derive(Serialize)]
pub(super) struct RestartOut {
    free_attempts: u32,
    max_delay: String,
    healthy_after: String,
}

impl<'a> From<&'a Service> for ServiceOut<'a> {
    fn from(service: &'a Service) -> Self {
        Self {
            name: &service.name,
            id: &service.id,
            address: &service.address,
            port: service.port,
            tags: &service.tags,
            meta: &service.meta,
            proxy: service.proxy.as_ref().map(ProxyOut::from),
        }
    }
}

impl<'a> From<&'a ProxySpec> for ProxyOut<'a> {
    fn from(spec: &'a ProxySpec) -> Self {
        let duration = |d: Duration| humantime::format_duration(d).to_string();
        Self {
            exec_mode: match spec.exec_mode {
                ExecMode::Daemon => ExecModeDef::Daemon,
            },
            kind: match spec.kind {
                ProxyKind::Envoy { .. } => Some(KindDef::Envoy),
                _ => None,
            },
            admin_port: match spec.kind {
                ProxyKind::Envoy { admin_port } => admin_port,
                _ => None,
            },
            command: match &spec.command {
                ProxyCommand::BuiltIn => None,
                ProxyCommand::Exec(line) => Some(line.to_words()),
            },
            working_dir: spec.working_dir.as_deref(),
            env: &spec.env,
            inherit_env: spec.inherit_env,
            user: spec.user.as_deref(),
            kill_signal: spec.kill.signal,
            kill_timeout: duration(spec.kill.timeout),
            log_max_size: spec.log.max_size,
            log_keep: spec.log.keep,
            log_target: spec.log.output.into(),
            config: &spec.config,
            restart: RestartOut {
                free_attempts: spec.restart.free_attempts,
                max_delay: duration(spec.restart.max_delay),
                healthy_after: duration(spec.restart.healthy_after),
            },
            readiness: spec.readiness.as_ref().map(|r| ProbeOut::new(&r.probe, r.interval, r.timeout, None)),
            liveness: spec.liveness.as_ref().map(|l| ProbeOut::new(&l.probe, l.interval, l.timeout, Some(l.failures))),
            listener: spec
                .listeners
                .iter()
                .map(|l| ListenerOut { name: l.name.as_str(), address: l.address.to_string() })
                .collect(),
            update: match spec.update.strategy {
                UpdateStrategy::Restart => UpdateDef::Restart,
                UpdateStrategy::Overlap => UpdateDef::Overlap,
                UpdateStrategy::Epoch => UpdateDef::Epoch,
            },
            update_timeout: duration(spec.update.timeout),
            // Written only where they apply: the schema refuses them beside another update.
            drain_timeout: (spec.update.strategy == UpdateStrategy::Epoch).then(|| duration(spec.update.drain_timeout)),
            max_generations: (spec.update.strategy == UpdateStrategy::Epoch).then_some(spec.update.max_generations),
            keep_listening: spec.update.strategy == UpdateStrategy::Epoch && spec.update.keep_listening,
            memory_max: spec.limits.memory_max,
            cpus: spec.limits.cpus.map(CpuLimit::cores),
            pids_max: spec.limits.pids_max,
            reload: spec.reload.as_deref().map(ReloadOut::from),
            template: spec.templates.iter().map(TemplateOut::from).collect(),
            depends_on: spec.depends_on.iter().map(|(name, condition)| (name.as_str(), condition.as_str())).collect(),
        }
    }
}

// ---------------------------------------------------------------------------------------
// `Service` in the schema's own form, for whoever stores services (the snapshot): written
// as a register body, read back through every check of the schema.

impl Serialize for Service {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        ServiceOut::from(self).serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Service {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Validated::deserialize(deserializer).map(|validated| validated.0)
    }
}
