#![doc = include_str!("../README.md")]
//!
//! # A runnable example
//!
//! The README's integration, run as a doc test against a real cobro API
//! served in-process on SQLite (hidden lines start it; `cargo test --doc -p
//! cobro-client`), with the durable journal in a temporary file:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let cobro = cobro_test_support::TestApp::spawn(cobro_test_support::Backend::Sqlite).await;
//! # let (url, token) = (cobro.url.clone(), cobro.token.clone());
//! # let dir = tempfile::tempdir()?;
//! # let journal_file = dir.path().join("intents.db");
//! use cobro_client::{Client, CreatePayment, SqliteJournal};
//!
//! let journal = SqliteJournal::open(&journal_file).await?;
//! let client = Client::new(&url, &token, journal)?;
//! client.resume_pending().await?; // first thing after every start
//!
//! let request = CreatePayment::new("pedido-842", 1999, "EUR", "pm_card_visa");
//! let payment = client.create_payment("pedido-842/pay", &request).await?;
//! assert_eq!(payment.status, 201);
//! assert!(!payment.was_replayed()); // executed now, not a replay
//!
//! // The same intent again (a retry, a restarted process): same key, same
//! // payment, answered from the journal without a request.
//! let again = client.create_payment("pedido-842/pay", &request).await?;
//! assert!(again.from_journal);
//! assert_eq!(again.value.id, payment.value.id);
//! assert_eq!(again.idempotency_key, payment.idempotency_key);
//!
//! // A different request under that reference is refused before sending.
//! let other = CreatePayment::new("pedido-842", 2500, "EUR", "pm_card_visa");
//! let refused = client.create_payment("pedido-842/pay", &other).await;
//! assert!(matches!(refused, Err(cobro_client::Error::IntentConflict { .. })));
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//!
//! | module | what it holds |
//! |---|---|
//! | `client` | [`Client`]: journal first, then send; [`Answer`], [`Event`], [`Client::resume_pending`], [`Client::wait_for_payment`] |
//! | `journal` | the [`Journal`] trait, [`Intent`], [`StoredAnswer`], [`MemoryJournal`] |
//! | `sqlite` | [`SqliteJournal`]: the durable journal (WAL, `synchronous=FULL`) |
//! | `retry` | [`RetryPolicy`] and which answers are retried |
//! | `types` | requests and answers mirrored from `/openapi.json` |
//! | `error` | [`Error`], [`ApiProblem`], [`Problem`], [`ProblemCode`] |
//! | `webhook` | receiving cobro's events: [`webhook::verify_event`], [`webhook::EventInbox`] (dedup by id, apply by sequence) |

/// Declares a string enum with an `Other` arm, (de)serialised as its string.
macro_rules! string_enum {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        #[serde(from = "String", into = "String")]
        pub enum $name {
            $($(#[$vdoc])* $variant,)+
            /// A value this client does not know (a newer server).
            Other(String),
        }

        impl $name {
            /// Every value this client knows, in the server's order.
            pub const KNOWN: &[&str] = &[$($text),+];

            pub fn as_str(&self) -> &str {
                match self {
                    $(Self::$variant => $text,)+
                    Self::Other(other) => other,
                }
            }
        }

        impl From<String> for $name {
            fn from(text: String) -> Self {
                match text.as_str() {
                    $($text => Self::$variant,)+
                    _ => Self::Other(text),
                }
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.as_str().to_owned()
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

mod client;
mod error;
mod journal;
mod retry;
mod sqlite;
mod types;
pub mod webhook;

pub use client::{Answer, Client, Event, Resource, Resumed};
pub use error::{ApiProblem, Error, FieldError, Problem, ProblemCode};
pub use journal::{Intent, Journal, JournalError, MemoryJournal, NewIntent, StoredAnswer};
pub use retry::RetryPolicy;
pub use sqlite::SqliteJournal;
pub use types::{
    Attempt, AttemptState, CaptureMethod, CreatePayment, CreateRefund, Failure, ListPayments,
    NextAction, Operation, Payment, PaymentList, PaymentStatus, RedirectToUrl, Refund,
    RefundStatus, Routing, RoutingMove,
};
