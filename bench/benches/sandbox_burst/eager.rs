//! The eager baseline of `sandbox_burst` (DSec's: the stack as one tar.gz from the same
//! store, downloaded and extracted per sandbox, run with the same runtime) and the runtime's
//! floor (`runc run` on an already composed root).

use super::*;

pub(super) struct Eager {
    pub(super) rt: tokio::runtime::Runtime,
    pub(super) backend: Arc<dyn fs_cache::Backend>,
    pub(super) key: String,
    pub(super) dir: PathBuf,
    pub(super) runc_root: PathBuf,
    pub(super) init: PathBuf,
}

pub(super) fn find_in_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Write a bundle for `rootfs` at `bundle` (the daemon's spec, its etc files), the process
/// `args` (None: Strata's init, as the daemon's sandboxes).
pub(super) fn write_bundle(
    e: &Eager,
    id: &str,
    bundle: &Path,
    rootfs: &Path,
    args: Option<Vec<String>>,
) {
    let etc = bundle.join("etc");
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::write(etc.join("hostname"), format!("{id}\n")).unwrap();
    std::fs::write(
        etc.join("hosts"),
        format!("127.0.0.1\tlocalhost\n127.0.1.1\t{id}\n"),
    )
    .unwrap();
    std::fs::write(etc.join("resolv.conf"), "").unwrap();
    let limits = Limits::default();
    let mut spec = sandbox_runtime::spec::build(&sandbox_runtime::spec::SpecInput {
        id,
        rootfs,
        init: &e.init,
        env: &[],
        limits: &limits,
        etc_dir: &etc,
        secrets_dir: None,
        netns: None,
        cgroup_parent: "/strata",
    })
    .expect("spec::build");
    if let Some(a) = args {
        if let Some(p) = spec.process_mut() {
            p.set_args(Some(a));
        }
    }
    std::fs::write(
        bundle.join("config.json"),
        serde_json::to_vec(&spec).unwrap(),
    )
    .unwrap();
}

/// Read `child`'s stdout to its end; the instant of its first byte.
pub(super) fn first_byte(child: &mut Child) -> Option<Instant> {
    let mut out = child.stdout.take()?;
    let mut buf = [0u8; 4096];
    let mut first = None;
    while let Ok(k) = out.read(&mut buf) {
        if k == 0 {
            break;
        }
        first.get_or_insert_with(Instant::now);
    }
    first
}

pub(super) fn eager_one(e: &Eager, i: usize) -> Result<Sample, String> {
    let id = format!("eg-{i}");
    let dir = e.dir.join(&id);
    let rootfs = dir.join("rootfs");
    std::fs::create_dir_all(&rootfs).map_err(|x| x.to_string())?;
    let t0 = Instant::now();
    let bytes =
        e.rt.block_on(e.backend.get(&e.key))
            .map_err(|x| x.to_string())?;
    let t1 = Instant::now();
    let mut tar = Command::new("tar")
        .arg("-xzf")
        .arg("-")
        .arg("-C")
        .arg(&rootfs)
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|x| x.to_string())?;
    tar.stdin
        .take()
        .ok_or("no stdin")?
        .write_all(&bytes)
        .map_err(|x| x.to_string())?;
    drop(bytes);
    let out = tar.wait_with_output().map_err(|x| x.to_string())?;
    if !out.status.success() {
        return Err(format!("tar: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let t2 = Instant::now();
    write_bundle(e, &id, &dir, &rootfs, None);
    let st = Command::new("runc")
        .arg("--root")
        .arg(&e.runc_root)
        .args(["run", "--detach", "--no-new-keyring", "--bundle"])
        .arg(&dir)
        .arg(&id)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|x| x.to_string())?;
    if !st.success() {
        return Err(format!("runc run {id}: {st}"));
    }
    let t3 = Instant::now();
    let mut ex = Command::new("runc")
        .arg("--root")
        .arg(&e.runc_root)
        .args(["exec", &id, "sh", "-c", CMD])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|x| x.to_string())?;
    let first = first_byte(&mut ex).ok_or("no output")?;
    let st = ex.wait().map_err(|x| x.to_string())?;
    if !st.success() {
        return Err(format!("runc exec {id}: {st}"));
    }
    let t4 = Instant::now();
    Ok(Sample {
        create: ms(t3 - t0),
        first_output: ms(first - t0),
        exec: ms(t4 - t3),
        download: ms(t1 - t0),
        extract: ms(t2 - t1),
        runc_run: ms(t3 - t2),
        daemon_create: 0.0,
    })
}

pub(super) fn run_pool<T: Send>(
    n: usize,
    conc: usize,
    f: impl Fn(usize) -> Result<T, String> + Sync,
) -> (Vec<T>, Vec<String>, Duration) {
    let next = AtomicUsize::new(0);
    let out = Mutex::new(Vec::new());
    let errs = Mutex::new(Vec::new());
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..conc.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                match f(i) {
                    Ok(v) => lock(&out).push(v),
                    Err(e) => lock(&errs).push(format!("#{i}: {e}")),
                }
            });
        }
    });
    let wall = t.elapsed();
    (
        out.into_inner().unwrap_or_default(),
        errs.into_inner().unwrap_or_default(),
        wall,
    )
}

