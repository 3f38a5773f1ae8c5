//! Everything the provider knows, behind one lock, and the effects on it.
//!
//! Each effect is a plain synchronous method run with the lock held: it is
//! short (map inserts and one small serialisation) and never awaits, which is
//! what lets one `std::sync::Mutex` carry the whole provider.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::http::StatusCode;
use chrono::{DateTime, TimeDelta, Utc};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc::UnboundedSender;

use crate::clock::{VirtualClock, delta};
use crate::config::{Config, WebhookTarget};
use crate::faults::{FaultBook, Operation};
use crate::idempotency::KeyStore;
use crate::ledger::{Effect, Ledger, LedgerBook, LedgerCharge, LedgerRefund};
use crate::model::{
    ApiError, CaptureMethod, CaptureParams, Charge, ChargeParams, ChargeStatus, List, Refund,
    RefundParams, RefundStatus, SearchFilter, StoredResponse,
};
use crate::webhooks::{Event, EventData, WebhookDelivery};

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
    caller: String,
    /// The idempotency key it was created with (without the caller).
    key: Option<String>,
    /// Equal to creation time unless a `search_lag` rule hit it.
    searchable_at: DateTime<Utc>,
}

/// What the store's indexes and search need from a charge or refund.
pub(crate) trait Resource {
    fn id(&self) -> &str;
    fn reference(&self) -> &str;
    fn metadata(&self) -> &BTreeMap<String, String>;
}

/// Charges and refunds carry the same three fields under the same names.
macro_rules! resource {
    ($($kind:ty),+) => {$(
        impl Resource for $kind {
            fn id(&self) -> &str {
                &self.id
            }
            fn reference(&self) -> &str {
                &self.reference
            }
            fn metadata(&self) -> &BTreeMap<String, String> {
                &self.metadata
            }
        }
    )+};
}

resource!(Charge, Refund);

/// One kind of object in creation order, with the indexes that find it.
/// Inserting is O(1): a push and three hash-map updates.
#[derive(Debug)]
struct Store<T> {
    /// Creation order: the ledger's order and, reversed, search's.
    items: Vec<Stored<T>>,
    /// Position of each id in `items`.
    by_id: HashMap<String, usize>,
    /// Positions per reference (all callers), in creation order.
    by_reference: HashMap<String, Vec<usize>>,
    /// Positions per caller, in creation order, for metadata-only search.
    by_caller: HashMap<String, Vec<usize>>,
}

impl<T> Default for Store<T> {
    fn default() -> Self {
        Self {
            items: Vec::new(),
            by_id: HashMap::new(),
            by_reference: HashMap::new(),
            by_caller: HashMap::new(),
        }
    }
}

impl<T: Resource + serde::Serialize> Store<T> {
    fn insert(&mut self, stored: Stored<T>) {
        let position = self.items.len();
        self.by_id.insert(stored.item.id().to_owned(), position);
        index(&mut self.by_reference, stored.item.reference(), position);
        index(&mut self.by_caller, &stored.caller, position);
        self.items.push(stored);
    }

    /// The object `id` if `caller` made it: another caller's object is as
    /// missing as one that does not exist.
    fn get(&self, id: &str, caller: &str) -> Option<&Stored<T>> {
        let stored = self.items.get(*self.by_id.get(id)?)?;
        (stored.caller == caller).then_some(stored)
    }

    fn get_mut(&mut self, id: &str, caller: &str) -> Option<&mut Stored<T>> {
        let stored = self.items.get_mut(*self.by_id.get(id)?)?;
        (stored.caller == caller).then_some(stored)
    }

    /// `caller`'s objects passing `filter`, newest first, skipping what a
    /// `search_lag` still hides. With a reference the by-reference index is
    /// used; a metadata-only search scans the caller's objects.
    fn search(&self, caller: &str, filter: &SearchFilter, now: DateTime<Utc>) -> StoredResponse {
        let candidates = match &filter.reference {
            Some(reference) => self.by_reference.get(reference.as_str()),
            None => self.by_caller.get(caller),
        };
        let data = candidates
            .into_iter()
            .flatten()
            .rev()
            .filter_map(|&position| self.items.get(position))
            .filter(|stored| stored.caller == caller && stored.searchable_at <= now)
            .filter(|stored| filter.matches(stored.item.reference(), stored.item.metadata()))
            .map(|stored| &stored.item)
            .collect();
        StoredResponse::json(
            StatusCode::OK,
            &List {
                object: "list",
                data,
            },
        )
    }
}

