//! Fault rules: which request (or webhook event) goes wrong, and how.
//!
//! Every probability is drawn from the provider's one seeded RNG while the
//! state lock is held, so the same seed and the same request order give the
//! same faults. A rule without `probability` (or with 1.0) draws nothing, so
//! adding a certain rule does not shift the draws of the random ones.

use std::time::Duration;

use rand::Rng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

/// What a rule matches on.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Operation {
    /// `POST /v1/charges`; Stripe: `POST /v1/payment_intents`.
    Charge,
    /// `POST /v1/charges/{id}/capture`; Stripe:
    /// `POST /v1/payment_intents/{id}/capture`.
    Capture,
    /// `POST /v1/charges/{id}/void`; Stripe:
    /// `POST /v1/payment_intents/{id}/cancel`.
    Void,
    /// `POST /v1/refunds` (both dialects).
    Refund,
    /// `GET /v1/charges/{id}`, `GET /v1/refunds/{id}`; Stripe:
    /// `GET /v1/payment_intents/{id}`, `GET /v1/refunds/{id}`.
    Get,
    /// The eventually consistent searches, subject to search lag:
    /// `GET /v1/charges?...` and `GET /v1/refunds?...` by reference and/or
    /// metadata; Stripe: `GET /v1/payment_intents/search`. The strongly
    /// consistent lists are [`Operation::List`].
    Search,
    /// The strongly consistent lists, which no search lag hides: the fake's
    /// `GET /v1/charges?created[gte]=...` (any of `created[gte]`,
    /// `created[lte]`, `limit`, `starting_after`) and
    /// `GET /v1/refunds?charge=...`; Stripe: `GET /v1/payment_intents` and
    /// `GET /v1/refunds?payment_intent=...|charge=...`.
    List,
    /// Outgoing webhook events (never matched by `any`).
    Webhook,
    /// Every provider API operation (not webhooks).
    Any,
}

/// What happens to a matching request or event.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum FaultAction {
    /// Sleep `delay_ms` (real time) before handling; the key is already
    /// reserved, so a concurrent retry sees 409. For webhooks: delay sending.
    Latency,
    /// 503, nothing done, key left free.
    FailBeforeEffect,
    /// Effect made, key stores the real answer, the caller gets 500.
    FailAfterEffect,
    /// As `FailAfterEffect`; in the Stripe dialect the 500 (and the key's
    /// replays of it) also says `Stripe-Should-Retry: false`: Stripe
    /// telling the client a retry under the key would not help.
    FailAfterEffectNoRetry,
    /// Nothing done, and in the Stripe dialect the 500 saved under the key
    /// (Stripe's endpoint began executing, then failed and rolled back),
    /// with `Stripe-Should-Retry: false`: a retry under the key replays the
    /// same 500 (`Idempotent-Replayed: true`), and only a read shows that
    /// nothing was made. In the fake dialect (which saves no 5xx), as
    /// `fail_before_effect`.
    FailSavedBeforeEffect,
    /// Effect made, then the TCP connection is closed without any response.
    DropResponseAfterEffect,
    /// Effect made, the answer is sent after `delay_ms` (real time).
    DelayAfterEffect,
    /// 409 `idempotency_in_progress`, nothing done.
    InProgress,
    /// 429 `rate_limit`, nothing done, the key neither read nor reserved:
    /// a rate limiter in front of the idempotency layer.
    RateLimit,
    /// Charges and refunds created while the rule is active stay invisible to
    /// search for `lag_seconds` of virtual time (lists still show them).
    SearchLag,
    /// Charge only (both dialects): the charge is made with its effect
    /// pending, status `processing` (a Stripe PaymentIntent `processing`),
    /// and the request answers with it as it is (201 / 200). It becomes what
    /// it would otherwise have been (authorized, captured or declined)
    /// `lag_seconds` of virtual time later, settled by the first request,
    /// ledger read or clock move after that; the ledger counts its effect
    /// then, once.
    Processing,
    /// Charge only (both dialects): the charge is declined with the soft
    /// decline `try_again_later` (the processor could not handle it now;
    /// another may), whatever its card: processed exactly as a declining
    /// card's charge (a declined charge, no money moved, the ledger counts a
    /// decline, the key saves the 402, the decline's event goes out). It
    /// replaces a declining card's own decline. Drawn when the charge is
    /// made, so a replay under the key draws nothing and replays the
    /// decline.
    SoftDecline,
    /// Nothing done yet and no answer (the connection is closed): the
    /// request is held, its key reserved (a retry under it sees 409
    /// `idempotency_in_progress`), and its effect is made only when released
    /// ([`crate::Control::release_held`], `POST /__admin/held/release`): a
    /// provider whose queue lets a request through long after the caller
    /// gave up on it, and after its search showed nothing. A request held
    /// for the key retention or longer is abandoned without an effect (no
    /// provider acts on a request whose key it has forgotten). Charges and
    /// refunds of the fake dialect; elsewhere (the Stripe dialect) it acts as
    /// `fail_before_effect`.
    HoldEffect,
    /// Webhook only: the event is delivered twice.
    Duplicate,
    /// Webhook only: the event is held back and sent after the next one.
    Reorder,
    /// Webhook only: the first delivery is not sent; it is redelivered after
    /// the retry backoff.
    DropThenRedeliver,
}

