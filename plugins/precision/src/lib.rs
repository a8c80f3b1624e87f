//! The precision cell: bytes per dtype, mixed-precision training with f32
//! master weights, and a dynamic loss scaler for f16.
//!
//! The techniques are the toolkit's: `candle_amp::GradScaler`, with
//! torch.amp's protocol (scale the loss, unscale once, a step skipped on
//! inf/NaN, a separate update), and `candle_amp::clip_grad_norm`. The
//! forward in f16 or bf16 from f32 master weights is `Mlp::forward_as` here
//! (candle's `to_dtype` is differentiable, so gradients arrive in f32);
//! `candle_amp::MasterWeights` does the same for any candle-nn model.
#![warn(missing_docs)]

use candle_amp::{clip_grad_norm, GradScaler, ScalerConfig, StepOutcome};
use serde::{Deserialize, Serialize};
use workbook_models::{cross_entropy, param_grads, Activation, Mlp, Rng};
use workbook_sdk::anyhow;
use workbook_sdk::candle::{DType, Device, Module, Result, Tensor};
use workbook_sdk::candle_nn::{AdamW, Optimizer};
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::output::{Axis, Series, Unit};
use workbook_sdk::{Category, Context, Figure, Plugin, Rules, Table, Violation};

/// Parameters of the precision cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// Seed of weights and data.
    pub seed: u64,
    /// Width of the model whose activations are measured (features).
    pub act_width: usize,
    /// Depth (Linear + GELU blocks) of the model whose activations are measured.
    pub act_depth: usize,
    /// Batch of the model whose activations are measured (rows).
    pub act_batch: usize,
    /// Widths of the trained model, input to output (features).
    pub train_widths: Vec<usize>,
    /// Batch of the trained model (rows).
    pub train_batch: usize,
    /// Training steps in each dtype.
    #[schemars(range(min = 1))]
    pub train_steps: usize,
    /// AdamW's learning rate.
    pub lr: f64,
    /// Global gradient norm the gradients are clipped to, after unscaling.
    pub max_grad_norm: f64,
    /// The scaler's settings for f16 training.
    pub scaler: ScalerConfig,
    /// The size of each output's gradient in the underflow demonstration.
    pub small_gradient: f64,
    /// The fraction of training labels replaced at random (0 to 1).
    #[schemars(range(min = 0.0, max = 1.0))]
    pub label_noise: f64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            seed: 47,
            act_width: 512,
            act_depth: 8,
            act_batch: 1024,
            train_widths: vec![32, 64, 4],
            train_batch: 4096,
            train_steps: 200,
            lr: 3e-3,
            max_grad_norm: 1.0,
            scaler: ScalerConfig::default(),
            small_gradient: 1e-8,
            label_noise: 0.2,
        }
    }
}

/// The precision plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct Precision;

const HALVES: [(DType, &str); 2] = [(DType::F16, "f16"), (DType::BF16, "bf16")];

impl Plugin for Precision {
    type Params = Params;

    fn name(&self) -> &str {
        "precision"
    }

