//! Which layers a GPT is computed with.

use serde::{Deserialize, Serialize};

use super::{AttentionKind, GptConfig};
// For the documentation's links only.
#[cfg(doc)]
use super::Gpt;

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
    /// The lean layers and materialized attention with no graph: each
    /// stage's backward called directly ([`Gpt::direct_loss_with`]).
    Direct,
    /// The direct backward with tiled attention.
    DirectTiled,
}

impl Recipe {
    /// The name used in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Recipe::Candle => "candle",
            Recipe::Lean => "lean",
            Recipe::Tiled => "tiled",
            Recipe::Direct => "direct",
            Recipe::DirectTiled => "direct_tiled",
        }
    }

    /// Every recipe, in the order the command line lists them.
    pub const ALL: [Recipe; 5] = [
        Recipe::Candle,
        Recipe::Lean,
        Recipe::Tiled,
        Recipe::Direct,
        Recipe::DirectTiled,
    ];

    /// The recipe whose [`Recipe::name`] is `name`.
    pub fn from_name(name: &str) -> Option<Recipe> {
        Self::ALL.into_iter().find(|r| r.name() == name)
    }

    /// Whether the backward is the direct one, with no graph.
    pub fn direct(self) -> bool {
        matches!(self, Recipe::Direct | Recipe::DirectTiled)
    }

    /// `model` computed this way.
    pub fn apply(self, model: GptConfig) -> GptConfig {
        let (attention, lean) = match self {
            Recipe::Candle => (AttentionKind::Naive, false),
            Recipe::Lean => (AttentionKind::Materialized, true),
            Recipe::Tiled | Recipe::DirectTiled => (AttentionKind::Tiled, true),
            Recipe::Direct => (AttentionKind::Materialized, true),
        };
        GptConfig {
            attention,
            lean,
            ..model
        }
    }
}
