//! # erofs-builder (not yet implemented)
//!
//! Will write and read EROFS images: full images, and lazy layers (a meta image plus a data
//! blob of 256 KiB chunks), from a directory, an OCI layer tar or an overlay upper. Nothing is
//! here yet; see the erofs-builder issue. This crate exports no API until then.
