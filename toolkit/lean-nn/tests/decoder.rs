//! The Llama-family layers (RMS norm, rotary embeddings, SwiGLU) and the
//! fused linear cross-entropy against plain compositions of candle's
//! operations: values and gradients in every float dtype, and bad inputs
//! (the memory the fused loss holds is in memory.rs, whose tests take
//! turns with the allocator).

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_lean_nn::LinearCrossEntropy;

mod common;
use common::{data, max_diff, targets, var};

/// The largest magnitude of `t`, to make a difference relative.
fn max_abs(t: &Tensor) -> Result<f64> {
    t.to_dtype(DType::F64)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()
}

/// Tolerances relative to the largest magnitude: f32 and f64 sum in
/// different orders; the half types differ by their rounding.
const DTYPES: [(DType, f64); 4] = [
    (DType::F64, 1e-12),
    (DType::F32, 2e-6),
    (DType::F16, 4e-3),
    (DType::BF16, 3e-2),
];

/// Checks `lean` against `plain`: their values within `tol` of the plain
/// ones' largest magnitude, and the gradients of `inputs` under the
/// upstream gradient `up` within `grad_tol`.
fn assert_same(
    lean: Tensor,
    plain: Tensor,
    up: &Tensor,
    inputs: &[(&str, &Var)],
    (tol, grad_tol): (f64, f64),
    what: &str,
) -> Result<()> {
    let d = max_diff(&lean, &plain)? / max_abs(&plain)?;
    assert!(d <= tol, "{what} values: {d}");
    let gl = (lean * up)?.sum_all()?.backward()?;
    let gp = (plain * up)?.sum_all()?.backward()?;
    for (name, v) in inputs {
        let (a, p) = (gl.get(v).unwrap(), gp.get(v).unwrap());
        let d = max_diff(a, p)? / max_abs(p)?;
        assert!(d <= grad_tol, "{what} gradient of {name}: {d}");
    }
    Ok(())
}

#[test]
fn rms_norm_equals_the_plain_composition_in_every_dtype() -> Result<()> {
    for (dtype, tol) in DTYPES {
        let x = var(&[2, 12, 16], 2.0, 3, dtype)?;
        let w = var(&[16], 1.5, 5, dtype)?;
        let up = data(&[2, 12, 16], 1.0, 11)?.to_dtype(dtype)?;
        let lean = candle_lean_nn::rms_norm(&x, &w, 1e-5)?;
        let plain = candle_nn::ops::rms_norm_slow(&x, &w, 1e-5)?;
        let inputs = [("x", &x), ("weight", &w)];
        assert_same(
            lean,
            plain,
            &up,
            &inputs,
            (tol, tol * 4.0),
            &format!("{dtype:?}"),
        )?;
    }
    Ok(())
}

#[test]
fn rope_equals_the_plain_composition_in_every_dtype() -> Result<()> {
    for (dtype, tol) in DTYPES {
        let (cos, sin) = candle_lean_nn::RopeConfig {
            positions: 6,
            head_dim: 8,
            theta: 10_000.0,
        }
        .tables(dtype, &Device::Cpu)?;
        let x = var(&[2, 3, 6, 8], 2.0, 7, dtype)?;
        let up = data(&[2, 3, 6, 8], 1.0, 13)?.to_dtype(dtype)?;
        let lean = candle_lean_nn::rope(&x, &cos, &sin)?;
        let plain = candle_nn::rotary_emb::rope_slow(&x, &cos, &sin)?;
        assert_same(
            lean,
            plain,
            &up,
            &[("x", &x)],
            (tol, tol * 2.0),
            &format!("{dtype:?}"),
        )?;
    }
    Ok(())
}

#[test]
fn swiglu_equals_the_plain_composition_in_every_dtype() -> Result<()> {
    for (dtype, tol) in DTYPES {
        let g = var(&[4, 24], 4.0, 17, dtype)?;
        let u = var(&[4, 24], 2.0, 19, dtype)?;
        let up = data(&[4, 24], 1.0, 23)?.to_dtype(dtype)?;
        let lean = candle_lean_nn::swiglu(&g, &u)?;
        let plain = (candle_nn::ops::silu(&g)? * u.as_tensor())?;
        let inputs = [("gate", &g), ("up", &u)];
        assert_same(
            lean,
            plain,
            &up,
            &inputs,
            (tol, tol * 4.0),
            &format!("{dtype:?}"),
        )?;
    }
    Ok(())
}

