//! Where cobro may send a merchant's events: the rule every event endpoint
//! URL passes when it is registered and again on every connection.
//!
//! An endpoint URL is chosen by whoever holds a merchant token, and cobro
//! then POSTs signed JSON to it from inside its own network. Without a
//! rule, that is a request forgery primitive (SSRF): `http://127.0.0.1/`,
//! the cloud metadata service at `169.254.169.254`, a Docker socket on
//! `10.0.0.1:2375`. So by default an endpoint must be `https://` and every
//! address it reaches must be a public unicast address
//! ([`special_range`] names the ones that are not). A deployment that
//! really delivers inside its network, and the tests, list what they
//! allow ([`AllowEntry`]); development may allow plain `http`.
//!
//! Layout:
//! - [`special_range`]: the address rule, a pure function of the address.
//! - [`EgressPolicy`]: the rule plus the deployment's allowances; checks a
//!   scheme, a host, one address, or a host's resolved addresses.
//! - [`Refusal`]: why, in words a merchant can act on.
//!
//! No IO here: resolving a name is the caller's (the API at registration,
//! the dispatcher's DNS resolver at connect time), each then asks this
//! policy about the addresses it got.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub use ipnet::IpNet;

/// Why an address is not a public unicast one, or `None` when it is.
///
/// IPv4: `0.0.0.0/8` (this network, with the unspecified address),
/// `10/8`, `172.16/12`, `192.168/16` (private), `100.64/10` (carrier-grade
/// NAT), `127/8` (loopback), `169.254/16` (link-local), `192.0.0/24` (IETF
/// protocol assignments), `192.0.2/24`, `198.51.100/24`, `203.0.113/24`
/// (documentation), `198.18/15` (benchmarking), `224/4` (multicast),
/// `240/4` (reserved) and `255.255.255.255` (broadcast).
///
/// IPv6: `::` and `::1`, `fe80::/10` (link-local), `fec0::/10` (the
/// deprecated site-local), `fc00::/7` (unique local), `ff00::/8`
/// (multicast), `2001:db8::/32` (documentation), `2001:2::/48`
/// (benchmarking), `100::/64` (discard), `::/96` (the deprecated
/// IPv4-compatible form), and the forms that carry an IPv4 address,
/// judged by the address they carry: `::ffff:0:0/96` (IPv4-mapped),
/// `64:ff9b::/96` (NAT64) and `2002::/16` (6to4).
pub fn special_range(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => special_v4(v4),
        IpAddr::V6(v6) => special_v6(v6),
    }
}

fn special_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    // The standard library's stable predicates first, the rest by hand.
    if ip.is_unspecified() || a == 0 {
        Some("unspecified (0.0.0.0/8)")
    } else if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_private() {
        Some("private")
    } else if ip.is_link_local() {
        Some("link-local")
    } else if ip.is_broadcast() {
        Some("broadcast")
    } else if ip.is_multicast() {
        Some("multicast")
    } else if ip.is_documentation() {
        Some("documentation")
    } else if a == 100 && (b & 0xc0) == 64 {
        Some("shared address space (carrier-grade NAT, 100.64.0.0/10)")
    } else if a == 198 && (b & 0xfe) == 18 {
        Some("benchmarking (198.18.0.0/15)")
    } else if a == 192 && b == 0 && c == 0 {
        Some("IETF protocol assignments (192.0.0.0/24)")
    } else if a >= 240 {
        Some("reserved (240.0.0.0/4)")
    } else {
        None
    }
}

