//! `workbook plan`: the planner's request from the command line or a model
//! file, and its answer as text, JSON and a plot.

use std::path::Path;

use serde::Deserialize;
use workbook_models::{AttentionKind, GptConfig};
use workbook_planner::plan::{Calibration, Candidate, Plan, Verification};
use workbook_planner::Stage;
use workbook_sdk::output::{Axis, Series};
use workbook_sdk::{Figure, Unit};

use crate::chapter::Location;
use crate::render::text::bytes;

/// A model file: the GPT's sizes, as `workbook plan --model FILE` reads it.
///
/// ```toml
/// layers = 4
/// hidden = 256
/// heads = 4
/// seq = 256
/// vocab = 512
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
}

/// The largest model file read: a few lines of TOML are a few hundred
/// bytes.
pub const MAX_MODEL_FILE: u64 = 64 << 10;

impl ModelFile {
    /// Reads a model file, a regular file of at most [`MAX_MODEL_FILE`]
    /// bytes; errors name the file, line and column.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        use std::io::Read as _;
        let cannot_read =
            |e: std::io::Error| anyhow::anyhow!("cannot read {}: {e}", path.display());
        if let Some(what) = crate::chapter::not_a_regular_file(path).map_err(cannot_read)? {
            anyhow::bail!(
                "{} {what}; a model file is a regular .toml file",
                path.display()
            );
        }
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_MODEL_FILE + 1).read_to_string(&mut text))
            .map_err(cannot_read)?;
        if text.len() as u64 > MAX_MODEL_FILE {
            anyhow::bail!(
                "{} is larger than a model file may be ({} bytes at most): a model file holds \
                 `layers`, `hidden`, `heads`, `seq` and `vocab`",
                path.display(),
                MAX_MODEL_FILE
            );
        }
        toml::from_str(&text).map_err(|e| match e.span() {
            Some(span) => {
                let at = Location::in_text(path, &text, span.start);
                anyhow::anyhow!("{at}: {}", e.message())
            }
            None => anyhow::anyhow!("{}: {}", path.display(), e.message()),
        })
    }

    /// The model, checked: sizes above zero, the hidden size a multiple of
    /// the heads.
    pub fn config(&self) -> anyhow::Result<GptConfig> {
        for (name, value) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("seq", self.seq),
        ] {
            if value == 0 {
                anyhow::bail!("`{name}` is 0; allowed: at least 1");
            }
        }
        if self.vocab < 2 {
            anyhow::bail!("`vocab` is {}; allowed: at least 2", self.vocab);
        }
        if !self.hidden.is_multiple_of(self.heads) {
            anyhow::bail!(
                "`hidden` is {}; allowed: a multiple of heads ({})",
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

/// A field of `/proc/meminfo` (`MemTotal:`, `MemAvailable:`), in bytes.
pub fn memory_field(name: &str) -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The memory this machine has available now (`MemAvailable`), else its
/// physical memory; `None` where neither can be read.
pub fn available_memory() -> Option<u64> {
    memory_field("MemAvailable:").or_else(|| memory_field("MemTotal:"))
}

fn option(c: &Candidate) -> String {
    let micro = if c.micro_steps > 1 {
        format!(
            "{} micro-batches of {} (gradients accumulated)",
            c.micro_steps, c.micro_batch
        )
    } else {
        format!("the whole batch of {}", c.micro_batch)
    };
    let checkpointed = if c.checkpointed {
        ", every layer checkpointed"
    } else {
        ""
    };
    format!(
        "{}{} layers in {}, {micro}{checkpointed}",
        c.stage.map(sharing).unwrap_or_default(),
        c.recipe.name(),
        c.dtype
    )
}

/// How the ranks share the training, in words.
fn sharing(stage: Stage) -> String {
    match stage {
        Stage::Ddp => "DDP (everything replicated), ",
        Stage::Zero1 => "ZeRO stage 1 (optimizer state partitioned), ",
        Stage::Zero2 => "ZeRO stage 2 (optimizer state and gradients partitioned), ",
        Stage::Zero3 => "ZeRO stage 3 (parameters, gradients and optimizer state partitioned), ",
    }
    .to_string()
}

/// The plan as text: the calibrations, every option with its predicted
/// peak and time, the choice (or why there is none).
pub fn text(plan: &Plan, batch: usize) -> String {
    let mut out = String::new();
    if plan.ranks > 1 {
        out.push_str(&format!(
            "Budget {} per rank for a step of {batch} sequences on {} ranks, {} each.\n\n\
             Calibration (one rank's measured steps at batch 1, 2 and 4, its {} peers rehearsed \
             in this process; the line through 2 and 4):\n",
            bytes(plan.budget),
            plan.ranks,
            plan.batch_per_rank,
            plan.ranks - 1
        ));
    } else {
        out.push_str(&format!(
            "Budget {} for a step of {batch} sequences.\n\nCalibration (measured steps at batch 1, \
             2 and 4; the line through 2 and 4):\n",
            bytes(plan.budget)
        ));
    }
    // The recipes' column as wide as its longest name (`direct_tiled`).
    let width = plan
        .calibrations
        .iter()
        .map(|c| c.recipe.name().len())
        .max()
        .unwrap_or(0)
        .max(6);
    for c in &plan.calibrations {
        out.push_str(&format!(
            "  {}{:<width$} {:<4} {:<12}  peaks {:>9} {:>9} {:>9}: fixed {:>9}, per sequence {:>9}\n",
            c.stage
                .map(|s| format!("{:<6}", s.name()))
                .unwrap_or_default(),
            c.recipe.name(),
            c.dtype,
            if c.checkpointed { "checkpointed" } else { "" },
            bytes(c.peaks[0]),
            bytes(c.peaks[1]),
            bytes(c.peaks[2]),
            bytes(c.fixed()),
            bytes(c.per_sequence())
        ));
    }
    out.push_str("\nOptions (predicted):\n");
    let mut sorted: Vec<&Candidate> = plan.candidates.iter().collect();
    sorted.sort_by(|a, b| a.seconds.total_cmp(&b.seconds).then(a.peak.cmp(&b.peak)));
    for c in sorted {
        let verdict = if plan.chosen.as_ref() == Some(c) {
            "chosen"
        } else if !c.fits {
            "over budget"
        } else if c.on_frontier {
            "fits, slower"
        } else {
            "fits, dominated"
        };
        out.push_str(&format!(
            "  {:>10}  {:>7.3} s  {:<15} {}\n",
            bytes(c.peak),
            c.seconds,
            verdict,
            option(c)
        ));
    }
    match &plan.chosen {
        Some(c) => out.push_str(&format!(
            "\nPlan: {}; predicted peak {} ({:.0}% of the budget: an option fits when its \
             prediction plus {:.0}% is within it), step {:.3} s.\n",
            option(c),
            bytes(c.peak),
            100.0 * c.peak as f64 / plan.budget as f64,
            100.0 * plan.margin,
            c.seconds
        )),
        None => out.push_str(&format!("\n{}\n", nothing_fits(plan, batch))),
    }
    out
}

/// Why no option fits, with the smallest there is.
pub fn nothing_fits(plan: &Plan, batch: usize) -> String {
    // On N ranks, each holds its share of the batch.
    let batch = plan.batch_per_rank.min(batch);
    // The least each calibration can need: one sequence at a time, or the
    // whole batch for the direct recipes, which are weighed at it only.
    let least = |c: &Calibration| if c.recipe.direct() { batch } else { 1 };
    let smallest = plan
        .calibrations
        .iter()
        .min_by_key(|c| c.peak(batch, least(c)));
    match smallest {
        Some(c) if least(c) > 1 => format!(
            "Nothing fits in {}{}: the smallest option, {} layers in {}{} the whole batch of \
             {batch}, needs {} (the direct recipes are weighed at the whole batch only), and \
             {:.0}% more as a margin for the prediction. Another recipe with micro-batches, a \
             smaller model, a shorter sequence or more memory would fit.",
            bytes(plan.budget),
            if plan.ranks > 1 { " per rank" } else { "" },
            c.recipe.name(),
            c.dtype,
            if c.checkpointed {
                ", checkpointed,"
            } else {
                ""
            },
            bytes(c.peak(batch, batch)),
            100.0 * plan.margin,
        ),
        Some(c) => {
            let sum = if batch > 1 {
                format!(
                    " and {} for the gradients accumulated over the batch",
                    bytes(c.sum_bytes)
                )
            } else {
                String::new()
            };
            format!(
                "Nothing fits in {}{}: the smallest option, {}{} layers in {}{} one sequence at a \
                 time, needs {} (measured for one sequence: {}, parameters, gradients and \
                 optimizer state included{sum}), and {:.0}% more as a margin for the \
                 prediction. A smaller model, a shorter sequence or more memory would fit.{}",
                bytes(plan.budget),
                if plan.ranks > 1 { " per rank" } else { "" },
                c.stage.map(sharing).unwrap_or_default(),
                c.recipe.name(),
                c.dtype,
                if c.checkpointed {
                    ", checkpointed,"
                } else {
                    ""
                },
                bytes(c.peak(batch, 1)),
                bytes(c.peaks[0]),
                100.0 * plan.margin,
                if plan.ranks > 1 {
                    " So would more ranks (`--ranks`) with ZeRO, each then holding a smaller \
                     share of the model's states."
                } else {
                    ""
                },
            )
        }
        None => format!(
            "Nothing fits in {}: no option was weighed.",
            bytes(plan.budget)
        ),
    }
}

/// The verification as text.
pub fn verified(v: &Verification, tolerance: f64) -> String {
    format!(
        "Verified{}: measured peak {} against {} predicted ({:+.1}%) and a budget of {}; \
         step {:.3} s (median{}). {}\n",
        if v.ranks > 1 {
            format!(" on {} MPI ranks (the rank that held the most)", v.ranks)
        } else {
            String::new()
        },
        bytes(v.peak),
        bytes(v.predicted),
        100.0 * v.error(),
        bytes(v.budget),
        v.seconds,
        if v.ranks > 1 { ", slowest rank" } else { "" },
        if v.kept(tolerance) {
            format!(
                "The plan kept its promise (within the budget and {:.0}% of the prediction).",
                100.0 * tolerance
            )
        } else {
            format!(
                "The plan did NOT keep its promise (it must stay within the budget and {:.0}% of \
                 the prediction).",
                100.0 * tolerance
            )
        }
    )
}

/// The options on the memory-time plane: the Pareto frontier (no other
/// option both smaller and faster), the chosen option, and the budget.
pub fn figure(plan: &Plan) -> Figure {
    let mut frontier: Vec<(f64, f64)> = plan
        .candidates
        .iter()
        .filter(|c| c.on_frontier)
        .map(|c| (c.seconds, c.peak as f64))
        .collect();
    frontier.sort_by(|a, b| a.0.total_cmp(&b.0));
    let xs = plan.candidates.iter().map(|c| c.seconds);
    let lo = xs.clone().fold(f64::INFINITY, f64::min);
    let hi = xs.fold(0f64, f64::max);
    let mut series = vec![Series {
        name: "Pareto frontier of the options".into(),
        points: frontier,
    }];
    if let Some(c) = &plan.chosen {
        series.push(Series {
            name: "chosen".into(),
            points: vec![(c.seconds, c.peak as f64)],
        });
    }
    series.push(Series {
        name: "budget".into(),
        points: vec![(lo, plan.budget as f64), (hi, plan.budget as f64)],
    });
    Figure {
        id: "plan".into(),
        title: "The planner's options: their Pareto frontier, the choice and the budget".into(),
        x: Axis {
            label: "predicted step time".into(),
            unit: Unit::Seconds,
            log: false,
        },
        y: Axis {
            label: "predicted peak".into(),
            unit: Unit::Bytes,
            log: false,
        },
        series,
        ..Figure::default()
    }
}

/// An option in words: `bf16 compute, the fused loss, every block
/// checkpointed, 4 micro-batches`.
fn option_words(o: &workbook_planner::decoder::DecoderOption) -> String {
    let mut words = format!("{} compute with the {} loss", o.compute, o.loss);
    match o.optimizer.as_str() {
        "offload" => words.push_str(", AdamW offloaded to the host"),
        "zero1" => words.push_str(", ZeRO-1"),
        "zero2" => words.push_str(", ZeRO-2"),
        _ => {}
    }
    if o.checkpoint {
        words.push_str(", every block checkpointed");
    }
    if o.micro_batches > 1 {
        words.push_str(&format!(", {} micro-batches", o.micro_batches));
    }
    words
}

/// A decoder plan as text: per compute dtype, place of AdamW's state and
/// checkpointing, the first option that fits (or else the smallest) with
/// its predicted peak by term; then the one chosen, or the smallest and
/// what it lacks.
pub fn decoder_text(
    cfg: &workbook_models::llama::LlamaConfig,
    card: &workbook_planner::decoder::Card,
    plan: &workbook_planner::decoder::DecoderPlan,
) -> String {
    let ranks = if plan.ranks > 1 {
        let each = plan.batch / plan.ranks;
        format!(
            " over {} ranks ({each} sequence{} each; the figures are one rank's)",
            plan.ranks,
            if each == 1 { "" } else { "s" }
        )
    } else {
        String::new()
    };
    let mut out = format!(
        "{} decoder, {} blocks, hidden {}, {} / {} heads, vocabulary {}: {} parameters.\n\
         A step of {} x {} tokens{ranks} with f32 master weights and AdamW, against {} ({}), \
         predicted in closed form and checked against measurement by chapter 5 on the CPU \
         (a GPU adds its runtime's own memory, which this does not count):\n\n",
        cfg.family.name(),
        cfg.layers,
        cfg.hidden,
        cfg.heads,
        cfg.kv_heads,
        cfg.vocab,
        plan.params,
        plan.batch,
        plan.seq,
        bytes(plan.budget),
        card.name
    );
    let row = |cells: [&str; 11]| {
        format!(
            "  {:<8} {:<8} {:<12} {:>5} {:<6} {:>11} {:>10} {:>10} {:>10} {:<5} {:>10}",
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            cells[4],
            cells[5],
            cells[6],
            cells[7],
            cells[8],
            cells[9],
            cells[10]
        )
    };
    out.push_str(&row([
        "compute",
        "AdamW",
        "checkpoint",
        "micro",
        "loss",
        "weights+",
        "grads sum",
        "saved",
        "working",
        "at",
        "peak",
    ]));
    out.push('\n');
    // One row per group of options that differ only in micro-batches and
    // loss: its first that fits, or its smallest.
    let mut shown = 0;
    let options = &plan.options;
    let mut start = 0;
    while start < options.len() {
        let key = |o: &workbook_planner::decoder::DecoderOption| {
            (o.compute.clone(), o.optimizer.clone(), o.checkpoint)
        };
        let end = (start..options.len())
            .find(|&j| key(&options[j]) != key(&options[start]))
            .unwrap_or(options.len());
        let group = start..end;
        let pick = group
            .clone()
            .find(|&j| options[j].fits)
            .or_else(|| group.clone().min_by_key(|&j| options[j].prediction.total()))
            .unwrap_or(start);
        let o = &options[pick];
        let p = &o.prediction;
        let mark = if plan.chosen == Some(pick) {
            "  <- chosen"
        } else if o.fits {
            ""
        } else {
            "  over"
        };
        let micro = o.micro_batches.to_string();
        let (state, sum, saved, working, total) = (
            bytes(p.state),
            bytes(p.accumulated),
            bytes(p.saved),
            bytes(p.working),
            bytes(p.total()),
        );
        out.push_str(&row([
            &o.compute,
            &o.optimizer,
            if o.checkpoint { "every block" } else { "none" },
            &micro,
            &o.loss,
            &state,
            &sum,
            &saved,
            &working,
            p.moment.name(),
            &total,
        ]));
        out.push_str(mark);
        out.push('\n');
        shown += 1;
        start = end;
    }
    out.push_str(&format!(
        "\n{} options weighed (micro-batches and loss within each row; `weights+` is the \
         weights with what the device holds of AdamW's state); {shown} shown, --json lists \
         every one.\n",
        options.len()
    ));
    match plan.chosen {
        Some(i) => {
            let o = &plan.options[i];
            out.push_str(&format!(
                "Chosen: {}, {} of {}.\n",
                option_words(o),
                bytes(o.prediction.total()),
                bytes(plan.budget)
            ));
        }
        None => {
            if let Some(o) = plan.options.iter().min_by_key(|o| o.prediction.total()) {
                let hint = if plan.ranks > 1 {
                    "more --ranks"
                } else {
                    "several devices with --ranks N (ZeRO)"
                };
                out.push_str(&format!(
                    "Nothing fits: the smallest, {}, needs {}, {} over the budget. Try a \
                     smaller --batch or --seq, or {hint}.\n",
                    option_words(o),
                    bytes(o.prediction.total()),
                    bytes(o.prediction.total().saturating_sub(plan.budget))
                ));
            }
        }
    }
    out
}

/// The page `docs/decoder-fits.md`: for each published decoder of
/// `models` (its name and shape), what `workbook plan --model` chooses on
/// each card preset at 2,048 and 8,192 tokens, batch 1 and 8, beside what
/// the public estimators say of the same model. Every figure is predicted.
pub fn decoder_fits_markdown(models: &[(String, workbook_models::llama::LlamaConfig)]) -> String {
    use workbook_planner::decoder::{plan_decoder, Card, DecoderRequest, CARDS};
    use workbook_planner::Stage;
    use workbook_sdk::candle::DType;
    let shapes = [(2048, 1), (2048, 8), (8192, 1), (8192, 8)];
    let mut out = String::from(
        "# Does it fit? Six published decoders on the common cards\n\n\
         Generated by `WORKBOOK_BLESS=1 cargo test --test plan`: what `workbook plan --model \
         models/<name>.config.json --device <card> --batch B --seq S` chooses on one card, \
         with its predicted peak. Every figure here is **predicted**, by the closed form that \
         chapter 5 checks against measurement on the CPU (its cells within 1.5%); none of these \
         runs was made. The prediction leaves out the GPU runtime's own memory, and its bf16 \
         terms count the f32 copies candle makes on a CPU, which a GPU does not, so on a card \
         the bf16 figures are high. An option is written compute dtype, loss, where AdamW's \
         state lives, checkpointing (`ckpt`) and micro-batches (`mN`).\n\n\
         The public estimators' figures are the training state alone, whatever the batch and \
         sequence: accelerate's `estimate-memory` (\"training using Adam\": 4 times the model's \
         size, 16 bytes a parameter in f32, 8 in bf16) and DeepSpeed's ZeRO-2 estimator for one \
         GPU (4 + 16 bytes a parameter; 2 with its optimizer offloaded to the CPU).\n",
    );
    for (name, cfg) in models {
        let params = cfg.parameter_count();
        let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
        out.push_str(&format!(
            "\n## {name} ({params} parameters, vocabulary {}, {} head)\n\n\
             accelerate: {} (f32), {} (bf16); DeepSpeed ZeRO-2: {} ({} offloaded).\n\n\
             | card | 2,048 x 1 | 2,048 x 8 | 8,192 x 1 | 8,192 x 8 |\n|---|---|---|---|---|\n",
            cfg.vocab,
            if cfg.tied { "tied" } else { "untied" },
            gib(params.saturating_mul(16)),
            gib(params.saturating_mul(8)),
            gib(params.saturating_mul(20)),
            gib(params.saturating_mul(2)),
        ));
        for (card_name, _) in CARDS {
            let card = Card::named(card_name).expect("a preset");
            let mut row = format!("| {card_name} ({}) |", gib(card.bytes));
            for (seq, batch) in shapes {
                let ask = DecoderRequest {
                    batch,
                    seq,
                    dtypes: vec![DType::BF16, DType::F32],
                    budget: card.bytes,
                    ranks: 1,
                    stages: vec![Stage::Zero1, Stage::Zero2],
                    checkpointing: true,
                };
                let plan = plan_decoder(cfg, &ask, &card);
                let cell = match plan.chosen {
                    Some(i) => {
                        let o = &plan.options[i];
                        let mut words = vec![o.compute.clone(), o.loss.clone()];
                        if o.optimizer != "device" {
                            words.push(o.optimizer.clone());
                        }
                        if o.checkpoint {
                            words.push("ckpt".into());
                        }
                        if o.micro_batches > 1 {
                            words.push(format!("m{}", o.micro_batches));
                        }
                        format!("{}: {}", words.join(" "), gib(o.prediction.total()))
                    }
                    None => {
                        let least = plan
                            .options
                            .iter()
                            .map(|o| o.prediction.total())
                            .min()
                            .unwrap_or(0);
                        format!("no (least {})", gib(least))
                    }
                };
                row.push_str(&format!(" {cell} |"));
            }
            out.push_str(&row);
            out.push('\n');
        }
    }
    out
}
