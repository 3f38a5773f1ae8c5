//! Everything the provider knows, behind one lock, and the effects on it.
//!
//! Each effect is a plain synchronous method run with the lock held: it is
//! short (map inserts and one small serialisation) and never awaits, which is
//! what lets one `std::sync::Mutex` carry the whole provider.
//!
//! This is the one engine both dialects drive: an effect returns what it did
//! (or why it refused) as data, and each dialect renders that in its own
//! wire format. The ledger, search lag and the fake's webhook events are
//! recorded here, so they are the same whichever API caused the effect.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc::UnboundedSender;

use crate::clock::{VirtualClock, delta};
use crate::config::{Config, WebhookDialect, WebhookTarget};
use crate::faults::{FaultBook, Operation};
use crate::idempotency::KeyStore;
use crate::ledger::{Effect, Ledger, LedgerBook, LedgerCharge, LedgerRefund};
use crate::model::{
    CaptureMethod, Charge, ChargeParams, ChargeStatus, Decline, Refund, RefundParams, RefundStatus,
};
use crate::stripe::StripeBook;
use crate::webhooks::{Event, FakeEvent, FakeEventData, WebhookDelivery};

/// What the provider shares between the HTTP handlers, the control handle and
/// the webhook dispatcher.
#[derive(Debug)]
pub(crate) struct Shared {
    /// All mutable provider state; held briefly, never across an await.
    state: Mutex<State>,
    /// Virtual time, readable without the lock.
    pub(crate) clock: VirtualClock,
    /// Every webhook delivery attempt, for tests to wait on; separate from
    /// `state` so delivery bookkeeping never contends with requests.
    deliveries: Mutex<Vec<WebhookDelivery>>,
    /// The last API requests received, with their trace context.
    requests: Mutex<crate::trace::Requests>,
    /// First webhook retry delay.
    pub(crate) webhook_retry_base: Duration,
}

impl Shared {
    pub(crate) fn new(config: &Config, events: UnboundedSender<Event>) -> Self {
        Self {
            state: Mutex::new(State::new(config, events)),
            clock: VirtualClock::default(),
            deliveries: Mutex::new(Vec::new()),
            requests: Mutex::new(crate::trace::Requests::new()),
            webhook_retry_base: config.webhook_retry_base,
        }
    }

    /// Locks the state. A panic while holding the lock leaves the maps
    /// consistent enough for a test double, so poisoning is ignored rather
    /// than turning every later request into a panic.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn requests(&self) -> MutexGuard<'_, crate::trace::Requests> {
        self.requests.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn deliveries(&self) -> MutexGuard<'_, Vec<WebhookDelivery>> {
        self.deliveries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// A charge or refund plus who made it and when search may see it.
#[derive(Debug)]
pub(crate) struct Stored<T> {
    pub(crate) item: T,
    /// The bearer token that created it: the only caller that can read,
    /// search or change it.
    pub(crate) caller: String,
    /// The idempotency key it was created with (without the caller).
    pub(crate) key: Option<String>,
    /// Equal to creation time unless a `search_lag` rule hit it.
    pub(crate) searchable_at: DateTime<Utc>,
}

/// What the store's indexes need from a stored object. The three are fixed
/// when the object is created (no endpoint changes an object's id,
/// reference or metadata), so the indexes never go stale.
pub(crate) trait Resource {
    fn id(&self) -> &str;
    fn reference(&self) -> &str;
    fn metadata(&self) -> &BTreeMap<String, String>;
}

/// Charges and refunds (and the Stripe dialect's PaymentIntents) carry the
/// three fields under the same names.
macro_rules! resource {
    ($($kind:ty),+) => {$(
        impl $crate::state::Resource for $kind {
            fn id(&self) -> &str {
                &self.id
            }
            fn reference(&self) -> &str {
                &self.reference
            }
            fn metadata(&self) -> &std::collections::BTreeMap<String, String> {
                &self.metadata
            }
        }
    )+};
}
pub(crate) use resource;

resource!(Charge, Refund);

/// One kind of object in creation order, with the indexes that find it.
/// Inserting is O(1) per metadata entry: a push and hash-map updates. A
/// lookup by id, reference or one metadata entry reads only the objects
/// that carry it, however many the provider holds.
#[derive(Debug)]
pub(crate) struct Store<T> {
    /// Creation order: the ledger's order and, reversed, search's.
    items: Vec<Stored<T>>,
    /// Position of each id in `items`.
    by_id: HashMap<String, usize>,
    /// Positions per reference (all callers), in creation order.
    by_reference: HashMap<String, Vec<usize>>,
    /// Positions per caller, in creation order, for an unfiltered list.
    by_caller: HashMap<String, Vec<usize>>,
    /// Positions per metadata key and value (all callers), in creation
    /// order, for metadata search (the Stripe dialect's only search).
    by_metadata: HashMap<String, HashMap<String, Vec<usize>>>,
}

impl<T> Default for Store<T> {
    fn default() -> Self {
        Self {
            items: Vec::new(),
            by_id: HashMap::new(),
            by_reference: HashMap::new(),
            by_caller: HashMap::new(),
            by_metadata: HashMap::new(),
        }
    }
}

impl<T: Resource> Store<T> {
    pub(crate) fn insert(&mut self, stored: Stored<T>) {
        let position = self.items.len();
        self.by_id.insert(stored.item.id().to_owned(), position);
        index(&mut self.by_reference, stored.item.reference(), position);
        index(&mut self.by_caller, &stored.caller, position);
        for (key, value) in stored.item.metadata() {
            if !self.by_metadata.contains_key(key) {
                self.by_metadata.insert(key.clone(), HashMap::new());
            }
            if let Some(values) = self.by_metadata.get_mut(key) {
                index(values, value, position);
            }
        }
        self.items.push(stored);
    }

