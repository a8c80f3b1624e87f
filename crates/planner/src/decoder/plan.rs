//! The options weighed for a decoder on a device, cheapest first.

use serde::Serialize;
use workbook_models::llama::{LlamaConfig, Loss};
use workbook_sdk::candle::DType;

use super::predict::{predict, DecoderRecipe, Prediction, Sharing};
use crate::margin::fits;
use crate::stage::Stage;

/// A device a plan is weighed against: a card preset, or this CPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Card {
    /// As `--device` names it.
    pub name: String,
    /// Bytes of memory, as `nvidia-smi` reports the card's total.
    pub bytes: u64,
    /// Whether bf16 arithmetic is the fast one (on the GPUs), or f32 (on a
    /// CPU, where candle widens bf16 products to f32: chapter 5 measured a
    /// bf16 step at twice the f32 one's time).
    pub bf16_fast: bool,
}

/// The cards `--device` knows, by name: total memory as `nvidia-smi`
/// reports it (MiB; the H200's as it reported on the card that
/// docs/comparison-gpu.md was measured on).
pub const CARDS: [(&str, u64); 6] = [
    ("h200", 143_771),
    ("h100-80gb", 81_559),
    ("a100-80gb", 81_920),
    ("a100-40gb", 40_960),
    ("l4", 23_034),
    ("rtx4090", 24_564),
];

impl Card {
    /// The named card of [`CARDS`].
    pub fn named(name: &str) -> Option<Self> {
        CARDS.iter().find(|(n, _)| *n == name).map(|(n, mib)| Self {
            name: n.to_string(),
            bytes: mib << 20,
            bf16_fast: true,
        })
    }

    /// Whether the device is this machine's own memory, where the host is:
    /// moving AdamW's state "to the host" frees nothing there.
    pub fn is_host(&self) -> bool {
        self.name == "cpu"
    }

    /// This machine's CPU with `bytes` of memory.
    pub fn cpu(bytes: u64) -> Self {
        Self {
            name: "cpu".into(),
            bytes,
            bf16_fast: false,
        }
    }
}

/// One option of a decoder plan and its predicted peak.
#[derive(Debug, Clone, Serialize)]
pub struct DecoderOption {
    /// The compute dtype's name: `f32`, or `bf16` from f32 masters.
    pub compute: String,
    /// `plain` or `fused`.
    pub loss: String,
    /// Whether blocks are checkpointed.
    pub checkpoint: bool,
    /// Micro-batches a device's share of the batch is split into.
    pub micro_batches: usize,
    /// Where AdamW's state lives: `device`, `offload`, `zero1`, `zero2`.
    pub optimizer: String,
    /// The recipe the option runs, as `verify` trains it.
    #[serde(skip)]
    pub recipe: DecoderRecipe,
    /// The predicted peak on one device, by term.
    pub prediction: Prediction,
    /// Whether it fits the budget.
    pub fits: bool,
}

/// The options weighed for a decoder at a batch, cheapest first, and the
/// one chosen: the first that fits.
#[derive(Debug, Clone, Serialize)]
pub struct DecoderPlan {
    /// Parameters of the model.
    pub params: u64,
    /// Sequences per step and tokens per sequence.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Data-parallel ranks.
    pub ranks: usize,
    /// The memory a step may hold on one device.
    pub budget: u64,
    /// The room each option's prediction had to leave (see
    /// [`DecoderRequest::margin`]).
    pub margin: f64,
    /// The options, cheapest first (see [`plan_decoder`]).
    pub options: Vec<DecoderOption>,
    /// The index of the first option that fits, if any.
    pub chosen: Option<usize>,
}

/// The micro-batch counts weighed for a device's `share` of the batch: the
/// powers of two that divide it, and one sequence at a time.
fn splits(share: usize) -> Vec<usize> {
    let mut out: Vec<usize> = std::iter::successors(Some(1usize), |m| m.checked_mul(2))
        .take_while(|m| *m <= share && share.is_multiple_of(*m))
        .collect();
    if share > 1 && out.last() != Some(&share) {
        out.push(share);
    }
    out
}

/// What a decoder plan is asked for.
#[derive(Debug, Clone)]
pub struct DecoderRequest {
    /// Sequences per optimizer step, over all ranks.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Compute dtypes to weigh.
    pub dtypes: Vec<DType>,
    /// The memory a step may hold on one device.
    pub budget: u64,
    /// Data-parallel ranks (devices) the batch is split over.
    pub ranks: usize,
    /// With several ranks, the ZeRO stages to weigh (1 and 2; others are
    /// not weighed for decoders).
    pub stages: Vec<Stage>,
    /// Whether to weigh activation checkpointing.
    pub checkpointing: bool,
    /// The room a chosen option leaves: it fits when its prediction
    /// times `1 + margin` is within the budget ([`MARGIN`] for a plan).
    pub margin: f64,
}

