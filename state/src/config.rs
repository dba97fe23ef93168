//! The configuration schema: `[[service]]` tables in TOML, `{"service": [...]}` in JSON,
//! and one service object as the body of the register API.
//!
//! Text is parsed into private `serde` structs that refuse unknown keys and validate every
//! value as it is read, so that each error carries the file, the line (TOML) or position
//! (JSON) and the field. Only valid [`Service`] values leave this module. It reads files
//! but never writes any.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::id::ServiceId;
use crate::service::{
    CommandLine, ExecMode, KillPolicy, KillSignal, LogPolicy, ProxyCommand, ProxyConfigMap, ProxySpec, RestartPolicy,
    Service, ServiceName,
};

/// The largest config file read, in bytes. Larger files are refused, not truncated.
pub const MAX_FILE_SIZE: u64 = 16 * 1024 * 1024;

/// How deep a proxy's `config` may nest tables and arrays, counting the `config` table
/// itself: `config = { a = { b = [1] } }` is 3 deep. Deeper values are refused where they
/// are read, with the field that goes too deep: a service is written back into
/// registrations, snapshots and API answers inside a few more levels, and read again by
/// parsers that stop at a recursion limit of their own (`serde_json`'s is 128), so a value
/// that nested without bound would make those files unreadable.
pub const MAX_CONFIG_DEPTH: usize = 32;

/// Where a piece of configuration came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A file on disk.
    File(PathBuf),
    /// The body of an API request.
    Body,
}

/// A place in a config file or request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The file or body.
    pub origin: Origin,
    /// The 1-based line, when known.
    pub line: Option<usize>,
    /// The 1-based column, when known.
    pub column: Option<usize>,
}

impl Location {
    fn file(path: &Path) -> Self {
        Self { origin: Origin::File(path.to_owned()), line: None, column: None }
    }

    fn at(origin: &Origin, line: usize, column: usize) -> Self {
        Self { origin: origin.clone(), line: Some(line), column: Some(column) }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.origin {
            Origin::File(path) => write!(f, "{}", DisplayPath(path))?,
            Origin::Body => f.write_str("request body")?,
        }
        match (self.line, self.column) {
            (Some(line), Some(column)) => write!(f, ":{line}:{column}"),
            (Some(line), None) => write!(f, ":{line}"),
            _ => Ok(()),
        }
    }
}

/// Shows a path with control characters escaped, so that a hostile file name cannot
/// rewrite the terminal or forge log lines.
pub struct DisplayPath<'a>(pub &'a Path);

impl fmt::Display for DisplayPath<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.to_string_lossy().chars() {
            if c.is_control() {
                write!(f, "{}", c.escape_default())?;
            } else {
                fmt::Write::write_char(f, c)?;
            }
        }
        Ok(())
    }
}

/// One thing wrong with the configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A file or directory could not be read.
    #[error("{location}: cannot read")]
    Read {
        /// The file or directory.
        location: Location,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file is larger than [`MAX_FILE_SIZE`].
    #[error("{location}: file is larger than {MAX_FILE_SIZE} bytes")]
    TooLarge {
        /// The file.
        location: Location,
    },
    /// A `*.toml` or `*.json` entry that is not a regular file.
    #[error("{location}: not a regular file")]
    NotAFile {
        /// The entry.
        location: Location,
    },
    /// A file is not UTF-8 text.
    #[error("{location}: not valid UTF-8")]
    NotUtf8 {
        /// Where the first invalid byte is.
        location: Location,
    },
    /// The text does not follow the schema: a syntax error, an unknown key or an invalid value.
    #[error("{location}: {}{message}", field_prefix(.field))]
    Invalid {
        /// Where.
        location: Location,
        /// The path of the field, such as `service[0].proxy.kill_timeout`.
        field: Option<String>,
        /// What is wrong, in the parser's words.
        message: String,
    },
    /// Two services share an id.
    #[error("{location}: duplicate service id `{id}`: already defined at {first}")]
    Duplicate {
        /// The second definition.
        location: Location,
        /// The id.
        id: ServiceId,
        /// The first definition.
        first: Box<Location>,
    },
}

fn field_prefix(field: &Option<String>) -> String {
    match field {
        Some(field) if !field.is_empty() => format!("field `{field}`: "),
        _ => String::new(),
    }
}

impl ConfigError {
    /// Where the error is.
    pub fn location(&self) -> &Location {
        match self {
            Self::Read { location, .. }
            | Self::TooLarge { location }
            | Self::NotAFile { location }
            | Self::NotUtf8 { location }
            | Self::Invalid { location, .. }
            | Self::Duplicate { location, .. } => location,
        }
    }
}

/// Every error found in a set of config dirs.
#[derive(Debug, thiserror::Error)]
#[error("{} error(s) in the configuration", .0.len())]
pub struct ConfigErrors(pub Vec<ConfigError>);

/// A service read from a config file, with the file it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigEntry {
    /// The service.
    pub service: Service,
    /// The file that defines it.
    pub file: PathBuf,
}

/// The text format of a config file or body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// TOML: `[[service]]` tables.
    Toml,
    /// JSON: `{"service": [...]}`.
    Json,
}