    /// The object `id` if `caller` made it: another caller's object is as
    /// missing as one that does not exist.
    pub(crate) fn get(&self, id: &str, caller: &str) -> Option<&Stored<T>> {
        let stored = self.items.get(*self.by_id.get(id)?)?;
        (stored.caller == caller).then_some(stored)
    }

    pub(crate) fn get_mut(&mut self, id: &str, caller: &str) -> Option<&mut Stored<T>> {
        let stored = self.items.get_mut(*self.by_id.get(id)?)?;
        (stored.caller == caller).then_some(stored)
    }

    /// Every object, whoever made it, in creation order.
    pub(crate) fn all(&self) -> impl Iterator<Item = &Stored<T>> {
        self.items.iter()
    }

    /// `caller`'s objects, newest first, with no regard to search lag (what
    /// a strongly consistent list sees).
    pub(crate) fn of_caller<'s>(&'s self, caller: &str) -> impl Iterator<Item = &'s T> + 's {
        self.by_caller
            .get(caller)
            .into_iter()
            .flatten()
            .rev()
            .filter_map(|&position| self.items.get(position))
            .map(|stored| &stored.item)
    }

    /// The positions a search has to read, in creation order: those with
    /// `reference` when one is given, else those with the metadata entry
    /// `metadata`, else every object of `caller`. Another caller's objects
    /// may be among them (the reference and metadata indexes are shared);
    /// [`Store::search`] filters them out.
    fn candidates(
        &self,
        caller: &str,
        reference: Option<&str>,
        metadata: Option<(&str, &str)>,
    ) -> &[usize] {
        let found = match (reference, metadata) {
            (Some(reference), _) => self.by_reference.get(reference),
            (None, Some((key, value))) => self.by_metadata.get(key).and_then(|v| v.get(value)),
            (None, None) => self.by_caller.get(caller),
        };
        found.map_or(&[], Vec::as_slice)
    }

    /// `caller`'s objects that `keep` accepts, newest first, skipping what a
    /// `search_lag` still hides. Only the objects with `reference`, or else
    /// with the metadata entry `metadata` (one of the search's filters), are
    /// read; with neither, the caller's objects are scanned.
    pub(crate) fn search<'s>(
        &'s self,
        caller: &'s str,
        reference: Option<&str>,
        metadata: Option<(&str, &str)>,
        now: DateTime<Utc>,
        keep: impl Fn(&T) -> bool + 's,
    ) -> impl Iterator<Item = &'s T> + 's {
        self.candidates(caller, reference, metadata)
            .iter()
            .rev()
            .filter_map(|&position| self.items.get(position))
            .filter(move |stored| stored.caller == caller && stored.searchable_at <= now)
            .map(|stored| &stored.item)
            .filter(move |item| keep(item))
    }
}

