//! A proxy's health checks: when a started proxy counts as ready ([`Readiness`]) and when a
//! running one is restarted because it stopped answering ([`Liveness`]), each through one
//! [`Probe`].
//!
//! This module owns the checks' values and their rules; it never probes anything: probing
//! is I/O, done by whoever runs the proxy.

use std::fmt;
use std::time::Duration;

use crate::service::CommandLine;

/// What a check asks of a proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Probe {
    /// A TCP connect to this `HOST:PORT` succeeds.
    Tcp(TcpTarget),
    /// A plain-HTTP `GET` of this URL answers 2xx.
    Http(HttpTarget),
    /// This program, started like the proxy (its user, working dir, environment), exits 0.
    Exec(CommandLine),
    /// systemd's sd_notify protocol: `READY=1` for readiness; for liveness, `WATCHDOG=1`
    /// at least once per interval.
    Notify,
    /// Readiness only: a line of the instance's stdout or stderr matches this pattern.
    LogLine(LinePattern),
    /// Readiness only: the instance writes a newline to this descriptor (s6's
    /// notification-fd), the write end of a pipe the agent gives it.
    Fd(u32),
}

impl Probe {
    /// The probe's kind, as the config names it (`tcp`, `http`, …).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Tcp(_) => "tcp",
            Self::Http(_) => "http",
            Self::Exec(_) => "exec",
            Self::Notify => "notify",
            Self::LogLine(_) => "log_line",
            Self::Fd(_) => "fd",
        }
    }

    /// Whether the probe may check liveness: `log_line` and `fd` tell only readiness.
    pub fn checks_liveness(&self) -> bool {
        !matches!(self, Self::LogLine(_) | Self::Fd(_))
    }
}

impl fmt::Display for Probe {
    /// `tcp 127.0.0.1:21000`, `http http://…`, `exec /bin/check`, `notify`, …: how an error
    /// names the probe.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(target) => write!(f, "tcp {target}"),
            Self::Http(target) => write!(f, "http {target}"),
            Self::Exec(command) => write!(f, "exec {}", command.program().display()),
            Self::Notify => f.write_str("notify"),
            Self::LogLine(pattern) => write!(f, "log_line {:?}", pattern.as_str()),
            Self::Fd(fd) => write!(f, "fd {fd}"),
        }
    }
}

/// `HOST:PORT` of a `tcp` probe; HOST is a name, an IPv4 address or a bracketed IPv6 one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TcpTarget {
    address: String,
}

impl TcpTarget {
    /// Checks `address`.
    ///
    /// # Errors
    ///
    /// A message saying what is wrong, when it is not `HOST:PORT` with a port from 1 to 65535.
    pub fn parse(address: &str) -> Result<Self, String> {
        let invalid = |why: &str| format!("invalid address {address:?}: {why} (expected HOST:PORT)");
        let (host, port) = address.rsplit_once(':').ok_or_else(|| invalid("no port"))?;
        let host_ok = if let Some(inner) = host.strip_prefix('[') {
            inner.strip_suffix(']').is_some_and(|ip| ip.parse::<std::net::Ipv6Addr>().is_ok())
        } else {
            !host.is_empty()
                && !host.contains(':')
                && !host.chars().any(|c| c.is_whitespace() || c.is_control() || c == '/')
        };
        if !host_ok {
            return Err(invalid("bad host"));
        }
        match port.parse::<u16>() {
            Ok(port) if port > 0 => Ok(Self { address: address.to_owned() }),
            _ => Err(invalid("bad port")),
        }
    }

    /// The `HOST:PORT` text, as given.
    pub fn as_str(&self) -> &str {
        &self.address
    }
}

impl fmt::Display for TcpTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.address)
    }
}

/// The URL of an `http` probe: `http://HOST[:PORT][/PATH]`, plain HTTP only.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HttpTarget {
    url: String,
    authority: TcpTarget,
    path: String,
}

