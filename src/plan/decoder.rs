//! A decoder's plan from its config.json in words, and the page of the
//! six published decoders on the card presets.

use workbook_planner::margin;

use crate::render::text::bytes;

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

/// Where a decoder plan's verification ran: this CPU, and for ZeRO one
/// rank of the job with its peers rehearsed in the same process.
pub fn decoder_verified_where(chosen: &workbook_planner::decoder::DecoderOption) -> String {
    use workbook_planner::decoder::Sharing;
    match chosen.recipe.sharing {
        Sharing::Zero1 { ranks } | Sharing::Zero2 { ranks } => format!(
            "Measured on this machine's CPU as rank 0 of {ranks}, its peers rehearsed in this \
             process: every collective fills the buffers a real rank's would, so the peak is a \
             real rank's.\n"
        ),
        Sharing::Offload => "Measured on this machine's CPU: the peak is what the device holds, \
                             AdamW's state on the host left out.\n"
            .to_string(),
        Sharing::Device => "Measured on this machine's CPU.\n".to_string(),
    }
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
                "Chosen: {}, {} of {} (an option fits when its prediction plus {:.0}% is \
                 within it).\n",
                option_words(o),
                bytes(o.prediction.total()),
                bytes(plan.budget),
                plan.margin * 100.0
            ));
        }
        None => {
            if let Some(line) = decoder_nothing_fits(plan) {
                out.push_str(&line);
                out.push('\n');
            }
        }
    }
    out
}

/// Why nothing of a decoder plan fits: its smallest option, what it
/// needs with the plan's room and how far over the budget that is, and what
/// could help. When the state that stays on every device (the weights,
/// with what the option keeps of AdamW's state) is alone over the budget,
/// no batch or sequence helps, and it says so. `None` for a plan with no
/// option.
pub fn decoder_nothing_fits(plan: &workbook_planner::decoder::DecoderPlan) -> Option<String> {
    let o = plan.options.iter().min_by_key(|o| o.prediction.total())?;
    let total = o.prediction.total();
    let room = margin::room(total, plan.margin);
    let over = |b: u64| !margin::fits(b, plan.budget, plan.margin);
    // Every device holds the f32 weights: ZeRO-1 and -2 share AdamW's
    // state and the gradients, not the weights.
    let weights = plan.params.saturating_mul(4);
    let hint = if over(weights) {
        format!(
            "The f32 weights alone take {}, and every device holds them (ZeRO-1 and -2 share \
             AdamW's state, not the weights): no --batch, --seq or --ranks helps; a card with \
             more memory does",
            bytes(weights)
        )
    } else if over(o.prediction.state) {
        format!(
            "Its weights with its share of AdamW's state alone take {}: no --batch or --seq \
             helps; {} ranks sharing AdamW's state do",
            bytes(o.prediction.state),
            if plan.ranks > 1 { "more" } else { "several" }
        )
    } else if plan.ranks > 1 {
        "Try a smaller --batch or --seq, or more --ranks".to_string()
    } else {
        "Try a smaller --batch or --seq, or several devices with --ranks N (ZeRO)".to_string()
    };
    Some(format!(
        "Nothing fits: the smallest, {}, needs {} ({} with the {:.0}% a plan leaves), {} over \
         the budget. {hint}.",
        option_words(o),
        bytes(total),
        bytes(room),
        plan.margin * 100.0,
        bytes(room.saturating_sub(plan.budget))
    ))
}

/// The page `docs/decoder-fits.md`: for each published decoder of
/// `models` (its name and shape), what `workbook plan --model` chooses on
/// each card preset at 2,048 and 8,192 tokens, batch 1 and 8, beside what
/// the public estimators say of the same model. Every figure is predicted.
pub fn decoder_fits_markdown(models: &[(String, workbook_models::llama::LlamaConfig)]) -> String {
    use workbook_planner::decoder::{Card, CARDS};
    let shapes = [(2048, 1), (2048, 8), (8192, 1), (8192, 8)];
    let mut out = String::from(
        "# Does it fit? Six published decoders on the common cards\n\n\
         Generated by `WORKBOOK_BLESS=1 cargo test --test plan`: what `workbook plan --model \
         models/<name>.config.json --device <card> --batch B --seq S` chooses on one card, \
         with its predicted peak: the first option whose prediction plus 5% is within the \
         card's memory. Every figure here is **predicted**, by the closed form that \
         chapter 5 checks against measurement on the CPU (its cells within 1.5%); none of these \
         runs was made. The prediction leaves out the GPU runtime's own memory, and its bf16 \
         terms count the f32 copies candle makes on a CPU, which a GPU does not, so on a card \
         the bf16 figures are high. An option is written compute dtype, loss, where AdamW's \
         state lives, checkpointing (`ckpt`) and micro-batches (`mN`).\n\n\
         The public estimators' figures are the training state alone, whatever the batch and \
         sequence: accelerate's `estimate-memory` (\"training using Adam\": 4 times the model's \
         size, 16 bytes a parameter in float32, 8 in float16, its half-precision row) and \
         DeepSpeed's ZeRO-2 estimator for one \
         GPU (4 + 16 bytes a parameter; 2 with its optimizer offloaded to the CPU).\n",
    );
    for (name, cfg) in models {
        let params = cfg.parameter_count();
        let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
        out.push_str(&format!(
            "\n## {name} ({params} parameters, vocabulary {}, {} head)\n\n\
             accelerate: {} (float32), {} (float16); DeepSpeed ZeRO-2: {} ({} offloaded).\n\n\
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
                let cell = fits_cell(cfg, &card, batch, seq);
                row.push_str(&format!(" {cell} |"));
            }
            out.push_str(&row);
            out.push('\n');
        }
    }
    out
}

/// One cell of the fits page: the option `workbook plan --model` chooses
/// for `cfg` on `card` at `batch` x `seq` tokens, in short words with its
/// predicted peak, or the least any option needs.
fn fits_cell(
    cfg: &workbook_models::llama::LlamaConfig,
    card: &workbook_planner::decoder::Card,
    batch: usize,
    seq: usize,
) -> String {
    use workbook_planner::decoder::{plan_decoder, DecoderRequest, MARGIN};
    use workbook_planner::Stage;
    use workbook_sdk::candle::DType;
    let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
    let ask = DecoderRequest {
        batch,
        seq,
        dtypes: vec![DType::BF16, DType::F32],
        budget: card.bytes,
        ranks: 1,
        stages: vec![Stage::Zero1, Stage::Zero2],
        checkpointing: true,
        margin: MARGIN,
    };
    if let Some(window) = cfg.sliding_window.filter(|w| seq > *w) {
        return format!("no (past its {window}-token window)");
    }
    let plan = plan_decoder(cfg, &ask, card);
    let Some(i) = plan.chosen else {
        let least = plan.options.iter().map(|o| o.prediction.total()).min();
        return format!("no (least {})", gib(least.unwrap_or(0)));
    };
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
