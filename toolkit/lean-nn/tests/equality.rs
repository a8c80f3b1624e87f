//! The fused layer against candle-nn's Linear and activation, and the
//! one-operation cross-entropy against candle-nn's: values and gradients in
//! every float dtype, and bad input.

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_lean_nn::{Activation, LeanLinear};

mod common;
use common::max_diff;

/// Normal values of standard deviation `scale`, the same on every run
/// (candle's CPU generator cannot be seeded): a test that compares with
/// candle-nn's GELU, whose own gradient is a few 1e-6 off, then holds or
/// fails the same way each time.
fn data(shape: &[usize], scale: f32, seed: u64) -> Result<Tensor> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = || {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        ((state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    };
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|_| {
            let (u, v) = (uniform(), uniform());
            scale * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
        })
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu)
}

fn reference(x: &Tensor, l: &candle_nn::Linear, act: Activation) -> Result<Tensor> {
    let y = l.forward(x)?;
    match act {
        Activation::Identity => Ok(y),
        Activation::Relu => y.relu(),
        Activation::Gelu => y.gelu(),
    }
}

#[test]
fn equal_to_candle_nn_in_every_dtype() -> Result<()> {
    for (dtype, tol) in [
        (DType::F64, 1e-12),
        // GELU's gradient differs more: see the test after this one.
        (DType::F32, 1e-6),
        // Half types: a rounding or two of values up to about 8 (measured
        // 7.8e-3 and 1.6e-2 at most).
        (DType::F16, 1.6e-2),
        (DType::BF16, 4e-2),
    ] {
        for act in [Activation::Identity, Activation::Relu, Activation::Gelu] {
            for with_bias in [true, false] {
                let w = Var::from_tensor(&data(&[5, 7], 0.3, 1)?.to_dtype(dtype)?)?;
                let b = Var::from_tensor(&data(&[5], 0.3, 2)?.to_dtype(dtype)?)?;
                let bias = with_bias.then(|| b.as_tensor().clone());
                let linear = candle_nn::Linear::new(w.as_tensor().clone(), bias.clone());
                let lean = LeanLinear::new(w.as_tensor().clone(), bias)?;
                // A 3-d input, as a transformer's (batch, seq, features).
                let x = Var::from_tensor(&data(&[2, 3, 7], 1.0, 3)?.to_dtype(dtype)?)?;
                let weights = data(&[2, 3, 5], 1.0, 4)?.to_dtype(dtype)?;
                let a = reference(&x, &linear, act)?;
                let l = lean.forward_act(&x, act)?;
                assert_eq!(l.dims(), [2, 3, 5]);
                assert_eq!(l.dtype(), dtype);
                let what = format!("{dtype:?} {act:?} bias {with_bias}");
                let od = max_diff(&a, &l)?;
                if std::env::var("SHOW").is_ok() {
                    println!("{what}: output {od:.2e}");
                }
                assert!(od <= tol, "{what}: output");
                let ga = (a * &weights)?.sum_all()?.backward()?;
                let gl = (l * &weights)?.sum_all()?.backward()?;
                let mut vars = vec![&x, &w];
                if with_bias {
                    vars.push(&b);
                }
                for v in vars {
                    let (p, q) = (ga.get(v).unwrap(), gl.get(v).expect("a gradient"));
                    assert_eq!(q.dtype(), dtype);
                    let d = max_diff(p, q)?;
                    if std::env::var("SHOW").is_ok() {
                        println!("{what}: gradient of {:?}: {d:.2e}", v.dims());
                    }
                    // candle's GELU gradient in f32 is itself up to 3e-6
                    // off the exact one (measured below).
                    let tol = if dtype == DType::F32 && act == Activation::Gelu {
                        5e-6
                    } else {
                        tol
                    };
                    assert!(d <= tol, "{what}: gradient of {:?}: {d}", v.dims());
                }
            }
        }
    }
    Ok(())
}

