//! Strata's own FUSE server core: the wire format ([`abi`]), a request parser ([`request`])
//! and sessions ([`session`]) that can resume a connection another process initialised.
//!
//! `fuser` 0.18 can only start a session with the kernel's INIT; a connection taken over from
//! the fd holder (`crate::holder`) after a crash or an upgrade has had its INIT already. The
//! blob mount and the OverlayBD image file (`crate::bd::fuse`) need a few dozen opcodes
//! between them, so this module implements them directly rather than patching `fuser`.

pub mod abi;
pub mod request;
pub mod session;

pub use request::{Op, Request};
pub use session::{handshake, Channel, Handler, InitPolicy, Negotiated, Reply, Session};
