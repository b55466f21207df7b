//! # sandbox-runtime (not yet implemented)
//!
//! Will compose sandbox roots (overlayfs over read-only layers with a local upper), run them,
//! suspend and resume them, and turn a live upper into a new layer (pack_diff). Nothing is here
//! yet. This crate exports no API until then.
