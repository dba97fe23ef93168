//! Validated identifiers: service ids and proxy ids.
//!
//! Ids become file names under the data dir, so this module is the one place that decides
//! which strings are acceptable. It never touches the file system.

use std::borrow::Borrow;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The longest service id, in bytes.
pub const MAX_SERVICE_ID_LEN: usize = 128;

/// The suffix that turns a service id into the id of its managed proxy.
pub const PROXY_SUFFIX: &str = "-proxy";

/// The longest proxy id, in bytes: the longest service id and [`PROXY_SUFFIX`].
pub const MAX_PROXY_ID_LEN: usize = MAX_SERVICE_ID_LEN + PROXY_SUFFIX.len();

/// The rule every service id must follow, as shown in error messages.
pub const SERVICE_ID_RULE: &str = "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$";

/// An id that does not follow [`SERVICE_ID_RULE`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdError {
    /// A service id that breaks the rule.
    #[error("invalid service id {id:?}: {reason} (ids must match {SERVICE_ID_RULE})")]
    Service {
        /// The rejected input, escaped when shown.
        id: String,
        /// Which part of the rule it breaks.
        reason: &'static str,
    },
    /// A proxy id that is not `<service id>-proxy`.
    #[error("invalid proxy id {id:?}: {reason} (proxy ids are `<service id>-proxy`)")]
    Proxy {
        /// The rejected input, escaped when shown.
        id: String,
        /// Which part of the rule it breaks.
        reason: &'static str,
    },
}

/// Checks `id` against [`SERVICE_ID_RULE`]; says which part of the rule it breaks.
///
/// The one id rule of the project: service ids, and the names built on them elsewhere (a
/// fleet's node names), are checked here.
///
/// # Errors
///
/// The part of the rule `id` breaks, as a phrase for an error message.
pub fn check_service_id(id: &str) -> Result<(), &'static str> {
    if id.len() > MAX_SERVICE_ID_LEN {
        return Err("it is longer than 128 bytes");
    }
    check_alphabet(id)
}

/// Checks a name that may be a service id or a proxy id (`<service id>-proxy`, up to
/// [`MAX_PROXY_ID_LEN`] bytes): the id rule's alphabet, at most [`MAX_PROXY_ID_LEN`] bytes. A
/// supervised process is named so, and every proxy id passes.
///
/// # Errors
///
/// The part of the rule `name` breaks, as a phrase for an error message.
pub fn check_process_name(name: &str) -> Result<(), &'static str> {
    if name.len() > MAX_PROXY_ID_LEN {
        return Err("it is longer than 134 bytes");
    }
    check_alphabet(name)
}

/// The id rule without its length: not empty, a letter or digit first, then letters,
/// digits, `.`, `_` and `-`.
fn check_alphabet(id: &str) -> Result<(), &'static str> {
    let bytes = id.as_bytes();
    let Some(first) = bytes.first() else {
        return Err("it is empty");
    };
    if !first.is_ascii_alphanumeric() {
        return Err("it must start with a letter or a digit");
    }
    if !bytes.iter().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')) {
        return Err("it may only contain letters, digits, `.`, `_` and `-`");
    }
    Ok(())
}

/// The id of a service: `^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`.
///
/// A `ServiceId` is always valid, so it is safe to use as a file name: it has no `/`, no NUL,
/// cannot be `.` or `..`, and is short enough for every file system. A clone shares the text
/// (as a [`ProxyId`]'s does): an agent keeps an id in several maps per service.
///
/// ```
/// use tether_state::ServiceId;
///
/// let id = ServiceId::new("web.v2").unwrap();
/// assert_eq!(id.proxy_id().as_str(), "web.v2-proxy");
/// assert!(ServiceId::new("../etc").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceId(Arc<str>);

