//! The library: plugins defined here, outside the built-in crates, registered
//! through the builder and run from a chapter.

use std::io::Write;

use serde::{Deserialize, Serialize};
use workbook::report::Status;
use workbook::runner::Quiet;
use workbook::{RunOptions, Workbook};
use workbook_sdk::{Category, Context, MetricSpec, Plugin};

#[global_allocator]
static ALLOC: workbook_sdk::meter::CountingAllocator = workbook_sdk::meter::CountingAllocator;

/// Records the metrics it is given, and allocates a buffer of known size.
struct Echo;

#[derive(Serialize, Deserialize, Default, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
struct EchoParams {
    value: f64,
    bytes: usize,
}

impl Plugin for Echo {
    type Params = EchoParams;
    fn name(&self) -> &str {
        "echo"
    }
    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::number("value", "the value given"),
            MetricSpec::number("not_a_number", "NaN"),
            MetricSpec::number("infinite", "infinity"),
            MetricSpec::bytes("buffer_peak", "the buffer's activation bytes"),
        ]
    }
    fn run(&self, ctx: &mut Context, p: EchoParams) -> anyhow::Result<()> {
        ctx.print(format!("value: {}", p.value));
        ctx.metric("value", p.value);
        ctx.metric("not_a_number", f64::NAN);
        ctx.metric("infinite", f64::INFINITY);
        let (_, region) = ctx.measure("buffer", |r| {
            let buffer = Category::Activations.scope(|| vec![7u8; p.bytes]);
            r.mark("allocated");
            drop(buffer);
            Ok(())
        })?;
        ctx.metric(
            "buffer_peak",
            region.category_peak_above_baseline(Category::Activations) as f64,
        );
        Ok(())
    }
}

/// Prints, records a metric, then panics.
struct Panics;

impl Plugin for Panics {
    type Params = ();
    fn name(&self) -> &str {
        "panics"
    }
    fn metrics(&self) -> Vec<MetricSpec> {
        vec![MetricSpec::count("recorded", "one, before the panic")]
    }
    fn run(&self, ctx: &mut Context, _: ()) -> anyhow::Result<()> {
        ctx.print("before the panic");
        ctx.metric("recorded", 1.0);
        panic!("the plugin gave up");
    }
}

/// A matrix product inside a region: its activation bytes are the
/// product's, and nothing else.
struct Matmul;

impl Plugin for Matmul {
    type Params = ();
    fn name(&self) -> &str {
        "matmul"
    }
    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::bytes("held_{dtype}", "the product's bytes, measured"),
            MetricSpec::bytes("data_{dtype}", "the product's bytes, by arithmetic"),
        ]
    }
    fn run(&self, ctx: &mut Context, _: ()) -> anyhow::Result<()> {
        use workbook_sdk::candle::{DType, Tensor};
        for (dtype, name) in [(DType::F32, "f32"), (DType::F16, "f16")] {
            // Small enough that gemm runs it on the calling thread, with
            // that thread's own packing buffer.
            let a = Tensor::ones((32, 512), dtype, ctx.device())?;
            let w = Tensor::ones((512, 512), dtype, ctx.device())?;
            let region = ctx.region("product");
            let c = Category::Activations.scope(|| a.matmul(&w.t()?))?;
            let held = region.current_above_baseline().get(Category::Activations);
            drop(c);
            ctx.metric(format!("held_{name}"), held as f64);
            ctx.metric(
                format!("data_{name}"),
                (32 * 512 * dtype.size_in_bytes()) as f64,
            );
        }
        Ok(())
    }
}

/// Allocates 10 MB and frees it before measuring a small region: the
/// cell's peak must still hold the 10 MB.
struct Freed;

impl Plugin for Freed {
    type Params = ();
    fn name(&self) -> &str {
        "freed"
    }
    fn metrics(&self) -> Vec<MetricSpec> {
        Vec::new()
    }
    fn run(&self, ctx: &mut Context, _: ()) -> anyhow::Result<()> {
        let big = Category::Activations.scope(|| vec![1u8; 10_000_000]);
        drop(big);
        ctx.measure("small", |_| {
            let v = Category::Activations.scope(|| vec![1u8; 1_000]);
            drop(v);
            Ok(())
        })?;
        Ok(())
    }
}

/// Returns an error.
struct Fails;

impl Plugin for Fails {
    type Params = ();
    fn name(&self) -> &str {
        "fails"
    }
    fn metrics(&self) -> Vec<MetricSpec> {
        Vec::new()
    }
    fn run(&self, _: &mut Context, _: ()) -> anyhow::Result<()> {
        anyhow::bail!("no data for this experiment")
    }
}

/// The meter's peak is process-wide, as in the binary where cells run one
/// at a time: tests that run chapters take turns.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

fn chapter_file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

