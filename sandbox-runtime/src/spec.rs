//! The OCI bundle's `config.json` of a sandbox, built with the `oci-spec` crate.
//!
//! What the runtime is asked for (and why):
//! - **init**: Strata's own `strata-init` (`init/strata-init.c`, static, bind-mounted
//!   read-only from the host at [`INIT_PATH`], on the container's own `/dev` tmpfs, so
//!   nothing lands in the upper): PID 1 of the sandbox's PID namespace. It reaps orphans (a
//!   fork bomb leaves no zombies behind) and starts execs for the daemon (`crate::agent`)
//!   without a runtime process per exec.
//! - **namespaces**: pid, mount, ipc, uts, cgroup and a new network namespace (runc brings up
//!   its loopback only). The root is the overlay the node daemon composed
//!   (`layers → lowerdir`, the sandbox's upper); runc pivots into it, so none of the node's
//!   mounts (blob files, layer mounts, other sandboxes, the daemon's run directory) is in the
//!   sandbox's mount namespace.
//! - **capabilities**: the container runtimes' usual default set (Docker's) without
//!   `CAP_NET_RAW` and `CAP_MKNOD`; `noNewPrivileges`.
//! - **masked paths**: runc's list plus the kernel's page-frame and memory views
//!   (`/proc/kpage*`, `/proc/kallsyms`, …) and `/sys/kernel`, `/sys/firmware`,
//!   `/sys/devices/virtual/powercap`; read-only `/proc/sys` and friends; `/sys` read-only.
//! - **seccomp** ([`seccomp`]): allow by default, `EPERM` for the extent-swap and clone
//!   ioctls, module and kexec loading, `open_by_handle_at`, bpf, perf, keyrings,
//!   userfaultfd, io_uring, new user namespaces, and the rest of the container breakouts'
//!   toolbox.
//! - **resources**: memory (swap = memory: none beyond it), CPU quota, pids, in the cgroup
//!   `<parent>/<id>` (v1 controllers here, v2 where they live there): `/strata/<id>`, or
//!   `/strata-<node>/<id>` for a node with a name (`ManagerConfig::node_name`), so that
//!   several nodes on one machine each have a parent cgroup of their own.

use std::path::Path;

use oci_spec::runtime::{
    Arch, Capability, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxMemoryBuilder,
    LinuxNamespaceBuilder, LinuxNamespaceType, LinuxPidsBuilder, LinuxResourcesBuilder,
    LinuxSeccomp, LinuxSeccompAction, LinuxSeccompArgBuilder, LinuxSeccompBuilder,
    LinuxSeccompOperator, LinuxSyscall, LinuxSyscallBuilder, Mount, MountBuilder,
    PosixRlimitBuilder, PosixRlimitType, ProcessBuilder, RootBuilder, Spec, SpecBuilder,
    UserBuilder,
};

use crate::proto::CpuClass;
use crate::{Error, Limits, Result};

/// Where the init binary appears inside a sandbox.
pub const INIT_PATH: &str = "/dev/.strata-init";

/// Where secrets appear inside a sandbox (read-only, a tmpfs on the host).
pub const SECRETS_PATH: &str = "/run/secrets";

/// What a sandbox's config needs.
#[derive(Debug, Clone)]
pub struct SpecInput<'a> {
    pub id: &'a str,
    /// The composed root (the node's overlay mount).
    pub rootfs: &'a Path,
    /// The host's init binary (`agent::install_init`'s).
    pub init: &'a Path,
    /// `KEY=VALUE` for the init and every exec.
    pub env: &'a [String],
    pub limits: &'a Limits,
    /// `/etc/hostname`, `/etc/hosts`, `/etc/resolv.conf` written by the runtime (bound over
    /// the root's own).
    pub etc_dir: &'a Path,
    /// A tmpfs holding one file per secret, bound read-only at [`SECRETS_PATH`].
    pub secrets_dir: Option<&'a Path>,
    /// A network namespace to join (a sandbox with an allowlist); `None`: a new one with
    /// loopback only.
    pub netns: Option<&'a Path>,
    /// The parent cgroup (`/strata`; [`cgroup_parent`]).
    pub cgroup_parent: &'a str,
}

