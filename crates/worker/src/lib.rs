#![doc = include_str!("../README.md")]

pub mod dispatch;
pub mod evidence;
pub mod retry;
pub mod settle;
mod worker;

pub use dispatch::{DeliveryStep, Dispatcher, DispatcherConfig};
pub use evidence::{Fit, fit};
pub use settle::{
    Applied, ChargeNow, Proof, Source, apply_proof, hand_to_reconciler, hold_cancel,
    settle_held_cancels, stop_the_line,
};
pub use worker::{Step, Worker, WorkerConfig, WorkerError};