fn special_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    if ip.is_unspecified() {
        return Some("unspecified");
    }
    if ip.is_loopback() {
        return Some("loopback");
    }
    if let Some(v4) = ip.to_ipv4_mapped() {
        return special_v4(v4).map(|_| "an IPv4-mapped form of a non-public IPv4 address");
    }
    let carried = |hi: u16, lo: u16| Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
    if s[..6] == [0; 6] {
        return Some("IPv4-compatible (deprecated, ::/96)");
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return special_v4(carried(s[6], s[7]))
            .map(|_| "a NAT64 form of a non-public IPv4 address");
    }
    if s[0] == 0x2002 {
        return special_v4(carried(s[1], s[2])).map(|_| "a 6to4 form of a non-public IPv4 address");
    }
    if ip.is_multicast() {
        Some("multicast")
    } else if ip.is_unicast_link_local() {
        Some("link-local")
    } else if (s[0] & 0xffc0) == 0xfec0 {
        Some("site-local (deprecated, fec0::/10)")
    } else if ip.is_unique_local() {
        Some("unique local (fc00::/7)")
    } else if s[0] == 0x2001 && s[1] == 0x0db8 {
        Some("documentation (2001:db8::/32)")
    } else if s[0] == 0x2001 && s[1] == 0x0002 && s[2] == 0 {
        Some("benchmarking (2001:2::/48)")
    } else if s[..4] == [0x0100, 0, 0, 0] {
        Some("discard-only (100::/64)")
    } else {
        None
    }
}

/// One allowance of a deployment: a network (`10.1.0.0/16`,
/// `127.0.0.1/32`, `::1/128`) whose addresses may be reached even though
/// they are not public, or a host name (`hooks.internal`) whose addresses
/// may all be reached, whatever they are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllowEntry {
    Network(IpNet),
    Host(String),
}

impl std::str::FromStr for AllowEntry {
    type Err = String;

    /// A CIDR (`10.0.0.0/8`), a bare address (one address: `/32` or
    /// `/128`), or a host name (letters, digits, `-` and `.`).
    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if let Ok(net) = text.parse::<IpNet>() {
            return Ok(AllowEntry::Network(net.trunc()));
        }
        if let Ok(ip) = text.parse::<IpAddr>() {
            return Ok(AllowEntry::Network(IpNet::from(ip)));
        }
        let name_ok = !text.is_empty()
            && text.len() <= 253
            && text.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            })
            && text.bytes().any(|b| b.is_ascii_alphabetic());
        if name_ok {
            Ok(AllowEntry::Host(text.to_ascii_lowercase()))
        } else {
            Err(format!(
                "`{text}` is neither a network (10.0.0.0/8, 127.0.0.1/32, ::1/128) nor a host name"
            ))
        }
    }
}

/// The host of an endpoint URL, as the URL parser read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Host<'a> {
    Name(&'a str),
    Ip(IpAddr),
}

/// What [`EgressPolicy::check_host`] leaves to the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostCheck {
    /// Allowed as it stands (an allowed address, or a listed host name
    /// whose addresses are all allowed): connect without checking more.
    Allowed,
    /// A name to resolve; then every address it has goes through
    /// [`EgressPolicy::check_resolved`] (registration) or
    /// [`EgressPolicy::allowed_addresses`] (connection).
    Resolve,
}

/// Why an endpoint URL, or one of its addresses, is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the URL could not be read")]
    Malformed,
    #[error("the URL must be https:// (plain http is allowed only in development)")]
    PlainHttp,
    #[error("{host} names this machine (localhost), which endpoints may not reach")]
    Localhost { host: String },
    #[error("{}", address_refused(host, ip, range))]
    Address {
        host: String,
        ip: IpAddr,
        range: &'static str,
    },
    #[error("{host} does not resolve to any address")]
    Unresolved { host: String },
}

fn address_refused(host: &str, ip: &IpAddr, range: &str) -> String {
    if host == ip.to_string() {
        format!("{ip} is a {range} address, which endpoints may not reach")
    } else {
        format!("{host} is {ip}, a {range} address, which endpoints may not reach")
    }
}

/// Where events may go: `https://` to public addresses, plus what the
/// deployment allows. [`Default`] is production's: nothing more.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EgressPolicy {
    /// Plain `http://` endpoints are accepted (development, tests).
    pub allow_http: bool,
    /// Networks and host names reachable even though not public.
    pub allow: Vec<AllowEntry>,
}

impl EgressPolicy {
    /// The embedded demo's allowances on top of `self`: plain http, and
    /// this machine (`127.0.0.0/8`, `::1`, `localhost`), so a merchant
    /// endpoint running next to the demo receives its events.
    pub fn with_development_allowances(mut self) -> Self {
        self.allow_http = true;
        for entry in ["127.0.0.0/8", "::1/128", "localhost"] {
            if let Ok(entry) = entry.parse::<AllowEntry>()
                && !self.allow.contains(&entry)
            {
                self.allow.push(entry);
            }
        }
        self
    }

