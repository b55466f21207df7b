//! The builder's secrets must not reach a packed layer: every packed file (its bytes, its
//! name, its symlink target, its xattr values) is scanned for every secret value the builder
//! sandbox was given — raw, hex (either case) and base64 (standard and URL-safe) — in one
//! pass per file (Aho-Corasick over all patterns).
//!
//! Base64 of a secret embedded in longer data depends on where the secret starts modulo 3;
//! for each of the three alignments the characters that encode only secret bytes are fixed,
//! so each alignment gives one pattern (`value[skip..]` cut to whole 3-byte groups, encoded
//! without padding). A secret shorter than [`MIN_SECRET`] bytes cannot be told from
//! ordinary data; packing a sandbox that holds one is refused.

use std::io::Read;

use aho_corasick::AhoCorasick;
use base64::Engine;

use crate::{Error, Result};

/// The shortest secret the scan can vouch for.
pub const MIN_SECRET: usize = 8;

/// The scanner for one sandbox's secrets.
#[derive(Debug)]
pub struct Scanner {
    ac: Option<AhoCorasick>,
    /// For each pattern: (secret name, encoding).
    what: Vec<(String, &'static str)>,
}

impl Scanner {
    /// A scanner for `secrets` (name, value).
    pub fn new(secrets: &[(String, Vec<u8>)]) -> Result<Self> {
        let mut patterns: Vec<Vec<u8>> = Vec::new();
        let mut what = Vec::new();
        for (name, value) in secrets {
            if value.len() < MIN_SECRET {
                return Err(Error::Refused(format!(
                    "secret {name} is {} bytes: too short to scan packed files for (at least \
                     {MIN_SECRET}), so the pack cannot show that it leaves the secret behind",
                    value.len()
                )));
            }
            let mut add = |p: Vec<u8>, how: &'static str| {
                if !patterns.contains(&p) {
                    patterns.push(p);
                    what.push((name.clone(), how));
                }
            };
            add(value.clone(), "raw");
            add(hex::encode(value).into_bytes(), "hex");
            add(hex::encode_upper(value).into_bytes(), "hex");
            for skip in 0..3 {
                let rest = &value[skip..];
                let whole = &rest[..rest.len() / 3 * 3];
                let std = base64::engine::general_purpose::STANDARD_NO_PAD.encode(whole);
                let url = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(whole);
                add(std.into_bytes(), "base64");
                add(url.into_bytes(), "base64url");
            }
        }
        let ac = if patterns.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::new(&patterns)
                    .map_err(|e| Error::Runtime(format!("secret scanner: {e}")))?,
            )
        };
        Ok(Self { ac, what })
    }

    /// Whether there is anything to look for.
    pub fn is_empty(&self) -> bool {
        self.ac.is_none()
    }

    /// The first secret found in `bytes`: (name, encoding).
    pub fn find(&self, bytes: &[u8]) -> Option<(&str, &'static str)> {
        let m = self.ac.as_ref()?.find(bytes)?;
        let (n, how) = &self.what[m.pattern().as_usize()];
        Some((n.as_str(), *how))
    }

    /// The first secret found in the stream `r`.
    pub fn find_in(&self, r: impl Read) -> std::io::Result<Option<(&str, &'static str)>> {
        let Some(ac) = &self.ac else {
            return Ok(None);
        };
        match ac.stream_find_iter(r).next() {
            None => Ok(None),
            Some(Err(e)) => Err(e),
            Some(Ok(m)) => {
                let (n, how) = &self.what[m.pattern().as_usize()];
                Ok(Some((n.as_str(), *how)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scanner(v: &str) -> Scanner {
        Scanner::new(&[("tok".into(), v.as_bytes().to_vec())]).unwrap()
    }

    #[test]
    fn finds_a_secret_raw_hex_and_base64_at_every_alignment() {
        let secret = "s3cr3t-ANSWER-42";
        let s = scanner(secret);
        let hay = format!("answer: {secret}\n");
        assert_eq!(s.find(hay.as_bytes()), Some(("tok", "raw")));
        assert_eq!(
            s.find(hex::encode(format!("x{secret}")).as_bytes()),
            Some(("tok", "hex"))
        );
        assert!(s
            .find(hex::encode_upper(secret.as_bytes()).as_bytes())
            .is_some());
        for prefix in ["", "a", "ab", "abc", "abcd"] {
            for suffix in ["", "z", "zz"] {
                let data = format!("{prefix}{secret}{suffix}");
                for e in [
                    base64::engine::general_purpose::STANDARD.encode(&data),
                    base64::engine::general_purpose::URL_SAFE.encode(&data),
                ] {
                    assert!(s.find(e.as_bytes()).is_some(), "{prefix:?}+{suffix:?}: {e}");
                    assert!(s.find_in(e.as_bytes()).unwrap().is_some());
                }
            }
        }
        assert_eq!(s.find(b"nothing to see here, s3cr3t-ANSWER-4"), None);
        assert_eq!(s.find_in(&b"s3cr3t-answer-42"[..]).unwrap(), None);
    }

    #[test]
    fn short_secrets_are_refused_and_none_finds_nothing() {
        let e = Scanner::new(&[("pin".into(), b"1234".to_vec())]).unwrap_err();
        assert!(e.to_string().contains("too short"), "{e}");
        let none = Scanner::new(&[]).unwrap();
        assert!(none.is_empty());
        assert_eq!(none.find(b"anything"), None);
    }
}
