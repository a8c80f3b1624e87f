//! The one-operation layer norm against candle-nn's differentiable one:
//! values and gradients of input, weight and bias in every float dtype,
//! and bad shapes.

use candle_core::{DType, Device, Result, Tensor, Var};

mod common;
use common::{data, max_diff};

#[test]
fn equal_to_candle_nn_in_every_dtype() -> Result<()> {
    // f32: the two sum in different orders (measured below 1e-6 for values,
    // a few 1e-6 for gradients summed over 24 rows); half types: their
    // rounding of values near 2.
    for (dtype, tol) in [
        (DType::F64, 1e-12),
        (DType::F32, 1e-5),
        (DType::F16, 1e-2),
        (DType::BF16, 6e-2),
    ] {
        let x = Var::from_tensor(&data(&[2, 12, 16], 2.0, 3)?.to_dtype(dtype)?)?;
        let w = Var::from_tensor(&data(&[16], 2.0, 5)?.to_dtype(dtype)?)?;
        let b = Var::from_tensor(&data(&[16], 2.0, 7)?.to_dtype(dtype)?)?;
        let up = data(&[2, 12, 16], 2.0, 11)?.to_dtype(dtype)?;
        let lean = candle_lean_nn::layer_norm(&x, &w, &b, 1e-5)?;
        let plain = candle_nn::ops::layer_norm_slow(&x, &w, &b, 1e-5)?;
        assert!(max_diff(&lean, &plain)? <= tol, "{dtype:?} values");
        let gl = (lean * &up)?.sum_all()?.backward()?;
        let gp = (plain * &up)?.sum_all()?.backward()?;
        for (name, v) in [("x", &x), ("weight", &w), ("bias", &b)] {
            let (a, p) = (gl.get(v).unwrap(), gp.get(v).unwrap());
            let d = max_diff(a, p)?;
            assert!(d <= tol * 4.0, "{dtype:?} gradient of {name}: {d}");
        }
    }
    Ok(())
}

#[test]
fn keeps_two_numbers_per_row_beside_the_graph() -> Result<()> {
    let x = Var::from_tensor(&data(&[4, 8], 2.0, 1)?)?;
    let (w, b) = (
        Tensor::ones(8, DType::F32, &Device::Cpu)?,
        Tensor::zeros(8, DType::F32, &Device::Cpu)?,
    );
    let rec = candle_custom_grad::kept::Recording::start();
    let y = candle_lean_nn::layer_norm(&x, &w, &b, 1e-5)?;
    let kept = rec.kept_by(&y);
    let shapes: Vec<Vec<usize>> = kept.iter().map(|t| t.dims().to_vec()).collect();
    assert_eq!(shapes, [vec![4, 1], vec![4, 1]]);
    Ok(())
}

#[test]
fn bad_shapes_are_refused() -> Result<()> {
    let x = data(&[2, 8], 2.0, 1)?;
    let w = Tensor::ones(7, DType::F32, &Device::Cpu)?;
    let b = Tensor::zeros(8, DType::F32, &Device::Cpu)?;
    let err = candle_lean_nn::layer_norm(&x, &w, &b, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("layer norm over 8 features: the weight has shape [7], the bias [8]"),
        "{err}"
    );
    Ok(())
}

