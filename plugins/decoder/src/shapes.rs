//! The `decoder_shapes` cell's experiment: what `workbook run` executes and
//! what chapter 5's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use workbook_decoder::{load, short_name, state_bytes, ShapesParams};
use workbook_models::llama::Llama;
use workbook_models::Rng;
use workbook_sdk::anyhow;
use workbook_sdk::candle::DType;
use workbook_sdk::output::Unit;
use workbook_sdk::{Category, Context, Table};

// notebook cell
/// The experiment: each model's parameters counted from its config's
/// shapes beside the published count; the small ones built and their
/// variables counted; what training each in f32 with AdamW holds before a
/// single activation, set against a device's memory.
pub fn decoder_shapes_experiment(ctx: &mut Context, p: ShapesParams) -> anyhow::Result<()> {
    let device = ctx.device().clone();
    let gib = (1u64 << 30) as f64;
    let mut table = Table::new(
        "Published decoders: parameters and f32 training state with AdamW",
        &[
            ("model", Unit::None),
            ("family", Unit::None),
            ("layers", Unit::Count),
            ("hidden", Unit::Count),
            ("heads / kv", Unit::None),
            ("vocabulary", Unit::Count),
            ("counted", Unit::Count),
            ("published", Unit::Count),
            ("training state", Unit::Bytes),
            ("share of the device", Unit::Ratio),
        ],
    );
    for model in &p.models {
        let cfg = load(&model.config)?;
        let name = short_name(&model.config);
        let counted = cfg.parameter_count();
        ctx.metric(format!("params_{name}"), counted as f64);
        ctx.metric(format!("published_{name}"), model.published as f64);
        if counted <= p.build_limit {
            ctx.progress(&format!("building {name}"));
            let built = Category::Parameters
                .scope(|| Llama::new(&cfg, DType::BF16, &mut Rng::seeded(1), &device))?;
            ctx.metric(format!("built_{name}"), built.param_count() as f64);
        }
        let state = state_bytes(counted);
        let share = state as f64 / (p.device_gib * gib);
        ctx.metric(format!("state_{name}"), state as f64);
        ctx.metric(format!("state_share_{name}"), share);
        table.row(vec![
            name.as_str().into(),
            cfg.family.name().into(),
            (cfg.layers as u64).into(),
            (cfg.hidden as u64).into(),
            format!("{} / {}", cfg.heads, cfg.kv_heads).into(),
            (cfg.vocab as u64).into(),
            counted.into(),
            model.published.into(),
            state.into(),
            share.into(),
        ]);
    }
    ctx.table(table);
    Ok(())
}
