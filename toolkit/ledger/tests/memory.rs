//! The ledger against the allocator: what it lists is what the forward left
//! allocated, to the byte for the tensors' storage.

use candle_core::{Device, Result, Tensor, Var};
use candle_lean_nn::{Activation, LeanLinear};
use candle_ledger::{Labeller, Ledger};
use candle_toolkit_alloc_count::{measure, Counting};

#[global_allocator]
static ALLOC: Counting = Counting;

fn filled(shape: (usize, usize), v: f32) -> Result<Tensor> {
    Tensor::full(v, shape, &Device::Cpu)
}

#[test]
fn lists_what_the_forward_left_allocated() -> Result<()> {
    let w = Var::from_tensor(&filled((256, 128), 0.01)?)?;
    let w2 = Var::from_tensor(&filled((64, 128), 0.02)?)?;
    let x = filled((32, 256), 1.0)?;
    let fc = LeanLinear::new(w2.as_tensor().clone(), None)?;
    // Forwards first, unmeasured: the thread pool and the matrix product's
    // per-thread buffers are set up once per thread, on whichever threads
    // the work lands.
    for _ in 0..8 {
        let g = fc.forward_act(&x.matmul(w.as_tensor())?.tanh()?, Activation::Gelu)?;
        drop(g.t()?.contiguous()?.sum_all()?);
    }
    let labels = Labeller::new();
    let (loss, usage) = measure(|| -> Result<Tensor> {
        // (32, 128) product, its tanh, then a fused GELU layer that keeps
        // its input (32, 64) beside its output (32, 64); a transposed view
        // of the weight, which is a parameter, not an activation.
        let h = labels.label(x.matmul(w.as_tensor())?, Some(0), "matmul");
        let t = labels.label(h.tanh()?, Some(0), "tanh");
        let g = labels.label(fc.forward_act(&t, Activation::Gelu)?, Some(1), "fc");
        let viewed = labels.label(g.t()?.contiguous()?, Some(1), "transpose");
        Ok(labels.label(viewed.sum_all()?, None, "loss"))
    });
    let loss = loss?;
    let ledger = Ledger::of(&loss, &labels)?;
    let f = |n: usize| (n * 4) as u64;
    assert_eq!(ledger.bytes_of(Some(0), "matmul"), f(32 * 128));
    assert_eq!(ledger.bytes_of(Some(0), "tanh"), f(32 * 128));
    // Output and kept input.
    assert_eq!(ledger.bytes_of(Some(1), "fc"), f(32 * 64) * 2);
    assert_eq!(ledger.bytes_of(Some(1), "transpose"), f(32 * 64));
    assert_eq!(ledger.bytes_of(None, "loss"), 4);
    let listed = ledger.total_bytes();
    assert_eq!(listed, f(32 * 128) * 2 + f(32 * 64) * 3 + 4);
    // The allocator saw the same storage plus candle's small blocks (shapes,
    // strides, reference counts) and the labeller's map.
    assert!(usage.held as u64 >= listed, "{} < {listed}", usage.held);
    assert!(
        usage.held as u64 - listed < 16 * 1024,
        "{} vs {listed}",
        usage.held
    );
    Ok(())
}
