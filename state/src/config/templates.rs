//! The schema of `[[service.proxy.template]]`, as read and as written back.
//!
//! A template names exactly one of `source` (an absolute path) and `contents` (the text),
//! an absolute `destination` distinct within its proxy, an octal `mode`, `on_change`,
//! `wait` and `max_size`. The language itself is the agent's: the schema checks only what a file's
//! reader can check without it.

use super::schema::deserialize_size;
use crate::template::{
    DEFAULT_TEMPLATE_MAX_SIZE, DEFAULT_TEMPLATE_MODE, DEFAULT_TEMPLATE_WAIT, OnChange, Template, TemplateSource,
};

use super::*;

/// The most templates of one proxy.
pub const MAX_TEMPLATES: usize = 64;

/// The `[[service.proxy.template]]` array, checked; each with whether its `on_change` was
/// given, since the default depends on the proxy's `reload` table.
pub(super) struct TemplatesDef(Vec<(Template, bool)>);

impl TemplatesDef {
    /// The templates of a proxy that has a `reload` table (`reloadable`) or not: `on_change`
    /// defaults to `reload` or `restart`.
    pub(super) fn resolve(self, reloadable: bool) -> Vec<Template> {
        let default = if reloadable { OnChange::Reload } else { OnChange::Restart };
        self.0
            .into_iter()
            .map(|(mut template, given)| {
                if !given {
                    template.on_change = default;
                }
                template
            })
            .collect()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TemplateDef {
    source: Option<TemplatePath>,
    contents: Option<Contents>,
    destination: TemplatePath,
    mode: Option<ModeDef>,
    on_change: Option<OnChangeDef>,
    wait: Option<HumanDuration>,
    max_size: Option<MaxSize>,
}

/// `max_size`: the most bytes a template may render, as a number or a size such as
/// `"1MiB"`; at least one byte.
struct MaxSize(u64);

impl MaxSize {
    fn checked(bytes: u64) -> Result<Self, String> {
        if bytes == 0 {
            return Err("max_size of 0 bytes: a template renders at least one byte".to_owned());
        }
        Ok(Self(bytes))
    }
}

impl<'de> Deserialize<'de> for MaxSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_size(deserializer, MaxSize::checked)
    }
}

/// A template's text: no NUL, which no file of a proxy's wants.
struct Contents(String);

impl<'de> Deserialize<'de> for Contents {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        no_nul(&raw).map_err(de::Error::custom)?;
        Ok(Self(raw))
    }
}

/// An absolute path that names a file: not `/`, no NUL, no `.` or `..` component.
struct TemplatePath(PathBuf);

impl<'de> Deserialize<'de> for TemplatePath {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        no_nul(&raw).map_err(de::Error::custom)?;
        let path = PathBuf::from(&raw);
        if !path.is_absolute() {
            return Err(de::Error::custom(format!("{raw:?} must be an absolute path")));
        }
        let dotted = raw.split('/').any(|part| part == "." || part == "..");
        if dotted || raw.ends_with('/') || path.file_name().is_none() {
            return Err(de::Error::custom(format!("{raw:?} must name a file: no `.` or `..`, no trailing `/`")));
        }
        Ok(Self(path))
    }
}

/// A file mode as an octal string, such as `"0640"`: permission bits only.
struct ModeDef(u32);

impl<'de> Deserialize<'de> for ModeDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        let invalid = || de::Error::custom(format!("invalid mode {raw:?}: an octal string from \"0000\" to \"0777\""));
        if raw.is_empty() || raw.len() > 4 || !raw.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
            return Err(invalid());
        }
        let mode = u32::from_str_radix(&raw, 8).map_err(|_| invalid())?;
        if mode > 0o777 {
            return Err(invalid());
        }
        Ok(Self(mode))
    }
}

/// `on_change`: `restart`, `reload` or `none`. Whether `reload` has a `reload` table to use
/// is the proxy's check; so is the default.
struct OnChangeDef(OnChange);

impl<'de> Deserialize<'de> for OnChangeDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        match raw.as_str() {
            "restart" => Ok(Self(OnChange::Restart)),
            "reload" => Ok(Self(OnChange::Reload)),
            "none" => Ok(Self(OnChange::Nothing)),
            other => Err(de::Error::custom(format!(
                "unknown on_change {other:?}: expected \"reload\", \"restart\" or \"none\""
            ))),
        }
    }
}

impl<'de> Deserialize<'de> for TemplatesDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let defs = Vec::<TemplateDefChecked>::deserialize(deserializer)?;
        if defs.len() > MAX_TEMPLATES {
            return Err(de::Error::custom(format!("{} templates: a proxy has at most {MAX_TEMPLATES}", defs.len())));
        }
        let mut templates: Vec<(Template, bool)> = Vec::with_capacity(defs.len());
        for TemplateDefChecked(template, given) in defs {
            if templates.iter().any(|(t, _)| t.destination == template.destination) {
                return Err(de::Error::custom(format!(
                    "two templates have the destination {}",
                    DisplayPath(&template.destination)
                )));
            }
            templates.push((template, given));
        }
        Ok(Self(templates))
    }
}

/// One template whose keys agree with each other; checked in `TryFrom`, so that the error
/// names the template's table.
#[derive(Deserialize)]
#[serde(try_from = "TemplateDef")]
struct TemplateDefChecked(Template, bool);

impl TryFrom<TemplateDef> for TemplateDefChecked {
    type Error = String;

    fn try_from(def: TemplateDef) -> Result<Self, String> {
        let source = match (def.source, def.contents) {
            (Some(path), None) => TemplateSource::File(path.0),
            (None, Some(text)) => TemplateSource::Inline(text.0),
            (Some(_), Some(_)) => return Err("both `source` and `contents`: give exactly one".to_owned()),
            (None, None) => return Err("no `source` and no `contents`: give exactly one".to_owned()),
        };
        if let TemplateSource::File(path) = &source {
            if *path == def.destination.0 {
                return Err(format!("`source` and `destination` are the same file {}", DisplayPath(path)));
            }
        }
        let given = def.on_change.is_some();
        let template = Template {
            source,
            destination: def.destination.0,
            mode: def.mode.map_or(DEFAULT_TEMPLATE_MODE, |m| m.0),
            on_change: def.on_change.map_or_else(OnChange::default, |o| o.0),
            wait: def.wait.map_or(DEFAULT_TEMPLATE_WAIT, |w| w.0),
            max_size: def.max_size.map_or(DEFAULT_TEMPLATE_MAX_SIZE, |m| m.0),
        };
        Ok(Self(template, given))
    }
}

/// A template as written back: it reads again to the same value.
#[derive(Serialize)]
pub(super) struct TemplateOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    source: Option<&'a Path>,
    #[serde(skip_serializing_if = "Option::is_none")]
    contents: Option<&'a str>,
    destination: &'a Path,
    mode: String,
    on_change: &'static str,
    wait: String,
    max_size: u64,
}

impl<'a> From<&'a Template> for TemplateOut<'a> {
    fn from(template: &'a Template) -> Self {
        let (source, contents) = match &template.source {
            TemplateSource::File(path) => (Some(path.as_path()), None),
            TemplateSource::Inline(text) => (None, Some(text.as_str())),
        };
        Self {
            source,
            contents,
            destination: &template.destination,
            mode: format!("{:04o}", template.mode),
            on_change: template.on_change.as_str(),
            wait: humantime::format_duration(template.wait).to_string(),
            max_size: template.max_size,
        }
    }
}
