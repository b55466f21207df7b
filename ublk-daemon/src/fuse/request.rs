//! Parsing one request read from `/dev/fuse` (the kernel's bytes, but checked as if hostile:
//! a short or inconsistent request is an error, never a panic or an out-of-bounds read).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use zerocopy::FromBytes;

use super::abi::{self, op, GetattrIn, GetxattrIn, InHeader, InitIn, OpenIn, ReadIn, ReleaseIn};

/// What the request asks for. Opcodes this server does not implement are [`Op::Other`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Op<'a> {
    Init(InitIn),
    Lookup { name: &'a OsStr },
    Forget,
    BatchForget,
    Getattr(GetattrIn),
    Open(OpenIn),
    Opendir(OpenIn),
    Read(ReadIn),
    Readdir(ReadIn),
    Release(ReleaseIn),
    Releasedir(ReleaseIn),
    Flush,
    Statfs,
    Getxattr { size: u32, name: &'a OsStr },
    Listxattr { size: u32 },
    Access,
    Interrupt,
    Destroy,
    Other(u32),
}

impl Op<'_> {
    /// Whether the kernel expects no reply (FORGET, BATCH_FORGET, INTERRUPT is answered only
    /// by the interrupted request itself).
    pub fn no_reply(&self) -> bool {
        matches!(self, Op::Forget | Op::BatchForget | Op::Interrupt)
    }
}

/// A parsed request.
#[derive(Debug)]
pub struct Request<'a> {
    pub header: InHeader,
    pub op: Op<'a>,
}

/// Why a request could not be parsed.
#[derive(Debug, PartialEq, Eq)]
pub enum ParseError {
    /// Fewer bytes than the header, or than the header says.
    Short { got: usize, need: usize },
    /// The opcode's argument is shorter than its struct.
    Argument {
        opcode: u32,
        got: usize,
        need: usize,
    },
    /// A name without its NUL terminator.
    Name { opcode: u32 },
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParseError::Short { got, need } => {
                write!(f, "request of {got} bytes, {need} expected")
            }
            ParseError::Argument { opcode, got, need } => {
                write!(
                    f,
                    "opcode {opcode}: argument of {got} bytes, {need} expected"
                )
            }
            ParseError::Name { opcode } => write!(f, "opcode {opcode}: name without NUL"),
        }
    }
}

fn arg<T: FromBytes + Copy>(opcode: u32, body: &[u8]) -> Result<T, ParseError> {
    let need = std::mem::size_of::<T>();
    T::read_from_prefix(body)
        .map(|(v, _)| v)
        .map_err(|_| ParseError::Argument {
            opcode,
            got: body.len(),
            need,
        })
}

fn name(opcode: u32, bytes: &[u8]) -> Result<&OsStr, ParseError> {
    let end = bytes
        .iter()
        .position(|&b| b == 0)
        .ok_or(ParseError::Name { opcode })?;
    Ok(OsStr::from_bytes(&bytes[..end]))
}

