//! Fuzz what a suspend and a resume parse: `/proc/<pid>/smaps` text (a sandbox's process names
//! its own mappings: `prctl(PR_SET_VMA_ANON_NAME)`, file names with spaces) and the stored
//! residency record (`suspend.json`). Neither may panic; a record that parses has only runs a
//! reader can add up (offset + length never overflows, anonymous ranges start before they end)
//! and serialises and parses back the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_runtime::resident::{merge, parse_smaps, Residency};

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        for v in parse_smaps(text) {
            assert!(v.start <= v.end);
            let _ = v.is_anon();
        }
    }
    if let Ok(r) = Residency::parse(data) {
        for f in &r.files {
            for [o, l] in &f.ranges {
                assert!(o.checked_add(*l).is_some());
            }
            let merged = merge(f.ranges.clone());
            assert!(merged.windows(2).all(|w| w[0][0] + w[0][1] < w[1][0]));
        }
        for p in &r.processes {
            assert!(p.anon.iter().all(|[s, e]| s < e));
        }
        let text = serde_json::to_vec(&r).expect("a record serialises");
        assert_eq!(Residency::parse(&text).expect("it parses back"), r);
    }
});
