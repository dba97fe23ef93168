//! The fleet catalog: services that a cluster store (etcd v3) holds for this node.
//!
//! Keys are `<prefix>/nodes/<node>/services/<service id>`; each value is one service object
//! in the register API's JSON schema. This module owns the parsing of values into services
//! (an invalid value is a per-key report, never a failure of the whole set), the agent's
//! follower (`follow`) and publisher (`publish`), the fleet's intentions (`intentions`),
//! and the operators' commands (`cli`,
//! `status`, `rollout`, with the helpers they share here). How etcd is reached, where keys
//! live and what the published records hold are `crate::etcd`'s. Its services enter
//! `LocalState` as `Source::External("etcd")`. It never starts a process and writes nothing
//! outside the data dir (`store`).

pub(crate) mod cli;
pub(crate) mod follow;
pub(crate) mod intentions;
pub(crate) mod publish;
pub(crate) mod roles;
pub(crate) mod rollout;
pub(crate) mod status;
pub(crate) mod store;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use tether_state::config::{ConfigError, Format, Origin};
use tether_state::{IdError, Service, ServiceId, SourceKind, config};

use crate::error::UsageError;
use crate::etcd::{EtcdError, EtcdOptions, Layout};

/// The name of the fleet source in the catalog (`Source::External`).
pub(crate) const SOURCE_NAME: &str = "etcd";

/// The catalog source kind of fleet services.
pub(crate) fn source_kind() -> SourceKind {
    SourceKind::External(SOURCE_NAME.to_owned())
}

/// Why one key's value was skipped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ValueError {
    #[error("key is not UTF-8")]
    KeyNotUtf8,
    #[error("key is not under {prefix}")]
    OutsidePrefix { prefix: String },
    #[error("the key's last segment is not a valid service id")]
    KeyId(#[source] IdError),
    #[error("value is not UTF-8")]
    ValueNotUtf8,
    #[error("invalid service")]
    Invalid(#[source] ConfigError),
    #[error("the value's id `{value_id}` differs from the key's id `{key_id}`")]
    IdMismatch { key_id: ServiceId, value_id: ServiceId },
}

/// Parses one key and its value into a service.
///
/// # Errors
///
/// A [`ValueError`] that says what is wrong; for an invalid service, its source names the
/// position and the field, with the key in place of a file name.
pub(crate) fn parse_entry(layout: &Layout, key: &[u8], value: &[u8]) -> Result<Service, ValueError> {
    let id = key_id(layout, key)?;
    let text = std::str::from_utf8(value).map_err(|_| ValueError::ValueNotUtf8)?;
    let origin = Origin::File(PathBuf::from(String::from_utf8_lossy(key).into_owned()));
    let service = config::parse_service(text, Format::Json, &origin).map_err(ValueError::Invalid)?;
    if service.id != id {
        return Err(ValueError::IdMismatch { key_id: id, value_id: service.id });
    }
    Ok(service)
}

/// The service id that a key names.
pub(crate) fn key_id(layout: &Layout, key: &[u8]) -> Result<ServiceId, ValueError> {
    let key = std::str::from_utf8(key).map_err(|_| ValueError::KeyNotUtf8)?;
    let prefix = layout.services_prefix();
    let rest = key.strip_prefix(&prefix).ok_or(ValueError::OutsidePrefix { prefix })?;
    ServiceId::new(rest).map_err(ValueError::KeyId)
}

/// The desired set of one node as last read from etcd: every valid value, by key id, and
/// every invalid key with its problem. `revision` is the etcd revision it reflects (0 when
/// unknown), so that a follower can resume watching at `revision + 1`; `mod_revisions` holds,
/// for each service in force, the mod revision of the key it was read from.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Desired {
    pub(crate) revision: i64,
    pub(crate) services: BTreeMap<ServiceId, Service>,
    pub(crate) mod_revisions: BTreeMap<ServiceId, i64>,
    pub(crate) invalid: BTreeMap<String, String>,
}

impl Desired {
    /// Records a put of `key` at `mod_revision`. Returns the problem when the value was
    /// skipped (the key's last valid service, and its mod revision, stay in force).
    pub(crate) fn put_at(&mut self, layout: &Layout, key: &[u8], value: &[u8], mod_revision: i64) -> Option<String> {
        let problem = self.put(layout, key, value);
        if problem.is_none() {
            if let Ok(id) = key_id(layout, key) {
                self.mod_revisions.insert(id, mod_revision);
            }
        }
        problem
    }

    /// Records a put of `key`. Returns the problem when the value was skipped.
    pub(crate) fn put(&mut self, layout: &Layout, key: &[u8], value: &[u8]) -> Option<String> {
        let shown = String::from_utf8_lossy(key).into_owned();
        // An invalid value leaves the key's last valid service in force, as an invalid file
        // leaves the previous config in force on SIGHUP: a typo never stops a proxy.
        match parse_entry(layout, key, value) {
            Ok(service) => {
                self.invalid.remove(&shown);
                self.services.insert(service.id.clone(), service);
                None
            }
            Err(err) => {
                let problem = crate::error::error_chain(&err);
                self.invalid.insert(shown, problem.clone());
                Some(problem)
            }
        }
    }

