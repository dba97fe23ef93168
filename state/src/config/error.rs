//! Where configuration comes from and what is wrong with it: [`Origin`], [`Location`],
//! [`ConfigError`], [`ConfigErrors`] and [`DisplayPath`].
//!
//! This module only describes errors; it never reads, parses or writes anything.

use std::borrow::Cow;

use super::*;

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
    pub(super) fn file(path: &Path) -> Self {
        Self { origin: Origin::File(path.to_owned()), line: None, column: None }
    }

    pub(super) fn at(origin: &Origin, line: usize, column: usize) -> Self {
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
        write_escaped(f, &self.0.to_string_lossy())
    }
}

/// Writes `text` with control characters escaped (`\n`, `\u{1b}`), so that it stays on one
/// line and cannot drive a terminal.
fn write_escaped(f: &mut fmt::Formatter<'_>, text: &str) -> fmt::Result {
    for c in text.chars() {
        if c.is_control() {
            write!(f, "{}", c.escape_default())?;
        } else {
            fmt::Write::write_char(f, c)?;
        }
    }
    Ok(())
}

/// One thing wrong with the configuration.
///
/// It shows on one line as ``location: field `path`: message`` ([`ConfigError::location`],
/// [`ConfigError::field`], [`ConfigError::message`]), the field only when there is one, and
/// control characters escaped. The cause of a [`ConfigError::Read`] is its
/// [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A file or directory could not be read.
    Read {
        /// The file or directory.
        location: Location,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file is larger than [`MAX_FILE_SIZE`].
    TooLarge {
        /// The file.
        location: Location,
    },
    /// A `*.toml` or `*.json` entry that is not a regular file.
    NotAFile {
        /// The entry.
        location: Location,
    },
    /// A file is not UTF-8 text.
    NotUtf8 {
        /// Where the first invalid byte is.
        location: Location,
    },
    /// The text does not follow the schema: a syntax error, an unknown key or an invalid value.
    Invalid {
        /// Where.
        location: Location,
        /// The path of the field, such as `service[0].proxy.kill_timeout`.
        field: Option<String>,
        /// What is wrong, in the parser's words.
        message: String,
    },
    /// Two services share an id.
    Duplicate {
        /// The second definition.
        location: Location,
        /// The id.
        id: ServiceId,
        /// The first definition.
        first: Box<Location>,
    },
}

impl ConfigError {
    /// Where the error is.
    #[must_use]
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

    /// The path of the field at fault, such as `service[0].proxy.kill_timeout`, when the
    /// error is about one field. It is as the file spells its keys: only the error's
    /// `Display` escapes control characters.
    #[must_use]
    pub fn field(&self) -> Option<&str> {
        match self {
            Self::Invalid { field: Some(field), .. } if !field.is_empty() => Some(field),
            _ => None,
        }
    }

    /// What is wrong, without the location and the field: the parser's words for
    /// [`ConfigError::Invalid`], unescaped as [`ConfigError::field`] is. The cause of a
    /// [`ConfigError::Read`] is not part of it.
    #[must_use]
    pub fn message(&self) -> Cow<'_, str> {
        match self {
            Self::Read { .. } => Cow::Borrowed("cannot read"),
            Self::TooLarge { .. } => Cow::Owned(format!("file is larger than {MAX_FILE_SIZE} bytes")),
            Self::NotAFile { .. } => Cow::Borrowed("not a regular file"),
            Self::NotUtf8 { .. } => Cow::Borrowed("not valid UTF-8"),
            Self::Invalid { message, .. } => Cow::Borrowed(message),
            Self::Duplicate { id, first, .. } => {
                Cow::Owned(format!("duplicate service id `{id}`: already defined at {first}"))
            }
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.location())?;
        // Field paths and messages quote the file's keys and values: escaped, a key cannot
        // break the error over two lines or drive a terminal.
        if let Some(field) = self.field() {
            f.write_str("field `")?;
            write_escaped(f, field)?;
            f.write_str("`: ")?;
        }
        write_escaped(f, &self.message())
    }
}

/// Every error found in a set of config dirs: never none.
///
/// The errors come in the order the files were read ([`load_dirs`] says which), and by
/// position within a file. It shows as one error a line, each with its causes
/// (``file:line:column: field `path`: message``), so that printing it prints them all; its
/// own [`source`](std::error::Error::source) is therefore `None`.
///
/// # Examples
///
/// ```
/// use tether_state::config::{load_dirs, Origin};
///
/// let dir = tempfile::tempdir().unwrap();
/// let file = dir.path().join("web.toml");
/// std::fs::write(&file, "[[service]]\nname = \"web\"\nprot = 8080\n").unwrap();
///
/// let errors = load_dirs(&[dir.path()]).unwrap_err();
/// assert_eq!(errors.len(), 1);
/// let error = errors.first();
/// assert_eq!(error.location().origin, Origin::File(file.clone()));
/// assert_eq!((error.location().line, error.location().column), (Some(3), Some(1)));
/// assert_eq!(error.field(), Some("service[0].prot"));
/// assert!(error.message().starts_with("unknown field `prot`"), "{error}");
/// assert_eq!(errors.to_string(), error.to_string());
/// ```
#[derive(Debug)]
pub struct ConfigErrors {
    /// At least one.
    errors: Vec<ConfigError>,
}

impl ConfigErrors {
    /// The errors, or `None` when there are none.
    pub(super) fn new(errors: Vec<ConfigError>) -> Option<Self> {
        (!errors.is_empty()).then_some(Self { errors })
    }

    /// How many errors there are: at least one.
    #[must_use]
    pub fn len(&self) -> usize {
        self.errors.len()
    }

    /// Always `false`: a [`ConfigErrors`] holds at least one error.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }

    /// The first error, in the order they are shown.
    #[must_use]
    pub fn first(&self) -> &ConfigError {
        &self.errors[0]
    }

    /// The errors, in the order they are shown.
    #[must_use]
    pub fn as_slice(&self) -> &[ConfigError] {
        &self.errors
    }

    /// Iterates over the errors, in the order they are shown.
    pub fn iter(&self) -> std::slice::Iter<'_, ConfigError> {
        self.errors.iter()
    }

    /// The errors, in the order they are shown.
    #[must_use]
    pub fn into_vec(self) -> Vec<ConfigError> {
        self.errors
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, error) in self.errors.iter().enumerate() {
            if index > 0 {
                f.write_str("\n")?;
            }
            f.write_str(&crate::error_chain(error))?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

impl<'a> IntoIterator for &'a ConfigErrors {
    type Item = &'a ConfigError;
    type IntoIter = std::slice::Iter<'a, ConfigError>;

    fn into_iter(self) -> Self::IntoIter {
        self.errors.iter()
    }
}

impl IntoIterator for ConfigErrors {
    type Item = ConfigError;
    type IntoIter = std::vec::IntoIter<ConfigError>;

    fn into_iter(self) -> Self::IntoIter {
        self.errors.into_iter()
    }
}