/// The provider's data.
#[derive(Debug)]
pub(crate) struct State {
    charges: Store<Charge>,
    refunds: Store<Refund>,
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
    events: UnboundedSender<Event>,
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
}

/// Why a change to a charge was refused.
enum Refused {
    /// A bad parameter: the error alone.
    Parameter(ApiError),
    /// The charge's state forbids the change: the error carries the charge.
    State(ApiError),
}

impl State {
    fn new(config: &Config, events: UnboundedSender<Event>) -> Self {
        Self {
            charges: Store::default(),
            refunds: Store::default(),
            keys: KeyStore::new(delta(config.retention)),
            faults: FaultBook::default(),
            fault_rng: StdRng::seed_from_u64(config.seed),
            // A different stream from the same seed.
            id_rng: StdRng::seed_from_u64(config.seed ^ 0x9e37_79b9_7f4a_7c15),
            ledger: LedgerBook::default(),
            webhook: config.webhook.clone(),
            events,
        }
    }

    /// The ledger's counts plus every charge and refund in its current state.
    pub(crate) fn ledger_snapshot(&self) -> Ledger {
        let charges = self.charges.items.iter().map(ledger_charge).collect();
        let refunds = self.refunds.items.iter().map(ledger_refund).collect();
        self.ledger.snapshot(charges, refunds)
    }