fn workbook() -> Workbook {
    Workbook::empty()
        .with_plugin(Echo)
        .and_then(|w| w.with_plugin(Panics))
        .and_then(|w| w.with_plugin(Fails))
        .and_then(|w| w.with_plugin(Matmul))
        .and_then(|w| w.with_plugin(Freed))
        .unwrap()
}

const CHAPTER: &str = r#"
format_version = 1
id = "outside"
title = "Plugins from outside"

[[cells]]
id = "first"
title = "Echo"
plugin = "echo"
assertions = [
  "value == 3",
  "buffer_peak >= 1000000",
  "is_finite(not_a_number)",
  "infinite > 0",
]
[cells.params]
value = 2
bytes = 2000000
[cells.check]
value = 3
bytes = 1000000

[[cells]]
id = "boom"
title = "Panics"
plugin = "panics"
assertions = ["recorded == 1"]

[[cells]]
id = "error"
title = "Fails"
plugin = "fails"

[[cells]]
id = "last"
title = "Echo again"
plugin = "echo"
assertions = ["value == 2"]
[cells.params]
value = 2
"#;

#[test]
fn plugins_registered_from_outside_run_and_failures_do_not_stop_the_run() {
    let _turn = turn();
    let file = chapter_file(CHAPTER);
    let wb = workbook();
    let chapter = wb.load(file.path().to_str().unwrap()).unwrap();
    let options = RunOptions {
        check: true,
        ..Default::default()
    };
    let report = wb.run(&chapter, &options, &mut Quiet).unwrap();
    let [first, boom, error, last] = &report.cells[..] else {
        panic!("four cells")
    };

    // Check-mode parameters were laid over the full ones, and the plugin's
    // buffer was measured to the byte.
    assert_eq!(first.printed, ["value: 3"]);
    assert_eq!(first.metrics["buffer_peak"], 1_000_000.0);
    let results: Vec<(bool, Option<&str>)> = first
        .assertions
        .iter()
        .map(|a| (a.passed, a.message.as_deref()))
        .collect();
    assert_eq!(
        results,
        [
            (true, None),
            (true, None),
            (
                false,
                Some("metric `not_a_number` is NaN, where a finite value was asserted")
            ),
            (
                false,
                Some("metric `infinite` is inf, where a finite value was asserted")
            ),
        ]
    );
    assert_eq!(first.status, Status::Failed);

    // The panic is the cell's error; what it recorded before is kept.
    assert_eq!(boom.status, Status::Error);
    assert_eq!(boom.error.as_deref(), Some("panicked: the plugin gave up"));
    assert_eq!(boom.printed, ["before the panic"]);
    assert!(
        boom.assertions[0].passed,
        "assertions read what was recorded"
    );
    assert!(!boom.assertions[1].passed, "the error counts as a failure");

    assert_eq!(error.status, Status::Error);
    assert_eq!(error.error.as_deref(), Some("no data for this experiment"));

    // The run went on after both.
    assert_eq!(last.status, Status::Passed);
    assert_eq!(last.printed, ["value: 2"]);
    assert_eq!(report.summary.line(), "4 passed, 4 failed");
}

#[test]
fn full_mode_uses_the_full_parameters() {
    let _turn = turn();
    let file = chapter_file(CHAPTER);
    let wb = workbook();
    let chapter = wb.load(file.path().to_str().unwrap()).unwrap();
    let options = RunOptions {
        cells: vec!["first".into()],
        ..Default::default()
    };
    let report = wb.run(&chapter, &options, &mut Quiet).unwrap();
    assert_eq!(report.cells.len(), 1);
    assert_eq!(report.cells[0].printed, ["value: 2"]);
    assert_eq!(report.cells[0].metrics["buffer_peak"], 2_000_000.0);
}

#[test]
fn a_duplicate_plugin_name_is_an_error() {
    let err = workbook().with_plugin(Echo).unwrap_err();
    assert_eq!(
        err.to_string(),
        "a plugin named `echo` is already registered"
    );
}

#[test]
fn the_json_report_round_trips() {
    let _turn = turn();
    let file = chapter_file(CHAPTER);
    let wb = workbook();
    let chapter = wb.load(file.path().to_str().unwrap()).unwrap();
    let options = RunOptions {
        check: true,
        cells: vec!["first".into()],
        ..Default::default()
    };
    let report = wb.run(&chapter, &options, &mut Quiet).unwrap();
    let mut json = Vec::new();
    workbook::render::json(&mut json, &report).unwrap();
    let back: workbook::ChapterReport = serde_json::from_slice(&json).unwrap();
    // Metrics may be NaN, which equals nothing once read back (written as
    // "NaN"), so compare the parts that hold no such float.
    assert_eq!(back.cells[0].memory, report.cells[0].memory);
    assert_eq!(back.cells[0].assertions, report.cells[0].assertions);
    assert_eq!(back.summary, report.summary);
}