impl ServiceId {
    /// Validates `id`.
    ///
    /// # Errors
    ///
    /// [`IdError::Service`] naming the id and the part of the rule it breaks.
    pub fn new(id: impl Into<String>) -> Result<Self, IdError> {
        let id = id.into();
        match check_service_id(&id) {
            Ok(()) => Ok(Self(id.into())),
            Err(reason) => Err(IdError::Service { id, reason }),
        }
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id of this service's managed proxy, `<id>-proxy`.
    pub fn proxy_id(&self) -> ProxyId {
        ProxyId(format!("{}{PROXY_SUFFIX}", self.0).into())
    }
}

/// The id of a managed proxy: always `<service id>-proxy`. A clone shares the text: the
/// engine, the backend and the API each key a map or two by it, per proxy.
///
/// ```
/// use tether_state::ProxyId;
///
/// let id = ProxyId::parse("web-proxy").unwrap();
/// assert_eq!(id.service_id().as_str(), "web");
/// assert!(ProxyId::parse("web").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProxyId(Arc<str>);

impl ProxyId {
    /// Parses a proxy id, as found in an API path or a file name.
    ///
    /// # Errors
    ///
    /// [`IdError::Proxy`] when `id` does not end in `-proxy` or what comes before is not a
    /// valid service id.
    pub fn parse(id: impl Into<String>) -> Result<Self, IdError> {
        let id = id.into();
        let Some(service) = id.strip_suffix(PROXY_SUFFIX) else {
            return Err(IdError::Proxy { id, reason: "it does not end in `-proxy`" });
        };
        if let Err(reason) = check_service_id(service) {
            return Err(IdError::Proxy { id, reason });
        }
        Ok(Self(id.into()))
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id of the service this proxy belongs to.
    pub fn service_id(&self) -> ServiceId {
        let service = &self.0[..self.0.len() - PROXY_SUFFIX.len()];
        ServiceId(service.into())
    }
}

macro_rules! id_traits {
    ($ty:ident, $ctor:ident) => {
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }

        impl AsRef<str> for $ty {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $ty {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl std::str::FromStr for $ty {
            type Err = IdError;

            fn from_str(s: &str) -> Result<Self, IdError> {
                Self::$ctor(s)
            }
        }

        impl TryFrom<String> for $ty {
            type Error = IdError;

            fn try_from(s: String) -> Result<Self, IdError> {
                Self::$ctor(s)
            }
        }

        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let raw = String::deserialize(deserializer)?;
                Self::$ctor(raw).map_err(serde::de::Error::custom)
            }
        }
    };
}

id_traits!(ServiceId, new);
id_traits!(ProxyId, parse);

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[track_caller]
    fn rejected(id: &str, reason: &str) {
        let err = ServiceId::new(id).unwrap_err();
        let message = err.to_string();
        assert!(message.contains(reason), "{id:?}: {message}");
        assert!(message.contains(SERVICE_ID_RULE), "{id:?}: {message}");
        assert!(message.contains(&format!("{id:?}")), "{id:?}: {message}");
    }

    #[test]
    fn ids_that_could_escape_the_data_dir_are_rejected() {
        rejected("", "empty");
        rejected("..", "start with a letter or a digit");
        rejected(".", "start with a letter or a digit");
        rejected("a/b", "may only contain");
        rejected("a\0b", "may only contain");
        rejected("web service", "may only contain");
        rejected("-web", "start with a letter or a digit");
        rejected("_web", "start with a letter or a digit");
        rejected("wéb", "may only contain");
        rejected(&"a".repeat(129), "longer than 128 bytes");
    }

    #[test]
    fn error_escapes_control_characters() {
        let message = ServiceId::new("a\nb\x1b[31m").unwrap_err().to_string();
        assert!(!message.contains('\n') && !message.contains('\x1b'), "{message}");
    }

    #[test]
    fn longest_and_shortest_ids_are_accepted() {
        assert!(ServiceId::new("a").is_ok());
        assert!(ServiceId::new("9").is_ok());
        assert!(ServiceId::new("a".repeat(128)).is_ok());
        assert!(ServiceId::new("a.b_c-D").is_ok());
        assert!(ServiceId::new("a..").is_ok(), "dots after the first byte are plain characters");
    }

    #[test]
    fn proxy_id_must_name_a_valid_service() {
        assert!(ProxyId::parse("web-proxy").is_ok());
        let err = ProxyId::parse("web").unwrap_err().to_string();
        assert!(err.contains("does not end in `-proxy`"), "{err}");
        let err = ProxyId::parse("-proxy").unwrap_err().to_string();
        assert!(err.contains("empty"), "{err}");
        let err = ProxyId::parse("../x-proxy").unwrap_err().to_string();
        assert!(err.contains("start with a letter or a digit"), "{err}");
    }

    #[test]
    fn ids_deserialize_through_validation() {
        let err = serde_json::from_str::<ServiceId>("\"a/b\"").unwrap_err().to_string();
        assert!(err.contains("invalid service id \"a/b\""), "{err}");
        let id: ProxyId = serde_json::from_str("\"db-proxy\"").unwrap();
        assert_eq!(id.service_id().as_str(), "db");
    }

    proptest! {
        #[test]
        fn valid_ids_are_accepted_and_map_to_their_proxy(id in "[A-Za-z0-9][A-Za-z0-9._-]{0,127}") {
            let service = ServiceId::new(id.clone()).unwrap();
            prop_assert_eq!(service.as_str(), id.as_str());
            let proxy = service.proxy_id();
            prop_assert_eq!(ProxyId::parse(proxy.as_str()).unwrap(), proxy.clone());
            prop_assert_eq!(proxy.service_id(), service);
        }

        #[test]
        fn accepted_ids_are_always_plain_file_names(id in any::<String>()) {
            if let Ok(service) = ServiceId::new(id.clone()) {
                let s = service.as_str();
                prop_assert!(!s.is_empty() && s.len() <= 128);
                prop_assert!(s != "." && s != "..");
                prop_assert!(!s.contains('/') && !s.contains('\0'));
                prop_assert!(s.bytes().all(|b| b.is_ascii_graphic()));
                let path = std::path::Path::new(s);
                prop_assert_eq!(path.components().count(), 1);
                prop_assert!(matches!(path.components().next(), Some(std::path::Component::Normal(_))));
            }
        }

        #[test]
        fn any_byte_outside_the_alphabet_is_rejected(
            prefix in "[A-Za-z0-9]{1,10}",
            bad in any::<char>().prop_filter("outside alphabet", |c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))),
        ) {
            let id = format!("{prefix}{bad}");
            prop_assert!(ServiceId::new(id).is_err());
        }
    }
}
