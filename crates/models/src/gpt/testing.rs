//! What tests of the model and of the steps that train it share (this
//! crate's, and the planner's): helpers that panic, not API.

use super::*;

/// A model small enough for a unit test's every step.
pub const SMALL: GptConfig = GptConfig {
    layers: 2,
    hidden: 16,
    heads: 2,
    seq: 6,
    vocab: 13,
    attention: AttentionKind::Tiled,
    lean: true,
    tied_head: true,
};

/// `t`'s values in f32.
pub fn flat(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()
}

/// Every parameter's gradient: `store`'s, and under stage 3 the linear
/// layers' blocks beside it; flattened, in [`Gpt::vars`]'s order.
pub fn gradients(model: &Gpt, mut store: GradStore) -> Result<Vec<Vec<f32>>> {
    model.take_grads_into(&mut store);
    model
        .vars()
        .iter()
        .map(|v| {
            let g = store
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for a parameter of {:?}", v.dims()));
            flat(g)
        })
        .collect()
}

/// Each parameter's values within 1e-6 of `want`'s.
pub fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: parameters");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: parameter {i}");
        for (a, b) in g.iter().zip(w) {
            assert!((a - b).abs() <= 1e-6, "{what}: parameter {i}: {a} vs {b}");
        }
    }
}
