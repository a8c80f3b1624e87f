//! The tiled attention against the plain computation: every dtype, causal
//! or not, grouped heads, uneven blocks, empty shapes, bad input.

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_tiled_attention::{
    flash_attention, flash_forward, materialized_attention, materialized_forward, naive_attention,
    FlashConfig,
};

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()
}

fn inputs(
    b: usize,
    hq: usize,
    hkv: usize,
    n: usize,
    d: usize,
    dtype: DType,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = Device::Cpu;
    let r = |h| Tensor::randn(0f32, 1.0, (b, h, n, d), &dev)?.to_dtype(dtype);
    Ok((r(hq)?, r(hkv)?, r(hkv)?))
}

/// Forward and gradients of the tiled op against the naive attention in f64.
fn check(
    dtype: DType,
    causal: bool,
    hq: usize,
    hkv: usize,
    n: usize,
    blocks: (usize, usize),
) -> Result<(f64, f64)> {
    let (q, k, v) = inputs(2, hq, hkv, n, 16, dtype)?;
    let cfg = FlashConfig {
        causal,
        q_block: blocks.0,
        k_block: blocks.1,
        scale: None,
    };
    let vars = [&q, &k, &v].map(|t| Var::from_tensor(t).unwrap());
    let out = flash_attention(&vars[0], &vars[1], &vars[2], &cfg)?;
    assert_eq!(out.dtype(), dtype);
    assert_eq!(out.dims(), &[2, hq, n, 16]);
    let weights = Tensor::randn(0f32, 1.0, out.dims(), &Device::Cpu)?;
    let grads = (out.to_dtype(DType::F32)? * &weights)?
        .sum_all()?
        .backward()?;

    let refs = [&q, &k, &v].map(|t| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap());
    let expected = naive_attention(&refs[0], &refs[1], &refs[2], &cfg)?;
    let ref_grads = (&expected * weights.to_dtype(DType::F64)?)?
        .sum_all()?
        .backward()?;
    let out_diff = max_diff(&out, &expected)?;
    let mut grad_diff = 0f64;
    for (v, r) in vars.iter().zip(&refs) {
        let g = grads.get(v).expect("every input gets a gradient");
        assert_eq!(g.dtype(), dtype);
        assert_eq!(g.dims(), v.dims());
        grad_diff = grad_diff.max(max_diff(g, ref_grads.get(r).unwrap())?);
    }
    Ok((out_diff, grad_diff))
}

#[test]
fn f32_equals_the_plain_computation() -> Result<()> {
    for causal in [false, true] {
        for (hq, hkv) in [(4, 4), (4, 2), (4, 1)] {
            let (o, g) = check(DType::F32, causal, hq, hkv, 37, (8, 5))?;
            assert!(
                o < 1e-5 && g < 1e-4,
                "causal {causal}, heads {hq}/{hkv}: {o} {g}"
            );
        }
    }
    Ok(())
}

#[test]
fn f64_equals_the_plain_computation_closely() -> Result<()> {
    let (o, g) = check(DType::F64, true, 4, 2, 33, (7, 9))?;
    assert!(o < 1e-12 && g < 1e-11, "{o} {g}");
    Ok(())
}

/// The causal mask used to be f32 whatever the scores were, and failed in
/// f16 and bf16 with "dtype mismatch in add".
#[test]
fn causal_attention_works_in_f16_and_bf16() -> Result<()> {
    for (dtype, tol) in [(DType::F16, 4e-3), (DType::BF16, 3e-2)] {
        for causal in [true, false] {
            let (o, g) = check(dtype, causal, 4, 2, 40, (16, 16))?;
            assert!(
                o < tol && g < 4.0 * tol,
                "{dtype:?} causal {causal}: {o} {g}"
            );
        }
    }
    Ok(())
}

