//! The node's persistent state: `<run-dir>/state.json`.
//!
//! ```json
//! {
//!   "version": 1,
//!   "store": "/var/lib/strata/store",
//!   "layers": {
//!     "<meta digest hex>": {
//!       "refs": ["base/os:1"],
//!       "meta": {"digest": "<hex>", "size": 123},
//!       "blobs": [{"digest": "<hex>", "size": 456}],
//!       "pins": 1
//!     }
//!   },
//!   "mounts": {
//!     "/mnt/sandbox": {
//!       "seq": 7, "layers": ["base/os:1", "toolkit/py:3"], "layer_ids": ["<hex>", "<hex>"],
//!       "upper": "/var/sandbox/upper", "work": "/var/sandbox/upper.work"
//!     }
//!   },
//!   "next_seq": 8,
//!   "restarts": 2,
//!   "takeovers": 1
//! }
//! ```
//!
//! Invariants: a layer is listed while `pins > 0` or a mount names it (its user count is the
//! number of mounts whose `layer_ids` hold it); every id in a mount's `layer_ids` is listed
//! under `layers`. The file is replaced atomically (temporary file, fsync, rename, fsync of
//! the directory), after every change and before the change is acknowledged, so a crash at
//! any point leaves either the old or the new state. Writes are group commits (`Node::stage`,
//! `Node::commit`): changes made while one write is in flight go to disk together in the
//! next, never under the node's lock (measured with strace: 128 mount + umount cycles by 32
//! clients wrote the file 60 times; each cycle used to write it 3 times, 384 in all).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use fs_cache::BlobRef;
use serde::{Deserialize, Serialize};

/// The state file's format version.
pub const STATE_VERSION: u32 = 1;

/// A layer the node serves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerState {
    pub refs: BTreeSet<String>,
    pub meta: BlobRef,
    pub blobs: Vec<BlobRef>,
    pub pins: u32,
    /// Its blobs that its current EROFS mount reads in passthrough mode (as it was mounted;
    /// kept here so that a daemon taking the mount over reports it).
    #[serde(default)]
    pub passthrough_blobs: u32,
}

/// A user mount.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountState {
    /// Creation order (unmounted newest first).
    pub seq: u64,
    pub layers: Vec<String>,
    pub layer_ids: Vec<String>,
    #[serde(default)]
    pub upper: Option<PathBuf>,
    #[serde(default)]
    pub work: Option<PathBuf>,
}

impl MountState {
    /// `bind` for one layer without an upper, else `overlay`.
    pub fn kind(&self) -> &'static str {
        if self.layer_ids.len() == 1 && self.upper.is_none() {
            "bind"
        } else {
            "overlay"
        }
    }
}

/// An absolute path with only normal components (what `canonicalize` returns).
fn is_plain_absolute(p: &Path) -> bool {
    use std::path::Component;
    let mut c = p.components();
    c.next() == Some(Component::RootDir) && c.all(|c| matches!(c, Component::Normal(_)))
}

/// Everything that survives a restart.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    pub version: u32,
    pub store: String,
    pub layers: BTreeMap<String, LayerState>,
    pub mounts: BTreeMap<PathBuf, MountState>,
    #[serde(default)]
    pub next_seq: u64,
    /// Starts of a daemon that found an earlier one's state here, and those that took over
    /// its FUSE connection (the `restarts` and `takeovers` counters of `strata status`).
    #[serde(default)]
    pub restarts: u64,
    #[serde(default)]
    pub takeovers: u64,
}

impl State {
    pub fn new(store: &str) -> Self {
        Self {
            version: STATE_VERSION,
            store: store.to_owned(),
            ..Self::default()
        }
    }

    /// Mounts that use layer `id`.
    pub fn users(&self, id: &str) -> u32 {
        self.mounts
            .values()
            .filter(|m| m.layer_ids.iter().any(|l| l == id))
            .count() as u32
    }

    /// The data blobs of every listed layer.
    pub fn blobs_in_use(&self) -> std::collections::HashSet<fs_cache::Digest> {
        self.layers
            .values()
            .flat_map(|l| l.blobs.iter().map(|b| b.digest))
            .collect()
    }

    /// Whether layer `id` is still needed.
    pub fn needed(&self, id: &str) -> bool {
        self.layers.get(id).is_some_and(|l| l.pins > 0) || self.users(id) > 0
    }

