//! Builds the sandboxes' init (`init/strata-init.c`) as one static binary, embedded by
//! `src/agent.rs`. It must run on any base layer, so it links nothing dynamically; the C
//! compiler and the static C library (Debian: `gcc`, `libc6-dev`) are build dependencies
//! (`scripts/install-build-deps.sh`).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "init/strata-init.c";
    println!("cargo:rerun-if-changed={src}");
    println!("cargo:rerun-if-env-changed=CC");
    let out =
        PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("strata-init");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let status = Command::new(&cc)
        .args(["-static", "-O2", "-s", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&out)
        .arg(src)
        .status()
        .unwrap_or_else(|e| {
            panic!("run the C compiler {cc:?} for {src}: {e} (install gcc and libc6-dev)")
        });
    assert!(
        status.success(),
        "{cc} -static {src} failed ({status}): the sandboxes' init needs a C compiler and a static C library (Debian: gcc, libc6-dev)"
    );
}