#[test]
fn a_wrong_input_or_bias_is_an_error() -> Result<()> {
    let dev = Device::Cpu;
    let w = Tensor::zeros((5, 7), DType::F32, &dev)?;
    let e = LeanLinear::new(w.clone(), Some(Tensor::zeros(4, DType::F32, &dev)?)).unwrap_err();
    assert!(e
        .to_string()
        .starts_with("the bias has shape [4], the weight [5, 7]"));
    let lean = LeanLinear::new(w, None)?;
    let e = lean
        .forward(&Tensor::zeros((2, 6), DType::F32, &dev)?)
        .unwrap_err();
    assert!(e
        .to_string()
        .starts_with("the input has shape [2, 6], the layer takes 7 features"));
    Ok(())
}

/// At a pre-activation of exactly 0 (a zero input row, no bias) ReLU's
/// gradient is 0, as PyTorch's; candle's relu passes it.
#[test]
fn relu_at_exactly_zero_follows_pytorch() -> Result<()> {
    let dev = Device::Cpu;
    let w = Var::new(&[[1f32, 2.0]], &dev)?;
    let lean = LeanLinear::new(w.as_tensor().clone(), None)?;
    let x = Tensor::zeros((1, 2), DType::F32, &dev)?;
    let grads = lean
        .forward_act(&x, Activation::Relu)?
        .sum_all()?
        .backward()?;
    assert_eq!(grads.get(&w).unwrap().to_vec2::<f32>()?, [[0.0, 0.0]]);
    let candle = candle_nn::Linear::new(w.as_tensor().clone(), None);
    let x = Var::zeros((1, 2), DType::F32, &dev)?;
    let g = candle.forward(&x)?.relu()?.sum_all()?.backward()?;
    // candle's passes the gradient at 0: for x = 0 the input's is W.
    assert_eq!(g.get(&x).unwrap().to_vec2::<f32>()?, [[1.0, 2.0]]);
    Ok(())
}

#[test]
fn cross_entropy_equals_candle_nns_in_every_dtype() -> Result<()> {
    let dev = Device::Cpu;
    let targets = Tensor::new(&[3u32, 0, 7, 7, 1], &dev)?;
    for (dtype, tol) in [
        (DType::F64, 1e-12),
        (DType::F32, 1e-6),
        (DType::F16, 4e-3),
        (DType::BF16, 3e-2),
    ] {
        let logits = Var::from_tensor(&Tensor::randn(0f32, 2.0, (5, 9), &dev)?.to_dtype(dtype)?)?;
        // candle-nn's in f64 for f64, in f32 otherwise (the half types'
        // reference too: their arithmetic is f32 here).
        let wide = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let reference = Var::from_tensor(&logits.as_tensor().to_dtype(wide)?)?;
        let plain = candle_nn::loss::cross_entropy(&reference, &targets)?;
        let lean = candle_lean_nn::cross_entropy(&logits, &targets)?;
        assert_eq!(lean.dtype(), dtype);
        assert!(max_diff(&plain, &lean)? <= tol, "{dtype:?} value");
        let (gp, gl) = (plain.backward()?, lean.backward()?);
        let g = gl.get(&logits).expect("a gradient for the logits");
        assert_eq!(g.dtype(), dtype);
        let d = max_diff(gp.get(&reference).unwrap(), g)?;
        assert!(d <= tol, "{dtype:?} gradient: {d}");
    }
    Ok(())
}