impl FaultAction {
    fn webhook_only(self) -> bool {
        matches!(
            self,
            Self::Duplicate | Self::Reorder | Self::DropThenRedeliver
        )
    }
}

/// One fault rule, as posted to `/__admin/faults`.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct FaultRule {
    /// The operation this rule applies to.
    pub operation: Operation,
    /// What goes wrong.
    pub action: FaultAction,
    /// Only requests whose merchant reference contains this text (for
    /// capture, void and get: the charge's reference).
    #[serde(default)]
    pub reference_contains: Option<String>,
    /// Applies to the next N firings only, then the rule is removed.
    #[serde(default)]
    pub next: Option<u32>,
    /// Chance that a matching request is hit; default 1.0.
    #[serde(default)]
    pub probability: Option<f64>,
    /// Real-time delay of `latency`, `delay_after_effect` and webhook
    /// `latency`; default [`DEFAULT_DELAY`].
    #[serde(default)]
    pub delay_ms: Option<u64>,
    /// Virtual seconds of invisibility for `search_lag`, and of pending for
    /// `processing`; default [`DEFAULT_LAG_SECONDS`].
    #[serde(default)]
    pub lag_seconds: Option<u64>,
}

/// Delay used when a rule that needs one does not say.
pub const DEFAULT_DELAY: Duration = Duration::from_millis(1000);
/// Search lag (and `processing` time) used when a rule does not say.
pub const DEFAULT_LAG_SECONDS: u64 = 60;

impl FaultRule {
    /// A rule that always fires, with no reference filter: the common case in
    /// tests, refined with the `with_*` methods.
    pub fn new(operation: Operation, action: FaultAction) -> Self {
        Self {
            operation,
            action,
            reference_contains: None,
            next: None,
            probability: None,
            delay_ms: None,
            lag_seconds: None,
        }
    }

    /// Restrict to the next `n` firings.
    pub fn with_next(mut self, n: u32) -> Self {
        self.next = Some(n);
        self
    }

    /// Restrict to references containing `text`.
    pub fn with_reference(mut self, text: impl Into<String>) -> Self {
        self.reference_contains = Some(text.into());
        self
    }

    /// Fire with probability `p` (drawn from the seeded RNG).
    pub fn with_probability(mut self, p: f64) -> Self {
        self.probability = Some(p);
        self
    }

