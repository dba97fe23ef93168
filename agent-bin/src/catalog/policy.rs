//! What the agent refuses besides the catalog's own rules: the settings that the register
//! API may not make without `--allow-api-commands`, and the user lookup through which the
//! engine tells which proxies would run as root.
//!
//! Config files are the operator's and may set anything. The register API answers any local
//! process that can open the socket, so what runs, as whom, where and under which loader and
//! libc variables is not its to choose unless the operator says so. This module only
//! answers questions; it changes nothing.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, ToSocketAddrs};

use serde::Deserialize;
use serde::de::IgnoredAny;
use tether_manager::UserLookup;
use tether_state::{ListenAddress, Probe, ProxyCommand, ReloadAction, Service, ServiceId};

/// A proxy setting that the register API may not make without `--allow-api-commands`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ApiSetting {
    /// `command`, even an empty or invalid one: the refusal comes before the value's check.
    Command,
    /// `user`.
    User,
    /// `working_dir`.
    WorkingDir,
    /// `inherit_env` set to anything but `false`.
    InheritEnv,
    /// `template`, even an empty list: the agent would write files wherever it says.
    Template,
    /// An `env` variable that the dynamic loader or libc reads ([`is_loader_variable`]).
    Env(String),
    /// An `exec` probe of `readiness` (`false`) or `liveness` (`true`): a program the agent
    /// runs, like `command`.
    ExecProbe { liveness: bool },
    /// A program of `reload`: its `exec` (`false`) or its `check` (`true`), which the agent
    /// runs, like `command`.
    ReloadProgram { check: bool },
    /// A listener the agent would bind with its own rights: a Unix socket file (created,
    /// or a stale one replaced, at any path) or a TCP port below 1024.
    Listener,
    /// An address that the agent or the built-in proxy would bind or connect to, and that
    /// is not on this host's loopback: it would expose a port to the network, or make the
    /// agent a relay to any host.
    Address {
        /// The setting, such as `proxy.readiness.http`.
        key: &'static str,
        /// The address, as given.
        address: String,
        /// What it means: why it is refused.
        why: AddressProblem,
    },
    /// A port below 1024 that the built-in proxy would bind (`proxy.config.bind_port`).
    PrivilegedPort {
        /// The port.
        port: u64,
    },
}

/// Whether binding `address` (a listener's, as written) uses the agent's own rights: a
/// path, or a port below 1024.
fn privileged_listener(address: &str) -> bool {
    address.starts_with('/')
        || address.rsplit_once(':').and_then(|(_, port)| port.parse::<u16>().ok()).is_some_and(|port| port < 1024)
}

impl ApiSetting {
    /// Why the setting is refused, beyond being what runs and how.
    pub(crate) fn note(&self) -> String {
        match self {
            Self::Env(_) => " (the dynamic loader or libc reads it)".to_owned(),
            Self::Listener => {
                " (the agent binds it with its own rights: a socket file, or a port below 1024)".to_owned()
            }
            Self::Address { address, why, .. } => format!(" to `{}`, which {why}", address.escape_default()),
            Self::PrivilegedPort { port } => format!(" to {port} (a port below 1024)"),
            _ => String::new(),
        }
    }
}

/// Why an address is not loopback, or cannot be shown to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AddressProblem {
    /// It means this address, which is not on the loopback.
    NotLoopback(IpAddr),
    /// It is a host name: resolved again at every use, it proves nothing now.
    Name,
}

impl fmt::Display for AddressProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotLoopback(ip) if ip.is_unspecified() => write!(f, "means {ip}: every address of this host"),
            Self::NotLoopback(ip) => write!(f, "means {ip}, not this host's loopback"),
            Self::Name => f.write_str("is a host name, not a loopback address (use 127.0.0.1, ::1 or localhost)"),
        }
    }
}