impl Format {
    /// The format of a file, by its extension: `.toml` or `.json`.
    pub fn of_path(path: &Path) -> Option<Self> {
        match path.extension()?.to_str()? {
            "toml" => Some(Self::Toml),
            "json" => Some(Self::Json),
            _ => None,
        }
    }
}

/// Loads every `*.toml` and `*.json` file directly in each dir, in lexical order per dir.
///
/// # Errors
///
/// Every error found, across all files: unreadable or invalid files, and service ids
/// defined twice (in one file or in two).
pub fn load_dirs<P: AsRef<Path>>(dirs: &[P]) -> Result<Vec<ConfigEntry>, ConfigErrors> {
    let scan = scan(dirs.iter().map(AsRef::as_ref), &HashMap::new());
    let files = scan.into_result()?;
    let mut entries = Vec::new();
    for file in files {
        // Nothing else holds the file: move its services out rather than clone them.
        let file = Arc::try_unwrap(file).unwrap_or_else(|shared| (*shared).clone());
        let path = file.path;
        entries.extend(file.services.into_iter().map(|service| ConfigEntry { service, file: path.clone() }));
    }
    Ok(entries)
}

/// Loads a set of config dirs again and again, as [`load_dirs`] does, but reads again only
/// the files that changed since the last load.
///
/// A file is taken from the previous load when its device, inode, size, modification time
/// and change time are all as they were when it was last read, and it was last changed
/// well before that read ([`SETTLE_TIME`]): a file changed within the timestamps'
/// granularity of the read could change again without its timestamps showing it, so it is
/// read every time until it has settled. Files that failed are always read again. Every
/// load lists the dirs afresh, so added and removed files are always seen, and the result
/// and the errors are exactly those of [`load_dirs`] on the same files.
///
/// ```
/// use tether_state::config::ConfigLoader;
///
/// let dir = tempfile::tempdir().unwrap();
/// std::fs::write(dir.path().join("web.toml"), "[[service]]\nname = \"web\"\n").unwrap();
/// let mut loader = ConfigLoader::new(vec![dir.path().to_owned()]);
/// assert_eq!(loader.load().unwrap()[0].service.id.as_str(), "web");
/// std::fs::write(dir.path().join("api.toml"), "[[service]]\nname = \"api\"\n").unwrap();
/// let ids: Vec<_> = loader.load().unwrap().into_iter().map(|e| e.service.id.to_string()).collect();
/// assert_eq!(ids, ["api", "web"]);
/// ```
pub struct ConfigLoader {
    dirs: Vec<PathBuf>,
    cache: HashMap<PathBuf, Arc<LoadedFile>>,
    settle_time: Duration,
    last: LoadStats,
}

impl fmt::Debug for ConfigLoader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the cached texts: a proxy's `env` may hold secrets.
        f.debug_struct("ConfigLoader")
            .field("dirs", &self.dirs)
            .field("cached_files", &self.cache.len())
            .field("settle_time", &self.settle_time)
            .finish_non_exhaustive()
    }
}

/// How long after its last change a file's timestamps are trusted to show any further
/// change; see [`ConfigLoader`]. Covers file systems with one- or two-second timestamps,
/// and a write still in progress while the file is read.
pub const SETTLE_TIME: Duration = Duration::from_secs(2);

/// What the last [`ConfigLoader::load`] did with the files it found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadStats {
    /// Files read and parsed (successfully or not).
    pub read: usize,
    /// Files taken unchanged from an earlier load.
    pub reused: usize,
}

impl ConfigLoader {
    /// A loader of `dirs` that has read nothing yet.
    pub fn new(dirs: Vec<PathBuf>) -> Self {
        Self::with_settle_time(dirs, SETTLE_TIME)
    }

    /// A loader that trusts a file's timestamps once it has not changed for `settle_time`.
    /// [`ConfigLoader::new`] uses [`SETTLE_TIME`]; a shorter time is only safe on file
    /// systems with fine timestamps, and suits tests.
    pub fn with_settle_time(dirs: Vec<PathBuf>, settle_time: Duration) -> Self {
        Self { dirs, cache: HashMap::new(), settle_time, last: LoadStats::default() }
    }

    /// The dirs this loader reads.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Loads every config file of the dirs, reading only those that changed.
    ///
    /// # Errors
    ///
    /// Exactly those of [`load_dirs`]. The files that did load are remembered all the same,
    /// so that a reload after a fix reads only the fixed file.
    pub fn load(&mut self) -> Result<Vec<ConfigEntry>, ConfigErrors> {
        let files = self.load_files()?;
        let mut entries = Vec::new();
        for file in &files {
            entries.extend(
                file.services()
                    .iter()
                    .map(|service| ConfigEntry { service: service.clone(), file: file.0.path.clone() }),
            );
        }
        Ok(entries)
    }

    /// Like [`ConfigLoader::load`], file by file: a file that was not read again is the
    /// same [`ConfigFile`] as in the last load ([`ConfigFile::same_read`]), so that a caller
    /// can skip what did not change without comparing services.
    ///
    /// # Errors
    ///
    /// As [`ConfigLoader::load`].
    pub fn load_files(&mut self) -> Result<Vec<ConfigFile>, ConfigErrors> {
        let scan = scan(self.dirs.iter().map(PathBuf::as_path), &self.cache);
        self.last = scan.stats;
        self.cache = scan
            .files
            .iter()
            .filter(|file| file.settled(self.settle_time))
            .map(|file| (file.path.clone(), file.clone()))
            .collect();
        Ok(scan.into_result()?.into_iter().map(ConfigFile).collect())
    }

