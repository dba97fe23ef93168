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

use serde::Deserialize;
use serde::de::IgnoredAny;
use tether_manager::UserLookup;
use tether_state::{Probe, ProxyCommand, Service, ServiceId};

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
    /// An `env` variable that the dynamic loader or libc reads ([`is_loader_variable`]).
    Env(String),
    /// An `exec` probe of `readiness` (`false`) or `liveness` (`true`): a program the agent
    /// runs, like `command`.
    ExecProbe { liveness: bool },
    /// A listener the agent would bind with its own rights: a Unix socket file (created,
    /// or a stale one replaced, at any path) or a TCP port below 1024.
    Listener,
}

/// Whether binding `address` (a listener's, as written) uses the agent's own rights: a
/// path, or a port below 1024.
fn privileged_listener(address: &str) -> bool {
    address.starts_with('/')
        || address.rsplit_once(':').and_then(|(_, port)| port.parse::<u16>().ok()).is_some_and(|port| port < 1024)
}

impl ApiSetting {
    /// Why the setting is refused, beyond being what runs and how.
    pub(crate) fn note(&self) -> &'static str {
        match self {
            Self::Env(_) => " (the dynamic loader or libc reads it)",
            Self::Listener => " (the agent binds it with its own rights: a socket file, or a port below 1024)",
            _ => "",
        }
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
            // Not yet validated when it comes from a body: escaped, so that it cannot forge
            // log lines.
            Self::Env(name) => write!(f, "proxy.env.{}", name.escape_default()),
            Self::ExecProbe { liveness: false } => f.write_str("proxy.readiness.exec"),
            Self::ExecProbe { liveness: true } => f.write_str("proxy.liveness.exec"),
            Self::Listener => f.write_str("proxy.listener.address"),
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
    env: Vec<&'a str>,
    /// An `exec` probe in `readiness`, in `liveness`.
    exec_probes: [bool; 2],
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
        self.privileged_listener.then_some(ApiSetting::Listener)
    }
}

/// The first setting of `service` that the register API may not make, if any.
pub(crate) fn refused_setting(service: &Service) -> Option<ApiSetting> {
    let proxy = service.proxy.as_ref()?;
    Settings {
        command: matches!(proxy.command, ProxyCommand::Exec(_)),
        user: proxy.user.is_some(),
        working_dir: proxy.working_dir.is_some(),
        inherit_env: proxy.inherit_env,
        env: proxy.env.keys().map(String::as_str).collect(),
        exec_probes: [
            proxy.readiness.as_ref().is_some_and(|check| matches!(check.probe, Probe::Exec(_))),
            proxy.liveness.as_ref().is_some_and(|check| matches!(check.probe, Probe::Exec(_))),
        ],
        privileged_listener: proxy.listeners.iter().any(|l| privileged_listener(&l.address.to_string())),
    }
    .first_refused()
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
        env: Option<BTreeMap<String, IgnoredAny>>,
        readiness: Option<CheckProbe>,
        liveness: Option<CheckProbe>,
        listener: Option<Vec<ListenerProbe>>,
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
        env: proxy.env.as_ref().map(|env| env.keys().map(String::as_str).collect()).unwrap_or_default(),
        exec_probes: [
            proxy.readiness.is_some_and(|check| check.exec.is_some()),
            proxy.liveness.is_some_and(|check| check.exec.is_some()),
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
            (r#"{"name": "a", "proxy": {"env": {"A": "1", "LD_PRELOAD": "/tmp/x.so"}}}"#, "proxy.env.LD_PRELOAD"),
            (r#"{"name": "a", "proxy": {"env": {"GCONV_PATH": "/tmp"}}}"#, "proxy.env.GCONV_PATH"),
            (r#"{"name": "a", "proxy": {"readiness": {"exec": ["/bin/true"]}}}"#, "proxy.readiness.exec"),
            (r#"{"name": "a", "proxy": {"liveness": {"exec": ["/bin/true"]}}}"#, "proxy.liveness.exec"),
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
        ] {
            assert_eq!(refused(body), (None, None), "{body}");
        }
        // What `tether register` sends: every field written out.
        let service = config::parse_service(r#"{"name": "a", "proxy": {}}"#, Format::Json, &Origin::Body).unwrap();
        let written = config::to_service_text(&service, Format::Json).unwrap();
        assert_eq!(refused(&written), (None, None), "{written}");
    }

    #[test]
    fn the_system_lookup_knows_root_and_numeric_uids() {
        let users = system_users();
        assert_eq!(users.uid("root"), Some(0));
        assert_eq!(users.uid("0"), Some(0));
        assert_eq!(users.uid("no-such-user-here"), None);
    }
}
