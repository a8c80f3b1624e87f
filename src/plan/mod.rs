//! `workbook plan`: the planner's request from the command line or a model
//! file, and its answer as text, JSON and a plot: the GPT's plans
//! ([`gpt`]) and a decoder's from its config.json ([`decoder`]).

use std::path::Path;

use serde::Deserialize;
use workbook_models::{AttentionKind, GptConfig};
use workbook_sdk::file::{read_small, FileKind};

use crate::chapter::Location;
use crate::render::text::bytes;

pub mod decoder;
pub mod gpt;

pub use decoder::{
    decoder_fits_markdown, decoder_nothing_fits, decoder_text, decoder_verified_where,
};
pub use gpt::{figure, nothing_fits, text, verified};

/// A model file: the GPT's sizes, as `workbook plan --model FILE` reads it.
///
/// ```toml
/// layers = 4
/// hidden = 256
/// heads = 4
/// seq = 256
/// vocab = 512
/// tied_head = true   # the default; false: the head has a table of its own
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFile {
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size; a multiple of `heads`.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Sequence length.
    pub seq: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// The head shares the token embedding's table (the default); `false`
    /// gives it its own.
    #[serde(default = "tied")]
    pub tied_head: bool,
}

/// serde's default for [`ModelFile::tied_head`].
fn tied() -> bool {
    true
}

/// The largest model file read; a decoder's `config.json` is held to the
/// same bound ([`workbook_models::llama::MAX_CONFIG_FILE`]).
pub const MAX_MODEL_FILE: u64 = workbook_models::llama::MAX_CONFIG_FILE;

/// A `--model` file of the workbook's GPT, in TOML: a few lines, a few
/// hundred bytes.
pub const GPT_MODEL: FileKind = FileKind {
    name: "a model file",
    is: "a regular .toml file",
    holds: "`layers`, `hidden`, `heads`, `seq` and `vocab` (and `tied_head`)",
    max_bytes: MAX_MODEL_FILE,
};

impl ModelFile {
    /// Reads a model file, a regular file of at most [`MAX_MODEL_FILE`]
    /// bytes; errors name the file, line and column.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = read_small(path, GPT_MODEL)?;
        toml::from_str(&text).map_err(|e| match e.span() {
            Some(span) => {
                let at = Location::in_text(path, &text, span.start);
                anyhow::anyhow!("{at}: {}", e.message())
            }
            None => anyhow::anyhow!("{}: {}", path.display(), e.message()),
        })
    }

    /// The model, checked: sizes above zero, the hidden size a multiple of
    /// the heads. Errors name each size `{prefix}{field}`: `--hidden` for
    /// the command line's flags, `hidden` for a file's fields.
    pub fn config(&self, prefix: &str) -> anyhow::Result<GptConfig> {
        for (name, value) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("seq", self.seq),
        ] {
            if value == 0 {
                anyhow::bail!("`{prefix}{name}` is 0; allowed: at least 1");
            }
        }
        if self.vocab < 2 {
            anyhow::bail!("`{prefix}vocab` is {}; allowed: at least 2", self.vocab);
        }
        if !self.hidden.is_multiple_of(self.heads) {
            anyhow::bail!(
                "`{prefix}hidden` is {}; allowed: a multiple of {prefix}heads ({})",
                self.hidden,
                self.heads
            );
        }
        Ok(GptConfig {
            layers: self.layers,
            hidden: self.hidden,
            heads: self.heads,
            seq: self.seq,
            vocab: self.vocab,
            attention: AttentionKind::Tiled,
            lean: true,
            tied_head: self.tied_head,
        })
    }
}

/// Refuses, before anything is allocated, a model whose calibration cannot
/// fit in `available` bytes, or whose sizes overflow. The floor is what
/// every calibrated step holds at least, in the smallest of `dtypes`: the
/// parameters, their gradients, and the logits of one sequence (s × v:
/// the head computes them whole).
pub fn preflight(
    config: &GptConfig,
    dtypes: &[workbook_sdk::candle::DType],
    memory: &Memory,
) -> anyhow::Result<()> {
    let Memory { available, place } = memory;
    let Some(params) = config.checked_param_count() else {
        anyhow::bail!(
            "this model's parameter count overflows 64 bits (layers {}, hidden {}, seq {}, \
             vocab {}): no machine can hold it",
            config.layers,
            config.hidden,
            config.seq,
            config.vocab
        );
    };
    let Some(dtype) = dtypes.iter().min_by_key(|d| d.size_in_bytes()) else {
        anyhow::bail!("no dtype to plan for; allowed: f32, bf16, f16");
    };
    let size = dtype.size_in_bytes() as u128;
    let logits = config.seq as u128 * config.vocab as u128;
    let floor = (u128::from(params) * 2 + logits) * size;
    if floor > u128::from(*available) {
        anyhow::bail!(
            "this model cannot be planned {place}: its {params} parameters, their \
             gradients and one sequence's {logits} logits take at least {} in {}, more than \
             the {} of memory available there (the planner measures steps of the model \
             itself, at batch 1, 2 and 4, before it predicts larger ones)",
            bytes(u64::try_from(floor).unwrap_or(u64::MAX)),
            dtype.as_str(),
            bytes(*available)
        );
    }
    Ok(())
}

/// The memory a plan's steps may take, and where it is.
#[derive(Debug, Clone)]
pub struct Memory {
    /// Bytes available now.
    pub available: u64,
    /// Where, as a phrase: "on this machine", "on cuda:0 (NVIDIA H100)".
    pub place: String,
}

impl Memory {
    /// The memory of `device`: a GPU's free memory, else the host's
    /// available memory (`u64::MAX` where neither can be read, so that
    /// nothing is refused on a guess).
    pub fn of(device: &workbook_sdk::candle::Device) -> Self {
        match workbook_sdk::device::gpu_free_memory(device) {
            Some(free) => Memory {
                available: free,
                place: format!("on {}", workbook_sdk::device::name(device)),
            },
            None => Memory {
                available: available_memory().unwrap_or(u64::MAX),
                place: "on this machine".to_string(),
            },
        }
    }
}

/// The memory this machine has available now (`MemAvailable`), else its
/// physical memory; `None` where neither can be read.
pub fn available_memory() -> Option<u64> {
    use workbook_sdk::device::meminfo;
    meminfo("MemAvailable:").or_else(|| meminfo("MemTotal:"))
}
