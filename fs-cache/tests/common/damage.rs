//! Damage behind the cache's back (included by the cache tests with `#[path]`).

use std::path::Path;

/// Flip bits of the byte at `at` of `path`, in place (a sparse file stays sparse).
pub fn flip(path: &Path, at: u64, bits: u8) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::options()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= bits;
    f.write_all_at(&b, at).unwrap();
}
