//! What the graph holds after the forward of a stack of Linear + activation
//! layers, candle-nn's against the fused layer, counted by an allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_lean_nn::{Activation, LeanLinear};

struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const DEPTH: usize = 8;
const WIDTH: usize = 256;
const BATCH: usize = 512;

/// Bytes alive once the forward is done, in layer outputs (one test in
/// this file, so nothing else allocates meanwhile).
fn held(forward: impl Fn(&Tensor) -> Result<Tensor>, x: &Tensor) -> Result<f64> {
    let before = LIVE.load(Ordering::SeqCst);
    let y = forward(x)?;
    let after = LIVE.load(Ordering::SeqCst);
    drop(y);
    let output = (BATCH * WIDTH * 4) as f64;
    Ok((after - before) as f64 / output)
}

#[test]
fn the_fused_layer_keeps_a_third_of_candle_nns_activations_for_relu() -> Result<()> {
    let dev = Device::Cpu;
    let layers: Vec<candle_nn::Linear> = (0..DEPTH)
        .map(|_| {
            let w = Var::from_tensor(&Tensor::randn(0f32, 0.05, (WIDTH, WIDTH), &dev)?)?;
            let b = Var::from_tensor(&Tensor::zeros(WIDTH, DType::F32, &dev)?)?;
            Ok(candle_nn::Linear::new(
                w.as_tensor().clone(),
                Some(b.as_tensor().clone()),
            ))
        })
        .collect::<Result<_>>()?;
    let lean: Vec<LeanLinear> = layers.iter().map(LeanLinear::from).collect();
    let x = Tensor::randn(0f32, 1.0, (BATCH, WIDTH), &dev)?;
    for (act, name) in [(Activation::Relu, "relu"), (Activation::Gelu, "gelu")] {
        let plain = held(
            |x| {
                layers.iter().try_fold(x.clone(), |h, l| {
                    let y = l.forward(&h)?;
                    if act == Activation::Relu {
                        y.relu()
                    } else {
                        y.gelu()
                    }
                })
            },
            &x,
        )?;
        let fused = held(
            |x| {
                lean.iter()
                    .try_fold(x.clone(), |h, l| l.forward_act(&h, act))
            },
            &x,
        )?;
        println!(
            "{name}: {DEPTH} layers hold {plain:.2} layer outputs with candle-nn, {fused:.2} fused"
        );
        match act {
            // candle-nn: product, bias sum and output per layer; fused: the output.
            Activation::Relu => {
                assert!((plain - 3.0 * DEPTH as f64).abs() < 0.5, "{plain}");
                assert!((fused - DEPTH as f64).abs() < 0.5, "{fused}");
            }
            // GELU's input is kept too: two per layer.
            _ => {
                assert!((plain - 3.0 * DEPTH as f64).abs() < 0.5, "{plain}");
                assert!((fused - 2.0 * DEPTH as f64).abs() < 0.5, "{fused}");
            }
        }
    }
    Ok(())
}
