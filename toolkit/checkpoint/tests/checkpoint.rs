//! Checkpointing against plain backprop, on closures and candle-nn layers,
//! and every misuse with its message.

use candle_checkpoint::{recompute, segment_bounds, Arg, Policy, Seed, Sequential};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

mod common;
use common::{max_diff, worst, Log};

fn err<T: std::fmt::Debug>(r: Result<T>) -> String {
    r.expect_err("must fail").to_string()
}

/// The error's message, without the backtrace candle appends to it when
/// `RUST_BACKTRACE` is set.
fn said<T: std::fmt::Debug>(r: Result<T>) -> String {
    err(r).lines().next().unwrap_or_default().to_string()
}

/// Layers of Linear and GELU in candle-nn, GELU first: the old layer-wise
/// backward demanded that each layer's first operation use a parameter.
struct GeluLinear(candle_nn::Linear);

impl Module for GeluLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(&x.gelu()?)
    }
}

fn stack(map: &VarMap, depth: usize) -> Result<Vec<GeluLinear>> {
    let vb = VarBuilder::from_varmap(map, DType::F32, &Device::Cpu);
    (0..depth)
        .map(|i| Ok(GeluLinear(candle_nn::linear(6, 6, vb.pp(i))?)))
        .collect()
}

#[test]
fn every_segment_count_gives_plain_gradients() -> Result<()> {
    let map = VarMap::new();
    let layers = stack(&map, 5)?;
    let vars = map.all_vars();
    let x = Tensor::randn(0f32, 1.0, (3, 6), &Device::Cpu)?;
    let xv = Var::from_tensor(&x)?;
    let head = |h: &Tensor| h.sqr()?.mean_all();
    let run = |h: &Tensor| layers.iter().try_fold(h.clone(), |h, l| l.forward(&h));
    let plain = head(&run(xv.as_tensor())?)?.backward()?;
    for segments in 1..=5 {
        let out = Sequential::new(&layers)
            .segments(segments)
            .backward(&x, &vars, head)?;
        assert!(worst(&plain, &out.grads, &vars)? < 1e-6);
        let gx = out.input_grad.expect("a float input has a gradient");
        assert!(max_diff(plain.get(xv.as_tensor()).unwrap(), &gx)? < 1e-6);
    }
    Ok(())
}

#[test]
fn each_layer_backward_needs_no_parameter_first() -> Result<()> {
    let map = VarMap::new();
    let layers = stack(&map, 4)?;
    let vars = map.all_vars();
    let x = Tensor::randn(0f32, 1.0, (2, 6), &Device::Cpu)?;
    let head = |h: &Tensor| h.sqr()?.mean_all();
    let plain = head(&layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))?)?.backward()?;
    let mut got = GradStore::default();
    let mut order = Vec::new();
    Sequential::new(&layers)
        .each_layer()
        .backward_with(&x, &vars, head, |v, g| {
            order.push(v.as_tensor().id());
            got.insert(v.as_tensor(), g);
            Ok(())
        })
        .map(|(loss, _)| loss)?;
    assert!(worst(&plain, &got, &vars)? < 1e-6);
    assert_eq!(order.len(), vars.len());
    Ok(())
}

#[test]
fn a_variable_shared_by_segments_gets_the_sum() -> Result<()> {
    let a = Var::new(&[0.5f32], &Device::Cpu)?;
    let layers: Vec<_> = (0..6)
        .map(|_| {
            let a = a.clone();
            move |x: &Tensor| x.broadcast_mul(a.as_tensor())?.tanh()
        })
        .collect();
    let x = Tensor::new(&[1f32, -2.0], &Device::Cpu)?;
    let head = |h: &Tensor| h.sum_all();
    let plain = head(&layers.iter().try_fold(x.clone(), |h, l| l(&h))?)?.backward()?;
    let out = Sequential::new(&layers)
        .segments(3)
        .backward(&x, std::slice::from_ref(&a), head)?;
    assert!(worst(&plain, &out.grads, &[a])? < 1e-6);
    Ok(())
}

