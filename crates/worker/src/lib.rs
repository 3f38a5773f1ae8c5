#![doc = include_str!("../README.md")]

pub mod retry;
pub mod settle;
mod worker;

pub use settle::{Applied, Proof, apply_proof, hand_to_reconciler};
pub use worker::{Step, Worker, WorkerConfig, WorkerError};
