//! Fuzz what the sandbox runtime parses: `sandbox_*` request lines from the node's socket and
//! the `sandbox.json` records a restarted daemon reads back. Neither may panic; what parses
//! serialises and parses back the same.
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
    }
    for id in ["a", "sb-0123", "x"] {
        if let Some(rec) = Record::parse(data, id) {
            assert_eq!(rec.id, id);
            let text = serde_json::to_vec(&rec).expect("a record serialises");
            assert_eq!(Record::parse(&text, id), Some(rec));
        }
    }
    if let Ok(s) = std::str::from_utf8(data) {
        for layer in parse_stack(s) {
            assert!(!layer.is_empty() && !layer.contains(','));
        }
    }
});
