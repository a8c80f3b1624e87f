//! `worker::run_cell`, what a plugin's own tests run: the cell measured by
//! the counting allocator, and held to the metrics its plugin declares.

use workbook_sdk::{anyhow, Category, Context, MetricSpec, Plugin};

#[global_allocator]
static ALLOC: workbook_sdk::meter::CountingAllocator = workbook_sdk::meter::CountingAllocator;

/// The counting allocator counts the whole process: one measured cell at a
/// time, or one test's buffer lands in the other's peak.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Allocates a known buffer; records one declared metric, and one more
/// when asked to.
struct Buffer {
    undeclared: bool,
}

impl Plugin for Buffer {
    type Params = ();
    fn name(&self) -> &str {
        "buffer"
    }
    fn metrics(&self) -> Vec<MetricSpec> {
        vec![MetricSpec::bytes("peak_{what}", "the buffer's peak")]
    }
    fn run(&self, ctx: &mut Context, _: ()) -> anyhow::Result<()> {
        let (_, region) = ctx.measure("buffer", |r| {
            let v = Category::Activations.scope(|| vec![0u8; 12_345]);
            r.mark("allocated");
            drop(v);
            Ok(())
        })?;
        ctx.metric("peak_buffer", region.peak_above_baseline() as f64);
        if self.undeclared {
            ctx.metric("bytes", 1.0);
        }
        Ok(())
    }
}

#[test]
fn a_cell_is_measured_to_the_byte_and_held_to_its_declared_metrics() {
    let _alone = alone();
    let ok = workbook_sdk::worker::run_cell(&Buffer { undeclared: false }, &(), true).unwrap();
    assert_eq!(ok.end.error, None);
    assert_eq!(ok.output.metrics["peak_buffer"], 12_345.0);

    let extra = workbook_sdk::worker::run_cell(&Buffer { undeclared: true }, &(), true).unwrap();
    assert_eq!(
        extra.end.error.as_deref(),
        Some("recorded metrics not declared in `Plugin::metrics`: bytes")
    );
    // What it recorded is kept.
    assert_eq!(extra.output.metrics["peak_buffer"], 12_345.0);
}

#[test]
fn an_edited_experiment_runs_measured_and_held_to_the_plugins_metrics() {
    let _alone = alone();
    // The experiment a notebook cell edited: a larger buffer.
    let edited =
        workbook_sdk::Edited::new(Buffer { undeclared: false }, |ctx: &mut Context, ()| {
            let (_, region) = ctx.measure("buffer", |_| {
                let v = Category::Activations.scope(|| vec![0u8; 54_321]);
                drop(std::hint::black_box(v));
                Ok(())
            })?;
            ctx.metric("peak_buffer", region.peak_above_baseline() as f64);
            Ok(())
        });
    let ok = workbook_sdk::worker::run_cell(&edited, &(), true).unwrap();
    assert_eq!(ok.end.error, None);
    assert_eq!(ok.output.metrics["peak_buffer"], 54_321.0);

    let wrong = workbook_sdk::Edited::new(Buffer { undeclared: false }, |ctx: &mut Context, ()| {
        ctx.metric("peak", 1.0);
        Ok(())
    });
    let extra = workbook_sdk::worker::run_cell(&wrong, &(), true).unwrap();
    assert_eq!(
        extra.end.error.as_deref(),
        Some("recorded metrics not declared in `Plugin::metrics`: peak")
    );
}
