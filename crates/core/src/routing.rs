//! Routing across providers (docs/routing.md): which providers a payment
//! may go to, in which order, and why. Pure: the rules, the facts of the
//! payment and which circuits are open go in, a [`Route`] comes out, and
//! the store keeps it on the payment.
//!
//! A route is a *chain*: the payment's first attempt goes to its head, and
//! it moves to the next provider of the chain only on proof that its
//! attempt at the current one had no effect (the worker and the reconciler
//! decide that; [`Route::next_after`] only says where it would go). It
//! never moves backwards, so a payment crosses each provider at most once.

use crate::state::CaptureMethod;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// The most rules an account may have, and the longest chain.
pub const MAX_RULES: usize = 100;
pub const MAX_CHAIN: usize = 8;

/// An account's routing rules: the first rule whose conditions hold gives
/// the chain; `default` when none does.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSet {
    #[serde(default)]
    pub rules: Vec<Rule>,
    /// The chain of a payment no rule matches.
    pub default: Vec<String>,
}

/// One rule: when its conditions all hold, the payment goes to
/// `providers`, in that order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub name: String,
    #[serde(default)]
    pub when: Conditions,
    pub providers: Vec<String>,
    /// A split of traffic: the chain's head is drawn by these weights
    /// (from the payment's id, so a decision is reproducible), the other
    /// providers follow in `providers` order. Empty: no split.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub weights: BTreeMap<String, u32>,
}

/// What a payment must be for a rule to apply; an absent condition always
/// holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conditions {
    /// ISO 4217 codes (any case).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub currencies: Option<Vec<String>>,
    /// In minor units, both included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amount_min: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amount_max: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture_method: Option<CaptureMethod>,
    /// Payment method tokens, exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payment_methods: Option<Vec<String>>,
    /// Card brands, where the token names one ([`brand_of`]); a payment
    /// whose brand is unknown never matches a brand condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub brands: Option<Vec<String>>,
}

/// The card brands a token can name.
pub const BRANDS: &[&str] = &[
    "visa",
    "mastercard",
    "amex",
    "discover",
    "diners",
    "jcb",
    "unionpay",
];

/// The brand a payment method token names, where it names one: Stripe's
/// test tokens `pm_card_<brand>[_...]` (`pm_card_visa`,
/// `pm_card_mastercard_debit`). Any other token's brand is unknown to
/// cobro (it never sees card numbers).
pub fn brand_of(payment_method: &str) -> Option<&'static str> {
    let rest = payment_method.strip_prefix("pm_card_")?;
    let word = rest.split('_').next()?;
    BRANDS.iter().copied().find(|b| *b == word)
}

/// What routing knows of a payment.
#[derive(Clone, Copy, Debug)]
pub struct Facts<'a> {
    pub amount: i64,
    /// The currency's ISO code, upper case.
    pub currency: &'a str,
    pub capture_method: CaptureMethod,
    pub payment_method: &'a str,
}

/// Why a rule set is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("{0}")]
    Invalid(String),
}

fn invalid(text: impl Into<String>) -> RuleError {
    RuleError::Invalid(text.into())
}

impl RuleSet {
    /// Parses and validates a rule set (JSON) against the providers this
    /// deployment has.
    pub fn parse(json: &str, known: &dyn Fn(&str) -> bool) -> Result<Self, RuleError> {
        let set: RuleSet = serde_json::from_str(json).map_err(|e| invalid(e.to_string()))?;
        set.validate(known)?;
        Ok(set)
    }

    /// Every provider named exists, no chain is empty, repeats a provider
    /// or is longer than [`MAX_CHAIN`], weights name only providers of
    /// their rule and do not all weigh zero, amount ranges are ranges,
    /// currencies and brands exist, rule names are unique.
    pub fn validate(&self, known: &dyn Fn(&str) -> bool) -> Result<(), RuleError> {
        if self.rules.len() > MAX_RULES {
            return Err(invalid(format!("at most {MAX_RULES} rules")));
        }
        chain_ok("default", &self.default, known)?;
        let mut names = BTreeSet::new();
        for rule in &self.rules {
            let name = rule.name.as_str();
            if name.is_empty() || name.len() > 64 || name.chars().any(char::is_control) {
                return Err(invalid("a rule's name is 1 to 64 printable characters"));
            }
            if !names.insert(name) {
                return Err(invalid(format!("two rules are named {name:?}")));
            }
            chain_ok(name, &rule.providers, known)?;
            if !rule.weights.is_empty() {
                if let Some(p) = rule.weights.keys().find(|p| !rule.providers.contains(p)) {
                    return Err(invalid(format!(
                        "rule {name:?} weighs {p:?}, which is not one of its providers"
                    )));
                }
                if rule.weights.values().all(|w| *w == 0) {
                    return Err(invalid(format!("rule {name:?}: every weight is zero")));
                }
                if rule.weights.values().any(|w| *w > 1_000_000) {
                    return Err(invalid(format!(
                        "rule {name:?}: a weight is at most 1000000"
                    )));
                }
            }
            rule.when.validate(name)?;
        }
        Ok(())
    }

