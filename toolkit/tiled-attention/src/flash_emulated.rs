//! The CUDA kernels of `kernels/flash_*.cu`, run on the CPU by
//! `tests/emulated/harness.cpp` (a C++ compiler builds them with just
//! enough of CUDA emulated: `candle-toolkit-cuda-emulation`), with the launches
//! [`crate::flash_plan::plan`] gives a GPU: f32 against the plain
//! computation in f64 through candle's autograd, f16 and bf16 against the
//! crate's CPU kernel in the same dtype.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use candle_core::{DType, Device, Result, Tensor, Var, D};
use candle_toolkit_cuda_emulation::Build;

use crate::flash_plan::{plan, Launch};
use crate::forward::{causal_mask, scale_of};
use crate::shapes::{repeat_kv, Dims};
use crate::{naive_attention, FlashConfig};

/// The harness, built as `build` says (compiled, or found compiled, once
/// per test process).
fn harness(build: Build) -> &'static Path {
    static PLAIN: OnceLock<PathBuf> = OnceLock::new();
    static RACE_CHECKED: OnceLock<PathBuf> = OnceLock::new();
    let cell = match build {
        Build::Plain => &PLAIN,
        Build::RaceChecked => &RACE_CHECKED,
    };
    cell.get_or_init(|| {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/emulated/harness.cpp");
        candle_toolkit_cuda_emulation::compile_as(&source, build)
    })
}

