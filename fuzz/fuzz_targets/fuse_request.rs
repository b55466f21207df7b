//! Fuzz the FUSE request parser (the bytes of one read from `/dev/fuse`, treated as hostile)
//! and the INIT negotiation that follows it: parsing must never panic or read out of bounds,
//! and what INIT agrees must stay within what this server and the kernel can speak.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ublk_daemon::fuse::abi::{self, init};
use ublk_daemon::fuse::request::{self, Op};
use ublk_daemon::fuse::InitPolicy;

/// What the blob mount asks for (as `blobfs`'s defaults do), with every flag this server
/// knows wanted.
const POLICY: InitPolicy = InitPolicy {
    max_read: 1 << 20,
    max_write: 1 << 20,
    want: init::ASYNC_READ
        | init::BIG_WRITES
        | init::ASYNC_DIO
        | init::PARALLEL_DIROPS
        | init::MAX_PAGES
        | init::PASSTHROUGH
        | init::HAS_RESEND,
    max_background: 256,
    congestion_threshold: 192,
};

/// A policy that asks for nothing and gives degenerate sizes (rounded up by `negotiate`).
const TINY: InitPolicy = InitPolicy {
    max_read: 0,
    max_write: 0,
    want: u64::MAX,
    max_background: 0,
    congestion_threshold: 0,
};

fuzz_target!(|data: &[u8]| {
    let Ok(req) = request::parse(data) else {
        return;
    };
    // What parsed is within what was read.
    let len = req.header.len as usize;
    assert!(len >= std::mem::size_of::<abi::InHeader>() && len <= data.len());
    let _ = req.op.no_reply();
    let _ = format!("{req:?}");
    match &req.op {
        Op::Init(i) => {
            let offered = request::init_flags(i);
            assert_eq!(offered & 0xffff_ffff, u64::from(i.flags));
            if offered & init::INIT_EXT == 0 {
                assert_eq!(offered >> 32, 0, "flags2 used without INIT_EXT");
            }
            for policy in [POLICY, TINY] {
                let n = policy.negotiate(i);
                assert!(n.minor <= abi::KERNEL_MINOR_VERSION, "minor {}", n.minor);
                assert!(n.minor <= i.minor);
                assert!(n.max_write >= 4096, "max_write {}", n.max_write);
                assert!(n.max_pages >= 1);
                assert!(n.max_stack_depth <= 1, "depth {}", n.max_stack_depth);
                assert_eq!(n.flags & !offered, 0, "flags not offered by the kernel");
                assert_eq!(n.flags & !policy.want, 0, "flags not wanted");
                assert_eq!(n.kernel_flags, offered);
                assert_eq!(n.max_readahead, i.max_readahead);
                assert_eq!(n.passthrough(), n.max_stack_depth == 1);
                let _ = n.has_resend();
                // The record kept by the fd holder reads back as it was written.
                let json = serde_json::to_string(&n).expect("Negotiated serialises");
                let back: ublk_daemon::fuse::Negotiated =
                    serde_json::from_str(&json).expect("Negotiated reads back");
                assert_eq!(back, n);
            }
        }
        Op::Write { arg, data } => {
            assert_eq!(data.len(), arg.size as usize, "WRITE data is not its size");
            // The data lies inside the request, before any extensions.
            let ext = usize::from(req.header.total_extlen) * 8;
            assert!(40 + 40 + data.len() + ext <= len);
        }
        Op::Lookup { name } | Op::Getxattr { name, .. } => {
            use std::os::unix::ffi::OsStrExt;
            assert!(!name.as_bytes().contains(&0));
        }
        _ => {}
    }
});