    fn description(&self) -> &str {
        "bytes per dtype, half-precision activations, f16 underflow and the loss scaler, mixed-precision training"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        r.at_least("act_width", p.act_width, 1)
            .at_least("act_depth", p.act_depth, 1)
            .at_least("act_batch", p.act_batch, 1)
            .widths("train_widths", &p.train_widths, p.train_batch)
            .at_least("train_batch", p.train_batch, 1)
            .at_least("train_steps", p.train_steps, 1)
            .positive("lr", p.lr)
            .positive("max_grad_norm", p.max_grad_norm)
            .positive("small_gradient", p.small_gradient)
            .within("label_noise", p.label_noise, 0.0, 1.0)
            .positive("scaler.init_scale", p.scaler.init_scale)
            .require(
                p.scaler.growth_factor.is_finite() && p.scaler.growth_factor > 1.0,
                "scaler.growth_factor",
                p.scaler.growth_factor.to_string(),
                "allowed: a finite number above 1 (as torch.amp.GradScaler)",
            )
            .require(
                p.scaler.backoff_factor > 0.0 && p.scaler.backoff_factor < 1.0,
                "scaler.backoff_factor",
                p.scaler.backoff_factor.to_string(),
                "allowed: a number above 0 and below 1 (as torch.amp.GradScaler)",
            )
            .at_least(
                "scaler.growth_interval",
                p.scaler.growth_interval as usize,
                1,
            );
        let w = p.act_width as u64;
        r.elements("act_width", "act_width × act_width", &[w, w])
            .elements(
                "act_batch",
                "act_depth × act_batch × act_width",
                &[p.act_depth as u64, p.act_batch as u64, w],
            );
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        // The f32 forward keeps every block's output.
        workbook_sdk::rules::f32_outputs_floor(
            "the forward keeps",
            p.act_depth,
            p.act_batch,
            p.act_width,
        )
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        let mut specs = Vec::new();
        for dtype in ["f32", "f16", "bf16", "u8"] {
            specs.push(MetricSpec::number(
                format!("tensor_mb_{dtype}"),
                format!("a 1000 × 1000 {dtype} tensor, measured, in MB (1e6 bytes)"),
            ));
        }
        specs.extend([
            MetricSpec::count(
                "underflow_elements",
                "elements of the weight gradient of the underflow demonstration",
            ),
            MetricSpec::count(
                "flushed_f16_unscaled",
                "weight-gradient elements nonzero in f32 but zero with an f16 forward, unscaled",
            ),
            MetricSpec::count(
                "flushed_f16_scaled",
                "weight-gradient elements nonzero in f32 but zero in f16, scaled by init_scale",
            ),
            MetricSpec::count(
                "flushed_bf16_unscaled",
                "weight-gradient elements nonzero in f32 but zero with a bf16 forward, unscaled",
            ),
        ]);
        for dtype in ["f32", "f16", "bf16"] {
            specs.extend([
                MetricSpec::bytes(
                    format!("act_held_{dtype}"),
                    format!("activations a forward in {dtype} holds when it ends"),
                ),
                MetricSpec::bytes(
                    format!("act_peak_{dtype}"),
                    format!("activations at their peak during a forward in {dtype}"),
                ),
            ]);
        }
        specs.extend([
            MetricSpec::bytes(
                "act_held_f32_lean",
                "activations an f32 forward on the fused layers holds when it ends",
            ),
            MetricSpec::bytes(
                "act_peak_f32_lean",
                "activations at their peak during an f32 forward on the fused layers",
            ),
        ]);
        for dtype in ["f16", "bf16"] {
            specs.extend([
                MetricSpec::ratio(
                    format!("act_held_ratio_{dtype}"),
                    format!("act_held_{dtype} over act_held_f32"),
                ),
                MetricSpec::ratio(
                    format!("act_peak_ratio_{dtype}"),
                    format!("act_peak_{dtype} over act_peak_f32"),
                ),
            ]);
        }
        for dtype in ["f32", "bf16", "f16"] {
            specs.push(MetricSpec::number(
                format!("final_loss_{dtype}"),
                format!("loss after training in {dtype}, evaluated with an f32 forward"),
            ));
        }
        specs.extend([
            MetricSpec::number("final_scale", "the f16 loss scale after the last step"),
            MetricSpec::count(
                "scale_decreases_f16",
                "times the f16 loss scale fell from one step to the next (the final included)",
            ),
            MetricSpec::number(
                "initial_loss",
                "loss before training, evaluated with an f32 forward",
            ),
            MetricSpec::count(
                "skipped_steps_f16",
                "f16 steps the scaler skipped for inf or NaN gradients",
            ),
        ]);
        for dtype in ["bf16", "f16"] {
            specs.push(MetricSpec::number(
                format!("loss_gap_{dtype}"),
                format!("|final_loss_{dtype} - final_loss_f32|"),
            ));
        }
        specs
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        let mut rng = Rng::seeded(p.seed);
        bytes_per_dtype(ctx)?;
        underflow(ctx, &p, &mut rng)?;
        activations(ctx, &p, &mut rng)?;
        training(ctx, &p, &mut rng)?;
        Ok(())
    }
}

