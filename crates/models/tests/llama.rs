//! Chapter 5's decoders: the six published shapes parsed and counted, every
//! bad field refused with its name, the built variables matching the
//! shapes, and the lean layers' loss and gradients equal to the plain
//! candle composition's.

use std::path::PathBuf;

use candle_checkpoint::NoObserver;
use candle_core::{DType, Device, Result, Tensor};
use workbook_models::llama::{Attention, Layers, Llama, LlamaConfig, Loss, StepOptions};
use workbook_models::Rng;

fn models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models")
}

/// The six files and their published parameter counts.
const PUBLISHED: [(&str, u64); 6] = [
    ("smollm2-135m", 134_515_008),
    ("qwen2.5-0.5b", 494_032_768),
    ("llama-3.2-1b", 1_235_814_400),
    ("mistral-7b-v0.1", 7_241_732_096),
    ("qwen2.5-7b", 7_615_616_512),
    ("llama-3.1-8b", 8_030_261_248),
];

fn config(name: &str) -> LlamaConfig {
    let path = models_dir().join(format!("{name}.config.json"));
    LlamaConfig::from_file(&path).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn the_six_published_shapes_count_their_published_parameters() {
    for (name, published) in PUBLISHED {
        assert_eq!(config(name).parameter_count(), published, "{name}");
    }
}

#[test]
fn smollm2_built_at_its_real_size_has_its_published_parameters() -> Result<()> {
    let cfg = config("smollm2-135m");
    let model = Llama::new(&cfg, DType::BF16, &mut Rng::seeded(1), &Device::Cpu)?;
    assert_eq!(model.param_count(), 134_515_008);
    Ok(())
}

#[test]
fn every_family_builds_the_variables_its_shape_lists() -> Result<()> {
    for (name, _) in PUBLISHED {
        let cfg = config(name).scaled(2, 16);
        let model = Llama::new(&cfg, DType::F32, &mut Rng::seeded(2), &Device::Cpu)?;
        let built: Vec<Vec<usize>> = model.vars().iter().map(|v| v.dims().to_vec()).collect();
        let listed: Vec<Vec<usize>> = cfg.parameters().into_iter().map(|(_, s)| s).collect();
        assert_eq!(built, listed, "{name}");
        assert_eq!(model.param_count(), cfg.parameter_count(), "{name}");
    }
    Ok(())
}

#[test]
fn the_families_differ_where_their_configs_say() {
    let names = |cfg: &LlamaConfig| -> Vec<String> {
        cfg.parameters().into_iter().map(|(n, _)| n).collect()
    };
    let qwen = names(&config("qwen2.5-0.5b"));
    assert!(qwen.contains(&"model.layers.0.self_attn.q_proj.bias".to_string()));
    assert!(!qwen.contains(&"model.layers.0.self_attn.o_proj.bias".to_string()));
    assert!(!qwen.contains(&"lm_head.weight".to_string()));
    let llama = names(&config("llama-3.1-8b"));
    assert!(!llama.iter().any(|n| n.ends_with(".bias")));
    assert!(llama.contains(&"lm_head.weight".to_string()));
    let mistral = config("mistral-7b-v0.1");
    assert_eq!(mistral.sliding_window, Some(4096));
    assert_eq!(mistral.head_dim, 128);
    assert_eq!(config("smollm2-135m").kv_heads, 3);
}

fn error(text: &str) -> String {
    LlamaConfig::from_json(text, "my.json")
        .unwrap_err()
        .to_string()
}

#[test]
fn bad_configs_are_refused_with_the_field_and_what_is_allowed() {
    let good = std::fs::read_to_string(models_dir().join("smollm2-135m.config.json")).unwrap();
    let with = |field: &str, value: &str| -> String {
        let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
        v[field] = serde_json::from_str(value).unwrap();
        v.to_string()
    };
    let cases = [
        (
            with("model_type", "\"gpt2\""),
            "my.json: `model_type` is \"gpt2\": this builds \"llama\", \"qwen2\" and \"mistral\" decoders",
        ),
        (
            with("num_key_value_heads", "4"),
            "my.json: `num_key_value_heads` is 4: a divisor of num_attention_heads (9): query heads share key/value heads in equal groups",
        ),
        (
            {
                // A Qwen2 without the field takes Hugging Face's 32, which
                // 9 heads cannot share.
                let mut v: serde_json::Value =
                    serde_json::from_str(&with("model_type", "\"qwen2\"")).unwrap();
                v.as_object_mut().unwrap().remove("num_key_value_heads");
                v.to_string()
            },
            "my.json: `num_key_value_heads` is absent, so 32 (qwen2's default): a divisor of num_attention_heads (9): query heads share key/value heads in equal groups",
        ),
        (
            with("head_dim", "63"),
            "my.json: `head_dim` is 63: even and at least 2: rotary embeddings rotate pairs",
        ),
        (
            with("hidden_act", "\"gelu\""),
            "my.json: `hidden_act` is \"gelu\": a Llama-family MLP is SwiGLU: \"silu\"",
        ),
        (
            with("mlp_bias", "true"),
            "my.json: `mlp_bias` is true: the MLP's projections are built without biases (false)",
        ),
        (
            with("vocab_size", "0"),
            "my.json: `vocab_size` is 0: from 1 to 16777216",
        ),
        (
            with("num_hidden_layers", "1000000000000"),
            "my.json: `num_hidden_layers` is 1000000000000: from 1 to 4096",
        ),
        (
            {
                let mut v: serde_json::Value =
                    serde_json::from_str(&with("hidden_size", "1048576")).unwrap();
                v["head_dim"] = 65536.into();
                v["num_attention_heads"] = 4096.into();
                v["num_key_value_heads"] = 4096.into();
                v["num_hidden_layers"] = 4096.into();
                v.to_string()
            },
            // 4096 blocks of 4·2^48 attention, 3·1536·2^20 MLP and 2·2^20
            // norm parameters, with the tied 49152·2^20 table and a norm.
            "my.json: these shapes make 4611705869767278592 parameters (hidden_size 1048576, intermediate_size 1536, num_hidden_layers 4096, num_attention_heads 4096, num_key_value_heads 4096, head_dim 65536, vocab_size 49152, a tied head): at most 1125899906842624 (2^50) are planned; no published decoder is within a thousandth of that, so one of them is likely mistyped",
        ),
        (
            with("architectures", "[\"LlamaForSequenceClassification\"]"),
            "my.json: `architectures` is [\"LlamaForSequenceClassification\"]: a causal language model's (`...ForCausalLM`): this trains next-token prediction, whose head is the vocabulary",
        ),
        (
            with("rms_norm_eps", "-1.0"),
            "my.json: `rms_norm_eps` is -1: a small positive number",
        ),
    ];
    for (text, message) in cases {
        let got = error(&text);
        assert!(got.starts_with(message), "{got}\n  wanted {message}");
    }
    // A value of the wrong type is named by its field, at its place.
    let typed = "{\n  \"model_type\": \"llama\",\n  \"hidden_size\": \"576\"\n}";
    assert_eq!(
        error(typed),
        "my.json:3:22: `hidden_size`: invalid type: string \"576\", expected usize"
    );
    assert_eq!(
        error(&with("num_hidden_layers", "-1")),
        format!(
            "my.json:1:{}: `num_hidden_layers`: invalid value: integer `-1`, expected usize",
            with("num_hidden_layers", "-1").find("-1").unwrap() + 2
        )
    );
    assert!(
        error(&with("architectures", "\"LlamaForCausalLM\"")).contains(
            ": `architectures`: invalid type: string \"LlamaForCausalLM\", expected a sequence"
        ),
        "{}",
        error(&with("architectures", "\"LlamaForCausalLM\""))
    );
    // A value that quotes serde_json's own words is cut at its place only.
    let quoting = error(&with("hidden_size", "\" at line 9\""));
    assert!(
        quoting.starts_with("my.json:1:")
            && quoting
                .ends_with(": `hidden_size`: invalid type: string \" at line 9\", expected usize"),
        "{quoting}"
    );
    // What is missing, or not JSON at all, has no field to name.
    assert_eq!(
        error("{\"model_type\": \"llama\"}"),
        "my.json:1:23: missing field `hidden_size`"
    );
    let trailing = format!("{} {{}}", with("vocab_size", "49152"));
    assert_eq!(
        error(&trailing),
        // At the `{` the trailing text opens with.
        format!("my.json:1:{}: trailing characters", trailing.len() - 1)
    );
    assert_eq!(
        error("{\n  \"model_type\": \"llama\",\n  \"hidden_size\": 8,\n}"),
        "my.json:4:1: trailing comma"
    );
    let mut no_head_dim: serde_json::Value = serde_json::from_str(&good).unwrap();
    no_head_dim.as_object_mut().unwrap().remove("head_dim");
    no_head_dim["hidden_size"] = 100.into();
    assert_eq!(
        error(&no_head_dim.to_string()),
        "my.json: `head_dim` is absent: given, or hidden_size (100) a multiple of num_attention_heads (9)"
    );
    let missing = LlamaConfig::from_file("no/such/config.json")
        .unwrap_err()
        .to_string();
    assert!(
        missing.starts_with("cannot read no/such/config.json: "),
        "{missing}"
    );
}

fn max_rel(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_dtype(DType::F64)?;
    let b = b.to_dtype(DType::F64)?;
    let scale = b.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-30);
    Ok((a - b)?.abs()?.max_all()?.to_scalar::<f64>()? / scale)
}