pub(super) fn eager_burst(e: &Eager, n: usize, conc: usize, tar_bytes: u64) -> Burst {
    let d0 = synced_disk_written();
    let cpu0 = machine_cpu();
    let (samples, errors, wall) = run_pool(n, conc, |i| eager_one(e, i));
    let cpu = machine_cpu() - cpu0;
    let disk = synced_disk_written() - d0;
    let ok = samples.len() as u64;
    let b = Burst {
        samples,
        errors,
        wall,
        disk,
        fetched: tar_bytes * ok,
        requests: ok,
        cpu,
    };
    print_burst(
        &format!(
            "Eager: {n} sandboxes, each S3 GET + tar -xzf of the stack's tar.gz + runc run -d + runc exec, {conc} threads"
        ),
        &b,
        true,
    );
    b
}

// ---------------------------------------------------------------------------------------
// Runtime floor.

pub(super) fn floor(e: &Eager, rootfs: &Path, n: usize, conc: usize) {
    let bundles = e.dir.join("floor");
    let run_one = |i: usize| -> Result<(f64, f64), String> {
        let id = format!("fl-{i}");
        let b = bundles.join(&id);
        write_bundle(
            e,
            &id,
            &b,
            rootfs,
            Some(vec!["sh".into(), "-c".into(), CMD.into()]),
        );
        let t0 = Instant::now();
        let mut c = Command::new("runc")
            .arg("--root")
            .arg(&e.runc_root)
            .args(["run", "--no-new-keyring", "--bundle"])
            .arg(&b)
            .arg(&id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|x| x.to_string())?;
        let first = first_byte(&mut c).ok_or("no output")?;
        let st = c.wait().map_err(|x| x.to_string())?;
        let t1 = Instant::now();
        let _ = std::fs::remove_dir_all(&b);
        if !st.success() {
            return Err(format!("runc run {id}: {st}"));
        }
        Ok((ms(first - t0), ms(t1 - t0)))
    };
    println!(
        "\n### Runtime floor: `runc run` of the command on one already extracted root ({n} runs)\n"
    );
    println!("| concurrency | wall | runs/s | first output ms p50 / p99 / max | run to exit ms p50 / p99 | CPU of runc + container (user+sys) per run | machine CPU per run | CPU-bound ceiling (2 vCPUs / machine CPU per run) |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for c in [1, conc] {
        let rc0 = children_cpu();
        let mc0 = machine_cpu();
        let (v, errs, wall) = run_pool(n, c, |i| run_one(i + c * 100_000));
        let rc = children_cpu() - rc0;
        let mc = machine_cpu() - mc0;
        let k = v.len().max(1) as f64;
        let cpus = std::thread::available_parallelism()
            .map(|x| x.get())
            .unwrap_or(1) as f64;
        println!(
            "| {c} | {:.2} s | {:.1} | {} | {} | {:.1} ms | {:.1} ms | {:.0}/s |",
            wall.as_secs_f64(),
            v.len() as f64 / wall.as_secs_f64(),
            dist(&v.iter().map(|x| x.0).collect::<Vec<_>>()),
            {
                let s = sorted(&v.iter().map(|x| x.1).collect::<Vec<_>>());
                format!("{:.1} / {:.1}", pct(&s, 0.5), pct(&s, 0.99))
            },
            rc * 1000.0 / k,
            mc * 1000.0 / k,
            cpus / (mc / k)
        );
        for e in errs.iter().take(3) {
            println!("error: {e}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Sustained and pool.