/// The provider's data.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) charges: Store<Charge>,
    pub(crate) refunds: Store<Refund>,
    /// What only the Stripe dialect knows: its PaymentIntents and their link
    /// to the engine's charges.
    pub(crate) stripe: StripeBook,
    pub(crate) keys: KeyStore,
    pub(crate) faults: FaultBook,
    /// Draws fault probabilities only, so the fault sequence depends on the
    /// seed and the order of matching requests, not on how many ids were made.
    pub(crate) fault_rng: StdRng,
    /// Makes ids and event ids: reproducible for a seed, and cheaper than a
    /// syscall per UUID.
    id_rng: StdRng,
    pub(crate) ledger: LedgerBook,
    pub(crate) webhook: Option<WebhookTarget>,
    /// Which dialect's events the target receives.
    pub(crate) webhook_dialect: WebhookDialect,
    events: UnboundedSender<Event>,
    /// Requests held by `hold_effect` faults, oldest first, until released.
    pub(crate) held: Vec<crate::pipeline::Held>,
}

/// What an effect needs to know about the request that causes it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ctx<'a> {
    /// Virtual time of the request.
    pub(crate) now: DateTime<Utc>,
    /// The bearer token: objects belong to the caller that created them.
    pub(crate) caller: &'a str,
    /// The idempotency key (without its caller), for the ledger.
    pub(crate) key: Option<&'a str>,
    /// The request's id (Stripe's `Request-Id`), for the events it causes.
    pub(crate) request_id: Option<&'a str>,
}

/// Why the engine refused to change a charge. Nothing was changed.
#[derive(Debug)]
pub(crate) enum Refused {
    /// No such charge for this caller.
    Missing,
    /// The charge's state forbids the change; the charge as it is.
    State(Box<Charge>),
    /// A capture amount that is not positive or above the authorized amount.
    Amount,
}

/// Why the engine refused a refund. Nothing was changed.
#[derive(Debug)]
pub(crate) enum RefundRefused {
    /// No such charge for this caller.
    Missing,
    /// The refund would exceed what was captured and not yet refunded.
    Exceeds { refundable: i64 },
}

impl State {
    fn new(config: &Config, events: UnboundedSender<Event>) -> Self {
        Self {
            charges: Store::default(),
            refunds: Store::default(),
            stripe: StripeBook::default(),
            keys: KeyStore::new(delta(config.retention)),
            faults: FaultBook::default(),
            fault_rng: StdRng::seed_from_u64(config.seed),
            // A different stream from the same seed.
            id_rng: StdRng::seed_from_u64(config.seed ^ 0x9e37_79b9_7f4a_7c15),
            ledger: LedgerBook::default(),
            webhook: config.webhook.clone(),
            webhook_dialect: config.webhook_dialect,
            events,
            held: Vec::new(),
        }
    }

    /// The ledger's counts plus every charge and refund in its current state.
    pub(crate) fn ledger_snapshot(&self) -> Ledger {
        let charges = self.charges.all().map(ledger_charge).collect();
        let refunds = self.refunds.all().map(ledger_refund).collect();
        self.ledger
            .snapshot(charges, refunds, self.stripe.payment_intent_charges())
    }

    /// A fresh id: `prefix` and a simple UUID from the seeded id stream.
    pub(crate) fn new_id(&mut self, prefix: &str) -> String {
        new_id(&mut self.id_rng, prefix)
    }

