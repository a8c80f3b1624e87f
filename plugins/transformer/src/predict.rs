//! The memory predictors people use, each as its formula.

use serde::Serialize;

/// What a predictor knows of a training run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Run {
    /// Transformer blocks (L).
    pub layers: u64,
    /// Hidden size (h).
    pub hidden: u64,
    /// Attention heads (a).
    pub heads: u64,
    /// Sequence length (s).
    pub seq: u64,
    /// Batch (b).
    pub batch: u64,
    /// Vocabulary (v).
    pub vocab: u64,
    /// Parameters.
    pub params: u64,
    /// Bytes per element of parameters, gradients, moments and activations.
    pub elem: u64,
}

impl Run {
    /// Parameters, gradients and AdamW's two moments, all in the training
    /// dtype: `4 · P · e`.
    pub fn model_states(&self) -> u64 {
        4 * self.params * self.elem
    }

    /// `s · b · h`.
    fn sbh(&self) -> u64 {
        self.seq * self.batch * self.hidden
    }

    /// Korthikanti et al.'s activations of one layer without recomputation,
    /// `s·b·h·(34 + 5·a·s/h)` bytes for 16-bit activations, scaled to this
    /// run's element size (`e / 2`).
    pub fn korthikanti_layer(&self) -> u64 {
        (34 * self.sbh() + 5 * self.heads * self.seq * self.seq * self.batch) * self.elem / 2
    }
}

/// A named way of predicting a training step's peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Predictor {
    /// Model states + L · s·b·h·(34 + 5·a·s/h) (Korthikanti et al. 2022,
    /// no recomputation).
    KorthikantiNone,
    /// Model states + L · 34·s·b·h (selective recomputation: the
    /// attention's core recomputed).
    KorthikantiSelective,
    /// Model states + L · 2·s·b·h (full recomputation: each layer's input).
    KorthikantiFull,
    /// The Hugging Face blog's rule: parameters + optimizer state +
    /// max(gradients + optimizer intermediates, activations), the
    /// intermediates one parameter-sized buffer, the activations
    /// Korthikanti's.
    HfBlog,
    /// accelerate's `estimate-memory` for training with Adam: 4x the model's
    /// size, no activation term.
    Accelerate,
    /// DeepSpeed's model-states estimate on one device: 20 bytes per
    /// parameter (16-bit parameters and gradients, f32 master weights and
    /// moments), no activation term.
    DeepSpeed,
    /// The workbook's: model states + the batch + the ledger's bytes (what
    /// the graph holds, read from the graph) + the backward's working set,
    /// two tensors the size of the largest held tensor (its gradient and
    /// the one it produces).
    Ledger,
    /// The workbook's calibrated one: the same step measured at batch 1 and
    /// 2, extrapolated along the batch. Everything a step holds either does
    /// not depend on the batch (parameters, gradients, optimizer state) or
    /// grows with it in proportion (activations, the backward's working
    /// set), so two small runs fix both parts.
    Calibrated,
}

impl Predictor {
    /// All predictors, in table order.
    pub const ALL: [Predictor; 8] = [
        Predictor::KorthikantiNone,
        Predictor::KorthikantiSelective,
        Predictor::KorthikantiFull,
        Predictor::HfBlog,
        Predictor::Accelerate,
        Predictor::DeepSpeed,
        Predictor::Ledger,
        Predictor::Calibrated,
    ];

    /// A short identifier, used in metric names.
    pub fn id(self) -> &'static str {
        match self {
            Predictor::KorthikantiNone => "korthikanti_none",
            Predictor::KorthikantiSelective => "korthikanti_selective",
            Predictor::KorthikantiFull => "korthikanti_full",
            Predictor::HfBlog => "hf_blog",
            Predictor::Accelerate => "accelerate",
            Predictor::DeepSpeed => "deepspeed",
            Predictor::Ledger => "ledger",
            Predictor::Calibrated => "calibrated",
        }
    }

    /// The predicted peak in bytes. `measured` holds what only a run can
    /// know (the ledger's predictor reads the graph): the others ignore it.
    pub fn predict(self, run: &Run, measured: &Measured) -> u64 {
        let states = run.model_states();
        let layers = run.layers;
        let p = run.params * run.elem;
        match self {
            Predictor::KorthikantiNone => states + layers * run.korthikanti_layer(),
            Predictor::KorthikantiSelective => states + layers * 34 * run.sbh() * run.elem / 2,
            Predictor::KorthikantiFull => states + layers * 2 * run.sbh() * run.elem / 2,
            Predictor::HfBlog => {
                let activations = layers * run.korthikanti_layer();
                p + 2 * p + (p + p).max(activations)
            }
            Predictor::Accelerate => 4 * p,
            Predictor::DeepSpeed => 20 * run.params,
            Predictor::Ledger => {
                states + measured.inputs + measured.ledger + 2 * measured.largest_held
            }
            Predictor::Calibrated => {
                let (one, two) = measured.calibration;
                let slope = two.saturating_sub(one);
                one + slope * run.batch.saturating_sub(1)
            }
        }
    }
}

/// What a run read from its graph, for the ledger's predictor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Measured {
    /// Bytes of the batch.
    pub inputs: u64,
    /// Bytes the graph holds at the end of the forward.
    pub ledger: u64,
    /// The largest tensor the graph holds.
    pub largest_held: u64,
    /// The step's peak measured at batch 1 and at batch 2.
    pub calibration: (u64, u64),
}
