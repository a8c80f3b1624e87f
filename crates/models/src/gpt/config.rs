//! A GPT's shape and how its attention is computed.

use serde::{Deserialize, Serialize};

// For the documentation's links only.
#[cfg(doc)]
use super::Gpt;

/// How the attention's core `softmax(Q K^T / sqrt(d)) V` is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKind {
    /// candle's own operations: the scores, the masked scores and the
    /// softmax's intermediates all stay in the graph.
    Naive,
    /// One operation for scores and softmax, whose graph keeps the
    /// probabilities only, as PyTorch's autograd does.
    Materialized,
    /// Tiled (FlashAttention): no `s x s` matrix is kept; the backward
    /// recomputes it block by block.
    Tiled,
}

impl AttentionKind {
    /// The name used in parameters and metrics.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Naive => "naive",
            AttentionKind::Materialized => "materialized",
            AttentionKind::Tiled => "tiled",
        }
    }
}

/// The fields a step's violations ([`GptConfig::check_step`]) are named by.
#[derive(Debug, Clone, Copy)]
pub struct StepFields<'a> {
    /// The model's table (`model`); its hidden size is `{model}.hidden`.
    pub model: &'a str,
    /// The field blamed for the token table's size (`model.vocab`).
    pub table: &'a str,
    /// The batch (`batch`).
    pub batch: &'a str,
}

impl StepFields<'static> {
    /// A cell's `model` table and `batch`.
    pub const MODEL: Self = StepFields {
        model: "model",
        table: "model.vocab",
        batch: "batch",
    };
}

/// The shape of a GPT and how its layers are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    /// Transformer blocks (L).
    pub layers: usize,
    /// Hidden size (h); a multiple of `heads`.
    pub hidden: usize,
    /// Attention heads (a).
    pub heads: usize,
    /// Longest sequence, the position table's length (s).
    pub seq: usize,
    /// Vocabulary (v).
    pub vocab: usize,
    /// The attention's core.
    pub attention: AttentionKind,
    /// The toolkit's lean layers (fused bias and GELU, one-operation layer
    /// norm and cross-entropy) instead of candle-nn's.
    pub lean: bool,
    /// The head shares the token embedding's table, as GPT-2's does (the
    /// default); `false` gives it a table of its own, `h·v` parameters more,
    /// as Llama's.
    #[serde(default = "tied")]
    pub tied_head: bool,
}

/// serde's default for [`GptConfig::tied_head`].
fn tied() -> bool {
    true
}

impl Default for GptConfig {
    /// Chapter 3's model at full size: 4 blocks, hidden 256, 4 heads, 256
    /// positions, a vocabulary of 512, lean layers with the attention's
    /// probabilities kept.
    fn default() -> Self {
        Self {
            layers: 4,
            hidden: 256,
            heads: 4,
            seq: 256,
            vocab: 512,
            attention: AttentionKind::Materialized,
            lean: true,
            tied_head: true,
        }
    }
}

impl GptConfig {
    /// Checks the fields a cell's parameters give for the model, each named
    /// under `field` (`model.layers`, ...).
    pub fn check(&self, r: &mut workbook_sdk::Rules, field: &str) {
        r.at_least(&format!("{field}.layers"), self.layers, 1)
            .at_least(&format!("{field}.heads"), self.heads, 1)
            .at_least(&format!("{field}.seq"), self.seq, 1)
            .at_least(&format!("{field}.vocab"), self.vocab, 2);
        r.require(
            self.heads > 0 && self.hidden > 0 && self.hidden.is_multiple_of(self.heads),
            &format!("{field}.hidden"),
            self.hidden.to_string(),
            &format!("allowed: a positive multiple of heads ({})", self.heads),
        );
    }

    /// Whether a step holds every head's whole score matrix at once: any
    /// attention but the tiled one.
    pub fn holds_scores(&self) -> bool {
        self.attention != AttentionKind::Tiled
    }

    /// Checks that a step of this model on `batch` sequences can be counted
    /// and allocated at all: a parameter count that fits 64 bits, and the
    /// largest tensors (the token table, an MLP weight of 4h² elements, the
    /// MLP's 4h-wide activations, the logits and, with `scores`, every
    /// head's attention scores) each within the 2^40 elements a cell may
    /// hold. Violations are named as `fields` says.
    pub fn check_step(
        &self,
        r: &mut workbook_sdk::Rules,
        fields: StepFields<'_>,
        batch: usize,
        scores: bool,
    ) {
        r.require(
            self.checked_param_count().is_some(),
            fields.model,
            format!("{} blocks of hidden {}", self.layers, self.hidden),
            "allowed: a parameter count that fits 64 bits",
        );
        let (b, s, h, v) = (
            batch as u64,
            self.seq as u64,
            self.hidden as u64,
            self.vocab as u64,
        );
        r.elements(fields.table, "hidden × vocab", &[h, v])
            .elements(
                &format!("{}.hidden", fields.model),
                "4 × hidden × hidden",
                &[4, h, h],
            )
            .elements(fields.batch, "batch × seq × 4 × hidden", &[b, s, 4, h])
            .elements(fields.batch, "batch × seq × vocab", &[b, s, v]);
        if scores {
            r.elements(
                fields.batch,
                "batch × heads × seq × seq",
                &[b, self.heads as u64, s, s],
            );
        }
    }

    /// Parameters of the model: `h·v + s·h + L·(12h² + 13h) + 2h` with the
    /// head tied to the token embedding, `h·v` more with a head of its own.
    ///
    /// ```
    /// use workbook_models::{AttentionKind, GptConfig};
    /// // GPT-2 small: 124,439,808 parameters with its 1024 positions.
    /// let c = GptConfig { layers: 12, hidden: 768, heads: 12, seq: 1024, vocab: 50257,
    ///                     attention: AttentionKind::Naive, lean: false, tied_head: true };
    /// assert_eq!(c.param_count(), 124_439_808);
    /// let untied = GptConfig { tied_head: false, ..c };
    /// assert_eq!(untied.param_count(), 124_439_808 + 768 * 50257);
    /// ```
    pub fn param_count(&self) -> u64 {
        self.checked_param_count().unwrap_or(u64::MAX)
    }

    /// [`param_count`](Self::param_count), `None` where it overflows `u64`
    /// (sizes a planner must refuse rather than wrap).
    pub fn checked_param_count(&self) -> Option<u64> {
        let (l, h, s, v) = (
            self.layers as u64,
            self.hidden as u64,
            self.seq as u64,
            self.vocab as u64,
        );
        let block = h
            .checked_mul(h)?
            .checked_mul(12)?
            .checked_add(h.checked_mul(13)?)?;
        let tables = if self.tied_head { 1u64 } else { 2 };
        h.checked_mul(v)?
            .checked_mul(tables)?
            .checked_add(s.checked_mul(h)?)?
            .checked_add(l.checked_mul(block)?)?
            .checked_add(h.checked_mul(2)?)
    }

    /// Elements of each parameter tensor, in [`Gpt::vars`]'s order.
    pub fn param_sizes(&self) -> Vec<usize> {
        let (h, s, v) = (self.hidden, self.seq, self.vocab);
        let block = [
            h,
            h,
            3 * h * h,
            3 * h,
            h * h,
            h,
            h,
            h,
            4 * h * h,
            4 * h,
            4 * h * h,
            h,
        ];
        let mut sizes = vec![v * h, s * h];
        for _ in 0..self.layers {
            sizes.extend(block);
        }
        sizes.extend([h, h]);
        if !self.tied_head {
            sizes.push(v * h);
        }
        sizes
    }
}
