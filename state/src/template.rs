//! The vocabulary of `[[service.proxy.template]]`: a file of the proxy's that the agent
//! renders from the catalog ([`Template`]), where its text comes from
//! ([`TemplateSource`]) and what a changed file does to the proxy ([`OnChange`]).
//!
//! These are plain values: the language, the data and the writing of files belong to the
//! agent.

use std::path::PathBuf;
use std::time::Duration;

/// The mode of a rendered file when the template gives none.
pub const DEFAULT_TEMPLATE_MODE: u32 = 0o644;

/// How long a template waits after a change of its data before it renders, when it gives
/// no `wait`: changes within this window render once.
pub const DEFAULT_TEMPLATE_WAIT: Duration = Duration::from_millis(200);

/// The most bytes a template may render when it gives no `max_size`: a render beyond it
/// fails, and nothing is written.
pub const DEFAULT_TEMPLATE_MAX_SIZE: u64 = 16 << 20;

/// One `[[service.proxy.template]]`: a file rendered for the proxy before its first start
/// and again whenever the data it reads changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    /// Where the template's text comes from.
    pub source: TemplateSource,
    /// The absolute path of the rendered file.
    pub destination: PathBuf,
    /// The rendered file's permission bits (default [`DEFAULT_TEMPLATE_MODE`]).
    pub mode: u32,
    /// What a changed file does to the running proxy.
    pub on_change: OnChange,
    /// How long it waits after a change of its data before it renders.
    pub wait: Duration,
    /// The most bytes it may render (default [`DEFAULT_TEMPLATE_MAX_SIZE`]): a render
    /// beyond it fails.
    pub max_size: u64,
}

impl Template {
    /// A template of `source` rendered to `destination`, with the defaults.
    pub fn new(source: TemplateSource, destination: PathBuf) -> Self {
        Self {
            source,
            destination,
            mode: DEFAULT_TEMPLATE_MODE,
            on_change: OnChange::default(),
            wait: DEFAULT_TEMPLATE_WAIT,
            max_size: DEFAULT_TEMPLATE_MAX_SIZE,
        }
    }
}

/// The text of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateSource {
    /// A file, read at each render (absolute path).
    File(PathBuf),
    /// The text itself, from the config's `contents`.
    Inline(String),
}

/// What a rendered file whose bytes changed does to the running proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnChange {
    /// The proxy is restarted, with its `update` strategy (the default of a proxy without a
    /// `reload` table).
    #[default]
    Restart,
    /// The proxy is reloaded through its `reload` table (the default of a proxy with one):
    /// a refused reload puts the previous file back.
    Reload,
    /// Nothing: the proxy reads the file when it wants to.
    Nothing,
}

impl OnChange {
    /// The name the config uses: `restart`, `reload` or `none`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Restart => "restart",
            Self::Reload => "reload",
            Self::Nothing => "none",
        }
    }
}
