//! The footprint cell's experiment: what `workbook run` executes and what
//! the chapter's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use workbook_footprint::{Params as FootprintParams, TrainingState};
use workbook_models::{cross_entropy, param_grads, Activation, Mlp, Rng};
use workbook_sdk::anyhow;
use workbook_sdk::candle::{DType, Module};
use workbook_sdk::candle_nn::AdamW;
use workbook_sdk::output::Unit;
use workbook_sdk::parse_dtype;
use workbook_sdk::{Category, Context, Table};

// notebook cell
/// The training state of `p.state_model` in dtype `name`, made in a
/// region as training makes it (parameters, a forward and backward, then
/// AdamW's moments): what the allocator counted of each, and the analytic
/// figures.
pub fn training_state(
    ctx: &mut Context,
    p: &FootprintParams,
    rng: &mut Rng,
    name: &str,
) -> anyhow::Result<(TrainingState, TrainingState)> {
    let device = ctx.device().clone();
    let dtype = parse_dtype(name)?;
    ctx.progress(&format!("materialising the training state in {name}"));
    let mut region = ctx.region(format!("training state, {name}"));
    let model = Mlp::new(rng, &p.state_model, Activation::Relu, dtype, &device)?;
    region.mark("parameters");
    let (x, y) = {
        let _inputs = Category::Inputs.enter();
        let x = rng
            .randn((p.batch, p.state_model[0]), &device)?
            .to_dtype(dtype)?;
        let classes = *p.state_model.last().unwrap_or(&1) as u32;
        (x, rng.labels(p.batch, classes, &device)?)
    };
    let loss = Category::Activations.scope(|| cross_entropy(&model.forward(&x)?, &y))?;
    region.mark("after forward");
    let grads = Category::Gradients.scope(|| {
        let store = loss.backward()?;
        Ok::<_, anyhow::Error>(param_grads(&store, &model.vars()))
    })?;
    drop(loss);
    region.mark("after backward");
    let optimizer = Category::OptimizerState.scope(|| AdamW::new_lr(model.vars(), 1e-3))?;
    region.mark("optimizer state");
    let measured = {
        let d = region.current_above_baseline();
        TrainingState {
            parameters: d.get(Category::Parameters),
            gradients: d.get(Category::Gradients),
            optimizer: d.get(Category::OptimizerState),
        }
    };
    drop((optimizer, grads, x, y, model));
    let analytic = TrainingState::analytic(
        p.state_model
            .windows(2)
            .map(|w| (w[0] * w[1] + w[1]) as u64)
            .sum(),
        dtype,
    );
    region.set_analytic(analytic.total());
    ctx.end_region(region);
    Ok((measured, analytic))
}

// notebook cell
/// The experiment: the two models' parameter counts; the training state
/// (parameters, gradients, AdamW's moments) materialised in each dtype and
/// measured by category beside the analytic figure; the 7B model's figures.
pub fn footprint_experiment(ctx: &mut Context, p: FootprintParams) -> anyhow::Result<()> {
    let device = ctx.device().clone();
    let mut rng = Rng::seeded(p.seed);
    let count = |rng: &mut Rng, widths: &[usize]| -> anyhow::Result<usize> {
        Ok(Mlp::new(rng, widths, Activation::Relu, DType::F32, &device)?.param_count())
    };
    let small = count(&mut rng, &p.small)?;
    let large = count(&mut rng, &p.large)?;
    ctx.print(format!("small params: {small}"));
    ctx.print(format!("large params: {large}"));
    ctx.metric("small_params", small as f64);
    ctx.metric("large_params", large as f64);

    let mut table = Table::new(
        "Training state with AdamW, measured against analytic",
        &[
            ("dtype", Unit::None),
            ("parameters", Unit::Bytes),
            ("gradients", Unit::Bytes),
            ("AdamW moments", Unit::Bytes),
            ("measured total", Unit::Bytes),
            ("analytic total", Unit::Bytes),
            ("measured / analytic", Unit::Ratio),
        ],
    );
    for name in &p.dtypes {
        let (measured, analytic) = training_state(ctx, &p, &mut rng, name)?;
        let ratio = measured.total() as f64 / analytic.total() as f64;
        ctx.metric(format!("params_bytes_{name}"), measured.parameters as f64);
        ctx.metric(format!("grads_bytes_{name}"), measured.gradients as f64);
        ctx.metric(format!("optimizer_bytes_{name}"), measured.optimizer as f64);
        ctx.metric(format!("state_measured_{name}"), measured.total() as f64);
        ctx.metric(format!("state_analytic_{name}"), analytic.total() as f64);
        ctx.metric(format!("state_ratio_{name}"), ratio);
        table.row(vec![
            name.as_str().into(),
            measured.parameters.into(),
            measured.gradients.into(),
            measured.optimizer.into(),
            measured.total().into(),
            analytic.total().into(),
            ratio.into(),
        ]);
    }
    ctx.table(table);

    let llm = TrainingState::analytic(p.llm_params, DType::F32);
    let gb = |b: u64| b as f64 / 1e9;
    ctx.print(format!(
        "{:.0}B parameters in f32 with AdamW: parameters {} GB, gradients {} GB, AdamW {} GB, total {} GB",
        p.llm_params as f64 / 1e9,
        gb(llm.parameters),
        gb(llm.gradients),
        gb(llm.optimizer),
        gb(llm.total())
    ));
    ctx.metric("llm_params_gb", gb(llm.parameters));
    ctx.metric("llm_grads_gb", gb(llm.gradients));
    ctx.metric("llm_adam_gb", gb(llm.optimizer));
    ctx.metric("llm_total_gb", gb(llm.total()));
    Ok(())
}
