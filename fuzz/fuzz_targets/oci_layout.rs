//! Fuzz what `strata image import` parses before any layer tar: the layout's JSON documents
//! (oci-layout, index, manifest, config, docker manifest.json: digests, media types,
//! platforms, diff_ids) and image archives (our tar index: checksums, long names, PAX,
//! links, traversal), planned as an import. Nothing may panic or allocate without bound;
//! the archive lives in an unnamed file, so the scratch directory must stay empty. Seed
//! with `index.json`/manifests of real layouts and small `strata layer export --oci x.tar`
//! archives.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("strata-fuzz-oci-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("create the scratch directory");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = scratch();
    oci_image::fuzz_parse(data, dir);
    assert_eq!(
        std::fs::read_dir(dir).expect("read_dir").count(),
        0,
        "the archive left a file behind"
    );
});
