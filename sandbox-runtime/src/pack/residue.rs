//! Residue rules: what `pack-diff` leaves out of a packed layer, in gitignore syntax.
//!
//! Paths are matched as the sandbox sees them, rooted at its `/` (`/tmp/*` is the sandbox's
//! `/tmp`, `__pycache__/` is any directory of that name; as in git, a pattern with a `/`
//! before its end is anchored at the root, so `**/.npm/_cacache/` for any depth). The defaults ([`DEFAULT_RULES`])
//! come first, a user's rule file (`--strip FILE`) after them, so that its lines win as in
//! git: `!/var/lib/apt/lists/*` keeps the apt lists after all. As in git, an entry under a
//! stripped directory cannot be brought back: the walk does not enter a stripped directory.

use std::path::Path;

use ignore::gitignore::{Gitignore, GitignoreBuilder};

use crate::{Error, Result};

/// The rules every pack starts from (unless `--no-default-strip`).
pub const DEFAULT_RULES: &str = r"# Temporary directories
/tmp/*
/var/tmp/*
# Package-manager caches: apt's lists and archives, pip, npm, cargo, go build, ccache
/var/lib/apt/lists/*
/var/cache/apt/archives/*.deb
/var/cache/apt/archives/partial/*
/var/cache/apt/*.bin
/var/cache/debconf/*-old
/root/.cache/
/home/*/.cache/
**/.npm/_cacache/
**/.npm/_logs/
**/.cargo/registry/
**/.cargo/git/
**/go/pkg/mod/cache/
.ccache/
__pycache__/
# Shell and REPL histories
.bash_history
.zsh_history
.sh_history
.ash_history
.python_history
.node_repl_history
.sqlite_history
.psql_history
.mysql_history
.irb_history
.Rhistory
.lesshst
.viminfo
.wget-hsts
# Editor swap, backup and lock files
.*.sw[a-p]
*~
\#*#
.#*
# Files the runtime writes (bound over the sandbox's own, or mount points it creates)
/etc/hostname
/etc/hosts
/etc/resolv.conf
/run/secrets
/dev/.strata*
# Identity: regenerated for every sandbox
/etc/machine-id
/var/lib/dbus/machine-id
/etc/ssh/ssh_host_*
";

/// A compiled rule set.
#[derive(Debug)]
pub struct Rules {
    ignore: Gitignore,
}

impl Rules {
    /// The defaults (if `defaults`) followed by `extra` (gitignore lines).
    pub fn new(defaults: bool, extra: Option<&str>) -> Result<Self> {
        let mut b = GitignoreBuilder::new("/");
        let mut add = |text: &str, from: &str| -> Result<()> {
            for (n, line) in text.lines().enumerate() {
                b.add_line(None, line).map_err(|e| {
                    Error::InvalidSpec(format!("{from} line {}: {line:?}: {e}", n + 1))
                })?;
            }
            Ok(())
        };
        if defaults {
            add(DEFAULT_RULES, "the default strip rules")?;
        }
        if let Some(x) = extra {
            add(x, "the strip rules")?;
        }
        let ignore = b
            .build()
            .map_err(|e| Error::InvalidSpec(format!("strip rules: {e}")))?;
        Ok(Self { ignore })
    }

    /// The rule that strips `path` (absolute, as the sandbox sees it), if one does; its
    /// parents are not looked at (the walk never enters a stripped directory).
    pub fn strips(&self, path: &Path, is_dir: bool) -> Option<String> {
        match self.ignore.matched(path, is_dir) {
            ignore::Match::Ignore(g) => Some(g.original().to_owned()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strips(r: &Rules, p: &str, dir: bool) -> bool {
        r.strips(Path::new(p), dir).is_some()
    }

    #[test]
    fn defaults_strip_the_residue_and_nothing_else() {
        let r = Rules::new(true, None).unwrap();
        for (p, dir) in [
            ("/tmp/x", false),
            ("/var/tmp/build", true),
            ("/var/lib/apt/lists/deb.debian.org_Packages", false),
            ("/var/cache/apt/archives/hello_2.10_amd64.deb", false),
            ("/var/cache/apt/pkgcache.bin", false),
            ("/root/.cache", true),
            ("/home/agent/.cache", true),
            ("/root/.npm/_cacache", true),
            ("/root/.cargo/registry", true),
            ("/usr/lib/python3/dist-packages/foo/__pycache__", true),
            ("/root/.bash_history", false),
            ("/home/agent/.python_history", false),
            ("/root/.notes.txt.swp", false),
            ("/etc/app.conf~", false),
            ("/root/#draft#", false),
            ("/etc/hostname", false),
            ("/etc/hosts", false),
            ("/etc/resolv.conf", false),
            ("/run/secrets", true),
            ("/etc/machine-id", false),
            ("/etc/ssh/ssh_host_ed25519_key", false),
            ("/etc/ssh/ssh_host_rsa_key.pub", false),
        ] {
            assert!(strips(&r, p, dir), "{p} is not stripped");
        }
        for (p, dir) in [
            ("/tmp", true),
            ("/var/lib/apt/lists", true),
            ("/usr/bin/hello", false),
            ("/etc/ssh/sshd_config", false),
            ("/root/.bashrc", false),
            ("/root/notes.txt", false),
            ("/srv/tmp/x", false),
            ("/etc/hostname.d", true),
            ("/usr/lib/python3/dist-packages/foo/mod.py", false),
            ("/var/cache/apt/archives", true),
            ("/root/.cargo/bin/rg", false),
        ] {
            assert!(!strips(&r, p, dir), "{p} is stripped");
        }
        // `__pycache__/` names directories only.
        assert!(!strips(&r, "/srv/__pycache__", false));
    }

    #[test]
    fn user_rules_add_and_take_back() {
        let r = Rules::new(true, Some("/srv/build/\n!/var/lib/apt/lists/*\n*.log\n")).unwrap();
        assert!(strips(&r, "/srv/build", true));
        assert!(strips(&r, "/var/log/x.log", false));
        assert!(!strips(&r, "/var/lib/apt/lists/x", false));
        assert!(strips(&r, "/tmp/x", false));
        let none = Rules::new(false, Some("*.o")).unwrap();
        assert!(!strips(&none, "/tmp/x", false));
        assert!(strips(&none, "/src/a.o", false));
    }

    #[test]
    fn a_bad_rule_is_an_error_with_its_line() {
        let e = Rules::new(false, Some("ok\n/a/**{b\n")).unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
    }
}
