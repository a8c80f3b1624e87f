//! The precision cell's experiment: what `workbook run` executes and what
//! the chapter's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use candle_amp::{clip_grad_norm, GradScaler, StepOutcome};
use workbook_models::{cross_entropy, param_grads, Activation, Mlp, Rng};
use workbook_precision::Params as PrecisionParams;
use workbook_sdk::anyhow;
use workbook_sdk::candle::{DType, Device, Module, Result, Tensor};
use workbook_sdk::candle_nn::{AdamW, Optimizer};
use workbook_sdk::output::{Axis, Series, Unit};
use workbook_sdk::{Category, Context, Figure, Table};

// notebook cell
/// The memory guide's 1000 x 1000 tensor in each dtype, measured.
pub fn bytes_per_dtype(ctx: &mut Context) -> anyhow::Result<()> {
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

// notebook cell
/// Elements of `grad` that are zero where `reference` is not.
pub fn flushed(grad: &Tensor, reference: &Tensor) -> Result<u64> {
    let zero = grad.eq(0f64)?.to_dtype(DType::U8)?;
    let nonzero_ref = reference.ne(0f64)?.to_dtype(DType::U8)?;
    (zero * nonzero_ref)?
        .to_dtype(DType::U32)?
        .sum_all()?
        .to_scalar::<u32>()
        .map(u64::from)
}

/// Gradients of `small_gradient` size flush to zero in f16 unless scaled.
pub fn underflow(ctx: &mut Context, p: &PrecisionParams, rng: &mut Rng) -> anyhow::Result<()> {
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

// notebook cell
/// The half dtypes the activations are measured in.
pub const HALVES: [(DType, &str); 2] = [(DType::F16, "f16"), (DType::BF16, "bf16")];

/// Activation memory of a forward in f32 against f16 and bf16.
pub fn activations(ctx: &mut Context, p: &PrecisionParams, rng: &mut Rng) -> anyhow::Result<()> {
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
            ("compute dtype, layers", Unit::None),
            ("activations held", Unit::Bytes),
            ("vs f32, fused", Unit::Ratio),
            ("activation peak", Unit::Bytes),
            ("vs f32, fused", Unit::Ratio),
        ],
    );
    // The forward alone: what it keeps for the backward, and its peak,
    // which includes each matrix product's temporaries. On the lean path
    // (the fused layers, each keeping its output and GELU's input, as
    // PyTorch's Linear and GELU do), then on candle-nn's layers.
    let mut base = (0f64, 0f64);
    for (fused, suffix, path) in [(true, "", "fused layers"), (false, "_candle", "candle-nn")] {
        for (dtype, name) in [
            (DType::F32, "f32"),
            (DType::F16, "f16"),
            (DType::BF16, "bf16"),
        ] {
            let label = format!("forward in {name}, {path}");
            ctx.progress(&label);
            let mut region = ctx.region(label);
            let out = Category::Activations.scope(|| {
                if fused {
                    model.forward_fused_as(&x, dtype)
                } else {
                    model.forward_as(&x, dtype)
                }
            })?;
            region.mark("after forward");
            let held = region.current_above_baseline().get(Category::Activations) as f64;
            drop(out);
            let report = ctx.end_region(region);
            let peak = report.category_peak_above_baseline(Category::Activations) as f64;
            if fused && dtype == DType::F32 {
                base = (held, peak);
            }
            ctx.metric(format!("act_held_{name}{suffix}"), held);
            ctx.metric(format!("act_peak_{name}{suffix}"), peak);
            table.row(vec![
                format!("{name}, {path}").into(),
                (held as u64).into(),
                (held / base.0).into(),
                (peak as u64).into(),
                (peak / base.1).into(),
            ]);
        }
    }
    for (_, name) in HALVES {
        let held = ctx.output().metrics[&format!("act_held_{name}")];
        let peak = ctx.output().metrics[&format!("act_peak_{name}")];
        ctx.metric(format!("act_held_ratio_{name}"), held / base.0);
        ctx.metric(format!("act_peak_ratio_{name}"), peak / base.1);
    }
    ctx.table(table);
    Ok(())
}

