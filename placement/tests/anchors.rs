//! The literature's anchors, reproduced with the crate's own policies (see `anchors`).

use placement::anchors::{balls_into_bins_mean, supermarket, Supermarket};
use placement::PolicyKind;

/// n = 1,000 balls into 1,000 bins, 100 seeds. The literature's means are 5.5 (one random
/// choice) and 3.0 (two choices). One seed's maximum varies by about ±0.7 (random) and is
/// 3 in nearly every seed (two choices), so the mean of 100 seeds has a standard error of
/// ≈ 0.07 and ≈ 0.02: ±0.3 and ±0.15 leave room for the rounding of the published figures
/// (≈ 5.5–5.6 by simulation at this n) and no more. A one-choice bug in power-of-k would
/// give 5.5, and a bias in sampling or tie-breaking shows as 3.2 or more.
#[test]
fn balls_into_bins_at_n_1000() {
    let random = balls_into_bins_mean(1000, PolicyKind::Random, 2, 100).unwrap();
    let two = balls_into_bins_mean(1000, PolicyKind::PowerOfKOverlay, 2, 100).unwrap();
    eprintln!("random {random}, two choices {two}");
    assert!(
        (random - 5.5).abs() <= 0.3,
        "random: mean max load {random}"
    );
    assert!(
        (two - 3.0).abs() <= 0.15,
        "two choices: mean max load {two}"
    );
}

/// Mitzenmacher's periodic-update supermarket model, n = 100, λ = 0.9, board refreshed every
/// T = 10 service times: shortest queue on the board herds (≈ 24.7), two choices ≈ 5.1,
/// random = 1 / (1 − λ) = 10. One seed over 5,000 service times (≈ 450,000 arrivals, 500
/// board periods): run to run the means vary by a few percent (two choices) and up to ≈ 10%
/// (herding oscillates with the board). Tolerances: ±20% for the herd, ±8% for two
/// choices, ±10% for random; and the qualitative result that matters, exactly: stale
/// least-loaded is worse than random and several times worse than two choices.
#[test]
fn stale_board_herds_least_loaded_not_two_choices() {
    let m = Supermarket {
        horizon: 5_000.0,
        warmup: 500.0,
        ..Supermarket::default()
    };
    let ll = supermarket(&m, PolicyKind::LeastLoaded, 7).unwrap();
    let two = supermarket(&m, PolicyKind::PowerOfK, 7).unwrap();
    let random = supermarket(&m, PolicyKind::Random, 7).unwrap();
    eprintln!("least-loaded {ll}, two choices {two}, random {random}");
    assert!((ll / 24.7 - 1.0).abs() <= 0.2, "least-loaded: {ll}");
    assert!((two / 5.1 - 1.0).abs() <= 0.08, "two choices: {two}");
    assert!((random / 10.0 - 1.0).abs() <= 0.10, "random: {random}");
    assert!(ll > random && ll > 3.0 * two, "no herding: {ll} vs {two}");
}

/// With a fresh board two choices reach the supermarket model's fixed point,
/// Σ_{i≥1} λ^(2^i − 2) ≈ 2.61 at λ = 0.9 (n → ∞; n = 100 is a little below). ±0.15.
#[test]
fn fresh_board_two_choices_meets_the_fixed_point() {
    let m = Supermarket {
        period: 0.0,
        warmup: 100.0,
        horizon: 1_000.0,
        ..Supermarket::default()
    };
    let lambda: f64 = m.lambda;
    let fixed: f64 = (1..20).map(|i| lambda.powi((1 << i) - 2)).sum();
    let two = supermarket(&m, PolicyKind::PowerOfK, 3).unwrap();
    eprintln!("fresh two choices {two}, fixed point {fixed}");
    assert!((two - fixed).abs() <= 0.15, "{two} vs {fixed}");
}

#[test]
fn anchors_refuse_bad_parameters() {
    assert!(balls_into_bins_mean(0, PolicyKind::Random, 2, 1).is_err());
    assert!(balls_into_bins_mean(10, PolicyKind::PowerOfKOverlayLocality, 2, 1).is_err());
    let bad = Supermarket {
        lambda: 1.2,
        ..Supermarket::default()
    };
    assert!(supermarket(&bad, PolicyKind::Random, 1).is_err());
}
