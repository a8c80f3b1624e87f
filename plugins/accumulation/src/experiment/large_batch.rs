// notebook cell
/// The sweep's model, on which activations can outweigh the parameters,
/// and its candle_nn AdamW.
pub struct Sweeper {
    /// The stack the sweep trains.
    pub model: Mlp,
    /// candle_nn's AdamW over it.
    pub optimizer: AdamW,
    /// The optimizer step's peak, from the first recorded step.
    pub step_peak: Option<u64>,
}

impl Sweeper {
    /// One training step of `batch` rows in `steps` micro-batches: the
    /// forward and backward passes' peak (0 unless `record`), then the
    /// optimizer's step, the same whatever the micro-batching, measured on
    /// its own.
    pub fn measure(
        &mut self,
        ctx: &mut Context,
        p: &AccumulationParams,
        rng: &mut Rng,
        (batch, steps): (usize, usize),
        record: bool,
    ) -> anyhow::Result<u64> {
        let device = ctx.device().clone();
        ctx.progress(&format!("batch {batch} in {steps} micro-batch(es)"));
        let (x, y) = batch_of(rng, batch, p.sweep_width, &device)?;
        let mut region = ctx.region(format!("batch {batch}, {steps} micro-batch(es)"));
        let mut acc = accumulate(&self.model, &x, &y, steps, &mut region)?;
        let peak = if record {
            ctx.end_region(region).peak_above_baseline()
        } else {
            0
        };
        let mut region = ctx.region("AdamW step (candle_nn)");
        let grads = acc.take()?;
        Category::OptimizerState.scope(|| self.optimizer.step(&grads))?;
        drop(grads);
        region.mark("after step");
        if record && self.step_peak.is_none() {
            self.step_peak = Some(ctx.end_region(region).peak_above_baseline());
        }
        Ok(peak)
    }
}

/// The peaks the sweep compares: batch `p.small_batch` and `p.large_batch`,
/// whole and in `p.compare_steps` micro-batches.
pub struct Peaks {
    /// The small batch, whole.
    pub full_small: u64,
    /// The small batch in micro-batches.
    pub accum_small: u64,
    /// The large batch, whole.
    pub full_large: u64,
    /// The large batch in micro-batches.
    pub accum_large: u64,
}

/// What the large batch's sweep measured.
pub struct LargeBatch {
    /// (micro-batch size, peak) for each of `p.steps`.
    pub points: Vec<(f64, f64)>,
    /// The whole batch's peak.
    pub full: u64,
    /// The peak in `p.compare_steps` micro-batches.
    pub accum: u64,
}

/// Batch `p.large_batch` in each of `p.steps` micro-batch counts, and the
/// whole batch and `p.compare_steps` micro-batches (measured apart if
/// `p.steps` lacks them).
pub fn large_batch_sweep(
    ctx: &mut Context,
    p: &AccumulationParams,
    rng: &mut Rng,
    s: &mut Sweeper,
) -> anyhow::Result<LargeBatch> {
    let mut points = Vec::new();
    let mut full_large = 0;
    let mut accum_large = 0;
    for &steps in &p.steps {
        let peak = s.measure(ctx, p, rng, (p.large_batch, steps), true)?;
        if steps == 1 {
            full_large = peak;
        }
        if steps == p.compare_steps {
            accum_large = peak;
        }
        points.push(((p.large_batch / steps) as f64, peak as f64));
    }
    if !p.steps.contains(&1) {
        full_large = s.measure(ctx, p, rng, (p.large_batch, 1), true)?;
    }
    if !p.steps.contains(&p.compare_steps) {
        accum_large = s.measure(ctx, p, rng, (p.large_batch, p.compare_steps), true)?;
    }
    Ok(LargeBatch {
        points,
        full: full_large,
        accum: accum_large,
    })
}

// notebook cell
/// The sweep's peaks as metrics, lines, a table and a figure.
pub fn accumulation_report(
    ctx: &mut Context,
    p: &AccumulationParams,
    s: &Sweeper,
    peaks: &Peaks,
    mut points: Vec<(f64, f64)>,
) {
    let step_peak = s.step_peak.unwrap_or(0);
    let grad_bytes: u64 = s
        .model
        .vars()
        .iter()
        .map(|v| v.elem_count() as u64 * 4)
        .sum();
    ctx.metric("peak_full_small", peaks.full_small as f64);
    ctx.metric("peak_accum_small", peaks.accum_small as f64);
    ctx.metric("peak_full_large", peaks.full_large as f64);
    ctx.metric("peak_accum_large", peaks.accum_large as f64);
    ctx.metric("gradient_bytes", grad_bytes as f64);
    ctx.metric("peak_adamw_step", step_peak as f64);
    let weight_bytes = (p.sweep_width * p.sweep_width * 4) as f64;
    ctx.metric("adamw_step_in_weights", step_peak as f64 / weight_bytes);
    for (batch, full, accum) in [
        (p.small_batch, peaks.full_small, peaks.accum_small),
        (p.large_batch, peaks.full_large, peaks.accum_large),
    ] {
        ctx.print(format!(
            "batch {batch}: full {:.1} MiB, {} micro-batches {:.1} MiB",
            mib(full),
            p.compare_steps,
            mib(accum)
        ));
    }
    ctx.print(format!(
        "one candle_nn::AdamW step on top of the gradients: {:.1} MiB (its out-of-place update)",
        mib(step_peak)
    ));
    let mut table = Table::new(
        format!(
            "Peak of the forward and backward passes of one step, batch {}",
            p.large_batch
        ),
        &[
            ("micro-batches", Unit::Count),
            ("micro-batch size", Unit::Count),
            ("peak", Unit::Bytes),
            ("vs full batch", Unit::Ratio),
        ],
    );
    for (size, peak) in &points {
        table.row(vec![
            ((p.large_batch as f64 / size).round() as u64).into(),
            (*size as u64).into(),
            (*peak as u64).into(),
            (peak / peaks.full_large as f64).into(),
        ]);
    }
    ctx.table(table);
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    ctx.figure(Figure {
        id: "accumulation-sweep".into(),
        title: format!("Peak of forward and backward, batch {}", p.large_batch),
        x: Axis {
            label: "micro-batch size".into(),
            unit: Unit::Count,
            log: true,
        },
        y: Axis {
            label: "peak memory".into(),
            unit: Unit::Bytes,
            log: false,
        },
        series: vec![Series {
            name: "measured peak".into(),
            points,
        }],
        markers: Vec::new(),
        guides: Vec::new(),
    });
}
