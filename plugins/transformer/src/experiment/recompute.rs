//! The `gpt_checkpointing` cell's experiment: what `workbook run` executes
//! and what chapter 3's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use std::time::Instant;

use candle_checkpoint::{Policy, Sequential, Tape};
use candle_ledger::{Labeller, Ledger};
use workbook_models::Rng;
use workbook_models::{corpus, Gpt, GptLayer};
use workbook_sdk::anyhow;
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{Module, Tensor, Var};
use workbook_sdk::observe::Tags;
use workbook_sdk::output::{Axis, Series};
use workbook_sdk::{median, parse_dtype};
use workbook_sdk::{Category, Context, Figure, Table, Unit};
use workbook_transformer::recompute::Params as GptCheckpointingParams;

// notebook cell
/// The products a block computes through its tape, with the part of the
/// profile each is timed and counted under.
pub const PRODUCTS: [(&str, &str); 4] = [
    ("qkv", "qkv"),
    ("proj", "proj"),
    ("fc", "fc"),
    ("fc2", "fc2"),
];

/// One way of running the backward.
#[derive(Debug, Clone)]
pub enum Strategy {
    /// candle's backward over the whole graph.
    None,
    /// `candle-checkpoint` in `segments` segments, keeping what `policy` says.
    Segments {
        /// Segments the stack is cut into.
        segments: usize,
        /// What each recomputed segment keeps from its forward.
        policy: Policy,
    },
}

/// The model, its parameters and one batch.
pub struct GptSetup {
    /// The GPT.
    pub model: Gpt,
    /// Its parameters.
    pub vars: Vec<Var>,
    /// The batch's tokens.
    pub x: Tensor,
    /// The batch's targets.
    pub y: Tensor,
}

// notebook cell
/// Each product's bytes (over all blocks, from the ledger of the first
/// run) and its forward time (the fastest of `p.repeats` runs: a shared
/// machine's noise only ever adds time, and a product that takes
/// microseconds at check size would otherwise be kept or recomputed by
/// whichever run was interrupted), in
/// [`PRODUCTS`]' order.
pub fn product_profile(
    p: &GptCheckpointingParams,
    s: &GptSetup,
) -> anyhow::Result<([u64; 4], Vec<f64>)> {
    drop(s.model.loss(&s.x, &s.y, &Labeller::default())?);
    let mut spans: Vec<Vec<f64>> = vec![Vec::new(); PRODUCTS.len()];
    let mut bytes = [0u64; 4];
    for r in 0..p.repeats.max(1) {
        let labels = Labeller::new();
        let logits = s.model.logits_taped(&s.x, &labels, &Tape::plain())?;
        // Each product's time over all blocks, as its bytes are.
        let mut this = [0f64; 4];
        for (label, spent) in labels.times() {
            if let Some(k) = PRODUCTS.iter().position(|(_, part)| *part == label.part) {
                this[k] += spent.as_secs_f64();
            }
        }
        for (k, t) in this.into_iter().enumerate() {
            spans[k].push(t);
        }
        if r == 0 {
            let ledger = Ledger::of(&logits, &labels)?;
            for (k, (_, part)) in PRODUCTS.iter().enumerate() {
                bytes[k] = (0..p.model.layers)
                    .map(|l| ledger.bytes_of(Some(l), part))
                    .sum();
            }
        }
    }
    let fastest = |times: Vec<f64>| times.into_iter().fold(f64::INFINITY, f64::min);
    Ok((bytes, spans.into_iter().map(fastest).collect()))
}

/// The selective policy: keep what costs more time per byte to recompute
/// than the products on average; recompute the rest (and everything
/// between them). The products kept, with the profile as a table.
pub fn selective_policy(ctx: &mut Context, bytes: &[u64; 4], times: &[f64]) -> Vec<String> {
    let mut profile = Table::new(
        "Each product, over all blocks: bytes its output holds, forward time, and what keeping it costs",
        &[
            ("product", Unit::None),
            ("bytes", Unit::Bytes),
            ("forward time", Unit::Seconds),
            ("time per MiB", Unit::Seconds),
            ("kept", Unit::None),
        ],
    );
    let average = times.iter().sum::<f64>() / bytes.iter().sum::<u64>().max(1) as f64;
    let mut kept = Vec::new();
    for (k, (name, _)) in PRODUCTS.iter().enumerate() {
        let per_byte = times[k] / bytes[k].max(1) as f64;
        // In units of the average (1 when nothing took measurable time, so
        // that every product is kept).
        let cost = if average > 0.0 {
            per_byte / average
        } else {
            1.0
        };
        let keep = cost >= 1.0;
        if keep {
            kept.push(name.to_string());
        }
        ctx.metric(format!("kept_{name}"), if keep { 1.0 } else { 0.0 });
        ctx.metric(format!("cost_{name}"), cost);
        profile.row(vec![
            (*name).into(),
            bytes[k].into(),
            times[k].into(),
            (per_byte * (1 << 20) as f64).into(),
            if keep { "kept" } else { "recomputed" }.into(),
        ]);
    }
    ctx.table(profile);
    ctx.metric("kept_products", kept.len() as f64);
    ctx.print(format!(
        "The selective policy keeps the outputs of {} and recomputes the rest of each block.",
        if kept.is_empty() {
            "no product".to_string()
        } else {
            kept.join(", ")
        }
    ));
    kept
}

