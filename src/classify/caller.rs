//! Caller identity: which configured caller a statement belongs to.
//!
//! Owns: `CallerRule`, `Cidr`, and `CallerMatcher::resolve`, which turns (comment tags,
//! `application_name`, user, client address) into a bounded `CallerId`. Tag *parsing* lives in
//! `tags.rs`. This file must not read config files or SQL text, and `resolve` must not
//! allocate: it runs for every statement.
//!
//! Resolution (DESIGN §4): a rule matches when every field it sets matches (all listed tags
//! present with equal values, `application_name` equal, user equal, address inside the CIDR).
//! Each rule is filed under the most specific field it sets — tags, then application_name,
//! then user, then client_cidr — and the tiers are tried in that order, rules in config order
//! within a tier. So the first tag rule that matches wins over any application_name rule, even
//! one earlier in the file; a rule `{tags: [service: billing], user: app}` is a tag rule that
//! additionally requires the user. A rule that sets no field is matched *by its name*
//! ([`CallerRule::by_name`], the design article's callers without `match`): in the tag tier
//! when the `service` tag equals the name, in the application tier when `application_name`
//! does, in the user tier when the login user does. Unmatched traffic is the `default`
//! caller, id `rules.len()`.
//! Tag keys compare ASCII-case-insensitively (extraction lowercases them); values, names and
//! users compare exactly. IPv4-mapped IPv6 client addresses match IPv4 networks.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::Arc;

/// Index into the matcher's rules; `rules.len()` is the default caller.
pub type CallerId = u16;

/// Name of the caller that unmatched traffic gets.
pub const DEFAULT_CALLER_NAME: &str = "default";

/// One configured caller and its match conditions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallerRule {
    pub name: String,
    pub tags: Vec<(String, String)>,
    pub application_name: Option<String>,
    pub user: Option<String>,
    pub client_cidr: Option<Cidr>,
}

impl CallerRule {
    /// A rule that sets no match field: it is matched by its name (the `service` comment tag,
    /// `application_name` or the login user equal to it).
    pub fn by_name(&self) -> bool {
        self.tags.is_empty()
            && self.application_name.is_none()
            && self.user.is_none()
            && self.client_cidr.is_none()
    }
}

/// The comment tag that names a caller matched by name.
pub const NAME_TAG: &str = "service";

/// An IPv4 or IPv6 network. Host bits in the input are masked off (`10.1.2.3/8` is
/// `10.0.0.0/8`); a bare address is a single host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

/// Why a CIDR string was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CidrError {
    input: String,
    reason: String,
}

impl fmt::Display for CidrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid CIDR `{}`: {}", self.input, self.reason)
    }
}

impl std::error::Error for CidrError {}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason: String| CidrError {
            input: s.to_owned(),
            reason,
        };
        let (addr, prefix) = match s.trim().split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s.trim(), None),
        };
        let ip: IpAddr = addr
            .parse()
            .map_err(|_| err(format!("`{addr}` is not an IPv4 or IPv6 address")))?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p.parse::<u8>().map_err(|_| {
                err(format!(
                    "prefix length `{p}` is not a number from 0 to {max}"
                ))
            })?,
        };
        if prefix > max {
            let family = if ip.is_ipv4() { "IPv4" } else { "IPv6" };
            return Err(err(format!(
                "prefix length {prefix} is longer than {max} bits for {family}"
            )));
        }
        Ok(Cidr {
            network: mask(ip, prefix),
            prefix,
        })
    }
}

fn mask(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let m = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4((u32::from(v4) & m).into())
        }
        IpAddr::V6(v6) => {
            let m = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6((u128::from(v6) & m).into())
        }
    }
}

impl Cidr {
    pub fn network(&self) -> IpAddr {
        self.network
    }