/// The room `workbook plan` leaves a decoder's prediction, as the GPT's
/// plan does: chapter 5's cells measured within 1.5% of it, a wider sweep
/// of smaller models missed by up to 3.6% over (bf16 on one device), and
/// `--verify` holds a step to 5%.
pub const MARGIN: f64 = 0.05;

/// Weighs, for `cfg` on `card`, every compute dtype of the ask; on one
/// device AdamW's state beside the parameters and then offloaded to the
/// host (on a GPU: on the CPU the host is the device), on several ranks each ZeRO stage asked for (stage 2 checkpointed
/// only); without and with activation checkpointing; whole batches and
/// every split into micro-batches that divides a device's share; both
/// losses. Cheapest first, in that order of precedence: the fast dtype
/// before the other; the state on the device, then offloaded (a copy of
/// every gradient and parameter over the bus, and the update on the
/// host's cores), or ZeRO-1 before ZeRO-2 (the same traffic as data
/// parallelism, in fewer collectives); no recomputation before
/// checkpointing (a second forward of every block); fewer micro-batches
/// before more (each is a smaller product, less efficient on a GPU); the
/// plain loss before the fused one (which computes the head's product once
/// more).
pub fn plan_decoder(cfg: &LlamaConfig, ask: &DecoderRequest, card: &Card) -> DecoderPlan {
    let mut order = ask.dtypes.clone();
    // The fast dtype first.
    order.sort_by_key(|d| (*d == DType::BF16) != card.bf16_fast);
    let ranks = ask.ranks.max(1);
    let sharings: Vec<Sharing> = if ranks > 1 {
        ask.stages
            .iter()
            .filter_map(|stage| match stage {
                Stage::Zero1 => Some(Sharing::Zero1 { ranks }),
                Stage::Zero2 => Some(Sharing::Zero2 { ranks }),
                // Data parallelism holds more than ZeRO-1 for the same
                // traffic; stage 3 needs layers that gather their weights.
                Stage::Ddp | Stage::Zero3 => None,
            })
            .collect()
    } else if card.is_host() {
        vec![Sharing::Device]
    } else {
        vec![Sharing::Device, Sharing::Offload]
    };
    let share = ask.batch / ranks;
    let splits = splits(share);
    let mut options = Vec::new();
    for compute in order {
        for &sharing in &sharings {
            for checkpoint in [false, true] {
                // ZeRO-2 hands gradients over from a checkpointed backward
                // only; without, it would be ZeRO-1 again.
                let zero2 = matches!(sharing, Sharing::Zero2 { .. });
                if (checkpoint && !ask.checkpointing) || (zero2 && !checkpoint) {
                    continue;
                }
                for &micro_batches in &splits {
                    for loss in [Loss::Plain, Loss::Fused] {
                        let recipe = DecoderRecipe {
                            compute,
                            loss,
                            checkpoint,
                            micro_batches,
                            sharing,
                        };
                        let prediction = predict(cfg, ask.batch, ask.seq, &recipe);
                        options.push(DecoderOption {
                            compute: format!("{compute:?}").to_lowercase(),
                            loss: match loss {
                                Loss::Plain => "plain".into(),
                                Loss::Fused => "fused".into(),
                            },
                            checkpoint,
                            micro_batches,
                            optimizer: sharing.name().into(),
                            recipe,
                            fits: fits(prediction.total(), ask.budget, ask.margin),
                            prediction,
                        });
                    }
                }
            }
        }
    }
    let chosen = options.iter().position(|o| o.fits);
    DecoderPlan {
        params: cfg.parameter_count(),
        batch: ask.batch,
        seq: ask.seq,
        ranks,
        budget: ask.budget,
        margin: ask.margin,
        options,
        chosen,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoder::{predict_peak, smollm2};

    #[test]
    fn checkpointing_predicts_less_and_the_plan_picks_it_only_when_it_must() {
        let cfg = smollm2();
        let plain = predict(&cfg, 8, 1024, &DecoderRecipe::new(DType::F32, Loss::Fused));
        let checkpointed = DecoderRecipe {
            checkpoint: true,
            ..DecoderRecipe::new(DType::F32, Loss::Fused)
        };
        let less = predict(&cfg, 8, 1024, &checkpointed);
        assert!(less.total() < plain.total() / 2, "{less:?} {plain:?}");
        assert_eq!(predict_peak(&cfg, 8, 1024, DType::F32, Loss::Fused), plain);

        let card = Card::cpu(1 << 40);
        let ask = |budget| DecoderRequest {
            batch: 8,
            seq: 1024,
            dtypes: vec![DType::F32],
            budget,
            ranks: 1,
            stages: vec![],
            checkpointing: true,
            margin: 0.0,
        };
        let roomy = plan_decoder(&cfg, &ask(plain.total()), &card);
        let first = &roomy.options[roomy.chosen.unwrap()];
        assert!(!first.checkpoint && first.micro_batches == 1);
        // Just under every option without checkpointing on the device.
        let budget = roomy
            .options
            .iter()
            .filter(|o| !o.checkpoint && o.optimizer == "device")
            .map(|o| o.prediction.total())
            .min()
            .unwrap()
            - 1;
        let tight = plan_decoder(&cfg, &ask(budget), &card);
        let chosen = &tight.options[tight.chosen.unwrap()];
        assert!(
            chosen.checkpoint && chosen.optimizer == "device",
            "{chosen:?}"
        );
        assert!(chosen.prediction.total() <= budget);
        // Cheapest first: nothing before it fits.
        assert!(tight.options[..tight.chosen.unwrap()]
            .iter()
            .all(|o| !o.fits));

        // With a margin, the plain step's exact budget is short of its
        // room: the next option that leaves 5% is chosen.
        let room = DecoderRequest {
            margin: MARGIN,
            ..ask(plain.total())
        };
        let margined = plan_decoder(&cfg, &room, &card);
        let chosen = &margined.options[margined.chosen.unwrap()];
        assert!(chosen.prediction.total() as f64 * 1.05 <= plain.total() as f64);
        assert!(margined.chosen > roomy.chosen);
        // And 5% more budget gives it back.
        let exact = DecoderRequest {
            budget: (plain.total() as f64 * 1.05).ceil() as u64,
            ..room
        };
        assert_eq!(plan_decoder(&cfg, &exact, &card).chosen, roomy.chosen);
    }

    #[test]
    fn the_plan_splits_a_devices_share_in_powers_of_two_or_single_sequences() {
        assert_eq!(splits(1), [1]);
        assert_eq!(splits(6), [1, 2, 6]);
        assert_eq!(splits(16), [1, 2, 4, 8, 16]);
        assert_eq!(splits(720_720), [1, 2, 4, 8, 16, 720_720]);
        // A batch past any memory is weighed in a handful of splits.
        assert_eq!(splits(1 << 50).len(), 51);

        let mut ask = DecoderRequest {
            batch: 6,
            seq: 64,
            dtypes: vec![DType::F32],
            budget: 1 << 40,
            ranks: 1,
            stages: vec![],
            checkpointing: true,
            margin: MARGIN,
        };
        let l4 = Card::named("l4").unwrap();
        let plan = plan_decoder(&smollm2(), &ask, &l4);
        let mut counts: Vec<usize> = plan.options.iter().map(|o| o.micro_batches).collect();
        counts.dedup();
        // Device then offload, each without and with checkpointing.
        assert_eq!(counts, [[1, 2, 6]; 4].concat());
        assert_eq!(plan.options.len(), 2 * 2 * 3 * 2);
        // On the CPU the host is the device: nothing is offloaded.
        let plan = plan_decoder(&smollm2(), &ask, &Card::cpu(1 << 40));
        assert!(plan.options.iter().all(|o| o.optimizer == "device"));
        assert_eq!(plan.options.len(), 2 * 3 * 2);

        ask.checkpointing = false;
        let plan = plan_decoder(&smollm2(), &ask, &l4);
        assert!(plan.options.iter().all(|o| !o.checkpoint));
        assert_eq!(plan.options.len(), 2 * 3 * 2);

        ask.checkpointing = true;
        ask.batch = 12;
        ask.ranks = 2;
        ask.stages = vec![Stage::Zero1, Stage::Zero2];
        let plan = plan_decoder(&smollm2(), &ask, &Card::cpu(1 << 40));
        let mut kinds: Vec<(String, bool)> = plan
            .options
            .iter()
            .map(|o| (o.optimizer.clone(), o.checkpoint))
            .collect();
        kinds.dedup();
        // ZeRO-2 reduce-scatters each layer's gradients as a checkpointed
        // backward makes them: checkpointed only.
        let named = |k: &str, c: bool| (k.to_string(), c);
        assert_eq!(
            kinds,
            [
                named("zero1", false),
                named("zero1", true),
                named("zero2", true)
            ]
        );
        assert_eq!(plan.options.len(), 3 * 3 * 2);
    }
}
