//! The data directory: its layout, atomic writes, and the stores for API registrations and
//! proxy tokens.
//!
//! Every file is written whole to a temporary file in the same directory, fsynced, renamed
//! over the old one, and the directory fsynced: a crash leaves the old content or the new,
//! never a mix. A file that cannot be read back is moved aside with its path reported,
//! never silently dropped. This is the only module of the crate that writes files.

use std::collections::BTreeMap;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::{self, DisplayPath, Format, Origin};
use crate::id::{ProxyId, ServiceId};
use crate::service::Service;
use crate::token::ProxyToken;

/// The mode of every directory tether creates.
pub const DIR_MODE: u32 = 0o700;

/// The mode of every file tether writes.
pub const FILE_MODE: u32 = 0o600;

/// A persistence operation that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PersistError {
    /// A file or directory could not be created, written or removed.
    #[error("cannot write {}", DisplayPath(.path))]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A file or directory could not be read.
    #[error("cannot read {}", DisplayPath(.path))]
    Read {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A value could not be serialized.
    #[error("cannot encode {}: {message}", DisplayPath(.path))]
    Encode {
        /// The file it was meant for.
        path: PathBuf,
        /// What the encoder said.
        message: String,
    },
}

/// A file that could not be read back and was moved aside.
#[derive(Debug)]
pub struct DamagedFile {
    /// Where it was.
    pub path: PathBuf,
    /// Where it is now (`<path>.corrupt`), or `None` if moving it failed too.
    pub moved_to: Option<PathBuf>,
    /// What was wrong with it.
    pub problem: String,
}

/// The agent's data directory and its layout (SPEC's table).
#[derive(Debug, Clone)]
pub struct DataDir {
    root: PathBuf,
}

impl DataDir {
    /// Opens `root`, creating it and its subdirectories with mode 0700 where missing.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`] if a directory cannot be created.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, PersistError> {
        let dir = Self { root: root.into() };
        for path in [dir.root.clone(), dir.registrations_dir(), dir.pids_dir(), dir.logs_dir()] {
            create_private_dir(&path)?;
        }
        Ok(dir)
    }

    /// The data dir itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `snapshot.json`: the manager's snapshot of running proxies.
    pub fn snapshot_path(&self) -> PathBuf {
        self.root.join("snapshot.json")
    }

    /// `tokens.json`: every proxy's token, so that they survive agent restarts.
    pub fn tokens_path(&self) -> PathBuf {
        self.root.join("tokens.json")
    }

    /// `registrations/`: services registered through the API.
    pub fn registrations_dir(&self) -> PathBuf {
        self.root.join("registrations")
    }

    /// `pids/`: one pid file per running proxy.
    pub fn pids_dir(&self) -> PathBuf {
        self.root.join("pids")
    }

    /// `pids/<proxy id>.pid`.
    pub fn pid_file(&self, id: &ProxyId) -> PathBuf {
        self.pids_dir().join(format!("{id}.pid"))
    }

    /// `logs/`: the proxies' output.
    pub fn logs_dir(&self) -> PathBuf {
        self.root.join("logs")
    }

    /// `logs/<proxy id>-stdout.log` and `logs/<proxy id>-stderr.log`.
    pub fn log_files(&self, id: &ProxyId) -> (PathBuf, PathBuf) {
        let logs = self.logs_dir();
        (logs.join(format!("{id}-stdout.log")), logs.join(format!("{id}-stderr.log")))
    }

    /// `agent.sock`: the control socket.
    pub fn socket_path(&self) -> PathBuf {
        self.root.join("agent.sock")
    }

    /// The store of API registrations.
    pub fn registrations(&self) -> RegistrationStore {
        RegistrationStore { dir: self.registrations_dir() }
    }

    /// The store of proxy tokens.
    pub fn tokens(&self) -> TokenStore {
        TokenStore { path: self.tokens_path() }
    }
}

fn create_private_dir(path: &Path) -> Result<(), PersistError> {
    match DirBuilder::new().mode(DIR_MODE).create(path) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => Ok(()),
        Err(source) => Err(PersistError::Write { path: path.to_owned(), source }),
    }
}

/// Writes `contents` to `path` atomically with mode 0600: temporary file in the same
/// directory, fsync, rename over `path`, fsync of the directory.
///
/// # Errors
///
/// [`PersistError::Write`]; the old content of `path`, if any, is then untouched.
pub fn write_atomic(path: &Path, contents: &[u8]) -> Result<(), PersistError> {
    write_atomic_with(path, |out| out.write_all(contents))
}

