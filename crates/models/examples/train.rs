//! Trains the small transformer twice on the same batches: plain f32 with
//! `candle_nn::AdamW`, and with the whole toolkit at once (f16 compute from
//! f32 master weights with a dynamic loss scaler, activation checkpointing,
//! uneven gradient accumulation and a lean or host-offloaded AdamW), and
//! compares the loss curves.
//!
//! ```text
//! cargo run --release -p workbook-models --example train -- [steps] [lean|host]
//! ```
//!
//! The two runs take different roundings from the first step on, so single
//! steps drift apart as training goes (by up to 0.16 at step 90 of 100,
//! both falling from 6.66 to about 0.8); the curves do not. The check: the
//! mean loss of every window of 10 steps is within 5% of plain training's.
//! Exits with an error if not.

use candle_accumulate::GradAccumulator;
use candle_amp::{GradScaler, MasterWeights, ScalerConfig, StepOutcome};
use candle_checkpoint::{ensure_grads, Sequential};
use candle_core::{DType, Device, Result, Var};
use candle_lean_optim::LeanAdamW;
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarMap};
use candle_offload::HostAdamW;
use clap::{Parser, ValueEnum};
use workbook_models::taped::{batch, Config, Transformer};

/// The largest relative difference allowed between the two runs' mean loss
/// over a window of [`WINDOW`] steps.
const TOLERANCE: f64 = 0.05;
const WINDOW: usize = 10;
const BATCH: usize = 10;
const MICRO: [usize; 3] = [4, 4, 2];
const SEQ: usize = 16;

/// Trains the small transformer plain and with the whole toolkit, and
/// compares the loss curves.
#[derive(Parser)]
struct Args {
    /// Steps of each run.
    #[arg(default_value_t = 40)]
    steps: usize,
    /// The toolkit run's optimizer.
    #[arg(value_enum, default_value_t = OptimizerChoice::Lean)]
    optimizer: OptimizerChoice,
}

/// The toolkit run's AdamW.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OptimizerChoice {
    /// The lean AdamW, on the device.
    Lean,
    /// The host-offloaded AdamW.
    Host,
}

fn copy_map(from: &VarMap) -> Result<VarMap> {
    let to = VarMap::new();
    {
        let src = from.data().lock().unwrap();
        let mut dst = to.data().lock().unwrap();
        for (name, var) in src.iter() {
            // A copy: `Var::from_tensor` of a variable would share its storage.
            dst.insert(name.clone(), Var::from_tensor(&var.as_detached_tensor())?);
        }
    }
    Ok(to)
}

fn main() -> Result<()> {
    let Args { steps, optimizer } = Args::parse();
    let host = optimizer == OptimizerChoice::Host;
    let dev = Device::Cpu;
    let cfg = Config {
        depth: 4,
        tiled: Some((8, 8)),
        ..Config::tiny()
    };
    let params = ParamsAdamW {
        lr: 3e-3,
        ..Default::default()
    };

    let plain_map = VarMap::new();
    let plain = Transformer::seeded(&cfg, 7, &plain_map, &dev)?;
    let mut plain_opt = AdamW::new(plain_map.all_vars(), params.clone())?;

    let masters = MasterWeights::from_varmap(copy_map(&plain_map)?, DType::F16);
    let vars = masters.vars();
    let mut lean = LeanAdamW::new(vars.clone(), params.clone())?;
    let mut offload = HostAdamW::new(vars.clone(), params)?;
    let mut scaler = GradScaler::new(ScalerConfig::default())?;

    let mut worst_step = 0f64;
    let mut curves: Vec<(f64, f64)> = Vec::with_capacity(steps);
    for step in 0..steps {
        let (ids, targets) = batch(step as u64, BATCH, SEQ, cfg.vocab, &dev)?;
        let plain_loss = plain.forward_loss(&ids, &targets)?;
        plain_opt.backward_step(&plain_loss)?;
        let plain_loss = f64::from(plain_loss.to_scalar::<f32>()?);

        // The model is rebuilt from the masters each step: fresh f16 casts.
        let model = Transformer::new(&cfg, masters.var_builder(&dev))?;
        let mut acc = GradAccumulator::new(vars.clone(), BATCH);
        let mut loss = 0f64;
        let mut start = 0;
        for rows in MICRO {
            let (x, y) = (ids.narrow(0, start, rows)?, targets.narrow(0, start, rows)?);
            start += rows;
            let weight = rows as f64 / BATCH as f64;
            let out = Sequential::new(model.layers())
                .segments(2)
                .backward(&x, &vars, |h| scaler.scale(&(model.loss(h, &y)? * weight)?))?;
            loss += f64::from(out.loss.to_scalar::<f32>()?) / scaler.scale_factor();
            acc.add_weighted(&out.grads, rows)?;
        }
        let mut grads = acc.take()?;
        ensure_grads(masters.varmap(), &grads)?;
        let outcome = if host {
            scaler.step(&mut offload, &mut grads, &vars)?
        } else {
            scaler.step(&mut lean, &mut grads, &vars)?
        };
        scaler.update()?;
        let skipped = if outcome == StepOutcome::Skipped {
            " (skipped: inf/NaN)"
        } else {
            ""
        };
        println!(
            "step {step:3}: plain {plain_loss:.4}  toolkit {loss:.4}  scale {}{skipped}",
            scaler.scale_factor()
        );
        worst_step = worst_step.max((loss - plain_loss).abs());
        curves.push((plain_loss, loss));
    }
    let mut worst = 0f64;
    for (i, w) in curves.chunks(WINDOW).enumerate() {
        let plain = w.iter().map(|p| p.0).sum::<f64>() / w.len() as f64;
        let toolkit = w.iter().map(|p| p.1).sum::<f64>() / w.len() as f64;
        let rel = (toolkit - plain).abs() / plain;
        println!(
            "steps {:3}..{:3}: mean loss plain {plain:.4}, toolkit {toolkit:.4} ({:+.1}%)",
            i * WINDOW,
            i * WINDOW + w.len(),
            100.0 * (toolkit - plain) / plain
        );
        worst = worst.max(rel);
    }
    if let (Some(first), Some(last)) = (curves.first(), curves.last()) {
        println!(
            "loss {:.4} -> {:.4} plain, {:.4} -> {:.4} toolkit; largest step difference {worst_step:.4}; \
             largest window difference {:.1}% (tolerance {:.0}%)",
            first.0,
            last.0,
            first.1,
            last.1,
            100.0 * worst,
            100.0 * TOLERANCE
        );
    }
    if worst > TOLERANCE {
        candle_core::bail!(
            "the toolkit's loss curve left the plain one: a window's mean differs by {:.1}%",
            100.0 * worst
        );
    }
    Ok(())
}