fn tokens(rng: &mut Rng, vocab: usize) -> Result<(Tensor, Tensor)> {
    let t = rng
        .labels(2 * 12, vocab as u32, &Device::Cpu)?
        .reshape((2, 12))?;
    let y = rng
        .labels(2 * 12, vocab as u32, &Device::Cpu)?
        .reshape((2, 12))?;
    Ok((t, y))
}

#[test]
fn the_lean_step_equals_the_candle_composition_for_every_family() -> Result<()> {
    for (name, _) in PUBLISHED {
        let cfg = config(name).scaled(2, 32);
        let model = Llama::new(&cfg, DType::F32, &mut Rng::seeded(3), &Device::Cpu)?;
        let (x, y) = tokens(&mut Rng::seeded(4), cfg.vocab)?;
        let plain = StepOptions {
            layers: Layers::Candle,
            compute: DType::F32,
            attention: Attention::Materialized,
            loss: Loss::Plain,
        };
        let reference = model.loss(&x, &y, &plain)?;
        let want = reference.backward()?;
        for attention in [Attention::Tiled, Attention::Materialized] {
            for loss in [Loss::Plain, Loss::Fused] {
                let options = StepOptions {
                    layers: Layers::Lean,
                    attention,
                    loss,
                    ..plain
                };
                let got = model.loss(&x, &y, &options)?;
                let what = format!("{name} {attention:?} {loss:?}");
                assert!(max_rel(&got, &reference)? < 1e-6, "{what}: loss");
                let grads = got.backward()?;
                for (i, v) in model.vars().iter().enumerate() {
                    let d = max_rel(grads.get(v).unwrap(), want.get(v).unwrap())?;
                    assert!(d < 1e-4, "{what}: gradient of variable {i}: {d}");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn the_checkpointed_step_equals_the_graph_step_for_every_family() -> Result<()> {
    for (name, _) in PUBLISHED {
        let cfg = config(name).scaled(3, 32);
        let model = Llama::new(&cfg, DType::F32, &mut Rng::seeded(9), &Device::Cpu)?;
        let (x, y) = tokens(&mut Rng::seeded(10), cfg.vocab)?;
        for compute in [DType::F32, DType::BF16] {
            for loss in [Loss::Plain, Loss::Fused] {
                let options = StepOptions {
                    layers: Layers::Lean,
                    compute,
                    attention: Attention::Tiled,
                    loss,
                };
                let what = format!("{name} {compute:?} {loss:?}");
                let reference = model.loss(&x, &y, &options)?;
                let want = reference.backward()?;
                let got = model.checkpointed_backward(&x, &y, &options, 0.25, &NoObserver)?;
                let quarter = reference.affine(0.25, 0.)?;
                assert!(max_rel(&got.loss, &quarter)? < 1e-6, "{what}: loss");
                assert!(
                    got.input_grad.is_none(),
                    "{what}: token ids have no gradient"
                );
                for (i, v) in model.vars().iter().enumerate() {
                    let g = got.grads.get(v).unwrap();
                    assert_eq!(g.dtype(), DType::F32, "{what}: variable {i}");
                    // The same operations on the same values: equal up to the
                    // order in which candle sums a tied embedding's two parts.
                    let d = max_rel(&g.affine(4., 0.)?, want.get(v).unwrap())?;
                    assert!(d < 1e-5, "{what}: gradient of variable {i}: {d}");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn bf16_compute_from_f32_masters_gives_f32_gradients_close_to_f32s() -> Result<()> {
    let cfg = config("qwen2.5-0.5b").scaled(2, 32);
    let model = Llama::new(&cfg, DType::F32, &mut Rng::seeded(5), &Device::Cpu)?;
    let (x, y) = tokens(&mut Rng::seeded(6), cfg.vocab)?;
    let f32 = StepOptions {
        layers: Layers::Lean,
        compute: DType::F32,
        attention: Attention::Tiled,
        loss: Loss::Fused,
    };
    let bf16 = StepOptions {
        compute: DType::BF16,
        ..f32
    };
    let (a, b) = (model.loss(&x, &y, &f32)?, model.loss(&x, &y, &bf16)?);
    assert_eq!(b.dtype(), DType::F32);
    assert!(max_rel(&b, &a)? < 1e-2);
    let (ga, gb) = (a.backward()?, b.backward()?);
    for v in model.vars() {
        let g = gb.get(&v).unwrap();
        assert_eq!(g.dtype(), DType::F32);
        assert!(max_rel(g, ga.get(&v).unwrap())? < 0.1);
    }
    Ok(())
}

#[test]
fn a_sequence_past_mistrals_window_is_refused() -> Result<()> {
    let mut cfg = config("mistral-7b-v0.1").scaled(1, 64);
    cfg.sliding_window = Some(8);
    let model = Llama::new(&cfg, DType::F32, &mut Rng::seeded(7), &Device::Cpu)?;
    let (x, y) = tokens(&mut Rng::seeded(8), cfg.vocab)?;
    let options = StepOptions {
        layers: Layers::Lean,
        compute: DType::F32,
        attention: Attention::Tiled,
        loss: Loss::Fused,
    };
    let e = model.loss(&x, &y, &options).unwrap_err().to_string();
    assert_eq!(
        e.lines().next().unwrap(),
        "sequences of 12 tokens are longer than the attention window (8), which this model does \
         not apply: use at most 8"
    );
    Ok(())
}

#[test]
fn absent_fields_take_hugging_faces_defaults_per_family() {
    let base = r#""hidden_size": 2048, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 64, "vocab_size": 100"#;
    let parse =
        |extra: &str| LlamaConfig::from_json(&format!("{{{base}, {extra}}}"), "t.json").unwrap();
    let llama = parse(r#""model_type": "llama", "attention_bias": true"#);
    assert_eq!(
        (llama.kv_heads, llama.qkv_bias, llama.o_bias),
        (64, true, true)
    );
    assert!(!llama.tied);
    let qwen = parse(r#""model_type": "qwen2", "attention_bias": true"#);
    assert_eq!(
        (qwen.kv_heads, qwen.qkv_bias, qwen.o_bias),
        (32, true, false)
    );
    let mistral = parse(r#""model_type": "mistral", "attention_bias": true"#);
    assert_eq!(
        (mistral.kv_heads, mistral.qkv_bias, mistral.o_bias),
        (8, false, false)
    );
    assert_eq!(mistral.sliding_window, Some(4096));
    // Mistral-7B-v0.2's `"sliding_window": null` is no window, not the
    // default one; Qwen2's window is read only where it is used.
    let unwindowed = parse(r#""model_type": "mistral", "sliding_window": null"#);
    assert_eq!(unwindowed.sliding_window, None);
    let narrow = parse(r#""model_type": "mistral", "sliding_window": 512"#);
    assert_eq!(narrow.sliding_window, Some(512));
    let qwen_window = |extra: &str| parse(&format!(r#""model_type": "qwen2", {extra}"#));
    assert_eq!(
        qwen_window(r#""sliding_window": 512, "use_sliding_window": true"#).sliding_window,
        Some(512)
    );
    assert_eq!(
        qwen_window(r#""sliding_window": 512, "use_sliding_window": false"#).sliding_window,
        None
    );
    assert_eq!(
        qwen_window(r#""sliding_window": null, "use_sliding_window": true"#).sliding_window,
        None
    );
    for cfg in [llama, qwen, mistral] {
        let listed: u64 = cfg
            .parameters()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum();
        assert_eq!(cfg.parameter_count(), listed, "{:?}", cfg.family);
    }
}
