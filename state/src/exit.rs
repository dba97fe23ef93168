//! How a process ended: [`ExitReason`], the one exit vocabulary of every tether crate (the
//! supervisor observes it, the engine publishes and counts it, the API shows it).

use std::fmt;

use serde::{Deserialize, Serialize};

/// How a process ended: `{"code": n}` or `{"signal": n}` on the wire.
///
/// ```
/// use tether_state::ExitReason;
///
/// assert_eq!(serde_json::to_string(&ExitReason::Signal(9)).unwrap(), r#"{"signal":9}"#);
/// assert_eq!(ExitReason::Code(1).to_string(), "exit code 1");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExitReason {
    /// It exited with this code.
    Code(i32),
    /// It was killed by this signal number.
    Signal(i32),
}

impl ExitReason {
    /// The reason recorded in a wait status; `None` for a status that reports neither (a
    /// stopped or continued process).
    pub fn from_status(status: std::process::ExitStatus) -> Option<Self> {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(code), _) => Some(Self::Code(code)),
            (None, Some(signal)) => Some(Self::Signal(signal)),
            (None, None) => None,
        }
    }
}

impl fmt::Display for ExitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Code(code) => write!(f, "exit code {code}"),
            Self::Signal(signal) => write!(f, "killed by signal {signal}"),
        }
    }
}