/// Parse the `n` bytes of one request in `buf`.
pub fn parse(buf: &[u8]) -> Result<Request<'_>, ParseError> {
    let hlen = std::mem::size_of::<InHeader>();
    let (header, _) = InHeader::read_from_prefix(buf).map_err(|_| ParseError::Short {
        got: buf.len(),
        need: hlen,
    })?;
    let len = header.len as usize;
    let ext = usize::from(header.total_extlen) * 8;
    if len < hlen + ext || len > buf.len() {
        return Err(ParseError::Short {
            got: buf.len(),
            need: len.max(hlen + ext),
        });
    }
    let body = &buf[hlen..len - ext];
    let opcode = header.opcode;
    let op = match opcode {
        op::INIT => {
            // Only major, minor, max_readahead and flags are guaranteed; the rest is zero
            // when the kernel sends less.
            let mut init = InitIn::default();
            let take = body.len().min(std::mem::size_of::<InitIn>());
            if take < 16 {
                return Err(ParseError::Argument {
                    opcode,
                    got: body.len(),
                    need: 16,
                });
            }
            zerocopy::IntoBytes::as_mut_bytes(&mut init)[..take].copy_from_slice(&body[..take]);
            Op::Init(init)
        }
        op::LOOKUP => Op::Lookup {
            name: name(opcode, body)?,
        },
        op::FORGET => Op::Forget,
        op::BATCH_FORGET => Op::BatchForget,
        op::GETATTR => Op::Getattr(arg(opcode, body)?),
        op::OPEN => Op::Open(arg(opcode, body)?),
        op::OPENDIR => Op::Opendir(arg(opcode, body)?),
        op::READ => Op::Read(arg(opcode, body)?),
        op::READDIR => Op::Readdir(arg(opcode, body)?),
        op::RELEASE => Op::Release(arg(opcode, body)?),
        op::RELEASEDIR => Op::Releasedir(arg(opcode, body)?),
        op::FLUSH => Op::Flush,
        op::STATFS => Op::Statfs,
        op::GETXATTR => {
            let a: GetxattrIn = arg(opcode, body)?;
            let rest = &body[std::mem::size_of::<GetxattrIn>()..];
            Op::Getxattr {
                size: a.size,
                name: name(opcode, rest)?,
            }
        }
        op::LISTXATTR => {
            let a: GetxattrIn = arg(opcode, body)?;
            Op::Listxattr { size: a.size }
        }
        op::ACCESS => Op::Access,
        op::INTERRUPT => Op::Interrupt,
        op::DESTROY => Op::Destroy,
        other => Op::Other(other),
    };
    Ok(Request { header, op })
}

/// The combined 64-bit INIT flags of a request.
pub fn init_flags(i: &InitIn) -> u64 {
    let mut f = u64::from(i.flags);
    if f & abi::init::INIT_EXT != 0 {
        f |= u64::from(i.flags2) << 32;
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerocopy::IntoBytes;

    fn request(opcode: u32, body: &[u8]) -> Vec<u8> {
        let h = InHeader {
            len: (40 + body.len()) as u32,
            opcode,
            unique: 7,
            nodeid: 1,
            ..Default::default()
        };
        let mut v = h.as_bytes().to_vec();
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn parses_and_refuses_short_input() {
        let r = request(op::LOOKUP, b"abc\0");
        let p = parse(&r).unwrap();
        assert!(matches!(p.op, Op::Lookup { name } if name == "abc"));
        assert_eq!(p.header.unique, 7);

        assert!(matches!(
            parse(&request(op::LOOKUP, b"abc")),
            Err(ParseError::Name { .. })
        ));
        assert!(matches!(
            parse(&request(op::READ, &[0; 39])),
            Err(ParseError::Argument { need: 40, .. })
        ));
        let read = ReadIn {
            fh: 3,
            offset: 4096,
            size: 8192,
            ..Default::default()
        };
        let r = request(op::READ, read.as_bytes());
        let p = parse(&r).unwrap();
        assert!(matches!(p.op, Op::Read(r) if r.offset == 4096 && r.size == 8192));
        // A header claiming more than was read, or less than itself.
        let mut r = request(op::STATFS, &[]);
        r[0] = 200;
        assert!(matches!(parse(&r), Err(ParseError::Short { .. })));
        r[0] = 10;
        assert!(matches!(parse(&r), Err(ParseError::Short { .. })));
        assert!(parse(&[0; 12]).is_err());
        // Extensions longer than the request.
        let mut r = request(op::STATFS, &[]);
        r[36] = 1;
        assert!(parse(&r).is_err());
        // An INIT from an old kernel (16 bytes) is accepted, shorter is not.
        assert!(matches!(
            parse(&request(op::INIT, &[7, 0, 0, 0, 31, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0])),
            Ok(Request { op: Op::Init(i), .. }) if i.major == 7 && i.minor == 31
        ));
        assert!(parse(&request(op::INIT, &[7, 0, 0, 0])).is_err());
        assert!(matches!(
            parse(&request(9999, &[])).unwrap().op,
            Op::Other(9999)
        ));
    }
}
