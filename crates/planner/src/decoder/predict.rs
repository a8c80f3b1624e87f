//! The closed-form prediction of a decoder step's peak, moment by moment.

use candle_lean_nn::LinearCrossEntropy;
use serde::Serialize;
use workbook_models::llama::{LlamaConfig, Loss};

use workbook_sdk::candle::DType;

/// A step's predicted peak on one device, by term, in bytes, and the
/// moment of the step it falls at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Prediction {
    /// The training state on the device: the f32 parameters and AdamW's
    /// two moments (12 bytes a parameter); the parameters alone with the
    /// state offloaded (4); with ZeRO the parameters and this rank's block
    /// of the moments (4 + 8/N).
    pub state: u64,
    /// Gradients held across micro-batches: the earlier ones' sum (4 bytes
    /// a parameter), or ZeRO-2's blocks of it (4/N); none for one batch.
    pub accumulated: u64,
    /// What the forward keeps for the backward, at that moment.
    pub saved: u64,
    /// What the step holds beside them at that moment: the head's
    /// gradients, or every gradient with the embedding's being made, or the
    /// optimizer's step with its buffers.
    pub working: u64,
    /// The moment.
    pub moment: Moment,
}

/// The moments of a step at which its peak may fall.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Moment {
    /// The head's and the loss's backward.
    Head,
    /// The end of the backward, the embedding's gradient being made.
    End,
    /// The optimizer's step.
    Step,
}

impl Moment {
    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Moment::Head => "head",
            Moment::End => "end",
            Moment::Step => "step",
        }
    }
}

impl Prediction {
    /// All terms.
    pub fn total(&self) -> u64 {
        self.state
            .saturating_add(self.accumulated)
            .saturating_add(self.saved)
            .saturating_add(self.working)
    }
}

/// What one block keeps for the backward, in bytes, at `batch` x `seq`
/// tokens with elements of `e` bytes. With tiled attention, each block
/// keeps six tensors of the residual stream's width h (the first norm's
/// output, the attention's projection, the sum after it, the second norm's
/// output, the MLP's projection, the sum after it), five of the queries'
/// width a*d (the q projection, its copy in heads-first order, q after
/// RoPE, the attention's output and its copy back in tokens-first order),
/// five of the keys' and values' kv*d (k and v projected and copied, and k
/// after RoPE), three of the MLP's width i (gate, up and their SwiGLU
/// product) and, in f32, each head's log-sum-exp per row and each norm's
/// reciprocal root mean square per token.
pub fn saved_per_block(cfg: &LlamaConfig, batch: usize, seq: usize, e: u64) -> u64 {
    saturate(saved_block(cfg, batch, seq, e as u128))
}

fn saved_block(cfg: &LlamaConfig, batch: usize, seq: usize, e: u128) -> u128 {
    let n = |x: usize| x as u128;
    let tokens = n(batch) * n(seq);
    let (h, i) = (n(cfg.hidden), n(cfg.intermediate));
    let q = n(cfg.heads) * n(cfg.head_dim);
    let kv = n(cfg.kv_heads) * n(cfg.head_dim);
    tokens * e * (6 * h + 5 * q + 5 * kv + 3 * i)
        + 4 * n(batch) * n(cfg.heads) * n(seq)
        + 2 * 4 * tokens
}

/// `x`, or `u64::MAX` past it: a prediction for an absurd size says "more
/// than any memory" rather than wrapping.
fn saturate(x: u128) -> u64 {
    u64::try_from(x).unwrap_or(u64::MAX)
}

/// How a decoder's step runs, as far as its memory goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecoderRecipe {
    /// The dtype the forward and backward compute in (the masters stay f32).
    pub compute: DType,
    /// The head and the loss.
    pub loss: Loss,
    /// Activation checkpointing: each block's input kept, the block run
    /// again in the backward (`Llama::checkpointed_backward`).
    pub checkpoint: bool,
    /// The batch split into this many equal micro-batches, their gradients
    /// summed (`candle_accumulate::GradAccumulator`); 1 for none. With ZeRO
    /// the rank's share of the batch is split.
    pub micro_batches: usize,
    /// Where AdamW's state lives.
    pub sharing: Sharing,
}

/// Where AdamW's state lives, and so what one device holds of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// On the device, beside the parameters (`LeanAdamW`).
    Device,
    /// On the host (`HostAdamW`): the device keeps the f32 parameters and
    /// the step's gradients, which go to the host at the step.
    Offload,
    /// ZeRO-1 over `ranks` (`ZeroAdamW`): each rank trains on its share of
    /// the batch, keeps its block of the moments, and reduce-scatters the
    /// gradients after the backward.
    Zero1 {
        /// Ranks of the job.
        ranks: usize,
    },
    /// ZeRO-2 over `ranks`: as ZeRO-1, but each layer's gradients are
    /// reduce-scattered as a checkpointed backward makes them, so no rank
    /// holds them all. Without checkpointing (candle's backward makes every
    /// gradient at once) it runs, and is predicted, as ZeRO-1.
    Zero2 {
        /// Ranks of the job.
        ranks: usize,
    },
}

