//! The data directory: its layout, atomic writes, and the stores for API registrations and
//! proxy tokens.
//!
//! Every file is written whole to a temporary file in the same directory and renamed over
//! the old one; files that must survive a power loss are fsynced, and their directory
//! after the rename ([`Durability`]). A crash leaves the old content or the new, never a
//! mix. A file that cannot be read back is moved aside with its path reported, never
//! silently dropped. Everything below the data dir's root is reached through a
//! [`PrivateDir`], never by path, and no symbolic link inside it is followed. This is the
//! only module of the crate that writes files.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::config::{self, DisplayPath, Format, Origin};
use crate::id::{ProxyId, ServiceId};
use crate::service::Service;
use crate::token::ProxyToken;

mod dir;

pub use dir::{Durability, LinkedComponent, PrivateDir, Temporary, UnsafeEntry};

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

const SNAPSHOT: &str = "snapshot.json";
const TOKENS: &str = "tokens.json";
const REGISTRATIONS: &str = "registrations";
const PIDS: &str = "pids";
const LOGS: &str = "logs";
/// Where the bootstraps of the proxies of `kind = "envoy"` are written.
const ENVOY: &str = "envoy";

/// The agent's data directory and its layout (the table in `docs/reference.md`); cheap to
/// clone.
///
/// [`DataDir::open`] opens the root and its subdirectories once, without following a link
/// below the root; every file is then reached through those handles ([`PrivateDir`]).
#[derive(Debug, Clone)]
pub struct DataDir {
    root: PrivateDir,
    registrations: PrivateDir,
    pids: PrivateDir,
    logs: PrivateDir,
}

