//! Fuzz what the E2B API parses from the network (`e2b_api::fuzz_parse`): Connect envelopes
//! fed in pieces, every request message of `process.Process` and `filesystem.Filesystem`,
//! the control plane's bodies, query strings, RFC 3339 times, sandbox paths (which must
//! come out absolute, without `..`), upload headers, and what a cluster front parses from
//! a node (`GET /strata/node`, `POST /strata/signed`). Nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    e2b_api::fuzz_parse(data);
});