    /// Creates a charge (declined when its payment method always declines),
    /// records it in the ledger and emits its fake event. `searchable_at`
    /// comes from [`State::searchable_at`], drawn once by the caller.
    pub(crate) fn create_charge(
        &mut self,
        params: ChargeParams,
        ctx: Ctx<'_>,
        searchable_at: DateTime<Utc>,
    ) -> Charge {
        let decline = Decline::of(&params.payment_method);
        let status = match (decline, params.capture) {
            (Some(_), _) => ChargeStatus::Declined,
            (None, true) => ChargeStatus::Captured,
            (None, false) => ChargeStatus::Authorized,
        };
        let charge = Charge {
            id: self.new_id("ch_"),
            object: "charge".to_owned(),
            amount: params.amount,
            currency: params.currency,
            payment_method: params.payment_method,
            capture_method: CaptureMethod::from_capture(params.capture),
            reference: params.reference,
            metadata: params.metadata,
            status,
            amount_captured: if status == ChargeStatus::Captured {
                params.amount
            } else {
                0
            },
            amount_refunded: 0,
            created: ctx.now,
            sequence: 1,
        };
        let effect = if decline.is_some() {
            Effect::Decline
        } else {
            Effect::Charge
        };
        self.ledger.record(effect, &charge.reference, ctx.key);
        self.emit_charge(&charge, ctx.now);
        self.charges
            .insert(new_stored(charge.clone(), ctx, searchable_at));
        charge
    }

    /// Captures `amount` (default: all) of an authorized charge.
    pub(crate) fn capture(
        &mut self,
        id: &str,
        amount: Option<i64>,
        ctx: Ctx<'_>,
    ) -> Result<Charge, Refused> {
        self.change_charge(id, Effect::Capture, ctx, |charge| {
            if charge.status != ChargeStatus::Authorized {
                return Err(Refused::State(Box::new(charge.clone())));
            }
            let amount = amount.unwrap_or(charge.amount);
            if amount <= 0 || amount > charge.amount {
                return Err(Refused::Amount);
            }
            charge.status = ChargeStatus::Captured;
            charge.amount_captured = amount;
            Ok(())
        })
    }

    /// Voids an authorized charge.
    pub(crate) fn void(&mut self, id: &str, ctx: Ctx<'_>) -> Result<Charge, Refused> {
        self.change_charge(id, Effect::Void, ctx, |charge| {
            if charge.status != ChargeStatus::Authorized {
                return Err(Refused::State(Box::new(charge.clone())));
            }
            charge.status = ChargeStatus::Voided;
            Ok(())
        })
    }

    /// Applies `change` to the caller's charge; on success bumps its
    /// sequence, records the effect and emits the event. `change` must leave
    /// the charge untouched when it refuses.
    fn change_charge(
        &mut self,
        id: &str,
        effect: Effect,
        ctx: Ctx<'_>,
        change: impl FnOnce(&mut Charge) -> Result<(), Refused>,
    ) -> Result<Charge, Refused> {
        let Some(stored) = self.charges.get_mut(id, ctx.caller) else {
            return Err(Refused::Missing);
        };
        let charge = &mut stored.item;
        change(charge)?;
        charge.sequence += 1;
        let charge = charge.clone();
        self.ledger.record(effect, &charge.reference, ctx.key);
        self.emit_charge(&charge, ctx.now);
        Ok(charge)
    }

    /// Refunds `params.amount` of the caller's charge, never more than was
    /// captured and not yet refunded.
    pub(crate) fn refund(
        &mut self,
        params: RefundParams,
        ctx: Ctx<'_>,
        searchable_at: DateTime<Utc>,
    ) -> Result<Refund, RefundRefused> {
        let Some(stored) = self.charges.get_mut(&params.charge, ctx.caller) else {
            return Err(RefundRefused::Missing);
        };
        let charge = &mut stored.item;
        let refundable = charge.amount_captured - charge.amount_refunded;
        if params.amount > refundable {
            return Err(RefundRefused::Exceeds { refundable });
        }
        charge.amount_refunded += params.amount;
        charge.sequence += 1;
        let refund = Refund {
            id: new_id(&mut self.id_rng, "re_"),
            object: "refund".to_owned(),
            charge: params.charge,
            amount: params.amount,
            currency: charge.currency.clone(),
            reference: params.reference,
            metadata: params.metadata,
            status: RefundStatus::Succeeded,
            created: ctx.now,
            sequence: charge.sequence,
        };
        self.ledger
            .record(Effect::Refund, &refund.reference, ctx.key);
        if self.emits(WebhookDialect::Fake) {
            let event = FakeEventData::Refund(refund.clone());
            let reference = refund.reference.clone();
            self.emit("refund.succeeded", &reference, WebhookDialect::Fake, |id| {
                FakeEvent::render(id, "refund.succeeded", ctx.now, refund.sequence, &event)
            });
        }
        self.refunds
            .insert(new_stored(refund.clone(), ctx, searchable_at));
        Ok(refund)
    }

