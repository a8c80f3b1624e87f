//! Each cell's parameter checks: every bad value named with what is allowed.

use workbook_sdk::{Plugin, Violation};
use workbook_transformer::{GptTraining, Predictors, SavedTensors};

fn said(v: &[Violation]) -> Vec<(String, String)> {
    v.iter().map(|v| (v.field.clone(), v.to_string())).collect()
}

fn pairs(expected: &[(&str, &str)]) -> Vec<(String, String)> {
    expected
        .iter()
        .map(|(f, m)| (f.to_string(), m.to_string()))
        .collect()
}

#[test]
fn a_hidden_size_that_is_not_a_multiple_of_the_heads_is_refused() {
    let mut p = <GptTraining as Plugin>::Params::default();
    p.model.hidden = 66;
    p.steps = 1;
    p.dtype = "f8".into();
    assert_eq!(
        said(&GptTraining.validate(&p)),
        pairs(&[
            (
                "model.hidden",
                "is 66; allowed: a positive multiple of heads (4)"
            ),
            ("dtype", "is \"f8\"; allowed: one of f32, f16, bf16"),
            ("steps", "is 1; allowed: at least 2"),
        ])
    );
    assert!(GptTraining.validate(&Default::default()).is_empty());
}

#[test]
fn an_empty_recipe_list_and_bad_variants_are_refused() {
    let mut p = <SavedTensors as Plugin>::Params::default();
    p.recipes.clear();
    assert_eq!(
        said(&SavedTensors.validate(&p)),
        pairs(&[(
            "recipes",
            "is []; allowed: a list of at least 1 of candle, lean, tiled, direct, direct_tiled"
        )])
    );

    let p = workbook_transformer::trial::Params {
        variants: vec![
            serde_json::from_str(r#"{"hidden": 102}"#).unwrap(),
            serde_json::from_str(r#"{"batch": 0, "dtype": "f64"}"#).unwrap(),
        ],
        ..Default::default()
    };
    assert_eq!(
        said(&Predictors.validate(&p)),
        pairs(&[
            (
                "variants[0].hidden",
                "is 102; allowed: a positive multiple of heads (4)"
            ),
            ("variants[1].batch", "is 0; allowed: at least 3"),
            (
                "variants[1].dtype",
                "is \"f64\"; allowed: one of f32, f16, bf16"
            ),
        ])
    );
    assert!(Predictors.validate(&Default::default()).is_empty());
}

#[test]
fn a_checkpoint_interval_beyond_the_stack_is_refused() {
    let p = workbook_transformer::recompute::Params {
        every: vec![2, 0, 6],
        repeats: 0,
        ..Default::default()
    };
    assert_eq!(
        said(&workbook_transformer::GptCheckpointing.validate(&p)),
        pairs(&[
            ("repeats", "is 0; allowed: at least 1"),
            ("every[1]", "is 0; allowed: from 1 to 5"),
            ("every[2]", "is 6; allowed: from 1 to 5"),
        ])
    );
}

#[test]
fn the_cells_that_walk_a_graph_refuse_the_direct_recipes() {
    use workbook_models::Recipe;
    use workbook_transformer::LayerProfile;
    // The saved-tensors cell lists a direct recipe's saved tensors instead.
    let p = workbook_transformer::saved::Params {
        recipes: vec![Recipe::Lean, Recipe::DirectTiled],
        ..Default::default()
    };
    assert!(SavedTensors.validate(&p).is_empty());
    let p = workbook_transformer::profile::Params {
        recipe: Recipe::Direct,
        ..Default::default()
    };
    assert_eq!(
        said(&LayerProfile.validate(&p)),
        pairs(&[(
            "recipe",
            "is \"direct\"; allowed: candle, lean, tiled (this cell walks the graph a backward \
             keeps; the direct recipes keep none)"
        )])
    );
    let p = workbook_transformer::trial::Params {
        recipe: Recipe::Direct,
        ..Default::default()
    };
    assert_eq!(
        said(&Predictors.validate(&p)),
        pairs(&[(
            "recipe",
            "is \"direct\"; allowed: candle, lean, tiled (the ledger's predictor reads the graph \
             a backward keeps; the direct recipes keep none)"
        )])
    );
}
