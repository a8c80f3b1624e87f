//! Chapter 3's GPT trained a few steps with the toolkit's AdamW: the exact
//! peak of the whole run (model, optimizer state, batch, every step's
//! activations, gradients and temporaries, from a counting allocator) and
//! the median step time, as one JSON object. The same run as
//! `scripts/torch_gpt.py` makes in PyTorch, which `scripts/compare_gpt.py`
//! puts beside it.
//!
//! ```text
//! cargo run --release -p workbook-models --example gpt_step -- \
//!     [--recipe direct] [--dtype f32] [--batch 4] [--layers 4] [--hidden 256] \
//!     [--heads 4] [--seq 256] [--vocab 512] [--steps 5] [--pool joined]
//! ```
//!
//! Recipes: `direct` and `direct_tiled` (each stage's backward called with
//! no graph), `lean` and `tiled` (the lean layers under candle's backward),
//! `candle` (candle-nn's layers).
//!
//! `--pool joined` (the default) makes the thread that runs the steps one
//! of rayon's global pool's threads (`use_current_thread`), as OpenMP's
//! master thread is one of PyTorch's: each parallel operation then starts
//! on the calling thread, where with `--pool outside` it is handed to a
//! pool thread while the caller sleeps until it is done. Both pools have as
//! many threads (`RAYON_NUM_THREADS`, else one a core).

use std::num::NonZeroUsize;
use std::time::Instant;

use candle_core::{backprop::GradStore, DType, Device, Result, Tensor};
use candle_lean_optim::LeanAdamW;
use candle_ledger::Labeller;
use candle_nn::{Optimizer, ParamsAdamW};
use candle_toolkit_alloc_count::{measure, Counting};
use clap::{error::ErrorKind, CommandFactory, Parser, ValueEnum};
use workbook_models::{corpus, Gpt, GptConfig, Recipe, Rng};

#[global_allocator]
static ALLOC: Counting = Counting;

/// The run's settings, from the command line.
struct Args {
    recipe: Recipe,
    dtype: DType,
    batch: usize,
    steps: usize,
    config: GptConfig,
    joined: bool,
}

/// Chapter 3's GPT trained a few steps: the whole run's exact peak and the
/// median step time, as one JSON object.
#[derive(Parser)]
#[command(name = "gpt_step")]
struct Cli {
    /// How the step computes its gradients.
    #[arg(long, default_value = "direct", value_parser = recipe)]
    recipe: Recipe,
    /// The model's dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32", value_parser = dtype)]
    dtype: DType,
    /// Sequences a step.
    #[arg(long, default_value = "4")]
    batch: NonZeroUsize,
    /// Steps timed (after one untimed step in a run of its own).
    #[arg(long, default_value = "5")]
    steps: NonZeroUsize,
    /// Blocks.
    #[arg(long, default_value = "4")]
    layers: NonZeroUsize,
    /// Width of the residual stream; a multiple of `--heads`.
    #[arg(long, default_value = "256")]
    hidden: NonZeroUsize,
    /// Attention heads.
    #[arg(long, default_value = "4")]
    heads: NonZeroUsize,
    /// Tokens a sequence.
    #[arg(long, default_value = "256")]
    seq: NonZeroUsize,
    /// Vocabulary size.
    #[arg(long, default_value = "512")]
    vocab: NonZeroUsize,
    /// Where the calling thread runs the step's parallel operations.
    #[arg(long, value_enum, default_value_t = Pool::Joined)]
    pool: Pool,
}

/// A recipe by name.
fn recipe(name: &str) -> std::result::Result<Recipe, String> {
    Recipe::from_name(name)
        .ok_or_else(|| format!("one of {}", Recipe::ALL.map(Recipe::name).join(", ")))
}

/// A dtype by name.
fn dtype(name: &str) -> std::result::Result<DType, String> {
    workbook_sdk::parse_dtype(name).map_err(|e| e.to_string())
}

