//! A decoder plan run on this machine: the option chosen, trained a few
//! steps under the meter, its device peak set beside the prediction.

use workbook_models::llama::LlamaConfig;
use workbook_sdk::{anyhow, Context};

use super::predict::DecoderRecipe;
use super::train::{train_measured, Run};
use crate::plan::Verification;

/// Trains `recipe` for `cfg` at `batch` x `seq` tokens for `steps` steps
/// in `ctx` (seeded weights and tokens), and sets the device's measured
/// peak beside the prediction and `budget`. A ZeRO recipe runs rank 0, its
/// peers rehearsed in this process, so the peak is a real rank's.
pub fn verify(
    ctx: &mut Context,
    cfg: &LlamaConfig,
    (batch, seq): (usize, usize),
    recipe: DecoderRecipe,
    budget: u64,
    steps: usize,
) -> anyhow::Result<Verification> {
    let run = Run {
        config: cfg,
        batch,
        seq,
        steps: steps.max(1),
        seed: 5,
        lr: 1e-3,
        recipe,
    };
    // gemm's packing buffers are each thread's from its first product on:
    // made before the measurement, as a chapter's cells have them.
    workbook_sdk::device::warm_up(ctx.device())?;
    let measured = train_measured(ctx, &run)?;
    Ok(Verification {
        peak: measured.report.device_total_peak_above_baseline(),
        predicted: measured.report.analytic.unwrap_or(0),
        budget,
        seconds: measured.seconds,
        ranks: 1,
    })
}
