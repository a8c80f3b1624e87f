//! What the materialized attention's halves hold, counted by the
//! allocator: one test in its own binary, so no other test's allocations
//! are counted.

use candle_core::{Device, Result, Tensor};
use candle_tiled_attention::{materialized_forward, FlashConfig};
use candle_toolkit_alloc_count::{live, Counting};

mod common;

#[global_allocator]
static ALLOC: Counting = Counting;

/// The halves without a graph: the forward holds the probabilities and the
/// output; the backward holds the probabilities and, on the CPU in f32 (this
/// test), their gradient one (batch, head) pair at a time, a block of
/// scratch per thread: less than two `n x n` matrices, where the graph's
/// backward reaches 6.5.
#[test]
fn the_halves_hold_two_matrices_at_most() -> Result<()> {
    let (heads, n, d) = (4, 256, 32);
    let dev = Device::Cpu;
    let x = [0; 4].map(|_| Tensor::randn(0f32, 1.0, (1, heads, n, d), &dev).unwrap());
    let cfg = FlashConfig::causal(false);
    common::warm_pool(n)?;
    let run = || -> Result<(isize, isize)> {
        let (held, usage) = candle_toolkit_alloc_count::measure(|| -> Result<isize> {
            let start = live();
            let fwd = materialized_forward(&x[0], &x[1], &x[2], &cfg)?;
            let held = live() - start;
            drop(fwd.backward(&x[0], &x[1], &x[2], &x[3])?);
            Ok(held)
        });
        Ok((held?, usage.peak))
    };
    run()?;
    let (held, peak) = run()?;
    let probs = (heads * n * n * 4) as isize;
    let out = (heads * n * d * 4) as isize;
    // The two tensors' data, and their bookkeeping (544 B measured).
    assert!(
        (probs + out..=probs + out + 1024).contains(&held),
        "the forward holds {held} B; probabilities {probs} B, output {out} B"
    );
    // Beyond the two matrices, input-sized tensors only (dV, the output's
    // gradient made contiguous, the packing of the products' operands):
    // measured 1.26 of them.
    assert!(
        peak <= 2 * probs + 2 * out,
        "the halves peak at {peak} B; probabilities {probs} B, an input {out} B"
    );
    // The probabilities, and one pair's gradient block per thread beside.
    let block = (n * n * 4) as isize;
    assert!(peak >= probs + block, "the halves peak at {peak} B");
    Ok(())
}
