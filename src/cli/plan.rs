//! `workbook plan`: a GPT's training step fitted into a memory budget,
//! and with `--verify` run and measured.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;

use super::parse::{
    parse_budget, parse_device, parse_dtype, parse_job_seconds, parse_ranks, parse_recipe,
    parse_stage, parse_steps,
};
use super::progress::Spinner;
use super::say;

/// The arguments of `workbook plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The most memory a training step may hold: 2GiB, 500MB, or bytes.
    /// For a `config.json`, the card `--device` names is the budget when
    /// this is not given, and a budget may not be more than that card's
    /// memory.
    #[arg(long, value_parser = parse_budget)]
    pub budget: Option<u64>,
    /// Sequences per optimizer step.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// A TOML file with the model's `layers`, `hidden`, `heads`, `seq`
    /// and `vocab`, and optionally `tied_head = false` (the flags of
    /// those sizes are then refused), or a Hugging Face `config.json` of a Llama,
    /// Qwen2 or Mistral decoder (chapter 5's), or the model's folder that
    /// holds it, whose step's peak is predicted in closed form for `--seq`
    /// tokens.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["layers", "hidden", "heads", "vocab", "untied_head"])]
    pub model: Option<PathBuf>,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Hidden size (a multiple of heads).
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Sequence length [default: 256]; a model file gives its own.
    #[arg(long, value_name = "N")]
    pub seq: Option<usize>,
    /// Vocabulary.
    #[arg(long, default_value_t = 512)]
    pub vocab: usize,
    /// Give the head a table of its own (h·v parameters more, as Llama's)
    /// instead of sharing the token embedding's (GPT-2's).
    #[arg(long)]
    pub untied_head: bool,
    /// Ways of computing the layers to consider, comma-separated: candle
    /// (candle-nn's layers, naive attention), lean (the toolkit's lean
    /// layers, the probabilities kept), tiled (lean, tiled attention),
    /// direct and direct_tiled (lean or tiled with no graph: each stage's
    /// backward called directly) [default: candle,direct,direct_tiled:
    /// lean and tiled are left out, their direct forms hold less at about
    /// the same speed]. The GPT's only: a config.json's decoder has one
    /// way.
    #[arg(long, value_delimiter = ',', value_parser = parse_recipe)]
    pub recipes: Option<Vec<workbook_models::Recipe>>,
    /// Leave checkpointing out of the options.
    #[arg(long)]
    pub no_checkpointing: bool,
    /// Dtypes to consider, comma-separated: f32, bf16, f16.
    #[arg(long, value_delimiter = ',', default_value = "f32,bf16", value_parser = parse_dtype)]
    pub dtypes: Vec<workbook_sdk::candle::DType>,
    /// Where the steps are measured: auto (a GPU when this build has CUDA
    /// support and one answers, else the CPU), cpu, or cuda (a build with
    /// `--features cuda`). The budget and the pre-flight are then that
    /// device's memory; `--verify` with `--ranks` runs on the CPU. For a
    /// `config.json`, the card the plan is for: h200, h100-80gb, a100-80gb,
    /// a100-40gb, l4, rtx4090, or cpu (this machine's available memory).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Ranks sharing the batch (data parallelism): the budget is then
    /// each rank's, and each trains on batch / ranks sequences;
    /// --verify runs them under mpirun (a build with `--features mpi`);
    /// for a config.json it runs rank 0 in this process, its peers
    /// rehearsed (every collective fills the buffers a real rank's would).
    #[arg(long, default_value_t = 1, value_parser = parse_ranks)]
    pub ranks: usize,
    /// With --ranks, how they may share the training, comma-separated:
    /// ddp (everything replicated), zero1 (optimizer state
    /// partitioned), zero2 (gradients too), zero3 (parameters too)
    /// [default: all four; for a config.json zero1 and zero2, the two it
    /// weighs].
    #[arg(long, value_delimiter = ',', value_parser = parse_stage)]
    pub stages: Option<Vec<workbook_planner::Stage>>,
    /// With --ranks and --verify, the ranks' time limit in seconds (at
    /// least 1) [default: 1800]. The GPT's only: a config.json's ranks are
    /// rehearsed in this process.
    #[arg(long, value_name = "SECONDS", value_parser = parse_job_seconds)]
    pub timeout: Option<u64>,
    /// Run the chosen plan and check that its measured peak is within
    /// the budget and within 5% of the prediction (exit code 1 if not, or
    /// if this machine cannot hold it: the plan is still written).
    #[arg(long)]
    pub verify: bool,
    /// Steps the verification runs (1 to 10,000).
    #[arg(long, default_value_t = 2, requires = "verify", value_parser = parse_steps)]
    pub steps: usize,
    /// Write the options' plot (plan.svg, plan.png) into this folder (the
    /// GPT's plans).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Print the plan as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The tolerance `plan --verify` holds a plan's measured peak to.