impl HttpTarget {
    /// Checks `url`.
    ///
    /// # Errors
    ///
    /// A message saying what is wrong: not `http://`, a bad host or port, a fragment, or a
    /// character that cannot appear in a request line.
    pub fn parse(url: &str) -> Result<Self, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            format!("invalid URL {url:?}: must start with http:// (a probe speaks plain HTTP to a local port)")
        })?;
        let (authority, path) = match rest.find('/') {
            Some(slash) => rest.split_at(slash),
            None => (rest, "/"),
        };
        if path.chars().any(|c| c.is_whitespace() || c.is_control()) || path.contains('#') {
            return Err(format!("invalid URL {url:?}: the path must not hold spaces, control characters or '#'"));
        }
        let with_port = if authority.rsplit_once(':').is_some_and(|(_, port)| !port.contains(']')) {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        let authority = TcpTarget::parse(&with_port).map_err(|err| format!("invalid URL {url:?}: {err}"))?;
        Ok(Self { url: url.to_owned(), authority, path: path.to_owned() })
    }

    /// The URL, as given.
    pub fn as_str(&self) -> &str {
        &self.url
    }

    /// Where to connect: `HOST:PORT` (port 80 when the URL names none).
    pub fn authority(&self) -> &TcpTarget {
        &self.authority
    }

    /// The request target: the path and query, `/` when the URL has none.
    pub fn path(&self) -> &str {
        &self.path
    }
}

impl fmt::Display for HttpTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.url)
    }
}

/// The regular expression of a `log_line` probe.
#[derive(Debug, Clone)]
pub struct LinePattern(regex::Regex);

impl LinePattern {
    /// Compiles `pattern`.
    ///
    /// # Errors
    ///
    /// The compiler's message, when `pattern` is not a valid regular expression.
    pub fn new(pattern: &str) -> Result<Self, String> {
        regex::Regex::new(pattern).map(Self).map_err(|err| format!("invalid regular expression: {err}"))
    }

    /// Whether `line` matches.
    pub fn matches(&self, line: &str) -> bool {
        self.0.is_match(line)
    }

    /// The pattern, as given.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl PartialEq for LinePattern {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for LinePattern {}

/// When a started proxy counts as ready: `[service.proxy.readiness]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readiness {
    /// The probe; any kind.
    pub probe: Probe,
    /// Time between two probes (default 1 s).
    pub interval: Duration,
    /// One probe's limit (default 1 s).
    pub timeout: Duration,
}

impl Readiness {
    /// `probe` with the default interval and timeout.
    pub fn new(probe: Probe) -> Self {
        Self { probe, interval: Duration::from_secs(1), timeout: Duration::from_secs(1) }
    }
}

/// When a running proxy is restarted because it stopped answering:
/// `[service.proxy.liveness]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Liveness {
    /// The probe; not `log_line` or `fd`.
    pub probe: Probe,
    /// Time between two probes (default 10 s); with `notify`, the watchdog interval.
    pub interval: Duration,
    /// One probe's limit (default 2 s).
    pub timeout: Duration,
    /// Failed probes in a row that restart the proxy (default 3).
    pub failures: u32,
}

impl Liveness {
    /// `probe` with the default interval, timeout and failure threshold.
    pub fn new(probe: Probe) -> Self {
        Self { probe, interval: Duration::from_secs(10), timeout: Duration::from_secs(2), failures: 3 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_targets_need_a_host_and_a_port() {
        for good in ["127.0.0.1:21000", "localhost:1", "[::1]:8080", "db.internal:65535"] {
            assert_eq!(TcpTarget::parse(good).unwrap().as_str(), good);
        }
        for bad in ["127.0.0.1", ":80", "host:0", "host:65536", "::1:80", "[::1:80", "a b:1", "host:x"] {
            assert!(TcpTarget::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn http_targets_are_plain_http_with_a_path() {
        let target = HttpTarget::parse("http://127.0.0.1:19000/ready?full=1").unwrap();
        assert_eq!((target.authority().as_str(), target.path()), ("127.0.0.1:19000", "/ready?full=1"));
        let bare = HttpTarget::parse("http://localhost").unwrap();
        assert_eq!((bare.authority().as_str(), bare.path()), ("localhost:80", "/"));
        assert_eq!(HttpTarget::parse("http://[::1]/x").unwrap().authority().as_str(), "[::1]:80");
        for bad in ["https://127.0.0.1/", "127.0.0.1:80/", "http://:80/", "http://h:1/a b", "http://h:1/#x"] {
            assert!(HttpTarget::parse(bad).is_err(), "{bad:?}");
        }
        assert!(HttpTarget::parse("ftp://h/").unwrap_err().contains("must start with http://"));
    }

    #[test]
    fn log_line_and_fd_tell_only_readiness() {
        assert!(Probe::Notify.checks_liveness());
        assert!(!Probe::Fd(3).checks_liveness());
        assert!(!Probe::LogLine(LinePattern::new("ready").unwrap()).checks_liveness());
        assert!(LinePattern::new("(").is_err());
        assert_eq!(Probe::Tcp(TcpTarget::parse("h:1").unwrap()).to_string(), "tcp h:1");
    }
}
