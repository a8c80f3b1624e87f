//! What the lean backward saves over candle's own, counted by the
//! allocator: one test in its own binary, so no other test's allocations
//! are counted.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};

use candle_checkpoint::lean_backward;
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_observe::NoObserver;

struct Counting;
static NOW: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            let now = NOW.fetch_add(layout.size() as isize, Relaxed) + layout.size() as isize;
            PEAK.fetch_max(now, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        NOW.fetch_sub(layout.size() as isize, Relaxed);
        System.dealloc(p, layout);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The most bytes allocated at once while `f` runs, above its start.
fn peak<R>(f: impl FnOnce() -> R) -> (R, isize) {
    let start = NOW.load(Relaxed);
    PEAK.store(start, Relaxed);
    let r = f();
    (r, PEAK.load(Relaxed) - start)
}

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

    let (plain, plain_peak) = peak(|| -> Result<_> {
        head(&layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))?)?.backward()
    });
    drop(plain?);
    let (lean, lean_peak) = peak(|| lean_backward(&layers, &x, &vars, head, &NoObserver));
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