/// The memory guide's 1000 x 1000 tensor in each dtype, measured.
fn bytes_per_dtype(ctx: &mut Context) -> anyhow::Result<()> {
    let device = ctx.device().clone();
    let mut table = Table::new(
        "A 1000 x 1000 tensor",
        &[
            ("dtype", Unit::None),
            ("bytes per element", Unit::Count),
            ("measured", Unit::Bytes),
            ("MB (1e6 B)", Unit::None),
        ],
    );
    for (dtype, name) in [
        (DType::F32, "f32"),
        (DType::F16, "f16"),
        (DType::BF16, "bf16"),
        (DType::U8, "u8"),
    ] {
        let region = ctx.region(format!("1000 x 1000 {name}"));
        let t = Category::Inputs.scope(|| Tensor::zeros((1000, 1000), dtype, &device))?;
        let bytes = region.current_above_baseline().get(Category::Inputs);
        drop(t);
        let mb = bytes as f64 / 1e6;
        ctx.metric(format!("tensor_mb_{name}"), mb);
        table.row(vec![
            name.into(),
            dtype.size_in_bytes().into(),
            bytes.into(),
            format!("{mb:.2}").into(),
        ]);
    }
    ctx.table(table);
    Ok(())
}

/// Elements of `grad` that are zero where `reference` is not.
fn flushed(grad: &Tensor, reference: &Tensor) -> Result<u64> {
    let zero = grad.eq(0f64)?.to_dtype(DType::U8)?;
    let nonzero_ref = reference.ne(0f64)?.to_dtype(DType::U8)?;
    (zero * nonzero_ref)?
        .to_dtype(DType::U32)?
        .sum_all()?
        .to_scalar::<u32>()
        .map(u64::from)
}

/// Gradients of `small_gradient` size flush to zero in f16 unless scaled.
fn underflow(ctx: &mut Context, p: &Params, rng: &mut Rng) -> anyhow::Result<()> {
    let device = ctx.device().clone();
    let model = Mlp::new(rng, &[64, 64], Activation::Relu, DType::F32, &device)?;
    let x = rng.randn((32, 64), &device)?;
    let weight = model.vars()[0].clone();
    // loss = small * sum(y): every output's gradient is `small`.
    let grad_of = |dtype: DType, scale: f64| -> anyhow::Result<Tensor> {
        let y = model.forward_as(&x, dtype)?.to_dtype(DType::F32)?;
        let loss = ((y.sum_all()? * p.small_gradient)? * scale)?;
        let grads = loss.backward()?;
        Ok(grads
            .get(weight.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("no gradient"))?
            .detach())
    };
    let reference = grad_of(DType::F32, 1.0)?;
    let elements = reference.elem_count() as f64;
    let f16_plain = flushed(&grad_of(DType::F16, 1.0)?, &reference)?;
    let scale = p.scaler.init_scale;
    let f16_scaled = flushed(&grad_of(DType::F16, scale)?, &reference)?;
    let bf16_plain = flushed(&grad_of(DType::BF16, 1.0)?, &reference)?;
    ctx.print(format!(
        "gradients of about {:.0e}: {f16_plain} of {elements} weight gradients flush to zero in f16, {f16_scaled} with the loss scaled by {scale}, {bf16_plain} in bf16 unscaled",
        p.small_gradient
    ));
    ctx.metric("underflow_elements", elements);
    ctx.metric("flushed_f16_unscaled", f16_plain as f64);
    ctx.metric("flushed_f16_scaled", f16_scaled as f64);
    ctx.metric("flushed_bf16_unscaled", bf16_plain as f64);
    Ok(())
}