const PLAN_TOLERANCE: f64 = 0.05;

/// `--seq` when it is not given.
const DEFAULT_SEQ: usize = 256;

/// `--recipes` when it is not given: lean and tiled are left out, their
/// direct forms hold less at about the same speed.
const DEFAULT_RECIPES: [workbook_models::Recipe; 3] = [
    workbook_models::Recipe::Candle,
    workbook_models::Recipe::Direct,
    workbook_models::Recipe::DirectTiled,
];

/// `--timeout` when it is not given: the ranks' time limit.
const DEFAULT_RANKS_SECONDS: u64 = 1800;

/// `workbook plan`: weighs the options, and with `--verify` runs the one
/// chosen.
pub fn plan(args: &PlanArgs) -> anyhow::Result<ExitCode> {
    let PlanArgs {
        budget,
        batch,
        model,
        layers,
        hidden,
        heads,
        seq,
        vocab,
        untied_head,
        recipes,
        no_checkpointing,
        dtypes,
        device,
        ranks,
        stages,
        timeout,
        verify,
        steps,
        out,
        json,
    } = args;
    use workbook::plan as view;
    use workbook_planner::plan::{plan as weigh, verify as run_plan, PlanRequest, VerifyRequest};
    if let Some(path) = model.as_deref().and_then(decoder_config) {
        return plan_decoder(args, &path);
    }
    if let Some(path) = model.as_ref().filter(|p| p.is_dir()) {
        anyhow::bail!(
            "`--model` is {}, a folder without a config.json; give a model's TOML file, a \
             Hugging Face config.json, or the folder of a Hugging Face model that holds one",
            path.display()
        );
    }
    let Some(budget) = budget else {
        anyhow::bail!(
            "`--budget` is missing: give the most memory a step may hold (2GiB, 500MB, bytes)"
        );
    };
    let device = parse_device(device).map_err(|e| anyhow::anyhow!("`--device`: {e}"))?;
    let device = &device;
    let file = match model {
        Some(path) => {
            if seq.is_some() {
                anyhow::bail!(
                    "`--seq` is given with the model file {}, which sets `seq` itself; give one",
                    path.display()
                );
            }
            view::ModelFile::read(path)?
        }
        None => view::ModelFile {
            layers: *layers,
            hidden: *hidden,
            heads: *heads,
            seq: seq.unwrap_or(DEFAULT_SEQ),
            vocab: *vocab,
            tied_head: !*untied_head,
        },
    };
    // A model file's sizes are named by the file they are wrong in, the
    // flags' by the flag.
    let config = match model {
        Some(path) => file
            .config("")
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
        None => file.config("--")?,
    };
    if *batch == 0 {
        anyhow::bail!("`--batch` is 0; allowed: at least 1");
    }
    // Ranks verify on the CPU: NCCL would need a GPU per rank.
    let device = match (*verify && *ranks > 1, device) {
        (true, workbook::DeviceChoice::Cuda) => anyhow::bail!(
            "--verify with --ranks runs MPI ranks on the CPU, and NCCL needs a GPU per rank: \
             verify on one rank with --device cuda, or on several with --device cpu"
        ),
        (true, _) => workbook_sdk::candle::Device::Cpu,
        (false, choice) => workbook_sdk::device::select(*choice).map_err(|e| anyhow::anyhow!(e))?,
    };
    let memory = view::Memory::of(&device);
    view::preflight(&config, dtypes, &memory)?;
    let request = PlanRequest {
        model: config,
        batch: *batch,
        budget: *budget,
        margin: PLAN_TOLERANCE,
        dtypes: dtypes.clone(),
        recipes: recipes.clone().unwrap_or_else(|| DEFAULT_RECIPES.to_vec()),
        checkpointing: !no_checkpointing,
        seed: 11,
        ranks: *ranks,
        stages: stages.clone().unwrap_or_else(|| {
            use workbook_planner::Stage;
            Stage::ALL.to_vec()
        }),
    };
    if stages.is_some() && *ranks == 1 {
        anyhow::bail!("`--stages` shares the training between ranks; give `--ranks` 2 or more");
    }
    if timeout.is_some() && !(*verify && *ranks > 1) {
        anyhow::bail!(
            "`--timeout` is the time limit of the ranks `--verify` runs; give it with `--ranks` \
             2 or more and `--verify`"
        );
    }
    request.batch_per_rank()?;
    if *verify && *ranks > 1 && !workbook_distributed::launch::built_with_mpi() {
        anyhow::bail!(
            "--verify with --ranks runs MPI ranks, and this workbook was built without the \
             `mpi` feature: {}",
            workbook_distributed::launch::INSTALL
        );
    }
    let meter = workbook_sdk::device::meter_for(&device)?;
    let progress = Spinner::new(0).bar;
    progress.enable_steady_tick(Duration::from_millis(120));
    let mut ctx = {
        let progress = progress.clone();
        workbook_sdk::Context::new(device, meter, false)
            .with_progress(move |m| progress.set_message(m.to_string()))
    };
    let plan = weigh(&mut ctx, &request)?;
    let verification = match (&plan.chosen, verify) {
        (Some(chosen), true) => {
            // What the plan holds per rank, and all ranks on this machine.
            let needed = chosen.peak.saturating_mul(*ranks as u64);
            let ran = if needed > memory.available {
                Err(anyhow::anyhow!(
                    "the chosen plan is predicted to hold {} ({} per rank), more than the {} \
                     of memory available {}: it cannot be verified there (plan without \
                     --verify, or with a smaller --budget)",
                    workbook::render::text::bytes(needed),
                    workbook::render::text::bytes(chosen.peak),
                    workbook::render::text::bytes(memory.available),
                    memory.place
                ))
            } else {
                let v = VerifyRequest::new(&request, chosen, *steps)?;
                if *ranks > 1 {
                    progress.set_message(format!("verifying on {ranks} ranks"));
                    workbook_distributed::launch::verify_on_ranks(
                        v,
                        *ranks,
                        Duration::from_secs(timeout.unwrap_or(DEFAULT_RANKS_SECONDS)),
                    )
                } else {
                    run_plan(&mut ctx, &v, None)
                }
                .context("the verification did not finish")
            };
            Some(ran)
        }
        _ => None,
    };
    // The plan stands when its run fails: it is written out, then the
    // failure said, and the exit code is 1, as a failed cell's.
    let (verification, failure) = split_run(verification);
    progress.finish_and_clear();
    if let Some(dir) = out {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
        let plot = workbook::render::plot::figure_plot(
            &view::figure(&plan),
            workbook::render::plot::Formats::SvgAndPng,
        )?;
        for (name, data) in [
            ("plan.svg", plot.svg.as_bytes()),
            ("plan.png", &plot.png[..]),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, data)
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        }
    }
    if *json {
        let value = serde_json::json!({ "plan": plan, "verification": verification });
        say(&format!("{}\n", serde_json::to_string_pretty(&value)?))?;
    } else {
        say(&view::text(&plan, *batch))?;
        if let Some(v) = &verification {
            say(&view::verified(v, PLAN_TOLERANCE))?;
        }
    }
    if plan.chosen.is_none() {
        if *json {
            eprintln!("error: {}", view::nothing_fits(&plan, *batch));
        }
        return Ok(ExitCode::from(1));
    }
    Ok(verdict(verification.as_ref(), failure))
}

