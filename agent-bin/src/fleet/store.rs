//! `fleet.json` in the data dir: the last set of fleet services read from etcd, so that an
//! agent that starts while etcd is down still runs them.
//!
//! The file is written atomically with mode 0600 (`PrivateDir::write_atomic`, through the
//! data dir's handle, so a link planted at its name is replaced, never followed) after
//! every change of the set, and records the node, the prefix and the etcd revision it
//! reflects. A damaged file, or a link, is moved aside with a warning; a file of another
//! node or prefix is ignored. Loading never fails the agent.

use std::collections::BTreeMap;
use std::path::PathBuf;

use tether_state::config::{self, DisplayPath, Format, Origin};
use tether_state::persist::{DataDir, Durability, PersistError, PrivateDir};

use super::Desired;
use crate::etcd::Layout;

/// The version of the file's format.
const VERSION: u32 = 1;

/// The file's name in the data dir.
const NAME: &str = "fleet.json";

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FleetFile {
    version: u32,
    prefix: String,
    node: String,
    /// The etcd revision the set reflects.
    revision: i64,
    /// Every valid service, by id, as a service object of the register API's JSON schema.
    services: BTreeMap<String, serde_json::Value>,
    /// Keys whose values were skipped, with the problem.
    #[serde(default)]
    invalid: BTreeMap<String, String>,
    /// The mod revision of each service's key (absent in files of earlier agents).
    #[serde(default)]
    mod_revisions: BTreeMap<String, i64>,
}

/// The fleet's file in the data dir.
#[derive(Debug, Clone)]
pub(crate) struct FleetStore {
    dir: PrivateDir,
    /// For messages.
    path: PathBuf,
}

impl FleetStore {
    pub(crate) fn in_data_dir(data: &DataDir) -> Self {
        Self { dir: data.root_dir().clone(), path: data.root().join(NAME) }
    }

