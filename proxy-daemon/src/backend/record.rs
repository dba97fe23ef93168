//! What the process backend keeps of a proxy in the engine's snapshot: a [`Record`] of the
//! process (what proves it, and how to stop it) or the mark of an adoption candidate, typed
//! here and opaque to the engine; and the reading of the first snapshot format's records.
//!
//! Records never hold a token or an environment value: only an [`Identity`] and a kill
//! policy.

use std::time::{Duration, SystemTime};

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
    /// For `update = "epoch"`: the generation's epoch, the proxy's base id, and the older
    /// generations that drain beside it.
    pub(super) epoch: Option<EpochRecord>,
}

/// What a record of a proxy with `update = "epoch"` adds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct EpochRecord {
    pub(super) epoch: u32,
    pub(super) base_id: u32,
    pub(super) draining: Vec<super::epoch::Draining>,
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
    Process {
        identity: Identity,
        kill_signal: KillSignal,
        kill_timeout_ms: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        epoch: Option<StoredEpoch>,
    },
    Candidate,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StoredEpoch {
    epoch: u32,
    base_id: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    draining: Vec<StoredDraining>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StoredDraining {
    identity: Identity,
    epoch: u32,
    kill_signal: KillSignal,
    kill_timeout_ms: u64,
    /// Until when it may drain, in milliseconds after the Unix epoch.
    drain_until_ms: u64,
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
        let millis = |duration: Duration| u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        let stored = Stored::Process {
            identity: self.identity.clone(),
            kill_signal: self.kill.signal,
            kill_timeout_ms: millis(self.kill.timeout),
            epoch: self.epoch.as_ref().map(|epoch| StoredEpoch {
                epoch: epoch.epoch,
                base_id: epoch.base_id,
                draining: epoch
                    .draining
                    .iter()
                    .map(|draining| StoredDraining {
                        identity: draining.identity.clone(),
                        epoch: draining.epoch,
                        kill_signal: draining.kill.signal,
                        kill_timeout_ms: millis(draining.kill.timeout),
                        drain_until_ms: millis(
                            draining.until.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default(),
                        ),
                    })
                    .collect(),
            }),
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
            Readable::Current(Stored::Process { identity, kill_signal, kill_timeout_ms, epoch }) => {
                Read::Process(Record {
                    identity,
                    kill: kill_policy(kill_signal, kill_timeout_ms),
                    epoch: epoch.map(|epoch| EpochRecord {
                        epoch: epoch.epoch,
                        base_id: epoch.base_id,
                        draining: epoch
                            .draining
                            .into_iter()
                            .map(|draining| super::epoch::Draining {
                                identity: draining.identity,
                                epoch: draining.epoch,
                                kill: kill_policy(draining.kill_signal, draining.kill_timeout_ms),
                                until: SystemTime::UNIX_EPOCH + Duration::from_millis(draining.drain_until_ms),
                            })
                            .collect(),
                    }),
                })
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
                epoch: None,
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
            epoch: None,
        }
    }

    #[test]
    fn a_record_of_a_generation_reads_back_with_the_generations_that_drain() {
        let draining = super::super::epoch::Draining {
            identity: Identity { pid: 590, pgid: 590, start_time: 2_016_001, boot_id: "b1912615".into(), cgroup: None },
            epoch: 3,
            kill: KillPolicy { signal: KillSignal::Int, timeout: Duration::from_secs(5) },
            until: SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
        };
        let generation =
            Record { epoch: Some(EpochRecord { epoch: 4, base_id: 77, draining: vec![draining] }), ..record() };
        let encoded = generation.encode();
        assert!(
            encoded.as_json().ends_with(
                r#""epoch":{"epoch":4,"base_id":77,"draining":[{"identity":{"pid":590,"pgid":590,"start_time":2016001,"boot_id":"b1912615"},"epoch":3,"kill_signal":"SIGINT","kill_timeout_ms":5000,"drain_until_ms":1700000000123}]}}}"#
            ),
            "{}",
            encoded.as_json()
        );
        assert_eq!(Record::read(&encoded).unwrap(), Read::Process(generation));
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
