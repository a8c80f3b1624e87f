//! What the direct backward holds beside the lean one, counted by the
//! allocator: one test in its own binary, so no other test's allocations
//! are counted.

use candle_checkpoint::Sequential;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_lean_nn::{cross_entropy, cross_entropy_and_grad, Activation, LeanLayer, LeanLinear};
use candle_toolkit_alloc_count::{measure, Counting};

#[global_allocator]
static ALLOC: Counting = Counting;

/// Through candle's graph, a layer's backward adds a zeros tensor and a
/// sum for its output's gradient and for its input's; called directly it
/// holds the gradient it is given until the product's is made, then that
/// one and the input's. The forward's activations are the same both ways.
#[test]
fn the_direct_backward_holds_fewer_activation_sized_tensors() -> Result<()> {
    let (width, batch, depth) = (256, 512, 8);
    let dev = Device::Cpu;
    let vars: Vec<Var> = (0..depth)
        .map(|_| Var::randn(0f32, 0.06, (width, width), &dev))
        .collect::<Result<_>>()?;
    let layers: Vec<LeanLayer> = vars
        .iter()
        .map(|v| {
            Ok(LeanLayer::new(
                LeanLinear::new(v.as_tensor().clone(), None)?,
                Activation::Relu,
            ))
        })
        .collect::<Result<_>>()?;
    let x = Tensor::randn(0f32, 1.0, (batch, width), &dev)?;
    let y = Tensor::zeros(batch, DType::U32, &dev)?;
    let lean_head = |h: &Tensor| cross_entropy(h, &y);
    let direct_head = |h: &Tensor| cross_entropy_and_grad(h, &y, 1.0);
    // Warm-up: candle's first operations allocate lasting buffers of their own.
    drop(Sequential::new(&layers).lean(&x, &vars, lean_head)?);
    drop(Sequential::direct(&layers).backward(&x, &vars, direct_head)?);

    let (lean, lean_usage) = measure(|| Sequential::new(&layers).lean(&x, &vars, lean_head));
    drop(lean?);
    let (direct, direct_usage) =
        measure(|| Sequential::direct(&layers).backward(&x, &vars, direct_head));
    let direct = direct?;
    assert!(direct.grads.get(vars[0].as_tensor()).is_some());
    drop(direct);
    let act = (batch * width * 4) as isize;
    let weight = (width * width * 4) as isize;
    let (l, d) = (lean_usage.peak, direct_usage.peak);
    println!(
        "peaks in activation-sized tensors: lean {:.2}, direct {:.2}",
        l as f64 / act as f64,
        d as f64 / act as f64
    );
    // Measured: 13.02 against 11.52.
    assert!(
        d <= l - act,
        "direct {d} B, lean {l} B, one activation {act} B"
    );
    // The forward's outputs, then at most four activation-sized tensors at
    // once (the gradient handed in, the product's, the input's, and the
    // matrix-product kernel's packed copy of a transposed operand) and a
    // weight's gradient, and a few bytes of bookkeeping.
    assert!(
        d <= (depth as isize + 4) * act + weight + 4096,
        "direct {d} B against {} activations",
        depth + 4
    );
    Ok(())
}
