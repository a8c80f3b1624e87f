//! The matrix products of chapter 3's GPT step, alone: for each dense layer
//! of a block and the head, its forward `x W^T`, its input's gradient
//! `g W` and its weight's gradient `g^T x`, each timed as candle's f32
//! `matmul` on the operands' layouts the toolkit's lean layers pass it (the
//! weight `(out, in)` as candle-nn stores it, so the forward's right operand
//! is a transposed view). One JSON object: each product's median time and
//! rate, and their sum over one step. `scripts/compare_products.py` puts
//! PyTorch's `matmul` on the same shapes beside it: most of a step's time
//! is these products, so the two libraries' products set how close the
//! two steps' times can come. (The attention's own products run inside its
//! kernels and are not among them.)
//!
//! ```text
//! cargo run --release -p workbook-models --example gpt_products -- \
//!     [--batch 4] [--layers 4] [--hidden 256] [--seq 256] [--vocab 512] [--repeats 30]
//! ```

use std::num::NonZeroUsize;
use std::time::Instant;

use candle_core::{Device, Result, Tensor};
use clap::Parser;

/// The products of chapter 3's GPT step, alone: each one's median time
/// and rate, and their sum over one step, as one JSON object.
#[derive(Parser)]
struct Args {
    /// Sequences a step.
    #[arg(long, default_value = "4")]
    batch: NonZeroUsize,
    /// Blocks.
    #[arg(long, default_value = "4")]
    layers: NonZeroUsize,
    /// Width of the residual stream.
    #[arg(long, default_value = "256")]
    hidden: NonZeroUsize,
    /// Tokens a sequence.
    #[arg(long, default_value = "256")]
    seq: NonZeroUsize,
    /// Vocabulary size.
    #[arg(long, default_value = "512")]
    vocab: NonZeroUsize,
    /// Timings of each product; the median is reported.
    #[arg(long, default_value = "30")]
    repeats: NonZeroUsize,
}

/// The median of `repeats` timings of `a b`, after one untimed product.
fn time(a: &Tensor, b: &Tensor, repeats: usize) -> Result<f64> {
    drop(a.matmul(b)?);
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        drop(a.matmul(b)?);
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn run(a: &Args) -> Result<serde_json::Value> {
    let dev = Device::Cpu;
    let (rows, h) = (a.batch.get() * a.seq.get(), a.hidden.get());
    let blocks = a.layers.get();
    // (layer, inputs, outputs, times per step).
    let layers = [
        ("qkv", h, 3 * h, blocks),
        ("proj", h, h, blocks),
        ("fc", h, 4 * h, blocks),
        ("fc2", 4 * h, h, blocks),
        ("head", h, a.vocab.get(), 1),
    ];
    // One product of each size first: the thread pool and gemm's packing
    // buffers are made before anything is timed.
    for &(_, inputs, outputs, _) in &layers {
        let x = Tensor::zeros((rows, inputs), candle_core::DType::F32, &dev)?;
        let w = Tensor::zeros((outputs, inputs), candle_core::DType::F32, &dev)?;
        drop(x.matmul(&w.t()?)?);
    }
    let mut products = Vec::new();
    let mut step = 0.0;
    for (layer, inputs, outputs, count) in layers {
        let x = Tensor::randn(0f32, 1.0, (rows, inputs), &dev)?;
        let w = Tensor::randn(0f32, 1.0, (outputs, inputs), &dev)?;
        let g = Tensor::randn(0f32, 1.0, (rows, outputs), &dev)?;
        let cases = [
            ("forward x W^T", x.clone(), w.t()?),
            ("input grad g W", g.clone(), w.clone()),
            ("weight grad g^T x", g.t()?, x.clone()),
        ];
        for (what, lhs, rhs) in cases {
            let seconds = time(&lhs, &rhs, a.repeats.get())?;
            let (m, k) = lhs.dims2()?;
            let n = rhs.dim(1)?;
            step += seconds * count as f64;
            products.push(serde_json::json!({
                "layer": layer,
                "product": what,
                "m": m, "k": k, "n": n,
                "count": count,
                "seconds": seconds,
                "gflops": 2.0 * (m * k * n) as f64 / seconds / 1e9,
            }));
        }
    }
    Ok(serde_json::json!({
        "threads": candle_core::utils::get_num_threads(),
        "products": products,
        "step_seconds": step,
    }))
}

fn main() {
    let args = Args::parse();
    match run(&args) {
        Ok(v) => println!("{v:#}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