    /// What the last load read and what it reused.
    pub fn last_stats(&self) -> LoadStats {
        self.last
    }
}

/// One config file and its services, as a [`ConfigLoader`] read it. Cheap to clone: clones
/// share the parsed services.
#[derive(Clone)]
pub struct ConfigFile(Arc<LoadedFile>);

impl ConfigFile {
    /// The file.
    pub fn path(&self) -> &Path {
        &self.0.path
    }

    /// Its services, in the file's order.
    pub fn services(&self) -> &[Service] {
        &self.0.services
    }

    /// Whether both come from the same read of a file: a loader hands out the same read
    /// again for as long as the file does not change.
    pub fn same_read(&self, other: &ConfigFile) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl fmt::Debug for ConfigFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<&str> = self.0.services.iter().map(|service| service.id.as_str()).collect();
        f.debug_struct("ConfigFile").field("path", &self.0.path).field("services", &ids).finish()
    }
}

/// The files of one pass over the config dirs, with every error found.
struct Scan {
    files: Vec<Arc<LoadedFile>>,
    errors: Vec<ConfigError>,
    stats: LoadStats,
}

impl Scan {
    /// The files, or every error: those of the files, then ids defined in two files.
    fn into_result(mut self) -> Result<Vec<Arc<LoadedFile>>, ConfigErrors> {
        // Cross-file duplicates; positions are worked out only for the files involved.
        let mut seen: HashMap<&ServiceId, (usize, usize)> = HashMap::new();
        let mut duplicates = Vec::new();
        for (file_index, file) in self.files.iter().enumerate() {
            for (service_index, service) in file.services.iter().enumerate() {
                match seen.get(&service.id) {
                    Some(&first) => duplicates.push((first, (file_index, service_index))),
                    None => {
                        seen.insert(&service.id, (file_index, service_index));
                    }
                }
            }
        }
        for ((first_file, first_index), (file_index, service_index)) in duplicates {
            let file = &self.files[file_index];
            self.errors.push(ConfigError::Duplicate {
                location: file.location_of(service_index),
                id: file.services[service_index].id.clone(),
                first: Box::new(self.files[first_file].location_of(first_index)),
            });
        }
        if !self.errors.is_empty() {
            return Err(ConfigErrors(self.errors));
        }
        Ok(self.files)
    }
}

/// Lists `dirs` and loads their files, taking from `cache` those that did not change.
fn scan<'a>(dirs: impl Iterator<Item = &'a Path>, cache: &HashMap<PathBuf, Arc<LoadedFile>>) -> Scan {
    let mut scan = Scan { files: Vec::new(), errors: Vec::new(), stats: LoadStats::default() };
    for dir in dirs {
        match config_files(dir) {
            Ok(paths) => {
                for path in paths {
                    if let Some(cached) = cache.get(&path).filter(|cached| cached.unchanged()) {
                        scan.stats.reused += 1;
                        scan.files.push(cached.clone());
                        continue;
                    }
                    scan.stats.read += 1;
                    match load_file(&path) {
                        Ok(loaded) => scan.files.push(Arc::new(loaded)),
                        Err(err) => scan.errors.push(err),
                    }
                }
            }
            Err(err) => scan.errors.push(err),
        }
    }
    scan
}

/// What identifies one version of a file's content, as far as its metadata can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fingerprint {
    dev: u64,
    ino: u64,
    size: u64,
    /// Modification time, in nanoseconds since the epoch.
    mtime: i128,
    /// Status change time, in nanoseconds since the epoch: unlike the modification time, no
    /// tool can set it back, so a rewrite that keeps the size and the old mtime still shows.
    ctime: i128,
}

impl Fingerprint {
    fn of(metadata: &fs::Metadata) -> Self {
        let nanos = |secs: i64, nsecs: i64| i128::from(secs) * 1_000_000_000 + i128::from(nsecs);
        Self {
            dev: metadata.dev(),
            ino: metadata.ino(),
            size: metadata.size(),
            mtime: nanos(metadata.mtime(), metadata.mtime_nsec()),
            ctime: nanos(metadata.ctime(), metadata.ctime_nsec()),
        }
    }
}

/// The wall clock in nanoseconds since the epoch, or `None` before it.
fn now_nanos() -> Option<i128> {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?;
    i128::try_from(since.as_nanos()).ok()
}

/// A config file that parsed, with its text kept to point at its services on error.
#[derive(Clone)]
struct LoadedFile {
    path: PathBuf,
    text: String,
    format: Format,
    services: Vec<Service>,
    /// The metadata of the file as it was read.
    fingerprint: Fingerprint,
    /// The wall clock just before the file was looked at, if known.
    read_at: Option<i128>,
}

impl LoadedFile {
    fn location_of(&self, index: usize) -> Location {
        let origin = Origin::File(self.path.clone());
        service_location(&self.text, self.format, &origin, index)
    }

