#![doc = include_str!("../README.md")]

pub mod dispatch;
pub mod egress;
pub mod retry;
mod worker;

pub use dispatch::{DeliveryStep, Dispatcher, DispatcherConfig};
pub use worker::{Step, Worker, WorkerConfig, WorkerError};
