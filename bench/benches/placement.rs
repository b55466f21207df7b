//! The placer's own speed: `Placer::place` per policy on a 160-node snapshot, the issue's
//! fleet, with the overlay as each policy uses it (weight 4: four instances).
//!
//! Set-up, never timed: a snapshot of 160 nodes with random reservations (10–80% of
//! memory) and 20–60 cached layers each (of 4 bases, 8 toolkits and 2,000 workspaces), and
//! 4,096 requests drawn from the simulator's workload (`placement::workload`), cycled.
//!
//! Timed: one `place` per iteration, whose admission callback accepts (the node's edge is
//! not the placer's cost); the clock advances 800 µs per placement (1,250/s: one of four
//! instances sharing 5,000/s), and every 1,250 placements (1 s) the placer gets a new
//! snapshot taken "now" (its overlay is pruned), so the overlay holds about one snapshot
//! period of entries, as in a front. Each
//! iteration is one placement (`Throughput::Elements(1)`): criterion's elem/s is the
//! placements per second of one instance (one thread). The goal: ≥ 100,000/s.

use std::sync::Arc;
use std::time::Duration;

use criterion::{black_box, Criterion, Throughput};
use placement::workload::Workload;
use placement::{
    LayerId, Limits, NodeId, NodeState, Placer, PlacerConfig, PolicyKind, PolicyParams, Resources,
    Snapshot,
};

const GIB: u64 = 1 << 30;
const NODES: u32 = 160;

fn fleet(rng: &mut fastrand::Rng, w: &Workload) -> Vec<NodeState> {
    (0..NODES)
        .map(|i| {
            let cap = Resources {
                cpu_millis: 128_000,
                mem_bytes: 1024 * GIB,
                disk_bytes: 8192 * GIB,
            };
            let frac = 0.1 + 0.7 * rng.f64();
            let mut layers: Vec<LayerId> = (0..rng.usize(20..=60))
                .map(|_| {
                    let s = w.stack(rng.u32(..4), rng.u32(..8), rng.u32(..100), rng.u32(..20));
                    s[rng.usize(..3)].id
                })
                .collect();
            layers.sort_unstable();
            layers.dedup();
            NodeState {
                id: NodeId(i),
                capacity: cap,
                reserved: Resources {
                    cpu_millis: (cap.cpu_millis as f64 * 4.0 * frac) as u64,
                    mem_bytes: (cap.mem_bytes as f64 * frac) as u64,
                    disk_bytes: (cap.disk_bytes as f64 * frac * 0.5) as u64,
                },
                used: Resources::default(),
                sandboxes: (frac * 300.0) as u32,
                limits: Limits::default(),
                layers: layers.into(),
            }
        })
        .collect()
}

fn placement(c: &mut Criterion) {
    let mut rng = fastrand::Rng::with_seed(7);
    let w = Workload::default();
    let nodes = fleet(&mut rng, &w);
    let reqs: Vec<(Resources, [placement::Layer; 3])> = (0..4096)
        .map(|_| {
            let stack = w.stack(rng.u32(..4), rng.u32(..8), rng.u32(..100), rng.u32(..20));
            (w.size(&mut rng), stack)
        })
        .collect();
    let mut group = c.benchmark_group("place");
    group.throughput(Throughput::Elements(1));
    for kind in PolicyKind::ALL {
        let snap = Arc::new(Snapshot::new(Duration::ZERO, nodes.clone()).expect("snapshot"));
        let cfg = PlacerConfig {
            overlay: kind.overlay(),
            overlay_weight: 4.0,
            ..PlacerConfig::default()
        };
        let policy = kind.build(&PolicyParams::default()).expect("policy");
        let mut placer = Placer::new(policy, cfg, snap, 1).expect("placer");
        let (mut i, mut now) = (0usize, Duration::ZERO);
        group.bench_function(kind.name(), |b| {
            b.iter(|| {
                let (res, stack) = &reqs[i % reqs.len()];
                let req = placement::Request {
                    resources: *res,
                    layers: stack,
                };
                i += 1;
                now += Duration::from_micros(800);
                if i % 1250 == 0 {
                    let s = Snapshot::new(now, nodes.clone()).expect("snapshot");
                    placer.set_snapshot(Arc::new(s));
                }
                black_box(placer.place(&req, now, |_| Ok(())).ok())
            })
        });
    }
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    placement(&mut criterion);
    criterion.final_summary();
}
