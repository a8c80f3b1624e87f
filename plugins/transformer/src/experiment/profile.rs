//! The `layer_profile` cell's experiment: what `workbook run` executes and
//! what chapter 3's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use std::collections::BTreeMap;
use std::time::Duration;

use candle_ledger::{Labeller, Ledger};
use workbook_models::Rng;
use workbook_models::{corpus, Gpt};
use workbook_sdk::anyhow;
use workbook_sdk::candle::Tensor;
use workbook_sdk::output::{Axis, Series};
use workbook_sdk::{median, parse_dtype};
use workbook_sdk::{Context, Figure, Table, Unit};
use workbook_transformer::profile::{metric_name, Params as LayerProfileParams, PARTS};

// notebook cell
/// What a (layer, part), a part or a layer adds up to.
#[derive(Default, Clone, Copy)]
pub struct Totals {
    /// Bytes held for the backward.
    pub bytes: u64,
    /// Tensors held.
    pub tensors: u64,
    /// Forward time, the median over the timed forwards.
    pub seconds: f64,
}

/// Where a (layer, part) comes in the forward: the embedding, the blocks
/// in order with their parts in order, then the final norm, head and loss.
pub fn order_in_forward(layer: Option<usize>, part: &str) -> (usize, usize, usize) {
    let position = PARTS.iter().position(|p| *p == part).unwrap_or(PARTS.len());
    match (layer, part) {
        (None, "embedding") => (0, 0, 0),
        (Some(i), _) => (1, i, position),
        (None, _) => (2, 0, position),
    }
}

/// A (layer, part) of the forward: the layer is `None` outside the blocks.
pub type PartKey = (Option<usize>, String);

/// Shares of the bytes held and of the forward's time.
pub struct Shares {
    /// Bytes held for the backward, in all.
    pub held: u64,
    /// The forward's seconds, in all.
    pub seconds: f64,
}

impl Shares {
    /// `bytes`' share of what is held.
    pub fn bytes(&self, bytes: u64) -> f64 {
        bytes as f64 / self.held.max(1) as f64
    }

    /// `seconds`' share of the forward's time.
    pub fn time(&self, seconds: f64) -> f64 {
        seconds / self.seconds.max(f64::MIN_POSITIVE)
    }
}

// notebook cell
/// `p.repeats` forwards labelled part by part (after one untimed, as
/// buffers and thread pools start up): each (layer, part)'s times, and the
/// first forward's ledger of what it holds for the backward.
pub fn timed_forwards(
    ctx: &mut Context,
    p: &LayerProfileParams,
    model: &Gpt,
    (x, y): (&Tensor, &Tensor),
) -> anyhow::Result<(BTreeMap<PartKey, Vec<Duration>>, Ledger)> {
    drop(model.loss(x, y, &Labeller::default())?);
    let mut times: BTreeMap<PartKey, Vec<Duration>> = BTreeMap::new();
    let mut ledger = Ledger::default();
    for r in 0..p.repeats {
        ctx.progress(&format!("timed forward {} of {}", r + 1, p.repeats));
        let labels = Labeller::new();
        let loss = model.loss(x, y, &labels)?;
        // A part may come twice in a layer (its two residual additions):
        // its time in this forward is the sum.
        let mut this: BTreeMap<PartKey, Duration> = BTreeMap::new();
        for (label, spent) in labels.times() {
            *this.entry((label.layer, label.part)).or_default() += spent;
        }
        for (key, spent) in this {
            times.entry(key).or_default().push(spent);
        }
        if r == 0 {
            ledger = Ledger::of(&loss, &labels)?;
        }
    }
    Ok((times, ledger))
}

/// Per (layer, part): bytes and tensors from the ledger, time from the
/// medians.
pub fn profile_cells(
    ledger: &Ledger,
    times: BTreeMap<PartKey, Vec<Duration>>,
) -> BTreeMap<PartKey, Totals> {
    let mut cells: BTreeMap<PartKey, Totals> = BTreeMap::new();
    for h in &ledger.held {
        let key = h
            .label
            .as_ref()
            .map_or((None, "unlabelled".to_string()), |l| {
                (l.layer, l.part.clone())
            });
        let t = cells.entry(key).or_default();
        t.bytes += h.bytes;
        t.tensors += 1;
    }
    for (key, spans) in times {
        cells.entry(key).or_default().seconds =
            median(spans.iter().map(Duration::as_secs_f64).collect());
    }
    cells
}

// notebook cell
/// Per part over all layers, in the forward's order: bytes held, their
/// share, forward time, its share, and bytes held per forward millisecond.
pub fn parts_table(ctx: &mut Context, parts: &BTreeMap<String, Totals>, shares: &Shares) {
    let mut by_part = Table::new(
        "Per part, over all layers: bytes held for the backward and forward time",
        &[
            ("part", Unit::None),
            ("tensors", Unit::Count),
            ("bytes", Unit::Bytes),
            ("share of bytes", Unit::Ratio),
            ("forward time", Unit::Seconds),
            ("share of time", Unit::Ratio),
            ("held per forward ms", Unit::Bytes),
        ],
    );
    let order = |name: &str| PARTS.iter().position(|p| *p == name).unwrap_or(PARTS.len());
    let mut names: Vec<&String> = parts.keys().collect();
    names.sort_by_key(|n| order(n));
    for name in names {
        let t = parts[name];
        by_part.row(vec![
            name.as_str().into(),
            t.tensors.into(),
            t.bytes.into(),
            shares.bytes(t.bytes).into(),
            t.seconds.into(),
            shares.time(t.seconds).into(),
            // What recomputing the part instead of keeping it would save
            // for each millisecond the recomputation costs.
            (t.bytes as f64 / (t.seconds * 1e3).max(1e-6))
                .round()
                .into(),
        ]);
        let metric = metric_name(name);
        ctx.metric(format!("bytes_share_{metric}"), shares.bytes(t.bytes));
        ctx.metric(format!("time_share_{metric}"), shares.time(t.seconds));
        ctx.metric(format!("bytes_{metric}"), t.bytes as f64);
    }
    ctx.table(by_part);
}