/// The parent cgroup of a node's sandboxes: `/strata`, or `/strata-<name>` for a named node.
pub fn cgroup_parent(node_name: Option<&str>) -> String {
    match node_name {
        Some(n) => format!("/strata-{n}"),
        None => "/strata".to_owned(),
    }
}

fn oci(e: oci_spec::OciSpecError) -> Error {
    Error::Spec(e.to_string())
}

/// The environment every sandbox process starts with, before the user's.
pub const BASE_ENV: &[&str] = &[
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME=/root",
    "LANG=C.UTF-8",
];

/// The paths masked (a read gives nothing) in every sandbox.
pub fn masked_paths() -> Vec<String> {
    let mut v = oci_spec::runtime::get_default_maskedpaths();
    for p in [
        "/proc/kpagecgroup",
        "/proc/kpageflags",
        "/proc/kpagecount",
        "/proc/kallsyms",
        "/proc/vmallocinfo",
        "/proc/page_owner",
        "/proc/sysrq-trigger",
        "/proc/config.gz",
        "/sys/kernel",
        "/sys/devices/virtual/powercap",
        "/sys/fs/bpf",
        "/sys/module",
    ] {
        if !v.iter().any(|x| x == p) {
            v.push(p.to_owned());
        }
    }
    v
}

/// The capabilities of a sandbox's processes (bounding, effective, permitted; none
/// inheritable or ambient).
pub fn capabilities() -> Vec<Capability> {
    use Capability::*;
    vec![
        Chown,
        DacOverride,
        Fsetid,
        Fowner,
        Setgid,
        Setuid,
        Setpcap,
        NetBindService,
        SysChroot,
        Kill,
        AuditWrite,
        Setfcap,
    ]
}

fn bind(src: &Path, dst: &str, ro: bool) -> Result<Mount> {
    let mut options = vec!["rbind".to_owned(), "nosuid".to_owned(), "nodev".to_owned()];
    if ro {
        options.push("ro".to_owned());
    }
    MountBuilder::default()
        .destination(dst)
        .typ("bind")
        .source(src)
        .options(options)
        .build()
        .map_err(oci)
}

