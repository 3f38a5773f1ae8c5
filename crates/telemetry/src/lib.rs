#![doc = include_str!("../README.md")]

pub mod context;
pub mod metrics;

pub use context::{
    StoredContext, attach_parent, current_context, extract_http, inject_current, link_to_stored,
    set_parent_from_stored, traces_on, tracing_active,
};
