//! The schema of `[connect]`, `[connect.ca]` and `[[intention]]`, as read, and what the
//! config dirs say about Connect as a whole ([`ConnectSection`]).
//!
//! Every value is read into the types of `crate::connect`, checked as it is read; the
//! checks that involve several keys run once the table is read, so that their errors name
//! the table. This module performs no I/O.

use crate::connect::{
    CaConfig, CaProvider, ConnectConfig, Datacenter, Intention, IntentionAction, IntentionTarget, Intentions, LeafTtl,
    PemPath, TrustDomain, check_description,
};

use super::*;

/// What the config dirs say about Connect: the one `[connect]` table, if a file has one, and
/// every `[[intention]]` of every file, with the files they come from.
///
/// Without a `[connect]` table the intentions are still read and checked, and decided with
/// [`crate::DEFAULT_INTENTION`].
#[derive(Debug, Clone, Default)]
pub struct ConnectSection {
    connect: Option<(ConnectConfig, PathBuf)>,
    intentions: Intentions,
    /// The file of each of `intentions.rules()`, in their order.
    intention_files: Vec<PathBuf>,
}

impl ConnectSection {
    /// The `[connect]` table, if a file has one.
    pub fn connect(&self) -> Option<&ConnectConfig> {
        self.connect.as_ref().map(|(config, _)| config)
    }

    /// The file that holds the `[connect]` table.
    pub fn connect_file(&self) -> Option<&Path> {
        self.connect.as_ref().map(|(_, file)| file.as_path())
    }

    /// Every intention, in the order of the files and of each file, and the default of
    /// `[connect]` (or [`crate::DEFAULT_INTENTION`]).
    pub fn intentions(&self) -> &Intentions {
        &self.intentions
    }

    /// The file that defines `rule`, which must be one of [`ConnectSection::intentions`]'s
    /// own rules (a [`crate::Decision`]'s, say); `None` for any other value.
    pub fn intention_file(&self, rule: &Intention) -> Option<&Path> {
        let index = self.intentions.rules().iter().position(|own| std::ptr::eq(own, rule))?;
        self.intention_files.get(index).map(PathBuf::as_path)
    }

    /// Builds the section from checked parts: at most one `[connect]`, and intentions whose
    /// pairs are unique with their files.
    pub(super) fn new(
        connect: Option<(ConnectConfig, PathBuf)>,
        intentions: Intentions,
        intention_files: Vec<PathBuf>,
    ) -> Self {
        debug_assert_eq!(intentions.rules().len(), intention_files.len());
        Self { connect, intentions, intention_files }
    }
}

/// The `[connect]` table, checked.
pub(super) struct ConnectDef(pub(super) ConnectConfig);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConnectFields {
    trust_domain: TrustDomainDef,
    datacenter: Option<DatacenterDef>,
    ca: CaDef,
    default_intention: Option<IntentionAction>,
}

impl<'de> Deserialize<'de> for ConnectDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let def = ConnectFields::deserialize(deserializer)?;
        let mut config = ConnectConfig::new(def.trust_domain.0, def.ca.0);
        if let Some(datacenter) = def.datacenter {
            config.datacenter = datacenter.0;
        }
        if let Some(action) = def.default_intention {
            config.default_intention = action;
        }
        Ok(Self(config))
    }
}

struct TrustDomainDef(TrustDomain);

impl<'de> Deserialize<'de> for TrustDomainDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        TrustDomain::new(raw).map(Self).map_err(de::Error::custom)
    }
}

struct DatacenterDef(Datacenter);

impl<'de> Deserialize<'de> for DatacenterDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        Datacenter::new(raw).map(Self).map_err(de::Error::custom)
    }
}

/// The `[connect.ca]` table, checked: `cert_file` and `key_file` exactly with `file`.
struct CaDef(CaConfig);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CaFields {
    provider: ProviderDef,
    cert_file: Option<PemDef>,
    key_file: Option<PemDef>,
    roots: Option<Vec<PemDef>>,
    leaf_ttl: Option<LeafTtlDef>,
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum ProviderDef {
    File,
    Dev,
}

impl<'de> Deserialize<'de> for CaDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let def = CaFields::deserialize(deserializer)?;
        let provider = match (def.provider, def.cert_file, def.key_file) {
            (ProviderDef::File, Some(cert_file), Some(key_file)) => {
                CaProvider::File { cert_file: cert_file.0, key_file: key_file.0 }
            }
            (ProviderDef::File, cert_file, _) => {
                let missing = if cert_file.is_none() { "cert_file" } else { "key_file" };
                return Err(de::Error::custom(format!(
                    "provider = \"file\" needs `{missing}`: the absolute path of the CA's {} (PEM)",
                    if cert_file.is_none() { "certificate" } else { "private key" }
                )));
            }
            (ProviderDef::Dev, None, None) => CaProvider::Dev,
            (ProviderDef::Dev, cert_file, _) => {
                let given = if cert_file.is_some() { "cert_file" } else { "key_file" };
                return Err(de::Error::custom(format!(
                    "`{given}` is for provider = \"file\": the dev provider makes its own CA in the data dir"
                )));
            }
        };
        let mut config = CaConfig::new(provider);
        config.roots = def.roots.unwrap_or_default().into_iter().map(|root| root.0).collect();
        if let Some(ttl) = def.leaf_ttl {
            config.leaf_ttl = ttl.0;
        }
        Ok(Self(config))
    }
}

/// A certificate's or key's path: absolute, naming a file.
struct PemDef(PemPath);

impl<'de> Deserialize<'de> for PemDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        no_nul(&raw).map_err(de::Error::custom)?;
        PemPath::new(raw).map(Self).map_err(de::Error::custom)
    }
}

/// `leaf_ttl`: a duration within [`LeafTtl`]'s bounds.
struct LeafTtlDef(LeafTtl);

impl<'de> Deserialize<'de> for LeafTtlDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let HumanDuration(ttl) = HumanDuration::deserialize(deserializer)?;
        LeafTtl::new(ttl).map(Self).map_err(de::Error::custom)
    }
}

/// One `[[intention]]` table, checked.
pub(super) struct IntentionDef(pub(super) Intention);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IntentionFields {
    source: TargetDef,
    destination: TargetDef,
    action: IntentionAction,
    description: Option<DescriptionDef>,
}

impl<'de> Deserialize<'de> for IntentionDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let def = IntentionFields::deserialize(deserializer)?;
        let intention = Intention::new(def.source.0, def.destination.0, def.action);
        match def.description {
            Some(description) => intention.with_description(description.0).map(Self).map_err(de::Error::custom),
            None => Ok(Self(intention)),
        }
    }
}

/// An intention's `source` or `destination`: a service name or `*`.
struct TargetDef(IntentionTarget);

impl<'de> Deserialize<'de> for TargetDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        IntentionTarget::parse(&raw).map(Self).map_err(de::Error::custom)
    }
}

/// An intention's `description`, checked where it is read so that its error names it.
struct DescriptionDef(String);

impl<'de> Deserialize<'de> for DescriptionDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        check_description(&raw).map_err(de::Error::custom)?;
        Ok(Self(raw))
    }
}

impl<'de> Deserialize<'de> for IntentionAction {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        IntentionAction::from_name(&raw)
            .ok_or_else(|| de::Error::custom(format!("unknown action {raw:?}: expected \"allow\" or \"deny\"")))
    }
}
