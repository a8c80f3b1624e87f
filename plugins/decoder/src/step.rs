//! The `decoder_step` cell's experiment: what `workbook run` executes and
//! what chapter 5's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use workbook_decoder::{
    model_config, recipes, state_bytes, train_measured, DecoderRecipe, Measured, Run, StepParams,
};
use workbook_models::llama::LlamaConfig;
use workbook_sdk::anyhow;
use workbook_sdk::output::Unit;
use workbook_sdk::{Category, Context, Table};

// notebook cell
/// Trains one variant (see `workbook_planner::decoder::train_measured`:
/// the model with f32 master weights, AdamW where the recipe puts its
/// state, `p.steps` steps on one batch of seeded tokens, in one measured
/// region with the closed-form prediction as its analytic figure).
pub fn train_variant(
    ctx: &mut Context,
    p: &StepParams,
    cfg: &LlamaConfig,
    recipe: DecoderRecipe,
) -> anyhow::Result<Measured> {
    let run = Run {
        config: cfg,
        batch: p.batch,
        seq: p.seq,
        steps: p.steps,
        seed: p.seed,
        lr: p.lr,
        recipe,
    };
    train_measured(ctx, &run)
}

// notebook cell
/// One variant's metrics and table row: its peak by category, the
/// prediction's error (the region's analytic figure) and the
/// 16-bytes-a-parameter formula's. Returns the peak.
pub fn report_variant(ctx: &mut Context, table: &mut Table, v: &Measured, params: u64) -> u64 {
    // What the device holds: an offloaded optimizer's host memory left out.
    let peak = v.report.device_total_peak_above_baseline();
    let predicted = v.report.analytic.unwrap_or(0);
    let at_peak = v.report.peak_by_category.saturating_sub(&v.report.baseline);
    let activations = at_peak.get(Category::Activations);
    let estimator = state_bytes(params);
    let n = &v.name;
    ctx.metric(format!("peak_{n}"), peak as f64);
    ctx.metric(format!("activations_{n}"), activations as f64);
    ctx.metric(format!("predicted_{n}"), predicted as f64);
    let error = |x: u64| (x as f64 - peak as f64) / peak as f64;
    ctx.metric(format!("prediction_error_{n}"), error(predicted).abs());
    ctx.metric(format!("estimator_error_{n}"), error(estimator));
    ctx.metric(
        format!("loss_first_{n}"),
        *v.losses.first().unwrap_or(&f64::NAN),
    );
    ctx.metric(
        format!("loss_last_{n}"),
        *v.losses.last().unwrap_or(&f64::NAN),
    );
    ctx.metric(format!("step_seconds_{n}"), v.seconds);
    table.row(vec![
        n.as_str().into(),
        peak.into(),
        at_peak.get(Category::Parameters).into(),
        at_peak.get(Category::OptimizerState).into(),
        at_peak.get(Category::Gradients).into(),
        activations.into(),
        predicted.into(),
        estimator.into(),
        v.seconds.into(),
    ]);
    peak
}

// notebook cell
/// The experiment: each compute dtype with each loss, the peak by category
/// beside the closed-form prediction and the model-state formula of the
/// public estimators; then what the fused loss saves.
pub fn decoder_step_experiment(ctx: &mut Context, p: StepParams) -> anyhow::Result<()> {
    let cfg = model_config(&p)?;
    let params = cfg.parameter_count();
    let logits = (p.batch * p.seq * cfg.vocab * 4) as u64;
    ctx.print(format!(
        "{} ({} blocks, hidden {}, {} / {} heads, vocabulary {}): {params} parameters; \
         batch {} x {} tokens",
        p.config, cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.vocab, p.batch, p.seq
    ));
    ctx.metric("params", params as f64);
    ctx.metric("state_bytes", state_bytes(params) as f64);
    ctx.metric("logits_bytes", logits as f64);
    ctx.metric("loss_uniform", (cfg.vocab as f64).ln());
    let mut table = Table::new(
        "The step's peak by category, measured, beside the predictions",
        &[
            ("variant", Unit::None),
            ("peak", Unit::Bytes),
            ("parameters", Unit::Bytes),
            ("AdamW", Unit::Bytes),
            ("gradients and the backward's", Unit::Bytes),
            ("saved by the forward", Unit::Bytes),
            ("predicted", Unit::Bytes),
            ("16 bytes a parameter", Unit::Bytes),
            ("seconds a step", Unit::Seconds),
        ],
    );
    let mut peaks = Vec::new();
    for recipe in recipes(&p)? {
        let v = train_variant(ctx, &p, &cfg, recipe)?;
        peaks.push((v.name.clone(), report_variant(ctx, &mut table, &v, params)));
    }
    // What the fused loss saves, where both ran on the whole batch.
    for dtype in &p.dtypes {
        let find = |n: String| peaks.iter().find(|(name, _)| *name == n).map(|(_, b)| *b);
        let (Some(plain), Some(fused)) = (
            find(format!("{dtype}_plain")),
            find(format!("{dtype}_fused")),
        ) else {
            continue;
        };
        let saved = plain.saturating_sub(fused);
        ctx.metric(format!("fused_saves_{dtype}"), saved as f64);
        ctx.metric(format!("logits_share_{dtype}"), saved as f64 / plain as f64);
        ctx.print(format!(
            "{dtype}: the fused loss saves {:.1} MB of the plain loss's {:.1} MB peak \
             (the logits alone are {:.1} MB in f32)",
            saved as f64 / 1e6,
            plain as f64 / 1e6,
            logits as f64 / 1e6
        ));
    }
    ctx.table(table);
    Ok(())
}
