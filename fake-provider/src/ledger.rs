//! The ground truth: effects the provider actually made.
//!
//! Only effects count, never requests: a replayed response, a 503 before the
//! effect or a 409 adds nothing, while a lost response after the effect does.
//! Tests compare cobro's view of the world against this.
//!
//! Besides the counts, a snapshot lists every charge and refund made, with
//! its caller, amounts, metadata and current state, so a test can tell whose
//! attempt a charge was and whether one intent was charged twice.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// Counts of effects made.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Effects {
    /// Money-moving charges (created `authorized` or `captured`).
    pub charges: u64,
    /// Charges refused with 402; they move no money, so they are kept apart
    /// from `charges`.
    pub declines: u64,
    /// Captures of an authorisation (not charges created with `capture: true`).
    pub captures: u64,
    /// Voided authorisations.
    pub voids: u64,
    /// Succeeded refunds (a refund that failed later still counts here).
    pub refunds: u64,
    /// Refunds that failed after they succeeded: their money went back to
    /// the merchant.
    #[serde(default)]
    pub refund_failures: u64,
}

/// A charge the provider made (declined ones included), in its current state.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct LedgerCharge {
    /// `ch_...`.
    pub id: String,
    /// The bearer token that created it.
    pub caller: String,
    /// The merchant's reference.
    pub reference: String,
    /// The merchant's metadata.
    pub metadata: BTreeMap<String, String>,
    /// Authorised amount in minor units.
    pub amount: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// `automatic` or `manual`.
    pub capture_method: String,
    /// Current status: `processing` (a `processing` fault's charge, not
    /// final yet, counted nowhere in the totals), `authorized`, `captured`,
    /// `declined` or `voided`.
    pub status: String,
    /// Why it was declined (the fake dialect's code: `card_declined`,
    /// `insufficient_funds`, `try_again_later`); absent unless `declined`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decline_code: Option<String>,
    /// Minor units captured so far.
    pub amount_captured: i64,
    /// Minor units refunded so far.
    pub amount_refunded: i64,
    /// The idempotency key it was created with (without the caller), if any.
    pub idempotency_key: Option<String>,
    /// Virtual time of creation.
    pub created: DateTime<Utc>,
}

impl LedgerCharge {
    /// Whether money moved (or was held): every status but `declined`. A
    /// charge still `processing` counts: it may yet move money, and a test
    /// asking about double charges must not miss one that is only pending.
    fn moves_money(&self) -> bool {
        self.status != "declined"
    }
}

/// A refund the provider made.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct LedgerRefund {
    /// `re_...`.
    pub id: String,
    /// The bearer token that created it.
    pub caller: String,
    /// The refunded charge's id.
    pub charge: String,
    /// The refund's own reference.
    pub reference: String,
    /// The refund's metadata.
    pub metadata: BTreeMap<String, String>,
    /// Refunded minor units.
    pub amount: i64,
    /// The charge's currency.
    pub currency: String,
    /// `succeeded`.
    pub status: String,
    /// The idempotency key it was created with (without the caller), if any.
    pub idempotency_key: Option<String>,
    /// Virtual time of creation.
    pub created: DateTime<Utc>,
}

/// A snapshot of the ledger.
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct Ledger {
    /// Everything, all references and keys together.
    pub totals: Effects,
    /// Per merchant reference. Captures and voids count under the charge's
    /// reference, refunds under the refund's own reference.
    pub by_reference: BTreeMap<String, Effects>,
    /// Per idempotency key, whoever the caller was; effects of requests
    /// without a key are absent here.
    pub by_key: BTreeMap<String, Effects>,
    /// References with more than one charge, whoever the callers were: the
    /// double charges cobro must never cause when references are per intent.
    pub duplicate_charge_references: Vec<String>,
    /// Every charge made (declines included), in creation order, each in its
    /// current state.
    #[serde(default)]
    pub charges: Vec<LedgerCharge>,
    /// Every refund made, in creation order.
    #[serde(default)]
    pub refunds: Vec<LedgerRefund>,
    /// The Stripe dialect's PaymentIntents whose confirmation reached the
    /// card, each with the charge it made (its `latest_charge`): the
    /// PaymentIntent *is* that charge for the ledger. PaymentIntents that
    /// made no charge (`requires_action`, unconfirmed) are not here.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub payment_intents: BTreeMap<String, String>,
}

impl Ledger {
    /// The effects recorded for `reference` (all zero if none).
    pub fn for_reference(&self, reference: &str) -> Effects {
        self.by_reference
            .get(reference)
            .cloned()
            .unwrap_or_default()
    }

    /// The effects recorded for idempotency key `key` (all zero if none).
    pub fn for_key(&self, key: &str) -> Effects {
        self.by_key.get(key).cloned().unwrap_or_default()
    }

    /// The charge with id `id`, whoever made it.
    pub fn charge(&self, id: &str) -> Option<&LedgerCharge> {
        self.charges.iter().find(|charge| charge.id == id)
    }