/// Activation memory of a forward in f32 against f16 and bf16.
fn activations(ctx: &mut Context, p: &Params, rng: &mut Rng) -> anyhow::Result<()> {
    let device = ctx.device().clone();
    let model = Mlp::stack(
        rng,
        p.act_width,
        p.act_depth,
        Activation::Gelu,
        DType::F32,
        &device,
    )?;
    let x = Category::Inputs.scope(|| rng.randn((p.act_batch, p.act_width), &device))?;
    let mut table = Table::new(
        format!(
            "Forward of {} x Linear({w},{w}) + GELU, batch {}",
            p.act_depth,
            p.act_batch,
            w = p.act_width
        ),
        &[
            ("compute dtype", Unit::None),
            ("activations held", Unit::Bytes),
            ("vs f32", Unit::Ratio),
            ("activation peak", Unit::Bytes),
            ("vs f32", Unit::Ratio),
        ],
    );
    let mut base = (0f64, 0f64);
    for (dtype, name) in [
        (DType::F32, "f32"),
        (DType::F16, "f16"),
        (DType::BF16, "bf16"),
    ] {
        ctx.progress(&format!("forward in {name}"));
        let mut region = ctx.region(format!("forward in {name}"));
        // The layers' forward alone: what it keeps for the backward, and its
        // peak, which includes each matrix product's temporaries.
        let out = Category::Activations.scope(|| model.forward_as(&x, dtype))?;
        region.mark("after forward");
        let held = region.current_above_baseline().get(Category::Activations) as f64;
        drop(out);
        let report = ctx.end_region(region);
        let peak = report.category_peak_above_baseline(Category::Activations) as f64;
        if dtype == DType::F32 {
            base = (held, peak);
        }
        ctx.metric(format!("act_held_{name}"), held);
        ctx.metric(format!("act_peak_{name}"), peak);
        table.row(vec![
            name.into(),
            (held as u64).into(),
            (held / base.0).into(),
            (peak as u64).into(),
            (peak / base.1).into(),
        ]);
    }
    // The f32 forward through the toolkit's fused layers: each keeps its
    // output and GELU's input, as PyTorch's Linear and GELU do.
    ctx.progress("forward in f32, fused layers");
    let mut region = ctx.region("forward in f32, fused layers");
    let out = Category::Activations.scope(|| model.forward_fused(&x))?;
    region.mark("after forward");
    let held = region.current_above_baseline().get(Category::Activations) as f64;
    drop(out);
    let peak = ctx
        .end_region(region)
        .category_peak_above_baseline(Category::Activations) as f64;
    ctx.metric("act_held_f32_lean", held);
    ctx.metric("act_peak_f32_lean", peak);
    table.row(vec![
        "f32, fused layers".into(),
        (held as u64).into(),
        (held / base.0).into(),
        (peak as u64).into(),
        (peak / base.1).into(),
    ]);
    for (_, name) in HALVES {
        let held = ctx.output().metrics[&format!("act_held_{name}")];
        let peak = ctx.output().metrics[&format!("act_peak_{name}")];
        ctx.metric(format!("act_held_ratio_{name}"), held / base.0);
        ctx.metric(format!("act_peak_ratio_{name}"), peak / base.1);
    }
    ctx.table(table);
    Ok(())
}

/// A learnable task: labels from a random linear teacher.
fn task(rng: &mut Rng, p: &Params, device: &Device) -> Result<(Tensor, Tensor)> {
    let (inp, classes) = (p.train_widths[0], *p.train_widths.last().unwrap_or(&2));
    let x = rng.randn((p.train_batch, inp), device)?;
    let teacher = rng.randn((inp, classes), device)?;
    let clean = x.matmul(&teacher)?.argmax(1)?;
    // Some labels replaced at random: the loss cannot reach zero, so the
    // gradients stay large enough to overflow f16 at a high scale.
    let random = rng.labels(p.train_batch, classes as u32, device)?;
    let noisy = rng
        .uniform(p.train_batch, 0.0, 1.0, device)?
        .lt(p.label_noise)?;
    let y = noisy.where_cond(&random, &clean)?;
    Ok((x, y))
}