    /// Reads the last known set of `layout`'s node, if there is one.
    pub(crate) fn load(&self, layout: &Layout) -> Option<Desired> {
        let bytes = match self.dir.read(NAME) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return None,
            Err(PersistError::Read { source, .. }) => {
                self.damaged(&source.to_string());
                return None;
            }
            Err(err) => {
                self.damaged(&err.to_string());
                return None;
            }
        };
        let file = match serde_json::from_slice::<FleetFile>(&bytes) {
            Ok(file) if file.version == VERSION => file,
            Ok(file) => {
                self.damaged(&format!("unknown format version {}", file.version));
                return None;
            }
            Err(err) => {
                self.damaged(&err.to_string());
                return None;
            }
        };
        if file.node != layout.node() || file.prefix != layout.prefix() {
            tracing::warn!(path = %DisplayPath(&self.path), node = %file.node, prefix = %file.prefix, "fleet file is of another node or prefix; ignored");
            return None;
        }
        let origin = Origin::File(self.path.clone());
        let mut desired = Desired { revision: file.revision, invalid: file.invalid, ..Desired::default() };
        for (id, mod_revision) in file.mod_revisions {
            if let Ok(id) = tether_state::ServiceId::new(&id) {
                desired.mod_revisions.insert(id, mod_revision);
            }
        }
        for (id, value) in file.services {
            match config::parse_service(&value.to_string(), Format::Json, &origin) {
                Ok(service) if service.id.as_str() == id => {
                    desired.services.insert(service.id.clone(), service);
                }
                Ok(_) | Err(_) => {
                    tracing::warn!(path = %DisplayPath(&self.path), service = %id, "fleet file holds an invalid service; skipped");
                    // Without it the set is not the one at `revision`: read it all again.
                    desired.revision = 0;
                }
            }
        }
        Some(desired)
    }

    fn damaged(&self, problem: &str) {
        match self.dir.quarantine(NAME) {
            Ok(moved) => {
                tracing::warn!(path = %DisplayPath(&self.path), moved = %DisplayPath(&moved), problem, "fleet file damaged and moved aside")
            }
            Err(err) => tracing::warn!(path = %DisplayPath(&self.path), problem, error = %err, "fleet file damaged"),
        }
    }

    /// Replaces the file with `desired`.
    ///
    /// # Errors
    ///
    /// [`PersistError::Encode`] or [`PersistError::Write`]; the old file is then untouched.
    pub(crate) fn save(&self, layout: &Layout, desired: &Desired) -> Result<(), PersistError> {
        let encode = |message: String| PersistError::Encode { path: self.path.clone(), message };
        let mut services = BTreeMap::new();
        for (id, service) in &desired.services {
            let text = config::to_service_text(service, Format::Json).map_err(|err| encode(err.to_string()))?;
            let value = serde_json::from_str(&text).map_err(|err| encode(err.to_string()))?;
            services.insert(id.to_string(), value);
        }
        let file = FleetFile {
            version: VERSION,
            prefix: layout.prefix().to_owned(),
            node: layout.node().to_owned(),
            revision: desired.revision,
            services,
            invalid: desired.invalid.clone(),
            mod_revisions: desired.mod_revisions.iter().map(|(id, revision)| (id.to_string(), *revision)).collect(),
        };
        let text = serde_json::to_string_pretty(&file).map_err(|err| encode(err.to_string()))?;
        // Power-loss durability, as before: an agent that starts while etcd is down runs
        // what this file holds.
        self.dir.write_atomic(NAME, Durability::PowerLoss, text.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_set_reads_back_for_the_same_node_only() {
        let temp = tempfile::tempdir().unwrap();
        let data = DataDir::open(temp.path().join("data")).unwrap();
        let store = FleetStore::in_data_dir(&data);
        let layout = Layout::new("/tether", "n1").unwrap();
        let mut desired = Desired::default();
        desired.put_at(
            &layout,
            b"/tether/nodes/n1/services/web",
            br#"{"name": "web", "proxy": {"kill_timeout": "1s"}}"#,
            5,
        );
        desired.put(&layout, b"/tether/nodes/n1/services/bad", b"{");
        desired.revision = 7;
        store.save(&layout, &desired).unwrap();
        assert_eq!(store.load(&layout), Some(desired));
        assert_eq!(store.load(&Layout::new("/tether", "n2").unwrap()), None);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(temp.path().join("data/fleet.json")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn a_damaged_file_is_moved_aside() {
        let temp = tempfile::tempdir().unwrap();
        let data = DataDir::open(temp.path().join("data")).unwrap();
        std::fs::write(temp.path().join("data/fleet.json"), "{").unwrap();
        let layout = Layout::new("/tether", "n1").unwrap();
        assert_eq!(FleetStore::in_data_dir(&data).load(&layout), None);
        assert!(temp.path().join("data/fleet.json.corrupt").exists());
    }

    #[test]
    fn a_linked_file_is_not_read_through_and_a_save_replaces_the_link() {
        let temp = tempfile::tempdir().unwrap();
        let data = DataDir::open(temp.path().join("data")).unwrap();
        let layout = Layout::new("/tether", "n1").unwrap();
        let target = temp.path().join("target");
        let saved = FleetStore::in_data_dir(&DataDir::open(temp.path().join("other")).unwrap());
        saved.save(&layout, &Desired::default()).unwrap();
        std::fs::rename(temp.path().join("other/fleet.json"), &target).unwrap();
        let before = std::fs::read(&target).unwrap();
        std::os::unix::fs::symlink(&target, temp.path().join("data/fleet.json")).unwrap();

        let store = FleetStore::in_data_dir(&data);
        assert_eq!(store.load(&layout), None, "a valid file behind a link is not read");
        assert!(std::fs::symlink_metadata(temp.path().join("data/fleet.json.corrupt")).unwrap().is_symlink());
        std::os::unix::fs::symlink(&target, temp.path().join("data/fleet.json")).unwrap();
        store.save(&layout, &Desired { revision: 9, ..Desired::default() }).unwrap();
        assert!(std::fs::symlink_metadata(temp.path().join("data/fleet.json")).unwrap().is_file());
        assert_eq!(std::fs::read(&target).unwrap(), before);
    }
}
