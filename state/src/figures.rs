//! What a supervisor counts and records of one process, as every status shape of a proxy
//! carries it: [`ProcessFigures`], observed once and embedded, never copied field by field.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::{ExitReason, Reloads};

/// The figures of one supervised process that pass unchanged from the supervisor's status
/// to the backend's: its pid, restarts, start, last exit, error, own account, failed checks
/// and reloads.
///
/// A figure that a supervisor learns and operators see is added here once: the supervisor's
/// status, the backend seam's and the engine's all carry this struct, and the agent's status
/// (`tether status --json`, the API) shows its serde form, flattened into each proxy's
/// object. A new field is shown there under its own name, after `error`, with nothing else
/// to change but the line of the supervisor that fills it; `#[serde(skip)]` keeps one off
/// the wire.
///
/// The serde form: `pid` (number or null), `restarts`, `started_at` (RFC 3339 in UTC, to the
/// second, or null), `last_exit` (`{"code": n}`, `{"signal": n}` or null) and `error`
/// (string or null). Three figures are not in it: `status_text` and `reloads` are shown by
/// the status at places of their own (after `ready`, and as `last_reload` after `update`,
/// where the first version of that object put them), and `probe_failures` by the metrics
/// only. Missing keys read as their defaults.
///
/// ```
/// use tether_state::{ExitReason, ProcessFigures};
///
/// let figures = ProcessFigures {
///     pid: Some(42),
///     restarts: 1,
///     started_at: Some(std::time::SystemTime::UNIX_EPOCH),
///     last_exit: Some(ExitReason::Signal(9)),
///     status_text: Some("serving".into()),
///     ..ProcessFigures::default()
/// };
/// let json = serde_json::to_string(&figures).unwrap();
/// assert_eq!(
///     json,
///     r#"{"pid":42,"restarts":1,"started_at":"1970-01-01T00:00:00Z","last_exit":{"signal":9},"error":null}"#
/// );
/// let read: ProcessFigures = serde_json::from_str(&json).unwrap();
/// assert_eq!(read, ProcessFigures { status_text: None, ..figures });
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ProcessFigures {
    /// The pid of the current instance, while one exists.
    pub pid: Option<u32>,
    /// Restarts after an exit since supervision began (not reset by a healthy run).
    pub restarts: u64,
    /// When the current (or last) instance started.
    #[serde(with = "rfc3339_seconds")]
    pub started_at: Option<SystemTime>,
    /// How the previous instance ended. `None` before the first exit, and for adopted
    /// processes, whose exit status belongs to their real parent.
    pub last_exit: Option<ExitReason>,
    /// The last error, if the latest operation on the process failed, or why its checks
    /// fail (a readiness probe while it starts, liveness probes that failed or restarted it),
    /// for display.
    pub error: Option<String>,
    /// The instance's own account of itself (sd_notify's `STATUS=`), if it gives one.
    #[serde(skip)]
    pub status_text: Option<String>,
    /// Failed readiness and liveness checks since supervision began.
    #[serde(skip)]
    pub probe_failures: u64,
    /// Its reloads since supervision began: the last one and the counts, once there was
    /// one. Boxed: most processes never reload.
    #[serde(skip)]
    pub reloads: Option<Box<Reloads>>,
}

/// A time as the status shows it: RFC 3339 in UTC, to the second, or null.
mod rfc3339_seconds {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(time: &Option<SystemTime>, serializer: S) -> Result<S::Ok, S::Error> {
        match time {
            Some(time) => serializer.collect_str(&humantime::format_rfc3339_seconds(*time)),
            None => serializer.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<SystemTime>, D::Error> {
        Option::<String>::deserialize(deserializer)?
            .map(|text| {
                humantime::parse_rfc3339(&text)
                    .map_err(|err| serde::de::Error::custom(format_args!("started_at {text:?}: {err}")))
            })
            .transpose()
    }
}
