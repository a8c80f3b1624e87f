//! One training step measured: model, optimizer state, batch, forward,
//! backward and AdamW update, by category.

use candle_core::{DType, Device};
use candle_lean_optim::LeanAdamW;
use candle_ledger::{Labeller, Ledger};
use candle_nn::{Optimizer, ParamsAdamW};
use workbook_models::{param_grads, Rng};
use workbook_sdk::meter::ByCategory;
use workbook_sdk::{anyhow, Category, Context, RegionReport};

use crate::corpus;
use crate::gpt::{Gpt, GptConfig};

/// What one measured training step gave.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// The region: peak, its split by category, the timeline.
    pub region: RegionReport,
    /// Bytes live at the end of the forward, above the region's start, by
    /// category.
    pub after_forward: ByCategory,
    /// Bytes the graph held at the end of the forward, from the ledger.
    pub ledger_bytes: u64,
    /// The largest tensor the graph held, in bytes.
    pub largest_held: u64,
    /// Parameters of the model.
    pub params: u64,
    /// The step's loss.
    pub loss: f32,
}

impl StepReport {
    /// The step's peak above the region's start: everything it allocated,
    /// model and optimizer state included.
    pub fn peak(&self) -> u64 {
        self.region.peak_above_baseline()
    }
}

/// Builds a model of `config` in `dtype` and trains it one step on a batch
/// of `batch` sequences of `config.seq` tokens with the toolkit's in-place
/// AdamW, all inside one region named `name`.
pub fn measured_step(
    ctx: &mut Context,
    name: String,
    config: GptConfig,
    dtype: DType,
    batch: usize,
    seed: u64,
) -> anyhow::Result<StepReport> {
    let device: Device = ctx.device().clone();
    let mut rng = Rng::seeded(seed);
    let mut region = ctx.region(name);
    let model = Gpt::new(config, dtype, &mut rng, &device)?;
    let params = model.param_count();
    let mut opt = Category::OptimizerState.scope(|| {
        LeanAdamW::new(
            model.vars(),
            ParamsAdamW {
                lr: 1e-3,
                ..Default::default()
            },
        )
    })?;
    let (x, y) = Category::Inputs
        .scope(|| corpus::batch(&mut rng, batch, config.seq, config.vocab, &device))?;
    region.mark("model, optimizer state, batch");
    // Notes what the toolkit's fused operations keep beside the graph (a
    // few bytes each), for the ledger.
    let labels = Labeller::unlabelled();
    let loss = Category::Activations.scope(|| model.loss(&x, &y, &labels))?;
    region.mark("after forward");
    let after_forward = region.current_above_baseline();
    let (ledger_bytes, largest_held) = Category::Other.scope(|| -> anyhow::Result<_> {
        let ledger = Ledger::of(&loss, &labels)?;
        let largest = ledger.held.iter().map(|h| h.bytes).max().unwrap_or(0);
        Ok((ledger.total_bytes(), largest))
    })?;
    let loss_value = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
    let grads = Category::Gradients.scope(|| -> anyhow::Result<_> {
        let store = loss.backward()?;
        Ok(param_grads(&store, &model.vars()))
    })?;
    drop((loss, labels));
    region.mark("after backward");
    Category::OptimizerState.scope(|| opt.step(&grads))?;
    region.mark("after AdamW step");
    drop((grads, opt, x, y, model));
    let region = ctx.end_region(region);
    Ok(StepReport {
        region,
        after_forward,
        ledger_bytes,
        largest_held,
        params,
        loss: loss_value,
    })
}
