//! Parsing one request read from `/dev/fuse` (the kernel's bytes, but checked as if hostile:
//! a short or inconsistent request is an error, never a panic or an out-of-bounds read).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use zerocopy::FromBytes;

use super::abi::{
    self, op, FallocateIn, FsyncIn, GetattrIn, GetxattrIn, InHeader, InitIn, OpenIn, ReadIn,
    ReleaseIn, SetattrIn, WriteIn,
};

/// What the request asks for. Opcodes this server does not implement are [`Op::Other`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Op<'a> {
    Init(InitIn),
    Lookup {
        name: &'a OsStr,
    },
    Forget,
    BatchForget,
    Getattr(GetattrIn),
    Setattr(SetattrIn),
    Open(OpenIn),
    Opendir(OpenIn),
    Read(ReadIn),
    /// `data` is exactly `arg.size` bytes.
    Write {
        arg: WriteIn,
        data: &'a [u8],
    },
    Readdir(ReadIn),
    Release(ReleaseIn),
    Releasedir(ReleaseIn),
    Flush,
    Fsync(FsyncIn),
    Fallocate(FallocateIn),
    Statfs,
    Getxattr {
        size: u32,
        name: &'a OsStr,
    },
    Listxattr {
        size: u32,
    },
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
    /// A WRITE whose data is not the `size` its argument says.
    WriteData { size: u32, got: usize },
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
            ParseError::WriteData { size, got } => {
                write!(f, "WRITE of {size} bytes carries {got} bytes of data")
            }
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
        op::SETATTR => Op::Setattr(arg(opcode, body)?),
        op::OPEN => Op::Open(arg(opcode, body)?),
        op::OPENDIR => Op::Opendir(arg(opcode, body)?),
        op::READ => Op::Read(arg(opcode, body)?),
        op::WRITE => {
            let a: WriteIn = arg(opcode, body)?;
            let data = &body[std::mem::size_of::<WriteIn>()..];
            if data.len() != a.size as usize {
                return Err(ParseError::WriteData {
                    size: a.size,
                    got: data.len(),
                });
            }
            Op::Write { arg: a, data }
        }
        op::READDIR => Op::Readdir(arg(opcode, body)?),
        op::RELEASE => Op::Release(arg(opcode, body)?),
        op::RELEASEDIR => Op::Releasedir(arg(opcode, body)?),
        op::FLUSH => Op::Flush,
        op::FSYNC => Op::Fsync(arg(opcode, body)?),
        op::FALLOCATE => Op::Fallocate(arg(opcode, body)?),
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

    fn write_request(offset: u64, data: &[u8], size: u32) -> Vec<u8> {
        let w = abi::WriteIn {
            fh: 9,
            offset,
            size,
            ..Default::default()
        };
        let mut body = w.as_bytes().to_vec();
        body.extend_from_slice(data);
        request(op::WRITE, &body)
    }

    #[test]
    fn parses_the_image_file_opcodes() {
        // WRITE: the argument, then exactly `size` bytes of data.
        let r = write_request(1 << 40, b"hello", 5);
        match parse(&r).unwrap().op {
            Op::Write { arg, data } => {
                assert_eq!((arg.fh, arg.offset, arg.size), (9, 1 << 40, 5));
                assert_eq!(data, b"hello");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse(&write_request(0, b"", 0)).unwrap().op,
            Op::Write { data: &[], .. }
        ));
        // Data shorter or longer than `size`, or a size no request can carry.
        for (data, size) in [
            (&b"hell"[..], 5),
            (b"hello!", 5),
            (b"", 1),
            (b"x", u32::MAX),
        ] {
            assert_eq!(
                parse(&write_request(0, data, size)).unwrap_err(),
                ParseError::WriteData {
                    size,
                    got: data.len()
                }
            );
        }
        // Extensions are not data: a WRITE whose tail is an extension is short of its data.
        let mut r = write_request(0, &[7; 8], 8);
        r[36] = 1;
        assert_eq!(
            parse(&r).unwrap_err(),
            ParseError::WriteData { size: 8, got: 0 }
        );

        let sa = abi::SetattrIn {
            valid: abi::fattr::SIZE | abi::fattr::MODE,
            size: 96 << 20,
            mode: 0o644,
            ..Default::default()
        };
        assert!(matches!(
            parse(&request(op::SETATTR, sa.as_bytes())).unwrap().op,
            Op::Setattr(a) if a.valid == abi::fattr::SIZE | abi::fattr::MODE
                && a.size == 96 << 20 && a.mode == 0o644
        ));
        let fs = abi::FsyncIn {
            fh: 3,
            fsync_flags: abi::FSYNC_FDATASYNC,
            padding: 0,
        };
        assert!(matches!(
            parse(&request(op::FSYNC, fs.as_bytes())).unwrap().op,
            Op::Fsync(f) if f.fh == 3 && f.fsync_flags == abi::FSYNC_FDATASYNC
        ));
        let fa = abi::FallocateIn {
            fh: 1,
            offset: 4096,
            length: 1 << 20,
            mode: libc::FALLOC_FL_PUNCH_HOLE as u32 | libc::FALLOC_FL_KEEP_SIZE as u32,
            padding: 0,
        };
        assert!(matches!(
            parse(&request(op::FALLOCATE, fa.as_bytes())).unwrap().op,
            Op::Fallocate(f) if f.offset == 4096 && f.length == 1 << 20 && f.mode == 3
        ));

        // Every truncation of each request is an error, never a panic: cut short of what the
        // header says (`Short`), or with a header that agrees with the cut (`Argument` for a
        // cut argument, `WriteData` for cut data).
        let full: [(u32, Vec<u8>, usize); 4] = [
            (op::WRITE, write_request(8, &[1; 100], 100), 40),
            (op::SETATTR, request(op::SETATTR, sa.as_bytes()), 88),
            (op::FSYNC, request(op::FSYNC, fs.as_bytes()), 16),
            (op::FALLOCATE, request(op::FALLOCATE, fa.as_bytes()), 32),
        ];
        for (opcode, r, need) in &full {
            assert!(parse(r).is_ok());
            for cut in 0..r.len() {
                assert!(parse(&r[..cut]).is_err(), "opcode {opcode} cut at {cut}");
                let mut agreeing = r[..cut].to_vec();
                if cut >= 40 {
                    agreeing[..4].copy_from_slice(&(cut as u32).to_ne_bytes());
                    let e = parse(&agreeing).unwrap_err();
                    let body = cut - 40;
                    if body < *need {
                        assert_eq!(
                            e,
                            ParseError::Argument {
                                opcode: *opcode,
                                got: body,
                                need: *need
                            }
                        );
                    } else {
                        assert!(
                            matches!(e, ParseError::WriteData { size: 100, .. }),
                            "{e:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn random_requests_never_panic() {
        let mut rng = fastrand::Rng::with_seed(0xf05e);
        let opcodes = [
            op::WRITE,
            op::SETATTR,
            op::FSYNC,
            op::FALLOCATE,
            op::READ,
            op::INIT,
            op::GETXATTR,
            op::LOOKUP,
            rng.u32(..),
        ];
        for _ in 0..20_000 {
            let mut body = vec![0u8; rng.usize(0..200)];
            rng.fill(&mut body);
            if rng.bool() && body.len() >= 20 {
                // A plausible WRITE size, so that some requests get as far as the data check.
                let size = (body.len() as u32).saturating_sub(40 + rng.u32(0..3));
                body[16..20].copy_from_slice(&size.to_ne_bytes());
            }
            let mut r = request(opcodes[rng.usize(..opcodes.len())], &body);
            if rng.u8(..4) == 0 {
                r[36] = rng.u8(..);
            }
            if rng.u8(..4) == 0 {
                let len = rng.u32(..);
                r[..4].copy_from_slice(&len.to_ne_bytes());
            }
            let cut = rng.usize(0..=r.len());
            if let Ok(Request {
                op: Op::Write { arg, data },
                ..
            }) = parse(&r[..cut])
            {
                assert_eq!(data.len(), arg.size as usize);
            }
        }
    }
}
