//! The `saved_tensors` cell's experiment: what `workbook run` executes and
//! what chapter 3's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use candle_custom_grad::DirectBackward;
use candle_ledger::{Held, Label, Labeller, Ledger};
use workbook_models::Rng;
use workbook_models::{corpus, Gpt, Recipe};
use workbook_sdk::anyhow;
use workbook_sdk::candle::{DType, Tensor};
use workbook_sdk::parse_dtype;
use workbook_sdk::{Category, Context, Table, Unit};
use workbook_transformer::predict::Run;
use workbook_transformer::saved::Params as SavedTensorsParams;

// notebook cell
/// Whether a held tensor is one of the attention's `(b, a, s, s)` matrices.
pub fn is_quadratic(shape: &[usize], batch: usize, heads: usize, seq: usize) -> bool {
    shape == [batch, heads, seq, seq]
}

/// The GPT under `recipe` in `dtype`, and a batch of token ids and targets.
pub fn model_and_batch(
    ctx: &Context,
    p: &SavedTensorsParams,
    recipe: Recipe,
    dtype: DType,
) -> anyhow::Result<(Gpt, Tensor, Tensor)> {
    let (device, c) = (ctx.device().clone(), p.model);
    let mut rng = Rng::seeded(p.seed);
    let model = Gpt::new(recipe.apply(c), dtype, &mut rng, &device)?;
    let (x, y) =
        Category::Inputs.scope(|| corpus::batch(&mut rng, p.batch, c.seq, c.vocab, &device))?;
    Ok((model, x, y))
}

/// The GPT under `recipe`, one forward measured by the allocator (without
/// labels), then the same forward labelled part by part: its ledger, and
/// the activations the allocator counted. The two forwards must hold the
/// same bytes.
pub fn recipe_graph(
    ctx: &mut Context,
    p: &SavedTensorsParams,
    recipe: Recipe,
    dtype: DType,
) -> anyhow::Result<(Ledger, u64)> {
    let name = recipe.name();
    let (model, x, y) = model_and_batch(ctx, p, recipe, dtype)?;
    // The allocator's count, from a forward without labels.
    let region = ctx.region(format!("forward, {name}"));
    let notes = Labeller::unlabelled();
    let loss = Category::Activations.scope(|| model.loss(&x, &y, &notes))?;
    let measured = region.current_above_baseline().get(Category::Activations);
    let unlabelled = Category::Other.scope(|| Ledger::of(&loss, &notes))?;
    drop((loss, notes));
    ctx.end_region(region);
    // The same forward, labelled part by part.
    let labels = Labeller::new();
    let loss = model.loss(&x, &y, &labels)?;
    let ledger = Ledger::of(&loss, &labels)?;
    drop(loss);
    if ledger.total_bytes() != unlabelled.total_bytes() {
        anyhow::bail!(
            "the labelled forward held {} bytes, the unlabelled one {}",
            ledger.total_bytes(),
            unlabelled.total_bytes()
        );
    }
    Ok((ledger, measured))
}

// notebook cell
/// The GPT under a direct recipe, which keeps no graph: one forward through
/// its stages (`Gpt::direct_stages`: the embeddings, each block, the final
/// norm and head), each keeping what its backward needs, as the direct
/// backward's driver runs them, counted by the allocator. Its ledger lists
/// what the stages saved (`DirectSaved::parts`) and each stage's output,
/// which the next stage keeps as its input.
pub fn recipe_direct(
    ctx: &mut Context,
    p: &SavedTensorsParams,
    recipe: Recipe,
    dtype: DType,
) -> anyhow::Result<(Ledger, u64)> {
    let name = recipe.name();
    let (model, x, _) = model_and_batch(ctx, p, recipe, dtype)?;
    let stages = model.direct_stages();
    let region = ctx.region(format!("forward, {name}"));
    let kept = Category::Activations.scope(|| -> anyhow::Result<_> {
        let (mut h, mut kept) = (x.clone(), Vec::with_capacity(stages.len()));
        for stage in &stages {
            let (out, saved) = stage.forward_saved(&h)?;
            kept.push((out.clone(), saved));
            h = out;
        }
        Ok(kept)
    })?;
    let measured = region.current_above_baseline().get(Category::Activations);
    let mut ledger = Ledger::default();
    let last = stages.len() - 1;
    for (i, (out, saved)) in kept.iter().enumerate() {
        // Stage 0 is the embeddings, the last the head; block `i - 1` between.
        let layer = (i > 0 && i < last).then(|| i - 1);
        let output = match i {
            0 => "embedding",
            _ if i == last => "head",
            _ => "residual",
        };
        for (part, t) in saved.parts().into_iter().chain([(output, out)]) {
            ledger.held.push(Held {
                label: Some(Label {
                    layer,
                    part: part.into(),
                }),
                shape: t.dims().to_vec(),
                dtype: t.dtype(),
                bytes: (t.elem_count() * t.dtype().size_in_bytes()) as u64,
                nodes: 1,
            });
        }
    }
    drop(kept);
    ctx.end_region(region);
    Ok((ledger, measured))
}

