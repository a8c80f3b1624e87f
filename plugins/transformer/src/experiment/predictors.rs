//! The `predictors` cell's experiment: what `workbook run` executes and
//! what chapter 3's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use workbook_models::GptConfig;
use workbook_planner::step::{calibrate, measured_step, StepShape};
use workbook_sdk::anyhow;
use workbook_sdk::output::{Axis, Series};
use workbook_sdk::parse_dtype;
use workbook_sdk::{Category, Context, Figure, Table, Unit};
use workbook_transformer::predict::{Measured, Predictor, Run};
use workbook_transformer::trial::{Params as PredictorsParams, Variant};

// notebook cell
/// A run's name: the sizes it changes from the base (`L=4, b=8`), or
/// `base`.
pub fn variant_label(v: &Variant) -> String {
    let mut parts = Vec::new();
    for (name, value) in [
        ("L", v.layers),
        ("h", v.hidden),
        ("s", v.seq),
        ("b", v.batch),
    ] {
        if let Some(x) = value {
            parts.push(format!("{name}={x}"));
        }
    }
    if let Some(d) = &v.dtype {
        parts.push(d.clone());
    }
    if parts.is_empty() {
        "base".into()
    } else {
        parts.join(", ")
    }
}

/// One run of the trial: its name, its shape and what the predictors are
/// given, the measured peak, and the peak's bytes by category.
pub struct Trial {
    /// The run's name ([`variant_label`]).
    pub name: String,
    /// Its shape.
    pub run: Run,
    /// What was measured that a predictor may use.
    pub known: Measured,
    /// The training step's measured peak.
    pub peak: u64,
    /// The peak above the start by category: parameters, gradients,
    /// optimizer state, activations.
    pub by_category: [u64; 4],
}

// notebook cell
/// One variant of the base run: two small calibration steps (batches 1
/// and 2), then the training step itself, measured.
pub fn measure_variant(
    ctx: &mut Context,
    p: &PredictorsParams,
    v: &Variant,
) -> anyhow::Result<Trial> {
    let config = p.recipe.apply(GptConfig {
        layers: v.layers.unwrap_or(p.model.layers),
        hidden: v.hidden.unwrap_or(p.model.hidden),
        seq: v.seq.unwrap_or(p.model.seq),
        ..p.model
    });
    let batch = v.batch.unwrap_or(p.batch);
    let dtype_name = v.dtype.clone().unwrap_or_else(|| p.dtype.clone());
    let dtype = parse_dtype(&dtype_name)?;
    let name = variant_label(v);
    let steps = calibrate(
        ctx,
        &name,
        config,
        dtype,
        &StepShape::wholes(&[1, 2], false),
        p.seed,
        None,
    )?;
    let calibration = (steps[0].peak(), steps[1].peak());
    ctx.progress(&format!("training step, {name}"));
    let step = measured_step(
        ctx,
        name.clone(),
        config,
        dtype,
        StepShape::whole(batch),
        p.seed,
        None,
    )?;
    let run = Run {
        layers: config.layers as u64,
        hidden: config.hidden as u64,
        heads: config.heads as u64,
        seq: config.seq as u64,
        batch: batch as u64,
        vocab: config.vocab as u64,
        params: step.params,
        elem: dtype.size_in_bytes() as u64,
    };
    let known = Measured {
        inputs: (2 * batch * config.seq * 4) as u64,
        ledger: step.ledger_bytes,
        largest_held: step.largest_held,
        calibration,
    };
    let at = step
        .region
        .peak_by_category
        .saturating_sub(&step.region.baseline);
    let by_category = [
        Category::Parameters,
        Category::Gradients,
        Category::OptimizerState,
        Category::Activations,
    ]
    .map(|c| at.get(c));
    Ok(Trial {
        name,
        run,
        known,
        peak: step.peak(),
        by_category,
    })
}

/// Each predictor's signed errors over the runs (predicted / measured -
/// 1): the worst (the largest in size), the highest, and (measured peak,
/// predicted / measured) points.
pub struct Errors {
    /// The worst error of each predictor, in [`Predictor::ALL`]'s order.
    pub worst: Vec<f64>,
    /// The highest.
    pub highest: Vec<f64>,
    /// The points, a series per predictor.
    pub series: Vec<Series>,
}

impl Errors {
    /// No run yet.
    pub fn new() -> Self {
        Self {
            worst: vec![0f64; Predictor::ALL.len()],
            highest: vec![f64::NEG_INFINITY; Predictor::ALL.len()],
            series: Predictor::ALL
                .iter()
                .map(|pr| Series {
                    name: pr.id().into(),
                    points: Vec::new(),
                })
                .collect(),
        }
    }