    /// The route of a payment: the first matching rule's chain (its head
    /// drawn by weight where it splits), else the default; providers whose
    /// circuit is open (`open`) go to the end of the chain, in order, so
    /// the first attempt goes to a closed one when there is one.
    pub fn route(&self, facts: &Facts<'_>, seed: u128, open: &dyn Fn(&str) -> bool) -> Route {
        let matched = self.rules.iter().find(|r| r.when.holds(facts));
        let (rule, mut chain, mut reason) = match matched {
            Some(rule) => {
                let (chain, split) = split(rule, seed);
                let reason = match split {
                    Some((weight, total)) => format!(
                        "rule {:?} matched; {} drawn by weight {weight} of {total}",
                        rule.name, chain[0]
                    ),
                    None => format!("rule {:?} matched", rule.name),
                };
                (Some(rule.name.clone()), chain, reason)
            }
            None => (
                None,
                self.default.clone(),
                "no rule matched: the account's default".to_owned(),
            ),
        };
        let skipped = demote_open(&mut chain, open);
        if !skipped.is_empty() {
            reason.push_str(&format!(
                "; circuit open, moved to the end: {}",
                skipped.join(", ")
            ));
        }
        Route {
            rule,
            chain,
            reason,
            moves: Vec::new(),
        }
    }
}

fn chain_ok(rule: &str, chain: &[String], known: &dyn Fn(&str) -> bool) -> Result<(), RuleError> {
    if chain.is_empty() {
        return Err(invalid(format!("{rule:?}: at least one provider")));
    }
    if chain.len() > MAX_CHAIN {
        return Err(invalid(format!("{rule:?}: at most {MAX_CHAIN} providers")));
    }
    let mut seen = BTreeSet::new();
    for p in chain {
        if !known(p) {
            return Err(invalid(format!(
                "{rule:?} names provider {p:?}, which this deployment does not have"
            )));
        }
        if !seen.insert(p) {
            return Err(invalid(format!("{rule:?} names provider {p:?} twice")));
        }
    }
    Ok(())
}

impl Conditions {
    fn validate(&self, rule: &str) -> Result<(), RuleError> {
        if let Some(codes) = &self.currencies {
            if codes.is_empty() {
                return Err(invalid(format!("rule {rule:?}: currencies is empty")));
            }
            if let Some(bad) = codes.iter().find(|c| crate::Currency::parse(c).is_err()) {
                return Err(invalid(format!(
                    "rule {rule:?}: {bad:?} is not a currency cobro supports"
                )));
            }
        }
        if self.amount_min.is_some_and(|a| a < 0) || self.amount_max.is_some_and(|a| a < 0) {
            return Err(invalid(format!("rule {rule:?}: amounts are not negative")));
        }
        if let (Some(min), Some(max)) = (self.amount_min, self.amount_max)
            && min > max
        {
            return Err(invalid(format!(
                "rule {rule:?}: amount_min {min} is above amount_max {max}"
            )));
        }
        if self.payment_methods.as_ref().is_some_and(Vec::is_empty) {
            return Err(invalid(format!("rule {rule:?}: payment_methods is empty")));
        }
        if let Some(brands) = &self.brands {
            if brands.is_empty() {
                return Err(invalid(format!("rule {rule:?}: brands is empty")));
            }
            if let Some(bad) = brands.iter().find(|b| !BRANDS.contains(&b.as_str())) {
                return Err(invalid(format!(
                    "rule {rule:?}: brand {bad:?} is not one of {}",
                    BRANDS.join(", ")
                )));
            }
        }
        Ok(())
    }

    fn holds(&self, facts: &Facts<'_>) -> bool {
        let currency = self
            .currencies
            .as_ref()
            .is_none_or(|c| c.iter().any(|c| c.eq_ignore_ascii_case(facts.currency)));
        let amount = self.amount_min.is_none_or(|m| facts.amount >= m)
            && self.amount_max.is_none_or(|m| facts.amount <= m);
        let capture = self
            .capture_method
            .is_none_or(|m| m == facts.capture_method);
        let method = self
            .payment_methods
            .as_ref()
            .is_none_or(|m| m.iter().any(|m| m == facts.payment_method));
        let brand = self.brands.as_ref().is_none_or(|brands| {
            brand_of(facts.payment_method).is_some_and(|b| brands.iter().any(|x| x == b))
        });
        currency && amount && capture && method && brand
    }
}

