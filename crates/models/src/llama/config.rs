//! A Llama-family decoder's shape, read from a Hugging Face `config.json`.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The families whose `config.json` this reads: the same decoder
/// (pre-norm RMSNorm, rotary positions, grouped-query attention, SwiGLU)
/// with different biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Llama 2 and 3, SmolLM: biases only with `attention_bias`.
    Llama,
    /// Qwen2 and Qwen2.5: biases on the q, k and v projections.
    Qwen2,
    /// Mistral: no biases; a sliding attention window.
    Mistral,
}

impl Family {
    /// The `model_type` of the family's `config.json`.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Mistral => "mistral",
        }
    }
}

/// A decoder's shape: every number that sets its parameters' and
/// activations' sizes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct LlamaConfig {
    /// The family (`model_type`).
    pub family: Family,
    /// Width of the residual stream, h (`hidden_size`).
    pub hidden: usize,
    /// Width of the SwiGLU MLP, i (`intermediate_size`).
    pub intermediate: usize,
    /// Decoder blocks, L (`num_hidden_layers`).
    pub layers: usize,
    /// Query heads, a (`num_attention_heads`).
    pub heads: usize,
    /// Key/value heads, kv (`num_key_value_heads`; `heads` when absent).
    pub kv_heads: usize,
    /// Width of one head (`head_dim`; `hidden / heads` when absent).
    pub head_dim: usize,
    /// Vocabulary, v (`vocab_size`).
    pub vocab: usize,
    /// The rotary base (`rope_theta`; 10,000 when absent).
    pub rope_theta: f64,
    /// The RMS norms' epsilon (`rms_norm_eps`).
    pub rms_norm_eps: f64,
    /// Whether the head is the embedding's transpose (`tie_word_embeddings`).
    pub tied: bool,
    /// Whether q, k and v carry biases (qwen2, or `attention_bias`).
    pub qkv_bias: bool,
    /// Whether the attention's output projection carries a bias
    /// (`attention_bias`).
    pub o_bias: bool,
    /// The longest sequence the model was trained for
    /// (`max_position_embeddings`).
    pub max_positions: usize,
    /// Mistral's attention window (`sliding_window`), if any.
    pub sliding_window: Option<usize>,
}

/// The most parameters a config may describe: far above any published
/// model (Llama-3.1-405B has 4e11), so that every byte count fits 64 bits.
pub const MAX_PARAMETERS: u64 = 1 << 50;

/// A `config.json` that cannot be a decoder's: where, and what to change.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read, or is not a small regular file.
    #[error(transparent)]
    Read(#[from] workbook_sdk::file::FileError),
    /// Not JSON, or a field of the wrong type.
    #[error(
        "{origin}:{line}:{column}: {}{message}",
        field.as_ref().map(|f| format!("`{f}`: ")).unwrap_or_default()
    )]
    Syntax {
        /// The file, or what the text came from.
        origin: String,
        /// Line of the error, from 1.
        line: usize,
        /// Column of the error, from 1.
        column: usize,
        /// The field whose value is of the wrong type (`architectures[1]`
        /// for an element of one), or `None` where the error is the
        /// document's: not JSON, a field missing or given twice, text after
        /// the object, a number past any type's range.
        field: Option<String>,
        /// serde_json's description.
        message: String,
    },
    /// Shapes each within bounds that together make more than
    /// [`MAX_PARAMETERS`], 2^50: a bound far above any published model, so
    /// that every byte count a plan makes fits 64 bits.
    #[error(
        "{origin}: these shapes make {params} parameters ({shapes}): at most {MAX_PARAMETERS} \
         (2^50) are planned; no published decoder is within a thousandth of that, so one of them \
         is likely mistyped"
    )]
    TooLarge {
        /// The file, or what the text came from.
        origin: String,
        /// The parameters the shapes make.
        params: u64,
        /// The shapes that make them, `hidden_size 4096, ...`, and whether
        /// the head is tied to the embedding.
        shapes: String,
    },
    /// A field whose value this cannot build.
    #[error("{origin}: `{field}` is {given}: {allowed}")]
    Field {
        /// The file, or what the text came from.
        origin: String,
        /// The field of `config.json`.
        field: &'static str,
        /// The value given.
        given: String,
        /// What is allowed.
        allowed: String,
    },
}

