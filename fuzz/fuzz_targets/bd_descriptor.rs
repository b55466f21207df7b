//! Fuzz what a block-device directory holds besides its upper: the descriptor
//! (`strata-bd.json`, through `Descriptor::read` on a real file) and the ublk recovery record
//! (`strata-bd.ublk.json`, `UblkRecord::parse`). Neither may panic; what is accepted keeps
//! its documented limits and reads back the same once written. A record's checksum is
//! recomputed over its `record` object so that mutations reach the checks behind it.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use ublk_daemon::bd::{Descriptor, UblkRecord, DESCRIPTOR_FILE};

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("strata-fuzz-bd-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("create the scratch directory");
        d
    })
}

/// The record with its check recomputed: the blake3 of the compact `record` object, fields
/// in the order the code writes them (as `recovery.rs` documents).
fn resealed(data: &[u8]) -> Option<Vec<u8>> {
    let v: serde_json::Value = serde_json::from_slice(data).ok()?;
    let rec = v.get("record")?.as_object()?;
    let order = [
        "version", "dev_id", "queues", "depth", "max_io", "size", "dir", "tag",
    ];
    let mut body = String::from("{");
    for (i, k) in order.iter().enumerate() {
        let field = serde_json::to_string(rec.get(*k)?).ok()?;
        if i > 0 {
            body.push(',');
        }
        body.push_str(&format!("\"{k}\":{field}"));
    }
    body.push('}');
    let check = blake3::hash(body.as_bytes()).to_hex();
    Some(format!("{{\"record\":{body},\"check\":\"{check}\"}}\n").into_bytes())
}

fn check_record(data: &[u8]) {
    if let Ok(r) = UblkRecord::parse(data) {
        assert!(r.size > 0 && r.size % 512 == 0);
        assert!(r.dir.is_absolute());
        assert_ne!(r.tag, 0);
        let bytes = r.encode().expect("an accepted record encodes");
        assert_eq!(UblkRecord::parse(&bytes), Ok(r));
    }
}

fuzz_target!(|data: &[u8]| {
    let d = dir();
    let path = d.join(DESCRIPTOR_FILE);
    std::fs::write(&path, data).expect("write the fuzz input");
    if let Ok(desc) = Descriptor::read(d) {
        assert!(desc.size > 0 && desc.size % 512 == 0);
        assert_eq!(desc.base_id.len(), 64);
        let body = serde_json::to_vec_pretty(&desc).expect("a descriptor serialises");
        std::fs::write(&path, body).expect("write it back");
        assert_eq!(
            Descriptor::read(d).expect("a written descriptor reads"),
            desc
        );
    }
    let _ = std::fs::remove_file(&path);
    check_record(data);
    if let Some(sealed) = resealed(data) {
        check_record(&sealed);
    }
});
