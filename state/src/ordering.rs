//! Ordering between proxies: the vocabulary of `depends_on` ([`Dependency`], [`Condition`]),
//! how a dependency's name resolves to a proxy ([`Dependency::resolve`]), and the one rule
//! that finds dependency cycles ([`dependency_cycles`]).
//!
//! This module is pure: it reads no file and knows nothing of what runs. The config loader
//! refuses cycles with it, and the engine orders starts and stops with it.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use crate::id::{IdError, ProxyId, ServiceId};

/// What a dependency must have reached before its dependent starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Condition {
    /// Its process runs (state `starting` with a process, or `running`).
    Started,
    /// It is `running`: started, and its readiness check (if any) passed.
    Ready,
}

impl Condition {
    /// The condition's name, as the config spells it: `started` or `ready`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Ready => "ready",
        }
    }

    /// The condition named `name`, if there is one.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "started" => Some(Self::Started),
            "ready" => Some(Self::Ready),
            _ => None,
        }
    }
}

impl fmt::Display for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The name of a dependency in `depends_on`: a proxy id (`db-proxy`) or a service id (`db`),
/// which names that service's proxy.
///
/// ```
/// use tether_state::{Dependency, ProxyId};
///
/// let by_service = Dependency::new("db").unwrap();
/// let known = [ProxyId::parse("db-proxy").unwrap()];
/// assert_eq!(by_service.resolve(|id| known.contains(id)), Some(known[0].clone()));
/// assert_eq!(Dependency::new("cache").unwrap().resolve(|id| known.contains(id)), None);
/// assert!(Dependency::new("../etc").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Dependency(Box<str>);

impl Dependency {
    /// Validates `name`: a valid proxy id or service id.
    ///
    /// # Errors
    ///
    /// The service id's [`IdError`] when `name` is neither.
    pub fn new(name: impl Into<String>) -> Result<Self, IdError> {
        let name = name.into();
        if ProxyId::parse(name.as_str()).is_ok() {
            return Ok(Self(name.into_boxed_str()));
        }
        ServiceId::new(name.as_str())?;
        Ok(Self(name.into_boxed_str()))
    }

    /// The name as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The proxy this name stands for, among those for which `exists` is true: the proxy of
    /// that id if there is one, else the proxy of the service of that id (as the command
    /// line takes a service id for its proxy).
    pub fn resolve(&self, exists: impl Fn(&ProxyId) -> bool) -> Option<ProxyId> {
        self.candidates().into_iter().flatten().find(|id| exists(id))
    }

    /// The proxies this name may stand for, in the order [`Dependency::resolve`] tries them:
    /// the proxy of that id, then the proxy of the service of that id.
    pub fn candidates(&self) -> [Option<ProxyId>; 2] {
        [ProxyId::parse(self.as_str()).ok(), ServiceId::new(self.as_str()).ok().map(|id| id.proxy_id())]
    }
}

impl fmt::Display for Dependency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Dependency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// A proxy's `depends_on`: each dependency and the condition it must reach.
pub type DependsOn = BTreeMap<Dependency, Condition>;

