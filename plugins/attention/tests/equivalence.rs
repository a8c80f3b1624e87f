//! Chunked and tiled attention against the naive reference.

use candle_core::{Device, Tensor, Var};
use workbook_attention::{
    attention_backward, chunked_attention, naive_attention, tiled_attention, Attention,
};
use workbook_sdk::train::{max_abs_diff, Rng};

struct Case {
    q: Var,
    k: Var,
    v: Var,
    d_out: Tensor,
}

fn case(n: usize, seed: u64) -> Case {
    let dev = Device::Cpu;
    let mut rng = Rng::seeded(seed);
    let mut t = || rng.randn((3, n, 16), &dev).unwrap();
    Case {
        q: Var::from_tensor(&t()).unwrap(),
        k: Var::from_tensor(&t()).unwrap(),
        v: Var::from_tensor(&t()).unwrap(),
        d_out: t(),
    }
}

/// Naive output and gradients through candle's autograd.
fn reference(c: &Case, causal: bool) -> (Tensor, [Tensor; 3]) {
    let out = naive_attention(&c.q, &c.k, &c.v, causal).unwrap();
    let grads = (&out * &c.d_out)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = |v: &Var| grads.get(v.as_tensor()).unwrap().clone();
    (out, [g(&c.q), g(&c.k), g(&c.v)])
}

fn check(c: &Case, causal: bool, fwd: Attention, q_block: usize, k_block: usize, what: &str) {
    let (out, grads) = reference(c, causal);
    let d = max_abs_diff(&out, &fwd.out).unwrap();
    assert!(d < 1e-5, "{what}: output differs by {d}");
    let (dq, dk, dv) =
        attention_backward(&c.q, &c.k, &c.v, &fwd, &c.d_out, causal, q_block, k_block).unwrap();
    for (name, a, b) in [
        ("q", &grads[0], &dq),
        ("k", &grads[1], &dk),
        ("v", &grads[2], &dv),
    ] {
        let d = max_abs_diff(a, b).unwrap();
        assert!(d < 1e-4, "{what}: gradient of {name} differs by {d}");
    }
}

#[test]
fn chunked_equals_naive_with_and_without_the_causal_mask() {
    let n = 50;
    for causal in [false, true] {
        for chunk in [1, 7, 16, 50, 64] {
            let c = case(n, chunk as u64);
            let fwd = chunked_attention(&c.q, &c.k, &c.v, causal, chunk).unwrap();
            check(
                &c,
                causal,
                fwd,
                chunk,
                n,
                &format!("chunked, chunk {chunk}, causal {causal}"),
            );
        }
    }
}

#[test]
fn tiled_equals_naive_with_and_without_the_causal_mask() {
    let n = 45;
    for causal in [false, true] {
        // Uneven tiles, tiles larger than N, and one-row tiles.
        for (qb, kb) in [(8, 8), (16, 5), (5, 16), (1, 45), (64, 64), (9, 1)] {
            let c = case(n, (qb * 100 + kb) as u64);
            let fwd = tiled_attention(&c.q, &c.k, &c.v, causal, qb, kb).unwrap();
            check(
                &c,
                causal,
                fwd,
                qb,
                kb,
                &format!("tiled {qb}x{kb}, causal {causal}"),
            );
        }
    }
}

#[test]
fn the_causal_mask_hides_the_future() {
    // With the mask, the first query sees only the first key: its output is v[0].
    let c = case(10, 3);
    let out = tiled_attention(&c.q, &c.k, &c.v, true, 4, 4).unwrap().out;
    let first = out.narrow(1, 0, 1).unwrap();
    let v0 = c.v.as_tensor().narrow(1, 0, 1).unwrap();
    assert!(max_abs_diff(&first, &v0).unwrap() < 1e-6);
}

#[test]
fn one_4096_by_4096_score_matrix_for_32_heads_in_f16_is_1_07_gb() {
    use workbook_attention::score_matrix_bytes;
    let bytes = score_matrix_bytes(32, 4096, workbook_sdk::candle::DType::F16);
    assert_eq!(bytes, 32 * 4096 * 4096 * 2);
    assert_eq!(bytes, 1_073_741_824);
    assert_eq!(format!("{:.2}", bytes as f64 / 1e9), "1.07");
}
