//! # overlaybd (not yet implemented)
//!
//! Will hold the layered block device: sealed read-only layers, a writable upper, an extent
//! index, commit and seal. Nothing is here yet; see the overlaybd issue. This crate exports no
//! API until then.
