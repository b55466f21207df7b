//! `cargo run -p erofs-builder --example mkfs -- SRC_DIR OUT.erofs`: build an image from a
//! directory (until `strata mkfs` is wired up).
//!
//! `... --example mkfs -- SRC_DIR META.erofs BLOB`: build a lazy layer (meta image + data
//! blob); mount it with mount(2) and `device=/abs/path/BLOB`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<std::path::PathBuf> = std::env::args_os().skip(1).map(Into::into).collect();
    match args.as_slice() {
        [src, out] => {
            let stats =
                erofs_builder::build_image(src, out, &erofs_builder::BuildOptions::default())?;
            println!("{stats:?}");
        }
        [src, meta, blob] => {
            let stats = erofs_builder::build_layer(
                src,
                meta,
                blob,
                &erofs_builder::LayerOptions::default(),
            )?;
            println!("{stats:?}");
            println!("blob blake3 {}", stats.blob_blake3_hex());
        }
        _ => return Err("usage: mkfs SRC_DIR OUT.erofs | mkfs SRC_DIR META.erofs BLOB".into()),
    }
    Ok(())
}
