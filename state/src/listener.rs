//! Listeners (sockets the agent binds and hands to every instance of a proxy) and the
//! update policy that decides how a changed proxy replaces its instance.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::TcpTarget;

/// One `[[service.proxy.listener]]`: a named socket that the agent binds and hands over.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Listener {
    /// Its name, for `LISTEN_FDNAMES`: `[A-Za-z0-9_.-]{1,64}`, unique within the proxy.
    pub name: ListenerName,
    /// Where it listens.
    pub address: ListenAddress,
}

/// A listener's name: 1 to 64 of `A-Z a-z 0-9 _ . -` (a `LISTEN_FDNAMES` entry may not
/// hold `:`, and a name is shown in errors).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ListenerName(String);

/// The rule of [`ListenerName`], for error messages.
pub const LISTENER_NAME_RULE: &str = "1 to 64 of A-Z a-z 0-9 _ . -";

impl ListenerName {
    /// Checks `name`.
    ///
    /// # Errors
    ///
    /// A message with the rule, when `name` breaks it.
    pub fn new(name: &str) -> Result<Self, String> {
        let valid = (1..=64).contains(&name.len())
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if valid {
            Ok(Self(name.to_owned()))
        } else {
            Err(format!("invalid listener name {name:?}: {LISTENER_NAME_RULE}"))
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ListenerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where a listener listens: TCP `HOST:PORT`, or a Unix stream socket at an absolute path.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ListenAddress {
    /// TCP; HOST is a name, an IPv4 address or a bracketed IPv6 one.
    Tcp(TcpTarget),
    /// A Unix stream socket.
    Unix(PathBuf),
}

impl ListenAddress {
    /// Reads an address as the config writes it: an absolute path is a Unix socket,
    /// anything else `HOST:PORT`.
    ///
    /// # Errors
    ///
    /// A message saying what is wrong.
    pub fn parse(address: &str) -> Result<Self, String> {
        if address.starts_with('/') {
            let path = Path::new(address);
            if address.contains('\0') {
                return Err(format!("invalid socket path {address:?}: it holds a NUL byte"));
            }
            // sun_path holds 108 bytes with the terminating NUL.
            if address.len() > 107 {
                return Err(format!("invalid socket path {address:?}: longer than 107 bytes"));
            }
            if path.file_name().is_none() || address.ends_with('/') {
                return Err(format!("invalid socket path {address:?}: it names no file"));
            }
            return Ok(Self::Unix(path.to_owned()));
        }
        TcpTarget::parse(address).map(Self::Tcp).map_err(|error| format!("{error}, or an absolute path"))
    }
}

impl fmt::Display for ListenAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(target) => f.write_str(target.as_str()),
            Self::Unix(path) => write!(f, "{}", path.display()),
        }
    }
}

/// How a restart-requiring change (or `tether restart`) replaces a running instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpdateStrategy {
    /// Stop the old instance, then start the new one.
    #[default]
    Restart,
    /// Start the new instance beside the old one, wait until it is ready, then stop the
    /// old one.
    Overlap,
    /// Hot restart by the proxy itself (Envoy's `--restart-epoch`): start a new generation
    /// with the next epoch beside the old one, which hands its listeners over, drains and
    /// exits on its own; it is not signalled, and is stopped only after `drain_timeout`.
    Epoch,
}

impl UpdateStrategy {
    /// The strategy's name, as the config spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Restart => "restart",
            Self::Overlap => "overlap",
            Self::Epoch => "epoch",
        }
    }
}

/// `update`, `update_timeout`, and for `update = "epoch"`, `drain_timeout`,
/// `max_generations` and `keep_listening`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpdatePolicy {
    /// How an instance is replaced.
    pub strategy: UpdateStrategy,
    /// How long an overlapping new instance (or a new generation) may take to become ready
    /// before the update is abandoned and the old one keeps serving.
    pub timeout: Duration,
    /// `update = "epoch"`: how long an old generation may take to drain and exit on its own
    /// before it is stopped with the kill signal.
    pub drain_timeout: Duration,
    /// `update = "epoch"`: the most generations of the proxy that run at once (at least
    /// [`UpdatePolicy::MIN_GENERATIONS`]); a change beyond it waits for one to exit.
    pub max_generations: u32,
    /// `update = "epoch"`: the agent keeps a copy of each listening socket of the
    /// generation that serves (`keep_listening`), so that a crash leaves connections
    /// waiting in the socket's backlog for the next generation instead of refused.
    pub keep_listening: bool,
}

