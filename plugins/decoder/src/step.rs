//! The `decoder_step` cell's experiment: what `workbook run` executes and
//! what chapter 5's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use candle_accumulate::{micro_batches, GradAccumulator};
use workbook_decoder::{
    model_config, predict, recipes, state_bytes, DecoderRecipe, StepParams, Trainer,
};
use workbook_models::llama::{Attention, Layers, Llama, LlamaConfig, StepOptions};
use workbook_models::Rng;
use workbook_sdk::anyhow;
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{DType, Tensor};
use workbook_sdk::candle_nn::ParamsAdamW;
use workbook_sdk::median;
use workbook_sdk::observe::Tags;
use workbook_sdk::output::Unit;
use workbook_sdk::{Category, Context, RegionReport, Table};

// notebook cell
/// What one variant (a compute dtype, a loss, checkpointing or not,
/// micro-batches, where AdamW's state lives) measured.
pub struct Variant {
    /// Its name: `f32_fused_checkpointed_m4_zero2` (see
    /// `DecoderRecipe::name`).
    pub name: String,
    /// The region: the peak, and its split by category.
    pub report: RegionReport,
    /// The loss at each step.
    pub losses: Vec<f64>,
    /// Median seconds per step.
    pub seconds: f64,
}

// notebook cell
/// Builds the model with f32 master weights and AdamW, and trains it
/// `p.steps` steps on one batch of seeded tokens (so the loss must fall),
/// all inside one measured region.
pub fn train_variant(
    ctx: &mut Context,
    p: &StepParams,
    cfg: &LlamaConfig,
    recipe: &DecoderRecipe,
) -> anyhow::Result<Variant> {
    let (device, name) = (ctx.device().clone(), recipe.name());
    let mut rng = Rng::seeded(p.seed);
    let mut region = ctx.region(name.clone());
    let model = Category::Parameters.scope(|| Llama::new(cfg, DType::F32, &mut rng, &device))?;
    let adamw = ParamsAdamW {
        lr: p.lr,
        ..Default::default()
    };
    let mut opt = Trainer::new(&model, adamw, recipe.sharing)?;
    // A rank's share of the batch (the whole batch on one device).
    let batch = p.batch / recipe.sharing.ranks();
    let (x, y) = Category::Inputs.scope(|| -> anyhow::Result<_> {
        let x = rng.labels(batch * p.seq, cfg.vocab as u32, &device)?;
        let y = rng.labels(batch * p.seq, cfg.vocab as u32, &device)?;
        Ok((x.reshape((batch, p.seq))?, y.reshape((batch, p.seq))?))
    })?;
    region.mark("model, optimizer and batch");
    let mut losses = Vec::with_capacity(p.steps);
    let mut times = Vec::with_capacity(p.steps);
    for step in 0..p.steps {
        ctx.progress(&format!("{name}: step {} of {}", step + 1, p.steps));
        let start = std::time::Instant::now();
        let loss = train_step(&model, &x, &y, recipe, &mut opt)?;
        losses.push(loss);
        times.push(start.elapsed().as_secs_f64());
    }
    region.set_analytic(predict(cfg, p.batch, p.seq, recipe).total());
    let report = ctx.end_region(region);
    Ok(Variant {
        name,
        report,
        losses,
        seconds: median(times),
    })
}

// notebook cell
/// One training step; returns its mean loss. The batch goes in
/// `recipe.micro_batches` equal parts, each back-propagated through
/// candle's graph or checkpointed block by block. Their gradients are
/// summed with each part's share of the rows and handed to the optimizer;
/// for ZeRO-2, checkpointed, each layer's are handed over as they are made
/// and summed there, in this rank's blocks.
pub fn train_step(
    model: &Llama,
    x: &Tensor,
    y: &Tensor,
    recipe: &DecoderRecipe,
    opt: &mut Trainer,
) -> anyhow::Result<f64> {
    let options = StepOptions {
        layers: Layers::Lean,
        compute: recipe.compute,
        attention: Attention::Tiled,
        loss: recipe.loss,
    };
    let batch = x.dim(0)?;
    let parts = recipe.micro_batches;
    anyhow::ensure!(
        parts > 0 && batch.is_multiple_of(parts),
        "{parts} micro-batches do not split {batch} sequences evenly"
    );
    let rows = batch / parts;
    let weight = rows as f64 / batch as f64;
    let parts = micro_batches(x, rows)?
        .into_iter()
        .zip(micro_batches(y, rows)?);
    let mut loss = 0.0;
    if recipe.sharing.takes_each_layer(recipe.checkpoint) {
        for (x, y) in parts {
            let take = |var: &_, g: _| opt.take(var, &g);
            let l = model.checkpointed_backward_with(&x, &y, &options, weight, take, &Tags)?;
            loss += l.to_scalar::<f32>()? as f64;
        }
        opt.step_taken()?;
        return Ok(loss);
    }
    let mut sum = GradAccumulator::new(model.vars(), batch).with_observer(Tags);
    for (x, y) in parts {
        if recipe.checkpoint {
            let c = model.checkpointed_backward(&x, &y, &options, weight, &Tags)?;
            loss += c.loss.to_scalar::<f32>()? as f64;
            sum.add_weighted(&c.grads, rows)?;
        } else {
            let l = Category::Activations.scope(|| model.loss(&x, &y, &options))?;
            sum.backward(&l, rows)?;
            loss += weight * l.to_scalar::<f32>()? as f64;
        }
    }
    let grads: GradStore = sum.take()?;
    opt.step(&grads)?;
    Ok(loss)
}

// notebook cell
/// One variant's metrics and table row: its peak by category, the
/// prediction's error (the region's analytic figure) and the
/// 16-bytes-a-parameter formula's. Returns the peak.
pub fn report_variant(ctx: &mut Context, table: &mut Table, v: &Variant, params: u64) -> u64 {
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
        let v = train_variant(ctx, &p, &cfg, &recipe)?;
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