/// The rule's chain with its head drawn by weight, and (weight, total)
/// when it was.
fn split(rule: &Rule, seed: u128) -> (Vec<String>, Option<(u32, u64)>) {
    let total: u64 = rule.weights.values().map(|w| u64::from(*w)).sum();
    if total == 0 {
        return (rule.providers.clone(), None);
    }
    let mut ticket = (seed % u128::from(total)) as u64;
    // In `providers` order, so a split reads the way the rule is written.
    for p in &rule.providers {
        let w = u64::from(rule.weights.get(p).copied().unwrap_or(0));
        if ticket < w {
            let mut chain = vec![p.clone()];
            chain.extend(rule.providers.iter().filter(|x| *x != p).cloned());
            return (chain, Some((w as u32, total)));
        }
        ticket -= w;
    }
    (rule.providers.clone(), None)
}

/// Moves the providers whose circuit is open to the end, keeping order;
/// answers the ones moved.
fn demote_open(chain: &mut Vec<String>, open: &dyn Fn(&str) -> bool) -> Vec<String> {
    let (closed, opened): (Vec<String>, Vec<String>) =
        chain.drain(..).partition(|p| !open(p.as_str()));
    chain.extend(closed);
    chain.extend(opened.iter().cloned());
    // Only a demotion that changed who goes first is worth saying.
    if chain.first().is_some_and(|first| opened.contains(first)) {
        return Vec::new();
    }
    opened
}

/// A payment's routing decision and its history, kept on the payment
/// (`payments.route`, JSON) and shown in its API object and events.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    /// The rule that matched; `None`: the default chain.
    pub rule: Option<String>,
    /// The providers the payment may go to, in order; its first attempt
    /// went to the first.
    pub chain: Vec<String>,
    /// Why, in words.
    pub reason: String,
    /// Every move to the next provider, with its proof.
    #[serde(default)]
    pub moves: Vec<Move>,
}

/// One move of a payment from one provider to the next.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    pub from: String,
    pub to: String,
    /// The proof that the attempt at `from` had no effect.
    pub proof: String,
    /// The attempt proven without effect.
    pub attempt: String,
    pub at: String,
}

impl Route {
    /// A route of one provider, for an account without rules.
    pub fn single(provider: &str, reason: &str) -> Self {
        Route {
            rule: None,
            chain: vec![provider.to_owned()],
            reason: reason.to_owned(),
            moves: Vec::new(),
        }
    }

