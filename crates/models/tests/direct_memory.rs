//! What the GPT's direct backward holds, counted by the allocator: each
//! block's saved tensors, per sequence, to the byte, and the working set of
//! its backward beside them. Alone in its file: the counts are process-wide.

use candle_core::{DType, Device, Result, Tensor};
use candle_custom_grad::DirectBackward;
use candle_toolkit_alloc_count::{measure, Counting};
use workbook_models::corpus::batch;
use workbook_models::{AttentionKind, DirectStage, Gpt, GptConfig, Rng};

#[global_allocator]
static ALLOC: Counting = Counting;

/// The tests take turns: the allocator's counts are the whole process's.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

const CONFIG: GptConfig = GptConfig {
    layers: 2,
    hidden: 128,
    heads: 4,
    seq: 64,
    vocab: 96,
    attention: AttentionKind::Materialized,
    lean: true,
    tied_head: true,
};

/// [`CONFIG`] with `attention`, in `dtype`.
fn model(attention: AttentionKind, dtype: DType) -> Result<Gpt> {
    let config = GptConfig {
        attention,
        ..CONFIG
    };
    Gpt::new(config, dtype, &mut Rng::seeded(1), &Device::Cpu)
}

/// Block 0's input for `b` sequences: the embeddings' output.
fn block_input(model: &Gpt, b: usize) -> Result<Tensor> {
    let c = model.config();
    let (x, _) = batch(&mut Rng::seeded(2), b, c.seq, c.vocab, &Device::Cpu)?;
    Ok(DirectStage::Embedding(model).forward_saved(&x)?.0)
}

/// Bytes block 0's forward leaves held (its output and what it saved) for
/// `b` sequences.
fn held_by_block(model: &Gpt, b: usize) -> Result<isize> {
    let x = block_input(model, b)?;
    let (kept, usage) = measure(|| DirectStage::Block(model, 0).forward_saved(&x));
    drop(kept?);
    Ok(usage.held)
}

#[test]
fn a_block_saves_what_pytorch_saves_to_the_byte() -> Result<()> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    // Every thread of the pool makes its matrix products' buffers first:
    // one made during the one-sequence pass and not the two-sequence one
    // would count as held by one sequence (as it did once, 1.5 MB).
    workbook_sdk::device::warm_up(&Device::Cpu)?;
    let c = CONFIG;
    let (h, a, s) = (c.hidden, c.heads, c.seq);
    for dtype in [DType::F32, DType::BF16] {
        for attention in [AttentionKind::Materialized, AttentionKind::Tiled] {
            let model = model(attention, dtype)?;
            // Once first: the thread pool and the matrix library's buffers.
            held_by_block(&model, 2)?;
            let one = held_by_block(&model, 1)?;
            let two = held_by_block(&model, 2)?;
            let e = dtype.size_in_bytes();
            // Per token, in the dtype: the first norm's output (h), q, k and
            // v (3h), the attention's output as the projection's input (h),
            // the residual stream (h), the second norm's output (h), GELU's
            // input and output (4h each), and the block's output (h); two
            // f32 numbers per row for each norm. Then the attention's
            // probabilities (a·s per token), or its f32 log-sum-exp (a).
            let linear = 16 * h * s * e + 2 * 2 * s * 4;
            let attention_bytes = match attention {
                AttentionKind::Tiled => a * s * 4,
                _ => a * s * s * e,
            };
            assert_eq!(
                (two - one) as usize,
                linear + attention_bytes,
                "{dtype:?}, {attention:?}: bytes per sequence"
            );
        }
    }
    Ok(())
}

/// The bound: a block's backward, from what its forward saved and its
/// output's gradient, never holds more above them than its parameters'
/// gradients and one tensor of the MLP's width (4h per token): each saved
/// tensor is freed once its last reader is done, each input gradient once
/// the next exists. In bf16 also the f32 buffers of the toolkit's sliced
/// bf16 products (`candle-lean-nn`'s product module): the right operand
/// widened, and a weight gradient's f32 sum and slice, each at most the
/// largest weight (4h x h) in f32.
#[test]
fn a_blocks_backward_works_in_its_gradients_and_one_wide_tensor() -> Result<()> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    // Every thread of the pool makes its matrix products' buffers first: on
    // a busy machine a product can be stolen by a thread the warm-up pass
    // below never reached, and its buffer (2 MB here) would be counted.
    workbook_sdk::device::warm_up(&Device::Cpu)?;
    let c = CONFIG;
    let (h, b, s) = (c.hidden, 4, c.seq);
    for dtype in [DType::F32, DType::BF16] {
        for attention in [AttentionKind::Materialized, AttentionKind::Tiled] {
            let model = model(attention, dtype)?;
            let stage = DirectStage::Block(&model, 0);
            let x = block_input(&model, b)?;
            let grad = Tensor::randn(0f32, 1.0, (b, s, h), &Device::Cpu)?.to_dtype(dtype)?;
            let e = dtype.size_in_bytes();
            let wide = 4 * h * b * s * e;
            let widened = if dtype == DType::BF16 {
                3 * 4 * h * h * 4
            } else {
                0
            };
            // Twice: the first call sets the thread pool's buffers up.
            for _ in 0..2 {
                let (out, saved) = stage.forward_saved(&x)?;
                drop(out);
                let (grads, usage) =
                    measure(|| stage.backward_saved(&x, saved, grad.clone(), true));
                let grads = grads?;
                let params: usize = grads.params.iter().map(|(_, g)| g.elem_count() * e).sum();
                let bound = params + wide + widened;
                assert!(
                    usage.peak as usize <= bound,
                    "{dtype:?}, {attention:?}: {} bytes above the saved tensors, the bound \
                     {bound} ({params} of gradients, {wide} of one wide tensor, {widened} of \
                     f32 products)",
                    usage.peak,
                );
            }
        }
    }
    Ok(())
}
