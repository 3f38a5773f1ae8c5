#![doc = include_str!("../README.md")]

pub mod apply;
pub mod books;
pub mod call;
pub mod evidence;
pub mod routing;
pub mod webhook;

pub use apply::{
    Applied, ChargeNow, Proof, Source, apply_proof, apply_proof_locked, await_customer,
    hand_to_reconciler, hold_cancel, settle_held_cancels, stop_the_line,
};
pub use evidence::{Fit, fit};
pub use webhook::deliver;