    /// Whether the file had stopped changing `settle_time` before it was read, so that its
    /// timestamps would show any later change.
    fn settled(&self, settle_time: Duration) -> bool {
        let Some(read_at) = self.read_at else { return false };
        let changed = self.fingerprint.mtime.max(self.fingerprint.ctime);
        changed.saturating_add(settle_time.as_nanos().try_into().unwrap_or(i128::MAX)) < read_at
    }

    /// Whether the file on disk still has the metadata it had when it was read.
    fn unchanged(&self) -> bool {
        fs::metadata(&self.path).is_ok_and(|now| now.is_file() && Fingerprint::of(&now) == self.fingerprint)
    }
}

/// The `*.toml` and `*.json` files directly in `dir`, sorted by name.
fn config_files(dir: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let read_error = |source| ConfigError::Read { location: Location::file(dir), source };
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(read_error)? {
        let path = entry.map_err(read_error)?.path();
        if Format::of_path(&path).is_some() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Loads and parses one config file.
fn load_file(path: &Path) -> Result<LoadedFile, ConfigError> {
    let read_at = now_nanos();
    let location = Location::file(path);
    let Some(format) = Format::of_path(path) else {
        return Err(ConfigError::NotAFile { location });
    };
    // Look before opening: opening a FIFO (or a symlink to one) for reading blocks until a
    // writer comes, which would hang `validate`, the agent's start and every reload. The
    // check after opening still guards against an entry replaced in between.
    let target = fs::metadata(path).map_err(|source| ConfigError::Read { location: location.clone(), source })?;
    if !target.is_file() {
        return Err(ConfigError::NotAFile { location });
    }
    let file = fs::File::open(path).map_err(|source| ConfigError::Read { location: location.clone(), source })?;
    let metadata = file.metadata().map_err(|source| ConfigError::Read { location: location.clone(), source })?;
    if !metadata.is_file() {
        return Err(ConfigError::NotAFile { location });
    }
    if metadata.len() > MAX_FILE_SIZE {
        return Err(ConfigError::TooLarge { location });
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_SIZE + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| ConfigError::Read { location: location.clone(), source })?;
    if bytes.len() as u64 > MAX_FILE_SIZE {
        return Err(ConfigError::TooLarge { location });
    }
    let text = match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(err) => {
            let valid = &err.as_bytes()[..err.utf8_error().valid_up_to()];
            let valid = std::str::from_utf8(valid).unwrap_or_default();
            let (line, column) = line_column(valid, valid.len());
            return Err(ConfigError::NotUtf8 { location: Location::at(&location.origin, line, column) });
        }
    };
    let services = parse_file(&text, format, &location.origin)?;
    let fingerprint = Fingerprint::of(&metadata);
    Ok(LoadedFile { path: path.to_owned(), text, format, services, fingerprint, read_at })
}

/// Parses the text of a config file.
///
/// # Errors
///
/// [`ConfigError::Invalid`] for the first schema error, [`ConfigError::Duplicate`] for an
/// id defined twice in the text.
///
/// # Examples
///
/// ```
/// use tether_state::config::{parse_file, Format, Origin};
///
/// let text = r#"
/// [[service]]
/// name = "web"
/// port = 8080
/// [service.proxy]
/// kill_timeout = "2s"
/// "#;
/// let services = parse_file(text, Format::Toml, &Origin::Body).unwrap();
/// assert_eq!(services[0].proxy.as_ref().unwrap().kill.timeout.as_secs(), 2);
///
/// let err = parse_file("[[service]]\nname = \"web\"\nprot = 1\n", Format::Toml, &Origin::Body).unwrap_err();
/// assert!(err.to_string().starts_with("request body:3:1: field `service[0].prot`"), "{err}");
/// ```
pub fn parse_file(text: &str, format: Format, origin: &Origin) -> Result<Vec<Service>, ConfigError> {
    let file: FileDef = deserialize(text, format, origin)?;
    let services: Vec<Service> = file.service.into_iter().map(|v| v.0).collect();
    let mut seen: HashMap<&ServiceId, usize> = HashMap::new();
    for (index, service) in services.iter().enumerate() {
        if let Some(&first) = seen.get(&service.id) {
            return Err(ConfigError::Duplicate {
                location: service_location(text, format, origin, index),
                id: service.id.clone(),
                first: Box::new(service_location(text, format, origin, first)),
            });
        }
        seen.insert(&service.id, index);
    }
    Ok(services)
}

/// Parses one service object: the body of `PUT /v1/agent/service/register`.
///
/// # Errors
///
/// [`ConfigError::Invalid`] with the position and field of the first error.
///
/// ```
/// use tether_state::config::{parse_service, Format, Origin};
///
/// let service = parse_service(r#"{"name": "api", "port": 9000, "proxy": {}}"#, Format::Json, &Origin::Body).unwrap();
/// assert_eq!(service.id.as_str(), "api");
/// let err = parse_service(r#"{"name": "api", "proxy": {"exec_mode": "script"}}"#, Format::Json, &Origin::Body).unwrap_err();
/// assert!(err.to_string().contains("field `proxy.exec_mode`"), "{err}");
/// ```
pub fn parse_service(text: &str, format: Format, origin: &Origin) -> Result<Service, ConfigError> {
    let service: Validated = deserialize(text, format, origin)?;
    Ok(service.0)
}

/// Writes services as a config file that [`parse_file`] reads back to the same values.
///
/// # Errors
///
/// Only if the serializer fails, which valid services never make it do.
pub fn to_file_text(services: &[Service], format: Format) -> Result<String, ConfigError> {
    let file = FileOut { service: services.iter().map(ServiceOut::from).collect() };
    serialize(&file, format)
}

/// Writes one service as a body that [`parse_service`] reads back to the same value.
///
/// # Errors
///
/// Only if the serializer fails, which valid services never make it do.
pub fn to_service_text(service: &Service, format: Format) -> Result<String, ConfigError> {
    serialize(&ServiceOut::from(service), format)
}

fn serialize<T: Serialize>(value: &T, format: Format) -> Result<String, ConfigError> {
    let invalid = |message: String| ConfigError::Invalid {
        location: Location { origin: Origin::Body, line: None, column: None },
        field: None,
        message,
    };
    match format {
        Format::Toml => toml::to_string(value).map_err(|err| invalid(err.to_string())),
        Format::Json => serde_json::to_string_pretty(value).map_err(|err| invalid(err.to_string())),
    }
}

fn deserialize<T: de::DeserializeOwned>(text: &str, format: Format, origin: &Origin) -> Result<T, ConfigError> {
    match format {
        Format::Toml => {
            let deserializer = match toml::Deserializer::parse(text) {
                Ok(deserializer) => deserializer,
                Err(err) => return Err(toml_error(text, origin, None, &err)),
            };
            serde_path_to_error::deserialize(deserializer).map_err(|err| {
                let field = err.path().to_string();
                toml_error(text, origin, Some(field), err.inner())
            })
        }
        Format::Json => {
            let mut deserializer = serde_json::Deserializer::from_str(text);
            let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|err| {
                let field = err.path().to_string();
                json_error(origin, Some(field), err.inner())
            })?;
            deserializer.end().map_err(|err| json_error(origin, None, &err))?;
            Ok(value)
        }
    }
}

