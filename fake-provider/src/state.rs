//! Everything the provider knows, behind one lock, and the effects on it.
//!
//! Each effect is a plain synchronous method run with the lock held: it is
//! short (map inserts and one small serialisation) and never awaits, which is
//! what lets one `std::sync::Mutex` carry the whole provider.

use std::collections::HashMap;
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
use crate::ledger::{Effect, LedgerBook};
use crate::model::{
    ApiError, CaptureParams, Charge, ChargeParams, ChargeStatus, List, Refund, RefundParams,
    RefundStatus, StoredResponse,
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
    /// First webhook retry delay.
    pub(crate) webhook_retry_base: Duration,
}

impl Shared {
    pub(crate) fn new(config: &Config, events: UnboundedSender<Event>) -> Self {
        Self {
            state: Mutex::new(State::new(config, events)),
            clock: VirtualClock::default(),
            deliveries: Mutex::new(Vec::new()),
            webhook_retry_base: config.webhook_retry_base,
        }
    }

    /// Locks the state. A panic while holding the lock leaves the maps
    /// consistent enough for a test double, so poisoning is ignored rather
    /// than turning every later request into a panic.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn deliveries(&self) -> MutexGuard<'_, Vec<WebhookDelivery>> {
        self.deliveries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// A charge or refund plus the moment it becomes visible to search.
#[derive(Debug)]
pub(crate) struct Stored<T> {
    pub(crate) item: T,
    /// Equal to creation time unless a `search_lag` rule hit it.
    searchable_at: DateTime<Utc>,
}

/// The provider's data.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) charges: HashMap<String, Stored<Charge>>,
    pub(crate) refunds: HashMap<String, Stored<Refund>>,
    /// Ids per reference in creation order, for search.
    charges_by_reference: HashMap<String, Vec<String>>,
    refunds_by_reference: HashMap<String, Vec<String>>,
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
    /// The idempotency key (without its caller), for the ledger.
    pub(crate) key: Option<&'a str>,
}

impl State {
    fn new(config: &Config, events: UnboundedSender<Event>) -> Self {
        Self {
            charges: HashMap::new(),
            refunds: HashMap::new(),
            charges_by_reference: HashMap::new(),
            refunds_by_reference: HashMap::new(),
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
            reference: params.reference,
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
        index(
            &mut self.charges_by_reference,
            &charge.reference,
            &charge.id,
        );
        self.charges.insert(
            charge.id.clone(),
            Stored {
                item: charge,
                searchable_at,
            },
        );
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
                return Err(not_allowed("charge_not_capturable", charge));
            }
            let amount = params.amount.unwrap_or(charge.amount);
            if amount <= 0 || amount > charge.amount {
                return Err(ApiError::invalid(
                    "amount",
                    "capture amount must be positive and at most the authorized amount",
                ));
            }
            charge.status = ChargeStatus::Captured;
            charge.amount_captured = amount;
            Ok(())
        })
    }

    pub(crate) fn void(&mut self, id: &str, ctx: Ctx<'_>) -> StoredResponse {
        self.change_charge(id, Effect::Void, ctx, |charge| {
            if charge.status != ChargeStatus::Authorized {
                return Err(not_allowed("charge_not_voidable", charge));
            }
            charge.status = ChargeStatus::Voided;
            Ok(())
        })
    }

    /// Applies `change` to a charge; on success bumps its sequence, records
    /// the effect and emits the event.
    fn change_charge(
        &mut self,
        id: &str,
        effect: Effect,
        ctx: Ctx<'_>,
        change: impl FnOnce(&mut Charge) -> Result<(), ApiError>,
    ) -> StoredResponse {
        let Some(stored) = self.charges.get_mut(id) else {
            return ApiError::missing("charge", id).into_stored();
        };
        let charge = &mut stored.item;
        if let Err(error) = change(charge) {
            return error.into_stored();
        }
        charge.sequence += 1;
        let charge = charge.clone();
        self.ledger.record(effect, &charge.reference, ctx.key);
        self.emit_charge(&charge, ctx.now);
        StoredResponse::json(StatusCode::OK, &charge)
    }

    pub(crate) fn refund(&mut self, params: RefundParams, ctx: Ctx<'_>) -> StoredResponse {
        let Some(stored) = self.charges.get_mut(&params.charge) else {
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
            reference: params.reference,
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
        index(
            &mut self.refunds_by_reference,
            &refund.reference,
            &refund.id,
        );
        self.refunds.insert(
            refund.id.clone(),
            Stored {
                item: refund,
                searchable_at,
            },
        );
        response
    }

    pub(crate) fn get_charge(&self, id: &str) -> StoredResponse {
        match self.charges.get(id) {
            Some(stored) => StoredResponse::json(StatusCode::OK, &stored.item),
            None => ApiError::missing("charge", id).into_stored(),
        }
    }

    pub(crate) fn get_refund(&self, id: &str) -> StoredResponse {
        match self.refunds.get(id) {
            Some(stored) => StoredResponse::json(StatusCode::OK, &stored.item),
            None => ApiError::missing("refund", id).into_stored(),
        }
    }

    pub(crate) fn search_charges(&self, reference: &str, now: DateTime<Utc>) -> StoredResponse {
        search(&self.charges, &self.charges_by_reference, reference, now)
    }

    pub(crate) fn search_refunds(&self, reference: &str, now: DateTime<Utc>) -> StoredResponse {
        search(&self.refunds, &self.refunds_by_reference, reference, now)
    }

    /// The reference a fault rule matches for a request about charge `id`.
    pub(crate) fn charge_reference(&self, id: &str) -> Option<&str> {
        self.charges
            .get(id)
            .map(|stored| stored.item.reference.as_str())
    }

    pub(crate) fn refund_reference(&self, id: &str) -> Option<&str> {
        self.refunds
            .get(id)
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
    let status = serde_json::to_value(charge.status).unwrap_or_default();
    let message = format!(
        "charge {} is {}",
        charge.id,
        status.as_str().unwrap_or("in another state")
    );
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

fn index(by_reference: &mut HashMap<String, Vec<String>>, reference: &str, id: &str) {
    match by_reference.get_mut(reference) {
        Some(ids) => ids.push(id.to_owned()),
        None => {
            by_reference.insert(reference.to_owned(), vec![id.to_owned()]);
        }
    }
}

/// Newest first, skipping what a `search_lag` still hides.
fn search<T: serde::Serialize>(
    items: &HashMap<String, Stored<T>>,
    by_reference: &HashMap<String, Vec<String>>,
    reference: &str,
    now: DateTime<Utc>,
) -> StoredResponse {
    let data = by_reference
        .get(reference)
        .into_iter()
        .flatten()
        .rev()
        .filter_map(|id| items.get(id))
        .filter(|stored| stored.searchable_at <= now)
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
