//! The `gpt_ranks` cell's parameters: what it refuses, and with what
//! message.

use workbook_distributed::gpt::Params;
use workbook_distributed::GptRanks;
use workbook_models::{GptConfig, Recipe};

mod common;
use common::refusals;

#[test]
fn the_defaults_are_valid() {
    assert_eq!(refusals(&GptRanks, Params::default()), Vec::<String>::new());
}

#[test]
fn rank_counts_must_divide_the_batch() {
    let p = Params {
        batch: 12,
        ranks: vec![1, 0, 8, 3, 65],
        ..Params::default()
    };
    assert_eq!(
        refusals(&GptRanks, p),
        [
            "ranks[1]: 0 (allowed: at least 1)",
            "ranks[2]: 8 (allowed: a count that divides the batch of 12 sequences (each rank \
             trains on as many))",
            "ranks[4]: 65 (allowed: at most 64)",
        ]
    );
}

#[test]
fn an_empty_list_of_ranks_is_refused() {
    let p = Params {
        ranks: vec![],
        ..Params::default()
    };
    assert_eq!(
        refusals(&GptRanks, p),
        ["ranks: [] (allowed: a list of at least 1 entry)"]
    );
}

#[test]
fn the_model_the_dtype_and_the_limits_are_checked() {
    let p = Params {
        model: GptConfig {
            layers: 0,
            hidden: 10,
            heads: 4,
            ..GptConfig::default()
        },
        dtype: "f64".into(),
        steps: 0,
        timeout_seconds: f64::NAN,
        ..Params::default()
    };
    assert_eq!(
        refusals(&GptRanks, p),
        [
            "model.layers: 0 (allowed: at least 1)",
            "model.hidden: 10 (allowed: a positive multiple of heads (4))",
            "dtype: \"f64\" (allowed: one of f32, f16, bf16)",
            "steps: 0 (allowed: at least 1)",
            "timeout_seconds: NaN (allowed: a finite number from 1 to 604800)",
        ]
    );
}

#[test]
fn sizes_past_what_a_tensor_may_hold_are_refused() {
    let p = Params {
        model: GptConfig {
            hidden: 1 << 20,
            heads: 1,
            vocab: 1 << 22,
            ..GptConfig::default()
        },
        ..Params::default()
    };
    let r = refusals(&GptRanks, p);
    assert_eq!(
        r,
        [
            "model.vocab: hidden × vocab = 1048576 × 4194304 (allowed: a product of at most \
             1099511627776 elements (2^40))",
            // An MLP weight, 4h × h.
            "model.hidden: 4 × hidden × hidden = 4 × 1048576 × 1048576 (allowed: a product of \
             at most 1099511627776 elements (2^40))",
        ]
    );
}

#[test]
fn a_rank_count_listed_twice_is_refused() {
    let p = Params {
        ranks: vec![1, 2, 4, 2],
        ..Params::default()
    };
    assert_eq!(
        refusals(&GptRanks, p),
        ["ranks[3]: 2 (allowed: a count not listed before (ranks[1] is 2))"]
    );
}

#[test]
fn the_memory_floor_is_ddps_four_states_in_the_cells_dtype() {
    use workbook_sdk::Plugin;
    let psi = GptConfig::default().checked_param_count().unwrap();
    for (dtype, bytes) in [("f32", 16), ("bf16", 8), ("f16", 8)] {
        let p = Params {
            dtype: dtype.into(),
            ..Params::default()
        };
        let (floor, why) = GptRanks.memory_floor(&p).unwrap();
        assert_eq!(floor, psi * bytes, "{dtype}");
        assert_eq!(
            why,
            format!("each rank's DDP model states, {bytes} bytes for each of {psi} parameters")
        );
    }
}

#[test]
fn a_score_matrix_past_a_tensors_size_is_refused_only_where_it_is_held() {
    // 2^21 tokens: batch × heads × seq × seq is 2^44 elements.
    let model = GptConfig {
        layers: 1,
        hidden: 8,
        heads: 2,
        seq: 1 << 21,
        vocab: 8,
        ..GptConfig::default()
    };
    let p = |recipe| Params {
        model,
        recipe,
        batch: 2,
        ranks: vec![1, 2],
        ..Params::default()
    };
    assert_eq!(
        refusals(&GptRanks, p(Recipe::Direct)),
        [
            "batch: batch × heads × seq × seq = 2 × 2 × 2097152 × 2097152 (allowed: a product \
          of at most 1099511627776 elements (2^40))"
        ]
    );
    assert_eq!(
        refusals(&GptRanks, p(Recipe::DirectTiled)),
        Vec::<String>::new()
    );
}