#[test]
fn recompute_takes_several_inputs_and_constants() -> Result<()> {
    let dev = Device::Cpu;
    let w = Var::new(&[[1f32, 2.0], [3.0, 4.0]], &dev)?;
    let (h, r) = (
        Tensor::new(&[[1f32, -1.0]], &dev)?,
        Tensor::new(&[[0.5f32, 0.25]], &dev)?,
    );
    let mask = Tensor::new(&[[1f32, 0.0]], &dev)?;
    let f = |a: &[Tensor]| (a[0].matmul(w.as_tensor())? + &a[1])?.tanh()? * &a[2];
    let g = Tensor::new(&[[2f32, 3.0]], &dev)?;
    let vjp = recompute(
        f,
        &[Arg::Grad(&h), Arg::Grad(&r), Arg::Const(&mask)],
        Seed::Grad(&g),
        std::slice::from_ref(&w),
    )?;
    // The same through candle directly.
    let (hv, rv) = (Var::from_tensor(&h)?, Var::from_tensor(&r)?);
    let out = f(&[hv.as_tensor().clone(), rv.as_tensor().clone(), mask.clone()])?;
    let store = (out * &g)?.sum_all()?.backward()?;
    assert!(
        max_diff(
            vjp.inputs[0].as_ref().unwrap(),
            store.get(hv.as_tensor()).unwrap()
        )? < 1e-6
    );
    assert!(
        max_diff(
            vjp.inputs[1].as_ref().unwrap(),
            store.get(rv.as_tensor()).unwrap()
        )? < 1e-6
    );
    assert!(vjp.inputs[2].is_none());
    assert!(
        max_diff(
            vjp.params.get(w.as_tensor()).unwrap(),
            store.get(w.as_tensor()).unwrap()
        )? < 1e-6
    );
    assert!(vjp.loss.is_none());
    Ok(())
}

#[test]
fn misuse_is_an_error_that_says_why() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::new(&[1f32, 2.0], &dev)?;
    let ids = Tensor::new(&[1u32, 2], &dev)?;
    let id = |a: &[Tensor]| Ok(a[0].clone());
    assert!(err(recompute(id, &[Arg::Grad(&ids)], Seed::Loss, &[]))
        .starts_with("argument 0 is U32: only a float input can have a gradient"));
    assert!(err(recompute(id, &[Arg::Grad(&x)], Seed::Loss, &[]))
        .starts_with("Seed::Loss needs a scalar output, the function returned shape [2]"));
    let g = Tensor::new(&[1f32, 2.0, 3.0], &dev)?;
    assert!(err(recompute(id, &[Arg::Grad(&x)], Seed::Grad(&g), &[]))
        .starts_with("the upstream gradient has shape [3], the function's output [2]"));
    assert!(err(segment_bounds(0, 1)).starts_with("there are no layers to checkpoint"));
    assert!(err(segment_bounds(3, 0))
        .starts_with("segments is 0: it must be between 1 and the number of layers, 3"));
    assert!(err(segment_bounds(3, 4)).starts_with("segments is 4"));
    let layers = [|x: &Tensor| x.exp()];
    assert!(err(Sequential::new(&layers)
        .segments(2)
        .backward(&x, &[], |h| h.sum_all()))
    .starts_with("segments is 2: it must be between 1 and the number of layers, 1"));
    Ok(())
}

#[test]
fn the_observer_sees_each_segment() -> Result<()> {
    let layers = [|x: &Tensor| x.exp(), |x: &Tensor| x.sin()];
    let x = Tensor::new(&[0.5f32], &Device::Cpu)?;
    let log = Log::default();
    Sequential::new(&layers)
        .segments(2)
        .observer(&log)
        .backward(&x, &[], |h| h.sum_all())?;
    let log = log.0.into_inner();
    let marks: Vec<_> = log.iter().filter(|l| l.starts_with("segment")).collect();
    assert_eq!(
        marks,
        ["segment forward", "segment backward", "segment backward"]
    );
    let enters = log.iter().filter(|l| l.contains('/')).count();
    assert_eq!(enters, log.iter().filter(|l| *l == "leave").count());
    assert!(log.contains(&"Activations/Device".to_string()));
    assert!(log.contains(&"Gradients/Device".to_string()));
    Ok(())
}

/// A function that computes other products when run again cannot replay
/// what its first forward kept: an error, not a wrong gradient.
#[test]
fn a_function_that_changes_between_runs_is_an_error() -> Result<()> {
    use candle_checkpoint::{Tape, TapeModule};
    use std::cell::Cell;
    struct Fickle {
        w: Var,
        runs: Cell<usize>,
    }
    impl TapeModule for Fickle {
        fn forward_t(&self, x: &Tensor, tape: &Tape) -> Result<Tensor> {
            self.runs.set(self.runs.get() + 1);
            if self.runs.get() == 1 {
                tape.matmul(x, self.w.as_tensor())
            } else {
                x.matmul(self.w.as_tensor())
            }
        }
    }
    let dev = Device::Cpu;
    let w = Var::ones((2, 2), DType::F32, &dev)?;
    let layers = [
        Fickle {
            w: w.clone(),
            runs: Cell::new(0),
        },
        Fickle {
            w: w.clone(),
            runs: Cell::new(0),
        },
    ];
    let x = Tensor::ones((1, 2), DType::F32, &dev)?;
    let e = err(Sequential::taped(&layers)
        .segments(2)
        .policy(&Policy::Dots)
        .backward(&x, &[w], |h| h.sum_all()));
    assert!(
        e.starts_with("the recomputation used 1 fewer saved products"),
        "{e}"
    );
    Ok(())
}