impl Sharing {
    /// Its name in metrics: `device`, `offload`, `zero1`, `zero2`.
    pub fn name(self) -> &'static str {
        match self {
            Sharing::Device => "device",
            Sharing::Offload => "offload",
            Sharing::Zero1 { .. } => "zero1",
            Sharing::Zero2 { .. } => "zero2",
        }
    }

    /// Whether the backward hands each layer's gradients to the optimizer
    /// as they are made, so they are never all on the device: ZeRO-2,
    /// checkpointed.
    pub fn takes_each_layer(self, checkpoint: bool) -> bool {
        checkpoint && matches!(self, Sharing::Zero2 { .. })
    }

    /// The ranks the batch is split over.
    pub fn ranks(self) -> usize {
        match self {
            Sharing::Zero1 { ranks } | Sharing::Zero2 { ranks } => ranks.max(1),
            _ => 1,
        }
    }
}

impl DecoderRecipe {
    /// The whole batch at once, every block's tensors kept.
    pub fn new(compute: DType, loss: Loss) -> Self {
        Self {
            compute,
            loss,
            checkpoint: false,
            micro_batches: 1,
            sharing: Sharing::Device,
        }
    }

    /// Its name in metrics and tables: `f32_fused`, `bf16_plain_checkpointed_m4`.
    pub fn name(&self) -> String {
        let mut name = format!(
            "{}_{}",
            format!("{:?}", self.compute).to_lowercase(),
            match self.loss {
                Loss::Plain => "plain",
                Loss::Fused => "fused",
            }
        );
        if self.checkpoint {
            name.push_str("_checkpointed");
        }
        if self.micro_batches > 1 {
            name.push_str(&format!("_m{}", self.micro_batches));
        }
        if self.sharing != Sharing::Device {
            name.push('_');
            name.push_str(self.sharing.name());
        }
        name
    }
}

/// The peak of a lean step of `cfg` at `batch` x `seq` tokens computing in
/// `compute` with `loss`: the toolkit's layers with tiled attention
/// (`Layers::Lean`, `Attention::Tiled`), f32 master weights, the toolkit's
/// in-place AdamW.
pub fn predict_peak(
    cfg: &LlamaConfig,
    batch: usize,
    seq: usize,
    compute: DType,
    loss: Loss,
) -> Prediction {
    predict(cfg, batch, seq, &DecoderRecipe::new(compute, loss))
}

