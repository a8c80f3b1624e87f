//! Chapter 5's cells: today's decoders (Llama, Qwen2, Mistral) built from
//! their Hugging Face `config.json`. `decoder_shapes` counts the published
//! models' parameters from their shapes and what training them holds;
//! `decoder_step` trains one at its real size (or scaled down) and measures
//! the step's peak by category, with the logits' share and what the fused
//! loss saves, beside the closed-form prediction and the public estimators'
//! figure.
#![warn(missing_docs)]

// The experiments name this crate by its name, as a notebook cell does.
extern crate self as workbook_decoder;

mod params;
mod shapes;
mod step;

pub use params::{Published, ShapesParams, StepParams};
pub use shapes::decoder_shapes_experiment;
pub use step::decoder_step_experiment;
pub use workbook_planner::decoder::{
    predict, predict_peak, saved_per_block, train_measured, DecoderRecipe, Measured, Prediction,
    Run, Sharing,
};

use std::path::{Path, PathBuf};

use workbook_models::llama::{ConfigError, LlamaConfig, Loss};
use workbook_sdk::file::FileError;
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{anyhow, Context, NotebookSource, Plugin, Rules, Violation};

/// Where a model's `config.json` is: an absolute path, a path from the
/// working directory, or one from the repository's root (where `models/`
/// holds the published shapes), in that order. (A chapter's cell has had a
/// path its folder holds joined to that folder already: see
/// `workbook_sdk::file::PATH_FORMAT`.)
pub fn resolve(path: &str) -> PathBuf {
    let given = PathBuf::from(path);
    if given.is_absolute() || given.exists() {
        return given;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let from_root = root.join(&given);
    if from_root.exists() {
        from_root
    } else {
        given
    }
}

/// Reads the `config.json` at `path` (see [`resolve`]).
pub fn load(path: &str) -> anyhow::Result<LlamaConfig> {
    Ok(LlamaConfig::from_file(resolve(path))?)
}

/// A short name for a model from its file: `smollm2_135m` for
/// `models/smollm2-135m.config.json`.
pub fn short_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = file.trim_end_matches(".json").trim_end_matches(".config");
    stem.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// f32 parameters, their gradients and AdamW's two moments: 16 bytes a
/// parameter (saturating: no config reaches it, see
/// `LlamaConfig::MAX_PARAMETERS`).
pub fn state_bytes(params: u64) -> u64 {
    params.saturating_mul(16)
}

/// The model a `decoder_step` cell trains: its config, scaled down when
/// `layers` or `divisor` say so.
pub fn model_config(p: &StepParams) -> anyhow::Result<LlamaConfig> {
    let cfg = load(&p.config)?;
    Ok(if p.layers.is_some() || p.divisor > 1 {
        cfg.scaled(p.layers.unwrap_or(cfg.layers), p.divisor)
    } else {
        cfg
    })
}

/// Every variant a `decoder_step` cell runs, in order: each compute dtype,
/// each loss, each of `checkpointing`, `micro_batches` and `optimizers`.
pub fn recipes(p: &StepParams) -> anyhow::Result<Vec<DecoderRecipe>> {
    let mut out = Vec::new();
    for dtype in &p.dtypes {
        let compute = workbook_sdk::parse_dtype(dtype)?;
        for loss in &p.losses {
            let loss = if loss == "fused" {
                Loss::Fused
            } else {
                Loss::Plain
            };
            for &checkpoint in &p.checkpointing {
                for &micro_batches in &p.micro_batches {
                    for optimizer in &p.optimizers {
                        out.push(DecoderRecipe {
                            compute,
                            loss,
                            checkpoint,
                            micro_batches,
                            sharing: sharing(optimizer, p.ranks)?,
                        });
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The [`Sharing`] an `optimizers` entry names.
pub fn sharing(name: &str, ranks: usize) -> anyhow::Result<Sharing> {
    Ok(match name {
        "device" => Sharing::Device,
        "offload" => Sharing::Offload,
        "zero1" => Sharing::Zero1 { ranks },
        "zero2" => Sharing::Zero2 { ranks },
        other => anyhow::bail!("`{other}` is no optimizer; allowed: device, offload, zero1, zero2"),
    })
}

/// The config at `path`, or a violation of `field` saying why not.
fn check_config(r: &mut Rules, field: &str, path: &str) -> Option<LlamaConfig> {
    match LlamaConfig::from_file(resolve(path)) {
        Ok(cfg) => Some(cfg),
        Err(e) => {
            // A relative path found nowhere: say where it was looked for.
            let searched = match &e {
                ConfigError::Read(FileError::Io { cause, .. })
                    if cause.kind() == std::io::ErrorKind::NotFound
                        && Path::new(path).is_relative() =>
                {
                    ", from the chapter's folder, the working directory or the repository's root"
                }
                _ => "",
            };
            r.violation(
                field,
                path,
                format!("allowed: a Llama-family config.json{searched} ({e})"),
            );
            None
        }
    }
}

/// A violation of `field` at the first entry of `list` that an earlier
/// one repeats.
fn once<T: PartialEq + std::fmt::Debug>(r: &mut Rules, field: &str, list: &[T]) {
    let repeat = list.iter().enumerate().find_map(|(i, v)| {
        let first = list[..i].iter().position(|earlier| earlier == v)?;
        Some((first, i))
    });
    if let Some((first, i)) = repeat {
        r.violation(
            format!("{field}[{i}]"),
            format!("{:?}", list[i]),
            format!(
                "allowed: each at most once ({field}[{first}] is {:?} already)",
                list[first]
            ),
        );
    }
}

/// The `decoder_shapes` cell.
#[derive(Debug, Default, Clone, Copy)]
pub struct DecoderShapes;

impl Plugin for DecoderShapes {
    type Params = ShapesParams;

    fn name(&self) -> &str {
        "decoder_shapes"
    }

    fn description(&self) -> &str {
        "published decoders' parameters counted from their config.json, and what training them holds"
    }

    fn validate(&self, p: &ShapesParams) -> Vec<Violation> {
        let mut r = Rules::new();
        if p.models.is_empty() {
            r.violation("models", "[]", "allowed: a list of at least 1 model");
        }
        for (i, m) in p.models.iter().enumerate() {
            check_config(&mut r, &format!("models[{i}].config"), &m.config);
            // Each model's metrics are named by its file's name.
            let name = short_name(&m.config);
            if let Some(first) = p.models[..i]
                .iter()
                .position(|o| short_name(&o.config) == name)
            {
                r.violation(
                    format!("models[{i}].config"),
                    &m.config,
                    format!(
                        "allowed: a file whose name is not models[{first}]'s: each model's \
                         metrics are named by its file's name (`params_{name}`), so rename one \
                         (a Hugging Face download's config.json to the model's name, say)"
                    ),
                );
            }
        }
        r.positive("device_gib", p.device_gib);
        r.into_violations()
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::count(
                "params_{model}",
                "parameters counted from the shapes of a model of `models` (its file's name)",
            ),
            MetricSpec::count("published_{model}", "the model's published parameter count"),
            MetricSpec::count(
                "built_{model}",
                "parameters counted from the variables of the model built, for models of at most \
                 `build_limit` parameters",
            ),
            MetricSpec::bytes(
                "state_{model}",
                "parameters, gradients and AdamW's moments in f32 (16 bytes a parameter)",
            ),
            MetricSpec::ratio(
                "state_share_{model}",
                "that training state over `device_gib` GiB",
            ),
        ]
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_decoder::DecoderShapes",
            entry: "decoder_shapes_experiment",
            params: "ShapesParams",
            source: "shapes.rs",
        })
    }

    fn run(&self, ctx: &mut Context, p: ShapesParams) -> anyhow::Result<()> {
        shapes::decoder_shapes_experiment(ctx, p)
    }
}

/// The `decoder_step` cell.
#[derive(Debug, Default, Clone, Copy)]
pub struct DecoderStep;

impl Plugin for DecoderStep {
    type Params = StepParams;

    fn name(&self) -> &str {
        "decoder_step"
    }

    fn description(&self) -> &str {
        "a decoder from its config.json trained a few steps: the peak by category, the logits' \
         share, the fused loss, checkpointing, micro-batches, optimizer offload, ZeRO, the \
         closed-form prediction and the public estimators"
    }

    fn validate(&self, p: &StepParams) -> Vec<Violation> {
        let mut r = Rules::new();
        let cfg = check_config(&mut r, "config", &p.config);
        if let (Some(layers), Some(cfg)) = (p.layers, &cfg) {
            r.between("layers", layers, 1, cfg.layers);
        }
        // The model built attends within its window only up to the window.
        if let Some(window) = cfg.and_then(|c| c.sliding_window) {
            if p.seq > window {
                r.violation(
                    "seq",
                    p.seq.to_string(),
                    format!(
                        "allowed: at most the config's attention window (`sliding_window` \
                         {window}), which this decoder does not slide past"
                    ),
                );
            }
        }
        r.between("batch", p.batch, 1, 1 << 16)
            .between("seq", p.seq, 2, 1 << 16)
            .at_least("steps", p.steps, 2)
            .between("divisor", p.divisor, 1, 1 << 12)
            .positive("lr", p.lr);
        if p.checkpointing.is_empty() {
            r.violation("checkpointing", "[]", "allowed: a list of at least 1 entry");
        }
        if p.micro_batches.is_empty() {
            r.violation("micro_batches", "[]", "allowed: a list of at least 1 entry");
        }
        let zero = p.optimizers.iter().any(|o| o.starts_with("zero"));
        // What a rank trains on: the batch, or its share of the ranks'.
        let rows = if zero {
            p.batch / p.ranks.max(1)
        } else {
            p.batch
        };
        let bad_ranks = zero && (p.ranks < 2 || !p.batch.is_multiple_of(p.ranks));
        if bad_ranks {
            r.violation(
                "ranks",
                p.ranks.to_string(),
                format!(
                    "allowed with zero1 or zero2: at least 2, dividing batch ({})",
                    p.batch
                ),
            );
        }
        // Micro-batches split a rank's share: not checked against ranks
        // that do not split the batch.
        for (i, m) in p.micro_batches.iter().enumerate().filter(|_| !bad_ranks) {
            if *m == 0 || !rows.is_multiple_of(*m) {
                r.violation(
                    format!("micro_batches[{i}]"),
                    m.to_string(),
                    if zero {
                        format!("allowed: a divisor of batch / ranks ({rows})")
                    } else {
                        format!("allowed: a divisor of batch ({rows})")
                    },
                );
            }
        }
        if p.optimizers.iter().any(|o| o == "zero2") && p.checkpointing.contains(&false) {
            r.violation(
                "checkpointing",
                format!("{:?}", p.checkpointing),
                "allowed with zero2: [true] (stage 2 reduce-scatters each layer's gradients as \
                 the checkpointed backward makes them)",
            );
        }
        for (field, list, allowed) in [
            ("dtypes", &p.dtypes, &["f32", "bf16"][..]),
            ("losses", &p.losses, &["plain", "fused"][..]),
            (
                "optimizers",
                &p.optimizers,
                &["device", "offload", "zero1", "zero2"][..],
            ),
        ] {
            if list.is_empty() {
                r.violation(field, "[]", "allowed: a list of at least 1 entry");
            }
            for (i, v) in list.iter().enumerate() {
                r.one_of(&format!("{field}[{i}]"), v, allowed);
            }
        }
        // A variant listed twice would run twice under one metric name.
        once(&mut r, "dtypes", &p.dtypes);
        once(&mut r, "losses", &p.losses);
        once(&mut r, "optimizers", &p.optimizers);
        once(&mut r, "checkpointing", &p.checkpointing);
        once(&mut r, "micro_batches", &p.micro_batches);
        r.into_violations()
    }

    fn memory_floor(&self, p: &StepParams) -> Option<(u64, String)> {
        let cfg = model_config(p).ok()?;
        let params = cfg.parameter_count();
        Some((
            state_bytes(params),
            format!("{params} parameters in f32 with their gradients and AdamW's two moments"),
        ))
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::count("params", "parameters of the model trained"),
            MetricSpec::bytes(
                "state_bytes",
                "its f32 parameters, gradients and AdamW moments, analytic (16 bytes a parameter)",
            ),
            MetricSpec::bytes(
                "logits_bytes",
                "the logits of one step in f32, batch x seq x vocab x 4, analytic",
            ),
            MetricSpec::bytes(
                "peak_{variant}",
                "the step's measured peak on the device (an offloaded optimizer's host memory \
                 left out; with ZeRO, rank 0's), per variant: `{dtype}_{loss}` for each compute \
                 dtype of `dtypes` and loss of `losses`, with `_checkpointed` when checkpointed, \
                 `_m{n}` for n micro-batches above 1 and `_offload`, `_zero1` or `_zero2` for \
                 where AdamW's state lives",
            ),
            MetricSpec::bytes(
                "activations_{variant}",
                "at that peak, the bytes the forward made (what the graph keeps for the backward)",
            ),
            MetricSpec::bytes(
                "predicted_{variant}",
                "the closed-form prediction of that peak",
            ),
            MetricSpec::ratio(
                "prediction_error_{variant}",
                "|predicted - measured| / measured",
            ),
            MetricSpec::ratio(
                "estimator_error_{variant}",
                "(16 bytes a parameter - measured) / measured: accelerate's estimate-memory \
                 for training with Adam in f32, model states alone, no activations",
            ),
            MetricSpec::bytes(
                "fused_saves_{dtype}",
                "the plain loss's peak minus the fused loss's, per compute dtype",
            ),
            MetricSpec::ratio(
                "logits_share_{dtype}",
                "that saving over the plain loss's peak",
            ),
            MetricSpec::number("loss_first_{variant}", "the first step's loss"),
            MetricSpec::number("loss_last_{variant}", "the last step's loss"),
            MetricSpec::number("loss_uniform", "ln(vocab): a uniform guess's loss"),
            MetricSpec::seconds("step_seconds_{variant}", "median seconds per step"),
        ]
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_decoder::DecoderStep",
            entry: "decoder_step_experiment",
            params: "StepParams",
            source: "step.rs",
        })
    }

    fn run(&self, ctx: &mut Context, p: StepParams) -> anyhow::Result<()> {
        step::decoder_step_experiment(ctx, p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names_are_the_files_stem_in_metric_characters() {
        assert_eq!(
            short_name("models/smollm2-135m.config.json"),
            "smollm2_135m"
        );
        assert_eq!(short_name("qwen2.5-0.5b.config.json"), "qwen2_5_0_5b");
        assert_eq!(short_name("/abs/my model.json"), "my_model");
    }

    #[test]
    fn the_published_shapes_resolve_from_any_working_directory() {
        let resolved = resolve("models/smollm2-135m.config.json");
        assert!(resolved.exists(), "{}", resolved.display());
        assert_eq!(resolve("no/such.json"), PathBuf::from("no/such.json"));
    }
}