impl DataDir {
    /// Opens `root`, creating it and its subdirectories with mode 0700 where missing.
    ///
    /// The root and its subdirectories get mode 0700, and every regular file in them
    /// 0600. A symbolic link in place of a subdirectory is reported and replaced by a new
    /// directory; what it pointed to is not touched. The root itself may be a link: the
    /// operator chose that path.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`] if a directory cannot be created or opened.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, PersistError> {
        let root = PrivateDir::open_root(root)?;
        let dir = Self {
            registrations: root.subdir(REGISTRATIONS)?,
            pids: root.subdir(PIDS)?,
            logs: root.subdir(LOGS)?,
            root,
        };
        for handle in [&dir.root, &dir.registrations, &dir.pids, &dir.logs] {
            handle.restrict_files();
        }
        Ok(dir)
    }

    /// Removes the temporary files that a crash of an earlier agent left in the data dir and
    /// its subdirectories (`.<name>.tmp.<pid>.<n>`, between a write and its rename); returns
    /// their paths. Call it only while holding the data dir's lock: every temporary not of
    /// this process is then an abandoned one.
    pub fn remove_temporaries(&self) -> Vec<PathBuf> {
        let own = std::process::id();
        [&self.root, &self.registrations, &self.pids, &self.logs]
            .into_iter()
            .flat_map(|dir| {
                dir.remove_temporaries(None, |pid| pid != own).into_iter().map(|name| dir.path().join(name))
            })
            .collect()
    }

    /// The data dir itself.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// The data dir itself, opened once: for files in it (`agent.lock`, `fleet.json`).
    pub fn root_dir(&self) -> &PrivateDir {
        &self.root
    }

    /// `pids/`, opened once: where pid files are written ([`DataDir::pid_file_name`]).
    pub fn pids(&self) -> &PrivateDir {
        &self.pids
    }

    /// `logs/`, opened once: where the proxies' output goes ([`DataDir::log_file_names`]).
    pub fn logs(&self) -> &PrivateDir {
        &self.logs
    }

    /// `snapshot.json`: the manager's snapshot of running proxies.
    pub fn snapshot_path(&self) -> PathBuf {
        self.root().join(SNAPSHOT)
    }

    /// `tokens.json`: every proxy's token, so that they survive agent restarts.
    pub fn tokens_path(&self) -> PathBuf {
        self.root().join(TOKENS)
    }

    /// `registrations/`: services registered through the API.
    pub fn registrations_dir(&self) -> PathBuf {
        self.root().join(REGISTRATIONS)
    }

    /// `pids/`: one pid file per running proxy.
    pub fn pids_dir(&self) -> PathBuf {
        self.root().join(PIDS)
    }

    /// `<proxy id>.pid`: the name of a proxy's pid file in [`DataDir::pids`]. `name` is a
    /// proxy id, or a process name of the supervisor (the same rule).
    pub fn pid_file_name(name: impl AsRef<str>) -> String {
        format!("{}.pid", name.as_ref())
    }

    /// `pids/<proxy id>.pid`.
    pub fn pid_file(&self, name: impl AsRef<str>) -> PathBuf {
        self.pids_dir().join(Self::pid_file_name(name))
    }

    /// `envoy/<proxy id>.json`: the bootstrap that the agent writes before each start of a
    /// proxy of `kind = "envoy"`, and gives it with `-c`.
    pub fn envoy_bootstrap_path(&self, id: &crate::ProxyId) -> PathBuf {
        self.root().join(ENVOY).join(Self::envoy_bootstrap_name(id))
    }

    /// `<proxy id>.json`: the name of a proxy's bootstrap in [`DataDir::envoy_dir`].
    pub fn envoy_bootstrap_name(id: &crate::ProxyId) -> String {
        format!("{}.json", id.as_str())
    }

    /// `envoy/`, made if it is missing: where the bootstraps are written.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`] when it cannot be made or opened.
    pub fn envoy_dir(&self) -> Result<PrivateDir, PersistError> {
        self.root.subdir(ENVOY)
    }

    /// `logs/`: the proxies' output.
    pub fn logs_dir(&self) -> PathBuf {
        self.root().join(LOGS)
    }

    /// `<proxy id>-stdout.log` and `<proxy id>-stderr.log`: the names of a proxy's log
    /// files in [`DataDir::logs`].
    pub fn log_file_names(name: impl AsRef<str>) -> (String, String) {
        let name = name.as_ref();
        (format!("{name}-stdout.log"), format!("{name}-stderr.log"))
    }

    /// `logs/<proxy id>-stdout.log` and `logs/<proxy id>-stderr.log`.
    pub fn log_files(&self, name: impl AsRef<str>) -> (PathBuf, PathBuf) {
        let logs = self.logs_dir();
        let (stdout, stderr) = Self::log_file_names(name);
        (logs.join(stdout), logs.join(stderr))
    }

    /// The abstract address of the supervisor's notification socket (`NOTIFY_SOCKET`):
    /// `@tether-notify-` and a digest of the data dir's path, so that it is the same for
    /// every agent on this data dir (proxies they adopt still reach it) and differs between
    /// data dirs.
    pub fn notify_address(&self) -> String {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(self.root().as_os_str().as_encoded_bytes());
        let hex: String = digest.iter().take(12).map(|byte| format!("{byte:02x}")).collect();
        format!("@tether-notify-{hex}")
    }

    /// `agent.sock`: the control socket.
    pub fn socket_path(&self) -> PathBuf {
        self.root().join("agent.sock")
    }

    /// `keeper.sock`: the socket of the keeper, the process that is the parent of the
    /// proxies and outlives the agent.
    pub fn keeper_socket_path(&self) -> PathBuf {
        self.root().join("keeper.sock")
    }

    /// The store of API registrations.
    pub fn registrations(&self) -> RegistrationStore {
        RegistrationStore::new(self.registrations.clone())
    }

    /// The store of proxy tokens.
    pub fn tokens(&self) -> TokenStore {
        TokenStore::new(self.root.clone())
    }
}

/// Writes `contents` to `path` atomically with mode 0600: temporary file in the same
/// directory, fsync, rename over `path`, fsync of the directory ([`Durability::PowerLoss`]).
///
/// `path`'s directory is opened by path; the file itself is never followed if it is a
/// link. Files of the data dir are written through [`DataDir`]'s handles instead.
///
/// # Errors
///
/// [`PersistError::Write`]; the old content of `path`, if any, is then untouched.
pub fn write_atomic(path: &Path, contents: &[u8]) -> Result<(), PersistError> {
    write_atomic_with(path, Durability::PowerLoss, |out| out.write_all(contents))
}