/// The largest `config.json` read: a published one is a few kilobytes.
pub const MAX_CONFIG_FILE: u64 = 64 << 10;

/// A decoder's `config.json`, as its read errors name it.
pub const CONFIG_FILE: workbook_sdk::file::FileKind = workbook_sdk::file::FileKind {
    name: "a decoder's config.json",
    is: "a regular .json file",
    holds: "the decoder's shape (`hidden_size`, `num_hidden_layers`, `vocab_size`, ...)",
    max_bytes: MAX_CONFIG_FILE,
};

/// The fields of a Hugging Face `config.json` that set a decoder's shape;
/// the others (tokens, generation, dtype) are ignored.
#[derive(Debug, Deserialize)]
struct Raw {
    model_type: String,
    /// The model classes the checkpoint loads as (`LlamaForCausalLM`).
    architectures: Option<Vec<String>>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rope_theta: Option<f64>,
    rms_norm_eps: Option<f64>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    max_position_embeddings: Option<usize>,
    /// Absent (Mistral's default window), `null` (no window) or a width.
    #[serde(default, deserialize_with = "present")]
    sliding_window: Option<Option<usize>>,
    use_sliding_window: Option<bool>,
}

/// A field that is there, `null` included: `Some(None)` for `null`, where
/// an absent field is `None` (serde's default).
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

