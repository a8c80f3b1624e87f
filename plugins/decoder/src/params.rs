//! The cells' parameters.

use serde::{Deserialize, Serialize};

/// One published model of the `decoder_shapes` cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Published {
    /// Its `config.json`: an absolute path, or one from the chapter's
    /// folder, the working directory or the repository's root, the first
    /// that holds it.
    #[schemars(extend("format" = "path"))]
    pub config: String,
    /// Its published parameter count.
    pub published: u64,
}

/// Parameters of the `decoder_shapes` cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ShapesParams {
    /// The models, each with its published count.
    pub models: Vec<Published>,
    /// Models of at most this many parameters are also built (in bf16),
    /// and their variables counted.
    pub build_limit: u64,
    /// The memory their training state is set against (GiB; an H100's 80 GB
    /// are 74.5 GiB).
    pub device_gib: f64,
}

impl Default for ShapesParams {
    fn default() -> Self {
        let m = |config: &str, published: u64| Published {
            config: format!("models/{config}.config.json"),
            published,
        };
        Self {
            models: vec![
                m("smollm2-135m", 134_515_008),
                m("qwen2.5-0.5b", 494_032_768),
                m("llama-3.2-1b", 1_235_814_400),
                m("mistral-7b-v0.1", 7_241_732_096),
                m("qwen2.5-7b", 7_615_616_512),
                m("llama-3.1-8b", 8_030_261_248),
            ],
            build_limit: 200_000_000,
            device_gib: 80e9 / (1u64 << 30) as f64,
        }
    }
}

/// Parameters of the `decoder_step` cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct StepParams {
    /// The model's `config.json`: an absolute path, or one from the
    /// chapter's folder, the working directory or the repository's root,
    /// the first that holds it (`models/smollm2-135m.config.json`).
    #[schemars(extend("format" = "path"))]
    pub config: String,
    /// Blocks to build, at most the config's (fewer scale it down).
    pub layers: Option<usize>,
    /// Widths and vocabulary divided by this (1: the real size; heads kept).
    pub divisor: usize,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Steps per variant (the first, which makes AdamW's moments, included).
    pub steps: usize,
    /// Compute dtypes: `f32`, or `bf16` from f32 master weights.
    pub dtypes: Vec<String>,
    /// Losses: `plain` (the whole logits) and `fused` (row chunks).
    pub losses: Vec<String>,
    /// Activation checkpointing, per variant: `false` (the graph keeps
    /// every block's tensors for the backward) or `true` (each block's input
    /// only, the block run again in the backward).
    pub checkpointing: Vec<bool>,
    /// Micro-batches per step, per variant: the batch split into this many
    /// equal parts whose gradients are summed (1: the whole batch at once).
    /// Each must divide `batch`.
    pub micro_batches: Vec<usize>,
    /// Where AdamW's state lives, per variant: `device` (beside the
    /// parameters), `offload` (f32 masters and moments on the host),
    /// `zero1` (the moments partitioned over `ranks`, the gradients
    /// reduce-scattered after the backward) or `zero2` (the gradients
    /// partitioned too, reduce-scattered as each layer's are made:
    /// checkpointed variants only). ZeRO runs rank 0 of `ranks`, its peers
    /// rehearsed in this process.
    pub optimizers: Vec<String>,
    /// Ranks of the ZeRO variants; each trains on `batch / ranks`
    /// sequences.
    pub ranks: usize,
    /// AdamW's learning rate.
    pub lr: f64,
    /// Seed of weights and tokens.
    pub seed: u64,
}

impl Default for StepParams {
    fn default() -> Self {
        Self {
            config: "models/smollm2-135m.config.json".into(),
            layers: None,
            divisor: 1,
            batch: 1,
            seq: 256,
            steps: 3,
            dtypes: vec!["f32".into(), "bf16".into()],
            losses: vec!["plain".into(), "fused".into()],
            checkpointing: vec![false],
            micro_batches: vec![1],
            optimizers: vec!["device".into()],
            ranks: 1,
            lr: 1e-3,
            seed: 5,
        }
    }
}