/// The peak of a lean step run by `recipe` (see [`predict_peak`]); `batch`
/// is the whole batch, which `recipe.micro_batches` divides.
pub fn predict(cfg: &LlamaConfig, batch: usize, seq: usize, recipe: &DecoderRecipe) -> Prediction {
    let n = |x: usize| x as u128;
    let (compute, loss) = (recipe.compute, recipe.loss);
    let micro = recipe.micro_batches.max(1);
    // A rank's share of the batch, then a micro-batch of it.
    let batch = batch / recipe.sharing.ranks() / micro;
    let params = u128::from(cfg.parameter_count());
    let e = n(compute.size_in_bytes());
    let tokens = n(batch) * n(seq);
    let (h, v) = (n(cfg.hidden), n(cfg.vocab));
    let half = compute != DType::F32;
    let block = saved_block(cfg, batch, seq, e);
    // The embedding's output and the final norm's.
    let ends = 2 * tokens * h * e;
    let logits = match loss {
        Loss::Plain => tokens * v * e,
        Loss::Fused => 0,
    };
    // In bf16 every parameter's cast is an input the graph keeps, and a tied
    // embedding is cast twice: for the lookup and for the head.
    let casts = if half {
        e * params + if cfg.tied { e * v * h } else { 0 }
    } else {
        0
    };
    // At the head: the logits' gradient (plain) and the head weight's
    // gradient in the compute dtype, in candle's gradient store; or the
    // logits' gradient summed there (it, zeros and the sum); in half
    // precision on the CPU, the weight's product widened to f32 with its
    // left operand, the logits' gradient.
    let head = match loss {
        Loss::Plain => {
            let grad = tokens * v * e;
            let widened = if half {
                grad + 4 * tokens * v + (4 + e) * v * h
            } else {
                0
            };
            (grad + 5 * e * v * h).max(3 * grad).max(widened)
        }
        Loss::Fused => (3 * e * v * h).max(fused_chunks(cfg, tokens, e)),
    };
    // The embedding's f32 gradient being made; in half precision also its
    // gradient in that dtype and the cast between.
    let embedding = if half { (8 + e) * v * h } else { 4 * v * h };
    let sharing = recipe.sharing;
    let each_layer = sharing.takes_each_layer(recipe.checkpoint);
    let shards = Shards::of(cfg, sharing.ranks());
    let state = match sharing {
        Sharing::Device => 12 * params,
        // The parameters stay; masters and moments are the host's.
        Sharing::Offload => 4 * params,
        // The parameters, and this rank's block of the two moments.
        Sharing::Zero1 { .. } | Sharing::Zero2 { .. } => 4 * params + 8 * shards.blocks,
    };
    // Gradients held on the device across micro-batches: their sum, or,
    // handed over layer by layer, ZeRO-2's gradient blocks.
    let accumulated = match (micro > 1, each_layer) {
        (false, _) => 0,
        (true, true) => 4 * shards.blocks,
        (true, false) => 4 * params,
    };
    let moment = |moment: Moment, saved: u128, working: u128| Prediction {
        state: saturate(state),
        accumulated: saturate(accumulated),
        saved: saturate(saved),
        working: saturate(working),
        moment,
    };
    let mut moments = Vec::new();
    if recipe.checkpoint {
        // The forward keeps each block's input; the backward runs the last
        // block with the head, then each block again, its tensors (and in
        // bf16 its weights' casts) alive only while it runs. It peaks at
        // the head, or at the end, when nothing is saved any more and the
        // embedding's gradient is made: beside every other gradient, a
        // tied embedding's two summed as they are handed over; or, handed
        // over layer by layer, beside ZeRO-2's gradient blocks (an untied
        // embedding's own not made yet), reduce-scattered through a padded
        // buffer and a copy.
        let per_block = (params - v * h * if cfg.tied { 1 } else { 2 }) / n(cfg.layers.max(1));
        let one_cast = if half { e * (per_block + v * h) } else { 0 };
        let at_head = n(cfg.layers) * tokens * h * e + block + ends + logits + one_cast;
        moments.push(moment(Moment::Head, at_head, head));
        let at_end = if each_layer {
            let own = 4 * (v * h).div_ceil(n(sharing.ranks()));
            let blocks = match (micro > 1, cfg.tied) {
                // Made by an earlier micro-batch: counted as accumulated.
                (true, _) => 0,
                (false, true) => 4 * shards.blocks,
                (false, false) => 4 * shards.blocks - own,
            };
            let embedding = if half { 8 * v * h } else { 4 * v * h };
            blocks + embedding + shards.reduce_buffers()
        } else {
            4 * params
                + if half { 12 * v * h } else { 4 * v * h }
                + if cfg.tied { 4 * v * h } else { 0 }
        };
        moments.push(moment(Moment::End, 0, at_end));
    } else {
        let saved = n(cfg.layers) * block + ends + logits + casts;
        moments.push(moment(Moment::Head, saved, head));
        moments.push(moment(Moment::End, saved, 4 * params + embedding));
    }
    // The optimizer's step, after the backward: ZeRO-1 reduce-scatters the
    // whole gradients into blocks, then updates and all-gathers each
    // parameter; ZeRO-2 only the latter, from its blocks; the offloaded
    // optimizer copies each updated parameter back.
    let step = match (sharing, each_layer) {
        (Sharing::Device, _) => 0,
        (Sharing::Offload, _) => 4 * params + 4 * shards.largest,
        (_, true) => 4 * shards.blocks + shards.gather_buffers(),
        (_, false) => 4 * params + 4 * shards.blocks + shards.gather_buffers(),
    };
    let step = Prediction {
        accumulated: 0,
        ..moment(Moment::Step, 0, step)
    };
    moments.push(step);
    moments
        .into_iter()
        .max_by_key(Prediction::total)
        .expect("at least one moment")
}

/// How a model's parameters split into ZeRO's blocks over some ranks.
struct Shards {
    /// Elements of this rank's blocks, all parameters together.
    blocks: u128,
    /// Elements of the largest parameter.
    largest: u128,
    /// Its elements padded to a whole number of blocks.
    padded: u128,
}

impl Shards {
    fn of(cfg: &LlamaConfig, ranks: usize) -> Self {
        let ranks = ranks.max(1) as u128;
        let sizes = cfg
            .parameters()
            .into_iter()
            .map(|(_, shape)| shape.iter().map(|&d| d as u128).product::<u128>());
        let (mut blocks, mut largest) = (0, 0);
        for size in sizes {
            blocks += size.div_ceil(ranks);
            largest = largest.max(size);
        }
        Self {
            blocks,
            largest,
            padded: largest.div_ceil(ranks) * ranks,
        }
    }