impl LlamaConfig {
    /// Reads a Hugging Face `config.json`, a regular file of at most
    /// [`MAX_CONFIG_FILE`] bytes: a pipe, a device or a weights file given
    /// in its place is refused before it is read.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = workbook_sdk::file::read_small(path, CONFIG_FILE)?;
        Self::from_json(&text, &path.display().to_string())
    }

    /// Parses the text of a Hugging Face `config.json`; `origin` names it
    /// in errors. Fields that do not set a shape are not read: `rope_scaling`
    /// changes the rotary angles, not what a step holds, and the model built
    /// rotates with `rope_theta` alone.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let mut json = serde_json::Deserializer::from_str(text);
        let raw: Raw = serde_path_to_error::deserialize(&mut json)
            .map_err(|e| (e.path().to_string(), e.into_inner()))
            // Text after the object is refused, as serde_json's from_str does.
            .and_then(|raw| json.end().map(|()| raw).map_err(|e| (".".into(), e)))
            .map_err(|(path, e)| {
                ConfigError::Syntax {
                    origin: origin.to_string(),
                    line: e.line(),
                    column: e.column(),
                    // `.` is the whole document: a missing field, or not JSON.
                    field: (path != "." && !e.is_syntax() && !e.is_eof()).then_some(path),
                    // serde_json ends its message with the place, which
                    // the error gives first; a value quoted in it may hold
                    // the same words.
                    message: {
                        let m = e.to_string();
                        m.rsplit_once(" at line ")
                            .map_or(m.clone(), |(m, _)| m.to_string())
                    },
                }
            })?;
        let field = |field: &'static str, given: String, allowed: &str| ConfigError::Field {
            origin: origin.to_string(),
            field,
            given,
            allowed: allowed.to_string(),
        };
        let family = match raw.model_type.as_str() {
            "llama" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "mistral" => Family::Mistral,
            other => {
                return Err(field(
                    "model_type",
                    format!("{other:?}"),
                    "this builds \"llama\", \"qwen2\" and \"mistral\" decoders",
                ))
            }
        };
        // A head other than next-token prediction's (sequence
        // classification, a value head) is not the step this builds.
        if let Some(archs) = raw
            .architectures
            .as_ref()
            .filter(|a| !a.iter().any(|a| a.ends_with("ForCausalLM")))
        {
            return Err(field(
                "architectures",
                format!("{archs:?}"),
                "a causal language model's (`...ForCausalLM`): this trains next-token \
                 prediction, whose head is the vocabulary",
            ));
        }
        if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(field(
                "hidden_act",
                format!("{act:?}"),
                "a Llama-family MLP is SwiGLU: \"silu\"",
            ));
        }
        if raw.mlp_bias == Some(true) {
            return Err(field(
                "mlp_bias",
                "true".into(),
                "the MLP's projections are built without biases (false)",
            ));
        }
        // Bounds far above any published model (Llama-3.1-405B: hidden
        // 16,384, 126 blocks, 128 heads), so that counts fit in 64 bits.
        for (name, value, max) in [
            ("hidden_size", raw.hidden_size, 1 << 20),
            ("intermediate_size", raw.intermediate_size, 1 << 20),
            ("num_hidden_layers", raw.num_hidden_layers, 1 << 12),
            ("num_attention_heads", raw.num_attention_heads, 1 << 12),
            ("vocab_size", raw.vocab_size, 1 << 24),
            ("head_dim", raw.head_dim.unwrap_or(1), 1 << 16),
        ] {
            if value == 0 || value > max {
                return Err(field(name, value.to_string(), &format!("from 1 to {max}")));
            }
        }
        let heads = raw.num_attention_heads;
        // Hugging Face's defaults where the field is absent.
        let kv_heads = raw.num_key_value_heads.unwrap_or(match family {
            Family::Llama => heads,
            Family::Qwen2 => 32,
            Family::Mistral => 8,
        });
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            // An absent field is named as the default it took.
            let given = match raw.num_key_value_heads {
                Some(_) => kv_heads.to_string(),
                None => format!("absent, so {kv_heads} ({}'s default)", family.name()),
            };
            return Err(field(
                "num_key_value_heads",
                given,
                &format!("a divisor of num_attention_heads ({heads}): query heads share key/value heads in equal groups"),
            ));
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if raw.hidden_size.is_multiple_of(heads) => raw.hidden_size / heads,
            None => {
                return Err(field(
                    "head_dim",
                    "absent".into(),
                    &format!(
                        "given, or hidden_size ({}) a multiple of num_attention_heads ({heads})",
                        raw.hidden_size
                    ),
                ))
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(field(
                "head_dim",
                head_dim.to_string(),
                "even and at least 2: rotary embeddings rotate pairs",
            ));
        }
        let rope_theta = raw.rope_theta.unwrap_or(10_000.0);
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(field(
                "rope_theta",
                rope_theta.to_string(),
                "a finite base above 1",
            ));
        }
        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(1e-6);
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(field(
                "rms_norm_eps",
                rms_norm_eps.to_string(),
                "a small positive number",
            ));
        }
        // Llama's `attention_bias` covers q, k, v and o; Qwen2's q, k and v
        // always have biases and o never; Mistral has none.
        let (qkv_bias, o_bias) = match family {
            Family::Llama => {
                let bias = raw.attention_bias.unwrap_or(false);
                (bias, bias)
            }
            Family::Qwen2 => (true, false),
            Family::Mistral => (false, false),
        };
        let sliding_window = match family {
            // Hugging Face's MistralConfig: 4096 when absent, none when null
            // (Mistral-7B-v0.2 and later).
            Family::Mistral => raw.sliding_window.unwrap_or(Some(4096)),
            Family::Qwen2 if raw.use_sliding_window == Some(true) => raw.sliding_window.flatten(),
            _ => None,
        };
        let config = Self {
            family,
            hidden: raw.hidden_size,
            intermediate: raw.intermediate_size,
            layers: raw.num_hidden_layers,
            heads,
            kv_heads,
            head_dim,
            vocab: raw.vocab_size,
            rope_theta,
            rms_norm_eps,
            // Hugging Face's default for these families.
            tied: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias,
            o_bias,
            max_positions: raw.max_position_embeddings.unwrap_or(usize::MAX),
            sliding_window,
        };
        let params = config.parameter_count();
        if params > MAX_PARAMETERS {
            return Err(ConfigError::TooLarge {
                origin: origin.to_string(),
                params,
                shapes: format!(
                    "hidden_size {}, intermediate_size {}, num_hidden_layers {}, \
                     num_attention_heads {heads}, num_key_value_heads {kv_heads}, head_dim \
                     {head_dim}, vocab_size {}, {} head",
                    raw.hidden_size,
                    raw.intermediate_size,
                    raw.num_hidden_layers,
                    raw.vocab_size,
                    if config.tied { "a tied" } else { "an untied" }
                ),
            });
        }
        Ok(config)
    }

    /// Every parameter's name (as in the family's checkpoints) and shape, in
    /// the order the model makes them.
    pub fn parameters(&self) -> Vec<(String, Vec<usize>)> {
        let (h, d) = (self.hidden, self.head_dim);
        let (q, kv) = (self.heads * d, self.kv_heads * d);
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, h])];
        for l in 0..self.layers {
            let p = |name: &str| format!("model.layers.{l}.{name}");
            out.push((p("input_layernorm.weight"), vec![h]));
            for (name, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                out.push((p(&format!("self_attn.{name}.weight")), vec![rows, h]));
                if self.qkv_bias {
                    out.push((p(&format!("self_attn.{name}.bias")), vec![rows]));
                }
            }
            out.push((p("self_attn.o_proj.weight"), vec![h, q]));
            if self.o_bias {
                out.push((p("self_attn.o_proj.bias"), vec![h]));
            }
            out.push((p("post_attention_layernorm.weight"), vec![h]));
            out.push((p("mlp.gate_proj.weight"), vec![self.intermediate, h]));
            out.push((p("mlp.up_proj.weight"), vec![self.intermediate, h]));
            out.push((p("mlp.down_proj.weight"), vec![h, self.intermediate]));
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tied {
            out.push(("lm_head.weight".to_string(), vec![self.vocab, h]));
        }
        out
    }

    /// Parameters in all, as [`LlamaConfig::parameters`] lists them,
    /// counted without listing them (`u64::MAX` past it).
    pub fn parameter_count(&self) -> u64 {
        let n = |x: usize| x as u128;
        let (h, d, i, v) = (
            n(self.hidden),
            n(self.head_dim),
            n(self.intermediate),
            n(self.vocab),
        );
        let (q, kv) = (n(self.heads) * d, n(self.kv_heads) * d);
        let mut block = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * i;
        if self.qkv_bias {
            block += q + 2 * kv;
        }
        if self.o_bias {
            block += h;
        }
        let heads = if self.tied { 1 } else { 2 };
        let total = heads * v * h + n(self.layers) * block + h;
        u64::try_from(total).unwrap_or(u64::MAX)
    }

    /// The same architecture at a size this machine trains in seconds:
    /// `layers` blocks, the vocabulary and the MLP's width divided by
    /// `divisor`, the head width too but to no less than 8 (heads and
    /// key/value heads kept, so the grouping is the same), and the hidden
    /// size `heads * head_dim` where the config's is that (so divided by
    /// less than `divisor` once the head width is at 8), else divided.
    pub fn scaled(&self, layers: usize, divisor: usize) -> Self {
        let divisor = divisor.max(1);
        let head_dim = (self.head_dim / divisor).max(8) & !1;
        let hidden = if self.hidden == self.heads * self.head_dim {
            self.heads * head_dim
        } else {
            (self.hidden / divisor).max(8)
        };
        Self {
            hidden,
            intermediate: (self.intermediate / divisor).max(8),
            layers: layers.max(1),
            head_dim,
            vocab: (self.vocab / divisor).max(16),
            ..self.clone()
        }
    }
}