fn toml_error(text: &str, origin: &Origin, field: Option<String>, err: &toml::de::Error) -> ConfigError {
    let (line, column) = match err.span() {
        Some(span) => line_column(text, span.start),
        None => (1, 1),
    };
    ConfigError::Invalid {
        location: Location::at(origin, line, column),
        field: field.filter(|f| f != "."),
        message: err.message().trim_end().to_owned(),
    }
}

fn json_error(origin: &Origin, field: Option<String>, err: &serde_json::Error) -> ConfigError {
    // serde_json appends " at line L column C" to its messages; the location says it already.
    let message = err.to_string();
    let message = match message.rfind(" at line ") {
        Some(cut) => message[..cut].to_owned(),
        None => message,
    };
    // A syntax error has no meaningful field: the path then ends in `?`.
    let syntax = matches!(err.classify(), serde_json::error::Category::Syntax | serde_json::error::Category::Eof);
    ConfigError::Invalid {
        location: Location::at(origin, err.line().max(1), err.column().max(1)),
        field: field.filter(|f| f != "." && !syntax),
        message,
    }
}

/// The 1-based line and column of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

/// Where the `index`-th service entry of a text that parsed starts. Used only to point at
/// duplicates, so it may be slow, and a failure here only loses the line number.
fn service_location(text: &str, format: Format, origin: &Origin, index: usize) -> Location {
    let start: Option<usize> = match format {
        Format::Toml => {
            #[derive(Deserialize)]
            struct Probe {
                #[serde(default)]
                service: Vec<toml::Spanned<IgnoredAny>>,
            }
            toml::from_str::<Probe>(text).ok().and_then(|probe| probe.service.get(index).map(|s| s.span().start))
        }
        Format::Json => {
            #[derive(Deserialize)]
            struct Probe<'a> {
                #[serde(borrow, default)]
                service: Vec<&'a serde_json::value::RawValue>,
            }
            serde_json::from_str::<Probe<'_>>(text).ok().and_then(|probe| {
                probe.service.get(index).map(|raw| raw.get().as_ptr() as usize - text.as_ptr() as usize)
            })
        }
    };
    match start {
        Some(start) => {
            let (line, column) = line_column(text, start);
            Location::at(origin, line, column)
        }
        None => Location { origin: origin.clone(), line: None, column: None },
    }
}

// ---------------------------------------------------------------------------------------
// The schema, as read.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDef {
    #[serde(default)]
    service: Vec<Validated>,
}

/// A service that passed every check; the struct-level checks run in `TryFrom`.
#[derive(Deserialize)]
#[serde(try_from = "ServiceDef")]
struct Validated(Service);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ServiceDef {
    name: ServiceName,
    id: Option<ServiceId>,
    address: Option<Address>,
    port: Option<u16>,
    tags: Option<Vec<Tag>>,
    meta: Option<BTreeMap<MetaKey, NoNul>>,
    proxy: Option<ProxyDef>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProxyDef {
    exec_mode: Option<ExecModeDef>,
    command: Option<CommandDef>,
    working_dir: Option<AbsolutePath>,
    env: Option<BTreeMap<EnvKey, NoNul>>,
    inherit_env: Option<bool>,
    user: Option<UserName>,
    kill_signal: Option<KillSignal>,
    kill_timeout: Option<HumanDuration>,
    log_max_size: Option<ByteSize>,
    log_keep: Option<LogKeep>,
    config: Option<ConfigDef>,
    restart: Option<RestartDef>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RestartDef {
    free_attempts: Option<u32>,
    max_delay: Option<HumanDuration>,
    healthy_after: Option<HumanDuration>,
}

#[derive(Deserialize, Serialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum ExecModeDef {
    Daemon,
}

impl TryFrom<ServiceDef> for Validated {
    type Error = String;