/// Judges a host (a name, an IPv4 address in any form the system's resolver reads, or an
/// IPv6 address, bracketed or not) by what it means when the agent uses it: `Ok` when it is
/// on the loopback.
///
/// IPv4 is read as `getaddrinfo` reads a numeric host, so that `0` (0.0.0.0), `127.1`,
/// `0x7f000001` and `2130706433` are judged by the address they mean; an IPv4-mapped IPv6
/// address by its IPv4 address. The only name taken is `localhost`, judged by what it
/// resolves to now; any other name is refused, since it could resolve elsewhere later.
///
/// # Errors
///
/// The [`AddressProblem`].
pub(crate) fn judge_host(host: &str) -> Result<(), AddressProblem> {
    let bare = host.strip_prefix('[').and_then(|inner| inner.strip_suffix(']')).unwrap_or(host);
    let ip = if let Some(ipv4) = numeric_ipv4(bare) {
        IpAddr::V4(ipv4)
    } else if let Ok(ipv6) = bare.parse::<Ipv6Addr>() {
        ipv6.to_ipv4_mapped().map_or(IpAddr::V6(ipv6), IpAddr::V4)
    } else if bare.eq_ignore_ascii_case("localhost") || bare.eq_ignore_ascii_case("localhost.") {
        // The hosts file decides what `localhost` means, and every use reads it again.
        let resolved: Vec<IpAddr> = match (bare, 0).to_socket_addrs() {
            Ok(addresses) => addresses.map(|address| address.ip()).collect(),
            Err(_) => return Err(AddressProblem::Name),
        };
        return match resolved.into_iter().find(|ip| !ip.is_loopback()) {
            Some(elsewhere) => Err(AddressProblem::NotLoopback(elsewhere)),
            None => Ok(()),
        };
    } else {
        return Err(AddressProblem::Name);
    };
    if ip.is_loopback() { Ok(()) } else { Err(AddressProblem::NotLoopback(ip)) }
}

/// An IPv4 address in the forms the C library's `inet_aton` reads, which `getaddrinfo` uses
/// for a numeric host: one to four parts separated by dots, each decimal, octal (a leading
/// `0`) or hexadecimal (`0x`), the last part filling the bytes that remain (`127.1` is
/// 127.0.0.1, `2130706433` is 127.0.0.1).
fn numeric_ipv4(text: &str) -> Option<Ipv4Addr> {
    let parts: Vec<&str> = text.split('.').collect();
    if parts.len() > 4 {
        return None;
    }
    let mut values = Vec::with_capacity(parts.len());
    for part in &parts {
        let (digits, radix) = if let Some(hex) = part.strip_prefix("0x").or_else(|| part.strip_prefix("0X")) {
            (hex, 16)
        } else if part.len() > 1 && part.starts_with('0') {
            (&part[1..], 8)
        } else {
            (*part, 10)
        };
        if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
            return None;
        }
        values.push(u32::from_str_radix(digits, radix).ok()?);
    }
    let (last, leading) = values.split_last()?;
    if leading.iter().any(|&value| value > 0xff) {
        return None;
    }
    let room = 32 - 8 * leading.len() as u32;
    if room < 32 && *last >= 1 << room {
        return None;
    }
    let high = leading.iter().enumerate().fold(0u32, |acc, (at, &value)| acc | value << (24 - 8 * at as u32));
    Some(Ipv4Addr::from(high | last))
}

/// The HOST of `HOST:PORT` (HOST possibly bracketed); the whole text without a port.
fn host_of(address: &str) -> &str {
    match address.rsplit_once(':') {
        Some((host, _)) if !host.is_empty() && (!host.contains(':') || host.starts_with('[')) => host,
        _ => address,
    }
}

impl fmt::Display for ApiSetting {
    /// The setting's key in the register body, such as `proxy.env.LD_PRELOAD`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Command => f.write_str("proxy.command"),
            Self::User => f.write_str("proxy.user"),
            Self::WorkingDir => f.write_str("proxy.working_dir"),
            Self::InheritEnv => f.write_str("proxy.inherit_env"),
            Self::Template => f.write_str("proxy.template"),
            // Not yet validated when it comes from a body: escaped, so that it cannot forge
            // log lines.
            Self::Env(name) => write!(f, "proxy.env.{}", name.escape_default()),
            Self::ExecProbe { liveness: false } => f.write_str("proxy.readiness.exec"),
            Self::ExecProbe { liveness: true } => f.write_str("proxy.liveness.exec"),
            Self::ReloadProgram { check: false } => f.write_str("proxy.reload.exec"),
            Self::ReloadProgram { check: true } => f.write_str("proxy.reload.check"),
            Self::Listener => f.write_str("proxy.listener.address"),
            Self::Address { key, .. } => f.write_str(key),
            Self::PrivilegedPort { .. } => f.write_str("proxy.config.bind_port"),
        }
    }
}

