//! The direct backward and its checkpointed form against candle's own
//! backward through the same fused layers, in every dtype, and their
//! errors.

use candle_checkpoint::{autograd_head, Sequential};
use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_lean_nn::{cross_entropy, cross_entropy_and_grad, Activation, LeanLayer, LeanLinear};

mod common;
use common::{max_diff, worst, Log};

/// Six layers of width 24 in `dtype`, the activations in turn, and their
/// variables.
fn stack(dtype: DType) -> Result<(Vec<LeanLayer>, Vec<Var>)> {
    let dev = Device::Cpu;
    let acts = [Activation::Relu, Activation::Gelu, Activation::Identity];
    let mut layers = Vec::new();
    let mut vars = Vec::new();
    for i in 0..6 {
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.3, (24, 24), &dev)?.to_dtype(dtype)?)?;
        let b = Var::from_tensor(&Tensor::randn(0f32, 0.3, 24, &dev)?.to_dtype(dtype)?)?;
        let linear = LeanLinear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()))?;
        layers.push(LeanLayer::new(linear, acts[i % 3]));
        vars.extend([w, b]);
    }
    Ok((layers, vars))
}

#[test]
fn direct_gradients_equal_candles_backward_in_every_dtype() -> Result<()> {
    let dev = Device::Cpu;
    let targets = Tensor::new((0..37u32).map(|r| (r * 5) % 24).collect::<Vec<_>>(), &dev)?;
    for (dtype, tol) in [
        (DType::F64, 1e-12),
        (DType::F32, 1e-6),
        (DType::F16, 2e-2),
        (DType::BF16, 2e-1),
    ] {
        let (layers, vars) = stack(dtype)?;
        let x = Tensor::randn(0f32, 1.0, (37, 24), &dev)?.to_dtype(dtype)?;
        let out = layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))?;
        let plain = cross_entropy(&out, &targets)?.backward()?;
        let head = |h: &Tensor| cross_entropy_and_grad(h, &targets, 1.0);
        let direct = Sequential::direct(&layers).backward(&x, &vars, head)?;
        assert!(direct.input_grad.is_none(), "a data batch gets no gradient");
        let d = worst(&plain, &direct.grads, &vars)?;
        assert!(d <= tol, "{dtype:?}: direct against candle's backward {d}");
        for segments in 1..=layers.len() {
            let ckpt = Sequential::direct(&layers)
                .segments(segments)
                .backward(&x, &vars, head)?;
            // The same operations on the same inputs: the same bits.
            let d = worst(&direct.grads, &ckpt.grads, &vars)?;
            assert_eq!(d, 0.0, "{dtype:?}, {segments} segment(s)");
            assert_eq!(
                ckpt.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
                direct.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?
            );
        }
    }
    Ok(())
}

#[test]
fn an_input_variable_gets_its_gradient() -> Result<()> {
    let (layers, vars) = stack(DType::F32)?;
    let x = Var::randn(0f32, 1.0, (5, 24), &Device::Cpu)?;
    let loss = |h: &Tensor| h.sqr()?.mean_all();
    let plain = loss(
        &layers
            .iter()
            .try_fold(x.as_tensor().clone(), |h, l| l.forward(&h))?,
    )?;
    let plain = plain.backward()?;
    let expected = plain.get(x.as_tensor()).expect("the input's gradient");
    let direct = Sequential::direct(&layers).backward(&x, &vars, autograd_head(loss))?;
    let got = direct.input_grad.expect("the input's gradient");
    assert!(max_diff(expected, &got)? <= 1e-6);
    let ckpt = Sequential::direct(&layers)
        .segments(4)
        .backward(&x, &vars, autograd_head(loss))?;
    assert_eq!(max_diff(&got, &ckpt.input_grad.expect("a gradient"))?, 0.0);
    assert!(worst(&plain, &ckpt.grads, &vars)? <= 1e-6);
    Ok(())
}

#[test]
fn each_gradient_is_handed_over_once_per_parameter() -> Result<()> {
    let (layers, vars) = stack(DType::F32)?;
    let x = Tensor::randn(0f32, 1.0, (5, 24), &Device::Cpu)?;
    let mut seen = Vec::new();
    Sequential::direct(&layers).backward_with(
        &x,
        &vars[2..],
        autograd_head(|h: &Tensor| h.mean_all()),
        |var, _| {
            seen.push(var.as_tensor().id());
            Ok(())
        },
    )?;
    // Last layer first, each layer's weight then bias; the first layer's
    // variables were not passed in: not handed over.
    let expected: Vec<_> = vars[2..]
        .chunks(2)
        .rev()
        .flatten()
        .map(|v| v.as_tensor().id())
        .collect();
    assert_eq!(seen, expected);
    assert_eq!(seen.len(), 10);
    Ok(())
}

