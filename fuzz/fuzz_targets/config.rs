//! A decoder's `config.json` on arbitrary text: it may be refused, never
//! crash the reader; one it accepts is planned over ranks and every ZeRO
//! stage, and the plan written as text, without a crash. Run with
//! `scripts/fuzz.sh config`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use workbook::plan::{decoder_nothing_fits, decoder_text};
use workbook_models::llama::LlamaConfig;
use workbook_planner::decoder::{plan_decoder, Card, DecoderRequest, MARGIN};
use workbook_planner::Stage;
use workbook_sdk::candle::DType;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let cfg = match LlamaConfig::from_json(text, "fuzzed.json") {
        Ok(cfg) => cfg,
        Err(e) => {
            // Every refusal says something.
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    let card = Card::named("h200").expect("a preset");
    for (ranks, stages) in [
        (1, vec![]),
        (8, vec![Stage::Ddp, Stage::Zero1, Stage::Zero2]),
    ] {
        let ask = DecoderRequest {
            batch: 8,
            seq: 2048,
            dtypes: vec![DType::BF16, DType::F32],
            budget: card.bytes,
            ranks,
            stages,
            checkpointing: true,
            margin: MARGIN,
        };
        let plan = plan_decoder(&cfg, &ask, &card);
        assert!(!decoder_text(&cfg, &card, &plan).is_empty());
        if plan.chosen.is_none() {
            assert!(decoder_nothing_fits(&plan).is_some_and(|m| !m.is_empty()));
        }
    }
});