/// A verification's outcome split into what it measured and why it could
/// not run, if it could not.
fn split_run(
    ran: Option<anyhow::Result<workbook_planner::plan::Verification>>,
) -> (
    Option<workbook_planner::plan::Verification>,
    Option<anyhow::Error>,
) {
    match ran {
        Some(Ok(v)) => (Some(v), None),
        Some(Err(e)) => (None, Some(e)),
        None => (None, None),
    }
}

/// The exit code of a plan that has a chosen option, once it is written
/// out: 1 when its verification could not run or did not finish (said
/// here) or broke its promise.
fn verdict(
    verification: Option<&workbook_planner::plan::Verification>,
    failure: Option<anyhow::Error>,
) -> ExitCode {
    if let Some(e) = failure {
        eprintln!(
            "error: {}",
            workbook::terminal::printable(&format!("{e:#}"))
        );
        return ExitCode::from(1);
    }
    match verification {
        Some(v) if !v.kept(PLAN_TOLERANCE) => ExitCode::from(1),
        _ => ExitCode::SUCCESS,
    }
}

/// `workbook plan --model config.json`: a decoder's step predicted in
/// closed form for each compute dtype and loss, against a card's memory or
/// the budget.
fn plan_decoder(args: &PlanArgs, path: &std::path::Path) -> anyhow::Result<ExitCode> {
    use workbook_planner::decoder::{plan_decoder as weigh, Card, DecoderRequest, CARDS, MARGIN};
    use workbook_planner::Stage;
    let cfg = workbook_models::llama::LlamaConfig::from_file(path)?;
    // What only the GPT's plan reads is refused, not silently dropped.
    for (given, flag, why) in [
        (
            args.recipes.is_some(),
            "--recipes",
            "a decoder is computed one way",
        ),
        (
            args.timeout.is_some(),
            "--timeout",
            "a decoder's ranks are rehearsed in this process, with no time limit to set",
        ),
        (
            args.out.is_some(),
            "--out",
            "a decoder's plan has no plot; `--json` writes its options",
        ),
    ] {
        if given {
            anyhow::bail!("`{flag}` is for the GPT's plan, not a config.json's: {why}");
        }
    }
    let seq = args.seq.unwrap_or(DEFAULT_SEQ);
    if !(1..=1 << 20).contains(&args.batch) || !(1..=1 << 24).contains(&seq) {
        anyhow::bail!(
            "`--batch` is {} and `--seq` {seq}; allowed: a batch from 1 to 1048576 and a \
             sequence from 1 to 16777216 tokens",
            args.batch,
        );
    }
    if let Some(window) = cfg.sliding_window.filter(|w| seq > *w) {
        anyhow::bail!(
            "`--seq` is {seq}; allowed for {}: at most its attention window (`sliding_window` \
             {window}), which this decoder does not slide past",
            path.display()
        );
    }
    if let Some(d) = args.dtypes.iter().find(|d| {
        !matches!(
            d,
            workbook_sdk::candle::DType::F32 | workbook_sdk::candle::DType::BF16
        )
    }) {
        anyhow::bail!(
            "`--dtypes` has {d:?}; allowed for a decoder: f32, bf16 (computed from f32 master weights)"
        );
    }
    if args.stages.is_some() && args.ranks == 1 {
        anyhow::bail!("`--stages` shares the training between ranks; give `--ranks` 2 or more");
    }
    let card = match args.device.as_str() {
        "cpu" | "auto" => {
            Card::cpu(workbook::plan::Memory::of(&workbook_sdk::candle::Device::Cpu).available)
        }
        name => Card::named(name).ok_or_else(|| {
            let names: Vec<&str> = CARDS.iter().map(|(n, _)| *n).collect();
            // A card named without its memory (`h100`, `a100`) means the
            // presets of that card, not the name one edit away (`h200`).
            let sized: Vec<&str> = names
                .iter()
                .copied()
                .filter(|n| {
                    n.strip_prefix(name)
                        .is_some_and(|rest| rest.starts_with('-'))
                })
                .collect();
            let hint = if sized.is_empty() {
                workbook::suggest::did_you_mean(name, names.iter().copied().chain(["cpu"]))
            } else {
                workbook::suggest::offer(&sized)
            };
            anyhow::anyhow!(
                "`--device` is `{name}`; allowed for a config.json: cpu, {}{hint}",
                card_names(),
            )
        })?,
    };
    let budget = match args.budget {
        None => card.bytes,
        Some(b) if b <= card.bytes => b,
        Some(b) => {
            let (holder, or) = if card.is_host() {
                (
                    "this machine's available memory".to_string(),
                    format!(
                        ", or name the card the plan is for with `--device` ({})",
                        card_names()
                    ),
                )
            } else {
                (format!("the {}", card.name), String::new())
            };
            anyhow::bail!(
                "`--budget` is {}, more than {holder} holds ({}); give at most that{or}",
                workbook::render::text::bytes(b),
                workbook::render::text::bytes(card.bytes),
            )
        }
    };
    let stages = match &args.stages {
        None => vec![Stage::Zero1, Stage::Zero2],
        Some(stages) => {
            if let Some(s) = stages
                .iter()
                .find(|s| !matches!(s, Stage::Zero1 | Stage::Zero2))
            {
                anyhow::bail!(
                    "`--stages` has {}; allowed for a decoder: zero1, zero2 (data parallelism \
                     holds more than ZeRO-1 for the same traffic, and stage 3 needs layers \
                     that gather their weights, which the decoders do not have)",
                    s.name()
                );
            }
            stages.clone()
        }
    };
    if args.no_checkpointing && args.ranks > 1 && stages.iter().all(|s| *s == Stage::Zero2) {
        anyhow::bail!(
            "`--stages zero2` with `--no-checkpointing` leaves nothing to weigh: ZeRO-2 is \
             weighed with checkpointing only (without it, it holds what ZeRO-1 does); add \
             zero1 to `--stages`, or leave out `--no-checkpointing`"
        );
    }
    if args.ranks > 1 && !args.batch.is_multiple_of(args.ranks) {
        anyhow::bail!(
            "`--batch` is {} over {} ranks; allowed: a multiple of --ranks",
            args.batch,
            args.ranks
        );
    }
    let ask = DecoderRequest {
        batch: args.batch,
        seq,
        dtypes: args.dtypes.clone(),
        budget,
        ranks: args.ranks,
        stages,
        checkpointing: !args.no_checkpointing,
        margin: MARGIN,
    };
    let plan = weigh(&cfg, &ask, &card);
    let verification = match plan.chosen {
        Some(i) if args.verify => Some(decoder_verifiable_here(&cfg, &plan.options[i]).and_then(
            |()| {
                verify_decoder(&cfg, &ask, &plan.options[i], args.steps)
                    .context("the verification did not finish")
            },
        )),
        _ => None,
    };
    let (verification, failure) = split_run(verification);
    if args.json {
        let value = serde_json::json!({
            "model": cfg,
            "device": card,
            "plan": plan,
            "verification": verification,
        });
        say(&format!("{}\n", serde_json::to_string_pretty(&value)?))?;
    } else {
        say(&workbook::plan::decoder_text(&cfg, &card, &plan))?;
        if let Some(v) = &verification {
            say(&workbook::plan::verified(v, PLAN_TOLERANCE))?;
            if let Some(i) = plan.chosen {
                say(&workbook::plan::decoder_verified_where(&plan.options[i]))?;
            }
        }
    }
    Ok(match plan.chosen {
        None => {
            // The text says it in its last line; JSON on stdout leaves it
            // to stderr, as the GPT's plan does.
            if args.json {
                if let Some(line) = workbook::plan::decoder_nothing_fits(&plan) {
                    eprintln!("error: {line}");
                }
            }
            ExitCode::from(1)
        }
        Some(_) => verdict(verification.as_ref(), failure),
    })
}

