//! One forward and backward of a stack of Linear + activation layers, on
//! candle-nn's layers under candle's backward and on the toolkit's lean path
//! (fused layers, one-operation cross-entropy, `Sequential::lean`): median wall
//! time of each.
//!
//! ```text
//! cargo run --release -p workbook-models --example lean_step -- \
//!     [--width 1024] [--depth 16] [--batch 1024] [--relu] [--repeats 5] [--lean-only]
//! ```

use std::num::NonZeroUsize;
use std::time::Instant;

use candle_checkpoint::Sequential;
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_lean_nn::{Activation, LeanLinear};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;

/// One forward and backward of a stack of Linear + activation layers, on
/// candle-nn's layers and on the toolkit's lean path: median wall time.
#[derive(Parser)]
struct Args {
    /// Features of every layer.
    #[arg(long, default_value = "1024")]
    width: NonZeroUsize,
    /// Layers.
    #[arg(long, default_value = "16")]
    depth: NonZeroUsize,
    /// Rows of the batch.
    #[arg(long, default_value = "1024")]
    batch: NonZeroUsize,
    /// ReLU between the layers (GELU otherwise).
    #[arg(long)]
    relu: bool,
    /// Timed runs of each step; the median is reported.
    #[arg(long, default_value = "5")]
    repeats: NonZeroUsize,
    /// Only the lean path.
    #[arg(long)]
    lean_only: bool,
}

struct Fused(LeanLinear, Activation);
impl Module for Fused {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward_act(x, self.1)
    }
}

fn main() -> Result<()> {
    let Args {
        width,
        depth,
        batch,
        relu,
        repeats,
        lean_only,
    } = Args::parse();
    let (width, depth, batch, repeats) = (width.get(), depth.get(), batch.get(), repeats.get());
    let dev = Device::Cpu;
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &dev);
    let linears: Vec<candle_nn::Linear> = (0..depth)
        .map(|i| candle_nn::linear(width, width, vb.pp(i)))
        .collect::<Result<_>>()?;
    let vars = map.all_vars();
    let act = if relu {
        Activation::Relu
    } else {
        Activation::Gelu
    };
    let fused: Vec<Fused> = linears
        .iter()
        .map(|l| Fused(LeanLinear::from(l), act))
        .collect();
    let x = Tensor::randn(0f32, 1.0, (batch, width), &dev)?;
    let labels: Vec<u32> = (0..batch).map(|i| (i * 7919 % width) as u32).collect();
    let y = Tensor::from_vec(labels, batch, &dev)?;
    let candle_step = || -> Result<()> {
        let mut h = x.clone();
        for l in &linears {
            h = l.forward(&h)?;
            h = if relu { h.relu()? } else { h.gelu()? };
        }
        candle_nn::loss::cross_entropy(&h, &y)?.backward().map(drop)
    };
    let lean_step = || -> Result<()> {
        let head = |h: &Tensor| candle_lean_nn::cross_entropy(h, &y);
        Sequential::new(&fused).lean(&x, &vars, head).map(drop)
    };
    let steps = [
        ("candle-nn", &candle_step as &dyn Fn() -> Result<()>),
        ("lean", &lean_step),
    ];
    for (name, step) in steps.into_iter().skip(usize::from(lean_only)) {
        step()?;
        let times = (0..repeats)
            .map(|_| {
                let t = Instant::now();
                step().map(|_| t.elapsed().as_secs_f64())
            })
            .collect::<Result<Vec<_>>>()?;
        println!(
            "{name}: {depth} x Linear({width}) + {}, batch {batch}: forward + backward median {:.3} s over {repeats} runs",
            if relu { "ReLU" } else { "GELU" },
            workbook_sdk::median(times)
        );
    }
    Ok(())
}
