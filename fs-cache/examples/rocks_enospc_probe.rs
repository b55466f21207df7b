// scratch probe (to be deleted)
use std::io::Write;
fn main() {
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
        let db = rocksdb::DB::open(&opts, mnt.join("index")).unwrap();
        db.put(b"a", b"1").unwrap();
        let mut f = std::fs::File::create(mnt.join("ballast")).unwrap();
        while f.write_all(&[0u8; 4096]).is_ok() {}
        while f.write_all(&[0u8; 1]).is_ok() {}
        let mut first_err = None;
        for i in 0..5000u32 {
            if let Err(e) = db.put(i.to_le_bytes(), [7u8; 40]) {
                println!("put {i}: {e}");
                first_err = Some(i);
                break;
            }
        }
        println!("first_err {first_err:?}");
        println!("again: {:?}", db.put(b"x", b"y"));
        println!("get: {:?}", db.get(b"a"));
        drop(f);
        std::fs::remove_file(mnt.join("ballast")).unwrap();
        for s in 0..12 {
            let r = db.put(b"x", b"y");
            println!("after freeing, t={s}s: {r:?}");
            if r.is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
        drop(db);
        let db = rocksdb::DB::open(&opts, mnt.join("index")).unwrap();
        println!("reopen get a: {:?}, x: {:?}", db.get(b"a"), db.get(b"x"));
    });
    std::process::Command::new("umount")
        .arg(mnt)
        .status()
        .unwrap();
    r.unwrap();
}
