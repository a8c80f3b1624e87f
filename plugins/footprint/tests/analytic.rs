use candle_core::DType;
use workbook_footprint::TrainingState;

#[test]
fn the_tutorials_7b_figures() {
    let s = TrainingState::analytic(7_000_000_000, DType::F32);
    assert_eq!(s.parameters, 28_000_000_000);
    assert_eq!(s.gradients, 28_000_000_000);
    assert_eq!(s.optimizer, 56_000_000_000);
    assert_eq!(s.total(), 112_000_000_000);
}

#[test]
fn half_precision_halves_every_part() {
    let f32 = TrainingState::analytic(333_834, DType::F32);
    for dtype in [DType::F16, DType::BF16] {
        let half = TrainingState::analytic(333_834, dtype);
        assert_eq!(half.total() * 2, f32.total());
        assert_eq!(half.parameters, 667_668);
    }
}