/// Whether the dynamic loader or libc reads the environment variable `name`, so that setting
/// it chooses code or files that the proxy's program loads.
///
/// The reference is glibc's list of the variables it removes from the environment of setuid
/// programs (`UNSECURE_ENVVARS` in `sysdeps/generic/unsecvars.h`), widened to every `LD_*`
/// name (loaders other than glibc's, and variables added to the list later) and every
/// `MALLOC_*` name (glibc's older malloc settings, and other allocators').
pub(crate) fn is_loader_variable(name: &str) -> bool {
    const UNSECURE: &[&str] = &[
        "GCONV_PATH",
        "GETCONF_DIR",
        "GLIBC_TUNABLES",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "LOCPATH",
        "NIS_PATH",
        "NLSPATH",
        "RESOLV_HOST_CONF",
        "RES_OPTIONS",
        "TMPDIR",
        "TZDIR",
    ];
    name.starts_with("LD_") || name.starts_with("MALLOC_") || UNSECURE.contains(&name)
}

/// What a proxy sets among the settings the API may not make, however it was read.
struct Settings<'a> {
    command: bool,
    user: bool,
    working_dir: bool,
    inherit_env: bool,
    template: bool,
    env: Vec<&'a str>,
    /// An `exec` probe in `readiness`, in `liveness`.
    exec_probes: [bool; 2],
    /// The `exec` of `reload`, its `check`.
    reload_programs: [bool; 2],
    /// A listener that [`privileged_listener`] says binds with the agent's rights.
    privileged_listener: bool,
}

impl Settings<'_> {
    /// The first refused setting, in the schema's order.
    fn first_refused(&self) -> Option<ApiSetting> {
        let fixed = [
            (self.command, ApiSetting::Command),
            (self.user, ApiSetting::User),
            (self.working_dir, ApiSetting::WorkingDir),
            (self.inherit_env, ApiSetting::InheritEnv),
            (self.template, ApiSetting::Template),
        ];
        if let Some((_, setting)) = fixed.into_iter().find(|(set, _)| *set) {
            return Some(setting);
        }
        if let Some(name) = self.env.iter().find(|name| is_loader_variable(name)) {
            return Some(ApiSetting::Env((*name).to_owned()));
        }
        if let Some(at) = self.exec_probes.iter().position(|&set| set) {
            return Some(ApiSetting::ExecProbe { liveness: at == 1 });
        }
        if let Some(at) = self.reload_programs.iter().position(|&set| set) {
            return Some(ApiSetting::ReloadProgram { check: at == 1 });
        }
        self.privileged_listener.then_some(ApiSetting::Listener)
    }
}

/// The first setting of `service` that the register API may not make, if any.
pub(crate) fn refused_setting(service: &Service) -> Option<ApiSetting> {
    let proxy = service.proxy.as_ref()?;
    let setting = Settings {
        command: matches!(proxy.command, ProxyCommand::Exec(_)),
        user: proxy.user.is_some(),
        working_dir: proxy.working_dir.is_some(),
        inherit_env: proxy.inherit_env,
        template: !proxy.templates.is_empty(),
        env: proxy.env.keys().map(String::as_str).collect(),
        exec_probes: [
            proxy.readiness.as_ref().is_some_and(|check| matches!(check.probe, Probe::Exec(_))),
            proxy.liveness.as_ref().is_some_and(|check| matches!(check.probe, Probe::Exec(_))),
        ],
        reload_programs: [
            proxy.reload.as_ref().is_some_and(|reload| matches!(reload.action, ReloadAction::Exec(_))),
            proxy.reload.as_ref().is_some_and(|reload| reload.check.is_some()),
        ],
        privileged_listener: proxy.listeners.iter().any(|l| privileged_listener(&l.address.to_string())),
    }
    .first_refused();
    setting.or_else(|| refused_address(service))
}

