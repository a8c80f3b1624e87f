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

use std::time::Instant;

use candle_core::{backprop::GradStore, DType, Device, Result, Tensor};
use candle_lean_optim::LeanAdamW;
use candle_ledger::Labeller;
use candle_nn::{Optimizer, ParamsAdamW};
use candle_toolkit_alloc_count::{measure, Counting};
use workbook_models::{corpus, Gpt, GptConfig, Recipe, Rng};

#[global_allocator]
static ALLOC: Counting = Counting;

struct Args {
    recipe: Recipe,
    dtype: DType,
    batch: usize,
    steps: usize,
    config: GptConfig,
    joined: bool,
}

fn parse() -> std::result::Result<Args, String> {
    let mut config = GptConfig::default();
    let (mut recipe, mut dtype, mut batch, mut steps) = (Recipe::Direct, DType::F32, 4, 5);
    let mut joined = true;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || -> std::result::Result<usize, String> {
            match value.parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!(
                    "{flag} takes a positive whole number, got {value:?}"
                )),
            }
        };
        match flag.as_str() {
            "--recipe" => {
                recipe = Recipe::ALL
                    .into_iter()
                    .find(|r| r.name() == value)
                    .ok_or_else(|| {
                        let names: Vec<_> = Recipe::ALL.iter().map(|r| r.name()).collect();
                        format!("--recipe {value:?}: one of {}", names.join(", "))
                    })?
            }
            "--dtype" => {
                dtype = match value.as_str() {
                    "f32" => DType::F32,
                    "bf16" => DType::BF16,
                    "f16" => DType::F16,
                    _ => return Err(format!("--dtype {value:?}: one of f32, bf16, f16")),
                }
            }
            "--pool" => {
                joined = match value.as_str() {
                    "joined" => true,
                    "outside" => false,
                    _ => return Err(format!("--pool {value:?}: one of joined, outside")),
                }
            }
            "--batch" => batch = number()?,
            "--steps" => steps = number()?,
            "--layers" => config.layers = number()?,
            "--hidden" => config.hidden = number()?,
            "--heads" => config.heads = number()?,
            "--seq" => config.seq = number()?,
            "--vocab" => config.vocab = number()?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if config.hidden % config.heads != 0 {
        return Err(format!(
            "--hidden {} is not a multiple of --heads {}",
            config.hidden, config.heads
        ));
    }
    Ok(Args {
        recipe,
        dtype,
        batch,
        steps,
        config: recipe.apply(config),
        joined,
    })
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
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
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