    /// A fresh read (`next`) that keeps, for each key that is invalid now, the last valid
    /// service of `self`.
    pub(crate) fn carry_over(&self, layout: &Layout, mut next: Desired) -> Desired {
        for key in next.invalid.keys() {
            if let Ok(id) = key_id(layout, key.as_bytes()) {
                if let Some(service) = self.services.get(&id) {
                    if let Some(mod_revision) = self.mod_revisions.get(&id) {
                        next.mod_revisions.entry(id.clone()).or_insert(*mod_revision);
                    }
                    next.services.entry(id).or_insert_with(|| service.clone());
                }
            }
        }
        next
    }

    /// Records a delete of `key`.
    pub(crate) fn delete(&mut self, layout: &Layout, key: &[u8]) {
        self.invalid.remove(String::from_utf8_lossy(key).as_ref());
        if let Ok(id) = key_id(layout, key) {
            self.services.remove(&id);
            self.mod_revisions.remove(&id);
        }
    }
}

/// What `tether agent --etcd ... --node ...` follows.
#[derive(Debug, Clone)]
pub(crate) struct FleetOptions {
    pub(crate) layout: Layout,
    pub(crate) etcd: EtcdOptions,
    /// The TTL of the status lease (`--fleet-ttl`).
    pub(crate) ttl: Duration,
}

impl FleetOptions {
    /// The fleet options of `tether agent`, if it follows etcd.
    ///
    /// # Errors
    ///
    /// A [`crate::error::UsageError`] for an invalid node or prefix, unreadable TLS files, or a
    /// password without a user: the agent does not start on options it cannot use.
    pub(crate) fn of_agent(args: &crate::cli::AgentArgs) -> anyhow::Result<Option<Self>> {
        let Some(node) = &args.node else { return Ok(None) };
        let usage = |message: String| anyhow::Error::from(crate::error::UsageError(message));
        let layout = Layout::new(&args.etcd_options.etcd_prefix, node).map_err(|err| usage(err.to_string()))?;
        let etcd = EtcdOptions::from_args(args.etcd.clone(), &args.etcd_options);
        etcd.connect_options().map_err(|err| usage(crate::error::error_chain(&err)))?;
        let ttl = args.fleet_ttl;
        if ttl.as_secs() == 0 || ttl.subsec_nanos() != 0 {
            let shown = humantime::format_duration(ttl);
            return Err(usage(format!("--fleet-ttl {shown}: a lease lives whole seconds, at least one")));
        }
        Ok(Some(Self { layout, etcd, ttl }))
    }
}

/// A usage error (exit 2) saying `message`.
pub(crate) fn usage(message: String) -> anyhow::Error {
    UsageError(message).into()
}

/// The services of the file `file` (`.toml` or `.json`), for `what` (`put`, `roll out`): a
/// usage error names the file when it cannot be read, is invalid or holds none.
pub(crate) fn read_services(file: &std::path::Path, what: &str) -> anyhow::Result<Vec<tether_state::Service>> {
    let format = Format::of_path(file)
        .ok_or_else(|| usage(format!("{}: a service file ends in .toml or .json", file.display())))?;
    let text = std::fs::read_to_string(file).map_err(|err| usage(format!("{}: cannot read: {err}", file.display())))?;
    let services = config::parse_file(&text, format, &Origin::File(file.to_owned()))
        .map_err(|err| usage(crate::error::error_chain(&err)))?;
    if services.is_empty() {
        return Err(usage(format!("{}: no [[service]] to {what}", file.display())));
    }
    Ok(services)
}

/// `err` as the commands report it: a usage error when the options are wrong, else a
/// runtime failure.
pub(crate) fn etcd_failure(err: EtcdError) -> anyhow::Error {
    if err.is_usage() { usage(crate::error::error_chain(&err)) } else { err.into() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout::new("/tether/", "n1").unwrap()
    }

    #[test]
    fn a_value_is_one_service_whose_id_matches_the_key() {
        let layout = layout();
        let service = parse_entry(&layout, b"/tether/nodes/n1/services/web", br#"{"name": "web"}"#).unwrap();
        assert_eq!(service.id.as_str(), "web");
        let err = parse_entry(&layout, b"/tether/nodes/n1/services/api", br#"{"name": "web"}"#).unwrap_err();
        assert!(matches!(err, ValueError::IdMismatch { .. }), "{err}");
        let err = parse_entry(&layout, b"/tether/nodes/n1/services/a/b", br#"{"name": "web"}"#).unwrap_err();
        assert!(matches!(err, ValueError::KeyId(_)), "{err}");
    }

    #[test]
    fn an_invalid_value_names_the_key_and_the_field() {
        let layout = layout();
        let err = parse_entry(&layout, b"/tether/nodes/n1/services/web", br#"{"name": "web", "prot": 1}"#).unwrap_err();
        let text = crate::error::error_chain(&err);
        assert!(text.contains("/tether/nodes/n1/services/web:1:"), "{text}");
        assert!(text.contains("prot"), "{text}");
    }

    #[test]
    fn a_put_of_an_invalid_value_keeps_the_last_valid_service_and_reports_the_key() {
        let layout = layout();
        let mut desired = Desired::default();
        let key = b"/tether/nodes/n1/services/web";
        assert_eq!(desired.put(&layout, key, br#"{"name": "web"}"#), None);
        assert!(desired.put(&layout, key, b"{").is_some());
        assert_eq!(desired.services.len(), 1);
        assert_eq!(desired.invalid.len(), 1);
        let mut reread = Desired::default();
        reread.put(&layout, key, b"{");
        assert_eq!(desired.carry_over(&layout, reread).services.len(), 1);
        desired.delete(&layout, key);
        assert!(desired.invalid.is_empty() && desired.services.is_empty());
    }
}
