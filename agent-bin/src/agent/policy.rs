//! The agent's policy beyond the catalog's own rules: the user lookup through which the
//! engine tells which proxies would run as root.
//!
//! This module only answers questions; it changes nothing.

use tether_manager::UserLookup;

/// The root policy's view of this host's users: the uid that a proxy's `user` names, looked
/// up as the process backend does before it switches to the user (`getpwnam`). A name that
/// is all digits and that no user has is taken as that uid, so that a `user` of "0" counts
/// as root whatever a later version of the backend makes of it. Any other name that does not
/// resolve (unknown, or the lookup failed) is not root: the start then fails on it and says
/// why.
pub(crate) fn system_users() -> UserLookup {
    UserLookup::new(|user| match nix::unistd::User::from_name(user) {
        Ok(Some(entry)) => Some(entry.uid.as_raw()),
        Ok(None) | Err(_) => user.parse().ok(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_system_lookup_knows_root_and_numeric_uids() {
        let users = system_users();
        assert_eq!(users.uid("root"), Some(0));
        assert_eq!(users.uid("0"), Some(0));
        assert_eq!(users.uid("no-such-user-here"), None);
    }
}