    fn try_from(def: ServiceDef) -> Result<Self, String> {
        let id = match def.id {
            Some(id) => id,
            None => ServiceId::new(def.name.as_str())
                .map_err(|err| format!("no `id` is given, so the name must be a valid id: {err}"))?,
        };
        let mut service = Service::new(id, def.name);
        if let Some(address) = def.address {
            service.address = address.0;
        }
        service.port = def.port;
        service.tags = def.tags.unwrap_or_default().into_iter().map(|t| t.0).collect();
        service.meta = def.meta.unwrap_or_default().into_iter().map(|(k, v)| (k.0, v.0)).collect();
        service.proxy = def.proxy.map(ProxySpec::from);
        Ok(Self(service))
    }
}

impl From<ProxyDef> for ProxySpec {
    fn from(def: ProxyDef) -> Self {
        let kill_default = KillPolicy::default();
        let restart_default = RestartPolicy::default();
        let log_default = LogPolicy::default();
        let restart = def.restart.unwrap_or(RestartDef { free_attempts: None, max_delay: None, healthy_after: None });
        ProxySpec {
            exec_mode: match def.exec_mode {
                Some(ExecModeDef::Daemon) | None => ExecMode::Daemon,
            },
            command: def.command.map_or(ProxyCommand::BuiltIn, |c| ProxyCommand::Exec(c.0)),
            working_dir: def.working_dir.map(|p| p.0),
            env: def.env.unwrap_or_default().into_iter().map(|(k, v)| (k.0, v.0)).collect(),
            inherit_env: def.inherit_env.unwrap_or(false),
            user: def.user.map(|u| u.0),
            kill: KillPolicy {
                signal: def.kill_signal.unwrap_or(kill_default.signal),
                timeout: def.kill_timeout.map_or(kill_default.timeout, |d| d.0),
            },
            restart: RestartPolicy {
                free_attempts: restart.free_attempts.unwrap_or(restart_default.free_attempts),
                max_delay: restart.max_delay.map_or(restart_default.max_delay, |d| d.0),
                healthy_after: restart.healthy_after.map_or(restart_default.healthy_after, |d| d.0),
            },
            log: LogPolicy {
                max_size: def.log_max_size.map_or(log_default.max_size, |s| s.0),
                keep: def.log_keep.map_or(log_default.keep, |k| k.0),
            },
            config: def.config.map(|c| c.0).unwrap_or_default(),
        }
    }
}

/// Declares a string newtype that validates while it is deserialized.
macro_rules! checked_string {
    ($(#[$doc:meta])* $name:ident, $check:expr) => {
        $(#[$doc])*
        #[derive(PartialEq, Eq, PartialOrd, Ord)]
        struct $name(String);

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let raw = String::deserialize(deserializer)?;
                let check: fn(&str) -> Result<(), String> = $check;
                check(&raw).map_err(de::Error::custom)?;
                Ok(Self(raw))
            }
        }
    };
}

fn no_nul(s: &str) -> Result<(), String> {
    if s.contains('\0') { Err("must not contain NUL bytes".to_owned()) } else { Ok(()) }
}

checked_string!(
    /// A value that can be passed to a process: no NUL.
    NoNul,
    no_nul
);
checked_string!(
    /// A service address: a host name or IP address.
    Address,
    |s| {
        if s.is_empty() || s.len() > 253 {
            return Err(format!("invalid address {s:?}: must be 1 to 253 bytes"));
        }
        if s.chars().any(|c| c.is_whitespace() || c.is_control() || c == '/') {
            return Err(format!("invalid address {s:?}: must be a host name or an IP address"));
        }
        Ok(())
    }
);
checked_string!(
    /// A tag: not empty, no control characters.
    Tag,
    |s| {
        if s.is_empty() || s.chars().any(char::is_control) {
            return Err(format!("invalid tag {s:?}: must be non-empty, without control characters"));
        }
        Ok(())
    }
);
checked_string!(
    /// A meta key: not empty, no control characters.
    MetaKey,
    |s| {
        if s.is_empty() || s.chars().any(char::is_control) {
            return Err(format!("invalid meta key {s:?}: must be non-empty, without control characters"));
        }
        Ok(())
    }
);
checked_string!(
    /// An environment variable name the proxy may be given.
    EnvKey,
    |s| {
        let mut chars = s.chars();
        let well_formed = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !well_formed {
            return Err(format!("invalid environment variable name {s:?}: must match ^[A-Za-z_][A-Za-z0-9_]*$"));
        }
        if s.starts_with("TETHER_") {
            return Err(format!("environment variable {s} is reserved: tether sets the TETHER_* variables itself"));
        }
        Ok(())
    }
);
checked_string!(
    /// A user name (or numeric uid) to run the proxy as.
    UserName,
    |s| {
        if s.is_empty() || s.len() > 256 || s.chars().any(|c| c.is_whitespace() || c.is_control() || c == ':' || c == '/') {
            return Err(format!("invalid user {s:?}: must be a user name or a numeric uid"));
        }
        Ok(())
    }
);

struct AbsolutePath(PathBuf);

impl<'de> Deserialize<'de> for AbsolutePath {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        no_nul(&raw).map_err(de::Error::custom)?;
        let path = PathBuf::from(&raw);
        if !path.is_absolute() {
            return Err(de::Error::custom(format!("working_dir {raw:?} must be an absolute path")));
        }
        Ok(Self(path))
    }
}