#[test]
fn cross_entropy_refuses_bad_input_saying_why() -> Result<()> {
    let dev = Device::Cpu;
    let logits = Tensor::zeros((2, 3), DType::F32, &dev)?;
    let err = |t: &Tensor| {
        candle_lean_nn::cross_entropy(&logits, t)
            .unwrap_err()
            .to_string()
    };
    assert!(err(&Tensor::new(&[1u32, 2, 0], &dev)?)
        .starts_with("targets have shape [3], the logits [2, 3]: one class index per row"));
    assert!(err(&Tensor::new(&[1f32, 2.0], &dev)?)
        .starts_with("targets must be class indices (u8, u32 or i64), got F32"));
    assert!(err(&Tensor::new(&[1u32, 3], &dev)?)
        .starts_with("target 3 of row 1 is not a class index: the logits have 3 classes"));
    let empty = Tensor::zeros((0, 3), DType::F32, &dev)?;
    let e = candle_lean_nn::cross_entropy(&empty, &Tensor::zeros(0, DType::U32, &dev)?)
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("cross-entropy of 0 rows of 3 classes has no mean"));
    Ok(())
}

/// The loss's f32 CPU kernel over rows spread across parallel tasks (and a
/// last, shorter one), classes not a multiple of the vector width, large
/// logits (a softmax that needs its maximum taken out), and an upstream
/// gradient other than one: against candle-nn's.
#[test]
fn cross_entropy_over_many_rows_and_odd_classes_in_f32() -> Result<()> {
    let dev = Device::Cpu;
    let logits = Var::from_tensor(&(data(&[101, 37], 1.0, 9)? * 60.0)?)?;
    let targets = Tensor::new((0..101u32).map(|r| (r * 7) % 37).collect::<Vec<_>>(), &dev)?;
    let plain = candle_nn::loss::cross_entropy(&logits, &targets)?;
    let lean = candle_lean_nn::cross_entropy(&logits, &targets)?;
    let rel = max_diff(&plain, &lean)? / plain.to_scalar::<f32>()?.abs() as f64;
    assert!(rel <= 1e-6, "value: relative difference {rel}");
    let (gp, gl) = ((plain * 0.25)?.backward()?, (lean * 0.25)?.backward()?);
    let d = max_diff(gp.get(&logits).unwrap(), gl.get(&logits).unwrap())?;
    assert!(d <= 1e-7, "gradient: {d}");
    Ok(())
}

/// Rows spread over several parallel tasks (and a last, shorter one), and
/// rows whose width is not a multiple of the vector width: the f32 CPU
/// kernel against candle-nn.
#[test]
fn many_rows_and_odd_widths_in_f32() -> Result<()> {
    for act in [Activation::Identity, Activation::Relu, Activation::Gelu] {
        let w = Var::from_tensor(&data(&[37, 19], 0.3, 5)?)?;
        let b = Var::from_tensor(&data(&[37], 0.3, 6)?)?;
        let linear = candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
        let lean = LeanLinear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()))?;
        let x = Var::from_tensor(&data(&[101, 19], 1.0, 7)?)?;
        let weights = data(&[101, 37], 1.0, 8)?;
        let a = reference(&x, &linear, act)?;
        let l = lean.forward_act(&x, act)?;
        assert!(max_diff(&a, &l)? <= 1e-6, "{act:?}: output");
        let ga = (a * &weights)?.sum_all()?.backward()?;
        let gl = (l * &weights)?.sum_all()?.backward()?;
        for v in [&x, &w, &b] {
            let d = max_diff(ga.get(v).unwrap(), gl.get(v).unwrap())?;
            if std::env::var("SHOW").is_ok() {
                println!("{act:?} {:?}: {d:.2e}", v.dims());
            }
            // ReLU and the identity are the same arithmetic in the same
            // order. candle's GELU gradient is up to 3e-6 off the exact one
            // per element (see the next test), summed over 101 rows here:
            // 8.6e-6 measured on this data.
            let tol = if act == Activation::Gelu { 2e-5 } else { 0.0 };
            assert!(d <= tol, "{act:?}: gradient {d}");
        }
    }
    Ok(())
}

