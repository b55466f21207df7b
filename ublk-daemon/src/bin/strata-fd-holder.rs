//! `strata-fd-holder --run-dir DIR`: the fd holder (`ublk_daemon::holder`) as its own small
//! program, for tests and for nodes that start it from a service manager. `strata
//! fuse-holder` runs the same code.

fn main() {
    let mut args = std::env::args_os().skip(1);
    let run_dir = match (args.next(), args.next(), args.next()) {
        (Some(flag), Some(dir), None) if flag == "--run-dir" => std::path::PathBuf::from(dir),
        _ => {
            eprintln!("usage: strata-fd-holder --run-dir DIR");
            std::process::exit(2);
        }
    };
    if let Err(e) = ublk_daemon::holder::run(&run_dir) {
        eprintln!("strata-fd-holder: {e}");
        std::process::exit(1);
    }
}
