//! Fuzz the parsers of what a store holds: layer manifests, layer references, manifest and blob
//! keys, digests. None may panic or allocate without bound, whatever the input.
#![no_main]

use fs_cache::store::blob_of_key;
use fs_cache::{Digest, LayerRef, Manifest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let layer: LayerRef = "base/fuzz:1".parse().expect("a valid reference");
    if let Ok(m) = Manifest::parse(&layer, data) {
        // What parses must serialise and parse back to the same manifest.
        let again = Manifest::parse(&layer, &m.to_json()).expect("a written manifest parses");
        assert_eq!(again, m);
        let _ = m.total_size();
    }
    if let Ok(s) = std::str::from_utf8(data) {
        if let Ok(r) = s.parse::<LayerRef>() {
            assert_eq!(r.to_string(), s);
            assert_eq!(LayerRef::from_manifest_key(&r.manifest_key()), Some(r));
        }
        let _ = LayerRef::from_manifest_key(s);
        let _ = blob_of_key(s);
        let _ = s.parse::<Digest>();
        let _ = fs_cache::backend::validate_key(s);
    }
});
