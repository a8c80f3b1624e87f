//! LeanAdamW's step allocates nothing; candle_nn::AdamW's allocates fifteen
//! temporaries the size of the parameter. Measured with a counting allocator.

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_lean_optim::LeanAdamW;
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use candle_toolkit_alloc_count::{measure, Counting};

#[global_allocator]
static ALLOC: Counting = Counting;

/// Bytes allocated by `f` (one test in this file, so no other thread of the
/// harness allocates meanwhile).
fn allocated(f: impl FnOnce() -> Result<()>) -> Result<u64> {
    let (r, usage) = measure(f);
    r?;
    Ok(usage.allocated)
}

#[test]
fn lean_step_allocates_nothing_where_candle_allocates_fifteen_parameters() -> Result<()> {
    let n = 1 << 18; // 1 MiB of f32
    let dev = Device::Cpu;
    let make = || -> Result<(Var, candle_core::backprop::GradStore)> {
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, n, &dev)?)?;
        let grads = w.as_tensor().sqr()?.sum_all()?.backward()?;
        Ok((w, grads))
    };
    let (w, grads) = make()?;
    let mut lean = LeanAdamW::new(vec![w.clone()], ParamsAdamW::default())?;
    lean.step(&grads)?; // warm: nothing lazily allocated on first use
    let lean_bytes = allocated(|| lean.step(&grads))?;

    let (w, grads) = make()?;
    let mut adamw = AdamW::new(vec![w.clone()], ParamsAdamW::default())?;
    let candle_bytes = allocated(|| adamw.step(&grads))?;
    let param = (n * DType::F32.size_in_bytes()) as u64;
    assert!(lean_bytes < 1024, "LeanAdamW allocated {lean_bytes} bytes");
    // candle 0.11.1's update, out of place: three tensors for the first
    // moment, four for the second, the two corrected moments, the decayed
    // weight, the root, the root plus eps, the ratio, its product with lr
    // and the new weight.
    // Past the 15 tensors, only scalars' and shapes' bookkeeping.
    assert!(
        (15 * param..15 * param + 16 * 1024).contains(&candle_bytes),
        "candle's AdamW allocated {candle_bytes} bytes, not 15 x {param}"
    );
    println!("per step: LeanAdamW {lean_bytes} bytes, candle_nn::AdamW {candle_bytes} bytes ({:.1}x the parameter)", candle_bytes as f64 / param as f64);
    Ok(())
}
