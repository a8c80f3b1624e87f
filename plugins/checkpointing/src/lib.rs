//! The checkpointing cell: activation checkpointing (recomputation) for
//! candle, proven equal to plain backprop and measured.
//!
//! The technique is `candle_checkpoint::checkpoint_sequential` from the
//! toolkit; this cell is its experiment. With `n` layers in `sqrt(n)`
//! segments, `O(sqrt(n))` activations for one extra forward (Chen et al.,
//! 2016).
#![warn(missing_docs)]

use std::time::Instant;

use candle_checkpoint::{checkpoint_sequential, checkpoint_sequential_with, lean_backward, Policy};
use candle_toolkit_testbench::{batch, seed_weights, Config as TransformerConfig, Transformer};
use workbook_sdk::candle_nn::{VarBuilder, VarMap};

use serde::{Deserialize, Serialize};
use workbook_models::{
    cross_entropy, grads_max_abs_diff, max_abs_diff, param_grads, Activation, Mlp, Rng,
};
use workbook_sdk::anyhow;
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{DType, Module, Result, Tensor, Var};
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::observe::{Marks, Tags};
use workbook_sdk::output::{mib, Axis, Marker, Series, Unit};
use workbook_sdk::{Category, Context, Figure, Plugin, Rules, Table, Violation};

fn run_segment<M: Module>(layers: &[M], x: &Tensor) -> Result<Tensor> {
    layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))
}

/// The checkpointing tip's "heavy function": `x + a`, `adds` times.
#[derive(Debug, Clone)]
pub struct Heavy {
    a: Var,
    adds: usize,
}

impl Heavy {
    /// A heavy function sharing the parameter `a`.
    pub fn new(a: Var, adds: usize) -> Self {
        Self { a, adds }
    }
}

impl Module for Heavy {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (0..self.adds).try_fold(x.clone(), |h, _| h.broadcast_add(self.a.as_tensor()))
    }
}

/// Parameters of the checkpointing cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// Width of the notebook's block (features).
    pub width: usize,
    /// The notebook's batch (rows).
    pub batch: usize,
    /// The notebook's classes.
    #[schemars(range(min = 2))]
    pub classes: usize,
    /// Seed of weights and data.
    pub seed: u64,
    /// Width of the deep stack (features).
    pub stack_width: usize,
    /// Depth (Linear + GELU blocks) of the deep stack.
    pub stack_depth: usize,
    /// Batch of the deep stack (rows).
    pub stack_batch: usize,
    /// Segment counts swept.
    pub segments: Vec<usize>,
    /// Timed repetitions of each variant (the median is reported).
    #[schemars(range(min = 1))]
    pub repeats: usize,
    /// Calls of the heavy function.
    pub heavy_calls: usize,
    /// Additions inside one call of the heavy function.
    pub heavy_adds: usize,
    /// Width of the transformer the selective policies are measured on (features).
    pub policy_width: usize,
    /// Blocks of the policies' transformer.
    #[schemars(range(min = 1))]
    pub policy_depth: usize,
    /// Attention heads of the policies' transformer (a divisor of `policy_width`).
    pub policy_heads: usize,
    /// Sequence length of the policies' transformer (tokens).
    pub policy_seq: usize,
    /// Batch of the policies' transformer (sequences).
    pub policy_batch: usize,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            width: 64,
            batch: 16,
            classes: 2,
            seed: 47,
            stack_width: 1024,
            stack_depth: 16,
            stack_batch: 1024,
            segments: vec![1, 2, 4, 8, 16],
            repeats: 3,
            heavy_calls: 1000,
            heavy_adds: 100,
            policy_width: 256,
            policy_depth: 4,
            policy_heads: 4,
            policy_seq: 256,
            policy_batch: 4,
        }
    }
}

/// The checkpointing plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct Checkpointing;

/// One way of running a forward and backward, measured.
struct Backprop {
    /// The first run's peak above the region's start.
    peak: u64,
    /// The first run's peak of activations above the region's start.
    act: u64,
    /// The median time of the runs.
    time: f64,
    /// The first run's gradients.
    grads: GradStore,
}