#[test]
fn forward_and_backward_halves_match_the_op() -> Result<()> {
    let (q, k, v) = inputs(1, 2, 2, 20, 8, DType::F32)?;
    let cfg = FlashConfig {
        causal: true,
        q_block: 6,
        k_block: 6,
        scale: Some(0.3),
    };
    let fwd = flash_forward(&q, &k, &v, &cfg)?;
    assert_eq!(fwd.lse.dims(), &[1, 2, 20]);
    assert_eq!(fwd.lse.dtype(), DType::F32);
    let ones = fwd.out.ones_like()?;
    let (dq, dk, dv) = fwd.backward(&q, &k, &v, &ones)?;
    let vars = [&q, &k, &v].map(|t| Var::from_tensor(t).unwrap());
    let grads = naive_attention(&vars[0], &vars[1], &vars[2], &cfg)?
        .sum_all()?
        .backward()?;
    for (mine, var) in [dq, dk, dv].iter().zip(&vars) {
        assert!(max_diff(mine, grads.get(var).unwrap())? < 1e-4);
    }
    Ok(())
}

#[test]
fn empty_queries_give_empty_outputs_and_zero_gradients() -> Result<()> {
    let (q, k, v) = inputs(1, 2, 2, 0, 8, DType::F32)?;
    let fwd = flash_forward(&q, &k, &v, &FlashConfig::default())?;
    assert_eq!(fwd.out.dims(), &[1, 2, 0, 8]);
    let (dq, dk, dv) = fwd.backward(&q, &k, &v, &fwd.out)?;
    assert_eq!(
        (dq.dims(), dk.dims(), dv.dims()),
        (q.dims(), k.dims(), v.dims())
    );
    Ok(())
}

fn err(r: Result<impl std::fmt::Debug>) -> String {
    r.expect_err("must fail").to_string()
}

#[test]
fn bad_input_is_an_error_that_says_why() -> Result<()> {
    let (q, k, v) = inputs(1, 3, 2, 4, 8, DType::F32)?;
    let cfg = FlashConfig::default();
    assert!(err(flash_attention(&q, &k, &v, &cfg))
        .starts_with("3 query heads cannot share 2 key/value heads"));
    let (q, k, v) = inputs(1, 2, 2, 4, 8, DType::F32)?;
    let zero = FlashConfig { k_block: 0, ..cfg };
    assert!(err(flash_attention(&q, &k, &v, &zero)).starts_with("k_block is 0"));
    assert!(err(flash_attention(&q.squeeze(0)?, &k, &v, &cfg))
        .starts_with("q must be (batch, heads, seq, head_dim), got shape [2, 4, 8]"));
    assert!(err(flash_attention(&q.to_dtype(DType::F16)?, &k, &v, &cfg))
        .starts_with("dtypes differ: q F16, k F32, v F32"));
    let (q0, k0, v0) = inputs(1, 2, 2, 0, 8, DType::F32)?;
    assert!(err(flash_forward(&q, &k0, &v0, &cfg)).starts_with("there are no keys"));
    assert!(err(materialized_attention(&q, &k0, &v0, &cfg)).starts_with("there are no keys"));
    let _ = q0;

    // A backward given other inputs than its forward's is an error, naming
    // both: wider values and more queries would read past the saved rows, a
    // longer key or a wider head would recompute other scores against the
    // saved log-sum-exp and return wrong gradients.
    let fwd = flash_forward(&q, &k, &v, &cfg)?;
    let d_out = fwd.out.ones_like()?;
    let (_, _, wide) = inputs(1, 2, 2, 4, 16, DType::F32)?;
    assert_eq!(
        err(fwd.backward(&q, &k, &wide, &d_out)).lines().next(),
        Some(
            "q, k and v (of shapes [1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 16]) are not the \
             forward's inputs (of shapes [1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8])"
        )
    );
    let (long, longer_k, longer_v) = inputs(1, 2, 2, 6, 8, DType::F32)?;
    assert!(
        err(fwd.backward(&long, &k, &v, &d_out)).starts_with("q, k and v (of shapes [1, 2, 6, 8]")
    );
    assert!(err(fwd.backward(&q, &longer_k, &longer_v, &d_out))
        .starts_with("q, k and v (of shapes [1, 2, 4, 8], [1, 2, 6, 8], [1, 2, 6, 8])"),);
    let (wide_q, wide_k, _) = inputs(1, 2, 2, 4, 16, DType::F32)?;
    assert!(err(fwd.backward(&wide_q, &wide_k, &v, &d_out))
        .starts_with("q, k and v (of shapes [1, 2, 4, 16], [1, 2, 4, 16], [1, 2, 4, 8])"));
    // The materialized backward alike: fewer key/value heads, and a wider
    // head under a given scale, would pass every other check.
    let (_, k1, v1) = inputs(1, 2, 1, 4, 8, DType::F32)?;
    assert_eq!(
        err(materialized_forward(&q, &k, &v, &cfg)?.backward(&q, &k1, &v1, &d_out))
            .lines()
            .next(),
        Some(
            "q, k and v (of shapes [1, 2, 4, 8], [1, 1, 4, 8], [1, 1, 4, 8]) are not the \
             forward's inputs (of shapes [1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8])"
        )
    );
    let scaled = FlashConfig {
        scale: Some(0.5),
        ..cfg
    };
    assert!(
        err(materialized_forward(&q, &k, &v, &scaled)?.backward(&wide_q, &wide_k, &v, &d_out))
            .starts_with("q, k and v (of shapes [1, 2, 4, 16], [1, 2, 4, 16], [1, 2, 4, 8])")
    );
    // Its output, a public field, replaced by one of other rows.
    let mut replaced = flash_forward(&q, &k, &v, &cfg)?;
    replaced.out = Tensor::zeros((1, 2, 3, 8), DType::F32, &Device::Cpu)?;
    assert_eq!(
        err(replaced.backward(&q, &k, &v, &replaced.out.ones_like()?))
            .lines()
            .next(),
        Some(
            "the forward's output has shape [1, 2, 3, 8] and its log-sum-exp [1, 2, 4]: not \
             those of its inputs, [1, 2, 4, 8] and [1, 2, 4]"
        )
    );
    Ok(())
}