/// Every float dtype, and an empty batch: the checkpointed gradients are
/// plain backprop's, in the same dtype, to the rounding of adding the
/// segments' shares of a shared weight in another order.
#[test]
fn every_dtype_and_an_empty_batch() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        for rows in [0usize, 3] {
            let w = Var::from_tensor(&Tensor::randn(0f32, 0.5, (6, 6), &dev)?.to_dtype(dtype)?)?;
            let layers: Vec<_> = (0..4)
                .map(|_| {
                    let w = w.clone();
                    move |x: &Tensor| x.matmul(w.as_tensor())?.tanh()
                })
                .collect();
            let x = Tensor::randn(0f32, 1.0, (rows, 6), &dev)?.to_dtype(dtype)?;
            let head = |h: &Tensor| h.sqr()?.sum_all();
            let plain = head(&layers.iter().try_fold(x.clone(), |h, l| l(&h))?)?.backward()?;
            let out = Sequential::new(&layers).segments(2).backward(
                &x,
                std::slice::from_ref(&w),
                head,
            )?;
            let (a, b) = (
                plain.get(w.as_tensor()).unwrap(),
                out.grads.get(w.as_tensor()).unwrap(),
            );
            assert_eq!(b.dtype(), dtype);
            let ulps = match dtype {
                DType::F64 => 1e-13,
                DType::F32 => 1e-5,
                DType::F16 => 4e-3,
                _ => 3e-2,
            };
            let scale = 1.0 + max_diff(a, &a.zeros_like()?)?;
            let d = max_diff(a, b)?;
            assert!(d <= ulps * scale, "{dtype:?}, {rows} rows: {d}");
            assert_eq!(out.input_grad.expect("float input").dims(), [rows, 6]);
        }
    }
    Ok(())
}

/// The builder's defaults: ⌈√n⌉ segments and no policy, the gradients of
/// `checkpoint_sequential` with that count, to the bit.
#[test]
fn the_builder_defaults_to_the_square_root_of_the_layers_in_segments() -> Result<()> {
    let map = VarMap::new();
    let layers = stack(&map, 5)?;
    let vars = map.all_vars();
    let x = Tensor::randn(0f32, 1.0, (3, 6), &Device::Cpu)?;
    let head = |h: &Tensor| h.sqr()?.mean_all();
    let log = Log::default();
    let built = Sequential::new(&layers)
        .observer(&log)
        .backward(&x, &vars, head)?;
    let backwards = log
        .0
        .into_inner()
        .iter()
        .filter(|l| *l == "segment backward")
        .count();
    assert_eq!(backwards, 3, "⌈√5⌉ segments");
    let three = Sequential::new(&layers)
        .segments(3)
        .backward(&x, &vars, head)?;
    assert_eq!(worst(&three.grads, &built.grads, &vars)?, 0.0);
    assert_eq!(
        built.loss.to_scalar::<f32>()?,
        three.loss.to_scalar::<f32>()?
    );
    Ok(())
}

#[test]
fn the_builder_refuses_a_bad_segment_count() -> Result<()> {
    let map = VarMap::new();
    let layers = stack(&map, 5)?;
    let vars = map.all_vars();
    let x = Tensor::randn(0f32, 1.0, (3, 6), &Device::Cpu)?;
    let head = |h: &Tensor| h.sum_all();
    for segments in [0, 6] {
        assert_eq!(
            said(
                Sequential::new(&layers)
                    .segments(segments)
                    .backward(&x, &vars, head)
            ),
            format!("segments is {segments}: it must be between 1 and the number of layers, 5")
        );
    }
    let none: [GeluLinear; 0] = [];
    assert_eq!(
        said(Sequential::new(&none).backward(&x, &vars, head)),
        "there are no layers to checkpoint"
    );
    Ok(())
}

/// candle-nn's `LayerNorm` on a contiguous input runs a fused kernel with no
/// backward: its weight and bias get no gradient, and `ensure_grads` says
/// so, naming the layer that has one.
#[test]
fn ensure_grads_names_the_fused_layers_that_drop_the_graph() -> Result<()> {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let ln = candle_nn::layer_norm(4, 1e-5, vb.pp("ln"))?;
    let fc = candle_nn::linear(4, 1, vb.pp("fc"))?;
    let x = Tensor::randn(0f32, 1.0, (3, 4), &Device::Cpu)?;
    let grads = fc.forward(&ln.forward(&x)?)?.sum_all()?.backward()?;
    let msg = said(candle_checkpoint::ensure_grads(&map, &grads));
    assert!(
        msg.starts_with(
            "2 variable(s) got no gradient: ln.bias, ln.weight (candle-nn's fused LayerNorm"
        ),
        "{msg}"
    );
    assert!(msg.contains("candle-lean-nn's LeanLayerNorm"), "{msg}");
    Ok(())
}