struct CommandDef(CommandLine);

impl<'de> Deserialize<'de> for CommandDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let words = Vec::<String>::deserialize(deserializer)?;
        if words.iter().any(|w| w.contains('\0')) {
            return Err(de::Error::custom("command words must not contain NUL bytes"));
        }
        CommandLine::from_words(words)
            .map(Self)
            .ok_or_else(|| de::Error::custom("command must name a program; leave `command` out for the built-in proxy"))
    }
}

/// The opaque `config` table. Any value JSON can hold is accepted; TOML's `nan` and `inf`
/// are refused here, because `serde_json` would quietly turn them into `null`, which the
/// proxy never asked for and which TOML cannot even write back.
struct ConfigDef(ProxyConfigMap);

impl<'de> Deserialize<'de> for ConfigDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TableVisitor;

        impl<'de> Visitor<'de> for TableVisitor {
            type Value = ProxyConfigMap;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map")
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<ProxyConfigMap, A::Error> {
                read_config_map(map, 1)
            }
        }

        deserializer.deserialize_map(TableVisitor).map(Self)
    }
}

/// Reads the entries of a table inside `config` that is `depth` deep.
fn read_config_map<'de, A: de::MapAccess<'de>>(mut map: A, depth: usize) -> Result<ProxyConfigMap, A::Error> {
    let mut values = ProxyConfigMap::new();
    while let Some(key) = map.next_key::<String>()? {
        let value = map.next_value_seed(ConfigValue { container_depth: depth })?;
        values.insert(key, value);
    }
    Ok(values)
}

/// One value inside `config`, read like `serde_json::Value` but without non-finite floats,
/// and no deeper than [`MAX_CONFIG_DEPTH`].
#[derive(Clone, Copy)]
struct ConfigValue {
    /// How deep the table or array that holds the value is.
    container_depth: usize,
}

impl ConfigValue {
    /// The depth of a table or array read as this value, or an error past the limit. Checked
    /// before its entries are read, so that no input recurses further.
    fn nested<E: de::Error>(self) -> Result<usize, E> {
        let depth = self.container_depth + 1;
        if depth > MAX_CONFIG_DEPTH {
            return Err(E::custom(format!(
                "`config` nests tables and arrays more than {MAX_CONFIG_DEPTH} deep (counting `config` itself)"
            )));
        }
        Ok(depth)
    }
}

impl<'de> DeserializeSeed<'de> for ConfigValue {
    type Value = serde_json::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<serde_json::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ConfigValue {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any value JSON can hold")
    }

    fn visit_bool<E: de::Error>(self, value: bool) -> Result<Self::Value, E> {
        Ok(value.into())
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Self::Value, E> {
        Ok(value.into())
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Self::Value, E> {
        Ok(value.into())
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<Self::Value, E> {
        serde_json::Number::from_f64(value).map(serde_json::Value::Number).ok_or_else(|| {
            E::custom(format!("{value} cannot be passed to the proxy as JSON: use a finite number or a string"))
        })
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Self::Value, E> {
        Ok(value.into())
    }

    fn visit_string<E: de::Error>(self, value: String) -> Result<Self::Value, E> {
        Ok(value.into())
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        DeserializeSeed::deserialize(self, deserializer)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let depth = self.nested()?;
        let mut values = Vec::new();
        while let Some(value) = seq.next_element_seed(ConfigValue { container_depth: depth })? {
            values.push(value);
        }
        Ok(serde_json::Value::Array(values))
    }

    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        let depth = self.nested()?;
        read_config_map(map, depth).map(serde_json::Value::Object)
    }
}

struct LogKeep(u32);

impl<'de> Deserialize<'de> for LogKeep {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let keep = u32::deserialize(deserializer)?;
        if keep > 1000 {
            return Err(de::Error::custom(format!("log_keep {keep} is more than 1000 files")));
        }
        Ok(Self(keep))
    }
}

struct HumanDuration(Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        humantime::parse_duration(&raw).map(Self).map_err(|err| {
            de::Error::custom(format!("invalid duration {raw:?}: {err} (examples: \"500ms\", \"5s\", \"1m\")"))
        })
    }
}

/// A size in bytes: an integer, or a string such as `"64MiB"`, `"10MB"`, `"512KiB"`.
struct ByteSize(u64);

/// The smallest log size cap: rotation of smaller files would churn.
const MIN_LOG_SIZE: u64 = 4096;

impl ByteSize {
    fn parse(raw: &str) -> Result<u64, String> {
        let raw = raw.trim();
        let split = raw.find(|c: char| !c.is_ascii_digit()).unwrap_or(raw.len());
        let (digits, unit) = raw.split_at(split);
        let number: u64 = digits
            .parse()
            .map_err(|_| format!("invalid size {raw:?}: expected a number of bytes such as \"64MiB\""))?;
        let factor: u64 = match unit.trim() {
            "" | "B" => 1,
            "K" | "KB" => 1000,
            "KiB" => 1 << 10,
            "M" | "MB" => 1000 * 1000,
            "MiB" => 1 << 20,
            "G" | "GB" => 1000 * 1000 * 1000,
            "GiB" => 1 << 30,
            other => {
                return Err(format!(
                    "invalid size {raw:?}: unknown unit {other:?} (use B, KB, KiB, MB, MiB, GB or GiB)"
                ));
            }
        };
        number.checked_mul(factor).ok_or_else(|| format!("invalid size {raw:?}: too large"))
    }