/// The sandbox's `config.json`.
pub fn build(input: &SpecInput<'_>) -> Result<Spec> {
    let mut env: Vec<String> = BASE_ENV.iter().map(|s| s.to_string()).collect();
    env.extend(input.env.iter().cloned());
    let caps: std::collections::HashSet<Capability> = capabilities().into_iter().collect();
    // Open files: 65,536, or the daemon's own hard limit if lower (the runtime cannot raise
    // it past that once capabilities are dropped).
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .maximum
        .unwrap_or(u64::MAX)
        .min(65_536);
    let process = ProcessBuilder::default()
        .terminal(false)
        .user(
            UserBuilder::default()
                .uid(0u32)
                .gid(0u32)
                .build()
                .map_err(oci)?,
        )
        .args(vec![INIT_PATH.to_owned()])
        .env(env)
        .cwd("/")
        .capabilities(
            LinuxCapabilitiesBuilder::default()
                .bounding(caps.clone())
                .effective(caps.clone())
                .permitted(caps)
                .build()
                .map_err(oci)?,
        )
        .rlimits(vec![
            PosixRlimitBuilder::default()
                .typ(PosixRlimitType::RlimitNofile)
                .hard(nofile)
                .soft(nofile)
                .build()
                .map_err(oci)?,
            // No process may raise its priority (nor leave `SCHED_IDLE`, `crate::qos`).
            PosixRlimitBuilder::default()
                .typ(PosixRlimitType::RlimitNice)
                .hard(0u64)
                .soft(0u64)
                .build()
                .map_err(oci)?,
        ])
        .no_new_privileges(true)
        .oom_score_adj(500)
        .build()
        .map_err(oci)?;

    let mut mounts = oci_spec::runtime::get_default_mounts();
    // A tmpfs /tmp of the sandbox's own: scratch that is not the upper's residue.
    mounts.push(
        MountBuilder::default()
            .destination("/tmp")
            .typ("tmpfs")
            .source("tmpfs")
            .options(vec![
                "nosuid".to_owned(),
                "nodev".to_owned(),
                "mode=1777".to_owned(),
                format!("size={}", input.limits.tmp_bytes()),
            ])
            .build()
            .map_err(oci)?,
    );
    mounts.push(bind(input.init, INIT_PATH, true)?);
    for f in ["hostname", "hosts", "resolv.conf", "machine-id"] {
        let src = input.etc_dir.join(f);
        // Bundles of sandboxes created before machine ids were given have none.
        if f != "machine-id" || src.exists() {
            mounts.push(bind(&src, &format!("/etc/{f}"), true)?);
        }
    }
    if let Some(s) = input.secrets_dir {
        mounts.push(bind(s, SECRETS_PATH, true)?);
    }

    let mut namespaces = Vec::new();
    for t in [
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Mount,
        LinuxNamespaceType::Cgroup,
    ] {
        namespaces.push(
            LinuxNamespaceBuilder::default()
                .typ(t)
                .build()
                .map_err(oci)?,
        );
    }
    let mut net = LinuxNamespaceBuilder::default().typ(LinuxNamespaceType::Network);
    if let Some(p) = input.netns {
        net = net.path(p);
    }
    namespaces.push(net.build().map_err(oci)?);

    let l = input.limits;
    let mut resources = LinuxResourcesBuilder::default();
    if let Some(m) = l.memory {
        let m = i64::try_from(m).map_err(|_| Error::InvalidSpec("--memory is too large".into()))?;
        resources = resources.memory(
            LinuxMemoryBuilder::default()
                .limit(m)
                .swap(m)
                .build()
                .map_err(oci)?,
        );
    }
    if l.cpu_millis.is_some() || l.class == CpuClass::Be {
        let mut cpu = LinuxCpuBuilder::default();
        if let Some(c) = l.cpu_millis {
            let period = 100_000u64;
            cpu = cpu
                .period(period)
                .quota((c as i64 * period as i64 / 1000).max(1000));
        }
        if l.class == CpuClass::Be {
            // The lowest weight (v1 `cpu.shares` 2; runc maps it to v2 `cpu.weight` 1).
            cpu = cpu.shares(BE_CPU_SHARES);
        }
        resources = resources.cpu(cpu.build().map_err(oci)?);
    }
    if let Some(p) = l.pids {
        resources = resources.pids(
            LinuxPidsBuilder::default()
                .limit(p as i64)
                .build()
                .map_err(oci)?,
        );
    }

    let linux = LinuxBuilder::default()
        .namespaces(namespaces)
        .masked_paths(masked_paths())
        .readonly_paths(oci_spec::runtime::get_default_readonly_paths())
        .resources(resources.build().map_err(oci)?)
        .cgroups_path(format!("{}/{}", input.cgroup_parent, input.id))
        .seccomp(seccomp()?)
        .build()
        .map_err(oci)?;

    SpecBuilder::default()
        .version("1.0.2-dev")
        .root(
            RootBuilder::default()
                .path(input.rootfs)
                .readonly(false)
                .build()
                .map_err(oci)?,
        )
        .hostname(input.id)
        .process(process)
        .mounts(mounts)
        .linux(linux)
        .build()
        .map_err(oci)
}

/// ioctl request numbers a sandbox may not use (the kernel compares the low 32 bits).
pub const DENIED_IOCTLS: &[(&str, u64)] = &[
    ("FICLONE", 0x4004_9409),
    ("FICLONERANGE", 0x4020_940d),
    ("FIDEDUPERANGE", 0xc018_9436),
    ("XFS_IOC_SWAPEXT", 0xc0c0_586d),
    ("EXT4_IOC_MOVE_EXT", 0xc028_660f),
    ("EXT4_IOC_SWAP_BOOT", 0x0000_6611),
    ("FS_IOC_SETFLAGS", 0x4008_6602),
    ("FS_IOC32_SETFLAGS", 0x4004_6602),
    ("FS_IOC_FSSETXATTR", 0x401c_5820),
    ("FITRIM", 0xc018_7879),
    ("FIFREEZE", 0xc004_5877),
    ("FITHAW", 0xc004_5878),
];

/// System calls a sandbox may not make at all.
pub const DENIED_SYSCALLS: &[&str] = &[
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "init_module",
    "io_uring_enter",
    "io_uring_register",
    "io_uring_setup",
    "ioperm",
    "iopl",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "mount",
    "mount_setattr",
    "move_mount",
    "name_to_handle_at",
    "nfsservctl",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "pivot_root",
    "quotactl",
    "quotactl_fd",
    "reboot",
    "request_key",
    "setns",
    "settimeofday",
    "swapoff",
    "swapon",
    "syslog",
    "umount2",
    "uselib",
    "userfaultfd",
    "vhangup",
];

