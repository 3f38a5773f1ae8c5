//! The in-process control handle: the same powers as `/__admin`, without HTTP.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::config::{WebhookDialect, WebhookTarget};
use crate::faults::FaultRule;
use crate::ledger::Ledger;
use crate::state::Shared;
use crate::trace::SeenRequest;
use crate::webhooks::WebhookDelivery;

/// A fault rule that is still active, with what is left of its `next` budget.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ActiveFault {
    /// The id `add_fault` returned.
    pub id: u64,
    /// The rule; `next` counts down as the rule fires.
    #[serde(flatten)]
    pub rule: FaultRule,
}

/// Handle on a running provider; cheap to clone, usable from any thread.
#[derive(Clone, Debug)]
pub struct Control {
    shared: Arc<Shared>,
}

impl Control {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// Adds a rule (after the existing ones: the first matching rule wins)
    /// and returns its id. Rules whose action does not fit their operation
    /// (see [`FaultRule::validate`]) never fire.
    pub fn add_fault(&self, rule: FaultRule) -> u64 {
        self.shared.lock().faults.add(rule)
    }

    /// The rules still active; a rule with `next` disappears once spent.
    pub fn faults(&self) -> Vec<ActiveFault> {
        let rules = self.shared.lock().faults.list();
        rules
            .into_iter()
            .map(|(id, rule)| ActiveFault { id, rule })
            .collect()
    }

    /// How often rules of each (operation, action) fired since the start
    /// (cleared and spent rules included), so a test can show its faults
    /// really happened.
    pub fn faults_fired(&self) -> Vec<crate::faults::FiredCount> {
        self.shared.lock().faults.fired()
    }

    /// Removes every fault rule.
    pub fn clear_faults(&self) {
        self.shared.lock().faults.clear();
    }

    /// Moves virtual time forward; keys past retention are forgotten (and
    /// held requests that arrived longer ago than that are abandoned,
    /// without an effect: no provider acts on a request whose key it has
    /// forgotten), `processing` charges whose time has come become final, and Stripe
    /// PaymentIntents uncaptured for seven days are canceled
    /// (`cancellation_reason: automatic`).
    pub fn advance_clock(&self, by: Duration) {
        let now = self.shared.clock.advance(by);
        let mut state = self.shared.lock();
        crate::pipeline::abandon_expired(&mut state, now);
        state.keys.forget_expired(now);
        state.settle_due(now);
        crate::stripe::expire_uncaptured(&mut state, now);
    }

    /// Fails refund `id` after it succeeded, as a card network can days
    /// later (the card's account was closed): see `State::fail_refund`.
    /// `false` when there is no such succeeded refund.
    pub fn fail_refund(&self, id: &str) -> bool {
        let now = self.shared.clock.now();
        self.shared.lock().fail_refund(id, now)
    }

    /// Current virtual time.
    pub fn now(&self) -> DateTime<Utc> {
        self.shared.clock.now()
    }

    /// A snapshot of every effect made so far, with every charge and refund
    /// in its current state (`processing` charges whose time has come are
    /// made final first).
    pub fn ledger(&self) -> Ledger {
        let now = self.shared.clock.now();
        let mut state = self.shared.lock();
        state.settle_due(now);
        state.ledger_snapshot()
    }

    /// Sets (or with `None` removes) the webhook target. Events are emitted
    /// only while a target is set; pending retries follow the new target.
    /// The target keeps the current [`WebhookDialect`] (the one in
    /// [`crate::Config`] unless changed with [`Control::set_webhook_dialect`]).
    pub fn set_webhook(&self, target: Option<WebhookTarget>) {
        self.shared.lock().webhook = target;
    }

    /// Chooses which API's events the target receives from now on: the
    /// fake's (every engine effect, `Fake-Signature`) or Stripe's (what the
    /// Stripe dialect made, `Stripe-Signature`). Events already queued keep
    /// the dialect they were made in.
    pub fn set_webhook_dialect(&self, dialect: WebhookDialect) {
        self.shared.lock().webhook_dialect = dialect;
    }

    /// The dialect of the webhook events emitted now.
    pub fn webhook_dialect(&self) -> WebhookDialect {
        self.shared.lock().webhook_dialect
    }

    /// The last API requests received (at most [`crate::trace::KEPT`]),
    /// oldest first, with the `traceparent` each carried.
    pub fn requests(&self) -> Vec<SeenRequest> {
        self.shared.requests().iter().cloned().collect()
    }

    /// Makes the effect of every request a `hold_effect` fault held, oldest
    /// first, as if each had arrived now (under the key it reserved, which
    /// then replays the answer), and says how many there were. Their
    /// callers are long gone: nothing is answered. Requests held for a key
    /// retention or longer were abandoned by then and make nothing.
    pub fn release_held(&self) -> usize {
        let held = {
            let mut state = self.shared.lock();
            crate::pipeline::abandon_expired(&mut state, self.shared.clock.now());
            std::mem::take(&mut state.held)
        };
        let released = held.len();
        for request in held {
            crate::pipeline::release(&self.shared, request);
        }
        released
    }

    /// How many requests `hold_effect` faults hold now.
    pub fn held(&self) -> usize {
        self.shared.lock().held.len()
    }

    /// Every delivery attempt so far, oldest first.
    pub fn webhook_deliveries(&self) -> Vec<WebhookDelivery> {
        self.shared.deliveries().clone()
    }
}
