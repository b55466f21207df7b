// scratch probe (to be deleted)
use std::io::Write;
fn main() {
    let mode = std::env::args().nth(1).unwrap();
    let mnt = std::path::Path::new("/tmp/probe/mnt");
    std::fs::create_dir_all(mnt).unwrap();
    assert!(std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(mnt)
        .status()
        .unwrap()
        .success());
    let r = std::panic::catch_unwind(|| {
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        opts.set_log_level(rocksdb::LogLevel::Warn);
        opts.set_write_buffer_size(4 << 20);
        let mut wo = rocksdb::WriteOptions::default();
        wo.disable_wal(true);
        let db = rocksdb::DB::open(&opts, mnt.join("index")).unwrap();
        db.put_opt(b"a", b"1", &wo).unwrap();
        println!("flush0 {:?}", db.flush());
        let mut f = std::fs::File::create(mnt.join("ballast")).unwrap();
        while f.write_all(&[0u8; 4096]).is_ok() {}
        while f.write_all(&[0u8; 1]).is_ok() {}
        for i in 0..5000u32 {
            if let Err(e) = db.put_opt(i.to_le_bytes(), [7u8; 40], &wo) {
                println!("put {i}: {e}");
                break;
            }
        }
        println!("flush1 {:?}", db.flush());
        println!("put after failed flush {:?}", db.put_opt(b"q", b"q", &wo));
        println!("flush2 {:?}", db.flush());
        if mode.contains("free") {
            drop(f);
            std::fs::remove_file(mnt.join("ballast")).unwrap();
            println!("freed");
        }
        if mode.contains("sleep") {
            std::thread::sleep(std::time::Duration::from_secs(12));
            println!("slept");
        }
        println!("put after: {:?}", db.put_opt(b"x", b"y", &wo));
        println!("flush3 {:?}", db.flush());
        println!("dropping");
        drop(db);
        println!("dropped");
        let _ = std::fs::remove_file(mnt.join("ballast"));
        let db = rocksdb::DB::open(&opts, mnt.join("index")).unwrap();
        println!(
            "reopen get a: {:?}, 5: {:?} x: {:?}",
            db.get(b"a"),
            db.get(5u32.to_le_bytes()),
            db.get(b"x")
        );
        println!(
            "put after reopen: {:?} flush {:?}",
            db.put_opt(b"z", b"z", &wo),
            db.flush()
        );
    });
    std::process::Command::new("umount")
        .arg(mnt)
        .status()
        .unwrap();
    r.unwrap();
}