/// `CLONE_NEWUSER`: a sandbox may not make user namespaces (an unprivileged door to
/// kernel code paths that need capabilities).
const CLONE_NEWUSER: u64 = 0x1000_0000;

/// (argument index, value) pairs a seccomp rule matches, all of them.
type ArgsEq = &'static [(usize, u64)];

/// Calls refused when their arguments name the init: each rule is (argument index, value)
/// pairs that must all match. pid 1 is the init; its process group is 1 (it leads its
/// session); `PRIO_USER`/`IOPRIO_WHO_USER` with 0 is the caller's own uid, root's for root.
const INIT_TARGETING: &[(&[&str], &[ArgsEq])] = &[
    (
        &[
            "prlimit64",
            "sched_setscheduler",
            "sched_setparam",
            "sched_setattr",
            "sched_setaffinity",
        ],
        &[&[(0, 1)]],
    ),
    // setpriority(which, who, prio): PRIO_PROCESS 0, PRIO_PGRP 1, PRIO_USER 2.
    (
        &["setpriority"],
        &[&[(0, 0), (1, 1)], &[(0, 1), (1, 1)], &[(0, 2), (1, 0)]],
    ),
    // ioprio_set(which, who, prio): IOPRIO_WHO_PROCESS 1, _PGRP 2, _USER 3.
    (
        &["ioprio_set"],
        &[&[(0, 1), (1, 1)], &[(0, 2), (1, 1)], &[(0, 3), (1, 0)]],
    ),
];