/// Like [`write_atomic`], but the contents come from `write`, which writes them to the
/// temporary file (through a buffer): a large file need not be assembled in memory first.
///
/// # Errors
///
/// [`PersistError::Write`], also when `write` fails; the old content of `path`, if any, is
/// then untouched.
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<(), PersistError> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let write_error = |source| PersistError::Write { path: path.to_owned(), source };
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| write_error(io::Error::from(io::ErrorKind::InvalidInput)))?;
    let temp = dir.join(format!(
        ".{}.tmp.{}.{}",
        name.to_string_lossy(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let file = OpenOptions::new().write(true).create_new(true).mode(FILE_MODE).open(&temp)?;
        let mut out = io::BufWriter::new(file);
        write(&mut out)?;
        let file = out.into_inner().map_err(io::IntoInnerError::into_error)?;
        file.sync_all()?;
        fs::rename(&temp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result.map_err(write_error)
}

/// Renames a damaged file to `<path>.corrupt`, replacing an older one.
///
/// # Errors
///
/// The rename's error.
pub fn quarantine(path: &Path) -> io::Result<PathBuf> {
    let mut target = path.as_os_str().to_owned();
    target.push(".corrupt");
    let target = PathBuf::from(target);
    fs::rename(path, &target)?;
    Ok(target)
}

fn damaged(path: PathBuf, problem: String) -> DamagedFile {
    let moved_to = quarantine(&path).ok();
    tracing::warn!(path = %DisplayPath(&path), moved_to = ?moved_to, problem = %problem, "damaged file moved aside");
    DamagedFile { path, moved_to, problem }
}

/// What was read back from `registrations/`.
#[derive(Debug, Default)]
pub struct LoadedRegistrations {
    /// The services, ordered by id.
    pub services: Vec<Service>,
    /// Files that could not be read, now moved aside.
    pub damaged: Vec<DamagedFile>,
}

/// Services registered through the API: `registrations/<service id>.json`, one service
/// object in the register API's schema per file.
#[derive(Debug, Clone)]
pub struct RegistrationStore {
    dir: PathBuf,
}

impl RegistrationStore {
    /// A store in `dir` (which must exist; [`DataDir::open`] creates it).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    fn path(&self, id: &ServiceId) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Saves `service`, replacing an earlier registration of the same id.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`] or [`PersistError::Encode`].
    pub fn save(&self, service: &Service) -> Result<(), PersistError> {
        let path = self.path(&service.id);
        let text = config::to_service_text(service, Format::Json)
            .map_err(|err| PersistError::Encode { path: path.clone(), message: err.to_string() })?;
        write_atomic(&path, text.as_bytes())
    }

    /// Removes a registration; removing one that does not exist is not an error.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`] if the file exists but cannot be removed.
    pub fn remove(&self, id: &ServiceId) -> Result<(), PersistError> {
        let path = self.path(id);
        match fs::remove_file(&path) {
            Ok(()) => File::open(&self.dir)
                .and_then(|dir| dir.sync_all())
                .map_err(|source| PersistError::Write { path: self.dir.clone(), source }),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(PersistError::Write { path, source }),
        }
    }

    /// Reads every registration back. Files that cannot be read or parsed, or whose name
    /// does not match the id inside, are moved aside and reported.
    ///
    /// # Errors
    ///
    /// [`PersistError::Read`] if the directory itself cannot be listed.
    pub fn load(&self) -> Result<LoadedRegistrations, PersistError> {
        let read_error = |source| PersistError::Read { path: self.dir.clone(), source };
        let mut paths = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(read_error)? {
            let path = entry.map_err(read_error)?.path();
            let is_json = path.extension().is_some_and(|ext| ext == "json");
            let hidden = path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.'));
            if is_json && !hidden {
                paths.push(path);
            }
        }
        paths.sort();
        let mut loaded = LoadedRegistrations::default();
        for path in paths {
            match read_registration(&path) {
                Ok(service) => loaded.services.push(service),
                Err(problem) => loaded.damaged.push(damaged(path, problem)),
            }
        }
        Ok(loaded)
    }
}

fn read_registration(path: &Path) -> Result<Service, String> {
    let text = fs::read_to_string(path).map_err(|err| err.to_string())?;
    let service =
        config::parse_service(&text, Format::Json, &Origin::File(path.to_owned())).map_err(|err| err.to_string())?;
    let expected = format!("{}.json", service.id);
    if path.file_name().is_none_or(|name| name != expected.as_str()) {
        return Err(format!("holds service {} but is not named {expected}", service.id));
    }
    Ok(service)
}

/// Every proxy's token, in `tokens.json` (mode 0600).
#[derive(Debug, Clone)]
pub struct TokenStore {
    path: PathBuf,
}

/// What was read back from `tokens.json`.
#[derive(Debug, Default)]
pub struct LoadedTokens {
    /// The tokens, by proxy.
    pub tokens: BTreeMap<ProxyId, ProxyToken>,
    /// The file, if it could not be read and was moved aside.
    pub damaged: Option<DamagedFile>,
}

impl TokenStore {
    /// A store at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// Reads the tokens back. A missing file is an empty store; a damaged one is moved
    /// aside and reported, and the store starts empty (proxies then get new tokens).
    pub fn load(&self) -> LoadedTokens {
        let text = match fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return LoadedTokens::default(),
            Err(err) => {
                return LoadedTokens {
                    tokens: BTreeMap::new(),
                    damaged: Some(damaged(self.path.clone(), err.to_string())),
                };
            }
        };
        match serde_json::from_str::<TokensFile>(&text) {
            Ok(file) if file.version == TOKENS_VERSION => LoadedTokens { tokens: file.tokens, damaged: None },
            Ok(file) => LoadedTokens {
                tokens: BTreeMap::new(),
                damaged: Some(damaged(self.path.clone(), format!("unknown format version {}", file.version))),
            },
            Err(err) => {
                LoadedTokens { tokens: BTreeMap::new(), damaged: Some(damaged(self.path.clone(), err.to_string())) }
            }
        }
    }

    /// Saves `tokens`, replacing the file.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`] or [`PersistError::Encode`].
    pub fn save(&self, tokens: &BTreeMap<ProxyId, ProxyToken>) -> Result<(), PersistError> {
        let file = TokensFileRef { version: TOKENS_VERSION, tokens };
        let text = serde_json::to_string_pretty(&file)
            .map_err(|err| PersistError::Encode { path: self.path.clone(), message: err.to_string() })?;
        write_atomic(&self.path, text.as_bytes())
    }
}

const TOKENS_VERSION: u32 = 1;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    version: u32,
    tokens: BTreeMap<ProxyId, ProxyToken>,
}

#[derive(serde::Serialize)]
struct TokensFileRef<'a> {
    version: u32,
    tokens: &'a BTreeMap<ProxyId, ProxyToken>,
}

#[cfg(test)]
mod tests;
