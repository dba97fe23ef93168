//! Where configuration comes from and what is wrong with it: [`Origin`], [`Location`],
//! [`ConfigError`] and [`DisplayPath`].
//!
//! This module only describes errors; it never reads, parses or writes anything.

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