/// The dependency cycles among `proxies` (each proxy with its `depends_on`), each as the
/// proxies along it, starting with the one listed first; every proxy that is on a cycle is
/// on at most one of those returned, and a graph with a cycle gives at least one. A
/// dependency that names no proxy of `proxies` is no edge.
///
/// ```
/// use std::collections::BTreeMap;
/// use tether_state::{Condition, Dependency, ProxyId, dependency_cycles};
///
/// let id = |s: &str| ProxyId::parse(s).unwrap();
/// let deps = |d: &str| BTreeMap::from([(Dependency::new(d).unwrap(), Condition::Ready)]);
/// let (a, b, c) = (deps("b"), deps("a-proxy"), deps("a"));
/// let proxies = [(id("a-proxy"), &a), (id("b-proxy"), &b), (id("c-proxy"), &c)];
/// assert_eq!(dependency_cycles(&proxies), [vec![id("a-proxy"), id("b-proxy")]]);
/// ```
pub fn dependency_cycles(proxies: &[(ProxyId, &DependsOn)]) -> Vec<Vec<ProxyId>> {
    let index: HashMap<&ProxyId, usize> = proxies.iter().enumerate().map(|(i, (id, _))| (id, i)).collect();
    let edges: Vec<Vec<usize>> = proxies
        .iter()
        .map(|(_, depends_on)| {
            depends_on
                .keys()
                .filter_map(|dependency| dependency.resolve(|id| index.contains_key(id)))
                .filter_map(|id| index.get(&id).copied())
                .collect()
        })
        .collect();
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        OnPath,
        Done,
    }
    let mut marks = vec![Mark::New; proxies.len()];
    let mut cycles = Vec::new();
    // Iterative depth-first search, so that a chain of thousands does not exhaust the stack.
    for root in 0..proxies.len() {
        if marks[root] != Mark::New {
            continue;
        }
        let mut path: Vec<(usize, usize)> = vec![(root, 0)];
        marks[root] = Mark::OnPath;
        while let Some((node, next)) = path.last_mut() {
            let node = *node;
            let Some(&to) = edges[node].get(*next) else {
                marks[node] = Mark::Done;
                path.pop();
                continue;
            };
            *next += 1;
            match marks[to] {
                Mark::New => {
                    marks[to] = Mark::OnPath;
                    path.push((to, 0));
                }
                Mark::OnPath => {
                    let start = path.iter().position(|(n, _)| *n == to).unwrap_or(0);
                    cycles.push(path[start..].iter().map(|(n, _)| proxies[*n].0.clone()).collect());
                }
                Mark::Done => {}
            }
        }
    }
    cycles
}

/// A cycle as a message: `a-proxy -> b-proxy -> a-proxy`.
pub fn cycle_text(cycle: &[ProxyId]) -> String {
    let mut text: Vec<&str> = cycle.iter().map(ProxyId::as_str).collect();
    if let Some(first) = cycle.first() {
        text.push(first.as_str());
    }
    text.join(" -> ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> ProxyId {
        ProxyId::parse(s).unwrap()
    }

    fn deps(names: &[&str]) -> DependsOn {
        names.iter().map(|n| (Dependency::new(*n).unwrap(), Condition::Started)).collect()
    }

    #[test]
    fn a_proxy_id_wins_over_a_service_of_that_id() {
        // `db-proxy` is the proxy of `db`, and also a valid service id whose proxy is `db-proxy-proxy`.
        let both = [id("db-proxy"), id("db-proxy-proxy")];
        assert_eq!(Dependency::new("db-proxy").unwrap().resolve(|p| both.contains(p)), Some(id("db-proxy")));
        let only_service = [id("db-proxy-proxy")];
        assert_eq!(
            Dependency::new("db-proxy").unwrap().resolve(|p| only_service.contains(p)),
            Some(id("db-proxy-proxy"))
        );
    }

    #[test]
    fn a_self_dependency_is_a_cycle() {
        let a = deps(&["a"]);
        assert_eq!(dependency_cycles(&[(id("a-proxy"), &a)]), [vec![id("a-proxy")]]);
    }

    #[test]
    fn a_long_chain_has_no_cycle_and_a_closed_one_has_one() {
        let n = 5000;
        let specs: Vec<DependsOn> = (0..n).map(|i| deps(&[&format!("s{}", (i + 1) % n)])).collect();
        let mut proxies: Vec<(ProxyId, &DependsOn)> =
            specs.iter().enumerate().map(|(i, d)| (id(&format!("s{i}-proxy")), d)).collect();
        let cycles = dependency_cycles(&proxies);
        assert_eq!(cycles.len(), 1);
        assert_eq!(cycles[0].len(), n);
        let open = DependsOn::new();
        proxies[n - 1].1 = &open;
        assert!(dependency_cycles(&proxies).is_empty());
    }

    #[test]
    fn diamonds_and_missing_names_are_no_cycles() {
        let (a, b, c, d) = (deps(&["b", "c", "nowhere"]), deps(&["d"]), deps(&["d-proxy"]), deps(&[]));
        let proxies = [(id("a-proxy"), &a), (id("b-proxy"), &b), (id("c-proxy"), &c), (id("d-proxy"), &d)];
        assert!(dependency_cycles(&proxies).is_empty());
    }

    #[test]
    fn the_cycle_text_closes_the_loop() {
        assert_eq!(cycle_text(&[id("a-proxy"), id("b-proxy")]), "a-proxy -> b-proxy -> a-proxy");
    }
}