    /// Delay for `latency` / `delay_after_effect`.
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay_ms = Some(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX));
        self
    }

    /// Invisibility window for `search_lag`, pending time for `processing`.
    pub fn with_lag_seconds(mut self, seconds: u64) -> Self {
        self.lag_seconds = Some(seconds);
        self
    }

    /// Rejects rules that could never fire, so the admin API can say so
    /// instead of silently ignoring them.
    pub fn validate(&self) -> Result<(), String> {
        if self.action == FaultAction::SoftDecline
            && !matches!(self.operation, Operation::Charge | Operation::Any)
        {
            return Err(format!(
                "soft_decline applies to charge only (it declines a charge being created), \
                 not to {}; put it on charge or any",
                format!("{:?}", self.operation).to_lowercase()
            ));
        }
        let webhook_only = self.action.webhook_only();
        let fits_webhook = webhook_only || self.action == FaultAction::Latency;
        if self.operation == Operation::Webhook && !fits_webhook {
            return Err(format!(
                "action {:?} does not apply to webhooks",
                self.action
            ));
        }
        if self.operation != Operation::Webhook && webhook_only {
            return Err(format!("action {:?} applies to webhooks only", self.action));
        }
        if self.action == FaultAction::HoldEffect
            && !matches!(self.operation, Operation::Charge | Operation::Refund)
        {
            return Err("hold_effect applies to charge and refund only".into());
        }
        if self.action == FaultAction::Processing
            && !matches!(self.operation, Operation::Charge | Operation::Any)
        {
            return Err("processing applies to charge only".into());
        }
        if self.action == FaultAction::SearchLag && self.operation == Operation::List {
            return Err(
                "search_lag does not apply to list: lists are strongly consistent; \
                 put it on search or on the creating operation"
                    .into(),
            );
        }
        match self.probability {
            Some(p) if !(0.0..=1.0).contains(&p) => Err("probability must be within 0..=1".into()),
            _ => Ok(()),
        }
    }

    pub(crate) fn delay(&self) -> Duration {
        self.delay_ms.map_or(DEFAULT_DELAY, Duration::from_millis)
    }

    fn matches(&self, operation: Operation, reference: Option<&str>) -> bool {
        let operation_matches = self.operation == operation
            || (self.operation == Operation::Any && operation != Operation::Webhook);
        operation_matches
            && match &self.reference_contains {
                None => true,
                Some(pattern) => reference.is_some_and(|r| r.contains(pattern.as_str())),
            }
    }
}

/// The faults chosen for one request or event: an optional delay before
/// handling plus at most one outcome, so a chaos run can combine latency with
/// a lost response.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Picked {
    pub(crate) latency: Option<Duration>,
    pub(crate) outcome: Option<(FaultAction, Duration)>,
}

/// The active rules, in the order they were added (first match wins).
#[derive(Debug, Default)]
pub(crate) struct FaultBook {
    rules: Vec<(u64, FaultRule)>,
    last_id: u64,
    /// How often rules of each (operation, action) fired since the start,
    /// cleared rules included: what a chaos run shows it really did.
    fired: std::collections::BTreeMap<(Operation, FaultAction), u64>,
}

