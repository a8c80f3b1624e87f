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
    let mut worst = vec![0f64; Predictor::ALL.len()];
    let mut highest = vec![f64::NEG_INFINITY; Predictor::ALL.len()];
    let mut series: Vec<Series> = Predictor::ALL
        .iter()
        .map(|pr| Series {
            name: pr.id().into(),
            points: Vec::new(),
        })
        .collect();
    for (i, v) in variants.iter().enumerate() {
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
        let calibration = [steps[0].peak(), steps[1].peak()];
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
        let inputs = (2 * batch * config.seq * 4) as u64;
        let known = Measured {
            inputs,
            ledger: step.ledger_bytes,
            largest_held: step.largest_held,
            calibration: (calibration[0], calibration[1]),
        };
        let peak = step.peak();
        ctx.metric(format!("peak_{i}"), peak as f64);
        let mut row = vec![name.clone().into(), peak.into()];
        for (k, pr) in Predictor::ALL.iter().enumerate() {
            let predicted = pr.predict(&run, &known);
            let error = predicted as f64 / peak as f64 - 1.0;
            ctx.metric(format!("error_{}_{i}", pr.id()), error);
            highest[k] = highest[k].max(error);
            worst[k] = if error.abs() > worst[k].abs() {
                error
            } else {
                worst[k]
            };
            row.push(error.into());
            series[k]
                .points
                .push((peak as f64, predicted as f64 / peak as f64));
        }
        table.row(row);
        let at = step
            .region
            .peak_by_category
            .saturating_sub(&step.region.baseline);
        // The calibration's two parts: what does not grow with the batch
        // and what each sequence adds; the rest of the peak is what no
        // term explains.
        let per_sequence = calibration[1].saturating_sub(calibration[0]);
        let fixed = calibration[0].saturating_sub(per_sequence);
        let explained = Predictor::Calibrated.predict(&run, &known);
        let unexplained = (peak as f64 - explained as f64) / peak as f64;
        ctx.metric(format!("unexplained_{i}"), unexplained);
        ctx.metric(format!("fixed_{i}"), fixed as f64);
        ctx.metric(format!("per_sequence_{i}"), per_sequence as f64);
        ctx.metric(format!("ledger_{i}"), step.ledger_bytes as f64);
        ctx.metric(format!("states_{i}"), run.model_states() as f64);
        terms.row(vec![
            name.into(),
            peak.into(),
            at.get(Category::Parameters).into(),
            at.get(Category::Gradients).into(),
            at.get(Category::OptimizerState).into(),
            at.get(Category::Activations).into(),
            step.ledger_bytes.into(),
            run.model_states().into(),
            fixed.into(),
            per_sequence.into(),
            unexplained.into(),
        ]);
    }
    ctx.metric("runs", variants.len() as f64);
    for (k, pr) in Predictor::ALL.iter().enumerate() {
        ctx.metric(format!("worst_{}", pr.id()), worst[k]);
        ctx.metric(format!("highest_{}", pr.id()), highest[k]);
    }
    ctx.table(table);
    ctx.table(terms);
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