/// The first address of `service` that the agent or the built-in proxy would bind or
/// connect to and that is not loopback, or a port below 1024 that the built-in proxy would
/// bind. The register API cannot set `command`, so the proxy's `config` is the built-in
/// proxy's: `bind_address`, `bind_port`, and `local_service_address`, or else the
/// service's own address, to which it forwards.
fn refused_address(service: &Service) -> Option<ApiSetting> {
    let proxy = service.proxy.as_ref()?;
    let config_str = |key: &str| proxy.config.get(key).and_then(serde_json::Value::as_str);
    let mut addresses: Vec<(&'static str, String, &str)> = Vec::new();
    for listener in &proxy.listeners {
        if let ListenAddress::Tcp(target) = &listener.address {
            addresses.push(("proxy.listener.address", target.to_string(), host_of(target.as_str())));
        }
    }
    if let Some(bind) = config_str("bind_address") {
        addresses.push(("proxy.config.bind_address", bind.to_owned(), bind));
    }
    // What an Envoy fed over xDS binds for the proxy's upstreams, as the built-in proxy
    // binds `bind_address`.
    let upstreams = proxy.config.get("upstreams").and_then(serde_json::Value::as_array).into_iter().flatten();
    for bind in upstreams.filter_map(|upstream| upstream.get("local_bind_address")?.as_str()) {
        addresses.push(("proxy.config.upstreams.local_bind_address", bind.to_owned(), bind));
    }
    match config_str("local_service_address") {
        Some(upstream) => {
            addresses.push(("proxy.config.local_service_address", upstream.to_owned(), host_of(upstream)))
        }
        None => addresses.push(("address", service.address.clone(), &service.address)),
    }
    let checks = [
        (proxy.readiness.as_ref().map(|check| &check.probe), "proxy.readiness.tcp", "proxy.readiness.http"),
        (proxy.liveness.as_ref().map(|check| &check.probe), "proxy.liveness.tcp", "proxy.liveness.http"),
    ];
    for (probe, tcp_key, http_key) in checks {
        match probe {
            Some(Probe::Tcp(target)) => addresses.push((tcp_key, target.to_string(), host_of(target.as_str()))),
            Some(Probe::Http(url)) => addresses.push((http_key, url.to_string(), host_of(url.authority().as_str()))),
            _ => {}
        }
    }
    for (key, address, host) in addresses {
        if let Err(why) = judge_host(host) {
            return Some(ApiSetting::Address { key, address, why });
        }
    }
    let bind_port = proxy.config.get("bind_port").and_then(serde_json::Value::as_u64);
    bind_port.filter(|port| (1..1024).contains(port)).map(|port| ApiSetting::PrivilegedPort { port })
}

/// The first setting that a register body makes and the API may not, looked for before the
/// body is validated, so that a refusal wins over an invalid value (`"command": []` is
/// refused, not reported as an empty command). Also the id the body names, if it is a valid
/// one, for the message.
///
/// Returns `None` when the body does not even have the shape of a service; the parser then
/// says what is wrong with it, and [`refused_setting`] checks what it reads.
pub(crate) fn refused_in_body(text: &str) -> Option<(Option<ServiceId>, ApiSetting)> {
    /// The parts of a service object that matter here; everything else is ignored.
    #[derive(Deserialize)]
    struct BodyProbe {
        id: Option<serde_json::Value>,
        name: Option<serde_json::Value>,
        proxy: Option<ProxyProbe>,
    }

    #[derive(Deserialize)]
    struct ProxyProbe {
        command: Option<IgnoredAny>,
        user: Option<IgnoredAny>,
        working_dir: Option<IgnoredAny>,
        inherit_env: Option<serde_json::Value>,
        template: Option<IgnoredAny>,
        env: Option<BTreeMap<String, IgnoredAny>>,
        readiness: Option<CheckProbe>,
        liveness: Option<CheckProbe>,
        reload: Option<ReloadProbe>,
        listener: Option<Vec<ListenerProbe>>,
    }

    #[derive(Deserialize)]
    struct ReloadProbe {
        exec: Option<IgnoredAny>,
        check: Option<IgnoredAny>,
    }

    #[derive(Deserialize)]
    struct CheckProbe {
        exec: Option<IgnoredAny>,
    }

    #[derive(Deserialize)]
    struct ListenerProbe {
        address: Option<serde_json::Value>,
    }

    let body: BodyProbe = serde_json::from_str(text).ok()?;
    let proxy = body.proxy?;
    let settings = Settings {
        command: proxy.command.is_some(),
        user: proxy.user.is_some(),
        working_dir: proxy.working_dir.is_some(),
        // `false` is the default, which `tether register` writes out: it sets nothing.
        inherit_env: proxy.inherit_env.is_some_and(|value| value != serde_json::Value::Bool(false)),
        template: proxy.template.is_some(),
        env: proxy.env.as_ref().map(|env| env.keys().map(String::as_str).collect()).unwrap_or_default(),
        exec_probes: [
            proxy.readiness.is_some_and(|check| check.exec.is_some()),
            proxy.liveness.is_some_and(|check| check.exec.is_some()),
        ],
        reload_programs: [
            proxy.reload.as_ref().is_some_and(|reload| reload.exec.is_some()),
            proxy.reload.as_ref().is_some_and(|reload| reload.check.is_some()),
        ],
        privileged_listener: proxy.listener.unwrap_or_default().iter().any(|listener| {
            listener.address.as_ref().and_then(serde_json::Value::as_str).is_some_and(privileged_listener)
        }),
    };
    let setting = settings.first_refused()?;
    let id = [body.id, body.name]
        .into_iter()
        .flatten()
        .find_map(|value| value.as_str().and_then(|text| ServiceId::new(text).ok()));
    Some((id, setting))
}

/// The root policy's view of this host's users: the uid that a proxy's `user` names, looked
/// up as the process backend does before it switches to the user (`getpwnam`). A name that
/// is all digits and that no user has is taken as that uid, so that a `user` of "0" counts
/// as root whatever a later version of the backend makes of it. Any other name that does not
/// resolve (unknown, or the lookup failed) is not root: the start then fails on it and says
/// why.
pub(crate) fn system_users() -> UserLookup {
    UserLookup::new(|user| match nix::unistd::User::from_name(user) {
        Ok(Some(entry)) => Some(entry.uid.as_raw()),
        Ok(None) | Err(_) => user.parse().ok(),
    })
}

#[cfg(test)]
mod tests {
    use tether_state::config::{self, Format, Origin};

    use super::*;

    #[test]
    fn loader_and_libc_variables_follow_glibc_list() {
        for name in [
            "LD_PRELOAD",
            "LD_LIBRARY_PATH",
            "LD_AUDIT",
            "LD_ANYTHING_NEW",
            "GCONV_PATH",
            "GETCONF_DIR",
            "GLIBC_TUNABLES",
            "HOSTALIASES",
            "LOCALDOMAIN",
            "LOCPATH",
            "MALLOC_TRACE",
            "MALLOC_ARENA_MAX",
            "NIS_PATH",
            "NLSPATH",
            "RESOLV_HOST_CONF",
            "RES_OPTIONS",
            "TMPDIR",
            "TZDIR",
        ] {
            assert!(is_loader_variable(name), "{name}");
        }
        for name in ["LOG_LEVEL", "PATH", "HOME", "ld_preload", "OLD_PRELOAD", "LD", "TZ", "LANG"] {
            assert!(!is_loader_variable(name), "{name}");
        }
    }

    /// What both checks say about `body`: the one on the raw text and the one on the parsed
    /// service, when it parses.
    fn refused(body: &str) -> (Option<String>, Option<String>) {
        let raw = refused_in_body(body).map(|(_, setting)| setting.to_string());
        let parsed = config::parse_service(body, Format::Json, &Origin::Body)
            .ok()
            .and_then(|service| refused_setting(&service))
            .map(|setting| setting.to_string());
        (raw, parsed)
    }

    #[test]
    fn every_refused_setting_is_named_by_its_key_before_and_after_parsing() {
        let cases = [
            (r#"{"name": "a", "proxy": {"command": ["/bin/true"]}}"#, "proxy.command"),
            (r#"{"name": "a", "proxy": {"user": "root"}}"#, "proxy.user"),
            (r#"{"name": "a", "proxy": {"working_dir": "/tmp"}}"#, "proxy.working_dir"),
            (r#"{"name": "a", "proxy": {"inherit_env": true}}"#, "proxy.inherit_env"),
            (r#"{"name": "a", "proxy": {"template": [{"contents": "x", "destination": "/etc/x"}]}}"#, "proxy.template"),
            (r#"{"name": "a", "proxy": {"env": {"A": "1", "LD_PRELOAD": "/tmp/x.so"}}}"#, "proxy.env.LD_PRELOAD"),
            (r#"{"name": "a", "proxy": {"env": {"GCONV_PATH": "/tmp"}}}"#, "proxy.env.GCONV_PATH"),
            (r#"{"name": "a", "proxy": {"readiness": {"exec": ["/bin/true"]}}}"#, "proxy.readiness.exec"),
            (r#"{"name": "a", "proxy": {"liveness": {"exec": ["/bin/true"]}}}"#, "proxy.liveness.exec"),
            (r#"{"name": "a", "proxy": {"reload": {"exec": ["/bin/true"]}}}"#, "proxy.reload.exec"),
            (
                r#"{"name": "a", "proxy": {"reload": {"signal": "SIGHUP", "check": ["/bin/true"]}}}"#,
                "proxy.reload.check",
            ),
            (
                r#"{"name": "a", "proxy": {"listener": [{"name": "l", "address": "/etc/cron.d/x"}]}}"#,
                "proxy.listener.address",
            ),
            (
                r#"{"name": "a", "proxy": {"listener": [{"name": "l", "address": "0.0.0.0:80"}]}}"#,
                "proxy.listener.address",
            ),
        ];
        for (body, key) in cases {
            assert_eq!(refused(body), (Some(key.to_owned()), Some(key.to_owned())), "{body}");
        }
    }

    #[test]
    fn a_refusal_comes_before_the_value_is_checked() {
        for (body, key) in [
            (r#"{"name": "a", "proxy": {"command": []}}"#, "proxy.command"),
            (r#"{"name": "a", "proxy": {"user": "a b", "nonsense": 1}}"#, "proxy.user"),
            (r#"{"name": "a", "proxy": {"working_dir": "relative"}}"#, "proxy.working_dir"),
            (r#"{"name": "a", "proxy": {"inherit_env": "yes"}}"#, "proxy.inherit_env"),
            (r#"{"name": "a", "proxy": {"template": []}}"#, "proxy.template"),
            (r#"{"name": "a", "proxy": {"template": [{"destination": "relative"}]}}"#, "proxy.template"),
            (r#"{"name": "a", "proxy": {"env": {"LD_\u001b[31m": 1}}}"#, "proxy.env.LD_\\u{1b}[31m"),
            (r#"{"name": "a", "proxy": {"liveness": {"exec": [], "tcp": "x"}}}"#, "proxy.liveness.exec"),
        ] {
            assert_eq!(refused(body), (Some(key.to_owned()), None), "{body}");
        }
        let (id, _) = refused_in_body(r#"{"name": "web", "id": "web-1", "proxy": {"user": "root"}}"#).unwrap();
        assert_eq!(id.as_ref().map(ServiceId::as_str), Some("web-1"));
        let (id, _) = refused_in_body(r#"{"name": "../x", "proxy": {"user": "root"}}"#).unwrap();
        assert_eq!(id, None);
    }

    #[test]
    fn harmless_and_default_settings_are_not_refused() {
        for body in [
            r#"{"name": "a"}"#,
            r#"{"name": "a", "proxy": {}}"#,
            r#"{"name": "a", "proxy": {"command": null, "user": null, "working_dir": null, "env": null}}"#,
            r#"{"name": "a", "proxy": {"inherit_env": false, "env": {"LOG_LEVEL": "info", "ld_preload": "x"}}}"#,
            r#"{"name": "a", "proxy": {"config": {"user": "root", "env": {"LD_PRELOAD": "x"}}}}"#,
            r#"{"name": "a", "proxy": {"readiness": {"tcp": "127.0.0.1:1"}, "liveness": {"notify": true}}}"#,
            r#"{"name": "a", "proxy": {"listener": [{"name": "l", "address": "127.0.0.1:21000"}]}}"#,
            r#"{"name": "a", "proxy": {"reload": {"signal": "SIGHUP", "watch": ["/etc/a.cfg"], "timeout": "5s"}}}"#,
        ] {
            assert_eq!(refused(body), (None, None), "{body}");
        }
        // What `tether register` sends: every field written out.
        let service = config::parse_service(r#"{"name": "a", "proxy": {}}"#, Format::Json, &Origin::Body).unwrap();
        let written = config::to_service_text(&service, Format::Json).unwrap();
        assert_eq!(refused(&written), (None, None), "{written}");
    }

    #[test]
    fn hosts_are_judged_by_the_address_they_mean() {
        for loopback in [
            "127.0.0.1",
            "127.1",
            "0x7f000001",
            "2130706433",
            "0177.0.0.1",
            "127.255.255.254",
            "::1",
            "[::1]",
            "::ffff:127.0.0.1",
            "[::ffff:7f00:1]",
            "localhost",
            "LOCALHOST",
        ] {
            assert_eq!(judge_host(loopback), Ok(()), "{loopback}");
        }
        for (elsewhere, means) in [
            ("0", "0.0.0.0"),
            ("0.0.0.0", "0.0.0.0"),
            ("10.0.0.1", "10.0.0.1"),
            ("167772161", "10.0.0.1"),
            ("0xa000001", "10.0.0.1"),
            ("012.0.0.1", "10.0.0.1"),
            ("10.1", "10.0.0.1"),
            ("::", "::"),
            ("[::]", "::"),
            ("[::ffff:0.0.0.0]", "0.0.0.0"),
            ("::ffff:10.0.0.1", "10.0.0.1"),
            ("fe80::1", "fe80::1"),
        ] {
            let means: IpAddr = means.parse().unwrap();
            assert_eq!(judge_host(elsewhere), Err(AddressProblem::NotLoopback(means)), "{elsewhere}");
        }
        for name in ["example.com", "127.0.0.1.nip.io", "deadbeef", "", "127.0.0.1 ", "1.2.3.4.5", "256.1.1.1", "0x"] {
            assert!(judge_host(name).is_err(), "{name}");
        }
    }

    #[test]
    fn numeric_ipv4_reads_what_the_system_resolver_reads() {
        // The resolver reads these without asking DNS: each is a number to it, or nothing.
        for text in [
            "0",
            "1",
            "127.1",
            "127.0.1",
            "0x7f.1",
            "0x7F000001",
            "017700000001",
            "2130706433",
            "10.0.0.1",
            "0xffffffff",
            "4294967296",
            "1.2.3.256",
            "1.2.65536",
            "1.16777216",
            "08",
            "0x",
            "1..2",
            "1.2.3.4.5",
            "09.1",
        ] {
            let resolver = (text, 0).to_socket_addrs().ok().and_then(|mut all| all.next()).and_then(|address| {
                match address.ip() {
                    IpAddr::V4(ipv4) => Some(ipv4),
                    IpAddr::V6(_) => None,
                }
            });
            assert_eq!(numeric_ipv4(text), resolver, "{text}");
        }
    }

    #[test]
    fn every_address_the_agent_or_the_builtin_proxy_would_use_must_be_loopback() {
        let cases = [
            (
                r#"{"name": "a", "proxy": {"listener": [{"name": "l", "address": "0.0.0.0:18302"}]}}"#,
                "proxy.listener.address",
                "0.0.0.0:18302",
            ),
            (
                r#"{"name": "a", "proxy": {"listener": [{"name": "l", "address": "[::]:18302"}]}}"#,
                "proxy.listener.address",
                "[::]:18302",
            ),
            (
                r#"{"name": "a", "proxy": {"listener": [{"name": "l", "address": "[::ffff:0.0.0.0]:18302"}]}}"#,
                "proxy.listener.address",
                "[::ffff:0.0.0.0]:18302",
            ),
            (
                r#"{"name": "a", "proxy": {"config": {"bind_address": "0", "bind_port": 21000}}}"#,
                "proxy.config.bind_address",
                "0",
            ),
            (
                r#"{"name": "a", "proxy": {"config": {"bind_address": "::", "bind_port": 21000}}}"#,
                "proxy.config.bind_address",
                "::",
            ),
            (r#"{"name": "a", "proxy": {"config": {"bind_port": 80}}}"#, "proxy.config.bind_port", "80"),
            (
                r#"{"name": "a", "proxy": {"config": {"bind_port": 21000, "upstreams": [{"destination_name": "db", "local_bind_port": 9191}, {"destination_name": "db", "local_bind_address": "0.0.0.0", "local_bind_port": 9192}]}}}"#,
                "proxy.config.upstreams.local_bind_address",
                "0.0.0.0",
            ),
            (
                r#"{"name": "a", "proxy": {"readiness": {"http": "http://10.0.0.1/"}}}"#,
                "proxy.readiness.http",
                "http://10.0.0.1/",
            ),
            (
                r#"{"name": "a", "proxy": {"readiness": {"http": "http://example.com/"}}}"#,
                "proxy.readiness.http",
                "http://example.com/",
            ),
            (
                r#"{"name": "a", "proxy": {"readiness": {"http": "http://167772161:80/"}}}"#,
                "proxy.readiness.http",
                "http://167772161:80/",
            ),
            (r#"{"name": "a", "proxy": {"liveness": {"tcp": "10.0.0.1:80"}}}"#, "proxy.liveness.tcp", "10.0.0.1:80"),
            (
                r#"{"name": "a", "proxy": {"config": {"local_service_address": "10.0.0.1:80"}}}"#,
                "proxy.config.local_service_address",
                "10.0.0.1:80",
            ),
            (r#"{"name": "a", "address": "10.0.0.1", "port": 80, "proxy": {}}"#, "address", "10.0.0.1"),
        ];
        for (body, key, address) in cases {
            let service = config::parse_service(body, Format::Json, &Origin::Body).unwrap();
            let setting = refused_setting(&service).unwrap_or_else(|| panic!("{body} was not refused"));
            assert_eq!(setting.to_string(), key, "{body}");
            assert!(setting.note().contains(address), "{body}: {}", setting.note());
        }
        for body in [
            r#"{"name": "a", "proxy": {"listener": [{"name": "l", "address": "127.0.0.1:21000"}]}}"#,
            r#"{"name": "a", "proxy": {"listener": [{"name": "l", "address": "[::1]:21000"}]}}"#,
            r#"{"name": "a", "address": "localhost", "port": 80, "proxy": {"config": {"bind_address": "127.0.0.1", "bind_port": 1024}}}"#,
            r#"{"name": "a", "proxy": {"config": {"bind_port": 0, "local_service_address": "[::1]:80"}, "readiness": {"http": "http://127.0.0.1:19000/ready"}, "liveness": {"tcp": "localhost:21000"}}}"#,
            // A service without a proxy: nothing of the agent's goes there.
            r#"{"name": "a", "address": "10.0.0.1", "port": 80}"#,
            // With local_service_address the built-in proxy never contacts the service's address.
            r#"{"name": "a", "address": "10.0.0.1", "port": 80, "proxy": {"config": {"local_service_address": "127.0.0.1:80"}}}"#,
        ] {
            let service = config::parse_service(body, Format::Json, &Origin::Body).unwrap();
            assert_eq!(refused_setting(&service), None, "{body}");
        }
    }

    #[test]
    fn the_system_lookup_knows_root_and_numeric_uids() {
        let users = system_users();
        assert_eq!(users.uid("root"), Some(0));
        assert_eq!(users.uid("0"), Some(0));
        assert_eq!(users.uid("no-such-user-here"), None);
    }
}
