//! Provider selection: the configured provider's URL, or (for `serve`
//! without one) the embedded fake provider on loopback. The worker, the
//! scheduled reconciler and `cobro reconcile` all get their client here.

use crate::settings::{KeyWindowSettings, ProviderSettings};
use anyhow::Context;
use cobro_provider::{HttpProvider, HttpProviderConfig};

/// The provider the worker calls, and the embedded fake one if we started it
/// (kept alive as long as this value).
pub struct ProviderHandle {
    pub client: HttpProvider,
    pub embedded: Option<fake_provider::Running>,
}

/// Connects to the configured provider, or, when no URL is set and
/// `embedded` gives its key window, starts the embedded fake one.
pub async fn connect(
    settings: &ProviderSettings,
    embedded: Option<&KeyWindowSettings>,
) -> anyhow::Result<ProviderHandle> {
    let (url, embedded) = match (&settings.provider_url, embedded) {
        (Some(url), _) => (url.clone(), None),
        (None, Some(window)) => {
            let running = fake_provider::start(fake_provider::Config {
                retention: window.provider_key_retention,
                admin: true,
                ..Default::default()
            })
            .await
            .context("could not start the embedded fake provider")?;
            tracing::warn!(
                url = %running.url(),
                "EMBEDDED FAKE PROVIDER: no real money moves; set COBRO_PROVIDER_URL for a real provider"
            );
            (running.url(), Some(running))
        }
        (None, None) => {
            anyhow::bail!("no provider configured: set COBRO_PROVIDER_URL (or --provider-url)")
        }
    };
    let mut config = HttpProviderConfig::new(url, settings.provider_api_key.clone());
    config.connect_timeout = settings.provider_connect_timeout;
    config.request_timeout = settings.provider_timeout;
    let client = HttpProvider::new(config).context("could not build the provider client")?;
    Ok(ProviderHandle { client, embedded })
}
