//! Fuzz the record the fd holder keeps beside the blob mount's FUSE connection
//! (`SavedConnection`, JSON): reading it must never panic, and what reads writes back to
//! the same record.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ublk_daemon::blobfs::SavedConnection;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Some(saved) = SavedConnection::from_json(&text) {
        let json = saved.to_json();
        assert!(!json.is_empty(), "a read record serialises");
        assert_eq!(SavedConnection::from_json(&json), Some(saved.clone()));
        if let Some(n) = saved.negotiated {
            let _ = n.passthrough();
            let _ = n.has_resend();
        }
    }
});
