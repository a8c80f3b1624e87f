//! The `saved_tensors` cell: what the graph holds for the backward, part
//! by part, beside Korthikanti et al.'s terms.

use candle_ledger::{Labeller, Ledger};
use serde::{Deserialize, Serialize};
use workbook_models::Rng;
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{anyhow, Category, Context, Plugin, Rules, Table, Unit, Violation};

use crate::gpt::{AttentionKind, Gpt, GptConfig};
use crate::predict::Run;
use crate::training::check_run;
use crate::{corpus, parse_dtype};

/// How the layers are computed: candle-nn's, or the toolkit's lean layers
/// with the attention kept as PyTorch keeps it, or tiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Recipe {
    /// candle-nn's Linear, GELU and cross-entropy; the naive attention.
    Candle,
    /// The toolkit's lean layers and cross-entropy; the attention's
    /// probabilities kept as one tensor.
    Lean,
    /// The lean layers with tiled attention.
    Tiled,
}

impl Recipe {
    /// The name used in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Recipe::Candle => "candle",
            Recipe::Lean => "lean",
            Recipe::Tiled => "tiled",
        }
    }

    /// `model` computed this way.
    pub fn apply(self, model: GptConfig) -> GptConfig {
        let (attention, lean) = match self {
            Recipe::Candle => (AttentionKind::Naive, false),
            Recipe::Lean => (AttentionKind::Materialized, true),
            Recipe::Tiled => (AttentionKind::Tiled, true),
        };
        GptConfig {
            attention,
            lean,
            ..model
        }
    }
}

/// Parameters of the `saved_tensors` cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// The model (its `attention` and `lean` are set by each recipe).
    pub model: GptConfig,
    /// Sequences per batch (b).
    pub batch: usize,
    /// The dtype of parameters and activations: `f32`, `f16` or `bf16`.
    pub dtype: String,
    /// The ways of computing the layers to compare.
    pub recipes: Vec<Recipe>,
    /// Seed of weights and data.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            model: GptConfig::default(),
            batch: 4,
            dtype: "f32".into(),
            recipes: vec![Recipe::Candle, Recipe::Lean, Recipe::Tiled],
            seed: 5,
        }
    }
}

/// Whether a held tensor is one of the attention's `(b, a, s, s)` matrices.
fn is_quadratic(shape: &[usize], batch: usize, heads: usize, seq: usize) -> bool {
    shape == [batch, heads, seq, seq]
}

/// The `saved_tensors` plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct SavedTensors;

impl Plugin for SavedTensors {
    type Params = Params;

    fn name(&self) -> &str {
        "saved_tensors"
    }