#[test]
fn misuse_is_an_error_that_says_why() -> Result<()> {
    let (layers, vars) = stack(DType::F32)?;
    let x = Tensor::randn(0f32, 1.0, (5, 24), &Device::Cpu)?;
    let err = |r: Result<candle_checkpoint::Checkpointed>| r.unwrap_err().to_string();
    let none: &[LeanLayer] = &[];
    assert!(err(Sequential::direct(none).backward(
        &x,
        &vars,
        autograd_head(|h: &Tensor| h.mean_all())
    ))
    .starts_with("a direct backward needs at least one layer"));
    // A head that returns the output itself, not a scalar loss.
    let bad = |h: &Tensor| Ok((h.clone(), h.clone()));
    assert!(err(Sequential::direct(&layers).backward(&x, &vars, bad)).starts_with(
        "the head must return the scalar loss and its gradient of the output's shape [5, 24], got shapes [5, 24] and [5, 24]"
    ));
    let head = autograd_head(|h: &Tensor| h.mean_all());
    assert!(err(Sequential::direct(&layers)
        .segments(7)
        .backward(&x, &vars, head))
    .starts_with("segments is 7: it must be between 1 and the number of layers, 6"));
    // A layer built on a cast of the variable: its gradient cannot reach it.
    let w = Var::randn(0f32, 0.3, (24, 24), &Device::Cpu)?;
    let cast = LeanLayer::new(
        LeanLinear::new(w.to_dtype(DType::BF16)?, None)?,
        Activation::Relu,
    );
    let half = x.to_dtype(DType::BF16)?;
    let head = autograd_head(|h: &Tensor| h.mean_all());
    assert!(
        err(Sequential::direct(&[cast]).backward(&half, &[w], head)).starts_with(
            "a layer's parameter of shape [24, 24] is computed from a variable (a cast, say)"
        )
    );
    // A wrong width reaches the layer's own check.
    let wide = Tensor::randn(0f32, 1.0, (5, 25), &Device::Cpu)?;
    let head = autograd_head(|h: &Tensor| h.mean_all());
    assert!(
        err(Sequential::direct(&layers).backward(&wide, &vars, head))
            .starts_with("the input has shape [5, 25], the layer takes 24 features")
    );
    Ok(())
}

/// A direct backward marks the end of its forward and of each layer's
/// backward but the first layer's: a planner sees each layer's backward
/// apart, with the gradients handed over before it.
#[test]
fn the_direct_backward_marks_each_layers_backward() -> Result<()> {
    let (layers, vars) = stack(DType::F32)?;
    let x = Tensor::randn(0f32, 1.0, (5, 24), &Device::Cpu)?;
    let log = Log::default();
    Sequential::direct(&layers).observer(&log).backward(
        &x,
        &vars,
        autograd_head(|h: &Tensor| h.mean_all()),
    )?;
    let mut expected = vec!["after forward"];
    expected.extend(std::iter::repeat_n("layer backward", layers.len() - 1));
    assert_eq!(log.marks(), expected);
    Ok(())
}

/// A checkpointed direct backward marks the head, and each segment's
/// recompute apart from its backward: a planner draws a line for each
/// stretch, and the recompute (every saved tensor of the segment, the
/// incoming gradient beside) and the backward grow at different rates in
/// the batch.
#[test]
fn the_checkpointed_direct_backward_marks_each_recompute_and_backward() -> Result<()> {
    let (layers, vars) = stack(DType::F32)?;
    let x = Tensor::randn(0f32, 1.0, (5, 24), &Device::Cpu)?;
    let log = Log::default();
    Sequential::direct(&layers)
        .segments(3)
        .observer(&log)
        .backward(&x, &vars, autograd_head(|h: &Tensor| h.mean_all()))?;
    assert_eq!(
        log.marks(),
        [
            "segment forward",
            "head",
            "segment recompute",
            "segment backward",
            "segment recompute",
            "segment backward",
            "segment recompute",
        ]
    );
    Ok(())
}