/// Gradients of the plain computation in f64, to check a call against.
fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_out: &Tensor,
    cfg: &FlashConfig,
) -> Result<[Tensor; 4]> {
    let vars = [q, k, v].map(|t| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap());
    let out = naive_attention(&vars[0], &vars[1], &vars[2], cfg)?;
    let grads = (&out * d_out.to_dtype(DType::F64)?)?
        .sum_all()?
        .backward()?;
    let g = |v: &Var| grads.get(v).unwrap().clone();
    Ok([out, g(&vars[0]), g(&vars[1]), g(&vars[2])])
}

/// Queries and keys of different lengths (causal: top-left aligned),
/// values narrower than keys, and inputs that are strided views.
#[test]
fn lengths_widths_and_strided_inputs() -> Result<()> {
    let dev = Device::Cpu;
    for (nq, nk) in [(13, 29), (29, 13)] {
        for causal in [false, true] {
            // q is stored (b, n, h, d) and viewed as (b, h, n, d): strided.
            let q = Tensor::randn(0f32, 1.0, (2, nq, 4, 16), &dev)?.transpose(1, 2)?;
            let k = Tensor::randn(0f32, 1.0, (2, 2, nk, 16), &dev)?;
            let v = Tensor::randn(0f32, 1.0, (2, 2, nk, 8), &dev)?;
            let d_out = Tensor::randn(0f32, 1.0, (2, 4, nq, 8), &dev)?;
            let cfg = FlashConfig {
                causal,
                q_block: 4,
                k_block: 7,
                scale: None,
            };
            let fwd = flash_forward(&q, &k, &v, &cfg)?;
            let (dq, dk, dv) = fwd.backward(&q, &k, &v, &d_out)?;
            let want = reference(&q, &k, &v, &d_out, &cfg)?;
            for (got, want) in [fwd.out, dq, dk, dv].iter().zip(&want) {
                assert_eq!(got.dims(), want.dims());
                let diff = max_diff(got, want)?;
                assert!(diff < 1e-4, "{nq}x{nk} causal {causal}: {diff}");
            }
        }
    }
    Ok(())
}

