//! The `gpt_training` cell's experiment: what `workbook run` executes and
//! what chapter 3's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use candle_lean_optim::LeanAdamW;
use candle_ledger::Labeller;
use workbook_models::Rng;
use workbook_models::{corpus, Gpt};
use workbook_sdk::anyhow;
use workbook_sdk::candle::DType;
use workbook_sdk::candle_nn::{Optimizer, ParamsAdamW};
use workbook_sdk::candle_observe::NoObserver;
use workbook_sdk::output::{Axis, Series};
use workbook_sdk::{median, parse_dtype};
use workbook_sdk::{Context, Figure, Unit};
use workbook_transformer::training::Params as GptTrainingParams;

// notebook cell
/// The experiment: a GPT's parameters counted against the formula, then
/// `p.steps` steps of AdamW on arithmetic sequences, the loss set against
/// a uniform guess's.
pub fn gpt_training_experiment(ctx: &mut Context, p: GptTrainingParams) -> anyhow::Result<()> {
    let dtype = parse_dtype(&p.dtype)?;
    let device = ctx.device().clone();
    let mut rng = Rng::seeded(p.seed);
    let config = p.recipe.apply(p.model);
    let model = Gpt::new(config, dtype, &mut rng, &device)?;
    let counted = model.param_count();
    ctx.print(format!(
        "{} blocks, hidden {}, {} heads, {} positions, vocabulary {}: {counted} parameters, \
         trained with the {} recipe",
        config.layers,
        config.hidden,
        config.heads,
        config.seq,
        config.vocab,
        p.recipe.name()
    ));
    ctx.metric("params_counted", counted as f64);
    ctx.metric("params_formula", config.param_count() as f64);
    let mut opt = LeanAdamW::new(
        model.vars(),
        ParamsAdamW {
            lr: p.lr,
            ..Default::default()
        },
    )?;
    let mut losses = Vec::with_capacity(p.steps);
    let mut times = Vec::with_capacity(p.steps);
    for step in 0..p.steps {
        if step % 10 == 0 {
            ctx.progress(&format!("training step {step} of {}", p.steps));
        }
        let start = std::time::Instant::now();
        let (x, y) = corpus::batch(&mut rng, p.batch, config.seq, config.vocab, &device)?;
        let loss = if p.recipe.direct() {
            // No graph: each stage's backward called directly, the
            // gradients collected for the optimizer.
            let step = model.direct_loss(&x, &y, 1.0, &NoObserver)?;
            opt.step(&step.grads)?;
            step.loss
        } else {
            let loss = model.loss(&x, &y, &Labeller::default())?;
            opt.backward_step(&loss)?;
            loss
        };
        losses.push(loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64);
        times.push(start.elapsed().as_secs_f64());
    }
    let tail = &losses[losses.len().saturating_sub(5)..];
    let last = tail.iter().sum::<f64>() / tail.len() as f64;
    ctx.print(format!(
        "loss {:.3} at the first step, {last:.3} over the last five (a uniform guess: {:.3})",
        losses[0],
        (config.vocab as f64).ln()
    ));
    ctx.metric("loss_first", losses[0]);
    ctx.metric("loss_last", last);
    ctx.metric("loss_uniform", (config.vocab as f64).ln());
    ctx.metric("step_seconds", median(times));
    ctx.figure(Figure {
        id: "gpt-loss".into(),
        title: "Training loss of the GPT on arithmetic sequences".into(),
        x: Axis {
            label: "step".into(),
            unit: Unit::Count,
            log: false,
        },
        y: Axis {
            label: "cross-entropy".into(),
            unit: Unit::None,
            log: false,
        },
        series: vec![Series {
            name: "loss".into(),
            points: losses
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as f64, l))
                .collect(),
        }],
        ..Figure::default()
    });
    Ok(())
}
