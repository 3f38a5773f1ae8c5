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
            clock: VirtualClock::starting_at(config.clock_start),
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

/// What the store's indexes and lists need from a stored object. All four
/// are fixed when the object is created (no endpoint changes an object's
/// id, reference, metadata or creation time), so the indexes never go stale.
pub(crate) trait Resource {
    fn id(&self) -> &str;
    fn reference(&self) -> &str;
    fn metadata(&self) -> &BTreeMap<String, String>;
    fn created(&self) -> DateTime<Utc>;
}

/// Charges and refunds (and the Stripe dialect's PaymentIntents) carry the
/// four fields under the same names.
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
            fn created(&self) -> chrono::DateTime<chrono::Utc> {
                self.created
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

    /// The object `id`, whoever made it: for pages a customer's browser
    /// opens (the 3-D Secure challenge), which carry no caller's token.
    pub(crate) fn get_any_mut(&mut self, id: &str) -> Option<&mut Stored<T>> {
        self.items.get_mut(*self.by_id.get(id)?)
    }

    /// Every object, whoever made it, in creation order.
    pub(crate) fn all(&self) -> impl Iterator<Item = &Stored<T>> {
        self.items.iter()
    }

    /// One page of a strongly consistent list: `caller`'s objects that
    /// `member` accepts, whatever search lag hides, newest first (by
    /// `created`; ties in reverse creation order), starting after the
    /// member `after`, keeping those `keep` accepts, at most `limit`.
    /// `None` when `after` is not one of those members (unknown, another
    /// caller's, or outside the list): a cursor the caller cannot have
    /// been given must not silently read as "nothing more".
    ///
    /// Sorting the caller's objects per page costs O(n log n) of that
    /// caller's objects, fine at test sizes; creation order is nearly
    /// `created` order, but two requests racing for the lock can insert in
    /// the other order, and the list promises `created` order.
    pub(crate) fn page<'s>(
        &'s self,
        caller: &str,
        member: impl Fn(&T) -> bool,
        after: Option<&str>,
        keep: impl Fn(&T) -> bool,
        limit: usize,
    ) -> Option<Page<'s, T>> {
        let mut members: Vec<(usize, &T)> = self
            .by_caller
            .get(caller)
            .into_iter()
            .flatten()
            .filter_map(|&position| Some((position, &self.items.get(position)?.item)))
            .filter(|(_, item)| member(item))
            .collect();
        members.sort_by_key(|&(position, item)| std::cmp::Reverse((item.created(), position)));
        let start = match after {
            None => 0,
            Some(id) => members.iter().position(|(_, item)| item.id() == id)? + 1,
        };
        let mut data: Vec<&T> = members
            .get(start..)
            .unwrap_or_default()
            .iter()
            .map(|&(_, item)| item)
            .filter(|item| keep(item))
            .take(limit.saturating_add(1))
            .collect();
        let has_more = data.len() > limit;
        data.truncate(limit);
        Some(Page { data, has_more })
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

/// One page of a list ([`Store::page`]).
#[derive(Debug)]
pub(crate) struct Page<'s, T> {
    /// Newest first.
    pub(crate) data: Vec<&'s T>,
    /// Whether more objects follow this page.
    pub(crate) has_more: bool,
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
    /// Charges a `processing` fault left pending, in creation order, until
    /// [`State::settle_due`] makes them final.
    processing: Vec<Pending>,
}

/// A `processing` charge: which, whose, and when it becomes final.
#[derive(Debug)]
struct Pending {
    charge: String,
    caller: String,
    settles_at: DateTime<Utc>,
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
            processing: Vec::new(),
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