// notebook cell
/// What the middle block holds for the backward, part by part, as a
/// table: its bytes linear in the sequence, its bytes quadratic in it, and
/// its tensors.
pub fn block_table(
    ctx: &mut Context,
    p: &SavedTensorsParams,
    ledger: &Ledger,
    name: &str,
) -> (u64, u64, usize) {
    let (c, mid) = (p.model, p.model.layers / 2);
    let mut parts = Table::new(
        format!("What block {mid} holds for the backward, {name} recipe"),
        &[
            ("part", Unit::None),
            ("shape", Unit::None),
            ("dtype", Unit::None),
            ("bytes", Unit::Bytes),
            ("views", Unit::Count),
        ],
    );
    let (mut linear, mut quadratic, mut count) = (0u64, 0u64, 0usize);
    for h in ledger.layer(mid) {
        count += 1;
        if is_quadratic(&h.shape, p.batch, c.heads, c.seq) {
            quadratic += h.bytes;
        } else {
            linear += h.bytes;
        }
        let part = h.label.as_ref().map_or("unlabelled", |l| l.part.as_str());
        parts.row(vec![
            part.into(),
            format!("{:?}", h.shape).into(),
            format!("{:?}", h.dtype).to_lowercase().into(),
            h.bytes.into(),
            (h.nodes as u64).into(),
        ]);
    }
    ctx.table(parts);
    (linear, quadratic, count)
}

// notebook cell
/// The experiment: for each recipe, the tensors one block holds for the
/// backward (in its graph, or saved by a direct recipe's stages), part by
/// part, in the units of Korthikanti et al.'s terms,
/// and the whole graph's bytes beside what the allocator counted.
pub fn saved_tensors_experiment(ctx: &mut Context, p: SavedTensorsParams) -> anyhow::Result<()> {
    let dtype = parse_dtype(&p.dtype)?;
    let c = p.model;
    let elem = dtype.size_in_bytes() as u64;
    let run = Run {
        layers: c.layers as u64,
        hidden: c.hidden as u64,
        heads: c.heads as u64,
        seq: c.seq as u64,
        batch: p.batch as u64,
        vocab: c.vocab as u64,
        params: c.param_count(),
        elem,
    };
    // Units of the paper's terms scaled to the dtype, as
    // `korthikanti_layer` is: its 34 and 5 count bytes of 16-bit values,
    // so one s·b·h tensor of the dtype is 2 units.
    let sbh_unit = (run.seq * run.batch * run.hidden * elem) as f64 / 2.0;
    let s2_unit = (run.heads * run.seq * run.seq * run.batch * elem) as f64 / 2.0;
    ctx.metric("korthikanti_layer", run.korthikanti_layer() as f64);
    let mid = c.layers / 2;
    let mut summary = Table::new(
        format!("One block (block {mid}) of the graph, per recipe"),
        &[
            ("recipe", Unit::None),
            ("tensors", Unit::Count),
            ("bytes", Unit::Bytes),
            ("s·b·h units", Unit::None),
            ("a·s²·b units", Unit::None),
            ("whole graph", Unit::Bytes),
            ("allocator, activations", Unit::Bytes),
        ],
    );
    for recipe in &p.recipes {
        let name = recipe.name();
        ctx.progress(&format!("what the {name} recipe keeps"));
        let (ledger, measured) = if recipe.direct() {
            recipe_direct(ctx, &p, *recipe, dtype)?
        } else {
            recipe_graph(ctx, &p, *recipe, dtype)?
        };
        let (linear, quadratic, count) = block_table(ctx, &p, &ledger, name);
        let total = ledger.total_bytes();
        ctx.metric(format!("ledger_{name}"), total as f64);
        ctx.metric(format!("measured_{name}"), measured as f64);
        ctx.metric(format!("coverage_{name}"), total as f64 / measured as f64);
        ctx.metric(format!("linear_units_{name}"), linear as f64 / sbh_unit);
        ctx.metric(
            format!("quadratic_units_{name}"),
            quadratic as f64 / s2_unit,
        );
        ctx.metric(format!("tensors_{name}"), count as f64);
        ctx.metric(format!("block_{name}"), (linear + quadratic) as f64);
        summary.row(vec![
            name.into(),
            (count as u64).into(),
            (linear + quadratic).into(),
            (linear as f64 / sbh_unit).into(),
            (quadratic as f64 / s2_unit).into(),
            total.into(),
            measured.into(),
        ]);
    }
    ctx.table(summary);
    Ok(())
}
