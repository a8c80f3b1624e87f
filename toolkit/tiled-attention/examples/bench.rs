//! The tiled attention's forward and backward on the CPU: median time,
//! GFLOP/s, their share of this machine's matrix-product rate, and the peak
//! of the bytes allocated above the start.
//!
//! ```text
//! cargo run --release -p candle-tiled-attention --example bench -- \
//!     [--n 4096] [--heads 4] [--dim 64] [--causal] [--block QxK] [--repeats 5]
//! RAYON_NUM_THREADS=1 cargo run --release ...   # one thread
//! ```
//!
//! Blocks default to `FlashConfig::for_length` (PyTorch's choice). The
//! rate is counted as the five block products of FlashAttention-2 and
//! the forward's two: `14 n^2 d heads` floating-point operations (half that
//! when causal). The reference rate is candle's own f32 product of two
//! 2048 x 2048 matrices on all threads.

use std::num::NonZeroUsize;
use std::time::Instant;

use candle_core::{Device, Result, Tensor};
use candle_tiled_attention::{flash_forward, FlashConfig};
use candle_toolkit_alloc_count::{measure, Counting};
use clap::Parser;

#[global_allocator]
static ALLOC: Counting = Counting;

/// The tiled attention's forward and backward: median time, rate and peak.
#[derive(Parser)]
struct Args {
    /// Tokens.
    #[arg(long, default_value = "4096")]
    n: NonZeroUsize,
    /// Heads.
    #[arg(long, default_value = "4")]
    heads: NonZeroUsize,
    /// Width of a head.
    #[arg(long, default_value = "64")]
    dim: NonZeroUsize,
    /// A causal mask.
    #[arg(long)]
    causal: bool,
    /// Query and key block rows, as `64x512` (default: PyTorch's choice).
    #[arg(long, value_parser = block)]
    block: Option<(usize, usize)>,
    /// Timed runs; the median is reported.
    #[arg(long, default_value = "5")]
    repeats: NonZeroUsize,
}

/// `QxK`, two whole numbers above zero.
fn block(value: &str) -> std::result::Result<(usize, usize), String> {
    let rows = |s: &str| s.parse::<usize>().ok().filter(|&n| n > 0);
    value
        .split_once('x')
        .and_then(|(q, k)| Some((rows(q)?, rows(k)?)))
        .ok_or_else(|| "give QxK, as 64x512".into())
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (n, heads, dim) = (args.n.get(), args.heads.get(), args.dim.get());
    let dev = Device::Cpu;
    let threads = rayon::current_num_threads();

    let m = Tensor::randn(0f32, 1.0, (2048, 2048), &dev)?;
    let gemm: Vec<f64> = (0..4)
        .map(|_| {
            let t = Instant::now();
            m.matmul(&m).map(|_| t.elapsed().as_secs_f64())
        })
        .collect::<Result<_>>()?;
    let gemm_rate = 2.0 * 2048f64.powi(3) / median(gemm[1..].to_vec()) / 1e9;

    let shape = (1, heads, n, dim);
    let (q, k, v, d_out) = (
        Tensor::randn(0f32, 1.0, shape, &dev)?,
        Tensor::randn(0f32, 1.0, shape, &dev)?,
        Tensor::randn(0f32, 1.0, shape, &dev)?,
        Tensor::randn(0f32, 1.0, shape, &dev)?,
    );
    let mut cfg = FlashConfig::for_length(args.causal, n);
    if let Some((q, k)) = args.block {
        (cfg.q_block, cfg.k_block) = (q, k);
    }
    let step = || -> Result<()> {
        let fwd = flash_forward(&q, &k, &v, &cfg)?;
        fwd.backward(&q, &k, &v, &d_out).map(drop)
    };
    step()?; // warm-up: thread pool, packing buffers
    let mut times = Vec::new();
    let mut peak = 0;
    for _ in 0..args.repeats.get() {
        let t = Instant::now();
        let (r, usage) = measure(step);
        times.push(t.elapsed().as_secs_f64());
        r?;
        peak = peak.max(usage.peak);
    }
    let t = median(times);
    let flops =
        14.0 * (n as f64).powi(2) * (dim * heads) as f64 / if args.causal { 2.0 } else { 1.0 };
    let rate = flops / t / 1e9;
    println!(
        "n {} heads {} dim {} causal {} blocks {}x{} threads {threads}: \
         forward+backward median {t:.3} s over {} runs, {rate:.1} GFLOP/s, \
         {:.0}% of the 2048^3 product's {gemm_rate:.1} GFLOP/s, peak {:.2} MiB above the inputs",
        n,
        heads,
        dim,
        args.causal,
        cfg.q_block,
        cfg.k_block,
        args.repeats.get(),
        100.0 * rate / gemm_rate,
        peak as f64 / (1u64 << 20) as f64,
    );
    Ok(())
}