    fn checked(bytes: u64) -> Result<Self, String> {
        if bytes < MIN_LOG_SIZE {
            return Err(format!("log_max_size of {bytes} bytes is below the minimum of {MIN_LOG_SIZE}"));
        }
        Ok(Self(bytes))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SizeVisitor;

        impl Visitor<'_> for SizeVisitor {
            type Value = ByteSize;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as \"64MiB\" or a number of bytes")
            }

            fn visit_u64<E: de::Error>(self, bytes: u64) -> Result<ByteSize, E> {
                ByteSize::checked(bytes).map_err(E::custom)
            }

            fn visit_i64<E: de::Error>(self, bytes: i64) -> Result<ByteSize, E> {
                let bytes = u64::try_from(bytes).map_err(|_| E::custom("a size cannot be negative"))?;
                self.visit_u64(bytes)
            }

            fn visit_str<E: de::Error>(self, raw: &str) -> Result<ByteSize, E> {
                ByteSize::parse(raw).and_then(ByteSize::checked).map_err(E::custom)
            }
        }

        deserializer.deserialize_any(SizeVisitor)
    }
}

impl<'de> Deserialize<'de> for KillSignal {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        KillSignal::from_name(&raw).ok_or_else(|| {
            let names: Vec<&str> = KillSignal::ALL.iter().map(|s| s.name()).collect();
            de::Error::custom(format!("unknown kill_signal {raw:?}: expected one of {}", names.join(", ")))
        })
    }
}

impl Serialize for KillSignal {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for ServiceName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        ServiceName::new(raw).map_err(de::Error::custom)
    }
}

impl Serialize for ServiceName {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

// ---------------------------------------------------------------------------------------
// The schema, as written: every field explicit, so that a round trip is exact.

#[derive(Serialize)]
struct FileOut<'a> {
    service: Vec<ServiceOut<'a>>,
}

#[derive(Serialize)]
struct ServiceOut<'a> {
    name: &'a ServiceName,
    id: &'a ServiceId,
    address: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    port: Option<u16>,
    tags: &'a [String],
    meta: &'a BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    proxy: Option<ProxyOut<'a>>,
}

#[derive(Serialize)]
struct ProxyOut<'a> {
    exec_mode: ExecModeDef,
    #[serde(skip_serializing_if = "Option::is_none")]
    command: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    working_dir: Option<&'a Path>,
    env: &'a BTreeMap<String, String>,
    inherit_env: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    user: Option<&'a str>,
    kill_signal: KillSignal,
    kill_timeout: String,
    log_max_size: u64,
    log_keep: u32,
    config: &'a ProxyConfigMap,
    restart: RestartOut,
}

#[derive(Serialize)]
struct RestartOut {
    free_attempts: u32,
    max_delay: String,
    healthy_after: String,
}

impl<'a> From<&'a Service> for ServiceOut<'a> {
    fn from(service: &'a Service) -> Self {
        Self {
            name: &service.name,
            id: &service.id,
            address: &service.address,
            port: service.port,
            tags: &service.tags,
            meta: &service.meta,
            proxy: service.proxy.as_ref().map(ProxyOut::from),
        }
    }
}

impl<'a> From<&'a ProxySpec> for ProxyOut<'a> {
    fn from(spec: &'a ProxySpec) -> Self {
        let duration = |d: Duration| humantime::format_duration(d).to_string();
        Self {
            exec_mode: match spec.exec_mode {
                ExecMode::Daemon => ExecModeDef::Daemon,
            },
            command: match &spec.command {
                ProxyCommand::BuiltIn => None,
                ProxyCommand::Exec(line) => Some(line.to_words()),
            },
            working_dir: spec.working_dir.as_deref(),
            env: &spec.env,
            inherit_env: spec.inherit_env,
            user: spec.user.as_deref(),
            kill_signal: spec.kill.signal,
            kill_timeout: duration(spec.kill.timeout),
            log_max_size: spec.log.max_size,
            log_keep: spec.log.keep,
            config: &spec.config,
            restart: RestartOut {
                free_attempts: spec.restart.free_attempts,
                max_delay: duration(spec.restart.max_delay),
                healthy_after: duration(spec.restart.healthy_after),
            },
        }
    }
}

#[cfg(test)]
mod tests;