/// Deterministic values in about [-2, 2).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// A `(batch, heads, n, width)` tensor of values already rounded to
/// `dtype`, in f64.
fn input(shape: (usize, usize, usize, usize), dtype: DType, seed: u64) -> Result<Tensor> {
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    Tensor::from_vec(values(n, seed), shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_dtype(DType::F64)
}

struct Case {
    dims: Dims,
    causal: bool,
    dtype: DType,
    build: Build,
}

/// What the kernels wrote: out, lse, dq, dk, dv.
fn emulate(case: &Case, inputs: [&Tensor; 4]) -> Vec<Vec<f64>> {
    let dims = &case.dims;
    let plan = plan(dims, case.dtype).expect("the kernels apply to every case here");
    let scale = scale_of(&FlashConfig::causal(case.causal), dims.d);
    let header = [
        dims.batch,
        dims.q_heads,
        dims.kv_heads,
        dims.nq,
        dims.nk,
        dims.d,
        dims.dv,
        usize::from(case.causal),
    ];
    let mut input: Vec<f64> = header.iter().map(|&n| n as f64).collect();
    input.push(scale);
    for t in inputs {
        input.extend(t.flatten_all().unwrap().to_vec1::<f64>().unwrap());
    }
    let mut args = Vec::new();
    for Launch { name, grid, block } in [
        &plan.forward,
        &plan.delta,
        &plan.backward_kv,
        &plan.backward_q,
    ] {
        args.push(name.clone());
        args.extend([grid.0, grid.1, *block].map(|n| n.to_string()));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let values = candle_toolkit_cuda_emulation::run_on_f64(harness(case.build), &args, &input);
    let (rq, rk) = (dims.rows() * dims.nq, dims.batch * dims.kv_heads * dims.nk);
    let sizes = [rq * dims.dv, rq, rq * dims.d, rk * dims.d, rk * dims.dv];
    assert_eq!(values.len(), sizes.iter().sum::<usize>());
    let mut rest = values.as_slice();
    sizes
        .iter()
        .map(|&n| {
            let (head, tail) = rest.split_at(n);
            rest = tail;
            head.to_vec()
        })
        .collect()
}

/// The plain computation in f64: out, lse, dq, dk, dv for the loss
/// `sum(out * d_out)`.
fn reference(case: &Case, inputs: [&Tensor; 4]) -> Result<Vec<Vec<f64>>> {
    let dims = &case.dims;
    let cfg = FlashConfig::causal(case.causal);
    let [q, k, v, d_out] = inputs.map(|t| Var::from_tensor(t).unwrap());
    let out = naive_attention(&q, &k, &v, &cfg)?;
    let grads = (&out * d_out.as_tensor())?.sum_all()?.backward()?;
    let grad = |t: &Var| grads.get(t).unwrap().flatten_all()?.to_vec1::<f64>();
    let kr = repeat_kv(&k, dims.group())?;
    let mut scores = (q.matmul(&kr.transpose(2, 3)?)? * scale_of(&cfg, dims.d))?;
    if case.causal {
        let mask = causal_mask(0, dims.nq, 0, dims.nk, DType::F64, &Device::Cpu)?;
        scores = scores.broadcast_add(&mask)?;
    }
    let max = scores.max_keepdim(D::Minus1)?;
    let lse = (scores
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + max)?;
    Ok(vec![
        out.flatten_all()?.to_vec1()?,
        lse.flatten_all()?.to_vec1()?,
        grad(&q)?,
        grad(&k)?,
        grad(&v)?,
    ])
}

/// The crate's CPU kernel in the call's own dtype: out, lse, dq, dk, dv.
/// For f16 and bf16, whose backward (as FlashAttention's, and PyTorch's)
/// takes `rowsum(dO * O)` from the output as rounded to the element type,
/// this is the computation to match, not the exact one. Its backward
/// starts from `kernel_forward`, the kernels' own out and lse: an output
/// element one rounding away moves `rowsum(dO * O)`, and `dO v^T - delta`
/// cancels, so from the CPU forward's the gradients would differ by many
/// roundings wherever the two forwards' sums round apart.
fn same_dtype(
    case: &Case,
    inputs: [&Tensor; 4],
    kernel_forward: [&[f64]; 2],
) -> Result<Vec<Vec<f64>>> {
    let [q, k, v, d_out] = inputs.map(|t| t.to_dtype(case.dtype).unwrap());
    let fwd = crate::flash_forward(&q, &k, &v, &FlashConfig::causal(case.causal))?;
    let [out, lse] = kernel_forward;
    // Exact: the kernels wrote out in the element type and lse in f32.
    let from_kernel = crate::forward::Forward {
        out: Tensor::from_slice(out, fwd.out.shape(), &Device::Cpu)?.to_dtype(case.dtype)?,
        lse: Tensor::from_slice(lse, fwd.lse.shape(), &Device::Cpu)?.to_dtype(fwd.lse.dtype())?,
        ..fwd.clone()
    };
    let (dq, dk, dv) = from_kernel.backward(&q, &k, &v, &d_out)?;
    [&fwd.out, &fwd.lse, &dq, &dk, &dv]
        .iter()
        .map(|t| t.flatten_all()?.to_dtype(DType::F64)?.to_vec1())
        .collect()
}

fn check(case: Case) -> Result<()> {
    let d = &case.dims;
    let qs = (d.batch, d.q_heads, d.nq, d.d);
    let inputs = [
        input(qs, case.dtype, 1)?,
        input((d.batch, d.kv_heads, d.nk, d.d), case.dtype, 2)?,
        input((d.batch, d.kv_heads, d.nk, d.dv), case.dtype, 3)?,
        input((d.batch, d.q_heads, d.nq, d.dv), case.dtype, 4)?,
    ];
    let inputs = [&inputs[0], &inputs[1], &inputs[2], &inputs[3]];
    let got = emulate(&case, inputs);
    if case.dtype != DType::F32 {
        // Normwise against the exact computation too, as tests/cuda.rs
        // holds the kernels on a GPU.
        let exact = reference(&case, inputs)?;
        let tolerance = if case.dtype == DType::F16 { 4e-3 } else { 3e-2 };
        for (what, (got, want)) in ["out", "lse", "dq", "dk", "dv"]
            .iter()
            .zip(got.iter().zip(&exact))
        {
            let largest = want.iter().fold(0f64, |m, x| m.max(x.abs()));
            let worst = got
                .iter()
                .zip(want)
                .fold(0f64, |m, (&g, &w)| m.max((g - w).abs()));
            assert!(
                worst <= tolerance * largest,
                "{what}: off by {:e} normwise ({:?})",
                worst / largest,
                case.dtype
            );
        }
    }
    // f32: the exact computation, within f32's error over sums that may
    // cancel. Half types: the CPU kernel (its backward from the kernels'
    // forward), within one rounding of the element type (both sum in f32,
    // in different orders).
    let (want, rel, floor) = match case.dtype {
        DType::F32 => (reference(&case, inputs)?, 2e-5, 0.05),
        half => {
            let want = same_dtype(&case, inputs, [&got[0], &got[1]])?;
            let rel = if half == DType::F16 {
                2f64.powi(-10)
            } else {
                2f64.powi(-7)
            };
            (want, rel, 0.01)
        }
    };
    for (what, (got, want)) in ["out", "lse", "dq", "dk", "dv"]
        .iter()
        .zip(got.iter().zip(&want))
    {
        let largest = want.iter().fold(0f64, |m, x| m.max(x.abs()));
        // lse stays f32 whatever the element type.
        let rel = if *what == "lse" { 2e-5 } else { rel };
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let err = (g - w).abs();
            assert!(
                err <= rel * (w.abs() + floor * largest),
                "{what}[{i}] is {g}, the reference {w} (case {:?}, {:?}, causal {})",
                case.dims,
                case.dtype,
                case.causal
            );
        }
    }
    Ok(())
}

fn dims(heads: (usize, usize), nq: usize, nk: usize, d: usize, dv: usize) -> Dims {
    Dims {
        batch: 2,
        q_heads: heads.0,
        kv_heads: heads.1,
        nq,
        nk,
        d,
        dv,
    }
}

#[test]
fn every_padded_dimension_matches_the_plain_computation_in_f32() -> Result<()> {
    for (dims, causal) in [
        // Rows and keys that fill no block evenly; one key/value head per
        // two query heads.
        (dims((4, 2), 70, 70, 16, 16), true),
        (dims((2, 2), 37, 90, 64, 64), false),
        (dims((3, 1), 33, 20, 100, 128), true),
        // More keys than queries and more queries than keys, causal.
        (dims((2, 1), 20, 45, 40, 24), true),
        (dims((2, 2), 45, 20, 32, 32), true),
    ] {
        check(Case {
            dims,
            causal,
            dtype: DType::F32,
            build: Build::Plain,
        })?;
    }
    Ok(())
}

#[test]
fn half_types_match_the_plain_computation_within_their_rounding() -> Result<()> {
    for dtype in [DType::F16, DType::BF16] {
        for (dims, causal) in [
            (dims((4, 2), 50, 50, 64, 64), true),
            (dims((2, 1), 40, 66, 128, 72), false),
        ] {
            check(Case {
                dims,
                causal,
                dtype,
                build: Build::Plain,
            })?;
        }
    }
    Ok(())
}

#[test]
fn no_thread_of_a_block_races_another_at_any_dimension_or_dtype() -> Result<()> {
    // Race-checked (ThreadSanitizer, many times slower), so small: per
    // padded dimension, several blocks of queries and of keys, three
    // streamed tiles (so the barrier before a tile is reloaded counts),
    // grouped heads and the causal mask; every output is still held to its
    // reference. Which threads touch which element does not depend on the
    // element type: f32 at each dimension, and f16 at one.
    for (dtype, d) in [
        (DType::F32, 24),
        (DType::F32, 64),
        (DType::F32, 100),
        (DType::F16, 64),
    ] {
        {
            check(Case {
                dims: Dims {
                    batch: 1,
                    ..dims((2, 1), 70, 70, d, d)
                },
                causal: true,
                dtype,
                build: Build::RaceChecked,
            })?;
        }
    }
    Ok(())
}