    /// The caller's charge `id`.
    pub(crate) fn charge(&self, id: &str, caller: &str) -> Option<&Charge> {
        self.charges.get(id, caller).map(|stored| &stored.item)
    }

    /// The caller's refund `id`.
    pub(crate) fn refund_of(&self, id: &str, caller: &str) -> Option<&Refund> {
        self.refunds.get(id, caller).map(|stored| &stored.item)
    }

    /// The reference a fault rule matches for a request of `caller` about
    /// charge `id`; none for another caller's charge, as for a missing one.
    pub(crate) fn charge_reference(&self, id: &str, caller: &str) -> Option<&str> {
        self.charges
            .get(id, caller)
            .map(|stored| stored.item.reference.as_str())
    }

    pub(crate) fn refund_reference(&self, id: &str, caller: &str) -> Option<&str> {
        self.refunds
            .get(id, caller)
            .map(|stored| stored.item.reference.as_str())
    }

    /// When an object being created now becomes visible to search: now,
    /// unless a `search_lag` rule for `created_by` (or `search`) fires.
    /// Draw it once per created object: a rule with `next` spends a unit.
    pub(crate) fn searchable_at(
        &mut self,
        created_by: Operation,
        reference: &str,
        now: DateTime<Utc>,
    ) -> DateTime<Utc> {
        match self
            .faults
            .search_lag(created_by, reference, &mut self.fault_rng)
        {
            Some(seconds) => {
                now + TimeDelta::seconds(i64::try_from(seconds).unwrap_or(i64::MAX / 1000))
            }
            None => now,
        }
    }

    fn emit_charge(&mut self, charge: &Charge, now: DateTime<Utc>) {
        if !self.emits(WebhookDialect::Fake) {
            return;
        }
        let kind = match charge.status {
            ChargeStatus::Authorized => "charge.authorized",
            ChargeStatus::Captured => "charge.captured",
            ChargeStatus::Declined => "charge.declined",
            ChargeStatus::Voided => "charge.voided",
        };
        let data = FakeEventData::Charge(charge.clone());
        self.emit(kind, &charge.reference, WebhookDialect::Fake, |id| {
            FakeEvent::render(id, kind, now, charge.sequence, &data)
        });
    }

    /// Whether events of `dialect` go anywhere now: a target is set and
    /// speaks that dialect. Check it before building an event's payload.
    pub(crate) fn emits(&self, dialect: WebhookDialect) -> bool {
        self.webhook.is_some() && self.webhook_dialect == dialect
    }

    /// Queues an event for the dispatcher if [`State::emits`] `dialect`;
    /// `render` gets the new event id and returns the body, serialised once
    /// here so every copy and retry sends the same bytes. `reference` is
    /// what webhook fault rules match.
    pub(crate) fn emit(
        &mut self,
        kind: &'static str,
        reference: &str,
        dialect: WebhookDialect,
        render: impl FnOnce(&str) -> Vec<u8>,
    ) {
        if !self.emits(dialect) {
            return;
        }
        let id = self.new_id("evt_");
        let body = render(&id);
        let event = Event {
            id,
            kind,
            reference: reference.to_owned(),
            dialect,
            body: body.into(),
        };
        // The receiver lives as long as the server; after shutdown there is
        // nobody to deliver to, so a failed send is correctly ignored.
        let _ = self.events.send(event);
    }
}

fn new_id(rng: &mut StdRng, prefix: &str) -> String {
    let uuid = uuid::Builder::from_random_bytes(rng.random()).into_uuid();
    format!("{prefix}{}", uuid.simple())
}