#[test]
fn a_matrix_product_holds_exactly_its_output() {
    let _turn = turn();
    let file = chapter_file(
        r#"
format_version = 1
id = "warm"
title = "Warm"

[[cells]]
id = "product"
title = "A product"
plugin = "matmul"
assertions = [
  "held_f32 >= data_f32 && held_f32 < data_f32 + 1024",
  "held_f16 >= data_f16 && held_f16 < data_f16 + 1024",
]
"#,
    );
    let wb = workbook();
    let chapter = wb.load(file.path().to_str().unwrap()).unwrap();
    let report = wb
        .run(&chapter, &RunOptions::default(), &mut Quiet)
        .unwrap();
    let cell = &report.cells[0];
    assert_eq!(cell.status, Status::Passed, "{:?}", cell.assertions);
}

#[test]
fn full_size_assertions_are_skipped_at_check_size_and_checked_at_full_size() {
    let _turn = turn();
    let file = chapter_file(
        r#"
format_version = 1
id = "sizes"
title = "Sizes"

[[cells]]
id = "echo"
title = "Echo"
plugin = "echo"
assertions = ["value > 0"]
full_size_assertions = ["value > 5"]
[cells.params]
value = 2
[cells.check]
value = 1
"#,
    );
    let wb = workbook();
    let chapter = wb.load(file.path().to_str().unwrap()).unwrap();
    let check = wb
        .run(
            &chapter,
            &RunOptions {
                check: true,
                ..Default::default()
            },
            &mut Quiet,
        )
        .unwrap();
    let a = &check.cells[0].assertions[1];
    assert!(a.skipped && !a.passed, "{a:?}");
    assert_eq!(a.message.as_deref(), Some("checked at full size only"));
    assert_eq!(check.cells[0].status, Status::Passed);
    assert_eq!(check.summary.line(), "1 passed, 0 failed, 1 skipped");
    // At full size it is checked, and here it is false.
    let full = wb
        .run(&chapter, &RunOptions::default(), &mut Quiet)
        .unwrap();
    let a = &full.cells[0].assertions[1];
    assert!(!a.skipped && !a.passed, "{a:?}");
    assert_eq!(full.summary.line(), "1 passed, 1 failed");
}

#[test]
fn an_assertion_for_one_device_is_checked_there_and_skipped_on_another() {
    let _turn = turn();
    let file = chapter_file(
        r#"
format_version = 1
id = "devices"
title = "Devices"

[[cells]]
id = "echo"
title = "Echo"
plugin = "echo"
assertions = [
  "value > 0",
  { expr = "value > 1", device = "cpu" },
  { expr = "value > 5", device = "cuda" },
]
full_size_assertions = [{ expr = "value < 1", device = "cpu" }]
[cells.params]
value = 2
"#,
    );
    let wb = workbook();
    let chapter = wb.load(file.path().to_str().unwrap()).unwrap();
    let options = RunOptions {
        device: workbook::DeviceChoice::Cpu,
        ..Default::default()
    };
    let report = wb.run(&chapter, &options, &mut Quiet).unwrap();
    assert_eq!(report.device, "cpu");
    let a = &report.cells[0].assertions;
    assert_eq!(a.len(), 4);
    assert!(a[1].passed && !a[1].skipped, "{:?}", a[1]);
    assert!(a[2].skipped && !a[2].passed, "{:?}", a[2]);
    assert_eq!(
        a[2].message.as_deref(),
        Some("checked on a CUDA GPU only; this cell ran on cpu")
    );
    // A full-size assertion for the CPU is checked there, and here fails.
    assert!(!a[3].passed && !a[3].skipped, "{:?}", a[3]);
    assert_eq!(report.summary.line(), "2 passed, 1 failed, 1 skipped");
}

#[test]
fn a_cells_peak_holds_what_it_freed_before_its_regions() {
    let _turn = turn();
    let file = chapter_file(
        r#"
format_version = 1
id = "peaks"
title = "Peaks"

[[cells]]
id = "freed"
title = "Freed"
plugin = "freed"
"#,
    );
    let wb = workbook();
    let chapter = wb.load(file.path().to_str().unwrap()).unwrap();
    let report = wb
        .run(&chapter, &RunOptions::default(), &mut Quiet)
        .unwrap();
    let memory = &report.cells[0].memory;
    let region = &memory.regions[0];
    assert_eq!(
        region.category_peak_above_baseline(Category::Activations),
        1_000
    );
    // Other test threads allocate and free small blocks at any moment: the
    // total is exact to within them.
    assert!(
        memory.peak_bytes + (1 << 16) >= memory.baseline_bytes + 10_000_000,
        "cell peak {} over a baseline of {}",
        memory.peak_bytes,
        memory.baseline_bytes
    );
    assert!(memory.peak_bytes >= region.peak_bytes);
    assert!(memory.peak_by_category.get(Category::Activations) >= 10_000_000);
}