/// The module built from a `candle_nn::LayerNorm` shares its variables and
/// trains them, where candle-nn's own forward on a contiguous input gives
/// them no gradient; its values equal candle-nn's differentiable layer norm.
#[test]
fn the_module_from_candle_nns_layer_norm_trains_its_variables() -> Result<()> {
    use candle_core::Module;
    use candle_nn::{VarBuilder, VarMap};
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let plain = candle_nn::layer_norm(16, 1e-5, vb.pp("ln"))?;
    let lean = candle_lean_nn::LeanLayerNorm::try_from(&plain)?;
    // Shared, not copied: the same tensors.
    assert_eq!(lean.weight().id(), plain.weight().id());
    assert_eq!(lean.bias().id(), plain.bias().unwrap().id());
    let x = data(&[3, 16], 2.0, 9)?;
    let up = data(&[3, 16], 2.0, 13)?;
    let y = lean.forward(&x)?;
    let want = candle_nn::ops::layer_norm_slow(&x, plain.weight(), plain.bias().unwrap(), 1e-5)?;
    assert!(max_diff(&y, &want)? < 1e-5);
    let grads = (y * &up)?.sum_all()?.backward()?;
    let mut names: Vec<String> = map.data().lock().unwrap().keys().cloned().collect();
    names.sort();
    assert_eq!(names, ["ln.bias", "ln.weight"]);
    for var in map.all_vars() {
        assert!(grads.get(var.as_tensor()).is_some(), "no gradient");
    }
    // candle-nn's own forward: the same values, and no gradient at all.
    let grads = (plain.forward(&x)? * &up)?.sum_all()?.backward()?;
    assert!(map
        .all_vars()
        .iter()
        .all(|v| grads.get(v.as_tensor()).is_none()));
    // And made new, as candle_nn::layer_norm makes it.
    let made = candle_lean_nn::lean_layer_norm(16, 1e-5, vb.pp("other"))?;
    assert_eq!(made.weight().to_vec1::<f32>()?, vec![1f32; 16]);
    assert_eq!(made.bias().to_vec1::<f32>()?, vec![0f32; 16]);
    Ok(())
}

#[test]
fn a_layer_norm_without_a_bias_or_of_bad_shapes_is_refused() -> Result<()> {
    let w = Tensor::ones(8, DType::F32, &Device::Cpu)?;
    let rms = candle_nn::LayerNorm::rms_norm(w.clone(), 1e-5);
    let err = candle_lean_nn::LeanLayerNorm::try_from(&rms)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(
            "this candle_nn::LayerNorm has no bias, and candle-nn does not say whether it \
             subtracts the mean"
        ),
        "{err}"
    );
    let b = Tensor::zeros(7, DType::F32, &Device::Cpu)?;
    let err = candle_lean_nn::LeanLayerNorm::new(w, b, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(
            "a layer norm's weight and bias are vectors of one shape: the weight has shape [8], \
             the bias [7]"
        ),
        "{err}"
    );
    Ok(())
}

/// The direct halves (`LeanLayerNorm` as a `DirectBackward`) give the
/// graph operation's values and gradients to the bit, in every dtype: the
/// same arithmetic with no graph.
#[test]
fn the_direct_backward_equals_the_graphs_to_the_bit_in_every_dtype() -> Result<()> {
    use candle_core::Module;
    use candle_custom_grad::DirectBackward;
    use candle_lean_nn::LeanLayerNorm;
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        let x = Var::from_tensor(&data(&[3, 5, 16], 2.0, 7)?.to_dtype(dtype)?)?;
        let w = Var::from_tensor(&data(&[16], 2.0, 11)?.to_dtype(dtype)?)?;
        let b = Var::from_tensor(&data(&[16], 2.0, 13)?.to_dtype(dtype)?)?;
        let g = data(&[3, 5, 16], 2.0, 17)?.to_dtype(dtype)?;
        let ln = LeanLayerNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), 1e-5)?;
        let graph = ln.forward(x.as_tensor())?;
        let grads = (&graph * &g)?.sum_all()?.backward()?;
        let (out, stats) = ln.forward_saved(x.as_tensor())?;
        assert_eq!(max_diff(&out, &graph)?, 0.0, "{dtype:?}: values");
        let direct = ln.backward_saved(x.as_tensor(), stats, g, true)?;
        let dx = direct.input.expect("asked for");
        assert_eq!(
            max_diff(&dx, grads.get(&x).unwrap())?,
            0.0,
            "{dtype:?}: input"
        );
        assert_eq!(direct.params.len(), 2);
        for ((param, grad), var) in direct.params.iter().zip([&w, &b]) {
            assert_eq!(
                param.id(),
                var.as_tensor().id(),
                "{dtype:?}: the variable itself"
            );
            assert_eq!(max_diff(grad, grads.get(var).unwrap())?, 0.0, "{dtype:?}");
        }
        let (out, stats) = ln.forward_saved(x.as_tensor())?;
        let none = ln.backward_saved(x.as_tensor(), stats, out.ones_like()?, false)?;
        assert!(none.input.is_none(), "{dtype:?}: no input gradient unasked");
    }
    Ok(())
}