fn training(ctx: &mut Context, p: &Params, rng: &mut Rng) -> anyhow::Result<()> {
    let device = ctx.device().clone();
    anyhow::ensure!(
        p.train_widths.len() >= 2,
        "train_widths needs at least an input and an output width"
    );
    let (x, y) = task(rng, p, &device)?;
    let base = Mlp::new(rng, &p.train_widths, Activation::Relu, DType::F32, &device)?;
    let eval = |m: &Mlp| -> Result<f64> {
        Ok(cross_entropy(&m.forward(&x)?, &y)?.to_scalar::<f32>()? as f64)
    };
    let initial = eval(&base)?;
    let mut finals = Vec::new();
    let mut scale_history = Vec::new();
    let mut skipped = 0usize;
    let mut curves = Vec::new();
    for (dtype, name) in [
        (DType::F32, "f32"),
        (DType::BF16, "bf16"),
        (DType::F16, "f16"),
    ] {
        ctx.progress(&format!("training in {name}"));
        let model = base.deep_clone()?;
        let vars = model.vars();
        let mut opt = AdamW::new_lr(vars.clone(), p.lr)?;
        let mut scaler = (dtype == DType::F16)
            .then(|| GradScaler::new(p.scaler))
            .transpose()?;
        let mut curve = Vec::new();
        for step in 0..p.train_steps {
            let loss = cross_entropy(&model.forward_as(&x, dtype)?, &y)?;
            curve.push((step as f64, loss.to_scalar::<f32>()? as f64));
            let root = match &scaler {
                Some(s) => s.scale(&loss)?,
                None => loss,
            };
            let mut grads = param_grads(&root.backward()?, &vars);
            // Unscaled before clipping, so the norm is the true one.
            let found_inf = match scaler.as_mut() {
                Some(s) => s.unscale(&mut grads, &vars)?,
                None => false,
            };
            if !found_inf {
                clip_grad_norm(&mut grads, &vars, p.max_grad_norm)?;
            }
            match scaler.as_mut() {
                Some(s) => {
                    scale_history.push((step as f64, s.scale_factor()));
                    if s.step(&mut opt, &mut grads, &vars)? == StepOutcome::Skipped {
                        skipped += 1;
                    }
                    s.update()?;
                }
                None => opt.step(&grads)?,
            }
        }
        let final_loss = eval(&model)?;
        ctx.metric(format!("final_loss_{name}"), final_loss);
        finals.push((name, final_loss));
        curves.push(Series {
            name: name.into(),
            points: curve,
        });
        if let Some(s) = scaler {
            ctx.metric("final_scale", s.scale_factor());
            // How often the scale a step ran with was below the one before
            // (the scale after the last step included), read from the
            // recorded history, not from the scaler's own count of skips.
            let scales: Vec<f64> = scale_history
                .iter()
                .map(|&(_, scale)| scale)
                .chain([s.scale_factor()])
                .collect();
            let decreases = scales.windows(2).filter(|w| w[1] < w[0]).count();
            ctx.metric("scale_decreases_f16", decreases as f64);
        }
    }
    ctx.metric("initial_loss", initial);
    ctx.metric("skipped_steps_f16", skipped as f64);
    let f32_loss = finals[0].1;
    for (name, l) in &finals[1..] {
        ctx.metric(format!("loss_gap_{name}"), (l - f32_loss).abs());
    }
    ctx.print(format!(
        "{} steps from loss {initial:.4}: f32 {:.4}, bf16 {:.4}, f16 with loss scaling {:.4}; {skipped} f16 step(s) skipped for inf/NaN, final scale {}",
        p.train_steps,
        finals[0].1,
        finals[1].1,
        finals[2].1,
        ctx.output().metrics.get("final_scale").copied().unwrap_or(f64::NAN)
    ));
    let mut changes = Table::new(
        "The f16 loss scale: each change",
        &[("step", Unit::Count), ("scale", Unit::None)],
    );
    let mut last = f64::NAN;
    for (step, scale) in &scale_history {
        if *scale != last {
            changes.row(vec![(*step as u64).into(), (*scale).into()]);
            last = *scale;
        }
    }
    ctx.table(changes);
    ctx.figure(Figure {
        id: "precision-loss".into(),
        title: "Training loss in f32, bf16 and f16 with loss scaling".into(),
        x: Axis {
            label: "step".into(),
            unit: Unit::Count,
            log: false,
        },
        y: Axis {
            label: "loss".into(),
            unit: Unit::None,
            log: false,
        },
        series: curves,
        markers: Vec::new(),
        guides: Vec::new(),
    });
    ctx.figure(Figure {
        id: "precision-scale".into(),
        title: "The f16 loss scale over training".into(),
        x: Axis {
            label: "step".into(),
            unit: Unit::Count,
            log: false,
        },
        y: Axis {
            label: "loss scale".into(),
            unit: Unit::None,
            log: true,
        },
        series: vec![Series {
            name: "scale".into(),
            points: scale_history,
        }],
        markers: Vec::new(),
        guides: Vec::new(),
    });
    Ok(())
}