    /// Creates a charge (declined when its payment method always declines,
    /// or when a `soft_decline` rule fires: then with
    /// [`Decline::TRY_AGAIN_LATER`], whatever the card), records it in the
    /// ledger and emits its fake event. `searchable_at` comes from
    /// [`State::searchable_at`], drawn once by the caller. When a
    /// `processing` rule fires, the charge is made `processing` instead:
    /// nothing is recorded or emitted until [`State::settle_due`] makes it
    /// final.
    pub(crate) fn create_charge(
        &mut self,
        params: ChargeParams,
        ctx: Ctx<'_>,
        searchable_at: DateTime<Utc>,
    ) -> Charge {
        let capture_method = CaptureMethod::from_capture(params.capture);
        let pending = self
            .faults
            .processing(&params.reference, &mut self.fault_rng);
        let forced_decline = self
            .faults
            .soft_decline(&params.reference, &mut self.fault_rng)
            .then_some(Decline::TRY_AGAIN_LATER);
        let mut charge = Charge {
            id: self.new_id("ch_"),
            object: "charge".to_owned(),
            amount: params.amount,
            currency: params.currency,
            payment_method: params.payment_method,
            capture_method,
            reference: params.reference,
            metadata: params.metadata,
            status: ChargeStatus::Processing,
            amount_captured: 0,
            amount_refunded: 0,
            created: ctx.now,
            sequence: 1,
            decline_code: None,
            forced_decline,
        };
        if pending.is_none() {
            charge.make_final();
        }
        match pending {
            Some(seconds) => self.processing.push(Pending {
                charge: charge.id.clone(),
                caller: ctx.caller.to_owned(),
                settles_at: ctx.now + seconds_delta(seconds),
            }),
            None => {
                self.ledger
                    .record(charge_effect(charge.status), &charge.reference, ctx.key);
                self.emit_charge(&charge, ctx.now);
            }
        }
        self.charges
            .insert(new_stored(charge.clone(), ctx, searchable_at));
        charge
    }

