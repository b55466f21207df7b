//! # overlaybd: Strata's layered block device
//!
//! A microVM disk as a stack of **sealed layers** (immutable files, stored content-addressed
//! and read lazily through the chunk cache) under one **writable upper** (a local directory),
//! like containerd/overlaybd, in Strata's own format. The byte layouts and the rules below are
//! specified in `docs/format.md`.
//!
//! - [`format`](mod@format): sealed layers: [`SealedLayer::open`] parses and checks one; [`LayerId`].
//! - [`upper`]: [`Upper`]: append-only data file + checksummed index log with flush barriers.
//! - [`Device`]: the stack; reads merge it, writes and discards go to the upper, `commit`
//!   seals the upper into a new layer.
//! - [`source`]: where a layer's bytes come from: [`FileSource`], [`MemSource`], [`BlobSource`]
//!   (the chunk cache, async, driven from the synchronous block path; see its docs).
//! - [`publish`]: [`push_layer`] stores a sealed layer as a versioned layer (`KIND/NAME:VERSION`),
//!   [`resolve_stack`] turns a stored top layer into its stack.
//!
//! # Invariants
//! - **Newest wins.** A read of any byte returns what the newest layer that maps it holds (the
//!   upper, then the sealed layers from the top down); unmapped bytes read zeros; a discard
//!   maps its range to zeros. Lookups are O(log n): the sealed layers are merged into one sorted
//!   segment list at open, the upper keeps a `BTreeMap`.
//! - **Flushed writes survive a crash.** After [`Device::flush`] returns, every write and
//!   discard before it survives kill -9 or power loss; a torn tail of the log is detected on
//!   open and dropped, never replayed as a wrong write.
//! - **Stacks are checked.** Each layer records its parent's id, and an upper records the id of
//!   the layer it was created on; a stack that does not chain is refused at open.
//! - **Bad input is an error.** A truncated or corrupt layer, a trailer or an extent pointing
//!   outside the file, unsorted or overlapping extents: [`Error::Corrupt`] at open, never a
//!   panic, a wrong read, or an allocation larger than the file.

mod device;
mod error;
mod extmap;
pub mod format;
pub mod publish;
pub mod source;
pub mod upper;

pub use device::Device;
pub use error::{Error, Result};
pub use format::{Extent, LayerId, SealedInfo, SealedLayer, SECTOR};
pub use publish::{push_layer, resolve_stack, PushedLayer};
pub use source::{BlobSource, FileSource, LayerSource, MemSource};
pub use upper::{Recovery, Upper};