impl FaultBook {
    pub(crate) fn add(&mut self, rule: FaultRule) -> u64 {
        self.last_id += 1;
        self.rules.push((self.last_id, rule));
        self.last_id
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    pub(crate) fn clear(&mut self) {
        self.rules.clear();
    }

    /// The active rules; `next` shows what is left of each budget.
    pub(crate) fn list(&self) -> Vec<(u64, FaultRule)> {
        self.rules.clone()
    }

    /// Firings per (operation, action) since the start.
    pub(crate) fn fired(&self) -> Vec<FiredCount> {
        self.fired
            .iter()
            .map(|(&(operation, action), &count)| FiredCount {
                operation,
                action,
                count,
            })
            .collect()
    }

    /// Faults for one provider API request (`operation` is never `Webhook`)
    /// or, with `Operation::Webhook`, for one event.
    pub(crate) fn pick(
        &mut self,
        operation: Operation,
        reference: Option<&str>,
        rng: &mut StdRng,
    ) -> Picked {
        let mut picked = Picked::default();
        if self.rules.is_empty() {
            return picked;
        }
        let for_webhooks = operation == Operation::Webhook;
        self.fire(operation, reference, rng, |rule, rng| match rule.action {
            // Drawn when the object is created, not per request.
            FaultAction::SearchLag | FaultAction::Processing | FaultAction::SoftDecline => false,
            FaultAction::HoldEffect
                if !matches!(operation, Operation::Charge | Operation::Refund) =>
            {
                false
            }
            action if action != FaultAction::Latency && action.webhook_only() != for_webhooks => {
                false
            }
            FaultAction::Latency => {
                let fires = picked.latency.is_none() && draw(rule, rng);
                if fires {
                    picked.latency = Some(rule.delay());
                }
                fires
            }
            action => {
                let fires = picked.outcome.is_none() && draw(rule, rng);
                if fires {
                    picked.outcome = Some((action, rule.delay()));
                }
                fires
            }
        });
        picked
    }

    /// The search lag of a charge or refund being created now, if a
    /// `search_lag` rule for `search`, `any` or the creating operation fires.
    pub(crate) fn search_lag(
        &mut self,
        created_by: Operation,
        reference: &str,
        rng: &mut StdRng,
    ) -> Option<u64> {
        if self.rules.is_empty() {
            return None;
        }
        let mut lag = None;
        for operation in [created_by, Operation::Search] {
            self.fire(operation, Some(reference), rng, |rule, rng| {
                let fires =
                    rule.action == FaultAction::SearchLag && lag.is_none() && draw(rule, rng);
                if fires {
                    lag = Some(rule.lag_seconds.unwrap_or(DEFAULT_LAG_SECONDS));
                }
                fires
            });
        }
        lag
    }

    /// How long a charge being created now stays `processing`, if a
    /// `processing` rule for `charge` (or `any`) fires.
    pub(crate) fn processing(&mut self, reference: &str, rng: &mut StdRng) -> Option<u64> {
        self.on_charge_creation(FaultAction::Processing, reference, rng)
    }

    /// Whether a charge being created now is declined `try_again_later`: a
    /// `soft_decline` rule for `charge` (or `any`) fires.
    pub(crate) fn soft_decline(&mut self, reference: &str, rng: &mut StdRng) -> bool {
        self.on_charge_creation(FaultAction::SoftDecline, reference, rng)
            .is_some()
    }

    /// Fires the first matching rule of `action` (drawn once per created
    /// charge) for the creation of a charge; its `lag_seconds`, defaulted.
    fn on_charge_creation(
        &mut self,
        action: FaultAction,
        reference: &str,
        rng: &mut StdRng,
    ) -> Option<u64> {
        if self.rules.is_empty() {
            return None;
        }
        let mut fired = None;
        self.fire(Operation::Charge, Some(reference), rng, |rule, rng| {
            let fires = rule.action == action && fired.is_none() && draw(rule, rng);
            if fires {
                fired = Some(rule.lag_seconds.unwrap_or(DEFAULT_LAG_SECONDS));
            }
            fires
        });
        fired
    }

    /// Offers each matching rule to `take`, which decides (drawing the
    /// probability only if it wants the rule) whether it fires; a fired rule
    /// spends one unit of its `next` budget.
    fn fire(
        &mut self,
        operation: Operation,
        reference: Option<&str>,
        rng: &mut StdRng,
        mut take: impl FnMut(&FaultRule, &mut StdRng) -> bool,
    ) {
        let mut index = 0;
        while index < self.rules.len() {
            let rule = &mut self.rules[index].1;
            let fires = rule.matches(operation, reference) && take(rule, rng);
            if fires {
                *self.fired.entry((rule.operation, rule.action)).or_default() += 1;
            }
            if fires && let Some(left) = rule.next.as_mut() {
                *left = left.saturating_sub(1);
                if *left == 0 {
                    self.rules.remove(index);
                    continue;
                }
            }
            index += 1;
        }
    }
}

/// How often rules of one (operation, action) fired.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct FiredCount {
    pub operation: Operation,
    pub action: FaultAction,
    pub count: u64,
}

/// Draws the rule's probability; certain rules draw nothing so that they do
/// not shift the sequence seen by the random ones.
fn draw(rule: &FaultRule, rng: &mut StdRng) -> bool {
    match rule.probability {
        Some(p) if p < 1.0 => rng.random_bool(p.max(0.0)),
        _ => true,
    }
}