/// candle's GELU backward uses constants rounded to six digits, so its f32
/// gradient is itself up to about 3e-6 off the exact derivative; the fused
/// layer's f32 kernel computes it with full constants. Both against the
/// exact derivative in f64, over fifty random layers.
#[test]
fn gelu_gradient_is_nearer_the_exact_derivative_than_candles() -> Result<()> {
    let mut worst = (0f64, 0f64);
    for i in 0..50 {
        let w = data(&[5, 7], 0.3, 100 + 4 * i)?;
        let b = data(&[5], 0.3, 101 + 4 * i)?;
        let x = data(&[6, 7], 1.0, 102 + 4 * i)?;
        let weights = data(&[6, 5], 1.0, 103 + 4 * i)?;
        let run = |dtype: DType, lean: bool| -> Result<Tensor> {
            let (w, b, x) = (
                Var::from_tensor(&w.to_dtype(dtype)?)?,
                Var::from_tensor(&b.to_dtype(dtype)?)?,
                x.to_dtype(dtype)?,
            );
            let out = if lean {
                LeanLinear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()))?
                    .forward_act(&x, Activation::Gelu)?
            } else {
                candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()))
                    .forward(&x)?
                    .gelu()?
            };
            let g = (out * weights.to_dtype(dtype)?)?.sum_all()?.backward()?;
            Ok(g.get(&w).unwrap().clone())
        };
        // The exact derivative in f64: dW = (weights * gelu'(z))^T x.
        let (w64, b64, x64) = (
            w.to_dtype(DType::F64)?,
            b.to_dtype(DType::F64)?,
            x.to_dtype(DType::F64)?,
        );
        let z = x64.matmul(&w64.t()?)?.broadcast_add(&b64)?;
        let k = (2.0f64 / std::f64::consts::PI).sqrt();
        let z2 = z.sqr()?;
        let t = ((&z * k)? * ((&z2 * 0.044715)? + 1.0)?)?.tanh()?;
        let first = ((&t + 1.0)? * 0.5)?;
        let slope = (((&z * 0.5)? * (1.0 - t.sqr()?)?)? * k)?;
        let inner = ((&z2 * (3.0 * 0.044715))? + 1.0)?;
        let d = (first + (slope * inner)?)?;
        let truth = (weights.to_dtype(DType::F64)? * d)?.t()?.matmul(&x64)?;
        worst.0 = worst.0.max(max_diff(&run(DType::F32, false)?, &truth)?);
        worst.1 = worst.1.max(max_diff(&run(DType::F32, true)?, &truth)?);
    }
    let (candle, lean) = worst;
    assert!(
        lean < 2e-6,
        "fused layer: {lean:.2e} off the exact gradient"
    );
    assert!(lean < candle, "fused {lean:.2e}, candle-nn {candle:.2e}");
    Ok(())
}

/// The exact derivative of the tanh-approximated GELU, in f64.
fn gelu_derivative(z: &Tensor) -> Result<Tensor> {
    let k = (2.0f64 / std::f64::consts::PI).sqrt();
    let z2 = z.sqr()?;
    let t = ((z * k)? * ((&z2 * 0.044715)? + 1.0)?)?.tanh()?;
    let first = ((&t + 1.0)? * 0.5)?;
    let slope = (((z * 0.5)? * (1.0 - t.sqr()?)?)? * k)?;
    let inner = ((&z2 * (3.0 * 0.044715))? + 1.0)?;
    first + (slope * inner)?
}

