//! The ground truth: effects the provider actually made.
//!
//! Only effects count, never requests: a replayed response, a 503 before the
//! effect or a 409 adds nothing, while a lost response after the effect does.
//! Tests compare cobro's view of the world against this.

use std::collections::{BTreeMap, HashMap};

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
    /// Succeeded refunds.
    pub refunds: u64,
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
    /// References with more than one charge: the double charges cobro must
    /// never cause.
    pub duplicate_charge_references: Vec<String>,
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
}

/// Which counter an effect bumps.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Effect {
    Charge,
    Decline,
    Capture,
    Void,
    Refund,
}

impl Effects {
    fn bump(&mut self, effect: Effect) {
        let counter = match effect {
            Effect::Charge => &mut self.charges,
            Effect::Decline => &mut self.declines,
            Effect::Capture => &mut self.captures,
            Effect::Void => &mut self.voids,
            Effect::Refund => &mut self.refunds,
        };
        *counter += 1;
    }
}

/// The live ledger. Hash maps on the hot path; sorted only when a snapshot is
/// taken, which is rare.
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

    pub(crate) fn snapshot(&self) -> Ledger {
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