/// Wraps a new object with its caller and key from the request.
pub(crate) fn new_stored<T>(item: T, ctx: Ctx<'_>, searchable_at: DateTime<Utc>) -> Stored<T> {
    Stored {
        item,
        caller: ctx.caller.to_owned(),
        key: ctx.key.map(str::to_owned),
        searchable_at,
    }
}

/// Appends `position` to `map[name]`, allocating the name only the first
/// time it is seen.
fn index(map: &mut HashMap<String, Vec<usize>>, name: &str, position: usize) {
    match map.get_mut(name) {
        Some(positions) => positions.push(position),
        None => {
            map.insert(name.to_owned(), vec![position]);
        }
    }
}

fn ledger_charge(stored: &Stored<Charge>) -> LedgerCharge {
    let charge = &stored.item;
    LedgerCharge {
        id: charge.id.clone(),
        caller: stored.caller.clone(),
        reference: charge.reference.clone(),
        metadata: charge.metadata.clone(),
        amount: charge.amount,
        currency: charge.currency.clone(),
        capture_method: charge.capture_method.as_str().to_owned(),
        status: charge.status.as_str().to_owned(),
        amount_captured: charge.amount_captured,
        amount_refunded: charge.amount_refunded,
        idempotency_key: stored.key.clone(),
        created: charge.created,
    }
}

fn ledger_refund(stored: &Stored<Refund>) -> LedgerRefund {
    let refund = &stored.item;
    LedgerRefund {
        id: refund.id.clone(),
        caller: stored.caller.clone(),
        charge: refund.charge.clone(),
        reference: refund.reference.clone(),
        metadata: refund.metadata.clone(),
        amount: refund.amount,
        currency: refund.currency.clone(),
        status: refund.status.as_str().to_owned(),
        idempotency_key: stored.key.clone(),
        created: refund.created,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The smallest object the store can index.
    struct Doc {
        id: String,
        reference: String,
        metadata: BTreeMap<String, String>,
    }
    resource!(Doc);

    fn doc(i: usize, caller: &str) -> Stored<Doc> {
        Stored {
            item: Doc {
                id: format!("doc_{i}"),
                reference: format!("ref-{i}"),
                metadata: BTreeMap::from([
                    ("attempt".to_owned(), format!("a-{i}")),
                    ("kind".to_owned(), "charge".to_owned()),
                ]),
            },
            caller: caller.to_owned(),
            key: None,
            searchable_at: DateTime::<Utc>::MIN_UTC,
        }
    }

    /// The complexity, counted: among 100 000 objects of one caller, a
    /// search by reference or by a metadata entry reads the one object that
    /// carries it (a scan would read all 100 000), and finds it.
    #[test]
    fn a_search_by_reference_or_metadata_reads_only_the_objects_that_carry_it() {
        let mut store = Store::default();
        let n = 100_000;
        for i in 0..n {
            store.insert(doc(i, "sk_one"));
        }
        store.insert(doc(7, "sk_other"));
        let now = Utc::now();
        assert_eq!(store.candidates("sk_one", None, None).len(), n);
        assert_eq!(
            store.candidates("sk_one", None, Some(("attempt", "a-12345"))),
            &[12_345]
        );
        assert_eq!(
            store.candidates("sk_one", Some("ref-99999"), None),
            &[99_999]
        );
        // Shared with another caller's object, filtered out by the search.
        assert_eq!(
            store
                .candidates("sk_one", None, Some(("attempt", "a-7")))
                .len(),
            2
        );
        let found: Vec<&str> = store
            .search("sk_other", None, Some(("attempt", "a-7")), now, |_| true)
            .map(|d| d.id.as_str())
            .collect();
        assert_eq!(found, ["doc_7"]);
        let found: Vec<&str> = store
            .search("sk_one", None, Some(("attempt", "a-12345")), now, |d| {
                d.metadata.get("kind").map(String::as_str) == Some("charge")
            })
            .map(|d| d.id.as_str())
            .collect();
        assert_eq!(found, ["doc_12345"]);
        assert!(
            store
                .candidates("sk_one", None, Some(("attempt", "none")))
                .is_empty()
        );
    }
}