/// Per layer: bytes held, their share and forward time. Returns the bytes
/// the blocks hold.
pub fn layers_table(ctx: &mut Context, cells: &BTreeMap<PartKey, Totals>, shares: &Shares) -> u64 {
    let mut by_layer = Table::new(
        "Per layer: bytes held and forward time",
        &[
            ("layer", Unit::None),
            ("bytes", Unit::Bytes),
            ("share of bytes", Unit::Ratio),
            ("forward time", Unit::Seconds),
        ],
    );
    let mut layers: BTreeMap<Option<usize>, Totals> = BTreeMap::new();
    for ((layer, _), t) in cells {
        let e = layers.entry(*layer).or_default();
        e.bytes += t.bytes;
        e.seconds += t.seconds;
    }
    let mut blocks = 0u64;
    for (layer, t) in &layers {
        let name = match layer {
            Some(i) => {
                blocks += t.bytes;
                ctx.metric(format!("block_bytes_{i}"), t.bytes as f64);
                format!("block {i}")
            }
            None => "outside the blocks".to_string(),
        };
        by_layer.row(vec![
            name.into(),
            t.bytes.into(),
            shares.bytes(t.bytes).into(),
            t.seconds.into(),
        ]);
    }
    ctx.table(by_layer);
    blocks
}

// notebook cell
/// The three parts that hold the most and the three slowest, named; the
/// biggest part's share.
pub fn biggest_and_slowest(
    ctx: &mut Context,
    parts: &BTreeMap<String, Totals>,
    shares: &Shares,
) -> f64 {
    let mut ranked: Vec<(&String, &Totals)> = parts.iter().collect();
    ranked.sort_by_key(|(_, t)| std::cmp::Reverse(t.bytes));
    let named: Vec<String> = ranked
        .iter()
        .take(3)
        .map(|(n, t)| format!("{n} ({:.0}%)", 100.0 * shares.bytes(t.bytes)))
        .collect();
    ctx.print(format!(
        "The biggest consumers of memory held for the backward: {}.",
        named.join(", ")
    ));
    let mut slowest: Vec<(&String, &Totals)> = parts.iter().collect();
    slowest.sort_by(|a, b| b.1.seconds.total_cmp(&a.1.seconds));
    let named: Vec<String> = slowest
        .iter()
        .take(3)
        .map(|(n, t)| format!("{n} ({:.0}%)", 100.0 * shares.time(t.seconds)))
        .collect();
    ctx.print(format!(
        "The slowest parts of the forward: {}.",
        named.join(", ")
    ));
    ranked.first().map_or(0.0, |(_, t)| shares.bytes(t.bytes))
}

/// The forward as a path: time spent against bytes held so far.
pub fn forward_path(ctx: &mut Context, p: &LayerProfileParams, cells: &BTreeMap<PartKey, Totals>) {
    let mut points = vec![(0.0, 0.0)];
    let (mut s, mut b) = (0.0, 0.0);
    let mut order: Vec<(&PartKey, &Totals)> = cells.iter().collect();
    order.sort_by_key(|((layer, part), _)| order_in_forward(*layer, part));
    for (_, t) in order {
        s += t.seconds;
        b += t.bytes as f64;
        points.push((s, b));
    }
    ctx.figure(Figure {
        id: "profile".into(),
        title: "The forward, part by part: bytes held for the backward against time".into(),
        x: Axis {
            label: "forward time".into(),
            unit: Unit::Seconds,
            log: false,
        },
        y: Axis {
            label: "held for the backward".into(),
            unit: Unit::Bytes,
            log: false,
        },
        series: vec![Series {
            name: format!("{} recipe", p.recipe.name()),
            points,
        }],
        ..Figure::default()
    });
}

// notebook cell
/// The experiment: timed forwards labelled part by part; the bytes each
/// part and layer holds for the backward, from the ledger, beside its
/// forward time; the biggest and slowest parts named.
pub fn layer_profile_experiment(ctx: &mut Context, p: LayerProfileParams) -> anyhow::Result<()> {
    let dtype = parse_dtype(&p.dtype)?;
    let device = ctx.device().clone();
    let config = p.recipe.apply(p.model);
    let mut rng = Rng::seeded(p.seed);
    let model = Gpt::new(config, dtype, &mut rng, &device)?;
    let (x, y) = corpus::batch(&mut rng, p.batch, config.seq, config.vocab, &device)?;
    let (times, ledger) = timed_forwards(ctx, &p, &model, (&x, &y))?;
    let cells = profile_cells(&ledger, times);
    let shares = Shares {
        held: cells.values().map(|t| t.bytes).sum(),
        seconds: cells.values().map(|t| t.seconds).sum(),
    };
    let mut parts: BTreeMap<String, Totals> = BTreeMap::new();
    for ((_, part), t) in &cells {
        let e = parts.entry(part.clone()).or_default();
        e.bytes += t.bytes;
        e.tensors += t.tensors;
        e.seconds += t.seconds;
    }
    parts_table(ctx, &parts, &shares);
    let blocks = layers_table(ctx, &cells, &shares);
    let biggest = biggest_and_slowest(ctx, &parts, &shares);
    ctx.metric("held", shares.held as f64);
    ctx.metric("blocks_share", shares.bytes(blocks));
    ctx.metric("biggest_share", biggest);
    ctx.metric("forward_seconds", shares.seconds);
    forward_path(ctx, &p, &cells);
    Ok(())
}
