//! Placeholder until the fake provider lands.
