//! `cargo run -p erofs-builder --example mkfs -- SRC_DIR OUT.erofs`: build an image from a
//! directory (until `strata mkfs` is wired up).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<std::path::PathBuf> = std::env::args_os().skip(1).map(Into::into).collect();
    let [src, out] = args.as_slice() else {
        return Err("usage: mkfs SRC_DIR OUT.erofs".into());
    };
    let stats = erofs_builder::build_image(src, out, &erofs_builder::BuildOptions::default())?;
    println!("{stats:?}");
    Ok(())
}
