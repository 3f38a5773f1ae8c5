#![doc = include_str!("../README.md")]

pub mod clock;
pub mod decision;
pub mod egress;
pub mod fingerprint;
pub mod ids;
pub mod intent;
pub mod key;
pub mod money;
pub mod records;
pub mod routing;
pub mod signature;
pub mod standard_webhooks;
pub mod state;
mod stored;
pub mod text;

pub use clock::{Clock, ManualClock, SystemClock};
pub use decision::Decision;
pub use fingerprint::{CONTRACT_VERSION, Fingerprint};
pub use ids::{
    AccountId, AttemptId, EndpointId, EventId, IntentId, OutboxId, PaymentId, RefundId, RunId,
    TokenId,
};
pub use intent::{IntentName, Operation, OrderRef, OrderRefError, attempt_reference};
pub use key::{IdempotencyKey, KeyError, KeyHash};
pub use money::{Amount, AmountError, Currency, CurrencyError};
pub use records::{ConflictKind, DeliveryState, WebhookOutcome};
pub use state::{
    AttemptState, CaptureMethod, IllegalTransition, PaymentEvent, PaymentStatus, RefundStatus,
};