/// Like [`write_atomic`], but the contents come from `write`, which writes them to the
/// temporary file (through a buffer): a large file need not be assembled in memory first;
/// and what the write must survive is the caller's choice ([`Durability`]).
///
/// # Errors
///
/// [`PersistError::Write`], also when `write` fails; the old content of `path`, if any, is
/// then untouched.
pub fn write_atomic_with(
    path: &Path,
    durability: Durability,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<(), PersistError> {
    let (dir, name) =
        PrivateDir::open_parent_of(path).map_err(|source| PersistError::Write { path: path.to_owned(), source })?;
    dir.write_atomic_with(name, durability, write)
}

/// Like [`write_atomic_with`], but `write` gets the temporary file itself (mode 0600), so
/// that it can also set the file's mode and owner before the rename puts it in place.
/// The directory of `path` is opened as it is; a symbolic link at `path` is replaced by
/// the rename, never written through.
///
/// # Errors
///
/// [`PersistError::Write`], also when `write` fails; the old content of `path`, if any, is
/// then untouched.
pub fn write_atomic_file(
    path: &Path,
    durability: Durability,
    write: impl FnOnce(&mut fs::File) -> io::Result<()>,
) -> Result<(), PersistError> {
    let (dir, name) =
        PrivateDir::open_parent_of(path).map_err(|source| PersistError::Write { path: path.to_owned(), source })?;
    dir.write_atomic_file(name, durability, write)
}

/// The directory of the absolute file path `path`, opened without following a link at any
/// component ([`PrivateDir::open_no_follow`]), and the file's name in it.
///
/// # Errors
///
/// As [`PrivateDir::open_no_follow`]; [`io::ErrorKind::InvalidInput`] when `path` names
/// no file.
pub fn open_parent_no_follow(path: &Path) -> io::Result<(PrivateDir, &OsStr)> {
    let name = path.file_name().ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let parent = path.parent().ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    Ok((PrivateDir::open_no_follow(parent)?, name))
}

/// Removes the temporary files that [`write_atomic_file`] and its kin left beside the
/// absolute file path `path` when their process died between a write and its rename
/// (`.<file name>.tmp.<pid>.<n>`), if that process is gone; returns their paths. Other
/// entries of the directory, and the temporaries of live processes, are not touched. The
/// directory is reached without following a link ([`open_parent_no_follow`]).
///
/// # Errors
///
/// When the directory of `path` cannot be opened.
pub fn remove_abandoned_temporaries(path: &Path) -> io::Result<Vec<PathBuf>> {
    let (dir, name) = open_parent_no_follow(path)?;
    let own = std::process::id();
    let gone = |pid: u32| {
        let Ok(raw) = i32::try_from(pid) else { return false };
        pid != own && nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), None) == Err(nix::errno::Errno::ESRCH)
    };
    Ok(dir.remove_temporaries(Some(name), gone).into_iter().map(|entry| dir.path().join(entry)).collect())
}

