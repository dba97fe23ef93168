//! Proxy tokens: the secret a proxy presents to the agent.
//!
//! A token is made from the operating system's CSPRNG, kept across agent restarts by the
//! persistence layer, and never shown: `Debug` and `Display` print a placeholder, and the
//! only way to read it is the explicit [`ProxyToken::expose`].

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};

/// Bytes of randomness in a token: 256 bits, shown as 64 hex digits.
const TOKEN_BYTES: usize = 32;

/// The shortest token accepted from storage, in hex digits (128 bits).
const MIN_TOKEN_HEX: usize = 32;

/// A token that could not be made or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The operating system's random source failed.
    #[error("the operating system's random number generator failed: {0}")]
    Random(getrandom::Error),
    /// A stored token is not lowercase hex of at least 128 bits.
    #[error("a stored proxy token is malformed: expected at least {MIN_TOKEN_HEX} lowercase hex digits")]
    Malformed,
}

/// The secret shared by one proxy and the agent.
///
/// ```
/// use tether_state::ProxyToken;
///
/// let token = ProxyToken::generate().unwrap();
/// assert_eq!(format!("{token:?}"), "ProxyToken(<redacted>)");
/// assert!(token.matches(token.expose()));
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ProxyToken(Box<str>);

impl ProxyToken {
    /// Makes a new token from the operating system's CSPRNG.
    ///
    /// # Errors
    ///
    /// [`TokenError::Random`] if the random source is unavailable.
    pub fn generate() -> Result<Self, TokenError> {
        let mut bytes = [0u8; TOKEN_BYTES];
        getrandom::fill(&mut bytes).map_err(TokenError::Random)?;
        Ok(Self(hex(&bytes).into_boxed_str()))
    }

    /// Reads a token back from storage.
    ///
    /// # Errors
    ///
    /// [`TokenError::Malformed`] unless `hex` is at least 32 lowercase hex digits.
    pub fn from_hex(hex: impl Into<String>) -> Result<Self, TokenError> {
        let hex = hex.into();
        let well_formed = hex.len() >= MIN_TOKEN_HEX
            && hex.len() % 2 == 0
            && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if !well_formed {
            return Err(TokenError::Malformed);
        }
        Ok(Self(hex.into_boxed_str()))
    }

    /// The secret itself, for the proxy's environment and for files of mode 0600.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Compares `candidate` with this token in time that does not depend on where they
    /// differ, so a caller probing the API learns nothing from timing.
    pub fn matches(&self, candidate: &str) -> bool {
        let ours = self.0.as_bytes();
        let theirs = candidate.as_bytes();
        if ours.len() != theirs.len() {
            return false;
        }
        let diff = ours.iter().zip(theirs).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(diff) == 0
    }

    /// A SHA-256 fingerprint of the token: enough to notice that it changed, useless to
    /// anyone who wants the token itself. Snapshots record this instead of the secret.
    pub fn fingerprint(&self) -> TokenFingerprint {
        let digest = Sha256::digest(self.0.as_bytes());
        TokenFingerprint(hex(&digest).into_boxed_str())
    }
}

impl fmt::Debug for ProxyToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ProxyToken(<redacted>)")
    }
}

impl fmt::Display for ProxyToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Serialize for ProxyToken {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for ProxyToken {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        Self::from_hex(raw).map_err(serde::de::Error::custom)
    }
}

/// The SHA-256 of a [`ProxyToken`], in hex. Safe to store and to show.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TokenFingerprint(Box<str>);

impl TokenFingerprint {
    /// The fingerprint in hex.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TokenFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        out.push(char::from(DIGITS[usize::from(byte >> 4)]));
        out.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_tokens_are_256_bits_of_hex_and_distinct() {
        let a = ProxyToken::generate().unwrap();
        let b = ProxyToken::generate().unwrap();
        assert_eq!(a.expose().len(), 64);
        assert!(ProxyToken::from_hex(a.expose()).is_ok());
        assert_ne!(a, b);
    }

    #[test]
    fn debug_and_display_never_show_the_secret() {
        let token = ProxyToken::generate().unwrap();
        let shown = format!("{token} {token:?} {:?}", Some(&token));
        assert!(!shown.contains(token.expose()), "{shown}");
        assert!(!shown.contains(&token.expose()[..8]), "{shown}");
    }

    #[test]
    fn malformed_tokens_are_refused_without_echoing_them() {
        for bad in ["", "abc", "ABCDEF0123456789ABCDEF0123456789", &"g".repeat(32), &"a".repeat(33)] {
            let err = ProxyToken::from_hex(bad).unwrap_err();
            assert!(matches!(err, TokenError::Malformed), "{bad:?}");
            if !bad.is_empty() {
                assert!(!err.to_string().contains(bad), "{err}");
            }
        }
    }

    #[test]
    fn matches_only_the_exact_token() {
        let token = ProxyToken::from_hex("0123456789abcdef0123456789abcdef").unwrap();
        assert!(token.matches("0123456789abcdef0123456789abcdef"));
        assert!(!token.matches("0123456789abcdef0123456789abcdee"));
        assert!(!token.matches("0123456789abcdef0123456789abcde"));
        assert!(!token.matches(""));
    }

    #[test]
    fn fingerprint_follows_the_token_and_hides_it() {
        let a = ProxyToken::generate().unwrap();
        let b = ProxyToken::generate().unwrap();
        assert_eq!(a.fingerprint(), a.clone().fingerprint());
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert!(!a.fingerprint().as_str().contains(a.expose()));
        assert_eq!(a.fingerprint().as_str().len(), 64);
    }
}
