//! The `decoder_step` cell's experiment: what `workbook run` executes and
//! what chapter 5's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use candle_lean_optim::LeanAdamW;
use workbook_decoder::{model_config, predict_peak, state_bytes, StepParams};
use workbook_models::llama::{Attention, Layers, Llama, LlamaConfig, Loss, StepOptions};
use workbook_models::Rng;
use workbook_sdk::anyhow;
use workbook_sdk::candle::DType;
use workbook_sdk::candle_nn::{Optimizer, ParamsAdamW};
use workbook_sdk::observe::Tags;
use workbook_sdk::output::Unit;
use workbook_sdk::{median, parse_dtype};
use workbook_sdk::{Category, Context, RegionReport, Table};

// notebook cell
/// What one variant (a compute dtype and a loss) measured.
pub struct Variant {
    /// The compute dtype's name and the loss's.
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
    options: StepOptions,
    name: String,
) -> anyhow::Result<Variant> {
    let device = ctx.device().clone();
    let mut rng = Rng::seeded(p.seed);
    let mut region = ctx.region(name.clone());
    let model = Category::Parameters.scope(|| Llama::new(cfg, DType::F32, &mut rng, &device))?;
    let adamw = ParamsAdamW {
        lr: p.lr,
        ..Default::default()
    };
    let mut opt = LeanAdamW::with_observer(model.vars(), adamw, Tags)?;
    let (x, y) = Category::Inputs.scope(|| -> anyhow::Result<_> {
        let x = rng.labels(p.batch * p.seq, cfg.vocab as u32, &device)?;
        let y = rng.labels(p.batch * p.seq, cfg.vocab as u32, &device)?;
        Ok((x.reshape((p.batch, p.seq))?, y.reshape((p.batch, p.seq))?))
    })?;
    region.mark("model, optimizer and batch");
    let mut losses = Vec::with_capacity(p.steps);
    let mut times = Vec::with_capacity(p.steps);
    for step in 0..p.steps {
        ctx.progress(&format!("{name}: step {} of {}", step + 1, p.steps));
        let start = std::time::Instant::now();
        let loss = Category::Activations.scope(|| model.loss(&x, &y, &options))?;
        region.mark("after forward");
        let grads = Category::Gradients.scope(|| loss.backward())?;
        region.mark("after backward");
        opt.step(&grads)?;
        drop(grads);
        losses.push(loss.to_scalar::<f32>()? as f64);
        times.push(start.elapsed().as_secs_f64());
    }
    region.set_analytic(predict_peak(cfg, p.batch, p.seq, options.compute, options.loss).total());
    let report = ctx.end_region(region);
    Ok(Variant {
        name,
        report,
        losses,
        seconds: median(times),
    })
}

// notebook cell
/// One variant's metrics and table row: its peak by category, the
/// prediction's error (the region's analytic figure) and the
/// 16-bytes-a-parameter formula's. Returns the peak.
pub fn report_variant(ctx: &mut Context, table: &mut Table, v: &Variant, params: u64) -> u64 {
    let peak = v.report.peak_above_baseline();
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
    for dtype in &p.dtypes {
        let mut peaks = Vec::new();
        for loss in &p.losses {
            let options = StepOptions {
                layers: Layers::Lean,
                compute: parse_dtype(dtype)?,
                attention: Attention::Tiled,
                loss: if loss == "fused" {
                    Loss::Fused
                } else {
                    Loss::Plain
                },
            };
            let v = train_variant(ctx, &p, &cfg, options, format!("{dtype}_{loss}"))?;
            let peak = report_variant(ctx, &mut table, &v, params);
            peaks.push((loss.clone(), peak));
        }
        let find = |l: &str| peaks.iter().find(|(n, _)| n == l).map(|(_, b)| *b);
        if let (Some(plain), Some(fused)) = (find("plain"), find("fused")) {
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
    }
    ctx.table(table);
    Ok(())
}
