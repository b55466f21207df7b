//! Shared test support: the conformance suite and the S3 test server.

pub mod moto;
pub mod suite;
