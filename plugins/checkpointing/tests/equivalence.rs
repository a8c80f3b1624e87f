//! checkpoint_sequential gives plain backprop's gradients.

use candle_core::{DType, Device, Module, Tensor, Var};
use workbook_checkpointing::{checkpoint_sequential, segment_bounds, Heavy};
use workbook_sdk::train::{cross_entropy, max_abs_diff, Activation, Layer, Mlp, Rng};

#[test]
fn gradients_equal_plain_backprop_for_every_segment_count() {
    let dev = Device::Cpu;
    let mut rng = Rng::seeded(3);
    let model = Mlp::stack(&mut rng, 32, 9, Activation::Gelu, DType::F32, &dev).unwrap();
    let input = Var::from_tensor(&rng.randn((16, 32), &dev).unwrap()).unwrap();
    let y = rng.labels(16, 32, &dev).unwrap();
    let head = |h: &Tensor| cross_entropy(h, &y);
    let plain_loss = head(&model.forward(input.as_tensor()).unwrap()).unwrap();
    let plain = plain_loss.backward().unwrap();
    // 18 layers (Linear, GELU) x 9: uneven splits too.
    for segments in [1, 2, 3, 4, 5, 7, 18, 40] {
        let out = checkpoint_sequential(
            model.layers(),
            segments,
            input.as_tensor(),
            &model.vars(),
            head,
        )
        .unwrap();
        assert_eq!(
            out.loss.to_scalar::<f32>().unwrap(),
            plain_loss.to_scalar::<f32>().unwrap()
        );
        for (i, v) in model.vars().iter().enumerate() {
            let a = plain.get(v.as_tensor()).unwrap();
            let b = out
                .grads
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for variable {i}"));
            let d = max_abs_diff(a, b).unwrap();
            assert!(
                d < 1e-6,
                "{segments} segments, variable {i}: max |diff| = {d}"
            );
        }
        let d = max_abs_diff(plain.get(input.as_tensor()).unwrap(), &out.input_grad).unwrap();
        assert!(
            d < 1e-6,
            "{segments} segments, input gradient: max |diff| = {d}"
        );
    }
}

#[test]
fn a_segment_that_starts_without_parameters_still_passes_the_input_gradient() {
    let dev = Device::Cpu;
    let mut rng = Rng::seeded(5);
    let mlp = Mlp::new(&mut rng, &[8, 8, 8], Activation::Relu, DType::F32, &dev).unwrap();
    // Linear, ReLU, Linear split as [Linear] [ReLU, Linear]: the second segment
    // begins with a parameter-free op.
    let layers: Vec<Layer> = mlp.layers().to_vec();
    let x = Var::from_tensor(&rng.randn((4, 8), &dev).unwrap()).unwrap();
    let head = |h: &Tensor| h.sqr()?.sum_all();
    let plain = head(&mlp.forward(x.as_tensor()).unwrap())
        .unwrap()
        .backward()
        .unwrap();
    let out = checkpoint_sequential(&layers, 2, x.as_tensor(), &mlp.vars(), head).unwrap();
    let d = max_abs_diff(plain.get(x.as_tensor()).unwrap(), &out.input_grad).unwrap();
    assert!(d < 1e-6, "input gradient differs by {d}");
}

#[test]
fn a_parameter_shared_by_every_segment_gets_the_sum_of_its_gradients() {
    let dev = Device::Cpu;
    let a = Var::new(1f32, &dev).unwrap();
    let layers: Vec<Heavy> = (0..50).map(|_| Heavy::new(a.clone(), 10)).collect();
    let x = Var::new(0f32, &dev).unwrap();
    let head = |h: &Tensor| h.sqr();
    let y = layers
        .iter()
        .try_fold(x.as_tensor().clone(), |h, l| l.forward(&h))
        .unwrap();
    let plain = head(&y).unwrap().backward().unwrap();
    let out =
        checkpoint_sequential(&layers, 50, x.as_tensor(), std::slice::from_ref(&a), head).unwrap();
    // y = x + 500 a, loss = y^2: d/da = 2 * y * 500 = 500,000 at a = 1, x = 0.
    assert_eq!(
        plain
            .get(a.as_tensor())
            .unwrap()
            .to_scalar::<f32>()
            .unwrap(),
        500_000.0
    );
    assert_eq!(
        out.grads
            .get(a.as_tensor())
            .unwrap()
            .to_scalar::<f32>()
            .unwrap(),
        500_000.0
    );
    assert_eq!(out.input_grad.to_scalar::<f32>().unwrap(), 1_000.0);
}

#[test]
fn segments_split_layers_evenly_and_in_order() {
    assert_eq!(segment_bounds(10, 3), vec![0..4, 4..7, 7..10]);
    assert_eq!(segment_bounds(4, 4), vec![0..1, 1..2, 2..3, 3..4]);
    assert_eq!(
        segment_bounds(4, 9),
        vec![0..1, 1..2, 2..3, 3..4],
        "more segments than layers"
    );
    assert_eq!(segment_bounds(5, 0), vec![0..5], "zero segments means one");
}

#[test]
fn the_observer_sees_each_segments_forward_and_backward() {
    use workbook_checkpointing::{checkpoint_sequential_observed, Step};
    let dev = Device::Cpu;
    let mut rng = Rng::seeded(9);
    let model = Mlp::stack(&mut rng, 8, 6, Activation::Gelu, DType::F32, &dev).unwrap();
    let x = rng.randn((2, 8), &dev).unwrap();
    let head = |h: &Tensor| h.sum_all();
    let mut steps = Vec::new();
    let observed =
        checkpoint_sequential_observed(model.layers(), 3, &x, &model.vars(), head, |s| {
            steps.push(s)
        })
        .unwrap();
    // The last segment's forward happens only in the backward.
    assert_eq!(
        steps,
        [
            Step::Forward,
            Step::Forward,
            Step::Backward,
            Step::Backward,
            Step::Backward
        ]
    );
    let plain = checkpoint_sequential(model.layers(), 3, &x, &model.vars(), head).unwrap();
    for v in model.vars() {
        let (a, b) = (
            observed.grads.get(v.as_tensor()).unwrap(),
            plain.grads.get(v.as_tensor()).unwrap(),
        );
        assert_eq!(max_abs_diff(a, b).unwrap(), 0.0);
    }
}