/// The plain head and loss: the whole logits, then candle-nn's
/// cross-entropy (computed in f32 for the half types, as the fused loss
/// does).
fn plain_loss(hidden: &Tensor, weight: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = hidden.matmul(&weight.t()?)?;
    let acc = if hidden.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    candle_nn::loss::cross_entropy(&logits.to_dtype(acc)?, targets)?.to_dtype(hidden.dtype())
}

#[test]
fn the_fused_loss_equals_the_plain_head_and_loss_in_every_dtype_and_chunking() -> Result<()> {
    let (rows, h, classes) = (13, 16, 40);
    let t = targets(rows, classes)?;
    for (dtype, tol) in DTYPES {
        let hidden = var(&[rows, h], 1.0, 29, dtype)?;
        let weight = var(&[classes, h], 1.0, 31, dtype)?;
        let plain = plain_loss(&hidden, &weight, &t)?;
        let gp = plain.backward()?;
        for chunk in [None, Some(1), Some(4), Some(13), Some(100)] {
            let fused = match chunk {
                Some(n) => LinearCrossEntropy::new().chunk_rows(n),
                None => LinearCrossEntropy::new(),
            };
            let loss = fused.loss(&hidden, &weight, &t)?;
            assert_eq!(loss.dtype(), dtype);
            let d = max_diff(&loss, &plain)? / max_abs(&plain)?;
            assert!(d <= tol, "{dtype:?} {chunk:?} loss: {d}");
            let gf = loss.backward()?;
            for (name, v) in [("hidden", &hidden), ("weight", &weight)] {
                let (a, p) = (gf.get(v).unwrap(), gp.get(v).unwrap());
                assert_eq!(a.dtype(), dtype);
                let d = max_diff(a, p)? / max_abs(p)?;
                assert!(
                    d <= tol * 4.0,
                    "{dtype:?} {chunk:?} gradient of {name}: {d}"
                );
            }
            // The one-pass form: the loss and gradients scaled by 0.25.
            let direct = fused.loss_and_grads(&hidden, &weight, &t, 0.25)?;
            let d = max_diff(&direct.loss, &(&plain * 0.25)?)? / max_abs(&plain)?;
            assert!(d <= tol, "{dtype:?} {chunk:?} direct loss: {d}");
            for (name, g, v) in [
                ("hidden", &direct.hidden, &hidden),
                ("weight", &direct.weight, &weight),
            ] {
                let p = (gp.get(v).unwrap() * 0.25)?;
                let d = max_diff(g, &p)? / max_abs(&p)?;
                assert!(d <= tol * 4.0, "{dtype:?} {chunk:?} direct {name}: {d}");
            }
        }
    }
    Ok(())
}

#[test]
fn the_chunk_rule_makes_a_chunks_logits_about_the_hidden_states_size() {
    let fused = LinearCrossEntropy::new();
    // Llama-3.1-8B at batch 8, 4,096 tokens: 128,256 / 4,096 -> 32;
    // 32,768 / 32 -> 1,024 rows.
    assert_eq!(fused.rows_per_chunk(32_768, 4096, 128_256), 1024);
    // SmolLM2-135M at batch 4, 512 tokens: 49,152 / 576 -> 86; 2048 / 86
    // -> 24 -> 32 rows, raised to the least, 128.
    assert_eq!(fused.rows_per_chunk(2048, 576, 49_152), 128);
    // Fewer classes than features: every row at once.
    assert_eq!(fused.rows_per_chunk(10, 64, 8), 10);
    assert_eq!(fused.chunk_rows(0).rows_per_chunk(10, 64, 8), 1);
    assert_eq!(
        LinearCrossEntropy::new()
            .chunk_rows(50)
            .rows_per_chunk(10, 64, 8),
        10
    );
}