// notebook cell
/// The strategies compared, by name, for a stack of `n` layers: none,
/// full (a segment per layer), every k-th layer kept for each k of
/// `p.every`, the selective policy, and the matrix products kept.
pub fn strategies(
    n: usize,
    p: &GptCheckpointingParams,
    kept: Vec<String>,
) -> Vec<(String, Strategy)> {
    let segments = |segments, policy| Strategy::Segments { segments, policy };
    let mut out = vec![
        ("none".to_string(), Strategy::None),
        ("full".to_string(), segments(n, Policy::Nothing)),
    ];
    for &k in &p.every {
        out.push((
            format!("every_{k}"),
            segments(n.div_ceil(k), Policy::Nothing),
        ));
    }
    out.push(("selective".into(), segments(n, Policy::Names(kept))));
    out.push(("dots".into(), segments(n, Policy::Dots)));
    out
}

/// One forward and backward of the batch under `strategy`, in a region
/// named `name`: the gradients, the peak and the seconds.
pub fn backward_once(
    ctx: &mut Context,
    s: &GptSetup,
    stack: &[GptLayer<'_>],
    name: &str,
    strategy: &Strategy,
) -> anyhow::Result<(GradStore, u64, f64)> {
    let head = |h: &Tensor| s.model.head_loss(h, &s.y);
    let mut region = ctx.region(name);
    let start = Instant::now();
    let grads = Category::Activations.scope(|| -> anyhow::Result<GradStore> {
        Ok(match strategy {
            Strategy::None => {
                let h = stack
                    .iter()
                    .try_fold(s.x.clone(), |h, l| Module::forward(l, &h))?;
                let loss = head(&h)?;
                let store = Category::Gradients.scope(|| loss.backward())?;
                workbook_models::param_grads(&store, &s.vars)
            }
            Strategy::Segments { segments, policy } => {
                Sequential::taped(stack)
                    .segments(*segments)
                    .policy(policy)
                    .observer(&Tags)
                    .backward(&s.x, &s.vars, head)?
                    .grads
            }
        })
    })?;
    // On a GPU the backward's last kernels may still be running.
    ctx.device().synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    region.mark("after backward");
    let peak = region.peak_above_baseline();
    ctx.end_region(region);
    Ok((grads, peak, seconds))
}

// notebook cell
/// Each strategy's forward and backward, `p.repeats` times: its largest
/// peak, its median time and its gradients against the first strategy's
/// (candle's own backward), as a table and on the memory-time plane.
pub fn compare_strategies(
    ctx: &mut Context,
    p: &GptCheckpointingParams,
    s: &GptSetup,
    strategies: &[(String, Strategy)],
) -> anyhow::Result<()> {
    let stack = s.model.stack();
    let mut reference: Option<GradStore> = None;
    let mut table = Table::new(
        "Forward and backward of one batch, per strategy",
        &[
            ("strategy", Unit::None),
            ("peak", Unit::Bytes),
            ("time", Unit::Seconds),
            ("time over none", Unit::Ratio),
            ("largest gradient difference", Unit::None),
        ],
    );
    let mut series = Vec::new();
    let mut none_seconds = 0.0;
    for (name, strategy) in strategies {
        ctx.progress(&format!("backward: {name}"));
        let mut times = Vec::new();
        let mut peak = 0;
        let mut grads = None;
        for _ in 0..p.repeats.max(1) {
            let (g, pk, seconds) = backward_once(ctx, s, &stack, name, strategy)?;
            peak = peak.max(pk);
            times.push(seconds);
            grads = Some(g);
        }
        let seconds = median(times);
        let grads = grads.unwrap_or_default();
        let diff = match &reference {
            Some(r) => workbook_models::grads_max_abs_diff(&grads, r, &s.vars)?,
            None => 0.0,
        };
        if reference.is_none() {
            reference = Some(grads);
            none_seconds = seconds;
        }
        ctx.metric(format!("peak_{name}"), peak as f64);
        ctx.metric(format!("seconds_{name}"), seconds);
        ctx.metric(format!("grad_diff_{name}"), diff);
        table.row(vec![
            name.as_str().into(),
            peak.into(),
            seconds.into(),
            (seconds / none_seconds).into(),
            format!("{diff:.1e}").into(),
        ]);
        series.push(Series {
            name: name.clone(),
            points: vec![(seconds, peak as f64)],
        });
    }
    ctx.table(table);
    ctx.figure(Figure {
        id: "checkpointing".into(),
        title: "Checkpointing strategies on the memory-time plane".into(),
        x: Axis {
            label: "forward and backward time".into(),
            unit: Unit::Seconds,
            log: false,
        },
        y: Axis {
            label: "peak".into(),
            unit: Unit::Bytes,
            log: false,
        },
        series,
        ..Figure::default()
    });
    Ok(())
}

// notebook cell
/// The experiment: each product's bytes and forward time measured, the
/// selective policy chosen from them (keep what costs more time per byte
/// to recompute than the average), then one forward and backward per
/// strategy: its peak, its time and its gradients against candle's.
pub fn gpt_checkpointing_experiment(
    ctx: &mut Context,
    p: GptCheckpointingParams,
) -> anyhow::Result<()> {
    let dtype = parse_dtype(&p.dtype)?;
    let device = ctx.device().clone();
    let mut rng = Rng::seeded(p.seed);
    let model = Gpt::new(p.model, dtype, &mut rng, &device)?;
    let vars = model.vars();
    let (x, y) = Category::Inputs
        .scope(|| corpus::batch(&mut rng, p.batch, p.model.seq, p.model.vocab, &device))?;
    let setup = GptSetup { model, vars, x, y };
    let (bytes, times) = product_profile(&p, &setup)?;
    let kept = selective_policy(ctx, &bytes, &times);
    let strategies = strategies(setup.model.stack().len(), &p, kept);
    compare_strategies(ctx, &p, &setup, &strategies)
}
