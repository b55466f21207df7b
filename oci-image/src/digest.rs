//! sha256 digests as OCI writes them (`sha256:` + 64 lowercase hex digits), and readers and
//! writers that hash what passes through them.

use std::fmt;
use std::io::{Read, Write};

use sha2::{Digest as _, Sha256};

use crate::{invalid, Result};

/// A sha256 digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sha256Digest(pub [u8; 32]);

impl Sha256Digest {
    /// The digest of `data`.
    pub fn of(data: &[u8]) -> Self {
        Self(Sha256::digest(data).into())
    }

    /// Parses `sha256:<64 lowercase hex>`; anything else (another algorithm, upper case,
    /// another length) is refused. `what` names the descriptor in the error.
    pub fn parse(s: &str, what: &str) -> Result<Self> {
        let hex = s.strip_prefix("sha256:").ok_or_else(|| {
            invalid(
                what,
                format!("digest {s:?} is not sha256:<64 hex> (only sha256 is accepted)"),
            )
        })?;
        Self::parse_hex(hex).ok_or_else(|| {
            invalid(
                what,
                format!("digest {s:?} is not sha256: followed by 64 lowercase hex digits"),
            )
        })
    }

    /// Parses 64 lowercase hex digits.
    pub fn parse_hex(hex: &str) -> Option<Self> {
        if hex.len() != 64 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(hex, &mut out).ok()?;
        Some(Self(out))
    }

    /// The 64 hex digits.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The path of this blob in an OCI layout.
    pub fn blob_path(&self) -> String {
        format!("blobs/sha256/{}", self.hex())
    }
}

impl fmt::Display for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Debug for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Running sha256 and byte count.
#[derive(Clone, Default)]
pub struct Hashing {
    hasher: Sha256,
    /// Bytes hashed so far.
    pub bytes: u64,
}

impl fmt::Debug for Hashing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hashing")
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Hashing {
    /// Adds bytes.
    pub fn update(&mut self, b: &[u8]) {
        self.hasher.update(b);
        self.bytes += b.len() as u64;
    }

    /// The digest of everything added.
    pub fn finish(&self) -> Sha256Digest {
        Sha256Digest(self.hasher.clone().finalize().into())
    }
}

/// A reader that hashes and counts the bytes read through it.
#[derive(Debug)]
pub struct HashReader<R> {
    inner: R,
    /// The hash of the bytes read so far.
    pub hash: Hashing,
}

impl<R: Read> HashReader<R> {
    /// Wraps `inner`.
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            hash: Hashing::default(),
        }
    }
}

impl<R: Read> Read for HashReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// A writer that hashes and counts the bytes written through it.
#[derive(Debug)]
pub struct HashWriter<W> {
    inner: W,
    /// The hash of the bytes written so far.
    pub hash: Hashing,
}

impl<W: Write> HashWriter<W> {
    /// Wraps `inner`.
    pub fn new(inner: W) -> Self {
        Self {
            inner,
            hash: Hashing::default(),
        }
    }

    /// The inner writer.
    pub fn into_inner(self) -> W {
        self.inner
    }

    /// The inner writer, borrowed.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }
}

impl<W: Write> Write for HashWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sha256_lowercase_64_hex() {
        let d = Sha256Digest::of(b"");
        let s = d.to_string();
        assert_eq!(
            s,
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(Sha256Digest::parse(&s, "x").unwrap(), d);
        for bad in [
            "sha512:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b85",
            "sha256:../../../../etc/passwd",
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "",
        ] {
            assert!(Sha256Digest::parse(bad, "x").is_err(), "{bad}");
        }
    }
}
