//! The placer's rules: overlay, TTL, refusals and bounded retries, herding, locality.

use std::sync::Arc;
use std::time::Duration;

use placement::{
    Error, Layer, LayerId, Limits, NodeId, NodeState, Placer, PlacerConfig, PolicyKind,
    PolicyParams, Refusal, RefusalReason, Request, Resources, Snapshot,
};

const GIB: u64 = 1 << 30;

fn node(id: u32, mem_used_gib: u64, layers: &[u64]) -> NodeState {
    NodeState {
        id: NodeId(id),
        capacity: Resources {
            cpu_millis: 64_000,
            mem_bytes: 256 * GIB,
            disk_bytes: 1024 * GIB,
        },
        reserved: Resources {
            mem_bytes: mem_used_gib * GIB,
            ..Resources::default()
        },
        used: Resources::default(),
        sandboxes: 0,
        limits: Limits::default(),
        layers: layers
            .iter()
            .map(|&l| LayerId(l))
            .collect::<Vec<_>>()
            .into(),
    }
}

fn snap(t_ms: u64, nodes: Vec<NodeState>) -> Arc<Snapshot> {
    Arc::new(Snapshot::new(Duration::from_millis(t_ms), nodes).unwrap())
}

const REQ: Request<'static> = Request {
    resources: Resources {
        cpu_millis: 1000,
        mem_bytes: GIB,
        disk_bytes: GIB,
    },
    layers: &[],
};