    /// Where a payment now at `current` would move: the first provider
    /// after it in the chain whose circuit is not open, else the first
    /// after it. `None` at the end of the chain (or for a provider not in
    /// it).
    pub fn next_after(&self, current: &str, open: &dyn Fn(&str) -> bool) -> Option<&str> {
        let at = self.chain.iter().position(|p| p == current)?;
        let rest = &self.chain[at + 1..];
        rest.iter()
            .find(|p| !open(p.as_str()))
            .or(rest.first())
            .map(String::as_str)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "null".to_owned())
    }

    pub fn from_json(text: &str) -> Option<Self> {
        serde_json::from_str(text).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(p: &str) -> bool {
        matches!(p, "a" | "b" | "c")
    }

    fn none_open(_: &str) -> bool {
        false
    }

    fn facts<'a>(amount: i64, currency: &'a str, pm: &'a str) -> Facts<'a> {
        Facts {
            amount,
            currency,
            capture_method: CaptureMethod::Automatic,
            payment_method: pm,
        }
    }

    fn set(json: &str) -> Result<RuleSet, RuleError> {
        RuleSet::parse(json, &known)
    }

    #[test]
    fn the_first_matching_rule_gives_the_chain_else_the_default() {
        let rules = set(r#"{"rules": [
            {"name": "eur-big", "when": {"currencies": ["eur"], "amount_min": 10000}, "providers": ["b", "a"]},
            {"name": "visa", "when": {"brands": ["visa"]}, "providers": ["c"]}
        ], "default": ["a", "b"]}"#)
        .expect("valid");
        let r = rules.route(&facts(20000, "EUR", "pm_card_visa"), 7, &none_open);
        assert_eq!(
            (r.rule.as_deref(), r.chain.clone()),
            (Some("eur-big"), vec!["b".into(), "a".into()])
        );
        let r = rules.route(&facts(500, "EUR", "pm_card_visa_debit"), 7, &none_open);
        assert_eq!(r.rule.as_deref(), Some("visa"));
        let r = rules.route(&facts(500, "EUR", "pm_card_mastercard"), 7, &none_open);
        assert_eq!((r.rule, r.chain), (None, vec!["a".into(), "b".into()]));
        // An unknown brand never matches a brand condition.
        let r = rules.route(&facts(500, "USD", "pm_123"), 7, &none_open);
        assert_eq!(r.rule, None);
    }

    #[test]
    fn a_split_draws_the_head_by_weight_and_keeps_the_rest_in_order() {
        let rules = set(
            r#"{"rules": [{"name": "split", "providers": ["a", "b", "c"],
            "weights": {"a": 3, "b": 1}}], "default": ["a"]}"#,
        )
        .expect("valid");
        let mut heads = BTreeMap::<String, u32>::new();
        for seed in 0..400u128 {
            let r = rules.route(&facts(1, "EUR", "x"), seed, &none_open);
            assert_eq!(r.chain.len(), 3);
            *heads.entry(r.chain[0].clone()).or_default() += 1;
            if r.chain[0] == "b" {
                assert_eq!(r.chain, ["b", "a", "c"]);
            }
        }
        assert_eq!(heads.get("a"), Some(&300));
        assert_eq!(heads.get("b"), Some(&100));
        assert_eq!(heads.get("c"), None);
    }

    #[test]
    fn open_circuits_go_to_the_end_and_are_skipped_when_moving_on() {
        let rules = set(r#"{"default": ["a", "b", "c"]}"#).expect("valid");
        let open = |p: &str| p == "a" || p == "b";
        let r = rules.route(&facts(1, "EUR", "x"), 0, &open);
        assert_eq!(r.chain, ["c", "a", "b"]);
        assert!(r.reason.contains("circuit open"), "{}", r.reason);
        let all = |_: &str| true;
        let r = rules.route(&facts(1, "EUR", "x"), 0, &all);
        assert_eq!(r.chain, ["a", "b", "c"]);
        let r = rules.route(&facts(1, "EUR", "x"), 0, &none_open);
        assert_eq!(r.next_after("a", &|p| p == "b"), Some("c"));
        assert_eq!(r.next_after("a", &all), Some("b"));
        assert_eq!(r.next_after("c", &none_open), None);
        assert_eq!(r.next_after("z", &none_open), None);
    }

    #[test]
    fn invalid_rule_sets_are_refused_with_a_reason() {
        for (json, says) in [
            (r#"{"default": []}"#, "at least one provider"),
            (r#"{"default": ["z"]}"#, "does not have"),
            (r#"{"default": ["a", "a"]}"#, "twice"),
            (r#"{"default": ["a"], "extra": 1}"#, "unknown field"),
            (
                r#"{"rules": [{"name": "r", "providers": ["a"], "weights": {"b": 1}}], "default": ["a"]}"#,
                "not one of its providers",
            ),
            (
                r#"{"rules": [{"name": "r", "providers": ["a"], "weights": {"a": 0}}], "default": ["a"]}"#,
                "zero",
            ),
            (
                r#"{"rules": [{"name": "r", "when": {"amount_min": 5, "amount_max": 1}, "providers": ["a"]}], "default": ["a"]}"#,
                "above",
            ),
            (
                r#"{"rules": [{"name": "r", "when": {"currencies": ["XXX1"]}, "providers": ["a"]}], "default": ["a"]}"#,
                "currency",
            ),
            (
                r#"{"rules": [{"name": "r", "when": {"brands": ["visaa"]}, "providers": ["a"]}], "default": ["a"]}"#,
                "brand",
            ),
            (
                r#"{"rules": [{"name": "r", "when": {"capture_method": "later"}, "providers": ["a"]}], "default": ["a"]}"#,
                "unknown variant",
            ),
            (
                r#"{"rules": [{"name": "r", "providers": ["a"]}, {"name": "r", "providers": ["b"]}], "default": ["a"]}"#,
                "two rules",
            ),
        ] {
            let e = set(json).expect_err(json);
            assert!(e.to_string().contains(says), "{json}: {e}");
        }
    }

    #[test]
    fn a_route_survives_its_json() {
        let mut r = Route::single("a", "the account's provider");
        r.moves.push(Move {
            from: "a".into(),
            to: "b".into(),
            proof: "never sent".into(),
            attempt: "x".into(),
            at: "2026-01-01T00:00:00Z".into(),
        });
        assert_eq!(Route::from_json(&r.to_json()), Some(r));
    }

    #[test]
    fn brands_are_read_from_tokens_that_name_them() {
        assert_eq!(brand_of("pm_card_visa"), Some("visa"));
        assert_eq!(brand_of("pm_card_mastercard_prepaid"), Some("mastercard"));
        assert_eq!(brand_of("pm_card_chargeDeclined"), None);
        assert_eq!(brand_of("tok_visa"), None);
    }
}
