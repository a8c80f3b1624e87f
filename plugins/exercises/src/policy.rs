//! The policy exercise: what `workbook run` executes (with the reference
//! solution) and what the chapter's notebook shows (with a `todo!()` in its
//! place, for the learner to write), a cell per `// notebook cell` line
//! (see `workbook_sdk::notebook`). Crates are named by their names, this
//! one's included, so that the same text compiles in a notebook cell.

use candle_checkpoint::{Policy, Sequential};
use workbook_exercises::{fewest_recomputed, PolicyParams as PolicyExerciseParams};
use workbook_models::taped::{batch, Config as TransformerConfig, Transformer};
use workbook_models::{grads_max_abs_diff, param_grads};
use workbook_sdk::anyhow;
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{Module, Tensor};
use workbook_sdk::candle_nn::VarMap;
use workbook_sdk::observe::Marks;
use workbook_sdk::output::{RegionReport, Unit};
use workbook_sdk::{Category, Context, Table};

// notebook cell
/// One matrix product of a transformer block, as a checkpointing policy
/// weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Product {
    /// Its name in the block (`Tape::named_linear`, `Tape::named_matmul`).
    pub name: &'static str,
    /// The bytes of its output (f32), kept until the backward uses it if
    /// the policy keeps it.
    pub bytes: u64,
    /// Its multiply-adds, spent again in the backward if the policy does
    /// not keep it.
    pub macs: u64,
}

/// The six products of one block of the transformer below, on `batch`
/// sequences of `seq` tokens, `width` features and `heads` heads: the
/// attention's input projection, its scores and their mix with the values,
/// its output projection, and the MLP's two layers.
pub fn block_products(batch: usize, seq: usize, width: usize, heads: usize) -> Vec<Product> {
    let (b, n, w, h) = (batch as u64, seq as u64, width as u64, heads as u64);
    let f32_bytes = 4;
    let product = |name, elements: u64, macs| Product {
        name,
        bytes: elements * f32_bytes,
        macs,
    };
    vec![
        product("qkv", b * n * 3 * w, b * n * w * 3 * w),
        product("scores", b * h * n * n, b * n * n * w),
        product("mix", b * n * w, b * n * n * w),
        product("proj", b * n * w, b * n * w * w),
        product("up", b * n * 4 * w, b * n * w * 4 * w),
        product("down", b * n * w, b * n * 4 * w * w),
    ]
}

// notebook cell: exercise
/// Exercise: keep what is worth keeping.
///
/// Selective checkpointing keeps some products of each block from the
/// forward, so that the backward does not compute them again. A kept
/// product costs its `bytes` until the backward has used it; one not kept
/// costs its `macs` again. Return the names of the products to keep, so
/// that
///
/// - their bytes add up to at most `budget` (bytes per block), and
/// - the multiply-adds left to recompute are as few as any choice within
///   the budget allows.
///
/// Hint: keeping the most multiply-adds per byte first is not enough here;
/// six products make only 64 choices.
pub fn choose_kept(products: &[Product], budget: u64) -> Vec<&'static str> {
    // solution begin
    let mut best: (u64, Vec<&'static str>) = (0, Vec::new());
    for choice in 0u32..1 << products.len() {
        let kept: Vec<&Product> = products
            .iter()
            .enumerate()
            .filter(|(i, _)| choice >> i & 1 == 1)
            .map(|(_, p)| p)
            .collect();
        let bytes: u64 = kept.iter().map(|p| p.bytes).sum();
        let spared: u64 = kept.iter().map(|p| p.macs).sum();
        if bytes <= budget && spared > best.0 {
            best = (spared, kept.iter().map(|p| p.name).collect());
        }
    }
    best.1
    // solution end
}

// notebook cell
/// Bytes held when the forward has ended (the last `segment forward` mark)
/// over the region's start.
fn held_after_forward(report: &RegionReport) -> anyhow::Result<u64> {
    let mark = report
        .marks
        .iter()
        .rfind(|m| m.label == "segment forward")
        .ok_or_else(|| anyhow::anyhow!("`{}` marked no segment forward", report.name))?;
    Ok(mark.current.total().saturating_sub(report.baseline.total()))
}