    /// The charge made for the Stripe dialect's PaymentIntent `id` (its
    /// `latest_charge`), if its confirmation reached the card.
    pub fn charge_of_payment_intent(&self, id: &str) -> Option<&LedgerCharge> {
        self.charge(self.payment_intents.get(id)?)
    }

    /// Charges whose metadata has `key` set to `value`, in creation order.
    pub fn charges_with_metadata(&self, key: &str, value: &str) -> Vec<&LedgerCharge> {
        self.charges
            .iter()
            .filter(|charge| has_metadata(&charge.metadata, key, value))
            .collect()
    }

    /// Refunds whose metadata has `key` set to `value`, in creation order.
    pub fn refunds_with_metadata(&self, key: &str, value: &str) -> Vec<&LedgerRefund> {
        self.refunds
            .iter()
            .filter(|refund| has_metadata(&refund.metadata, key, value))
            .collect()
    }

    /// Refunds of charge `charge`, in creation order.
    pub fn refunds_of_charge(&self, charge: &str) -> Vec<&LedgerRefund> {
        self.refunds
            .iter()
            .filter(|refund| refund.charge == charge)
            .collect()
    }

    /// Money-moving (not declined) charges grouped by caller plus the values
    /// of `keys` in their metadata (charges missing any of the keys are left
    /// out); only groups with more than one charge, each in creation order,
    /// groups ordered by their first charge. With keys
    /// `["cobro_account", "cobro_intent"]` this is "one intent charged
    /// twice"; two merchants' charges under one reference are not a double
    /// charge. With no keys, every caller with more than one charge.
    pub fn double_charges(&self, keys: &[&str]) -> Vec<Vec<&LedgerCharge>> {
        let mut groups: Vec<Vec<&LedgerCharge>> = Vec::new();
        let mut positions: HashMap<(&str, Vec<&str>), usize> = HashMap::new();
        for charge in self.charges.iter().filter(|charge| charge.moves_money()) {
            let Some(values) = metadata_values(&charge.metadata, keys) else {
                continue;
            };
            match positions.entry((charge.caller.as_str(), values)) {
                Entry::Occupied(position) => groups[*position.get()].push(charge),
                Entry::Vacant(position) => {
                    position.insert(groups.len());
                    groups.push(vec![charge]);
                }
            }
        }
        groups.retain(|group| group.len() > 1);
        groups
    }
}

/// `metadata[key] == value`.
fn has_metadata(metadata: &BTreeMap<String, String>, key: &str, value: &str) -> bool {
    metadata.get(key).is_some_and(|found| found == value)
}

/// The values of `keys` in `metadata`, or `None` if any key is missing.
fn metadata_values<'m>(
    metadata: &'m BTreeMap<String, String>,
    keys: &[&str],
) -> Option<Vec<&'m str>> {
    keys.iter()
        .map(|key| metadata.get(*key).map(String::as_str))
        .collect()
}

/// Which counter an effect bumps.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Effect {
    Charge,
    Decline,
    Capture,
    Void,
    Refund,
    RefundFailure,
}

impl Effects {
    fn bump(&mut self, effect: Effect) {
        let counter = match effect {
            Effect::Charge => &mut self.charges,
            Effect::Decline => &mut self.declines,
            Effect::Capture => &mut self.captures,
            Effect::Void => &mut self.voids,
            Effect::Refund => &mut self.refunds,
            Effect::RefundFailure => &mut self.refund_failures,
        };
        *counter += 1;
    }
}

/// The live ledger's counts. Hash maps on the hot path; sorted only when a
/// snapshot is taken, which is rare. The charges and refunds of a snapshot
/// come from the provider's own store (one source of truth, no second copy
/// per request).
#[derive(Debug, Default)]
pub(crate) struct LedgerBook {
    totals: Effects,
    by_reference: HashMap<String, Effects>,
    by_key: HashMap<String, Effects>,
}

impl LedgerBook {
    pub(crate) fn record(&mut self, effect: Effect, reference: &str, key: Option<&str>) {
        self.totals.bump(effect);
        bump_entry(&mut self.by_reference, reference, effect);
        if let Some(key) = key {
            bump_entry(&mut self.by_key, key, effect);
        }
    }

    /// The counts plus the given charges and refunds (creation order).
    pub(crate) fn snapshot(
        &self,
        charges: Vec<LedgerCharge>,
        refunds: Vec<LedgerRefund>,
        payment_intents: BTreeMap<String, String>,
    ) -> Ledger {
        let by_reference: BTreeMap<_, _> = self
            .by_reference
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let duplicate_charge_references = by_reference
            .iter()
            .filter(|(_, effects)| effects.charges > 1)
            .map(|(reference, _)| reference.clone())
            .collect();
        Ledger {
            totals: self.totals.clone(),
            by_key: self
                .by_key
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            by_reference,
            duplicate_charge_references,
            charges,
            refunds,
            payment_intents,
        }
    }
}

/// Bumps `map[name]`, allocating the name only the first time it is seen.
fn bump_entry(map: &mut HashMap<String, Effects>, name: &str, effect: Effect) {
    match map.get_mut(name) {
        Some(effects) => effects.bump(effect),
        None => map.entry(name.to_owned()).or_default().bump(effect),
    }
}