impl UpdatePolicy {
    /// The default `drain_timeout`.
    pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(15 * 60);
    /// The default `max_generations`.
    pub const MAX_GENERATIONS: u32 = 3;
    /// The least `max_generations`: the generation that serves and the one that takes over.
    pub const MIN_GENERATIONS: u32 = 2;
}

impl Default for UpdatePolicy {
    fn default() -> Self {
        Self {
            strategy: UpdateStrategy::Restart,
            timeout: Duration::from_secs(30),
            drain_timeout: Self::DRAIN_TIMEOUT,
            max_generations: Self::MAX_GENERATIONS,
            keep_listening: false,
        }
    }
}

/// The placeholder of `command` and `env` that `update = "epoch"` replaces with a
/// generation's restart epoch: 0 at a cold start, one more at each hot restart.
pub const RESTART_EPOCH_PLACEHOLDER: &str = "{restart_epoch}";
/// The placeholder of `command` and `env` that `update = "epoch"` replaces with the proxy's
/// base id: a number stable for the proxy and unique among the agent's proxies.
pub const BASE_ID_PLACEHOLDER: &str = "{base_id}";

/// `text` with [`RESTART_EPOCH_PLACEHOLDER`] and [`BASE_ID_PLACEHOLDER`] replaced, wherever
/// they appear in it.
///
/// ```
/// assert_eq!(tether_state::substitute_epoch("--base-id={base_id}", 1, 7), "--base-id=7");
/// assert_eq!(tether_state::substitute_epoch("{restart_epoch}", 2, 7), "2");
/// ```
pub fn substitute_epoch(text: &str, epoch: u32, base_id: u32) -> String {
    if !text.contains('{') {
        return text.to_owned();
    }
    text.replace(RESTART_EPOCH_PLACEHOLDER, &epoch.to_string()).replace(BASE_ID_PLACEHOLDER, &base_id.to_string())
}

/// The first epoch placeholder `text` holds, if any.
pub fn epoch_placeholder_in(text: &str) -> Option<&'static str> {
    [RESTART_EPOCH_PLACEHOLDER, BASE_ID_PLACEHOLDER].into_iter().find(|placeholder| text.contains(placeholder))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_rule() {
        assert!(ListenerName::new("public").is_ok());
        assert!(ListenerName::new("a.b-c_9").is_ok());
        assert!(ListenerName::new(&"x".repeat(64)).is_ok());
        for bad in ["", "a:b", "with space", "é", &"x".repeat(65)] {
            let error = ListenerName::new(bad).unwrap_err();
            assert!(error.contains(LISTENER_NAME_RULE), "{error}");
        }
    }

    #[test]
    fn addresses_are_tcp_or_absolute_paths() {
        assert!(matches!(ListenAddress::parse("127.0.0.1:21000"), Ok(ListenAddress::Tcp(_))));
        assert!(matches!(ListenAddress::parse("[::1]:80"), Ok(ListenAddress::Tcp(_))));
        assert!(matches!(ListenAddress::parse("/run/web.sock"), Ok(ListenAddress::Unix(_))));
        assert!(ListenAddress::parse("relative.sock").unwrap_err().contains("absolute path"));
        assert!(ListenAddress::parse("127.0.0.1:0").is_err());
        assert!(ListenAddress::parse("/run/").is_err());
        assert!(ListenAddress::parse(&format!("/{}", "s".repeat(107))).unwrap_err().contains("107"));
        assert_eq!(ListenAddress::parse("/run/web.sock").unwrap().to_string(), "/run/web.sock");
    }
}
