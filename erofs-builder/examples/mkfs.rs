//! `cargo run -p erofs-builder --example mkfs -- [--tar|--upper] SRC OUT.erofs`: build an
//! image from a directory, a layer tar (plain, gzip or zstd; `-` for standard input) or an
//! overlayfs upper directory (until `strata mkfs` is wired up).
//!
//! `... --example mkfs -- [--tar|--upper] SRC META.erofs BLOB`: build a lazy layer (meta
//! image + data blob); mount it with mount(2) and `device=/abs/path/BLOB`.
//!
//! A progress line goes to standard error every second.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use erofs_builder::{Progress, Source};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<PathBuf> = std::env::args_os().skip(1).map(Into::into).collect();
    let kind = match args.first().and_then(|a| a.to_str()) {
        Some("--tar") | Some("--upper") => args.remove(0).to_string_lossy().into_owned(),
        _ => String::new(),
    };
    let source = |src: &PathBuf| -> Result<Source, erofs_builder::Error> {
        Ok(match kind.as_str() {
            "--tar" if src.as_os_str() == "-" => Source::tar(std::io::stdin()),
            "--tar" => Source::tar_file(src)?,
            "--upper" => Source::OverlayUpper(src.clone()),
            _ => Source::Dir(src.clone()),
        })
    };
    let progress = Progress::new();
    let done = Arc::new(AtomicBool::new(false));
    let reporter = {
        let (p, done) = (progress.clone(), done.clone());
        std::thread::spawn(move || {
            let mut ticks = 0u32;
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(50));
                ticks += 1;
                if ticks % 20 == 0 {
                    eprintln!("{:?}", p.snapshot());
                }
            }
        })
    };
    let result = (|| -> Result<(), Box<dyn std::error::Error>> {
        match args.as_slice() {
            [src, out] => {
                let mut opts = erofs_builder::BuildOptions::default();
                opts.progress = Some(progress.clone());
                let stats = erofs_builder::build_image_from(source(src)?, out, &opts)?;
                println!("{stats:?}");
            }
            [src, meta, blob] => {
                let mut opts = erofs_builder::LayerOptions::default();
                opts.build.progress = Some(progress.clone());
                let stats = erofs_builder::build_layer_from(source(src)?, meta, blob, &opts)?;
                println!("{stats:?}");
                println!("blob blake3 {}", stats.blob_blake3_hex());
            }
            _ => {
                return Err(
                    "usage: mkfs [--tar|--upper] SRC OUT.erofs | ... SRC META.erofs BLOB".into(),
                )
            }
        }
        Ok(())
    })();
    done.store(true, Ordering::Relaxed);
    let _ = reporter.join();
    result
}