    fn description(&self) -> &str {
        "every tensor a GPT's graph holds for the backward, per part, beside Korthikanti's terms"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        check_run(&mut r, &p.model, p.batch, 1, &p.dtype);
        if p.recipes.is_empty() {
            r.violation(
                "recipes",
                "[]",
                "allowed: a list of at least 1 of candle, lean, tiled",
            );
        }
        r.into_violations()
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::bytes(
                "ledger_{recipe}",
                "bytes the graph holds at the end of the forward, from the ledger, per recipe",
            ),
            MetricSpec::bytes(
                "measured_{recipe}",
                "activation bytes live at the end of the forward, counted by the allocator",
            ),
            MetricSpec::ratio(
                "coverage_{recipe}",
                "ledger bytes over the allocator's activation bytes at the end of the forward",
            ),
            MetricSpec::number(
                "linear_units_{recipe}",
                "one block's held bytes without the s x s matrices over s·b·h·e/2 (Korthikanti: 34; 32 without dropout)",
            ),
            MetricSpec::number(
                "quadratic_units_{recipe}",
                "one block's s x s matrices over a·s²·b·e/2 (Korthikanti: 5; 2 without dropout)",
            ),
            MetricSpec::count("tensors_{recipe}", "storages one block holds"),
            MetricSpec::bytes("korthikanti_layer", "s·b·h·(34 + 5·a·s/h) scaled to the dtype"),
            MetricSpec::bytes("block_{recipe}", "bytes one block holds, from the ledger"),
        ]
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        let dtype = parse_dtype(&p.dtype)?;
        let device = ctx.device().clone();
        let c = p.model;
        let elem = dtype.size_in_bytes() as u64;
        let run = Run {
            layers: c.layers as u64,
            hidden: c.hidden as u64,
            heads: c.heads as u64,
            seq: c.seq as u64,
            batch: p.batch as u64,
            vocab: c.vocab as u64,
            params: c.param_count(),
            elem,
        };
        // Units of the paper's terms scaled to the dtype, as
        // `korthikanti_layer` is: its 34 and 5 count bytes of 16-bit values,
        // so one s·b·h tensor of the dtype is 2 units.
        let sbh_unit = (run.seq * run.batch * run.hidden * elem) as f64 / 2.0;
        let s2_unit = (run.heads * run.seq * run.seq * run.batch * elem) as f64 / 2.0;
        ctx.metric("korthikanti_layer", run.korthikanti_layer() as f64);
        let mid = c.layers / 2;
        let mut summary = Table::new(
            format!("One block (block {mid}) of the graph, per recipe"),
            &[
                ("recipe", Unit::None),
                ("tensors", Unit::Count),
                ("bytes", Unit::Bytes),
                ("s·b·h units", Unit::None),
                ("a·s²·b units", Unit::None),
                ("whole graph", Unit::Bytes),
                ("allocator, activations", Unit::Bytes),
            ],
        );
        for recipe in &p.recipes {
            let name = recipe.name();
            let cfg = recipe.apply(c);
            ctx.progress(&format!("the {name} recipe's graph"));
            let mut rng = Rng::seeded(p.seed);
            let model = Gpt::new(cfg, dtype, &mut rng, &device)?;
            let (x, y) = Category::Inputs
                .scope(|| corpus::batch(&mut rng, p.batch, c.seq, c.vocab, &device))?;
            // The allocator's count, from a forward without labels.
            let region = ctx.region(format!("forward, {name}"));
            let notes = Labeller::unlabelled();
            let loss = Category::Activations.scope(|| model.loss(&x, &y, &notes))?;
            let measured = region.current_above_baseline().get(Category::Activations);
            let unlabelled = Category::Other.scope(|| Ledger::of(&loss, &notes))?;
            drop((loss, notes));
            ctx.end_region(region);
            // The same forward, labelled part by part.
            let labels = Labeller::new();
            let loss = model.loss(&x, &y, &labels)?;
            let ledger = Ledger::of(&loss, &labels)?;
            drop(loss);
            if ledger.total_bytes() != unlabelled.total_bytes() {
                anyhow::bail!(
                    "the labelled forward held {} bytes, the unlabelled one {}",
                    ledger.total_bytes(),
                    unlabelled.total_bytes()
                );
            }
            let mut parts = Table::new(
                format!("What block {mid} holds for the backward, {name} recipe"),
                &[
                    ("part", Unit::None),
                    ("shape", Unit::None),
                    ("dtype", Unit::None),
                    ("bytes", Unit::Bytes),
                    ("views", Unit::Count),
                ],
            );
            let (mut linear, mut quadratic, mut count) = (0u64, 0u64, 0usize);
            for h in ledger.layer(mid) {
                count += 1;
                if is_quadratic(&h.shape, p.batch, c.heads, c.seq) {
                    quadratic += h.bytes;
                } else {
                    linear += h.bytes;
                }
                let part = h.label.as_ref().map_or("unlabelled", |l| l.part.as_str());
                parts.row(vec![
                    part.into(),
                    format!("{:?}", h.shape).into(),
                    format!("{:?}", h.dtype).to_lowercase().into(),
                    h.bytes.into(),
                    (h.nodes as u64).into(),
                ]);
            }
            ctx.table(parts);
            let total = ledger.total_bytes();
            ctx.metric(format!("ledger_{name}"), total as f64);
            ctx.metric(format!("measured_{name}"), measured as f64);
            ctx.metric(format!("coverage_{name}"), total as f64 / measured as f64);
            ctx.metric(format!("linear_units_{name}"), linear as f64 / sbh_unit);
            ctx.metric(
                format!("quadratic_units_{name}"),
                quadratic as f64 / s2_unit,
            );
            ctx.metric(format!("tensors_{name}"), count as f64);
            ctx.metric(format!("block_{name}"), (linear + quadratic) as f64);
            summary.row(vec![
                name.into(),
                (count as u64).into(),
                (linear + quadratic).into(),
                (linear as f64 / sbh_unit).into(),
                (quadratic as f64 / s2_unit).into(),
                total.into(),
                measured.into(),
            ]);
        }
        ctx.table(summary);
        Ok(())
    }
}
