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

use crate::connect::{ConnectConfig, DEFAULT_INTENTION, Intention, IntentionAction, Intentions};
use crate::health::{HttpTarget, LinePattern, Liveness, Probe, Readiness, TcpTarget};
use crate::id::{ProxyId, ServiceId};
use crate::listener::{ListenAddress, Listener, ListenerName, UpdatePolicy, UpdateStrategy};
use crate::ordering::dependency_cycles;
use crate::ordering::{Condition, Dependency, DependsOn};
use crate::reload::{ReloadAction, ReloadPolicy};
use crate::resources::{CpuLimit, ResourceLimits};
use crate::service::{
    CommandLine, ExecMode, KillPolicy, KillSignal, LogOutput, LogPolicy, ProxyCommand, ProxyConfigMap, ProxyKind,
    ProxySpec, RestartPolicy, Service, ServiceName,
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

mod connect;
mod error;
mod listeners;
mod loader;
mod resources;
mod schema;
mod templates;
mod written;

pub use connect::ConnectSection;
use connect::{ConnectDef, IntentionDef};
pub use error::*;
pub use listeners::MAX_LISTENERS;
use listeners::*;
pub use loader::*;
use resources::{Cpus, MemoryMax, PidsMax};
use schema::*;
pub use templates::MAX_TEMPLATES;
use templates::*;
use written::*;

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
    let parsed = parse_config_file(text, format, origin)?;
    // A file of services to register or to put in the fleet: the mesh's settings are the
    // config dirs' alone, and dropping them quietly would leave the operator believing
    // they apply.
    if parsed.connect.is_some() {
        return Err(ConfigError::Invalid {
            location: table_location(text, format, origin, Table::Connect),
            field: Some("connect".to_owned()),
            message: "`[connect]` is read from config dirs only, not from a file of services to register".to_owned(),
        });
    }
    if !parsed.intentions.is_empty() {
        return Err(ConfigError::Invalid {
            location: table_location(text, format, origin, Table::Intention(0)),
            field: Some("intention[0]".to_owned()),
            message: "intentions are read from config dirs only, not from a file of services to register".to_owned(),
        });
    }
    Ok(parsed.services)
}

/// What one file of a config dir holds, every value checked.
pub(super) struct ParsedFile {
    pub(super) services: Vec<Service>,
    pub(super) connect: Option<ConnectConfig>,
    pub(super) intentions: Vec<Intention>,
}

/// Parses the text of a file of a config dir: services, and the Connect tables.
///
/// # Errors
///
/// [`ConfigError::Invalid`] for the first schema error or the first intention that repeats
/// the source and destination of another, [`ConfigError::Duplicate`] for an id defined twice
/// in the text.
pub(super) fn parse_config_file(text: &str, format: Format, origin: &Origin) -> Result<ParsedFile, ConfigError> {
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
    let intentions: Vec<Intention> = file.intention.into_iter().map(|def| def.0).collect();
    if let Err(duplicates) = Intentions::new(intentions.clone(), DEFAULT_INTENTION) {
        let (first, second) = duplicates.pairs()[0];
        return Err(duplicate_intention(
            table_location(text, format, origin, Table::Intention(second)),
            second,
            &intentions[second],
            &table_location(text, format, origin, Table::Intention(first)),
        ));
    }
    Ok(ParsedFile { services, connect: file.connect.map(|def| def.0), intentions })
}

