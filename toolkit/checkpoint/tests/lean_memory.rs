//! What the lean backward saves over candle's own, counted by the
//! allocator: one test in its own binary, so no other test's allocations
//! are counted.

use candle_checkpoint::Sequential;
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_toolkit_alloc_count::{measure, Counting};

#[global_allocator]
static ALLOC: Counting = Counting;

struct LinearRelu(candle_nn::Linear);
impl Module for LinearRelu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)?.relu()
    }
}

/// candle's backward keeps every activation until it returns; the lean one
/// frees each layer's as it passes, so its peak is the forward's activations
/// plus one layer's backward.
#[test]
fn the_lean_backward_frees_each_layer_as_it_passes() -> Result<()> {
    let (width, batch, depth) = (256, 512, 8);
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let layers: Vec<LinearRelu> = (0..depth)
        .map(|i| Ok(LinearRelu(candle_nn::linear(width, width, vb.pp(i))?)))
        .collect::<Result<_>>()?;
    let vars = map.all_vars();
    let x = Tensor::randn(0f32, 1.0, (batch, width), &Device::Cpu)?;
    let head = |h: &Tensor| h.sqr()?.mean_all();
    // Warm-up: candle's first operations allocate lasting buffers of their own.
    head(&layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))?)?.backward()?;

    let (plain, plain_usage) = measure(|| -> Result<_> {
        head(&layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))?)?.backward()
    });
    let plain_peak = plain_usage.peak;
    drop(plain?);
    let (lean, lean_usage) = measure(|| Sequential::new(&layers).lean(&x, &vars, head));
    let lean_peak = lean_usage.peak;
    drop(lean?);

    // One activation tensor: batch x width f32. candle-nn's Linear + ReLU
    // keeps three per layer (product, sum with the bias, ReLU).
    let act = (batch * width * 4) as isize;
    let forward = 3 * depth as isize * act;
    let params = (depth * (width * width + width) * 4) as isize;
    // candle's peak comes at the end of its backward, every activation
    // still held beside every parameter's gradient; the lean one's at the
    // start, before any gradient exists.
    assert!(
        lean_peak < plain_peak - params / 2,
        "lean {lean_peak} B, candle {plain_peak} B, parameters {params} B"
    );
    // The forward's activations and the head's and one layer's backward
    // through candle's operations (each gradient summed into a zeros
    // tensor): about ten activation-sized tensors, measured 10.5.
    assert!(
        lean_peak <= forward + 12 * act,
        "lean {lean_peak} B, forward's activations {forward} B"
    );
    Ok(())
}