    /// `https`, or `http` when allowed.
    pub fn check_scheme(&self, scheme: &str) -> Result<(), Refusal> {
        match scheme {
            "https" => Ok(()),
            "http" if self.allow_http => Ok(()),
            _ => Err(Refusal::PlainHttp),
        }
    }

    /// One address: public, or inside an allowed network. An IPv4-mapped
    /// IPv6 address matches the allowed IPv4 networks too.
    pub fn check_address(&self, host: &str, ip: IpAddr) -> Result<(), Refusal> {
        let canonical = ip.to_canonical();
        let allowed = self.allow.iter().any(|entry| match entry {
            AllowEntry::Network(net) => net.contains(&ip) || net.contains(&canonical),
            AllowEntry::Host(_) => false,
        });
        match special_range(ip) {
            Some(range) if !allowed => Err(Refusal::Address {
                host: host.to_owned(),
                ip,
                range,
            }),
            _ => Ok(()),
        }
    }

    /// The host, before any resolution: an address is checked; a listed
    /// host name is allowed; `localhost` and `*.localhost` are refused
    /// without asking DNS (RFC 6761 reserves them for loopback, and many
    /// resolvers answer them without DNS); any other name is to resolve.
    pub fn check_host(&self, host: Host<'_>) -> Result<HostCheck, Refusal> {
        match host {
            Host::Ip(ip) => self
                .check_address(&ip.to_string(), ip)
                .map(|()| HostCheck::Allowed),
            Host::Name(name) => {
                let name = name.trim_end_matches('.').to_ascii_lowercase();
                if self.host_listed(&name) {
                    Ok(HostCheck::Allowed)
                } else if name == "localhost" || name.ends_with(".localhost") {
                    Err(Refusal::Localhost { host: name })
                } else {
                    Ok(HostCheck::Resolve)
                }
            }
        }
    }

    fn host_listed(&self, name: &str) -> bool {
        self.allow
            .iter()
            .any(|entry| matches!(entry, AllowEntry::Host(h) if h == name))
    }

    /// At registration: every address `host` resolved to must be allowed
    /// (one bad address refuses the URL), and it must have one.
    pub fn check_resolved(&self, host: &str, addresses: &[IpAddr]) -> Result<(), Refusal> {
        if addresses.is_empty() {
            return Err(Refusal::Unresolved {
                host: host.to_owned(),
            });
        }
        addresses
            .iter()
            .try_for_each(|ip| self.check_address(host, *ip))
    }