/// The same results from a pool of one thread as from the global pool.
#[test]
fn one_thread_gives_the_same_results() -> Result<()> {
    let (q, k, v) = inputs(2, 4, 2, 70, 16, DType::F32)?;
    let d_out = Tensor::randn(0f32, 1.0, (2, 4, 70, 16), &Device::Cpu)?;
    let cfg = FlashConfig {
        causal: true,
        q_block: 16,
        k_block: 32,
        scale: None,
    };
    let run = || -> Result<Vec<Tensor>> {
        let fwd = flash_forward(&q, &k, &v, &cfg)?;
        let (dq, dk, dv) = fwd.backward(&q, &k, &v, &d_out)?;
        Ok(vec![fwd.out, fwd.lse, dq, dk, dv])
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a pool of one thread");
    let single = pool.install(run)?;
    for (a, b) in single.iter().zip(&run()?) {
        assert_eq!(max_diff(a, b)?, 0.0);
    }
    Ok(())
}

/// One case of the materialized attention's tests: inputs, the output's
/// gradient, the configuration, and the plain computation's output and
/// gradients in f64.
struct Case {
    dtype: DType,
    tol: f64,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_out: Tensor,
    cfg: FlashConfig,
    want: [Tensor; 4],
    what: String,
}

/// Runs `check` on every dtype with its tolerance, causal or not, grouped
/// heads, and queries and keys of different lengths.
fn for_each_materialized_case(mut check: impl FnMut(Case) -> Result<()>) -> Result<()> {
    let dev = Device::Cpu;
    for (dtype, tol) in [
        (DType::F32, 1e-5),
        (DType::F64, 1e-12),
        (DType::F16, 1e-2),
        (DType::BF16, 6e-2),
    ] {
        for causal in [false, true] {
            for (hkv, nq, nk) in [(4, 13, 13), (2, 13, 21), (1, 21, 13)] {
                let r = |h, n, d| Tensor::randn(0f32, 1.0, (2, h, n, d), &dev)?.to_dtype(dtype);
                let (q, k, v) = (r(4, nq, 8)?, r(hkv, nk, 8)?, r(hkv, nk, 6)?);
                let d_out = Tensor::randn(0f32, 1.0, (2, 4, nq, 6), &dev)?.to_dtype(dtype)?;
                let cfg = FlashConfig::causal(causal);
                let want = reference(&q, &k, &v, &d_out, &cfg)?;
                let what = format!("{dtype:?} causal {causal} kv heads {hkv} {nq}x{nk}");
                check(Case {
                    dtype,
                    tol,
                    q,
                    k,
                    v,
                    d_out,
                    cfg,
                    want,
                    what,
                })?;
            }
        }
    }
    Ok(())
}

/// The materialized attention (probabilities kept, scores and softmax one
/// operation) against the plain computation in f64: every dtype, causal or
/// not, grouped heads, queries and keys of different lengths.
#[test]
fn materialized_attention_equals_the_plain_computation() -> Result<()> {
    for_each_materialized_case(|c| {
        let vars = [&c.q, &c.k, &c.v].map(|t| Var::from_tensor(t).unwrap());
        let out = materialized_attention(&vars[0], &vars[1], &vars[2], &c.cfg)?;
        assert_eq!(out.dtype(), c.dtype);
        let grads = (&out * &c.d_out)?.sum_all()?.backward()?;
        let what = &c.what;
        assert!(max_diff(&out, &c.want[0])? < c.tol, "{what}: output");
        for (var, want) in vars.iter().zip(&c.want[1..]) {
            let got = grads.get(var).expect("a gradient");
            assert_eq!(got.dims(), var.dims());
            let d = max_diff(got, want)?;
            assert!(d < 4.0 * c.tol, "{what}: gradient {d}");
        }
        Ok(())
    })
}

/// The materialized attention's two halves, no graph, against the plain
/// computation in f64: every dtype, causal or not, grouped heads, queries
/// and keys of different lengths; and equal to the autograd version's.
#[test]
fn materialized_halves_equal_the_plain_computation() -> Result<()> {
    for_each_materialized_case(|c| {
        let (q, k, v, cfg, what) = (&c.q, &c.k, &c.v, &c.cfg, &c.what);
        let fwd = materialized_forward(q, k, v, cfg)?;
        assert_eq!(fwd.probs.dims(), &[2, 4, q.dim(2)?, k.dim(2)?]);
        let out = fwd.out.clone();
        let grads = fwd.backward(q, k, v, &c.d_out)?;
        assert_eq!(out.dtype(), c.dtype);
        assert!(max_diff(&out, &c.want[0])? < c.tol, "{what}: output");
        let got = [&grads.0, &grads.1, &grads.2];
        for ((got, input), want) in got.into_iter().zip([q, k, v]).zip(&c.want[1..]) {
            assert_eq!((got.dims(), got.dtype()), (input.dims(), c.dtype), "{what}");
            let d = max_diff(got, want)?;
            assert!(d < 4.0 * c.tol, "{what}: gradient {d}");
        }
        // The autograd version's gradients, through candle's graph: equal in
        // f32 and f64 to rounding.
        if matches!(c.dtype, DType::F32 | DType::F64) {
            let vars = [q, k, v].map(|t| Var::from_tensor(t).unwrap());
            let auto = materialized_attention(&vars[0], &vars[1], &vars[2], cfg)?;
            let store = (&auto * &c.d_out)?.sum_all()?.backward()?;
            for (var, got) in vars.iter().zip(got) {
                let d = max_diff(store.get(var).unwrap(), got)?;
                assert!(d < c.tol, "{what}: against autograd {d}");
            }
        }
        Ok(())
    })
}

/// What the materialized halves refuse, each with its reason.
#[test]
fn materialized_halves_refuse_mismatched_input() -> Result<()> {
    let (q, k, v) = inputs(1, 2, 2, 5, 4, DType::F32)?;
    let cfg = FlashConfig::causal(false);
    let k0 = k.narrow(2, 0, 0)?;
    let v0 = v.narrow(2, 0, 0)?;
    assert!(err(materialized_forward(&q, &k0, &v0, &cfg)).starts_with("there are no keys"));
    let fwd = materialized_forward(&q, &k, &v, &cfg)?;
    let short = fwd.out.narrow(2, 0, 4)?;
    let said = err((fwd.clone()).backward(&q, &k, &v, &short));
    assert!(
        said.starts_with(
            "d_out has shape [1, 2, 4, 4], the forward's output [1, 2, 5, 4]; \
             these inputs make [1, 2, 5, 4]"
        ),
        "{said}"
    );
    // A forward of other inputs: refused before its probabilities, which do
    // not fit these, are read; and probabilities replaced (a public field)
    // by others.
    let (q6, k6, v6) = inputs(1, 2, 2, 6, 4, DType::F32)?;
    let other = materialized_forward(&q6, &k6, &v6, &cfg)?;
    let d_out = Tensor::ones((1, 2, 6, 4), DType::F32, &Device::Cpu)?;
    let said = err(other.clone().backward(&q6, &k, &v, &d_out));
    assert!(
        said.starts_with(
            "q, k and v (of shapes [1, 2, 6, 4], [1, 2, 5, 4], [1, 2, 5, 4]) are not the \
             forward's inputs (of shapes [1, 2, 6, 4], [1, 2, 6, 4], [1, 2, 6, 4])"
        ),
        "{said}"
    );
    let mut replaced = other;
    replaced.probs = replaced.probs.narrow(3, 0, 5)?;
    let said = err(replaced.backward(&q6, &k6, &v6, &d_out));
    assert!(
        said.starts_with(
            "the probabilities have shape [1, 2, 6, 5], these inputs make [1, 2, 6, 6]"
        ),
        "{said}"
    );
    // Inputs of another head size than the forward's, which would scale
    // the scores otherwise. (The forward's configuration travels with its
    // result, so no other can be given to the backward.)
    let fwd = materialized_forward(&q, &k, &v, &cfg)?;
    let d_out = fwd.out.ones_like()?;
    let (q8, k8, _) = inputs(1, 2, 2, 5, 8, DType::F32)?;
    let said = err(fwd.backward(&q8, &k8, &v, &d_out));
    assert!(
        said.starts_with("q, k and v (of shapes [1, 2, 5, 8], [1, 2, 5, 8], [1, 2, 5, 4])"),
        "{said}"
    );
    Ok(())
}
