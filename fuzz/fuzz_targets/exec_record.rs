//! Fuzz what a daemon reads back of an exec kept beside its sandbox (`sandbox_runtime::exec`):
//! the status line the sandbox's init writes (`<wait status> <stdout total> <stderr total>
//! <pid>`)
//! and the exec's record (`exec.json`). Neither may panic; a status that parses prints back
//! to what parses the same, and a record that parses serialises and parses back equal.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_runtime::exec::{ExecMeta, Status};

fuzz_target!(|data: &[u8]| {
    if let Some(s) = Status::parse(data) {
        let line = format!("{} {} {} {}\n", s.wait, s.stdout, s.stderr, s.pid);
        assert_eq!(Status::parse(line.as_bytes()), Some(s));
    }
    if let Ok(m) = ExecMeta::parse(data) {
        let text = serde_json::to_vec(&m).expect("a record serialises");
        assert_eq!(ExecMeta::parse(&text).expect("it parses back"), m);
    }
});