    pub fn prefix_len(&self) -> u8 {
        self.prefix
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match (self.network, ip) {
            (IpAddr::V4(_), IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => return false,
            },
            _ => ip,
        };
        match (self.network, ip) {
            (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_)) => {
                mask(ip, self.prefix) == self.network
            }
            _ => false,
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl serde::Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The most specific field a rule sets; tiers are tried in this order.
#[derive(Clone, Copy)]
enum Tier {
    Tags = 0,
    Application = 1,
    User = 2,
    Address = 3,
}

/// Resolves statements to callers. Build once per config; `resolve` is allocation-free.
#[derive(Debug, Clone)]
pub struct CallerMatcher {
    rules: Vec<CallerRule>,
    /// The callers' names by id, the default's last: shared, so that a statistics entry
    /// holding one recognizes it again by address (`observe::stats`).
    names: Vec<Arc<str>>,
    /// Rule indices per tier, in config order.
    tiers: [Vec<CallerId>; 4],
}

impl CallerMatcher {
    /// At most `CallerId::MAX - 1` rules are used (the last id is the default); config
    /// validation should bound the list far below that.
    pub fn new(mut rules: Vec<CallerRule>) -> Self {
        rules.truncate(usize::from(CallerId::MAX - 1));
        let mut tiers: [Vec<CallerId>; 4] = Default::default();
        for (i, rule) in rules.iter_mut().enumerate() {
            for (k, _) in &mut rule.tags {
                k.make_ascii_lowercase();
            }
            // `i` < CallerId::MAX by the truncate above.
            let id = CallerId::try_from(i).unwrap_or(CallerId::MAX);
            if rule.by_name() {
                for tier in [Tier::Tags, Tier::Application, Tier::User] {
                    tiers[tier as usize].push(id);
                }
                continue;
            }
            let tier = if !rule.tags.is_empty() {
                Tier::Tags
            } else if rule.application_name.is_some() {
                Tier::Application
            } else if rule.user.is_some() {
                Tier::User
            } else if rule.client_cidr.is_some() {
                Tier::Address
            } else {
                continue;
            };
            tiers[tier as usize].push(id);
        }
        let names = rules
            .iter()
            .map(|r| Arc::from(r.name.as_str()))
            .chain([Arc::from(DEFAULT_CALLER_NAME)])
            .collect();
        CallerMatcher {
            rules,
            names,
            tiers,
        }
    }

    pub fn resolve(
        &self,
        tags: &[(String, String)],
        application_name: Option<&str>,
        user: &str,
        addr: Option<IpAddr>,
    ) -> CallerId {
        let tiers = [
            !tags.is_empty(),
            application_name.is_some(),
            true,
            addr.is_some(),
        ];
        for (tier, ids) in self.tiers.iter().enumerate() {
            if !tiers[tier] {
                continue;
            }
            for &id in ids {
                if let Some(rule) = self.rules.get(usize::from(id))
                    && if rule.by_name() {
                        named(rule, tier, tags, application_name, user)
                    } else {
                        matches(rule, tags, application_name, user, addr)
                    }
                {
                    return id;
                }
            }
        }
        self.default_id()
    }

    /// Caller name; `"default"` for the default id (and any out-of-range id).
    pub fn name(&self, id: CallerId) -> &str {
        self.name_arc(id)
    }

    /// [`CallerMatcher::name`], shared (what the statistics keep).
    pub fn name_arc(&self, id: CallerId) -> &Arc<str> {
        let last = self.names.len() - 1;
        &self.names[usize::from(id).min(last)]
    }

    /// Number of callers including the default.
    pub fn len(&self) -> usize {
        self.rules.len() + 1
    }

    /// Never true: the default caller always exists.
    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn default_id(&self) -> CallerId {
        CallerId::try_from(self.rules.len()).unwrap_or(CallerId::MAX)
    }

    /// Id of the first rule with this name; the default id for `"default"`.
    pub fn id_of(&self, name: &str) -> Option<CallerId> {
        match self.rules.iter().position(|r| r.name == name) {
            Some(i) => CallerId::try_from(i).ok(),
            None if name == DEFAULT_CALLER_NAME => Some(self.default_id()),
            None => None,
        }
    }

    pub fn rules(&self) -> &[CallerRule] {
        &self.rules
    }
}

/// A by-name rule in one tier: the identity that tier reads equals the rule's name.
fn named(
    rule: &CallerRule,
    tier: usize,
    tags: &[(String, String)],
    application_name: Option<&str>,
    user: &str,
) -> bool {
    let name = rule.name.as_str();
    match tier {
        t if t == Tier::Tags as usize => tags.iter().any(|(k, v)| k == NAME_TAG && v == name),
        t if t == Tier::Application as usize => application_name == Some(name),
        t if t == Tier::User as usize => user == name,
        _ => false,
    }
}

fn matches(
    rule: &CallerRule,
    tags: &[(String, String)],
    application_name: Option<&str>,
    user: &str,
    addr: Option<IpAddr>,
) -> bool {
    rule.tags
        .iter()
        .all(|(k, v)| tags.iter().any(|(tk, tv)| tk == k && tv == v))
        && rule
            .application_name
            .as_deref()
            .is_none_or(|a| application_name == Some(a))
        && rule.user.as_deref().is_none_or(|u| u == user)
        && rule
            .client_cidr
            .is_none_or(|c| addr.is_some_and(|ip| c.contains(ip)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(name: &str) -> CallerRule {
        CallerRule {
            name: name.to_owned(),
            tags: Vec::new(),
            application_name: None,
            user: None,
            client_cidr: None,
        }
    }

    fn t(k: &str, v: &str) -> (String, String) {
        (k.to_owned(), v.to_owned())
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or(IpAddr::V4(0.into()))
    }

    /// A tag bound to an identity: the tag alone, from another user or address, is not the
    /// caller (the default is), so a client cannot claim a critical caller by writing its tag.
    #[test]
    fn a_tag_bound_to_a_user_or_network_needs_both() {
        let m = CallerMatcher::new(vec![
            CallerRule {
                tags: vec![t("service", "billing")],
                user: Some("payments".into()),
                ..rule("pay")
            },
            CallerRule {
                tags: vec![t("service", "ops")],
                client_cidr: Some("10.0.0.0/8".parse().expect("cidr")),
                ..rule("ops")
            },
        ]);
        let billing = [t("service", "billing")];
        let ops = [t("service", "ops")];
        let inside: IpAddr = "10.1.2.3".parse().expect("ip");
        let outside: IpAddr = "192.168.1.1".parse().expect("ip");
        assert_eq!(m.name(m.resolve(&billing, None, "payments", None)), "pay");
        assert_eq!(m.name(m.resolve(&billing, None, "app", None)), "default");
        assert_eq!(m.name(m.resolve(&ops, None, "app", Some(inside))), "ops");
        assert_eq!(
            m.name(m.resolve(&ops, None, "app", Some(outside))),
            "default"
        );
    }

    #[test]
    fn cidr_parse_and_contains() {
        let c: Cidr = "10.1.2.3/8".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.to_string(), "10.0.0.0/8");
        assert!(c.contains(ip("10.200.0.1")));
        assert!(!c.contains(ip("11.0.0.1")));
        assert!(c.contains(ip("::ffff:10.9.9.9")));
        assert!(!c.contains(ip("::1")));
        let host: Cidr = "192.168.1.5".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(host.prefix_len(), 32);
        assert!(host.contains(ip("192.168.1.5")) && !host.contains(ip("192.168.1.6")));
        let v6: Cidr = "fd00::/8".parse().unwrap_or_else(|e| panic!("{e}"));
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fe80::1")));
        let all: Cidr = "0.0.0.0/0".parse().unwrap_or_else(|e| panic!("{e}"));
        assert!(all.contains(ip("1.2.3.4")));
        for (bad, msg) in [
            (
                "10.0.0.0/33",
                "prefix length 33 is longer than 32 bits for IPv4",
            ),
            (
                "::/129",
                "prefix length 129 is longer than 128 bits for IPv6",
            ),
            ("10.0.0/8", "is not an IPv4 or IPv6 address"),
            ("10.0.0.0/x", "is not a number"),
            ("", "is not an IPv4 or IPv6 address"),
        ] {
            match bad.parse::<Cidr>() {
                Ok(c) => panic!("{bad} parsed as {c}"),
                Err(e) => assert!(e.to_string().contains(msg), "{e}"),
            }
        }
    }

    #[test]
    fn resolution_order_is_tags_app_user_address_default() {
        let cidr: Cidr = "10.0.0.0/8".parse().unwrap_or_else(|e| panic!("{e}"));
        let rules = vec![
            CallerRule {
                client_cidr: Some(cidr),
                ..rule("by_addr")
            },
            CallerRule {
                user: Some("app".into()),
                ..rule("by_user")
            },
            CallerRule {
                application_name: Some("psql".into()),
                ..rule("by_app")
            },
            CallerRule {
                tags: vec![t("Service", "billing")],
                ..rule("billing")
            },
            CallerRule {
                tags: vec![t("service", "billing"), t("route", "/pay")],
                user: Some("app".into()),
                ..rule("billing_pay")
            },
            rule("matched_by_name"),
        ];
        let m = CallerMatcher::new(rules);
        assert_eq!(m.len(), 7);
        let name =
            |tags: &[(String, String)], app, user, addr| m.name(m.resolve(tags, app, user, addr));
        let billing = [t("service", "billing"), t("route", "/pay")];
        // First tag rule in config order wins, even over a more specific later one.
        assert_eq!(
            name(&billing, Some("psql"), "app", Some(ip("10.0.0.1"))),
            "billing"
        );
        // Tag beats application_name, which beats user, which beats address.
        assert_eq!(
            name(
                &[t("service", "other")],
                Some("psql"),
                "app",
                Some(ip("10.0.0.1"))
            ),
            "by_app"
        );
        assert_eq!(
            name(&[], Some("other"), "app", Some(ip("10.0.0.1"))),
            "by_user"
        );
        assert_eq!(name(&[], None, "someone", Some(ip("10.0.0.1"))), "by_addr");
        assert_eq!(
            name(&[], None, "someone", Some(ip("::ffff:10.0.0.1"))),
            "by_addr"
        );
        assert_eq!(
            name(&[], None, "someone", Some(ip("192.168.0.1"))),
            "default"
        );
        assert_eq!(name(&[], None, "someone", None), "default");
        assert_eq!(m.resolve(&[], None, "x", None), m.default_id());
        assert_eq!(m.id_of("default"), Some(6));
        assert_eq!(m.id_of("by_app"), Some(2));
        assert_eq!(m.name(999), "default");
    }

    /// The design article's callers have no `match`: a caller is then the client whose
    /// `service` tag, application_name or login user is its name, in the usual tier order.
    #[test]
    fn a_caller_without_match_is_matched_by_its_name() {
        let m = CallerMatcher::new(vec![
            CallerRule {
                application_name: Some("service_analytics".into()),
                ..rule("by_app")
            },
            rule("service_payment"),
            rule("service_analytics"),
        ]);
        let name = |tags: &[(String, String)], app, user| m.name(m.resolve(tags, app, user, None));
        let pay = [t("service", "service_payment")];
        assert_eq!(name(&pay, None, "app"), "service_payment");
        assert_eq!(name(&[], Some("service_payment"), "app"), "service_payment");
        assert_eq!(name(&[], None, "service_payment"), "service_payment");
        // The tag tier comes first: a by-name tag wins over an explicit application rule.
        let analytics = [t("service", "service_analytics")];
        assert_eq!(
            name(&analytics, Some("service_analytics"), "app"),
            "service_analytics"
        );
        // Within the application tier config order decides.
        assert_eq!(name(&[], Some("service_analytics"), "app"), "by_app");
        // Other tag keys and near names do not match.
        assert_eq!(
            name(&[t("team", "service_payment")], None, "app"),
            "default"
        );
        assert_eq!(name(&[], Some("service_payment2"), "app"), "default");
    }

    #[test]
    fn multi_field_rule_needs_all_fields() {
        let m = CallerMatcher::new(vec![
            CallerRule {
                tags: vec![t("service", "billing")],
                user: Some("app".into()),
                ..rule("billing_app")
            },
            CallerRule {
                tags: vec![t("service", "billing")],
                ..rule("billing")
            },
        ]);
        let tags = [t("service", "billing")];
        assert_eq!(m.name(m.resolve(&tags, None, "app", None)), "billing_app");
        assert_eq!(m.name(m.resolve(&tags, None, "other", None)), "billing");
        assert_eq!(
            m.name(m.resolve(&[t("service", "Billing")], None, "app", None)),
            "default"
        );
    }
}
