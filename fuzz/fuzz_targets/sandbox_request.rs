//! Fuzz what the sandbox runtime parses: `sandbox_*` request lines from the node's socket and
//! the `sandbox.json` records a restarted daemon reads back. Neither may panic; what parses
//! serialises and parses back the same. Residue rules (`pack-diff --strip FILE`, gitignore
//! syntax) compile or fail with an error, and match any path without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_runtime::proto::{parse_stack, Request};
use sandbox_runtime::Record;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = serde_json::from_slice::<Request>(data) {
        let back: Request = serde_json::from_value(r.to_value()).expect("a request round-trips");
        assert_eq!(back, r);
        if let Request::SandboxRun(run) = &r {
            let _ = parse_stack(&run.stack);
        }
        if let Request::SandboxPack(p) = &r {
            if let Some(rules) = &p.strip {
                strip_rules(rules);
            }
        }
    }
    for id in ["a", "sb-0123", "x"] {
        if let Some(rec) = Record::parse(data, id) {
            assert_eq!(rec.id, id);
            let text = serde_json::to_vec(&rec).expect("a record serialises");
            assert_eq!(Record::parse(&text, id), Some(rec));
        }
    }
    if let Ok(s) = std::str::from_utf8(data) {
        strip_rules(s);
        for layer in parse_stack(s) {
            assert!(!layer.is_empty() && !layer.contains(','));
        }
    }
});

fn strip_rules(text: &str) {
    use sandbox_runtime::pack::residue::Rules;
    if let Ok(r) = Rules::new(false, Some(text)) {
        for (p, dir) in [("/tmp/x", false), ("/a/b/c", true), ("/", true), ("/.wh.x", false)] {
            let _ = r.strips(std::path::Path::new(p), dir);
        }
    }
}