/// The seccomp profile (see the module docs).
pub fn seccomp() -> Result<LinuxSeccomp> {
    let eperm = libc::EPERM as u32;
    let mut syscalls: Vec<LinuxSyscall> = vec![LinuxSyscallBuilder::default()
        .names(
            DENIED_SYSCALLS
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>(),
        )
        .action(LinuxSeccompAction::ScmpActErrno)
        .errno_ret(eperm)
        .build()
        .map_err(oci)?];
    for (_, code) in DENIED_IOCTLS {
        syscalls.push(
            LinuxSyscallBuilder::default()
                .names(vec!["ioctl".to_owned()])
                .action(LinuxSeccompAction::ScmpActErrno)
                .errno_ret(eperm)
                .args(vec![LinuxSeccompArgBuilder::default()
                    .index(1usize)
                    .value(0xffff_ffffu64)
                    .value_two(*code)
                    .op(LinuxSeccompOperator::ScmpCmpMaskedEq)
                    .build()
                    .map_err(oci)?])
                .build()
                .map_err(oci)?,
        );
    }
    // unshare(CLONE_NEWUSER) and clone(CLONE_NEWUSER) (clone3 takes its flags in memory,
    // out of seccomp's sight: it is refused whole, and libc falls back to clone).
    for (name, index) in [("unshare", 0usize), ("clone", 0usize)] {
        syscalls.push(
            LinuxSyscallBuilder::default()
                .names(vec![name.to_owned()])
                .action(LinuxSeccompAction::ScmpActErrno)
                .errno_ret(eperm)
                .args(vec![LinuxSeccompArgBuilder::default()
                    .index(index)
                    .value(CLONE_NEWUSER)
                    .value_two(CLONE_NEWUSER)
                    .op(LinuxSeccompOperator::ScmpCmpMaskedEq)
                    .build()
                    .map_err(oci)?])
                .build()
                .map_err(oci)?,
        );
    }
    // The init (PID 1) runs as root: root inside could reach it by uid alone through the
    // calls that change another process's limits or scheduling (no ptrace check there).
    // Refused when they name pid 1, its process group or (setpriority/ioprio_set's "user"
    // forms) all of root's processes; the init's memory, descriptors and signals are out of
    // reach because it is non-dumpable and the namespace's init (docs/sandbox.md).
    for (names, rules) in INIT_TARGETING {
        for rule in *rules {
            let args = rule
                .iter()
                .map(|(index, value)| {
                    LinuxSeccompArgBuilder::default()
                        .index(*index)
                        .value(*value)
                        .op(LinuxSeccompOperator::ScmpCmpEq)
                        .build()
                        .map_err(oci)
                })
                .collect::<Result<Vec<_>>>()?;
            syscalls.push(
                LinuxSyscallBuilder::default()
                    .names(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                    .action(LinuxSeccompAction::ScmpActErrno)
                    .errno_ret(eperm)
                    .args(args)
                    .build()
                    .map_err(oci)?,
            );
        }
    }
    syscalls.push(
        LinuxSyscallBuilder::default()
            .names(vec!["clone3".to_owned()])
            .action(LinuxSeccompAction::ScmpActErrno)
            .errno_ret(libc::ENOSYS as u32)
            .build()
            .map_err(oci)?,
    );
    LinuxSeccompBuilder::default()
        .default_action(LinuxSeccompAction::ScmpActAllow)
        .architectures(vec![
            Arch::ScmpArchX86_64,
            Arch::ScmpArchX86,
            Arch::ScmpArchX32,
        ])
        .syscalls(syscalls)
        .build()
        .map_err(oci)
}

/// `cpu.shares` of a best-effort sandbox (the default is 1024).
pub const BE_CPU_SHARES: u64 = 2;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_names_what_the_module_docs_promise() {
        let limits = Limits {
            memory: Some(256 << 20),
            cpu_millis: Some(500),
            pids: Some(128),
            ..Limits::default()
        };
        let spec = build(&SpecInput {
            id: "sb1",
            rootfs: Path::new("/r/rootfs"),
            init: Path::new("/r/strata-init"),
            env: &["A=1".to_owned()],
            limits: &limits,
            etc_dir: Path::new("/r/etc"),
            secrets_dir: Some(Path::new("/r/secrets")),
            netns: None,
            cgroup_parent: "/strata",
        })
        .unwrap();
        let v = serde_json::to_value(&spec).unwrap();
        assert_eq!(v["process"]["args"][0], INIT_PATH);
        assert!(v["process"]["env"]
            .as_array()
            .unwrap()
            .contains(&"A=1".into()));
        assert_eq!(v["linux"]["resources"]["memory"]["limit"], 256 << 20);
        assert_eq!(v["linux"]["resources"]["cpu"]["quota"], 50_000);
        assert!(v["linux"]["resources"]["cpu"]["shares"].is_null());
        let be = Limits {
            class: CpuClass::Be,
            ..Limits::default()
        };
        let spec_be = build(&SpecInput {
            id: "sb2",
            rootfs: Path::new("/r/rootfs"),
            init: Path::new("/r/strata-init"),
            env: &[],
            limits: &be,
            etc_dir: Path::new("/r/etc"),
            secrets_dir: None,
            netns: None,
            cgroup_parent: &cgroup_parent(Some("n2")),
        })
        .unwrap();
        let v_be = serde_json::to_value(&spec_be).unwrap();
        assert_eq!(v_be["linux"]["resources"]["cpu"]["shares"], BE_CPU_SHARES);
        assert!(v_be["linux"]["resources"]["cpu"]["quota"].is_null());
        assert_eq!(v_be["linux"]["cgroupsPath"], "/strata-n2/sb2");
        assert_eq!(v["linux"]["resources"]["pids"]["limit"], 128);
        assert_eq!(v["linux"]["cgroupsPath"], "/strata/sb1");
        let masked = v["linux"]["maskedPaths"].as_array().unwrap();
        for p in ["/proc/kcore", "/proc/kpagecgroup", "/sys/firmware"] {
            assert!(masked.contains(&p.into()), "{p} not masked");
        }
        let caps = v["process"]["capabilities"]["bounding"].as_array().unwrap();
        assert!(!caps.contains(&"CAP_SYS_ADMIN".into()));
        assert!(!caps.contains(&"CAP_NET_RAW".into()));
        let sc = &v["linux"]["seccomp"];
        assert_eq!(sc["defaultAction"], "SCMP_ACT_ALLOW");
        let ficlone = sc["syscalls"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["args"][0]["valueTwo"] == 0x4004_9409u64)
            .expect("FICLONE denied");
        assert_eq!(ficlone["names"][0], "ioctl");
        assert_eq!(ficlone["args"][0]["op"], "SCMP_CMP_MASKED_EQ");
        let netns = v["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["type"] == "network")
            .unwrap();
        assert!(netns.get("path").is_none());
    }
}
