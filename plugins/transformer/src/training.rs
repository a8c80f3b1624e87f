//! The `gpt_training` cell: the model counts the parameters the formula
//! says, and it learns.

use candle_lean_optim::LeanAdamW;
use candle_ledger::Labeller;
use candle_nn::{Optimizer, ParamsAdamW};
use serde::{Deserialize, Serialize};
use workbook_models::Rng;
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::output::{Axis, Series};
use workbook_sdk::{anyhow, Context, Figure, Plugin, Rules, Unit, Violation};

use crate::gpt::{AttentionKind, Gpt, GptConfig};
use crate::{corpus, parse_dtype};

/// Parameters of the `gpt_training` cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// The model.
    pub model: GptConfig,
    /// Sequences per batch.
    pub batch: usize,
    /// Training steps.
    pub steps: usize,
    /// AdamW's learning rate.
    pub lr: f64,
    /// The parameters' dtype: `f32`, `f16` or `bf16`.
    pub dtype: String,
    /// Seed of weights and data.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            model: GptConfig {
                layers: 2,
                hidden: 64,
                seq: 32,
                vocab: 64,
                attention: AttentionKind::Tiled,
                ..GptConfig::default()
            },
            batch: 16,
            steps: 60,
            lr: 3e-3,
            dtype: "f32".into(),
            seed: 3,
        }
    }
}

/// Checks what every cell of this crate takes: the model, a batch of at
/// least `least` sequences, and a dtype by name.
pub(crate) fn check_run(r: &mut Rules, model: &GptConfig, batch: usize, least: usize, dtype: &str) {
    check_model(r, "model", model);
    r.at_least("batch", batch, least);
    r.one_of("dtype", dtype, &crate::DTYPES);
}

/// Checks a model configuration's fields.
pub(crate) fn check_model(r: &mut Rules, field: &str, m: &GptConfig) {
    r.at_least(&format!("{field}.layers"), m.layers, 1)
        .at_least(&format!("{field}.heads"), m.heads, 1)
        .at_least(&format!("{field}.seq"), m.seq, 1)
        .at_least(&format!("{field}.vocab"), m.vocab, 2);
    r.require(
        m.heads > 0 && m.hidden > 0 && m.hidden.is_multiple_of(m.heads),
        &format!("{field}.hidden"),
        m.hidden.to_string(),
        &format!("allowed: a positive multiple of heads ({})", m.heads),
    );
}

/// The `gpt_training` plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct GptTraining;

impl Plugin for GptTraining {
    type Params = Params;

    fn name(&self) -> &str {
        "gpt_training"
    }

    fn description(&self) -> &str {
        "a GPT-style decoder: its parameter count against the formula, and its loss as it trains"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        check_run(&mut r, &p.model, p.batch, 1, &p.dtype);
        r.at_least("steps", p.steps, 2);
        r.positive("lr", p.lr);
        r.into_violations()
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::count(
                "params_counted",
                "parameters, counted from the model's variables",
            ),
            MetricSpec::count(
                "params_formula",
                "parameters by the formula h·v + s·h + L·(12h² + 13h) + 2h",
            ),
            MetricSpec::number("loss_first", "the loss of the first step"),
            MetricSpec::number("loss_last", "the mean loss of the last five steps"),
            MetricSpec::number("loss_uniform", "ln(vocab): the loss of a uniform guess"),
            MetricSpec::seconds("step_seconds", "median wall time of a training step"),
        ]
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        let dtype = parse_dtype(&p.dtype)?;
        let device = ctx.device().clone();
        let mut rng = Rng::seeded(p.seed);
        let model = Gpt::new(p.model, dtype, &mut rng, &device)?;
        let counted = model.param_count();
        ctx.print(format!(
            "{} blocks, hidden {}, {} heads, {} positions, vocabulary {}: {counted} parameters",
            p.model.layers, p.model.hidden, p.model.heads, p.model.seq, p.model.vocab
        ));
        ctx.metric("params_counted", counted as f64);
        ctx.metric("params_formula", p.model.param_count() as f64);
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
            let (x, y) = corpus::batch(&mut rng, p.batch, p.model.seq, p.model.vocab, &device)?;
            let loss = model.loss(&x, &y, &Labeller::default())?;
            opt.backward_step(&loss)?;
            losses.push(loss.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()? as f64);
            times.push(start.elapsed().as_secs_f64());
        }
        let tail = &losses[losses.len().saturating_sub(5)..];
        let last = tail.iter().sum::<f64>() / tail.len() as f64;
        ctx.print(format!(
            "loss {:.3} at the first step, {last:.3} over the last five (a uniform guess: {:.3})",
            losses[0],
            (p.model.vocab as f64).ln()
        ));
        ctx.metric("loss_first", losses[0]);
        ctx.metric("loss_last", last);
        ctx.metric("loss_uniform", (p.model.vocab as f64).ln());
        ctx.metric("step_seconds", crate::median(times));
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
}
