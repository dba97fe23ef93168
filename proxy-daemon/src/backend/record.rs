//! What the process backend keeps of a proxy in the engine's snapshot: a [`Record`] of the
//! process (what proves it, and how to stop it) or the mark of an adoption candidate, typed
//! here and opaque to the engine; and the reading of the first snapshot format's records.
//!
//! Records never hold a token or an environment value: only an [`Identity`] and a kill
//! policy.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tether_manager::BackendRecord;
use tether_state::{KillPolicy, KillSignal};

use crate::proc::Identity;

/// A process the backend started or adopted: what proves it after an agent restart, and
/// how to stop it should it no longer be wanted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Record {
    pub(super) identity: Identity,
    pub(super) kill: KillPolicy,
}

/// What a [`BackendRecord`] of this backend says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Read {
    /// A process, as [`Record::encode`] (or the first format) recorded it.
    Process(Record),
    /// An adoption candidate ([`Record::candidate`]): a proxy id found in `pids/` or in the
    /// environment of a process, proven only by `restore`.
    Candidate,
}

/// The record as stored (snapshot format 2): `{"process": {...}}` or `"candidate"`.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum Stored {
    Process { identity: Identity, kill_signal: KillSignal, kill_timeout_ms: u64 },
    Candidate,
}

/// A record of the first snapshot format: the identity's fields and the kill policy, flat.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FirstFormat {
    pid: u32,
    pgid: u32,
    start_time: u64,
    boot_id: String,
    kill_signal: String,
    kill_timeout_ms: u64,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Readable {
    Current(Stored),
    First(FirstFormat),
}

impl Record {
    /// The record for the snapshot.
    pub(super) fn encode(&self) -> BackendRecord {
        let stored = Stored::Process {
            identity: self.identity.clone(),
            kill_signal: self.kill.signal,
            kill_timeout_ms: u64::try_from(self.kill.timeout.as_millis()).unwrap_or(u64::MAX),
        };
        BackendRecord::new(&stored).unwrap_or_else(|_| unreachable!("a record of plain fields encodes"))
    }

    /// The record handed to `restore` for an adoption candidate.
    pub(super) fn candidate() -> BackendRecord {
        BackendRecord::new(&Stored::Candidate).unwrap_or_else(|_| unreachable!("a unit variant encodes"))
    }

    /// Reads a record of either format.
    ///
    /// # Errors
    ///
    /// When it is not a record of this backend.
    pub(super) fn read(record: &BackendRecord) -> Result<Read, serde_json::Error> {
        Ok(match record.parse::<Readable>()? {
            Readable::Current(Stored::Candidate) => Read::Candidate,
            Readable::Current(Stored::Process { identity, kill_signal, kill_timeout_ms }) => {
                Read::Process(Record { identity, kill: kill_policy(kill_signal, kill_timeout_ms) })
            }
            Readable::First(first) => Read::Process(Record {
                identity: Identity {
                    pid: first.pid,
                    pgid: first.pgid,
                    start_time: first.start_time,
                    boot_id: first.boot_id,
                    cgroup: None,
                },
                // The first format wrote nix's names, which are also the config's (`SIGTERM`).
                kill: kill_policy(KillSignal::from_name(&first.kill_signal).unwrap_or_default(), first.kill_timeout_ms),
            }),
        })
    }
}

fn kill_policy(signal: KillSignal, timeout_ms: u64) -> KillPolicy {
    KillPolicy { signal, timeout: Duration::from_millis(timeout_ms) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        Record {
            identity: Identity { pid: 596, pgid: 596, start_time: 2_016_587, boot_id: "b1912615".into(), cgroup: None },
            kill: KillPolicy { signal: KillSignal::Term, timeout: Duration::from_secs(2) },
        }
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let encoded = record().encode();
        assert_eq!(
            encoded.as_json(),
            r#"{"process":{"identity":{"pid":596,"pgid":596,"start_time":2016587,"boot_id":"b1912615"},"kill_signal":"SIGTERM","kill_timeout_ms":2000}}"#
        );
        assert_eq!(Record::read(&encoded).unwrap(), Read::Process(record()));
        assert_eq!(Record::read(&Record::candidate()).unwrap(), Read::Candidate);
    }

    #[test]
    fn a_record_of_the_first_format_reads_as_the_same_process() {
        // As the first format wrote it into `snapshot.json`.
        let text = r#"{
            "boot_id": "b1912615",
            "kill_signal": "SIGTERM",
            "kill_timeout_ms": 2000,
            "pgid": 596,
            "pid": 596,
            "start_time": 2016587
        }"#;
        let first: BackendRecord = serde_json::from_str(text).unwrap();
        assert_eq!(Record::read(&first).unwrap(), Read::Process(record()));
    }

    #[test]
    fn a_record_of_another_backend_is_not_read() {
        for other in [r#"{"pid": 1}"#, r#"{"proof": "web-proxy", "pid": 5}"#, "null", r#""process""#] {
            let record: BackendRecord = serde_json::from_str(other).unwrap();
            assert!(Record::read(&record).is_err(), "{other}");
        }
    }
}
