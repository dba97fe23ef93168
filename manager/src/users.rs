//! The engine's one view of the host's user database: which uid a proxy's `user` names, as
//! the root policy needs to know.
//!
//! The agent supplies the lookup; this crate never calls the operating system itself, so
//! that the engine and its tests stay free of `nix` and of the host's accounts.

use std::fmt;
use std::sync::Arc;

/// Finds the uid that a user name has on this host, for the root policy: a proxy whose
/// `user` has uid 0 runs as root.
///
/// The engine asks it when a proxy that names a user enters the catalog or changes, and only
/// while root is refused (the agent runs as uid 0 without `--allow-root`), on its own task:
/// the answer should be quick, as a local user database's is. `None` means that the name
/// cannot be resolved; such a proxy is not refused, since its start fails on the unknown user
/// and says so. [`UserLookup::default`] resolves no name.
///
/// ```
/// use tether_manager::UserLookup;
///
/// let users = UserLookup::new(|name| match name {
///     "root" | "toor" => Some(0),
///     "nobody" => Some(65534),
///     _ => None,
/// });
/// assert_eq!(users.uid("toor"), Some(0));
/// assert_eq!(users.uid("ghost"), None);
/// assert_eq!(UserLookup::default().uid("root"), None);
/// ```
#[derive(Clone)]
pub struct UserLookup(Arc<UidOf>);

/// The function behind a [`UserLookup`].
type UidOf = dyn Fn(&str) -> Option<u32> + Send + Sync;

impl UserLookup {
    /// A lookup that answers with `uid_of`.
    pub fn new(uid_of: impl Fn(&str) -> Option<u32> + Send + Sync + 'static) -> Self {
        Self(Arc::new(uid_of))
    }

    /// The uid of `user`, if the name resolves.
    pub fn uid(&self, user: &str) -> Option<u32> {
        (self.0)(user)
    }
}

impl Default for UserLookup {
    fn default() -> Self {
        Self::new(|_| None)
    }
}

impl fmt::Debug for UserLookup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UserLookup(..)")
    }
}