    pub(crate) fn create_charge(&mut self, params: ChargeParams, ctx: Ctx<'_>) -> StoredResponse {
        let decline = match params.payment_method.as_str() {
            "pm_card_declined" => Some(("card_declined", "Your card was declined.")),
            "pm_insufficient_funds" => {
                Some(("insufficient_funds", "Your card has insufficient funds."))
            }
            _ => None,
        };
        let status = match (decline, params.capture) {
            (Some(_), _) => ChargeStatus::Declined,
            (None, true) => ChargeStatus::Captured,
            (None, false) => ChargeStatus::Authorized,
        };
        let charge = Charge {
            id: new_id(&mut self.id_rng, "ch_"),
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
        let response = match decline {
            None => StoredResponse::json(StatusCode::CREATED, &charge),
            Some((code, message)) => {
                ApiError::new(StatusCode::PAYMENT_REQUIRED, "card_error", code, message)
                    .into_stored_with(Some(&charge))
            }
        };
        self.emit_charge(&charge, ctx.now);
        let searchable_at = self.searchable_at(Operation::Charge, &charge.reference, ctx.now);
        self.charges.insert(new_stored(charge, ctx, searchable_at));
        response
    }

    pub(crate) fn capture(
        &mut self,
        id: &str,
        params: CaptureParams,
        ctx: Ctx<'_>,
    ) -> StoredResponse {
        self.change_charge(id, Effect::Capture, ctx, |charge| {
            if charge.status != ChargeStatus::Authorized {
                return Err(Refused::State(not_allowed("charge_not_capturable", charge)));
            }
            let amount = params.amount.unwrap_or(charge.amount);
            if amount <= 0 || amount > charge.amount {
                return Err(Refused::Parameter(ApiError::invalid(
                    "amount",
                    "capture amount must be positive and at most the authorized amount",
                )));
            }
            charge.status = ChargeStatus::Captured;
            charge.amount_captured = amount;
            Ok(())
        })
    }

    pub(crate) fn void(&mut self, id: &str, ctx: Ctx<'_>) -> StoredResponse {
        self.change_charge(id, Effect::Void, ctx, |charge| {
            if charge.status != ChargeStatus::Authorized {
                return Err(Refused::State(not_allowed("charge_not_voidable", charge)));
            }
            charge.status = ChargeStatus::Voided;
            Ok(())
        })
    }

    /// Applies `change` to the caller's charge; on success bumps its
    /// sequence, records the effect and emits the event. `change` must leave
    /// the charge untouched when it refuses: a refusal by state carries the
    /// charge as it is.
    fn change_charge(
        &mut self,
        id: &str,
        effect: Effect,
        ctx: Ctx<'_>,
        change: impl FnOnce(&mut Charge) -> Result<(), Refused>,
    ) -> StoredResponse {
        let Some(stored) = self.charges.get_mut(id, ctx.caller) else {
            return ApiError::missing("charge", id).into_stored();
        };
        let charge = &mut stored.item;
        match change(charge) {
            Ok(()) => {}
            Err(Refused::Parameter(error)) => return error.into_stored(),
            Err(Refused::State(error)) => return error.into_stored_with(Some(&*charge)),
        }
        charge.sequence += 1;
        let charge = charge.clone();
        self.ledger.record(effect, &charge.reference, ctx.key);
        self.emit_charge(&charge, ctx.now);
        StoredResponse::json(StatusCode::OK, &charge)
    }

    pub(crate) fn refund(&mut self, params: RefundParams, ctx: Ctx<'_>) -> StoredResponse {
        let Some(stored) = self.charges.get_mut(&params.charge, ctx.caller) else {
            return ApiError::missing("charge", &params.charge).into_stored();
        };
        let charge = &mut stored.item;
        let refundable = charge.amount_captured - charge.amount_refunded;
        if params.amount > refundable {
            let message = format!(
                "refund of {} exceeds the {} captured and not yet refunded",
                params.amount, refundable
            );
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "refund_exceeds_captured",
                message,
            )
            .into_stored();
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
        self.emit(
            || {
                (
                    "refund.succeeded",
                    refund.sequence,
                    EventData::Refund(refund.clone()),
                    refund.reference.clone(),
                )
            },
            ctx.now,
        );
        let response = StoredResponse::json(StatusCode::CREATED, &refund);
        let searchable_at = self.searchable_at(Operation::Refund, &refund.reference, ctx.now);
        self.refunds.insert(new_stored(refund, ctx, searchable_at));
        response
    }

    pub(crate) fn get_charge(&self, id: &str, ctx: Ctx<'_>) -> StoredResponse {
        match self.charges.get(id, ctx.caller) {
            Some(stored) => StoredResponse::json(StatusCode::OK, &stored.item),
            None => ApiError::missing("charge", id).into_stored(),
        }
    }

    pub(crate) fn get_refund(&self, id: &str, ctx: Ctx<'_>) -> StoredResponse {
        match self.refunds.get(id, ctx.caller) {
            Some(stored) => StoredResponse::json(StatusCode::OK, &stored.item),
            None => ApiError::missing("refund", id).into_stored(),
        }
    }

    pub(crate) fn search_charges(&self, filter: &SearchFilter, ctx: Ctx<'_>) -> StoredResponse {
        self.charges.search(ctx.caller, filter, ctx.now)
    }

    pub(crate) fn search_refunds(&self, filter: &SearchFilter, ctx: Ctx<'_>) -> StoredResponse {
        self.refunds.search(ctx.caller, filter, ctx.now)
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

    fn searchable_at(
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
        let kind = match charge.status {
            ChargeStatus::Authorized => "charge.authorized",
            ChargeStatus::Captured => "charge.captured",
            ChargeStatus::Declined => "charge.declined",
            ChargeStatus::Voided => "charge.voided",
        };
        self.emit(
            || {
                (
                    kind,
                    charge.sequence,
                    EventData::Charge(charge.clone()),
                    charge.reference.clone(),
                )
            },
            now,
        );
    }

    /// Queues an event for the dispatcher; `make` runs (and clones the
    /// resource) only when a webhook target is set.
    fn emit(
        &mut self,
        make: impl FnOnce() -> (&'static str, u64, EventData, String),
        now: DateTime<Utc>,
    ) {
        if self.webhook.is_none() {
            return;
        }
        let (kind, sequence, data, reference) = make();
        let event = Event {
            id: new_id(&mut self.id_rng, "evt_"),
            kind,
            created: now,
            sequence,
            data,
            reference,
        };
        // The receiver lives as long as the server; after shutdown there is
        // nobody to deliver to, so a failed send is correctly ignored.
        let _ = self.events.send(event);
    }
}

fn not_allowed(code: &'static str, charge: &Charge) -> ApiError {
    let message = format!("charge {} is {}", charge.id, charge.status.as_str());
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        code,
        message,
    )
}

fn new_id(rng: &mut StdRng, prefix: &str) -> String {
    let uuid = uuid::Builder::from_random_bytes(rng.random()).into_uuid();
    format!("{prefix}{}", uuid.simple())
}

/// Wraps a new object with its caller and key from the request.
fn new_stored<T>(item: T, ctx: Ctx<'_>, searchable_at: DateTime<Utc>) -> Stored<T> {
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
