//! Fuzz the tar input parser (decompression detection, headers, GNU/PAX extensions, sparse
//! maps, whiteouts, the path rules): arbitrary bytes as a layer tar stream, spooled into a
//! scratch directory. Nothing may panic, loop forever or allocate without bound; the spool
//! has no name, so the directory must stay empty whatever happens.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("strata-fuzz-tar-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("create the scratch directory");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = scratch();
    let _ = erofs_builder::tar::fuzz_read_tar(data, dir);
    assert_eq!(
        std::fs::read_dir(dir).expect("read_dir").count(),
        0,
        "the tar spool left a file behind"
    );
});