    /// Run `i`'s error for each predictor, as metrics and in the tallies.
    pub fn add(&mut self, ctx: &mut Context, i: usize, t: &Trial) -> Vec<f64> {
        let mut errors = Vec::new();
        for (k, pr) in Predictor::ALL.iter().enumerate() {
            let predicted = pr.predict(&t.run, &t.known);
            let error = predicted as f64 / t.peak as f64 - 1.0;
            ctx.metric(format!("error_{}_{i}", pr.id()), error);
            self.highest[k] = self.highest[k].max(error);
            if error.abs() > self.worst[k].abs() {
                self.worst[k] = error;
            }
            errors.push(error);
            self.series[k]
                .points
                .push((t.peak as f64, predicted as f64 / t.peak as f64));
        }
        errors
    }
}

impl Default for Errors {
    fn default() -> Self {
        Self::new()
    }
}

/// Run `i`'s peak taken apart: by category, the ledger, the model states
/// and the calibration's two parts (what does not grow with the batch and
/// what each sequence adds); the rest of the peak is what no term
/// explains. A row of the terms table, and metrics.
pub fn terms_row(ctx: &mut Context, i: usize, t: &Trial) -> Vec<workbook_sdk::serde_json::Value> {
    let (one, two) = t.known.calibration;
    let per_sequence = two.saturating_sub(one);
    let fixed = one.saturating_sub(per_sequence);
    let explained = Predictor::Calibrated.predict(&t.run, &t.known);
    let unexplained = (t.peak as f64 - explained as f64) / t.peak as f64;
    ctx.metric(format!("unexplained_{i}"), unexplained);
    ctx.metric(format!("fixed_{i}"), fixed as f64);
    ctx.metric(format!("per_sequence_{i}"), per_sequence as f64);
    ctx.metric(format!("ledger_{i}"), t.known.ledger as f64);
    ctx.metric(format!("states_{i}"), t.run.model_states() as f64);
    let [parameters, gradients, optimizer, activations] = t.by_category;
    vec![
        t.name.as_str().into(),
        t.peak.into(),
        parameters.into(),
        gradients.into(),
        optimizer.into(),
        activations.into(),
        t.known.ledger.into(),
        t.run.model_states().into(),
        fixed.into(),
        per_sequence.into(),
        unexplained.into(),
    ]
}

// notebook cell
/// The experiment: for the base run and each variant, two small
/// calibration steps (batches 1 and 2) and the training step itself,
/// measured; each predictor's figure against the measured peak, and the
/// peak taken apart by category.
pub fn predictors_experiment(ctx: &mut Context, p: PredictorsParams) -> anyhow::Result<()> {
    let mut variants = vec![Variant::default()];
    variants.extend(p.variants.iter().cloned());
    let mut columns = vec![("run", Unit::None), ("measured peak", Unit::Bytes)];
    let ids: Vec<String> = Predictor::ALL.iter().map(|p| p.id().to_string()).collect();
    for id in &ids {
        columns.push((id.as_str(), Unit::Ratio));
    }
    let mut table = Table::new(
        "Signed error of each predictor against the measured peak (predicted / measured - 1)",
        &columns,
    );
    let mut terms = Table::new(
        "The measured peak: by category at that moment, the ledger, the model states, \
         and the calibration's two parts",
        &[
            ("run", Unit::None),
            ("peak", Unit::Bytes),
            ("parameters", Unit::Bytes),
            ("gradients", Unit::Bytes),
            ("optimizer state", Unit::Bytes),
            ("activations", Unit::Bytes),
            ("ledger", Unit::Bytes),
            ("4·P·e", Unit::Bytes),
            ("fixed part", Unit::Bytes),
            ("per sequence", Unit::Bytes),
            ("unexplained", Unit::Ratio),
        ],
    );
    let mut errors = Errors::new();
    for (i, v) in variants.iter().enumerate() {
        let trial = measure_variant(ctx, &p, v)?;
        ctx.metric(format!("peak_{i}"), trial.peak as f64);
        let mut row = vec![trial.name.as_str().into(), trial.peak.into()];
        row.extend(errors.add(ctx, i, &trial).into_iter().map(Into::into));
        table.row(row);
        terms.row(terms_row(ctx, i, &trial));
    }
    ctx.metric("runs", variants.len() as f64);
    for (k, pr) in Predictor::ALL.iter().enumerate() {
        ctx.metric(format!("worst_{}", pr.id()), errors.worst[k]);
        ctx.metric(format!("highest_{}", pr.id()), errors.highest[k]);
    }
    ctx.table(table);
    ctx.table(terms);
    let mut series = errors.series;
    for s in &mut series {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    ctx.figure(Figure {
        id: "predictors".into(),
        title: "Each predictor's figure over the measured peak, per run".into(),
        x: Axis {
            label: "measured peak".into(),
            unit: Unit::Bytes,
            log: true,
        },
        y: Axis {
            label: "predicted / measured".into(),
            unit: Unit::Ratio,
            log: false,
        },
        series,
        ..Figure::default()
    });
    Ok(())
}