/// The error of an intention, the `index`-th of its file, whose source and destination are
/// those of the intention at `first`.
pub(super) fn duplicate_intention(
    location: Location,
    index: usize,
    intention: &Intention,
    first: &Location,
) -> ConfigError {
    ConfigError::Invalid {
        location,
        field: Some(format!("intention[{index}]")),
        message: format!("duplicate intention {intention}: already defined at {first}"),
    }
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

/// A top-level table of a config file.
#[derive(Debug, Clone, Copy)]
pub(super) enum Table {
    /// The `index`-th `[[service]]`.
    Service(usize),
    /// The `index`-th `[[intention]]`.
    Intention(usize),
    /// `[connect]`.
    Connect,
}

/// Where the `index`-th service entry of a text that parsed starts.
fn service_location(text: &str, format: Format, origin: &Origin, index: usize) -> Location {
    table_location(text, format, origin, Table::Service(index))
}

/// Where a table of a text that parsed starts. Used only to point at errors, so it may be
/// slow, and a failure here only loses the line number.
pub(super) fn table_location(text: &str, format: Format, origin: &Origin, table: Table) -> Location {
    let start: Option<usize> = match format {
        Format::Toml => {
            #[derive(Deserialize)]
            struct Probe {
                #[serde(default)]
                service: Vec<toml::Spanned<IgnoredAny>>,
                #[serde(default)]
                intention: Vec<toml::Spanned<IgnoredAny>>,
                connect: Option<toml::Spanned<IgnoredAny>>,
            }
            toml::from_str::<Probe>(text).ok().and_then(|probe| match table {
                Table::Service(index) => probe.service.get(index).map(|s| s.span().start),
                Table::Intention(index) => probe.intention.get(index).map(|s| s.span().start),
                Table::Connect => probe.connect.map(|s| s.span().start),
            })
        }
        Format::Json => {
            #[derive(Deserialize)]
            struct Probe<'a> {
                #[serde(borrow, default)]
                service: Vec<&'a serde_json::value::RawValue>,
                #[serde(borrow, default)]
                intention: Vec<&'a serde_json::value::RawValue>,
                #[serde(borrow)]
                connect: Option<&'a serde_json::value::RawValue>,
            }
            serde_json::from_str::<Probe<'_>>(text).ok().and_then(|probe| {
                let raw = match table {
                    Table::Service(index) => probe.service.get(index).copied(),
                    Table::Intention(index) => probe.intention.get(index).copied(),
                    Table::Connect => probe.connect,
                };
                raw.map(|raw| raw.get().as_ptr() as usize - text.as_ptr() as usize)
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

/// Where the `depends_on` of the `index`-th service of a text that parsed is, or where the
/// service starts when that cannot be found. Used only to point at a dependency cycle.
fn depends_on_location(text: &str, format: Format, origin: &Origin, index: usize) -> Location {
    let start: Option<usize> = match format {
        Format::Toml => {
            #[derive(Deserialize)]
            struct Probe {
                #[serde(default)]
                service: Vec<ServiceProbe>,
            }
            #[derive(Deserialize)]
            struct ServiceProbe {
                proxy: Option<ProxyProbe>,
            }
            #[derive(Deserialize)]
            struct ProxyProbe {
                depends_on: Option<toml::Spanned<IgnoredAny>>,
            }
            toml::from_str::<Probe>(text).ok().and_then(|probe| {
                let proxy = probe.service.into_iter().nth(index)?.proxy?;
                proxy.depends_on.map(|d| d.span().start)
            })
        }
        Format::Json => {
            #[derive(Deserialize)]
            struct Probe<'a> {
                #[serde(borrow, default)]
                service: Vec<ServiceProbe<'a>>,
            }
            #[derive(Deserialize)]
            struct ServiceProbe<'a> {
                #[serde(borrow)]
                proxy: Option<ProxyProbe<'a>>,
            }
            #[derive(Deserialize)]
            struct ProxyProbe<'a> {
                #[serde(borrow)]
                depends_on: Option<&'a serde_json::value::RawValue>,
            }
            serde_json::from_str::<Probe<'_>>(text).ok().and_then(|probe| {
                let raw = probe.service.into_iter().nth(index)?.proxy?.depends_on?;
                Some(raw.get().as_ptr() as usize - text.as_ptr() as usize)
            })
        }
    };
    match start {
        Some(start) => {
            let (line, column) = line_column(text, start);
            Location::at(origin, line, column)
        }
        None => service_location(text, format, origin, index),
    }
}

#[cfg(test)]
mod tests;