/// In f16 and bf16 the activation's derivative is applied in f32 to the
/// half-precision gradient and input and rounded once, and the bias's
/// gradient summed in f32 and rounded once: within a rounding (2^-8 of
/// each term for bf16, 2^-11 for f16, counted over the terms' magnitudes)
/// of the same sums in f64 from the same half-precision inputs.
#[test]
fn half_precision_bias_gradient_is_within_a_rounding_of_f64() -> Result<()> {
    for (dtype, unit) in [(DType::BF16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
        for act in [Activation::Gelu, Activation::Relu, Activation::Identity] {
            let w = data(&[24, 40], 0.2, 7)?.to_dtype(dtype)?;
            let b = data(&[24], 0.2, 8)?.to_dtype(dtype)?;
            let x = data(&[300, 40], 1.0, 9)?.to_dtype(dtype)?;
            let grad = data(&[300, 24], 1.0, 10)?.to_dtype(dtype)?;
            let layer = LeanLinear::new(w, Some(b))?;
            let (out, kept) = layer.forward_saved(&x, act)?;
            let (_, _, db) = layer.backward_saved(&x, kept.clone(), grad.clone(), true)?;
            let db = db.expect("a bias's gradient");
            assert_eq!(db.dtype(), dtype);
            let g = grad.to_dtype(DType::F64)?;
            let dz = match act {
                Activation::Gelu => {
                    (g * gelu_derivative(&kept.tensor().unwrap().to_dtype(DType::F64)?)?)?
                }
                Activation::Relu => {
                    (g * out.to_dtype(DType::F64)?.gt(0.0)?.to_dtype(DType::F64)?)?
                }
                Activation::Identity => g,
            };
            let exact = dz.sum(0)?;
            let bound = dz.abs()?.sum(0)?.affine(unit, 0.0)?;
            let excess = ((db.to_dtype(DType::F64)? - &exact)?.abs()? - &bound)?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f64>()?;
            println!(
                "{dtype:?} {act:?}: the bias's gradient within its bound by {:.3e}",
                -excess
            );
            assert!(
                excess <= 0.0,
                "{dtype:?} {act:?}: {excess:e} over the bound"
            );
        }
    }
    Ok(())
}

/// `lean_linear` makes the variables `candle_nn::linear` makes: the same
/// names and shapes, and the same layer's output.
#[test]
fn lean_linear_makes_candle_nns_variables() -> candle_core::Result<()> {
    use candle_core::{DType, Device, Module, Tensor};
    use candle_nn::{VarBuilder, VarMap};
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let lean = candle_lean_nn::lean_linear(4, 3, vb.pp("fc"))?;
    let mut vars: Vec<(String, Vec<usize>)> = map
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.dims().to_vec()))
        .collect();
    vars.sort();
    assert_eq!(
        vars,
        [
            ("fc.bias".to_string(), vec![3]),
            ("fc.weight".to_string(), vec![3, 4])
        ]
    );
    // The same variables through candle-nn: the same output.
    let plain = candle_nn::linear(4, 3, vb.pp("fc"))?;
    let x = Tensor::randn(0f32, 1.0, (2, 4), &Device::Cpu)?;
    let (a, b) = (lean.forward(&x)?, plain.forward(&x)?);
    assert_eq!(a.to_vec2::<f32>()?, b.to_vec2::<f32>()?);
    Ok(())
}

/// The direct backward of a layer built on variables hands back plain
/// gradients: a product with the variable itself would record a graph, and
/// that graph would keep the output's gradient alive as long as the input's
/// gradient lives (a whole activation per layer in a deep stack).
#[test]
fn direct_backward_on_variables_records_no_graph() -> Result<()> {
    for act in [Activation::Identity, Activation::Relu, Activation::Gelu] {
        let w = Var::from_tensor(&data(&[6, 5], 0.3, 21)?)?;
        let b = Var::from_tensor(&data(&[6], 0.3, 22)?)?;
        let layer = LeanLinear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()))?;
        let x = data(&[4, 5], 1.0, 23)?;
        let (_, kept) = layer.forward_saved(&x, act)?;
        let grad = data(&[4, 6], 1.0, 24)?;
        let (dx, dw, db) = layer.backward_saved(&x, kept, grad, true)?;
        let dx = dx.expect("the input's gradient was asked for");
        let db = db.expect("the layer has a bias");
        for (name, t) in [("input", &dx), ("weight", &dw), ("bias", &db)] {
            assert!(!t.track_op(), "{act:?}: the {name}'s gradient has a graph");
        }
    }
    Ok(())
}
