//! Reading config dirs: [`load_dirs`] once, and [`ConfigLoader`], which reads again only the
//! files whose inode, size, mtime or ctime changed since the last load. Both give the
//! services, and what the dirs say about Connect ([`ConnectSection`]).
//!
//! This module reads files and hands their text to the schema; it never writes a file and
//! never decides what a service is.

use super::*;

/// Everything a set of config dirs holds, every check passed.
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    /// The services, file by file, each file's in its order.
    pub services: Vec<ConfigEntry>,
    /// The `[connect]` table and the intentions.
    pub connect: ConnectSection,
}

/// Everything a set of config dirs holds, file by file, as [`ConfigLoader::load_files`]
/// gives it.
#[derive(Debug, Clone)]
pub struct LoadedFiles {
    /// The files, in the order they were read.
    pub files: Vec<ConfigFile>,
    /// The `[connect]` table and the intentions.
    pub connect: ConnectSection,
}

/// Loads every `*.toml` and `*.json` file directly in each dir, in lexical order per dir.
///
/// # Errors
///
/// Every error found, across all files: unreadable or invalid files, service ids defined
/// twice (in one file or in two), a second `[connect]` table, and intentions that repeat
/// the source and destination of another. A repeat is reported at the definition read
/// second, pointing at the first. The errors come in the order the files were read (the
/// dirs in the order given, each in lexical order), and by position within a file.
///
/// ```
/// use tether_state::IntentionAction;
/// use tether_state::config::load_dirs;
///
/// let dir = tempfile::tempdir().unwrap();
/// std::fs::write(dir.path().join("web.toml"), "[[service]]\nname = \"web\"\n").unwrap();
/// std::fs::write(
///     dir.path().join("mesh.toml"),
///     "[connect]\ntrust_domain = \"example.org\"\n[connect.ca]\nprovider = \"dev\"\n\n\
///      [[intention]]\nsource = \"web\"\ndestination = \"db\"\naction = \"allow\"\n",
/// )
/// .unwrap();
/// let loaded = load_dirs(&[dir.path()]).unwrap();
/// assert_eq!(loaded.services[0].service.id.as_str(), "web");
/// assert_eq!(loaded.connect.connect().unwrap().trust_domain.as_str(), "example.org");
/// assert_eq!(loaded.connect.intentions().rules()[0].action(), IntentionAction::Allow);
/// ```
pub fn load_dirs<P: AsRef<Path>>(dirs: &[P]) -> Result<LoadedConfig, ConfigErrors> {
    let scan = scan(dirs.iter().map(AsRef::as_ref), &HashMap::new());
    let (files, connect) = scan.into_result()?;
    let mut entries = Vec::new();
    for file in files {
        // Nothing else holds the file: move its services out rather than clone them.
        let file = Arc::try_unwrap(file).unwrap_or_else(|shared| (*shared).clone());
        let path = file.path;
        entries.extend(
            file.services
                .into_iter()
                .map(|service| ConfigEntry { service: Arc::unwrap_or_clone(service), file: path.clone() }),
        );
    }
    Ok(LoadedConfig { services: entries, connect })
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
/// assert_eq!(loader.load().unwrap().services[0].service.id.as_str(), "web");
/// std::fs::write(dir.path().join("api.toml"), "[[service]]\nname = \"api\"\n").unwrap();
/// let ids: Vec<_> = loader.load().unwrap().services.into_iter().map(|e| e.service.id.to_string()).collect();
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
        // Not the cached services: a proxy's `env` may hold secrets.
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
    pub fn load(&mut self) -> Result<LoadedConfig, ConfigErrors> {
        let LoadedFiles { files, connect } = self.load_files()?;
        let mut entries = Vec::new();
        for file in &files {
            entries.extend(
                file.services()
                    .iter()
                    .map(|service| ConfigEntry { service: (**service).clone(), file: file.0.path.clone() }),
            );
        }
        Ok(LoadedConfig { services: entries, connect })
    }

    /// Like [`ConfigLoader::load`], file by file: a file that was not read again is the
    /// same [`ConfigFile`] as in the last load ([`ConfigFile::same_read`]), so that a caller
    /// can skip what did not change without comparing services.
    ///
    /// # Errors
    ///
    /// As [`ConfigLoader::load`].
    pub fn load_files(&mut self) -> Result<LoadedFiles, ConfigErrors> {
        let scan = scan(self.dirs.iter().map(PathBuf::as_path), &self.cache);
        self.last = scan.stats;
        self.cache = scan
            .files
            .iter()
            .filter(|file| file.settled(self.settle_time))
            .map(|file| (file.path.clone(), file.clone()))
            .collect();
        let (files, connect) = scan.into_result()?;
        Ok(LoadedFiles { files: files.into_iter().map(ConfigFile).collect(), connect })
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

    /// Its services, in the file's order; shared, so that a catalog can keep the same
    /// values ([`crate::LocalState::change_source`] takes them as they are).
    pub fn services(&self) -> &[Arc<Service>] {
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
pub(super) struct Scan {
    files: Vec<Arc<LoadedFile>>,
    /// The place of each of `files` in the pass, counting every file and dir looked at.
    places: Vec<usize>,
    /// Every error found so far, with the place of the file or dir it is about.
    errors: Vec<(usize, ConfigError)>,
    stats: LoadStats,
}

impl Scan {
    /// The files and their Connect section, or every error: those of the files, ids defined
    /// in two files, a second `[connect]` and intentions repeated across files, in the order
    /// the files were read, and by position within a file.
    fn into_result(mut self) -> Result<(Vec<Arc<LoadedFile>>, ConnectSection), ConfigErrors> {
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
            let duplicate = ConfigError::Duplicate {
                location: file.location_of(service_index),
                id: file.services[service_index].id.clone(),
                first: Box::new(self.files[first_file].location_of(first_index)),
            };
            self.errors.push((self.places[file_index], duplicate));
        }
        let connect = self.check_connect();
        let default = connect.as_ref().map_or(DEFAULT_INTENTION, |(config, _)| config.default_intention);
        let intentions = self.check_intentions(default);
        if self.errors.is_empty() {
            self.check_cycles();
            self.check_destinations();
        }
        // Stable: a file that loaded has no other error, and its duplicates are already in
        // the order of its services.
        self.errors.sort_by_key(|(place, _)| *place);
        match ConfigErrors::new(self.errors.into_iter().map(|(_, error)| error).collect()) {
            Some(errors) => Err(errors),
            None => Ok((self.files, ConnectSection::new(connect, intentions.0, intentions.1))),
        }
    }
}

impl Scan {
    /// The one `[connect]` table of the files, with its file; a second one is refused,
    /// naming the first, and the first is kept.
    fn check_connect(&mut self) -> Option<(ConnectConfig, PathBuf)> {
        let mut first: Option<usize> = None;
        for (file_index, file) in self.files.iter().enumerate() {
            if file.connect.is_none() {
                continue;
            }
            match first {
                None => first = Some(file_index),
                Some(first) => {
                    let error = ConfigError::Invalid {
                        location: file.table_location(Table::Connect),
                        field: Some("connect".to_owned()),
                        message: format!(
                            "a second [connect] table: the config dirs hold one, and {} has it already",
                            self.files[first].table_location(Table::Connect)
                        ),
                    };
                    self.errors.push((self.places[file_index], error));
                }
            }
        }
        let file = &self.files[first?];
        file.connect.as_deref().map(|config| (config.clone(), file.path.clone()))
    }

    /// Every intention of the files, with its file, decided with `default`; or none after
    /// refusing each that repeats the source and destination of an earlier one, naming it.
    fn check_intentions(&mut self, default: IntentionAction) -> (Intentions, Vec<PathBuf>) {
        let mut rules = Vec::new();
        // The file and the index within it of each of `rules`.
        let mut places: Vec<(usize, usize)> = Vec::new();
        for (file_index, file) in self.files.iter().enumerate() {
            rules.extend(file.intentions.iter().cloned());
            places.extend((0..file.intentions.len()).map(|index| (file_index, index)));
        }
        match Intentions::new(rules, default) {
            Ok(intentions) => {
                let files = places.iter().map(|&(file_index, _)| self.files[file_index].path.clone()).collect();
                (intentions, files)
            }
            Err(duplicates) => {
                for &(first, second) in duplicates.pairs() {
                    let (first_file, first_index) = places[first];
                    let (file_index, index) = places[second];
                    let file = &self.files[file_index];
                    let error = duplicate_intention(
                        file.table_location(Table::Intention(index)),
                        index,
                        &file.intentions[index],
                        &self.files[first_file].table_location(Table::Intention(first_index)),
                    );
                    self.errors.push((self.places[file_index], error));
                }
                (Intentions::empty(default), Vec::new())
            }
        }
    }
}

impl Scan {
    /// Refuses every dependency cycle among the files' proxies, each at the `depends_on` of
    /// its first proxy in the order of the files, naming every proxy on it with its place.
    /// Run only when the ids are unique, so that each name means one proxy.
    fn check_cycles(&mut self) {
        let mut places: HashMap<ProxyId, (usize, usize)> = HashMap::new();
        let mut proxies = Vec::new();
        for (file_index, file) in self.files.iter().enumerate() {
            for (service_index, service) in file.services.iter().enumerate() {
                if let Some(proxy) = &service.proxy {
                    let id = service.id.proxy_id();
                    places.insert(id.clone(), (file_index, service_index));
                    proxies.push((id, &proxy.depends_on));
                }
            }
        }
        if proxies.iter().all(|(_, depends_on)| depends_on.is_empty()) {
            return;
        }
        let cycles = dependency_cycles(&proxies);
        for cycle in cycles {
            let Some(&(file_index, service_index)) = cycle.first().and_then(|first| places.get(first)) else {
                continue;
            };
            let file = &self.files[file_index];
            let members: Vec<String> = cycle
                .iter()
                .map(|id| match places.get(id) {
                    Some(&(f, s)) => format!("{id} ({})", self.files[f].depends_on_location(s)),
                    None => id.to_string(),
                })
                .collect();
            let error = ConfigError::Invalid {
                location: file.depends_on_location(service_index),
                field: Some(format!("service[{service_index}].proxy.depends_on")),
                message: format!("dependency cycle: {} -> {}", members.join(" -> "), cycle[0]),
            };
            self.errors.push((self.places[file_index], error));
        }
    }
}

impl Scan {
    /// Refuses a template destination that two proxies write: each would overwrite the
    /// other's file at every render. The second is the error, naming the first.
    fn check_destinations(&mut self) {
        let mut first: HashMap<&Path, (usize, usize)> = HashMap::new();
        let mut clashes = Vec::new();
        for (file_index, file) in self.files.iter().enumerate() {
            for (service_index, service) in file.services.iter().enumerate() {
                let Some(proxy) = &service.proxy else { continue };
                for (template_index, template) in proxy.templates.iter().enumerate() {
                    match first.get(template.destination.as_path()) {
                        Some(&earlier) => clashes.push((file_index, service_index, template_index, earlier)),
                        None => {
                            first.insert(&template.destination, (file_index, service_index));
                        }
                    }
                }
            }
        }
        for (file_index, service_index, template_index, (first_file, first_service)) in clashes {
            let file = &self.files[file_index];
            let proxy = file.services[service_index].proxy.as_ref().expect("a clash is of a template of a proxy");
            let destination = &proxy.templates[template_index].destination;
            let error = ConfigError::Invalid {
                location: file.location_of(service_index),
                field: Some(format!("service[{service_index}].proxy.template[{template_index}].destination")),
                message: format!(
                    "{} is also the destination of a template of {} ({}): two proxies cannot write one file",
                    DisplayPath(destination),
                    self.files[first_file].services[first_service].id.proxy_id(),
                    self.files[first_file].location_of(first_service)
                ),
            };
            self.errors.push((self.places[file_index], error));
        }
    }
}

/// Lists `dirs` and loads their files, taking from `cache` those that did not change.
pub(super) fn scan<'a>(dirs: impl Iterator<Item = &'a Path>, cache: &HashMap<PathBuf, Arc<LoadedFile>>) -> Scan {
    let mut scan = Scan { files: Vec::new(), places: Vec::new(), errors: Vec::new(), stats: LoadStats::default() };
    let mut place = 0;
    for dir in dirs {
        match config_files(dir) {
            Ok(paths) => {
                for path in paths {
                    place += 1;
                    let loaded = match cache.get(&path).filter(|cached| cached.unchanged()) {
                        Some(cached) => {
                            scan.stats.reused += 1;
                            Ok(cached.clone())
                        }
                        None => {
                            scan.stats.read += 1;
                            load_file(&path).map(Arc::new)
                        }
                    };
                    match loaded {
                        Ok(file) => {
                            scan.files.push(file);
                            scan.places.push(place);
                        }
                        Err(err) => scan.errors.push((place, err)),
                    }
                }
            }
            Err(err) => {
                place += 1;
                scan.errors.push((place, err));
            }
        }
    }
    scan
}

/// What identifies one version of a file's content, as far as its metadata can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Fingerprint {
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
pub(super) fn now_nanos() -> Option<i128> {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?;
    i128::try_from(since.as_nanos()).ok()
}

/// A config file that parsed.
#[derive(Clone)]
pub(super) struct LoadedFile {
    path: PathBuf,
    format: Format,
    services: Vec<Arc<Service>>,
    /// Its `[connect]` table, rare: boxed, so that a file without one costs a word.
    connect: Option<Box<ConnectConfig>>,
    intentions: Box<[Intention]>,
    /// The metadata of the file as it was read.
    fingerprint: Fingerprint,
    /// The wall clock just before the file was looked at, if known.
    read_at: Option<i128>,
}

impl LoadedFile {
    /// Where its `index`-th service starts, from its text read again: kept, the text would
    /// cost its whole size for as long as the file is loaded, for an error that is rare.
    /// Read as any config file is (never blocking on a FIFO put in its place); just the file
    /// if it changed since it was loaded.
    fn location_of(&self, index: usize) -> Location {
        self.table_location(Table::Service(index))
    }

    /// Where one of its tables starts, read again as [`LoadedFile::location_of`] does.
    fn table_location(&self, table: Table) -> Location {
        match read_text(&self.path) {
            Ok((text, now)) if Fingerprint::of(&now) == self.fingerprint => {
                table_location(&text, self.format, &Origin::File(self.path.clone()), table)
            }
            _ => Location::file(&self.path),
        }
    }

    /// Where the `depends_on` of its `index`-th service is, read again as
    /// [`LoadedFile::location_of`] does.
    fn depends_on_location(&self, index: usize) -> Location {
        match read_text(&self.path) {
            Ok((text, now)) if Fingerprint::of(&now) == self.fingerprint => {
                depends_on_location(&text, self.format, &Origin::File(self.path.clone()), index)
            }
            _ => Location::file(&self.path),
        }
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
pub(super) fn config_files(dir: &Path) -> Result<Vec<PathBuf>, ConfigError> {
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

/// The text of the config file at `path` and its metadata as it was read: a regular file
/// (never a FIFO, whose opening would block), at most [`MAX_FILE_SIZE`] bytes, UTF-8.
fn read_text(path: &Path) -> Result<(String, fs::Metadata), ConfigError> {
    let location = Location::file(path);
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
    match String::from_utf8(bytes) {
        Ok(text) => Ok((text, metadata)),
        Err(err) => {
            let valid = &err.as_bytes()[..err.utf8_error().valid_up_to()];
            let valid = std::str::from_utf8(valid).unwrap_or_default();
            let (line, column) = line_column(valid, valid.len());
            Err(ConfigError::NotUtf8 { location: Location::at(&location.origin, line, column) })
        }
    }
}

/// Loads and parses one config file.
pub(super) fn load_file(path: &Path) -> Result<LoadedFile, ConfigError> {
    let read_at = now_nanos();
    let location = Location::file(path);
    let Some(format) = Format::of_path(path) else {
        return Err(ConfigError::NotAFile { location });
    };
    let (text, metadata) = read_text(path)?;
    let parsed = parse_config_file(&text, format, &location.origin)?;
    let services = parsed.services;
    let fingerprint = Fingerprint::of(&metadata);
    // Not `collect()`: collected in place, the `Arc`s would keep the parsed services' whole
    // buffer (650 bytes a service) as spare capacity for as long as the file is loaded.
    let mut shared = Vec::with_capacity(services.len());
    shared.extend(services.into_iter().map(Arc::new));
    Ok(LoadedFile {
        path: path.to_owned(),
        format,
        services: shared,
        connect: parsed.connect.map(Box::new),
        intentions: parsed.intentions.into_boxed_slice(),
        fingerprint,
        read_at,
    })
}