/// The `config.json` that `--model` names: a file whose name ends in
/// `.json` (any case), or the one in a Hugging Face model's folder; `None`
/// for a model's TOML file.
fn decoder_config(model: &std::path::Path) -> Option<PathBuf> {
    let in_folder = model.join("config.json");
    if model.is_dir() {
        return in_folder.exists().then_some(in_folder);
    }
    model
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"))
        .then(|| model.to_path_buf())
}

/// That this machine's memory can hold the chosen option of a decoder
/// plan, or why it cannot be verified here.
fn decoder_verifiable_here(
    cfg: &workbook_models::llama::LlamaConfig,
    chosen: &workbook_planner::decoder::DecoderOption,
) -> anyhow::Result<()> {
    use workbook_planner::decoder::Sharing;
    use workbook_sdk::candle::Device;
    let params = cfg.parameter_count();
    // The device's peak, and what an offloaded optimizer keeps on the host
    // (masters, moments and the gradients sent there), all in this memory.
    let host = match chosen.recipe.sharing {
        Sharing::Offload => params.saturating_mul(16),
        _ => 0,
    };
    let needed = chosen.prediction.total().saturating_add(host);
    let memory = workbook::plan::Memory::of(&Device::Cpu);
    if needed > memory.available {
        anyhow::bail!(
            "the chosen option is predicted to hold {}, more than the {} of memory available \
             {}: it cannot be verified here (plan without --verify, or ask for a smaller \
             --batch or --seq)",
            workbook::render::text::bytes(needed),
            workbook::render::text::bytes(memory.available),
            memory.place
        );
    }
    Ok(())
}

/// Trains the chosen option of a decoder plan on this machine's CPU, under
/// the counting allocator.
fn verify_decoder(
    cfg: &workbook_models::llama::LlamaConfig,
    ask: &workbook_planner::decoder::DecoderRequest,
    chosen: &workbook_planner::decoder::DecoderOption,
    steps: usize,
) -> anyhow::Result<workbook_planner::plan::Verification> {
    use workbook_sdk::candle::Device;
    let meter = workbook_sdk::device::meter_for(&Device::Cpu)?;
    let progress = Spinner::new(0).bar;
    progress.enable_steady_tick(Duration::from_millis(120));
    let mut ctx = {
        let progress = progress.clone();
        workbook_sdk::Context::new(Device::Cpu, meter, false)
            .with_progress(move |m| progress.set_message(m.to_string()))
    };
    let v = workbook_planner::decoder::verify(
        &mut ctx,
        cfg,
        (ask.batch, ask.seq),
        chosen.recipe,
        ask.budget,
        steps,
    );
    progress.finish_and_clear();
    v
}

/// The cards `--device` knows, for a message: `h200, h100-80gb, …`.
fn card_names() -> String {
    workbook_planner::decoder::CARDS.map(|(n, _)| n).join(", ")
}