/// The choice of `choose` checked (every name a product of the block) and
/// graded: its bytes against the budget, the multiply-adds it leaves to
/// recompute against the fewest any choice leaves. The products kept, and
/// their bytes.
pub fn graded_choice(
    ctx: &mut Context,
    p: &PolicyExerciseParams,
    choose: impl Fn(&[Product], u64) -> Vec<&'static str>,
) -> anyhow::Result<(Vec<&'static str>, u64)> {
    let products = block_products(p.batch, p.seq, p.width, p.heads);
    let all_bytes: u64 = products.iter().map(|q| q.bytes).sum();
    let budget = (p.budget_fraction * all_bytes as f64) as u64;
    let mut kept = choose(&products, budget);
    kept.sort_unstable();
    kept.dedup();
    for name in &kept {
        anyhow::ensure!(
            products.iter().any(|q| q.name == *name),
            "`{name}` is not a product of the block; they are {}",
            products
                .iter()
                .map(|q| q.name)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let is_kept = |q: &&Product| kept.contains(&q.name);
    let kept_bytes: u64 = products.iter().filter(is_kept).map(|q| q.bytes).sum();
    let recomputed: u64 = products
        .iter()
        .filter(|q| !is_kept(q))
        .map(|q| q.macs)
        .sum();
    let pairs: Vec<(u64, u64)> = products.iter().map(|q| (q.bytes, q.macs)).collect();
    let fewest = fewest_recomputed(&pairs, budget);
    ctx.print(format!(
        "kept: {}",
        if kept.is_empty() {
            "nothing".to_string()
        } else {
            kept.join(", ")
        }
    ));
    ctx.metric("budget_bytes", budget as f64);
    ctx.metric("kept_bytes", kept_bytes as f64);
    ctx.metric("kept_products", kept.len() as f64);
    ctx.metric("recomputed_macs", recomputed as f64);
    ctx.metric("fewest_recomputed_macs", fewest as f64);
    let mut choices = Table::new(
        format!("The products of a block, budget {budget} bytes"),
        &[
            ("product", Unit::None),
            ("output", Unit::Bytes),
            ("multiply-adds", Unit::None),
            ("kept", Unit::None),
        ],
    );
    for q in &products {
        choices.row(vec![
            q.name.into(),
            q.bytes.into(),
            (q.macs as f64).into(),
            if is_kept(&q) { "yes" } else { "" }.into(),
        ]);
    }
    ctx.table(choices);
    Ok((kept, kept_bytes))
}

/// The transformer the policies train, its parameters (and the map that
/// holds them) and a batch.
pub struct PolicyBench {
    /// The transformer.
    pub model: Transformer,
    /// The map its parameters live in.
    pub map: VarMap,
    /// The batch's tokens.
    pub ids: Tensor,
    /// The batch's targets.
    pub targets: Tensor,
}

// notebook cell
/// The exercise's transformer, seeded, and a batch, tagged by role.
pub fn policy_bench(ctx: &Context, p: &PolicyExerciseParams) -> anyhow::Result<PolicyBench> {
    let device = ctx.device().clone();
    let cfg = TransformerConfig {
        vocab: 256,
        width: p.width,
        heads: p.heads,
        depth: p.depth,
        tiled: None,
    };
    let map = VarMap::new();
    let model = Category::Parameters.scope(|| Transformer::seeded(&cfg, p.seed, &map, &device))?;
    let (ids, targets) =
        Category::Inputs.scope(|| batch(p.seed, p.batch, p.seq, cfg.vocab, &device))?;
    Ok(PolicyBench {
        model,
        map,
        ids,
        targets,
    })
}

/// One step with plain backprop, then one under each policy (keep
/// nothing, the products `kept`, every product) with a segment per block:
/// what each holds after the forward, its peak, and its gradients against
/// plain backprop's. The bytes each policy held, in that order.
pub fn policies_measured(
    ctx: &mut Context,
    p: &PolicyExerciseParams,
    b: &PolicyBench,
    kept: &[&'static str],
) -> anyhow::Result<Vec<u64>> {
    let (model, ids) = (&b.model, &b.ids);
    let vars = &b.map.all_vars();
    let head = |h: &Tensor| model.loss(h, &b.targets);
    let mut region = ctx.region("plain backprop");
    let plain = Category::Gradients.scope(|| -> anyhow::Result<GradStore> {
        let h = Category::Activations.scope(|| -> anyhow::Result<Tensor> {
            let mut h = ids.clone();
            for layer in model.layers() {
                h = layer.forward(&h)?;
            }
            Ok(head(&h)?)
        })?;
        Ok(param_grads(&h.backward()?, vars))
    })?;
    let report = ctx.end_region(region);
    ctx.metric("peak_plain", report.peak_above_baseline() as f64);
    let mut table = Table::new(
        format!(
            "One step, {} blocks of width {}, {} heads, {} x {} tokens, a segment per block",
            p.depth, p.width, p.heads, p.batch, p.seq
        ),
        &[
            ("policy", Unit::None),
            ("held after the forward", Unit::Bytes),
            ("peak", Unit::Bytes),
            ("max |grad diff|", Unit::None),
        ],
    );
    table.row(vec![
        "plain backprop".into(),
        "".into(),
        report.peak_above_baseline().into(),
        0.0.into(),
    ]);
    let names: Vec<String> = kept.iter().map(|n| n.to_string()).collect();
    let mut held = Vec::new();
    for (label, key, policy) in [
        ("keep nothing", "nothing", Policy::Nothing),
        ("your choice", "chosen", Policy::Names(names)),
        ("keep every product", "dots", Policy::Dots),
    ] {
        region = ctx.region(format!("policy: {label}"));
        let grads = Sequential::taped(model.layers())
            .segments(model.layers().len())
            .policy(&policy)
            .observer(&Marks::new(&mut region))
            .backward(ids, vars, head)?
            .grads;
        let diff = grads_max_abs_diff(&plain, &grads, vars)?;
        drop(grads);
        let report = ctx.end_region(region);
        let bytes = held_after_forward(&report)?;
        held.push(bytes);
        ctx.metric(format!("held_{key}"), bytes as f64);
        ctx.metric(format!("peak_{key}"), report.peak_above_baseline() as f64);
        if key == "chosen" {
            ctx.metric("grad_max_abs_diff", diff);
        }
        table.row(vec![
            label.into(),
            bytes.into(),
            report.peak_above_baseline().into(),
            diff.into(),
        ]);
    }
    ctx.table(table);
    Ok(held)
}

// notebook cell
/// The choice of `choose` graded: against the budget and against the
/// fewest multiply-adds any choice leaves. Then measured: a transformer
/// trained one step with a segment per block under each policy, keeping
/// nothing, the choice and every product, against plain backprop. The
/// forward holds what a policy keeps for every block but the last (which
/// runs once, in the backward), so the choice's bytes, times `depth - 1`,
/// are what it holds beyond keeping nothing.
pub fn grade_choice(
    ctx: &mut Context,
    p: &PolicyExerciseParams,
    choose: impl Fn(&[Product], u64) -> Vec<&'static str>,
) -> anyhow::Result<()> {
    let (kept, kept_bytes) = graded_choice(ctx, p, choose)?;
    let bench = policy_bench(ctx, p)?;
    let held = policies_measured(ctx, p, &bench, &kept)?;
    let kept_predicted = kept_bytes * (p.depth as u64 - 1);
    ctx.metric("kept_predicted", kept_predicted as f64);
    ctx.metric("kept_measured", held[1] as f64 - held[0] as f64);
    Ok(())
}

/// The exercise: your `choose_kept`, graded and measured.
pub fn policy_exercise(ctx: &mut Context, p: PolicyExerciseParams) -> anyhow::Result<()> {
    grade_choice(ctx, &p, choose_kept)
}