/// `step` run `repeats` times, each in a region named `name`: the first
/// run's memory and gradients (later runs only time), the median time.
fn measure_backprop(
    ctx: &mut Context,
    name: &str,
    repeats: usize,
    mut step: impl FnMut(&mut workbook_sdk::Region) -> anyhow::Result<GradStore>,
) -> anyhow::Result<Backprop> {
    let mut first = None;
    let mut times = Vec::new();
    for rep in 0..repeats {
        ctx.progress(&format!("{name}, run {}", rep + 1));
        let mut region = ctx.region(name);
        let start = Instant::now();
        let grads = step(&mut region)?;
        times.push(start.elapsed().as_secs_f64());
        if first.is_none() {
            let r = ctx.end_region(region);
            first = Some((
                r.peak_above_baseline(),
                r.category_peak_above_baseline(Category::Activations),
                grads,
            ));
        }
    }
    let Some((peak, act, grads)) = first else {
        anyhow::bail!("{name}: repeats must be at least 1");
    };
    Ok(Backprop {
        peak,
        act,
        time: median(times),
        grads,
    })
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

impl Plugin for Checkpointing {
    type Params = Params;

    fn name(&self) -> &str {
        "checkpointing"
    }

    fn description(&self) -> &str {
        "activation checkpointing: equal gradients, peak per segment count, time overhead"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        r.at_least("width", p.width, 1)
            .at_least("batch", p.batch, 1)
            .at_least("classes", p.classes, 2)
            .at_least("stack_width", p.stack_width, 1)
            .at_least("stack_depth", p.stack_depth, 1)
            .at_least("stack_batch", p.stack_batch, 1)
            .list("segments", &p.segments, 1, 1)
            .at_least("repeats", p.repeats, 1)
            .at_least("heavy_calls", p.heavy_calls, 1)
            .at_least("heavy_adds", p.heavy_adds, 1)
            .at_least("policy_width", p.policy_width, 1)
            .at_least("policy_depth", p.policy_depth, 1)
            .between("policy_heads", p.policy_heads, 1, p.policy_width.max(1))
            .require(
                p.policy_heads == 0 || p.policy_width.is_multiple_of(p.policy_heads),
                "policy_heads",
                format!("{} with policy_width = {}", p.policy_heads, p.policy_width),
                "allowed: a divisor of policy_width",
            )
            .at_least("policy_seq", p.policy_seq, 1)
            .at_least("policy_batch", p.policy_batch, 1);
        // The stack is stack_depth blocks of Linear + GELU: 2 × stack_depth
        // modules to cut into segments.
        let modules = p.stack_depth.saturating_mul(2);
        for (i, &s) in p.segments.iter().enumerate() {
            if s > modules {
                r.violation(
                    format!("segments[{i}]"),
                    s.to_string(),
                    format!(
                        "allowed: at most the {modules} modules of the stack (2 × stack_depth)"
                    ),
                );
            }
        }
        let (w, sw) = (p.width as u64, p.stack_width as u64);
        r.elements("width", "width × width", &[w, w])
            .elements("batch", "batch × width", &[p.batch as u64, w])
            .elements("stack_width", "stack_width × stack_width", &[sw, sw])
            .elements(
                "stack_batch",
                "stack_depth × stack_batch × stack_width",
                &[p.stack_depth as u64, p.stack_batch as u64, sw],
            )
            .elements(
                "heavy_calls",
                "heavy_calls × heavy_adds",
                &[p.heavy_calls as u64, p.heavy_adds as u64],
            )
            .elements(
                "policy_seq",
                "policy_batch × policy_heads × policy_seq × policy_seq",
                &[
                    p.policy_batch as u64,
                    p.policy_heads as u64,
                    p.policy_seq as u64,
                    p.policy_seq as u64,
                ],
            );
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        // Plain backprop keeps every block's output of the stack.
        workbook_sdk::rules::f32_outputs_floor(
            "the plain stack keeps",
            p.stack_depth,
            p.stack_batch,
            p.stack_width,
        )
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        let mut specs = vec![
            MetricSpec::number("loss", "loss of the notebook's checkpointed block and head"),
            MetricSpec::number(
                "input_grad_present",
                "1 if plain backprop gives the block's input a gradient, else 0",
            ),
            MetricSpec::number(
                "input_grad_max_abs_diff",
                "largest input-gradient difference, checkpointed block against plain",
            ),
            MetricSpec::number(
                "block_grad_max_abs_diff",
                "largest parameter-gradient difference, checkpointed block against plain",
            ),
            MetricSpec::bytes("peak_plain", "peak of plain backprop on the deep stack"),
            MetricSpec::bytes(
                "peak_plain_fused",
                "peak of plain backprop on the deep stack's fused layers",
            ),
            MetricSpec::bytes(
                "activation_peak_plain_fused",
                "activations at their peak, plain backprop on the fused layers",
            ),
            MetricSpec::number(
                "fused_grad_max_abs_diff",
                "largest gradient difference, fused layers against plain backprop",
            ),
            MetricSpec::bytes(
                "peak_plain_lean",
                "peak of plain backprop on the fused layers under the lean backward",
            ),
            MetricSpec::seconds(
                "time_plain_lean",
                "median time of plain backprop on the fused layers under the lean backward",
            ),
            MetricSpec::number(
                "lean_grad_max_abs_diff",
                "largest gradient difference, lean backward against plain backprop",
            ),
            MetricSpec::bytes("peak_best", "lowest checkpointed peak of the segment sweep"),
            MetricSpec::count("best_segments", "segment count with the lowest peak"),
            MetricSpec::bytes(
                "activation_peak_plain",
                "activations at their peak, plain backprop on the deep stack",
            ),
            MetricSpec::bytes(
                "activation_peak_best",
                "lowest activations at their peak of the segment sweep",
            ),
            MetricSpec::count(
                "best_activation_segments",
                "segment count with the lowest activations at their peak",
            ),
            MetricSpec::number(
                "sqrt_layers",
                "square root of the stack's modules (2 × stack_depth) cut into segments",
            ),
            MetricSpec::number(
                "stack_grad_max_abs_diff",
                "largest gradient difference of the checkpointed stack and plain, over the sweep",
            ),
            MetricSpec::seconds(
                "time_plain",
                "median time of plain backprop on the deep stack",
            ),
            MetricSpec::seconds(
                "time_best",
                "median time of the segment count with the lowest peak",
            ),
            MetricSpec::ratio("time_overhead", "time_best over time_plain"),
            MetricSpec::count("heavy_ops", "additions of the heavy function, calls × adds"),
            MetricSpec::number(
                "heavy_blocks_per_tensor",
                "heap blocks one tensor made by an addition occupies, measured",
            ),
            MetricSpec::count(
                "heavy_live_tensors_plain",
                "tensors live at the peak, heavy function without checkpointing",
            ),
            MetricSpec::count(
                "heavy_live_tensors_checkpointed",
                "tensors live at the peak, heavy function checkpointed a call per segment",
            ),
            MetricSpec::count(
                "heavy_expected_checkpointed",
                "segment inputs plus one segment's intermediates: heavy_calls + heavy_adds",
            ),
            MetricSpec::number(
                "heavy_grad_abs_diff",
                "gradient difference, checkpointed heavy function against plain",
            ),
        ];
        // The policies, in the order they are measured.
        for (key, what) in [
            ("plain", "plain backprop"),
            ("nothing", "keeping nothing (nothing_saveable)"),
            ("dots", "keeping every product (dots_saveable)"),
            ("names", "keeping the linear layers' products"),
        ] {
            specs.extend([
                MetricSpec::bytes(
                    format!("policy_peak_{key}"),
                    format!("peak of the transformer's forward and backward, {what}"),
                ),
                MetricSpec::bytes(
                    format!("policy_activations_{key}"),
                    format!("activations at their peak in the transformer, {what}"),
                ),
                MetricSpec::seconds(
                    format!("policy_time_{key}"),
                    format!("median time of the transformer's forward and backward, {what}"),
                ),
            ]);
        }
        specs.push(MetricSpec::number(
            "policy_grad_max_abs_diff",
            "largest gradient difference of a policy against plain backprop, worst policy",
        ));
        specs
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        let device = ctx.device().clone();
        let mut rng = Rng::seeded(p.seed);
        anyhow::ensure!(p.repeats > 0, "repeats must be at least 1");

        // The notebook's cell: a checkpointed block, a head, an input that needs a gradient.
        let block = Mlp::new(
            &mut rng,
            &[p.width, p.width, p.width],
            Activation::Relu,
            DType::F32,
            &device,
        )?;
        let block_layers: Vec<_> = block
            .layers()
            .iter()
            .cloned()
            .chain(std::iter::once(workbook_models::Layer::Activation(
                Activation::Relu,
            )))
            .collect();
        let head = Mlp::new(
            &mut rng,
            &[p.width, p.classes],
            Activation::Relu,
            DType::F32,
            &device,
        )?;
        let input = Var::from_tensor(&rng.randn((p.batch, p.width), &device)?)?;
        let target = rng.labels(p.batch, p.classes as u32, &device)?;
        let loss_of = |h: &Tensor| cross_entropy(&head.forward(h)?, &target);
        let mut vars = block.vars();
        vars.extend(head.vars());

        let plain = loss_of(&run_segment(&block_layers, input.as_tensor())?)?;
        let plain_store = plain.backward()?;
        let plain_input_grad = plain_store.get(input.as_tensor()).map(|g| g.detach());
        let ckpt =
            checkpoint_sequential(&block_layers, 1, input.as_tensor(), &vars, loss_of, &Tags)?;
        let loss = ckpt.loss.to_scalar::<f32>()?;
        ctx.print(format!("{loss:.4}"));
        ctx.metric("loss", loss as f64);
        ctx.metric(
            "input_grad_present",
            f64::from(u8::from(plain_input_grad.is_some())),
        );
        let input_diff = match (&plain_input_grad, &ckpt.input_grad) {
            (Some(a), Some(b)) => max_abs_diff(a, b)?,
            _ => f64::INFINITY,
        };
        ctx.metric("input_grad_max_abs_diff", input_diff);
        ctx.metric(
            "block_grad_max_abs_diff",
            grads_max_abs_diff(&param_grads(&plain_store, &vars), &ckpt.grads, &vars)?,
        );
        drop((plain, plain_store));

        self.sweep(ctx, &p, &mut rng)?;
        self.heavy(ctx, &p)?;
        self.policies(ctx, &p)?;
        Ok(())
    }
}

/// The policies measured, with their names in tables and metrics.
fn policies() -> [(&'static str, &'static str, Option<Policy>); 4] {
    [
        ("plain backprop", "plain", None),
        (
            "keep nothing (nothing_saveable)",
            "nothing",
            Some(Policy::Nothing),
        ),
        (
            "keep every product (dots_saveable)",
            "dots",
            Some(Policy::Dots),
        ),
        (
            "keep the linear layers' products",
            "names",
            Some(Policy::Names(
                ["qkv", "proj", "up", "down"].map(String::from).to_vec(),
            )),
        ),
    ]
}

impl Checkpointing {
    /// Selective checkpointing on a small transformer, one block per
    /// segment: what each policy keeps, its peak and its time.
    fn policies(&self, ctx: &mut Context, p: &Params) -> anyhow::Result<()> {
        let device = ctx.device().clone();
        let cfg = TransformerConfig {
            vocab: 256,
            width: p.policy_width,
            heads: p.policy_heads,
            depth: p.policy_depth,
            tiled: None,
        };
        let map = VarMap::new();
        let model = Category::Parameters.scope(|| -> anyhow::Result<_> {
            let m = Transformer::new(&cfg, VarBuilder::from_varmap(&map, DType::F32, &device))?;
            seed_weights(&map, p.seed)?;
            Ok(m)
        })?;
        let vars = map.all_vars();
        let (ids, targets) = Category::Inputs
            .scope(|| batch(p.seed, p.policy_batch, p.policy_seq, cfg.vocab, &device))?;
        let head = |h: &Tensor| model.loss(h, &targets);
        let segments = model.layers().len();
        let mut table = Table::new(
            format!(
                "Selective checkpointing, {} blocks of width {}, {} heads, {} x {} tokens, a segment per block",
                p.policy_depth, p.policy_width, p.policy_heads, p.policy_batch, p.policy_seq
            ),
            &[
                ("policy", Unit::None),
                ("peak", Unit::Bytes),
                ("activations at their peak", Unit::Bytes),
                ("median time", Unit::Seconds),
                ("max |grad diff|", Unit::None),
            ],
        );
        let mut reference: Option<GradStore> = None;
        let mut worst = 0f64;
        for (label, key, policy) in policies() {
            let mut times = Vec::new();
            let mut report = None;
            for rep in 0..p.repeats {
                ctx.progress(&format!("policy {key}, run {}", rep + 1));
                let mut region = ctx.region(format!("policy: {label}"));
                let start = Instant::now();
                let grads = match &policy {
                    None => Category::Gradients.scope(|| -> anyhow::Result<GradStore> {
                        let loss = Category::Activations
                            .scope(|| head(&run_segment(model.layers(), &ids)?))?;
                        region.mark("after forward");
                        Ok(param_grads(&loss.backward()?, &vars))
                    })?,
                    Some(policy) => {
                        checkpoint_sequential_with(
                            model.layers(),
                            segments,
                            &ids,
                            &vars,
                            head,
                            policy,
                            &Marks::new(&mut region),
                        )?
                        .grads
                    }
                };
                region.mark("after backward");
                times.push(start.elapsed().as_secs_f64());
                if rep == 0 {
                    let diff = match &reference {
                        Some(r) => grads_max_abs_diff(r, &grads, &vars)?,
                        None => 0.0,
                    };
                    worst = worst.max(diff);
                    if reference.is_none() {
                        reference = Some(grads);
                    } else {
                        drop(grads);
                    }
                    report = Some((ctx.end_region(region), diff));
                }
            }
            let Some((r, diff)) = report else {
                anyhow::bail!("no run of policy {key}");
            };
            let time = median(times);
            let peak = r.peak_above_baseline();
            let acts = r.category_peak_above_baseline(Category::Activations);
            ctx.metric(format!("policy_peak_{key}"), peak as f64);
            ctx.metric(format!("policy_activations_{key}"), acts as f64);
            ctx.metric(format!("policy_time_{key}"), time);
            table.row(vec![
                label.into(),
                peak.into(),
                acts.into(),
                time.into(),
                diff.into(),
            ]);
        }
        ctx.metric("policy_grad_max_abs_diff", worst);
        ctx.table(table);
        Ok(())
    }

    fn sweep(&self, ctx: &mut Context, p: &Params, rng: &mut Rng) -> anyhow::Result<()> {
        let device = ctx.device().clone();
        let model = Mlp::stack(
            rng,
            p.stack_width,
            p.stack_depth,
            Activation::Gelu,
            DType::F32,
            &device,
        )?;
        let vars = model.vars();
        let (x, y) = Category::Inputs.scope(|| -> anyhow::Result<_> {
            Ok((
                rng.randn((p.stack_batch, p.stack_width), &device)?,
                rng.labels(p.stack_batch, p.stack_width as u32, &device)?,
            ))
        })?;
        let head = |h: &Tensor| cross_entropy(h, &y);

        // A forward on candle-nn's layers or the fused ones, then candle's
        // own backward.
        let candle_backward = |fused: bool, region: &mut workbook_sdk::Region| {
            let loss = Category::Activations.scope(|| {
                let h = if fused {
                    model.forward_fused(&x)?
                } else {
                    model.forward(&x)?
                };
                head(&h)
            })?;
            region.mark("after forward");
            let grads = Category::Gradients
                .scope(|| -> anyhow::Result<_> { Ok(param_grads(&loss.backward()?, &vars)) })?;
            drop(loss);
            region.mark("after backward");
            Ok(grads)
        };

        // Plain backprop: the reference for gradients, memory and time.
        let plain = measure_backprop(ctx, "plain backprop", p.repeats, |r| {
            candle_backward(false, r)
        })?;
        let (plain_peak, plain_act, plain_time) = (plain.peak, plain.act, plain.time);
        let plain_grads = plain.grads;

        // The same plain backprop with the toolkit's fused layers: the
        // framework's own overhead, beside what checkpointing saves.
        let name = "plain backprop, fused layers (candle-lean-nn)";
        let fused_run = measure_backprop(ctx, name, p.repeats, |r| candle_backward(true, r))?;
        let lean_diff = grads_max_abs_diff(&plain_grads, &fused_run.grads, &vars)?;
        let (lean_peak, lean_act, lean_time) = (fused_run.peak, fused_run.act, fused_run.time);
        drop(fused_run);

        // The fused layers again, under the toolkit's lean backward (each
        // layer's graph dropped once the backward has passed it, as PyTorch
        // frees what it saved) and its one-operation cross-entropy.
        let fused = model.fused_layers()?;
        let lean_head = |h: &Tensor| candle_lean_nn::cross_entropy(h, &y);
        let name = "plain backprop, fused layers, lean backward";
        let driver = measure_backprop(ctx, name, p.repeats, |region| {
            Ok(lean_backward(&fused, &x, &vars, lean_head, &Marks::new(region))?.grads)
        })?;
        let driver_diff = grads_max_abs_diff(&plain_grads, &driver.grads, &vars)?;
        let (driver_peak, driver_act, driver_time) = (driver.peak, driver.act, driver.time);
        drop(driver);

        let mut table = Table::new(
            format!(
                "{} layers of Linear({w},{w}) + GELU, batch {}",
                p.stack_depth,
                p.stack_batch,
                w = p.stack_width
            ),
            &[
                ("segments", Unit::Count),
                ("peak", Unit::Bytes),
                ("vs plain", Unit::Ratio),
                ("activations at their peak", Unit::Bytes),
                ("median time", Unit::Seconds),
                ("time vs plain", Unit::Ratio),
                ("max |grad diff|", Unit::None),
            ],
        );
        table.row(vec![
            "plain".into(),
            plain_peak.into(),
            1.0.into(),
            plain_act.into(),
            plain_time.into(),
            1.0.into(),
            0.0.into(),
        ]);
        table.row(vec![
            "plain, fused layers".into(),
            lean_peak.into(),
            (lean_peak as f64 / plain_peak as f64).into(),
            lean_act.into(),
            lean_time.into(),
            (lean_time / plain_time).into(),
            lean_diff.into(),
        ]);
        table.row(vec![
            "plain, fused layers, lean backward".into(),
            driver_peak.into(),
            (driver_peak as f64 / plain_peak as f64).into(),
            driver_act.into(),
            driver_time.into(),
            (driver_time / plain_time).into(),
            driver_diff.into(),
        ]);
        let mut points = Vec::new();
        let mut worst_diff = 0f64;
        let mut best = (u64::MAX, 0usize, 0f64);
        let mut best_act = (u64::MAX, 0usize);
        let mut act_points = Vec::new();
        for &segments in &p.segments {
            let mut times = Vec::new();
            let mut peak = 0;
            let mut act = 0;
            for rep in 0..p.repeats {
                ctx.progress(&format!("{segments} segment(s), run {}", rep + 1));
                let mut region = ctx.region(format!("checkpointed, {segments} segment(s)"));
                let start = Instant::now();
                let out = checkpoint_sequential(
                    model.layers(),
                    segments,
                    &x,
                    &vars,
                    head,
                    &Marks::new(&mut region),
                )?;
                region.mark("after backward");
                times.push(start.elapsed().as_secs_f64());
                if rep == 0 {
                    worst_diff =
                        worst_diff.max(grads_max_abs_diff(&plain_grads, &out.grads, &vars)?);
                    drop(out);
                    let r = ctx.end_region(region);
                    peak = r.peak_above_baseline();
                    act = r.category_peak_above_baseline(Category::Activations);
                }
            }
            let time = median(times);
            if peak < best.0 {
                best = (peak, segments, time);
            }
            if act < best_act.0 {
                best_act = (act, segments);
            }
            points.push((segments as f64, peak as f64));
            act_points.push((segments as f64, act as f64));
            table.row(vec![
                segments.into(),
                peak.into(),
                (peak as f64 / plain_peak as f64).into(),
                act.into(),
                time.into(),
                (time / plain_time).into(),
                worst_diff.into(),
            ]);
        }
        ctx.table(table);
        // What is cut into segments is the stack's modules, a Linear and a
        // GELU per block: n is 2 × stack_depth, not the depth.
        let sqrt_n = (model.layers().len() as f64).sqrt();
        ctx.figure(Figure {
            id: "checkpointing-segments".into(),
            title: format!(
                "Peak memory against checkpoint segments ({} layers)",
                p.stack_depth
            ),
            x: Axis {
                label: "segments".into(),
                unit: Unit::Count,
                log: true,
            },
            y: Axis {
                label: "peak memory".into(),
                unit: Unit::Bytes,
                log: false,
            },
            series: vec![
                Series {
                    name: "checkpointed, total peak".into(),
                    points: points.clone(),
                },
                Series {
                    name: "checkpointed, activations at their peak".into(),
                    points: act_points,
                },
                Series {
                    name: "plain backprop".into(),
                    points: points
                        .iter()
                        .map(|(x, _)| (*x, plain_peak as f64))
                        .collect(),
                },
            ],
            markers: vec![Marker {
                x: sqrt_n,
                label: format!("sqrt(n) = {sqrt_n:.1}"),
            }],
            guides: Vec::new(),
        });
        ctx.print(format!(
            "plain backprop peak {:.1} MiB; best {} segments {:.1} MiB ({:.0}% of plain), time x{:.2}",
            mib(plain_peak),
            best.1,
            mib(best.0),
            100.0 * best.0 as f64 / plain_peak as f64,
            best.2 / plain_time
        ));
        ctx.metric("peak_plain", plain_peak as f64);
        ctx.metric("peak_plain_fused", lean_peak as f64);
        ctx.metric("activation_peak_plain_fused", lean_act as f64);
        ctx.metric("fused_grad_max_abs_diff", lean_diff);
        ctx.metric("peak_plain_lean", driver_peak as f64);
        ctx.metric("time_plain_lean", driver_time);
        ctx.metric("lean_grad_max_abs_diff", driver_diff);
        ctx.metric("peak_best", best.0 as f64);
        ctx.metric("best_segments", best.1 as f64);
        ctx.metric("activation_peak_plain", plain_act as f64);
        ctx.metric("activation_peak_best", best_act.0 as f64);
        ctx.metric("best_activation_segments", best_act.1 as f64);
        ctx.metric("sqrt_layers", sqrt_n);
        ctx.metric("stack_grad_max_abs_diff", worst_diff);
        ctx.metric("time_plain", plain_time);
        ctx.metric("time_best", best.2);
        ctx.metric("time_overhead", best.2 / plain_time);
        Ok(())
    }

    fn heavy(&self, ctx: &mut Context, p: &Params) -> anyhow::Result<()> {
        let device = ctx.device().clone();
        let a = Category::Parameters.scope(|| Var::new(1f32, &device))?;
        let layers: Vec<Heavy> = (0..p.heavy_calls)
            .map(|_| Heavy::new(a.clone(), p.heavy_adds))
            .collect();
        let x0 = Var::new(0f32, &device)?;
        let head = |h: &Tensor| Ok(h.clone());

        // How many blocks one tensor made by an op occupies, measured.
        let per_tensor = {
            let n = 1000;
            let mut region = ctx.region("calibration");
            let chain = Heavy::new(a.clone(), n).forward(x0.as_tensor())?;
            region.mark("chain");
            // Calibration is not shown; only its block count is used.
            let blocks = region.blocks_above_baseline();
            drop(chain);
            blocks as f64 / n as f64
        };

        ctx.progress("heavy function, plain");
        let mut region = ctx.region("heavy function, plain");
        let y = Category::Activations.scope(|| run_segment(&layers, x0.as_tensor()))?;
        region.mark("after forward");
        let plain_store = Category::Gradients.scope(|| y.backward())?;
        let plain_grad = plain_store.get(a.as_tensor()).map(|g| g.detach());
        drop((y, plain_store));
        let plain_blocks = ctx.end_region(region).blocks_above_baseline();

        ctx.progress("heavy function, checkpointed");
        let mut region = ctx.region("heavy function, checkpointed");
        let out = checkpoint_sequential(
            &layers,
            p.heavy_calls,
            x0.as_tensor(),
            std::slice::from_ref(&a),
            head,
            &Tags,
        )?;
        region.mark("after backward");
        let ckpt_grad = out.grads.get(a.as_tensor()).map(|g| g.detach());
        drop(out);
        let ckpt_blocks = ctx.end_region(region).blocks_above_baseline();

        let plain_tensors = (plain_blocks as f64 / per_tensor).round();
        let ckpt_tensors = (ckpt_blocks as f64 / per_tensor).round();
        let ops = (p.heavy_calls * p.heavy_adds) as f64;
        ctx.print(format!(
            "heavy function, {} calls of {} additions: about {plain_tensors} live tensors at the peak plain, {ckpt_tensors} checkpointed",
            p.heavy_calls, p.heavy_adds
        ));
        ctx.metric("heavy_ops", ops);
        ctx.metric("heavy_blocks_per_tensor", per_tensor);
        ctx.metric("heavy_live_tensors_plain", plain_tensors);
        ctx.metric("heavy_live_tensors_checkpointed", ckpt_tensors);
        ctx.metric(
            "heavy_expected_checkpointed",
            (p.heavy_calls + p.heavy_adds) as f64,
        );
        let grad_diff = match (plain_grad, ckpt_grad) {
            (Some(a), Some(b)) => max_abs_diff(&a, &b)?,
            _ => f64::INFINITY,
        };
        ctx.metric("heavy_grad_abs_diff", grad_diff);
        Ok(())
    }
}
