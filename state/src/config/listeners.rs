//! The schema of `[[service.proxy.listener]]` and `update`, as read, and the check that
//! ties listeners to a readiness `fd`.

use super::*;

/// The most listeners of one proxy: descriptors 3 to 66 of each instance, passed to it
/// in one message.
pub const MAX_LISTENERS: usize = 64;

/// The `[[service.proxy.listener]]` array: names unique, addresses distinct, at most
/// [`MAX_LISTENERS`].
pub(super) struct ListenersDef(pub(super) Vec<Listener>);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListenerDef {
    name: ListenerNameDef,
    address: ListenAddressDef,
}

struct ListenerNameDef(ListenerName);

impl<'de> Deserialize<'de> for ListenerNameDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        ListenerName::new(&raw).map(Self).map_err(de::Error::custom)
    }
}

struct ListenAddressDef(ListenAddress);

impl<'de> Deserialize<'de> for ListenAddressDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        ListenAddress::parse(&raw).map(Self).map_err(de::Error::custom)
    }
}

impl<'de> Deserialize<'de> for ListenersDef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let defs = Vec::<ListenerDef>::deserialize(deserializer)?;
        if defs.len() > MAX_LISTENERS {
            return Err(de::Error::custom(format!("{} listeners: a proxy has at most {MAX_LISTENERS}", defs.len())));
        }
        let mut listeners: Vec<Listener> = Vec::with_capacity(defs.len());
        for def in defs {
            let listener = Listener { name: def.name.0, address: def.address.0 };
            if let Some(twin) = listeners.iter().find(|l| l.name == listener.name) {
                return Err(de::Error::custom(format!("two listeners are named {:?}", twin.name.as_str())));
            }
            if let Some(twin) = listeners.iter().find(|l| l.address == listener.address) {
                return Err(de::Error::custom(format!(
                    "listeners {:?} and {:?} have the same address {}",
                    twin.name.as_str(),
                    listener.name.as_str(),
                    listener.address
                )));
            }
            listeners.push(listener);
        }
        Ok(Self(listeners))
    }
}

#[derive(Deserialize, Serialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
pub(super) enum UpdateDef {
    Restart,
    Overlap,
    Epoch,
}

/// Listeners take descriptors 3, 4, … of every instance: a readiness `fd` may not be one.
pub(super) fn check_descriptors(proxy: &ProxySpec) -> Result<(), String> {
    if let Some(Readiness { probe: Probe::Fd(fd), .. }) = proxy.readiness.as_deref() {
        let taken = 3..3 + proxy.listeners.len() as u64;
        if taken.contains(&u64::from(*fd)) {
            let listener = &proxy.listeners[(u64::from(*fd) - 3) as usize];
            return Err(format!(
                "proxy.readiness.fd {fd} is the descriptor of listener {:?} (listeners take 3, 4, …): choose {} or more",
                listener.name.as_str(),
                taken.end
            ));
        }
    }
    Ok(())
}