    /// Makes final every `processing` charge whose time has come by `now`
    /// (virtual), oldest due first: its status becomes what it would have
    /// been without the fault, its sequence is bumped, the ledger counts its
    /// effect (under its creation key) and its events go out, dated when it
    /// became final. Called before every API request is handled, before a
    /// ledger snapshot and when the clock moves, so nothing ever observes a
    /// charge still `processing` past its time. Cheap when none is pending.
    pub(crate) fn settle_due(&mut self, now: DateTime<Utc>) {
        if self
            .processing
            .iter()
            .all(|pending| pending.settles_at > now)
        {
            return;
        }
        let (mut due, waiting): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut self.processing)
            .into_iter()
            .partition(|pending| pending.settles_at <= now);
        self.processing = waiting;
        // Stable: charges due at the same time settle in creation order.
        due.sort_by_key(|pending| pending.settles_at);
        for pending in due {
            self.settle(&pending);
        }
    }

    fn settle(&mut self, pending: &Pending) {
        let Some(stored) = self.charges.get_mut(&pending.charge, &pending.caller) else {
            return;
        };
        let charge = &mut stored.item;
        if charge.status != ChargeStatus::Processing {
            return;
        }
        charge.make_final();
        charge.sequence += 1;
        let charge = charge.clone();
        let key = stored.key.clone();
        self.ledger.record(
            charge_effect(charge.status),
            &charge.reference,
            key.as_deref(),
        );
        self.emit_charge(&charge, pending.settles_at);
        crate::stripe::settled(self, &charge, &pending.caller, pending.settles_at);
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

    /// Fails refund `id` (of any caller) after it succeeded: its amount is
    /// no longer refunded on its charge (whose sequence moves), the ledger
    /// counts a refund failure, and `refund.failed` is sent in either
    /// dialect. `false` when there is no such refund, or it already failed.
    pub(crate) fn fail_refund(&mut self, id: &str, now: DateTime<Utc>) -> bool {
        let Some(caller) = self
            .refunds
            .all()
            .find(|stored| stored.item.id == id && stored.item.status == RefundStatus::Succeeded)
            .map(|stored| stored.caller.clone())
        else {
            return false;
        };
        let Some(charge) = self
            .refunds
            .get(id, &caller)
            .map(|stored| stored.item.charge.clone())
        else {
            return false;
        };
        let Some(stored) = self.charges.get_mut(&charge, &caller) else {
            return false;
        };
        stored.item.sequence += 1;
        let sequence = stored.item.sequence;
        let Some(refund) = self.refunds.get_mut(id, &caller) else {
            return false;
        };
        refund.item.status = RefundStatus::Failed;
        refund.item.sequence = sequence;
        let refund = refund.item.clone();
        if let Some(stored) = self.charges.get_mut(&charge, &caller) {
            stored.item.amount_refunded -= refund.amount;
        }
        self.ledger
            .record(Effect::RefundFailure, &refund.reference, None);
        if self.emits(WebhookDialect::Fake) {
            let event = FakeEventData::Refund(refund.clone());
            self.emit(
                "refund.failed",
                &refund.reference,
                WebhookDialect::Fake,
                |id| FakeEvent::render(id, "refund.failed", now, refund.sequence, &event),
            );
        }
        crate::stripe::refund_failed(self, &refund, &caller, now);
        true
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
            Some(seconds) => now + seconds_delta(seconds),
            None => now,
        }
    }

    fn emit_charge(&mut self, charge: &Charge, now: DateTime<Utc>) {
        if !self.emits(WebhookDialect::Fake) {
            return;
        }
        let kind = match charge.status {
            // Nothing happened yet: its event comes when it settles.
            ChargeStatus::Processing => return,
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

/// The ledger counter a charge's creation bumps once final.
fn charge_effect(status: ChargeStatus) -> Effect {
    if status == ChargeStatus::Declined {
        Effect::Decline
    } else {
        Effect::Charge
    }
}

/// `seconds` of a fault rule as a time delta, saturating.
fn seconds_delta(seconds: u64) -> TimeDelta {
    TimeDelta::seconds(i64::try_from(seconds).unwrap_or(i64::MAX / 1000))
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
        decline_code: charge.decline_code.clone(),
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
        created: DateTime<Utc>,
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
                created: DateTime::<Utc>::MIN_UTC,
            },
            caller: caller.to_owned(),
            key: None,
            searchable_at: DateTime::<Utc>::MIN_UTC,
        }
    }

    /// A list is newest first by `created`, ties in reverse creation order,
    /// even when an object was inserted after a newer one (two requests
    /// racing for the lock); the cursor is a position in that order and
    /// must be one of the list's members.
    #[test]
    fn a_page_is_newest_first_by_created_and_starts_after_its_cursor() {
        let mut store = Store::default();
        let at = |seconds| DateTime::<Utc>::MIN_UTC + TimeDelta::seconds(seconds);
        for (i, created) in [(0, 10), (1, 30), (2, 20), (3, 20), (4, 40)] {
            let mut stored = doc(i, "sk_one");
            stored.item.created = at(created);
            store.insert(stored);
        }
        store.insert(doc(5, "sk_other"));
        fn ids(page: Option<Page<'_, Doc>>) -> (Vec<&str>, bool) {
            let page = page.expect("a known cursor");
            let ids = page.data.iter().map(|d| d.id.as_str()).collect();
            (ids, page.has_more)
        }
        let everything = store.page("sk_one", |_| true, None, |_| true, 10);
        assert_eq!(
            ids(everything),
            (vec!["doc_4", "doc_1", "doc_3", "doc_2", "doc_0"], false)
        );
        let after = store.page("sk_one", |_| true, Some("doc_3"), |_| true, 2);
        assert_eq!(ids(after), (vec!["doc_2", "doc_0"], false));
        let kept = store.page("sk_one", |_| true, Some("doc_4"), |d| d.id != "doc_1", 1);
        assert_eq!(ids(kept), (vec!["doc_3"], true));
        assert!(
            store
                .page("sk_one", |_| true, Some("doc_5"), |_| true, 1)
                .is_none()
        );
        let members = |d: &Doc| d.id != "doc_1";
        assert!(
            store
                .page("sk_one", members, Some("doc_1"), |_| true, 1)
                .is_none()
        );
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