fn first_line(e: candle_core::Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

#[test]
fn bad_inputs_are_refused_with_what_was_given() -> Result<()> {
    let dev = Device::Cpu;
    let h = Tensor::zeros((3, 4), DType::F32, &dev)?;
    let w = Tensor::zeros((5, 4), DType::F32, &dev)?;
    let t = Tensor::new(&[0u32, 1, 2], &dev)?;
    let fused = LinearCrossEntropy::new();
    let cases = [
        (
            fused.loss(&h, &Tensor::zeros((5, 3), DType::F32, &dev)?, &t),
            "the head's weight has shape [5, 3] for hidden states [3, 4]: it must be (classes, 4)",
        ),
        (
            fused.loss(&h, &w.to_dtype(DType::BF16)?, &t),
            "the hidden states are F32 and the head's weight BF16: give both one dtype",
        ),
        (
            fused.loss(&h, &w, &Tensor::new(&[0u32, 1], &dev)?),
            "targets have shape [2], the hidden states [3, 4]: one class index per row",
        ),
        (
            fused.loss(&h, &w, &Tensor::new(&[0f32, 1.0, 2.0], &dev)?),
            "targets must be class indices (u8, u32 or i64), got F32",
        ),
        (
            fused.loss(&h, &w, &Tensor::new(&[0u32, 5, 2], &dev)?),
            "target 5 of row 1 is not a class index: the logits have 5 classes",
        ),
        (
            fused.loss(
                &Tensor::zeros((0, 4), DType::F32, &dev)?,
                &w,
                &Tensor::zeros(0, DType::U32, &dev)?,
            ),
            "cross-entropy of 0 rows of 5 classes has no mean",
        ),
    ];
    for (result, message) in cases {
        assert_eq!(first_line(result.unwrap_err()), message);
    }
    let x = Tensor::zeros((2, 4), DType::F32, &dev)?;
    let cases = [
        (
            candle_lean_nn::rms_norm(&x, &Tensor::ones(3, DType::F32, &dev)?, 1e-5),
            "RMS norm over 4 features: the weight has shape [3], it must be (4,)",
        ),
        (
            candle_lean_nn::rms_norm(&x, &Tensor::ones(4, DType::F16, &dev)?, 1e-5),
            "RMS norm of F32 input with a F16 weight: give both one dtype",
        ),
        (
            candle_lean_nn::swiglu(&x, &Tensor::zeros((2, 3), DType::F32, &dev)?),
            "SwiGLU multiplies gate and up element by element: gate is F32 [2, 4], up F32 [2, 3]",
        ),
    ];
    for (result, message) in cases {
        assert_eq!(first_line(result.unwrap_err()), message);
    }
    let q = Tensor::zeros((1, 2, 6, 8), DType::F32, &dev)?;
    let (cos, sin) = candle_lean_nn::RopeConfig {
        positions: 4,
        head_dim: 8,
        theta: 1e4,
    }
    .tables(DType::F32, &dev)?;
    assert_eq!(
        first_line(candle_lean_nn::rope(&q, &cos, &sin).unwrap_err()),
        "rotary embeddings of input [1, 2, 6, 8] (batch, heads, seq, head_dim) need tables of \
         (6.., 4), got cos [4, 4] and sin [4, 4]"
    );
    assert_eq!(
        first_line(
            candle_lean_nn::RopeConfig {
                positions: 4,
                head_dim: 7,
                theta: 1e4
            }
            .tables(DType::F32, &dev)
            .unwrap_err()
        ),
        "rotary embeddings rotate pairs: head_dim 7 must be even and positive"
    );
    Ok(())
}

#[test]
fn rope_tables_hold_hugging_faces_angles() -> Result<()> {
    // inv_freq = theta^(-2i / head_dim): 1 and 1/100 for head_dim 4 and
    // theta 10,000; position 2 turns by 2 and 0.02 radians.
    let (cos, sin) = candle_lean_nn::RopeConfig {
        positions: 3,
        head_dim: 4,
        theta: 10_000.0,
    }
    .tables(DType::F64, &Device::Cpu)?;
    let (cos, sin) = (cos.to_vec2::<f64>()?, sin.to_vec2::<f64>()?);
    assert_eq!(cos[0], [1.0, 1.0]);
    assert_eq!(sin[0], [0.0, 0.0]);
    for (got, want) in [
        (cos[2][0], 2f64.cos()),
        (cos[2][1], 0.02f64.cos()),
        (sin[2][0], 2f64.sin()),
        (sin[2][1], 0.02f64.sin()),
    ] {
        // The angles are computed in f32.
        assert!((got - want).abs() < 1e-6, "{got} against {want}");
    }
    Ok(())
}