    /// At connect time: the addresses of `host` that may be reached (none:
    /// the connection fails), after the same host checks as
    /// [`check_host`](Self::check_host). A listed host keeps them all.
    pub fn allowed_addresses(
        &self,
        host: &str,
        addresses: Vec<IpAddr>,
    ) -> Result<Vec<IpAddr>, Refusal> {
        if self.check_host(Host::Name(host))? == HostCheck::Allowed {
            return Ok(addresses);
        }
        let mut first_refusal = None;
        let allowed: Vec<IpAddr> = addresses
            .into_iter()
            .filter(|ip| match self.check_address(host, *ip) {
                Ok(()) => true,
                Err(refusal) => {
                    first_refusal.get_or_insert(refusal);
                    false
                }
            })
            .collect();
        match (allowed.is_empty(), first_refusal) {
            (false, _) => Ok(allowed),
            (true, Some(refusal)) => Err(refusal),
            (true, None) => Err(Refusal::Unresolved {
                host: host.to_owned(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("an address")
    }

    /// Every range the rule names, by at least one address in it (and its
    /// edges where an off-by-one would hide).
    const REFUSED: &[&str] = &[
        // loopback
        "127.0.0.1",
        "127.255.255.254",
        "::1",
        // private
        "10.0.0.1",
        "10.255.255.255",
        "172.16.0.1",
        "172.31.255.255",
        "192.168.1.1",
        // link-local, the cloud metadata service among them
        "169.254.169.254",
        "169.254.0.1",
        "fe80::1",
        "febf::1",
        // unique local
        "fc00::1",
        "fd12:3456::1",
        // multicast
        "224.0.0.1",
        "239.255.255.250",
        "ff02::1",
        // unspecified and 0/8
        "0.0.0.0",
        "0.1.2.3",
        "::",
        // broadcast and 240/4
        "255.255.255.255",
        "240.0.0.1",
        "250.1.2.3",
        // carrier-grade NAT
        "100.64.0.1",
        "100.127.255.255",
        // documentation
        "192.0.2.1",
        "198.51.100.7",
        "203.0.113.9",
        "2001:db8::1",
        // benchmarking
        "198.18.0.1",
        "198.19.255.255",
        "2001:2::1",
        // IETF protocol assignments, deprecated site-local, discard
        "192.0.0.8",
        "fec0::1",
        "100::1",
        // IPv4-mapped and IPv4-compatible forms of the above
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::ffff:169.254.169.254",
        "::ffff:192.168.1.1",
        "::ffff:0.0.0.0",
        "::127.0.0.1",
        "::10.0.0.1",
        "::169.254.169.254",
        // NAT64 and 6to4 forms of non-public IPv4 addresses
        "64:ff9b::7f00:1",
        "64:ff9b::a9fe:a9fe",
        "2002:7f00:1::1",
        "2002:a00:1::",
    ];

    const PUBLIC: &[&str] = &[
        "1.1.1.1",
        "8.8.8.8",
        "93.184.216.34",
        "9.255.255.255",
        "11.0.0.0",
        "172.15.255.255",
        "172.32.0.0",
        "192.167.255.255",
        "192.169.0.0",
        "100.63.255.255",
        "100.128.0.0",
        "169.253.255.255",
        "198.17.255.255",
        "198.20.0.0",
        "223.255.255.255",
        "192.0.1.1",
        "192.0.3.1",
        "2606:4700:4700::1111",
        "2a00:1450:4007:80e::200e",
        "::ffff:8.8.8.8",
        "64:ff9b::808:808",
        "2002:808:808::1",
        "2001:db9::1",
    ];

    #[test]
    fn every_non_public_range_is_refused_by_default() {
        let policy = EgressPolicy::default();
        for text in REFUSED {
            assert!(special_range(ip(text)).is_some(), "{text} is special");
            let refused = policy.check_address(&ip(text).to_string(), ip(text));
            assert!(
                matches!(refused, Err(Refusal::Address { .. })),
                "{text}: {refused:?}"
            );
            assert_eq!(
                policy.check_host(Host::Ip(ip(text))).map(|_| ()),
                refused,
                "{text} as a literal"
            );
        }
    }

    #[test]
    fn public_unicast_addresses_are_allowed() {
        let policy = EgressPolicy::default();
        for text in PUBLIC {
            assert_eq!(special_range(ip(text)), None, "{text}");
            assert_eq!(policy.check_address("h", ip(text)), Ok(()), "{text}");
        }
    }

    #[test]
    fn only_https_is_allowed_unless_plain_http_is() {
        let production = EgressPolicy::default();
        assert_eq!(production.check_scheme("https"), Ok(()));
        assert_eq!(production.check_scheme("http"), Err(Refusal::PlainHttp));
        assert_eq!(production.check_scheme("ftp"), Err(Refusal::PlainHttp));
        let development = EgressPolicy {
            allow_http: true,
            ..Default::default()
        };
        assert_eq!(development.check_scheme("http"), Ok(()));
        assert_eq!(development.check_scheme("ftp"), Err(Refusal::PlainHttp));
    }

    #[test]
    fn localhost_names_are_refused_without_resolution() {
        let policy = EgressPolicy::default();
        for name in [
            "localhost",
            "LOCALHOST",
            "localhost.",
            "a.localhost",
            "x.y.Localhost",
        ] {
            assert!(
                matches!(
                    policy.check_host(Host::Name(name)),
                    Err(Refusal::Localhost { .. })
                ),
                "{name}"
            );
            assert!(policy.allowed_addresses(name, vec![ip("8.8.8.8")]).is_err());
        }
        for name in ["shop.example", "localhost.shop.example", "mylocalhost"] {
            assert_eq!(
                policy.check_host(Host::Name(name)),
                Ok(HostCheck::Resolve),
                "{name}"
            );
        }
    }

    #[test]
    fn a_name_resolving_to_loopback_is_refused_at_registration_and_connection() {
        let policy = EgressPolicy::default();
        // As /etc/hosts or a rebinding DNS server would answer.
        let loopback = vec![ip("127.0.0.1")];
        assert!(matches!(
            policy.check_resolved("rebind.example", &loopback),
            Err(Refusal::Address {
                range: "loopback",
                ..
            })
        ));
        assert!(matches!(
            policy.allowed_addresses("rebind.example", loopback),
            Err(Refusal::Address {
                range: "loopback",
                ..
            })
        ));
    }

    #[test]
    fn one_bad_address_refuses_a_registration_and_is_dropped_at_connection() {
        let policy = EgressPolicy::default();
        let mixed = vec![ip("93.184.216.34"), ip("10.0.0.1")];
        assert!(policy.check_resolved("shop.example", &mixed).is_err());
        assert_eq!(
            policy.allowed_addresses("shop.example", mixed),
            Ok(vec![ip("93.184.216.34")])
        );
        assert_eq!(
            policy.check_resolved("shop.example", &[]),
            Err(Refusal::Unresolved {
                host: "shop.example".into()
            })
        );
        assert!(policy.allowed_addresses("shop.example", vec![]).is_err());
    }

    #[test]
    fn the_allow_list_admits_its_networks_and_hosts_only() {
        let policy = EgressPolicy {
            allow_http: false,
            allow: ["10.1.0.0/16", "127.0.0.1", "hooks.internal"]
                .iter()
                .map(|e| e.parse().expect("entry"))
                .collect(),
        };
        assert_eq!(policy.check_address("h", ip("10.1.2.3")), Ok(()));
        assert_eq!(policy.check_address("h", ip("127.0.0.1")), Ok(()));
        assert_eq!(policy.check_address("h", ip("::ffff:127.0.0.1")), Ok(()));
        assert!(policy.check_address("h", ip("10.2.0.1")).is_err());
        assert!(policy.check_address("h", ip("127.0.0.2")).is_err());
        assert!(policy.check_address("h", ip("169.254.169.254")).is_err());
        assert_eq!(
            policy.check_host(Host::Name("Hooks.Internal")),
            Ok(HostCheck::Allowed)
        );
        assert_eq!(
            policy.allowed_addresses("hooks.internal", vec![ip("192.168.0.9")]),
            Ok(vec![ip("192.168.0.9")])
        );
        assert!(
            policy
                .allowed_addresses("other.internal", vec![ip("192.168.0.9")])
                .is_err()
        );
        // A listed network does not open `localhost` by name.
        assert!(policy.check_host(Host::Name("localhost")).is_err());
    }

    #[test]
    fn allow_entries_parse_networks_addresses_and_names() {
        assert_eq!(
            "10.1.2.3/16".parse::<AllowEntry>(),
            Ok(AllowEntry::Network("10.1.0.0/16".parse().expect("net")))
        );
        assert_eq!(
            " ::1 ".parse::<AllowEntry>(),
            Ok(AllowEntry::Network("::1/128".parse().expect("net")))
        );
        assert_eq!(
            "Hooks.Internal".parse::<AllowEntry>(),
            Ok(AllowEntry::Host("hooks.internal".into()))
        );
        for bad in ["", "10.0.0.0/33", "a..b", "http://x", "1.2.3", "x/8"] {
            assert!(bad.parse::<AllowEntry>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn development_allows_http_and_this_machine_only() {
        let policy = EgressPolicy::default().with_development_allowances();
        assert_eq!(policy.check_scheme("http"), Ok(()));
        assert_eq!(policy.check_address("h", ip("127.0.0.1")), Ok(()));
        assert_eq!(policy.check_address("h", ip("::1")), Ok(()));
        assert_eq!(
            policy.check_host(Host::Name("localhost")),
            Ok(HostCheck::Allowed)
        );
        assert!(policy.check_address("h", ip("169.254.169.254")).is_err());
        assert!(policy.check_address("h", ip("10.0.0.1")).is_err());
        assert!(policy.check_address("h", ip("192.168.1.1")).is_err());
    }
}