    /// Check the invariants of a loaded file, and everything in it that becomes a path or a
    /// mount option: a layer id is its meta image's digest in lowercase hex (it names a
    /// directory under `layers/`), references parse, mountpoints, uppers and work
    /// directories are absolute and normal (no `.`, `..`, or empty components).
    pub fn check(&self) -> Result<(), String> {
        if self.version != STATE_VERSION {
            return Err(format!(
                "version {} (this build reads {STATE_VERSION})",
                self.version
            ));
        }
        for (id, l) in &self.layers {
            if *id != l.meta.digest.to_hex() {
                return Err(format!(
                    "layer id {id:?} is not its meta image's digest {}",
                    l.meta.digest
                ));
            }
            if let Some(r) = l
                .refs
                .iter()
                .find(|r| r.parse::<fs_cache::LayerRef>().is_err())
            {
                return Err(format!("layer {id}: bad reference {r:?}"));
            }
        }
        for (mp, m) in &self.mounts {
            for (what, p) in [
                ("mountpoint", Some(mp)),
                ("upper", m.upper.as_ref()),
                ("work", m.work.as_ref()),
            ] {
                if let Some(p) = p {
                    if !is_plain_absolute(p) {
                        return Err(format!(
                            "mount {}: {what} {p:?} is not a plain absolute path",
                            mp.display()
                        ));
                    }
                }
            }
            if m.upper.is_some() != m.work.is_some() {
                return Err(format!(
                    "mount {}: an upper needs a work directory",
                    mp.display()
                ));
            }
        }
        for (mp, m) in &self.mounts {
            if m.layer_ids.is_empty() || m.layer_ids.len() != m.layers.len() {
                return Err(format!("mount {} names no layers", mp.display()));
            }
            if let Some(id) = m.layer_ids.iter().find(|id| !self.layers.contains_key(*id)) {
                return Err(format!("mount {} uses unknown layer {id}", mp.display()));
            }
        }
        Ok(())
    }

    /// Read the state file; `Ok(None)` if there is none.
    pub fn load(path: &Path) -> Result<Option<Self>, String> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("read {}: {e}", path.display())),
        };
        let s: State = serde_json::from_slice(&bytes)
            .map_err(|e| format!("{} is not a state file: {e}", path.display()))?;
        s.check().map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Some(s))
    }

    /// The state file's bytes.
    pub fn to_bytes(&self) -> std::io::Result<Vec<u8>> {
        let mut body = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        body.push(b'\n');
        Ok(body)
    }

    /// Replace the state file atomically.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        fs_cache::write_atomic(path, &self.to_bytes()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fs_cache::Digest;

    #[test]
    fn round_trip_and_checks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        assert_eq!(State::load(&path).unwrap(), None);
        let mut s = State::new("/store");
        let id = Digest::of(b"meta").to_hex();
        s.layers.insert(
            id.clone(),
            LayerState {
                refs: ["base/os:1".to_owned()].into(),
                meta: BlobRef::plain(Digest::of(b"meta"), 4),
                blobs: vec![],
                pins: 0,
                passthrough_blobs: 0,
            },
        );
        s.mounts.insert(
            "/mnt/a".into(),
            MountState {
                seq: 0,
                layers: vec!["base/os:1".into()],
                layer_ids: vec![id.clone()],
                upper: None,
                work: None,
            },
        );
        assert_eq!(s.users(&id), 1);
        assert!(s.needed(&id));
        s.save(&path).unwrap();
        assert_eq!(State::load(&path).unwrap(), Some(s.clone()));
        s.layers.clear();
        s.save(&path).unwrap();
        assert!(State::load(&path).unwrap_err().contains("unknown layer"));
        std::fs::write(&path, b"{").unwrap();
        assert!(State::load(&path).unwrap_err().contains("not a state file"));

        // Whatever becomes a path is checked before it is trusted.
        let mut good = State::new("/store");
        good.layers.insert(
            id.clone(),
            LayerState {
                refs: ["base/os:1".to_owned()].into(),
                meta: BlobRef::plain(Digest::of(b"meta"), 4),
                blobs: vec![],
                pins: 1,
                passthrough_blobs: 0,
            },
        );
        good.save(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(State::load(&path).unwrap().is_some());
        // Truncated anywhere: refused.
        for cut in [1, text.len() / 3, text.len() / 2, text.len() - 3] {
            std::fs::write(&path, &text[..cut]).unwrap();
            assert!(State::load(&path).is_err(), "truncated at {cut}");
        }
        let hostile = [
            text.replace(&id, "../../etc"),
            text.replace("base/os:1", "base/../x"),
        ];
        for bad in hostile {
            std::fs::write(&path, bad).unwrap();
            assert!(State::load(&path).is_err());
        }
        let mut bad_mount = good.clone();
        bad_mount.mounts.insert(
            "/mnt/../etc".into(),
            MountState {
                seq: 0,
                layers: vec!["base/os:1".into()],
                layer_ids: vec![id.clone()],
                upper: None,
                work: None,
            },
        );
        bad_mount.save(&path).unwrap();
        assert!(State::load(&path).unwrap_err().contains("plain absolute"));
        let mut bad_upper = good.clone();
        bad_upper.mounts.insert(
            "/mnt/a".into(),
            MountState {
                seq: 0,
                layers: vec!["base/os:1".into()],
                layer_ids: vec![id.clone()],
                upper: Some("relative/upper".into()),
                work: Some("/w".into()),
            },
        );
        bad_upper.save(&path).unwrap();
        assert!(State::load(&path).unwrap_err().contains("upper"));
    }
}