/// Where the calling thread runs the step's parallel operations.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Pool {
    /// The calling thread is one of rayon's pool, as OpenMP's master
    /// thread is one of PyTorch's.
    Joined,
    /// The calling thread hands each parallel operation to a pool thread
    /// and sleeps until it is done.
    Outside,
}

fn parse() -> Args {
    let cli = Cli::parse();
    if cli.hidden.get() % cli.heads.get() != 0 {
        Cli::command()
            .error(
                ErrorKind::ValueValidation,
                format!(
                    "--hidden {} is not a multiple of --heads {}",
                    cli.hidden, cli.heads
                ),
            )
            .exit();
    }
    let config = GptConfig {
        layers: cli.layers.get(),
        hidden: cli.hidden.get(),
        heads: cli.heads.get(),
        seq: cli.seq.get(),
        vocab: cli.vocab.get(),
        ..GptConfig::default()
    };
    Args {
        recipe: cli.recipe,
        dtype: cli.dtype,
        batch: cli.batch.get(),
        steps: cli.steps.get(),
        config: cli.recipe.apply(config),
        joined: cli.pool == Pool::Joined,
    }
}

/// One step's gradients.
fn grads(model: &Gpt, recipe: Recipe, x: &Tensor, y: &Tensor) -> Result<GradStore> {
    if recipe.direct() {
        let observer = candle_observe::NoObserver;
        return Ok(model.direct_loss(x, y, 1.0, &observer)?.grads);
    }
    let loss = model.loss(x, y, &Labeller::unlabelled())?;
    let all = loss.backward()?;
    let mut store = GradStore::default();
    for var in model.vars() {
        if let Some(g) = all.get(var.as_tensor()) {
            store.insert(var.as_tensor(), g.clone());
        }
    }
    Ok(store)
}

fn run(args: &Args) -> Result<Vec<f64>> {
    let device = Device::Cpu;
    let mut rng = Rng::seeded(11);
    let model = Gpt::new(args.config, args.dtype, &mut rng, &device)?;
    let params = ParamsAdamW {
        lr: 1e-3,
        ..Default::default()
    };
    let mut opt = LeanAdamW::new(model.vars(), params)?;
    let (x, y) = corpus::batch(
        &mut rng,
        args.batch,
        args.config.seq,
        args.config.vocab,
        &device,
    )?;
    let mut times = Vec::with_capacity(args.steps);
    for _ in 0..args.steps {
        let start = Instant::now();
        let g = grads(&model, args.recipe, &x, &y)?;
        opt.step(&g)?;
        drop(g);
        times.push(start.elapsed().as_secs_f64());
    }
    Ok(times)
}

fn main() {
    let args = parse();
    if args.joined {
        let pool = rayon::ThreadPoolBuilder::new().use_current_thread();
        if let Err(e) = pool.build_global() {
            eprintln!("error: cannot join rayon's pool: {e}");
            std::process::exit(1);
        }
    }
    // The thread pool and the matrix library's buffers are set up once per
    // process, as PyTorch's script warms up before it measures.
    if let Err(e) = run(&Args { steps: 1, ..args }) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    let (times, usage) = measure(|| run(&args));
    let times = match times {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let mut later: Vec<f64> = times.iter().skip(1).copied().collect();
    if later.is_empty() {
        later = times.clone();
    }
    later.sort_by(f64::total_cmp);
    let n = later.len();
    let median = (later[(n - 1) / 2] + later[n / 2]) / 2.0;
    let c = &args.config;
    let report = serde_json::json!({
        "recipe": args.recipe.name(),
        "config": {
            "layers": c.layers, "hidden": c.hidden, "heads": c.heads, "seq": c.seq,
            "vocab": c.vocab, "batch": args.batch, "dtype": format!("{:?}", args.dtype).to_lowercase(),
        },
        "pool": if args.joined { "joined" } else { "outside" },
        "peak": usage.peak,
        "first_time": times[0],
        "time": median,
        "times": times,
    });
    println!("{report:#}");
}
