//! Accumulated gradients equal the full batch's, and candle's AdamW takes the
//! same steps from either.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{AdamW, Optimizer};
use workbook_accumulation::{micro_batches, GradAccumulator};
use workbook_sdk::train::{
    cross_entropy, grads_max_abs_diff, max_abs_diff, param_grads, Activation, Mlp, Rng,
};

fn setup(seed: u64) -> (Mlp, Tensor, Tensor) {
    let dev = Device::Cpu;
    let mut rng = Rng::seeded(seed);
    let model = Mlp::new(&mut rng, &[64, 128, 2], Activation::Relu, DType::F32, &dev).unwrap();
    let x = rng.randn((32, 64), &dev).unwrap();
    let y = rng.labels(32, 2, &dev).unwrap();
    (model, x, y)
}

fn accumulated(model: &Mlp, x: &Tensor, y: &Tensor, micro: usize) -> GradAccumulator {
    let steps = x.dim(0).unwrap() / micro;
    let mut acc = GradAccumulator::new(model.vars());
    for (xb, yb) in micro_batches(x, micro)
        .unwrap()
        .iter()
        .zip(micro_batches(y, micro).unwrap().iter())
    {
        let loss =
            (cross_entropy(&model.forward(xb).unwrap(), yb).unwrap() / steps as f64).unwrap();
        acc.backward(&loss).unwrap();
    }
    acc
}

#[test]
fn accumulated_gradients_equal_the_full_batch_for_every_micro_batch_size() {
    let (model, x, y) = setup(47);
    let full = param_grads(
        &cross_entropy(&model.forward(&x).unwrap(), &y)
            .unwrap()
            .backward()
            .unwrap(),
        &model.vars(),
    );
    for micro in [1, 2, 4, 8, 16, 32] {
        let acc = accumulated(&model, &x, &y, micro);
        assert_eq!(acc.micro_batches(), 32 / micro);
        let diff = grads_max_abs_diff(&full, acc.grads().unwrap(), &model.vars()).unwrap();
        assert!(diff < 1e-5, "micro-batch {micro}: max |diff| = {diff}");
    }
}

#[test]
fn adamw_steps_from_accumulated_gradients_match_full_batch_steps() {
    let (model, x, y) = setup(7);
    let twin = model.deep_clone().unwrap();
    let mut opt_acc = AdamW::new_lr(model.vars(), 1e-2).unwrap();
    let mut opt_full = AdamW::new_lr(twin.vars(), 1e-2).unwrap();
    let mut diffs = Vec::new();
    for _ in 0..10 {
        let mut acc = accumulated(&model, &x, &y, 8);
        acc.step(&mut opt_acc).unwrap();
        assert_eq!(acc.micro_batches(), 0, "a step starts the sum again");
        let grads = param_grads(
            &cross_entropy(&twin.forward(&x).unwrap(), &y)
                .unwrap()
                .backward()
                .unwrap(),
            &twin.vars(),
        );
        opt_full.step(&grads).unwrap();
        diffs.push(
            model
                .vars()
                .iter()
                .zip(twin.vars().iter())
                .map(|(a, b)| max_abs_diff(a.as_tensor(), b.as_tensor()).unwrap())
                .fold(0f64, f64::max),
        );
    }
    // The gradients agree to about 1e-8, but AdamW's update is close to
    // lr * g / (|g| + eps): for elements whose gradient is near zero it turns
    // a 1e-8 difference into a visible one. Within 1% of one step (lr = 1e-2),
    // and not growing from step to step.
    let (first, last) = (diffs[0], diffs[diffs.len() - 1]);
    assert!(first < 1e-4, "parameters differ by {first} after one step");
    assert!(
        last < 1e-4 && last < 2.0 * first.max(1e-7),
        "the difference grew: {diffs:?}"
    );
    // And the model moved: the comparison is not of two untouched copies.
    let (fresh, _, _) = setup(7);
    let moved = max_abs_diff(fresh.vars()[0].as_tensor(), model.vars()[0].as_tensor()).unwrap();
    assert!(moved > 1e-3, "the parameters moved by {moved}");
}

#[test]
fn micro_batches_are_views_covering_the_batch_in_order() {
    let t = Tensor::arange(0u32, 10, &Device::Cpu).unwrap();
    let parts = micro_batches(&t, 4).unwrap();
    let got: Vec<Vec<u32>> = parts.iter().map(|p| p.to_vec1().unwrap()).collect();
    assert_eq!(got, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]);
    let err = micro_batches(&t, 0).unwrap_err().to_string();
    assert!(err.contains("micro-batch size must be at least 1"), "{err}");
}

#[test]
fn a_step_with_nothing_accumulated_changes_nothing() {
    let (model, _, _) = setup(1);
    let before = model.vars()[0].as_tensor().copy().unwrap();
    let mut opt = AdamW::new_lr(model.vars(), 1e-2).unwrap();
    GradAccumulator::new(model.vars()).step(&mut opt).unwrap();
    assert_eq!(
        max_abs_diff(&before, model.vars()[0].as_tensor()).unwrap(),
        0.0
    );
}
