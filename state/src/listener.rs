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
}

impl UpdateStrategy {
    /// The strategy's name, as the config spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Restart => "restart",
            Self::Overlap => "overlap",
        }
    }
}

/// `update` and `update_timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpdatePolicy {
    /// How an instance is replaced.
    pub strategy: UpdateStrategy,
    /// How long an overlapping new instance may take to become ready before the update is
    /// abandoned and the old one keeps serving.
    pub timeout: Duration,
}

impl Default for UpdatePolicy {
    fn default() -> Self {
        Self { strategy: UpdateStrategy::Restart, timeout: Duration::from_secs(30) }
    }
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