fn placer(kind: PolicyKind, cfg: PlacerConfig, s: Arc<Snapshot>, seed: u64) -> Placer {
    let cfg = PlacerConfig {
        overlay: kind.overlay(),
        ..cfg
    };
    Placer::new(kind.build(&PolicyParams::default()).unwrap(), cfg, s, seed).unwrap()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn the_overlay_balances_an_instance_on_a_stale_snapshot() {
    let s = snap(0, (0..2).map(|i| node(i, 0, &[])).collect());
    // k = 2 of 2 nodes: both are always compared, so with the overlay the placements
    // alternate exactly; without it both look equal forever.
    let mut with = placer(
        PolicyKind::PowerOfKOverlay,
        PlacerConfig::default(),
        s.clone(),
        1,
    );
    let mut counts = [0u32; 2];
    for i in 0..10 {
        let n = with.choose(&REQ, ms(i), &[]).unwrap();
        with.placed(n, &REQ, ms(i));
        counts[n.0 as usize] += 1;
    }
    assert_eq!(counts, [5, 5]);
    assert_eq!(with.overlay_len(), 10);
    // Least-loaded without the overlay on a snapshot where node 1 looks lighter: every
    // placement goes there (the herd).
    let s2 = snap(0, vec![node(0, 10, &[]), node(1, 9, &[])]);
    let mut herd = placer(PolicyKind::LeastLoaded, PlacerConfig::default(), s2, 1);
    for i in 0..50 {
        let n = herd.choose(&REQ, ms(i), &[]).unwrap();
        herd.placed(n, &REQ, ms(i));
        assert_eq!(n, NodeId(1));
    }
}

#[test]
fn a_newer_snapshot_and_the_ttl_retire_overlay_entries() {
    let cfg = PlacerConfig {
        overlay_ttl: ms(500),
        settle: ms(50),
        ..PlacerConfig::default()
    };
    let s = snap(0, (0..4).map(|i| node(i, 0, &[])).collect());
    let mut p = placer(PolicyKind::PowerOfKOverlay, cfg, s, 2);
    for t in [10, 20, 100, 200] {
        let n = p.choose(&REQ, ms(t), &[]).unwrap();
        p.placed(n, &REQ, ms(t));
    }
    // Taken at 120 ms: shows what was placed before 70 ms (settle 50 ms).
    p.set_snapshot(snap(120, (0..4).map(|i| node(i, 0, &[])).collect()));
    assert_eq!(p.overlay_len(), 2);
    // No newer snapshot: the TTL drops the rest at 100 + 500 and 200 + 500 ms.
    p.choose(&REQ, ms(650), &[]).unwrap();
    assert_eq!(p.overlay_len(), 1);
    p.choose(&REQ, ms(700), &[]).unwrap();
    assert_eq!(p.overlay_len(), 0);
}

#[test]
fn a_placement_in_flight_counts_until_its_answer_whatever_the_snapshots() {
    let cfg = PlacerConfig {
        overlay_ttl: ms(10_000),
        settle: ms(50),
        ..PlacerConfig::default()
    };
    let s = snap(0, (0..2).map(|i| node(i, 0, &[])).collect());
    let mut p = placer(PolicyKind::PowerOfKOverlay, cfg, s, 4);
    // Two creates on their way to node 0 (a busy node, slow to even count them), one to 1.
    let a = p.sent(NodeId(0), &REQ, ms(10));
    let b = p.sent(NodeId(0), &REQ, ms(20));
    let c = p.sent(NodeId(1), &REQ, ms(30));
    assert!(a.is_some() && b.is_some() && c.is_some());
    // Snapshots long after them that do not show them: they still count, so the next
    // placement, with both nodes compared (k = 2 of 2), goes to node 1.
    for t in [500, 1000, 2000] {
        p.set_snapshot(snap(t, (0..2).map(|i| node(i, 0, &[])).collect()));
        assert_eq!(p.overlay_len(), 3);
    }
    assert_eq!(p.choose(&REQ, ms(2001), &[]).unwrap(), NodeId(1));
    // Node 0 admitted `a` at 2100 ms, refused `b`; node 1 admitted `c` at 2100 ms. `b` no
    // longer counts; the others until a snapshot taken after their answer (+ settle).
    p.answered(a, ms(2100), true);
    p.answered(b, ms(2100), false);
    p.answered(b, ms(2100), true);
    assert_eq!(p.overlay_len(), 2);
    p.set_snapshot(snap(2120, (0..2).map(|i| node(i, 0, &[])).collect()));
    assert_eq!(p.overlay_len(), 2, "within settle of the answer");
    p.answered(c, ms(2130), true);
    p.set_snapshot(snap(2160, (0..2).map(|i| node(i, 0, &[])).collect()));
    assert_eq!(
        p.overlay_len(),
        1,
        "a's answer (2100) + settle < 2160; c's is not"
    );
    p.set_snapshot(snap(2200, (0..2).map(|i| node(i, 0, &[])).collect()));
    assert_eq!(p.overlay_len(), 0);
    // A node that counts this instance's sends: the first `seen` of them are in its state,
    // however recent, the others not, however old.
    let e = p.sent(NodeId(0), &REQ, ms(2300));
    let f = p.sent(NodeId(0), &REQ, ms(2310));
    assert_eq!(p.sends_to(NodeId(0)), 4);
    assert_eq!(p.overlay_len(), 2);
    let fresh = || snap(9000, (0..2).map(|i| node(i, 0, &[])).collect());
    p.set_snapshot_seen(fresh(), &[(NodeId(0), 3)]);
    assert_eq!(
        p.overlay_len(),
        1,
        "sends 0..3 of node 0 are shown, send 3 (f) is not"
    );
    p.answered(e, ms(9001), true);
    assert_eq!(p.overlay_len(), 1, "e's answer changes nothing: it is gone");
    p.set_snapshot_seen(fresh(), &[(NodeId(0), 4)]);
    assert_eq!(p.overlay_len(), 0);
    assert!(f.is_some());
    // An answer that never comes: the TTL ends it.
    let d = p.sent(NodeId(1), &REQ, ms(3000));
    assert!(d.is_some());
    p.choose(&REQ, ms(12_999), &[]).unwrap();
    assert_eq!(p.overlay_len(), 1);
    p.choose(&REQ, ms(13_000), &[]).unwrap();
    assert_eq!(p.overlay_len(), 0);
    p.answered(d, ms(13_001), true);
    assert_eq!(
        p.overlay_len(),
        0,
        "an expired ticket's answer changes nothing"
    );
    // Without an overlay, nothing is in flight.
    let s = snap(0, (0..2).map(|i| node(i, 0, &[])).collect());
    let mut plain = placer(PolicyKind::PowerOfK, PlacerConfig::default(), s, 5);
    assert!(plain.sent(NodeId(0), &REQ, ms(1)).is_none());
}

#[test]
fn a_snapshot_taken_node_by_node_retires_entries_by_each_nodes_time() {
    let cfg = PlacerConfig {
        settle: ms(50),
        ..PlacerConfig::default()
    };
    let s = snap(0, (0..2).map(|i| node(i, 0, &[])).collect());
    let mut p = placer(PolicyKind::PowerOfKOverlay, cfg, s, 3);
    for (t, n) in [(10, 0), (20, 1), (300, 0), (310, 1)] {
        p.placed(NodeId(n), &REQ, ms(t));
    }
    // Node 0 seen at 500 ms (shows all of its placements), node 1 last seen at 100 ms (a
    // slow node's kept state: shows only the first).
    let nodes = (0..2).map(|i| node(i, 0, &[])).collect();
    let s = Snapshot::new_per_node(nodes, vec![ms(500), ms(100)]).unwrap();
    assert_eq!(s.taken_at(), ms(100));
    assert_eq!(s.taken_at_of(0), ms(500));
    p.set_snapshot(Arc::new(s));
    assert_eq!(
        p.overlay_len(),
        1,
        "only node 1's placement at 310 ms is kept"
    );
    assert!(Snapshot::new_per_node(vec![node(0, 0, &[])], vec![]).is_err());
}

#[test]
fn refusals_are_retried_elsewhere_and_bounded() {
    let s = snap(0, (0..6).map(|i| node(i, 0, &[])).collect());
    let cfg = PlacerConfig {
        max_attempts: 3,
        refusal_ttl: ms(1000),
        ..PlacerConfig::default()
    };
    let mut p = placer(PolicyKind::PowerOfKOverlay, cfg, s.clone(), 3);
    let mut asked = Vec::new();
    let err = p
        .place(&REQ, ms(0), |n| {
            asked.push(n);
            Err(Refusal {
                node: n,
                reason: RefusalReason::Memory,
                need: GIB,
                free: 0,
            })
        })
        .unwrap_err();
    match err {
        Error::Refused { attempts, last } => {
            assert_eq!(attempts, 3);
            assert_eq!(last.reason, RefusalReason::Memory);
        }
        other => panic!("{other:?}"),
    }
    asked.sort();
    asked.dedup();
    assert_eq!(asked.len(), 3, "three distinct nodes tried");
    // Those three stay blocked: the next request goes to one of the other three, whose
    // refusal is retried on the next.
    let mut second = Vec::new();
    let ok = p
        .place(&REQ, ms(10), |n| {
            second.push(n);
            if second.len() == 1 {
                Err(Refusal {
                    node: n,
                    reason: RefusalReason::Sandboxes,
                    need: 1,
                    free: 0,
                })
            } else {
                Ok(())
            }
        })
        .unwrap();
    assert_eq!(ok.attempts, 2);
    assert!(
        second.iter().all(|n| !asked.contains(n)),
        "{second:?} vs {asked:?}"
    );
    assert_ne!(second[0], second[1]);
    // All four refusing nodes blocked: two remain (one holds a placement).
    let mut third = Vec::new();
    for t in 0..20 {
        let n = p.choose(&REQ, ms(20 + t), &[]).unwrap();
        third.push(n);
    }
    assert!(third.iter().all(|n| !asked.contains(n) && *n != second[0]));
    // A snapshot taken after the refusals unblocks them.
    p.set_snapshot(snap(100, (0..6).map(|i| node(i, 0, &[])).collect()));
    let mut seen = std::collections::HashSet::new();
    for t in 0..200 {
        let n = p.choose(&REQ, ms(200 + t), &[]).unwrap();
        p.placed(n, &REQ, ms(200 + t));
        seen.insert(n);
    }
    assert_eq!(seen.len(), 6);
}

#[test]
fn full_nodes_by_the_view_are_not_chosen_and_an_empty_choice_is_an_error() {
    // Node 0 is full by memory: power-of-k never picks it while node 1 has room.
    let s = snap(0, vec![node(0, 256, &[]), node(1, 0, &[])]);
    let mut p = placer(PolicyKind::PowerOfK, PlacerConfig::default(), s, 4);
    for t in 0..20 {
        assert_eq!(p.choose(&REQ, ms(t), &[]).unwrap(), NodeId(1));
    }
    assert!(matches!(
        p.choose(&REQ, ms(30), &[NodeId(1)]),
        Err(Error::NoCandidate)
    ));
}

#[test]
fn locality_prefers_a_cached_node_only_within_its_bound() {
    let stack = [
        Layer {
            id: LayerId(1),
            bytes: GIB,
        },
        Layer {
            id: LayerId(2),
            bytes: GIB,
        },
    ];
    let req = Request {
        layers: &stack,
        ..REQ
    };
    let params = PolicyParams {
        k: 2,
        homes: 0,
        bonus: 0.05,
    };
    let mk = |s| {
        Placer::new(
            PolicyKind::PowerOfKOverlayLocality.build(&params).unwrap(),
            PlacerConfig::default(),
            s,
            5,
        )
        .unwrap()
    };
    // Equal loads: the node caching the stack wins every time.
    let mut p = mk(snap(0, vec![node(0, 100, &[1, 2]), node(1, 100, &[])]));
    for t in 0..20 {
        assert_eq!(p.choose(&req, ms(t), &[]).unwrap(), NodeId(0));
    }
    // Cached but 10% more loaded (more than 1 / (1 − 0.05)): the other node wins.
    let mut p = mk(snap(0, vec![node(0, 110, &[1, 2]), node(1, 100, &[])]));
    for t in 0..20 {
        assert_eq!(p.choose(&req, ms(t), &[]).unwrap(), NodeId(1));
    }
    // With the overlay, the cached node takes placements while (100 + c + 1) × 0.95 ≤ 101,
    // that is the first 6; then the other node wins, and once it has a sandbox of the
    // stack (it will cache it: the overlay remembers) both are equally cached and they
    // alternate: locality cannot herd.
    let mut p = mk(snap(0, vec![node(0, 100, &[1, 2]), node(1, 100, &[])]));
    let mut order = Vec::new();
    for t in 0..100 {
        let n = p.choose(&req, ms(t), &[]).unwrap();
        p.placed(n, &req, ms(t));
        order.push(n.0);
    }
    assert_eq!(&order[..7], &[0, 0, 0, 0, 0, 0, 1]);
    let c0 = order.iter().filter(|&&n| n == 0).count();
    assert!(c0.abs_diff(100 - c0) <= 1, "{c0} of 100 on the cached node");
}

#[test]
fn placers_are_deterministic_given_their_seed() {
    let s = snap(0, (0..50).map(|i| node(i, u64::from(i % 7), &[])).collect());
    let run = |seed| {
        let mut p = placer(
            PolicyKind::PowerOfKOverlay,
            PlacerConfig::default(),
            s.clone(),
            seed,
        );
        (0..200)
            .map(|t| {
                let n = p.choose(&REQ, ms(t), &[]).unwrap();
                p.placed(n, &REQ, ms(t));
                n
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run(9), run(9));
    assert_ne!(run(9), run(10));
}

#[test]
fn bad_input_is_an_error() {
    assert!(Snapshot::new(Duration::ZERO, vec![node(1, 0, &[]), node(1, 0, &[])]).is_err());
    assert!(Snapshot::new(Duration::ZERO, vec![node(1, 0, &[3, 2])]).is_err());
    assert!(Snapshot::new(Duration::ZERO, vec![node(1, 0, &[2, 2])]).is_err());
    let s = snap(0, vec![node(0, 0, &[])]);
    let zero = PlacerConfig {
        max_attempts: 0,
        ..PlacerConfig::default()
    };
    let policy = || PolicyKind::Random.build(&PolicyParams::default()).unwrap();
    assert!(Placer::new(policy(), zero, s.clone(), 0).is_err());
    let weight = PlacerConfig {
        overlay_weight: f64::NAN,
        ..PlacerConfig::default()
    };
    assert!(Placer::new(policy(), weight, s, 0).is_err());
    let k0 = PolicyParams {
        k: 0,
        ..PolicyParams::default()
    };
    assert!(PolicyKind::PowerOfK.build(&k0).is_err());
    let b = PolicyParams {
        bonus: 1.0,
        ..PolicyParams::default()
    };
    assert!(PolicyKind::PowerOfKOverlayLocality.build(&b).is_err());
    assert!("pow-k+overlay".parse::<PolicyKind>().is_ok());
    assert!("best".parse::<PolicyKind>().is_err());
    // An empty fleet: no candidate, no panic.
    let empty = snap(0, Vec::new());
    let mut p = placer(
        PolicyKind::PowerOfKOverlayLocality,
        PlacerConfig::default(),
        empty,
        0,
    );
    assert!(matches!(
        p.choose(&REQ, ms(0), &[]),
        Err(Error::NoCandidate)
    ));
}
