//! `kind = "envoy"`: before each start of such a proxy, the agent writes its bootstrap
//! (what `tether envoy bootstrap` prints) to `envoy/<proxy id>.json` in the data dir, which
//! the backend gives Envoy with `-c`.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::Arc;

use async_trait::async_trait;
use tether_proxy_daemon::BeforeStart;
use tether_state::persist::{DataDir, Durability};
use tether_state::{ManagedProxy, ProxyKind};

use super::bootstrap::{Bootstrap, XdsTarget};

/// Writes the bootstraps of the proxies of `kind = "envoy"`.
#[derive(Debug, Clone)]
pub(crate) struct EnvoyBootstraps {
    data: DataDir,
    xds: XdsTarget,
}

impl EnvoyBootstraps {
    /// Bootstraps in `data`'s `envoy/`, that reach the agent at `xds`.
    pub(crate) fn new(data: DataDir, xds: XdsTarget) -> Self {
        Self { data, xds }
    }

    /// Writes `proxy`'s bootstrap, mode 0600 (it holds the token), if it is of `kind = "envoy"`.
    fn write(&self, proxy: &ManagedProxy) -> anyhow::Result<()> {
        let ProxyKind::Envoy { admin_port } = proxy.spec().kind else { return Ok(()) };
        let port = match admin_port {
            Some(port) => port,
            // A port free now; Envoy binds it a moment later, at its start.
            None => TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
                .and_then(|listener| listener.local_addr())
                .map_err(|err| anyhow::anyhow!("cannot find a free loopback port for Envoy's admin: {err}"))?
                .port(),
        };
        let admin = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let bootstrap = Bootstrap { proxy: proxy.id(), token: proxy.token(), xds: &self.xds, admin, delta: false };
        let mut text = serde_json::to_vec_pretty(&bootstrap.to_json())?;
        text.push(b'\n');
        let dir = self.data.envoy_dir()?;
        dir.write_atomic(DataDir::envoy_bootstrap_name(proxy.id()), Durability::Crash, &text)?;
        Ok(())
    }
}

#[async_trait]
impl BeforeStart for EnvoyBootstraps {
    async fn before_start(&self, proxy: Arc<ManagedProxy>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        if !matches!(proxy.spec().kind, ProxyKind::Envoy { .. }) {
            return Ok(());
        }
        let this = self.clone();
        match tokio::task::spawn_blocking(move || this.write(&proxy)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(format!("writing the Envoy bootstrap: {error:#}").into()),
            Err(join) => Err(Box::new(join)),
        }
    }
}

/// Several [`BeforeStart`]s, one after the other; the first failure fails the start.
#[derive(Debug)]
pub(crate) struct BeforeStarts(pub(crate) Vec<Arc<dyn BeforeStart>>);

#[async_trait]
impl BeforeStart for BeforeStarts {
    async fn before_start(&self, proxy: Arc<ManagedProxy>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        for each in &self.0 {
            each.before_start(proxy.clone()).await?;
        }
        Ok(())
    }
}
