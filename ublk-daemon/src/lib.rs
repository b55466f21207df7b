//! # ublk-daemon (not yet implemented)
//!
//! Will hold the node daemon's frontends: FUSE blob files for kernel EROFS mounts and ublk /
//! FUSE block devices for OverlayBD. Nothing is here yet; see the ublk-daemon issues. This
//! crate exports no API until then.