/// The CPU kernels (f32, bf16, f16) against the same arithmetic in f64
/// (candle's operations): rows past one task's share, widths with and
/// without a remainder past the kernels' eight lanes, an offset mean (no
/// cancellation: the variance is taken about the mean), and the direct
/// halves as the graph operation calls them.
#[test]
fn the_cpu_kernels_equal_the_f64_computation() -> Result<()> {
    for h in [1usize, 7, 19, 64] {
        let rows = 37;
        let x64 = (data(&[rows, h], 2.0, 3)? + 100.0)?.to_dtype(DType::F64)?;
        let w64 = data(&[h], 2.0, 5)?.to_dtype(DType::F64)?;
        let b64 = data(&[h], 2.0, 7)?.to_dtype(DType::F64)?;
        let up64 = data(&[rows, h], 2.0, 11)?.to_dtype(DType::F64)?;
        // Relative to each tensor's size: f32 sums in another order; the
        // half types round the input, the output and the gradients.
        for (dtype, tol) in [(DType::F32, 2e-5), (DType::F16, 4e-3), (DType::BF16, 3e-2)] {
            let cast = |t: &Tensor| t.to_dtype(dtype);
            let (x, w, b, up) = (cast(&x64)?, cast(&w64)?, cast(&b64)?, cast(&up64)?);
            let (got, stats) = candle_lean_nn::layer_norm_saved(&x, &w, &b, 1e-5)?;
            assert_eq!(got.dtype(), dtype);
            let scale = |t: &Tensor| -> Result<f64> {
                Ok(t.abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f64>()?
                    .max(1e-30))
            };
            // The half types' input is rounded before it is normalised:
            // compare with the f64 norm of the rounded input.
            let x_rounded = x.to_dtype(DType::F64)?;
            let (want_rounded, stats_rounded) = candle_lean_nn::layer_norm_saved(
                &x_rounded,
                &w.to_dtype(DType::F64)?,
                &b.to_dtype(DType::F64)?,
                1e-5,
            )?;
            let d = max_diff(&got, &want_rounded)? / scale(&want_rounded)?;
            assert!(d <= tol, "{dtype:?}, h {h}: values {d}");
            let (dx, dw, db) = candle_lean_nn::layer_norm_backward(&x, &w, &stats, &up)?;
            let want_g = candle_lean_nn::layer_norm_backward(
                &x_rounded,
                &w.to_dtype(DType::F64)?,
                &stats_rounded,
                &up.to_dtype(DType::F64)?,
            )?;
            for (name, got, want) in [
                ("x", &dx, &want_g.0),
                ("weight", &dw, &want_g.1),
                ("bias", &db, &want_g.2),
            ] {
                assert_eq!(got.dims(), want.dims(), "{dtype:?}, h {h}: {name}");
                let d = max_diff(got, want)? / scale(want)?;
                assert!(d <= tol, "{dtype:?}, h {h}: gradient of {name}: {d}");
            }
        }
    }
    Ok(())
}

#[test]
fn a_gradient_of_another_shape_is_refused() -> Result<()> {
    let x = data(&[4, 8], 2.0, 1)?;
    let (w, b) = (data(&[8], 1.0, 2)?, data(&[8], 1.0, 3)?);
    let (_, stats) = candle_lean_nn::layer_norm_saved(&x, &w, &b, 1e-5)?;
    let err = candle_lean_nn::layer_norm_backward(&x, &w, &stats, &data(&[8, 4], 1.0, 4)?)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err.lines().next().unwrap_or_default(),
        "the layer norm's input has shape [4, 8], the output's gradient [8, 4]"
    );
    Ok(())
}