    /// Reduce-scattering the largest gradient: its padded f32 buffer and
    /// its f32 copy.
    fn reduce_buffers(&self) -> u128 {
        4 * (self.padded + self.largest)
    }

    /// All-gathering the largest parameter: the padded buffer, the whole
    /// tensor made from it, and this rank's block sent (which takes the
    /// place of its gradient block, given up to the update).
    fn gather_buffers(&self) -> u128 {
        4 * (self.padded + self.largest)
    }
}

/// What the fused loss's backward holds at its widest chunk, beside the
/// head weight's gradient summed so far (f32; none with one chunk): the
/// chunk's logits and their gradient, or the gradient and the weight's
/// gradient for the chunk. In half precision on the CPU a product widens
/// its operands and its result to f32, so the second moment also holds the
/// chunk's gradient and the product in f32.
fn fused_chunks(cfg: &LlamaConfig, tokens: u128, e: u128) -> u128 {
    let (h, v) = (cfg.hidden as u128, cfg.vocab as u128);
    let rows = LinearCrossEntropy::new().rows_per_chunk(
        usize::try_from(tokens).unwrap_or(usize::MAX),
        cfg.hidden,
        cfg.vocab,
    ) as u128;
    let chunk = rows * v;
    let sum = if tokens > rows { 4 * v * h } else { 0 };
    let logits = 2 * e * chunk;
    let weight = if e == 4 {
        4 * v * h + 4 * chunk
    } else {
        (4 + e) * v * h + (4 + e) * chunk
    };
    sum + logits.max(weight)
}

/// A device a plan is made for: its name and the memory a step may hold.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoder::smollm2;

    #[test]
    fn a_recipe_is_named_by_what_it_changes() {
        let mut r = DecoderRecipe::new(DType::F32, Loss::Fused);
        assert_eq!(r.name(), "f32_fused");
        r.checkpoint = true;
        r.micro_batches = 4;
        assert_eq!(r.name(), "f32_fused_checkpointed_m4");
        assert_eq!(
            DecoderRecipe::new(DType::BF16, Loss::Plain).name(),
            "bf16_plain"
        );
    }

    #[test]
    fn a_micro_batch_is_predicted_as_its_own_batch_plus_the_summed_gradients() {
        let cfg = smollm2();
        let params = cfg.parameter_count();
        for checkpoint in [false, true] {
            let whole = DecoderRecipe {
                checkpoint,
                ..DecoderRecipe::new(DType::F32, Loss::Fused)
            };
            let split = DecoderRecipe {
                micro_batches: 4,
                ..whole
            };
            let one = predict(&cfg, 1, 256, &whole);
            let four = predict(&cfg, 4, 256, &split);
            assert_eq!(four.accumulated, 4 * params);
            assert_eq!(one.accumulated, 0);
            assert_eq!((four.saved, four.working), (one.saved, one.working));
            assert_eq!(four.total(), one.total() + 4 * params);
        }
    }

    #[test]
    fn offload_and_zero_hold_less_on_each_device_and_more_ranks_less_still() {
        let cfg = smollm2();
        let on = |sharing| DecoderRecipe {
            checkpoint: true,
            sharing,
            ..DecoderRecipe::new(DType::F32, Loss::Fused)
        };
        let device = predict(&cfg, 8, 256, &on(Sharing::Device));
        let offload = predict(&cfg, 8, 256, &on(Sharing::Offload));
        assert!(offload.state < device.state && offload.total() < device.total());
        for ranks in [2, 4, 8] {
            let one = predict(&cfg, 8, 256, &on(Sharing::Zero1 { ranks }));
            let two = predict(&cfg, 8, 256, &on(Sharing::Zero2 { ranks }));
            let more = predict(&cfg, 8, 256, &on(Sharing::Zero2 { ranks: 2 * ranks }));
            assert!(two.total() < one.total() && one.total() < device.total());
            assert!(more.total() < two.total(), "{ranks} ranks");
        }
        // Without checkpointing ZeRO-2 cannot hand gradients over: it is
        // ZeRO-1.
        let graph = |sharing| DecoderRecipe {
            checkpoint: false,
            ..on(sharing)
        };
        assert_eq!(
            predict(&cfg, 8, 256, &graph(Sharing::Zero2 { ranks: 4 })),
            predict(&cfg, 8, 256, &graph(Sharing::Zero1 { ranks: 4 }))
        );
    }
}
