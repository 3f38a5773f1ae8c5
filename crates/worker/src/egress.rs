//! The dispatcher's guard at connect time: the egress rule of
//! `cobro_core::egress`, applied to the addresses the dispatcher's HTTP
//! client is about to connect to.
//!
//! An endpoint's URL was checked when it was registered, but a host name
//! can resolve elsewhere later: a DNS server that answers a public address
//! at registration and `127.0.0.1` a minute after (DNS rebinding) would
//! pass any check made only once. So the client resolves names through
//! [`GuardedResolver`], which drops every address the policy refuses and
//! fails the connection when none is left; the addresses it returns are
//! the ones connected to, so there is no second lookup to race. reqwest
//! does not call a resolver for an IP-literal host, so
//! [`check_before_send`] checks those (and the scheme) before the POST.

use cobro_core::egress::{EgressPolicy, Host, Refusal};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;

/// Resolves a host name to its addresses. The system's resolver in
/// production ([`system_lookup`]); a test can answer what a rebinding DNS
/// server would.
pub type Lookup = Arc<
    dyn Fn(String) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<IpAddr>>> + Send>>
        + Send
        + Sync,
>;

/// The operating system's resolver (`getaddrinfo`, through tokio).
pub fn system_lookup() -> Lookup {
    Arc::new(|name: String| {
        Box::pin(async move {
            let addresses = tokio::net::lookup_host((name.as_str(), 0)).await?;
            Ok(addresses.map(|address| address.ip()).collect())
        })
    })
}

/// A connection refused by the egress rule; found again in the chain of
/// reqwest's error to record why a delivery failed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Blocked(pub Refusal);

/// reqwest's DNS resolver for the dispatcher's client: resolves with its
/// [`Lookup`] and keeps only the addresses the policy allows.
pub struct GuardedResolver {
    policy: Arc<EgressPolicy>,
    lookup: Lookup,
}

impl GuardedResolver {
    pub fn new(policy: Arc<EgressPolicy>, lookup: Lookup) -> Self {
        Self { policy, lookup }
    }
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_owned();
        let policy = Arc::clone(&self.policy);
        let lookup = Arc::clone(&self.lookup);
        Box::pin(async move {
            // `localhost` is refused before any lookup.
            policy.check_host(Host::Name(&host)).map_err(Blocked)?;
            let addresses = lookup(host.clone()).await?;
            let allowed = policy
                .allowed_addresses(&host, addresses)
                .map_err(Blocked)?;
            // Port 0: reqwest puts the URL's port (or the scheme's) in.
            let addresses: reqwest::dns::Addrs = Box::new(
                allowed
                    .into_iter()
                    .map(|ip| SocketAddr::new(ip, 0))
                    .collect::<Vec<_>>()
                    .into_iter(),
            );
            Ok(addresses)
        })
    }
}

/// What the resolver never sees: the scheme, and a host that is an IP
/// literal. A name passes here and is judged by [`GuardedResolver`].
pub fn check_before_send(policy: &EgressPolicy, url: &reqwest::Url) -> Result<(), Refusal> {
    policy.check_scheme(url.scheme())?;
    match url.host() {
        Some(url::Host::Ipv4(ip)) => policy.check_host(Host::Ip(ip.into())).map(|_| ()),
        Some(url::Host::Ipv6(ip)) => policy.check_host(Host::Ip(ip.into())).map(|_| ()),
        Some(url::Host::Domain(name)) => policy.check_host(Host::Name(name)).map(|_| ()),
        None => Err(Refusal::Malformed),
    }
}

/// The egress refusal somewhere in `error`'s chain, if that is why it
/// failed.
pub fn blocked_by<'e>(error: &'e (dyn std::error::Error + 'static)) -> Option<&'e Refusal> {
    let mut source = Some(error);
    while let Some(e) = source {
        if let Some(Blocked(refusal)) = e.downcast_ref::<Blocked>() {
            return Some(refusal);
        }
        source = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::dns::Resolve;

    fn answering(addresses: &'static [&'static str]) -> Lookup {
        Arc::new(move |_name| {
            Box::pin(async move {
                Ok(addresses
                    .iter()
                    .map(|a| a.parse().expect("address"))
                    .collect())
            })
        })
    }

    async fn resolve(
        policy: EgressPolicy,
        lookup: Lookup,
        name: &str,
    ) -> Result<Vec<IpAddr>, String> {
        let resolver = GuardedResolver::new(Arc::new(policy), lookup);
        match resolver.resolve(name.parse().expect("name")).await {
            Ok(addresses) => Ok(addresses.map(|a| a.ip()).collect()),
            Err(e) => Err(e.to_string()),
        }
    }

    #[tokio::test]
    async fn the_resolver_drops_refused_addresses_and_fails_when_none_is_left() {
        let only_loopback = resolve(
            EgressPolicy::default(),
            answering(&["127.0.0.1"]),
            "rebind.example",
        )
        .await;
        assert_eq!(
            only_loopback,
            Err(
                "rebind.example is 127.0.0.1, a loopback address, which endpoints may not reach"
                    .into()
            )
        );
        let mixed = resolve(
            EgressPolicy::default(),
            answering(&["10.0.0.1", "93.184.216.34", "::1"]),
            "mixed.example",
        )
        .await;
        assert_eq!(mixed, Ok(vec!["93.184.216.34".parse().expect("ip")]));
    }

    #[tokio::test]
    async fn the_resolver_refuses_localhost_without_a_lookup() {
        let never: Lookup = Arc::new(|name| panic!("{name} was looked up"));
        let refused = resolve(EgressPolicy::default(), never, "localhost").await;
        assert!(refused.is_err_and(|e| e.contains("localhost")));
    }

    #[tokio::test]
    async fn the_resolver_keeps_allowed_networks() {
        let policy = EgressPolicy {
            allow_http: true,
            allow: vec!["127.0.0.1/32".parse().expect("entry")],
        };
        let allowed = resolve(policy, answering(&["127.0.0.1"]), "merchant.test").await;
        assert_eq!(allowed, Ok(vec!["127.0.0.1".parse().expect("ip")]));
    }

    #[test]
    fn ip_literals_and_the_scheme_are_checked_before_sending() {
        let url = |u: &str| reqwest::Url::parse(u).expect("url");
        let policy = EgressPolicy::default();
        for refused in [
            "http://8.8.8.8/hook",
            "https://127.0.0.1:8080/internal/admin",
            "https://169.254.169.254/latest/meta-data",
            "https://localhost/",
        ] {
            assert!(
                check_before_send(&policy, &url(refused)).is_err(),
                "{refused}"
            );
        }
        assert_eq!(
            check_before_send(&policy, &url("https://8.8.8.8/hook")),
            Ok(())
        );
        assert_eq!(
            check_before_send(&policy, &url("https://shop.example/")),
            Ok(())
        );
    }
}