// notebook cell
/// A learnable task: labels from a random linear teacher.
pub fn task(rng: &mut Rng, p: &PrecisionParams, device: &Device) -> Result<(Tensor, Tensor)> {
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

/// One training run in a compute dtype.
pub struct Trained {
    /// The model as trained.
    pub model: Mlp,
    /// (step, loss) at each step.
    pub curve: Vec<(f64, f64)>,
    /// The loss scaler, for f16.
    pub scaler: Option<GradScaler>,
    /// (step, the scale that step ran with), for f16.
    pub scale_history: Vec<(f64, f64)>,
    /// Steps the scaler skipped for inf or NaN.
    pub skipped: usize,
}

// notebook cell
/// `p.train_steps` of AdamW on a copy of `base`, its forward in `dtype`
/// (f32 master weights); f16 with a loss scaler, whose scale is unscaled
/// before the gradients are clipped.
pub fn train_in(
    p: &PrecisionParams,
    base: &Mlp,
    (x, y): (&Tensor, &Tensor),
    dtype: DType,
) -> anyhow::Result<Trained> {
    let model = base.deep_clone()?;
    let vars = model.vars();
    let mut opt = AdamW::new_lr(vars.clone(), p.lr)?;
    let mut scaler = (dtype == DType::F16)
        .then(|| GradScaler::new(p.scaler))
        .transpose()?;
    let (mut curve, mut scale_history, mut skipped) = (Vec::new(), Vec::new(), 0);
    for step in 0..p.train_steps {
        let loss = cross_entropy(&model.forward_as(x, dtype)?, y)?;
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
    Ok(Trained {
        model,
        curve,
        scaler,
        scale_history,
        skipped,
    })
}

/// Training from the same start in f32 and in mixed precision with f32
/// master weights (f16 with the dynamic loss scaler, and bf16).
pub fn training(ctx: &mut Context, p: &PrecisionParams, rng: &mut Rng) -> anyhow::Result<()> {
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
        let run = train_in(p, &base, (&x, &y), dtype)?;
        scale_history.extend(run.scale_history);
        skipped += run.skipped;
        let final_loss = eval(&run.model)?;
        ctx.metric(format!("final_loss_{name}"), final_loss);
        finals.push((name, final_loss));
        curves.push(Series {
            name: name.into(),
            points: run.curve,
        });
        if let Some(s) = run.scaler {
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
    training_figures(ctx, curves, scale_history);
    Ok(())
}

/// The f16 loss scale's changes as a table; the losses and the scale over
/// training as figures.
pub fn training_figures(ctx: &mut Context, curves: Vec<Series>, scale_history: Vec<(f64, f64)>) {
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
    let axes = |label: &str, log| {
        let step = Axis {
            label: "step".into(),
            unit: Unit::Count,
            log: false,
        };
        let y = Axis {
            label: label.into(),
            unit: Unit::None,
            log,
        };
        (step, y)
    };
    let (x, y) = axes("loss", false);
    ctx.figure(Figure {
        id: "precision-loss".into(),
        title: "Training loss in f32, bf16 and f16 with loss scaling".into(),
        x,
        y,
        series: curves,
        markers: Vec::new(),
        guides: Vec::new(),
    });
    let (x, y) = axes("loss scale", true);
    ctx.figure(Figure {
        id: "precision-scale".into(),
        title: "The f16 loss scale over training".into(),
        x,
        y,
        series: vec![Series {
            name: "scale".into(),
            points: scale_history,
        }],
        markers: Vec::new(),
        guides: Vec::new(),
    });
}

// notebook cell
/// The experiment: bytes per dtype, f16's underflow and the loss scaler,
/// activations in each dtype, and mixed-precision training.
pub fn precision_experiment(ctx: &mut Context, p: PrecisionParams) -> anyhow::Result<()> {
    let mut rng = Rng::seeded(p.seed);
    bytes_per_dtype(ctx)?;
    underflow(ctx, &p, &mut rng)?;
    activations(ctx, &p, &mut rng)?;
    training(ctx, &p, &mut rng)?;
    Ok(())
}
