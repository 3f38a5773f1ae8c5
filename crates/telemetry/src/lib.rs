#![doc = include_str!("../README.md")]

pub mod context;
pub mod metrics;

pub use context::{
    StoredContext, current_context, extract_http, inject_current, link_to_stored,
    set_parent_from_stored, tracing_active,
};