/// Reads the whole regular file at `path` without following it if it is a link (its
/// directory is opened by path).
///
/// # Errors
///
/// [`io::ErrorKind::NotFound`] if there is no file; an error whose source is an
/// [`UnsafeEntry`] if `path` is a link, a file with other hard links or a special file.
pub fn read_no_follow(path: &Path) -> io::Result<Vec<u8>> {
    let (dir, name) = PrivateDir::open_parent_of(path)?;
    match dir.read(name) {
        Ok(Some(bytes)) => Ok(bytes),
        Ok(None) => Err(io::Error::from(io::ErrorKind::NotFound)),
        Err(PersistError::Read { source, .. }) => Err(source),
        Err(other) => Err(io::Error::other(other)),
    }
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

fn damaged(dir: &PrivateDir, name: &OsStr, problem: String) -> DamagedFile {
    let path = dir.path().join(name);
    let moved_to = dir.quarantine(name).ok();
    tracing::warn!(path = %DisplayPath(&path), moved_to = ?moved_to, problem = %problem, "damaged file moved aside");
    DamagedFile { path, moved_to, problem }
}

/// What was read back from `registrations/`.
#[derive(Debug, Default)]
pub struct LoadedRegistrations {
    /// The services, ordered by id.
    pub services: Vec<Service>,
    /// The proxies' tokens that their registrations' files hold
    /// ([`RegistrationStore::save_with_token`]).
    pub tokens: BTreeMap<ProxyId, ProxyToken>,
    /// Files that could not be read, now moved aside.
    pub damaged: Vec<DamagedFile>,
}

/// The extended attribute of a registration's file that holds its proxy's token.
const TOKEN_ATTRIBUTE: &str = "user.tether.token";

/// Longer than any token that [`ProxyToken::from_hex`] takes back from a file.
const TOKEN_ATTRIBUTE_MAX: usize = 1024;

/// Services registered through the API: `registrations/<service id>.json`, one service
/// object in the register API's schema per file.
///
/// Registrations must survive a power loss ([`Durability::PowerLoss`]): every write and
/// removal is fsynced, file and directory.
#[derive(Debug, Clone)]
pub struct RegistrationStore {
    dir: PrivateDir,
}

impl RegistrationStore {
    /// A store in `dir` ([`DataDir::registrations`] opens `registrations/`).
    pub fn new(dir: PrivateDir) -> Self {
        Self { dir }
    }

    fn name(id: &ServiceId) -> String {
        format!("{id}.json")
    }

    /// Saves `service`, replacing an earlier registration of the same id.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`] or [`PersistError::Encode`].
    pub fn save(&self, service: &Service) -> Result<(), PersistError> {
        let name = Self::name(&service.id);
        let text = self.text(service, &name)?;
        self.dir.write_atomic(&name, Durability::PowerLoss, text.as_bytes())
    }

    /// Saves `service` as [`RegistrationStore::save`] does, with its proxy's `token` in an
    /// extended attribute of the same file (`user.tether.token`), so that the one fsync
    /// that makes the registration durable makes the token durable too, without a rewrite
    /// of `tokens.json` and its every proxy's token first. `Ok(false)`: the file system
    /// keeps no such attribute; the registration is saved without it, and the token must
    /// reach `tokens.json` before its proxy may start.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`] or [`PersistError::Encode`].
    pub fn save_with_token(&self, service: &Service, token: &ProxyToken) -> Result<bool, PersistError> {
        let name = Self::name(&service.id);
        let text = self.text(service, &name)?;
        let mut kept = false;
        self.dir.write_atomic_file(&name, Durability::PowerLoss, |file| {
            file.write_all(text.as_bytes())?;
            // Not supported (or refused, for want of room): the caller's other way.
            kept = rustix::fs::fsetxattr(
                &*file,
                TOKEN_ATTRIBUTE,
                token.expose().as_bytes(),
                rustix::fs::XattrFlags::empty(),
            )
            .is_ok();
            Ok(())
        })?;
        Ok(kept)
    }

    /// The token that the registration of `id` holds for its proxy, if it has one.
    pub fn token(&self, id: &ServiceId) -> Option<ProxyToken> {
        let name = Self::name(id);
        let file = self.dir.open_read(&name).ok()??;
        read_token(&file, &self.dir.path().join(&name))
    }

    fn text(&self, service: &Service, name: &str) -> Result<String, PersistError> {
        config::to_service_text(service, Format::Json)
            .map_err(|err| PersistError::Encode { path: self.dir.path().join(name), message: err.to_string() })
    }

    /// Removes a registration; removing one that does not exist is not an error.
    ///
    /// # Errors
    ///
    /// [`PersistError::Write`] if the file exists but cannot be removed.
    pub fn remove(&self, id: &ServiceId) -> Result<(), PersistError> {
        self.dir.remove(Self::name(id), Durability::PowerLoss).map(drop)
    }

    /// Reads every registration back. Files that cannot be read or parsed, or whose name
    /// does not match the id inside, are moved aside and reported; so are links, which are
    /// never followed.
    ///
    /// # Errors
    ///
    /// [`PersistError::Read`] if the directory itself cannot be listed.
    pub fn load(&self) -> Result<LoadedRegistrations, PersistError> {
        let mut names: Vec<_> = self
            .dir
            .names()?
            .into_iter()
            .filter(|name| {
                let name = Path::new(name);
                let is_json = name.extension().is_some_and(|ext| ext == "json");
                let hidden = name.as_os_str().to_string_lossy().starts_with('.');
                is_json && !hidden
            })
            .collect();
        names.sort();
        let mut loaded = LoadedRegistrations::default();
        for name in names {
            match self.read_registration(&name) {
                Ok((service, token)) => {
                    if let Some(token) = token.filter(|_| service.proxy.is_some()) {
                        loaded.tokens.insert(service.id.proxy_id(), token);
                    }
                    loaded.services.push(service);
                }
                Err(problem) => loaded.damaged.push(damaged(&self.dir, &name, problem)),
            }
        }
        Ok(loaded)
    }

    fn read_registration(&self, name: &OsStr) -> Result<(Service, Option<ProxyToken>), String> {
        let path = self.dir.path().join(name);
        let mut file = match self.dir.open_read(name) {
            Ok(Some(file)) => file,
            Ok(None) => return Err("removed while it was read".to_owned()),
            Err(PersistError::Read { source, .. }) => return Err(source.to_string()),
            Err(err) => return Err(err.to_string()),
        };
        let mut bytes = Vec::new();
        io::Read::read_to_end(&mut file, &mut bytes).map_err(|err| err.to_string())?;
        let text = String::from_utf8(bytes).map_err(|err| err.to_string())?;
        let service =
            config::parse_service(&text, Format::Json, &Origin::File(path.clone())).map_err(|err| err.to_string())?;
        let expected = Self::name(&service.id);
        if name != expected.as_str() {
            return Err(format!("holds service {} but is not named {expected}", service.id));
        }
        Ok((service, read_token(&file, &path)))
    }
}

/// The token in a registration's file, if it has one; one that is not a token is reported
/// and left out (its proxy then has the token of `tokens.json`, or a new one).
fn read_token(file: &fs::File, path: &Path) -> Option<ProxyToken> {
    let mut value = [0u8; TOKEN_ATTRIBUTE_MAX];
    let length = rustix::fs::fgetxattr(file, TOKEN_ATTRIBUTE, &mut value).ok()?;
    let token = std::str::from_utf8(&value[..length]).ok().and_then(|hex| ProxyToken::from_hex(hex).ok());
    if token.is_none() {
        tracing::warn!(path = %DisplayPath(path), attribute = TOKEN_ATTRIBUTE, "registration's token attribute is not a token; left out");
    }
    token
}

/// Every proxy's token, in `tokens.json` (mode 0600).
///
/// Tokens must survive a power loss ([`Durability::PowerLoss`]): a proxy that lost its
/// token is restarted with a new one.
#[derive(Debug, Clone)]
pub struct TokenStore {
    dir: PrivateDir,
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
    /// A store at `tokens.json` in `dir` (the data dir's root: [`DataDir::tokens`]).
    pub fn new(dir: PrivateDir) -> Self {
        Self { dir }
    }

    /// Reads the tokens back. A missing file is an empty store; a damaged one (or a link,
    /// which is never followed) is moved aside and reported, and the store starts empty
    /// (proxies then get new tokens).
    pub fn load(&self) -> LoadedTokens {
        let damaged = |problem: String| LoadedTokens {
            tokens: BTreeMap::new(),
            damaged: Some(damaged(&self.dir, OsStr::new(TOKENS), problem)),
        };
        let bytes = match self.dir.read(TOKENS) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return LoadedTokens::default(),
            Err(PersistError::Read { source, .. }) => return damaged(source.to_string()),
            Err(err) => return damaged(err.to_string()),
        };
        match serde_json::from_slice::<TokensFile>(&bytes) {
            Ok(file) if file.version == TOKENS_VERSION => LoadedTokens { tokens: file.tokens, damaged: None },
            Ok(file) => damaged(format!("unknown format version {}", file.version)),
            Err(err) => damaged(err.to_string()),
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
            .map_err(|err| PersistError::Encode { path: self.dir.path().join(TOKENS), message: err.to_string() })?;
        self.dir.write_atomic(TOKENS, Durability::PowerLoss, text.as_bytes())
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
