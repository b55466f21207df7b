//! Fuzz what the node daemon reads back or is sent: its state file (`state.json`, through
//! `State::load` on a real file) and an API request line. Neither may panic, whatever the
//! bytes; a state file that loads passes its own checks and saves and loads back the same.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use ublk_daemon::node::proto::RequestLine;
use ublk_daemon::node::state::State;

/// One scratch directory per fuzzing process (libFuzzer exits without running destructors,
/// so it stays behind, empty: each run removes its file).
fn dir() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        tempfile::Builder::new()
            .prefix("strata-fuzz-node-state-")
            .tempdir()
            .expect("a scratch directory")
    })
}

fuzz_target!(|data: &[u8]| {
    let path: PathBuf = dir().path().join("state.json");
    std::fs::write(&path, data).expect("write the fuzz input");
    match State::load(&path) {
        Ok(Some(s)) => {
            assert!(s.check().is_ok());
            for id in s.layers.keys() {
                let _ = s.needed(id);
                let _ = s.users(id);
            }
            let _ = s.blobs_in_use();
            for m in s.mounts.values() {
                let _ = m.kind();
            }
            // What loads saves and loads back unchanged.
            s.save(&path).expect("save a loaded state");
            let again = State::load(&path).expect("a saved state loads");
            assert_eq!(again.as_ref(), Some(&s));
        }
        Ok(None) => panic!("State::load found no file it had just been given"),
        Err(_) => {}
    }

    let _ = std::fs::remove_file(&path);

    if let Ok(line) = serde_json::from_slice::<RequestLine>(data) {
        let text = serde_json::to_string(&line).expect("a request line serialises");
        let back: RequestLine = serde_json::from_str(&text).expect("a written line parses");
        assert_eq!(back.v, line.v);
        assert_eq!(back.request, line.request);
    }
});
