//! `workbook::Live`, what a notebook's cells call, outside Jupyter: a cell
//! run from its experiment function in this process measures what `workbook
//! run` measures, an edit changes the measurement and is graded by the
//! chapter's assertions, and a wrong cell, plugin or parameter type is an
//! error that says what is wrong. (Through a real kernel: tests/kernel.rs
//! and scripts/notebook_check.py.)

use workbook::Live;
use workbook_exercises::{
    fit_exercise, grade_choice, grade_plan, policy_exercise, recomputed_layers, FitExercise,
    FitParams, PolicyExercise, PolicyParams, Product, StepPlan, StepShape,
};
use workbook_footprint::{footprint_experiment, Footprint, Params};

#[global_allocator]
static ALLOC: workbook::sdk::meter::CountingAllocator = workbook::sdk::meter::CountingAllocator;

const CHAPTER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/chapters/chapter2.toml");

/// The counting allocator counts the whole process: one measurement at a
/// time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn chapter2() -> (Live, std::sync::MutexGuard<'static, ()>) {
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    (Live::try_open(CHAPTER).unwrap().check(true), guard)
}

#[test]
fn a_cell_run_from_its_experiment_measures_what_workbook_run_measures() {
    let (wb, _one) = chapter2();
    let p: Params = wb.try_params("footprint").unwrap();
    let view = wb
        .try_run("footprint", Footprint, p, footprint_experiment)
        .unwrap();
    assert!(view.passed(), "{:?}", view.failure());

    // What `workbook run` measures in a fresh process, as the kernel's cell
    // is its process's first.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_workbook"))
        .args([
            "run",
            CHAPTER,
            "--check",
            "--cell",
            "footprint",
            "--format",
            "json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: workbook::ChapterReport = serde_json::from_slice(&out.stdout).unwrap();
    // Byte counts, parameter counts and the 7B figures: all equal. (A ratio
    // read back from JSON text may differ in its last place.)
    let (here, there) = (&view.cell().metrics, &report.cells[0].metrics);
    assert_eq!(
        here.keys().collect::<Vec<_>>(),
        there.keys().collect::<Vec<_>>()
    );
    for (name, value) in here {
        if name.contains("ratio") {
            assert!(
                (value - there[name]).abs() < 1e-12,
                "{name}: {value} {}",
                there[name]
            );
        } else {
            assert_eq!(*value, there[name], "{name}");
        }
    }
    assert!(view
        .html()
        .contains("measured by cpu-allocator in this kernel"));
}

#[test]
fn an_edit_changes_the_measurement_and_is_graded_by_the_chapter() {
    let (wb, _one) = chapter2();
    let p: Params = wb.try_params("footprint").unwrap();
    // A smaller "small" model: 10 x 20 weights and 20 biases.
    let edited = Params {
        small: vec![10, 20],
        ..p
    };
    let view = wb
        .try_run("footprint", Footprint, edited, footprint_experiment)
        .unwrap();
    assert_eq!(view.cell().metrics["small_params"], 220.0);
    let failure = view.failure().unwrap();
    assert!(
        failure.starts_with("cell `footprint` failed 1 of "),
        "{failure}"
    );
    assert!(failure.contains("small_params = 220"), "{failure}");

    // The experiment's code itself, edited: the closure runs instead.
    let view = wb
        .try_run("footprint", Footprint, p_of(&wb), |ctx, p: Params| {
            ctx.metric("small_params", 17_802.0);
            ctx.metric("large_params", p.large.len() as f64);
            Ok(())
        })
        .unwrap();
    assert_eq!(
        view.cell().metrics["large_params"],
        p_of(&wb).large.len() as f64
    );
}

fn p_of(wb: &Live) -> Params {
    wb.try_params("footprint").unwrap()
}

#[test]
fn a_wrong_cell_plugin_or_parameter_type_says_what_is_wrong() {
    let (wb, _one) = chapter2();
    let err = wb.try_params::<Params>("footprnt").unwrap_err().to_string();
    assert_eq!(
        err,
        "chapter `chapter2` has no cell `footprnt`; did you mean `footprint`?; its cells: \
         footprint, accumulation, checkpointing, precision, offload, attention, exercise-policy, \
         exercise-fit"
    );
    let err = wb
        .try_run("checkpointing", Footprint, p_of(&wb), footprint_experiment)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "cell `checkpointing` runs plugin `checkpointing`, not `footprint`"
    );
    let err = wb
        .try_params::<workbook_checkpointing::Params>("footprint")
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("cell `footprint`'s parameters: unknown field `"),
        "{err}"
    );
}

/// Most multiply-adds per byte first: the learner's likely first answer,
/// which misses the best choice at chapter 2's sizes.
fn greedy(products: &[Product], budget: u64) -> Vec<&'static str> {
    let mut order: Vec<&Product> = products.iter().collect();
    order.sort_by(|a, b| (b.macs * a.bytes).cmp(&(a.macs * b.bytes)));
    let mut left = budget;
    let mut kept = Vec::new();
    for p in order {
        if p.bytes <= left {
            left -= p.bytes;
            kept.push(p.name);
        }
    }
    kept
}

#[test]
fn an_exercise_is_graded_unfinished_wrong_and_solved() {
    let (wb, _one) = chapter2();
    let p: PolicyParams = wb.try_params("exercise-policy").unwrap();
    let grade = |choose: fn(&[Product], u64) -> Vec<&'static str>| {
        wb.try_run(
            "exercise-policy",
            PolicyExercise,
            p.clone(),
            move |ctx, p: PolicyParams| grade_choice(ctx, &p, choose),
        )
        .unwrap()
    };

    // As the notebook shows it: the `todo!()` is the cell's error.
    let view = grade(|_, _| todo!("exercise: replace this line with your code"));
    let failure = view.failure().unwrap();
    assert!(
        failure.starts_with("cell `exercise-policy` errored: ")
            && failure.contains("not yet implemented: exercise: replace this line with your code"),
        "{failure}"
    );

    // Within the budget, but not the fewest multiply-adds.
    let view = grade(greedy);
    let failure = view.failure().unwrap();
    assert!(
        failure.starts_with("cell `exercise-policy` failed 1 of 4 assertions"),
        "{failure}"
    );
    assert!(
        failure.contains("`recomputed_macs == fewest_recomputed_macs`"),
        "{failure}"
    );
    // Everything: over the budget.
    let view = grade(|products, _| products.iter().map(|p| p.name).collect());
    let failure = view.failure().unwrap();
    assert!(
        failure.contains("`kept_bytes <= budget_bytes`"),
        "{failure}"
    );
    // A name the block does not have.
    let view = grade(|_, _| vec!["attention"]);
    let failure = view.failure().unwrap();
    assert!(
        failure.contains(
            "`attention` is not a product of the block; they are qkv, scores, mix, proj, up, down"
        ),
        "{failure}"
    );

    // The reference solution passes, and what it keeps is measured: its
    // bytes for each block but the last, and a little bookkeeping.
    let view = wb
        .try_run(
            "exercise-policy",
            PolicyExercise,
            p.clone(),
            policy_exercise,
        )
        .unwrap();
    assert_eq!(view.failure(), None);
    let m = &view.cell().metrics;
    assert_eq!(m["kept_bytes"], m["budget_bytes"]);
    assert_eq!(m["kept_predicted"], m["kept_bytes"] * (p.depth - 1) as f64);
    let bookkeeping = m["kept_measured"] - m["kept_predicted"];
    assert!((0.0..=16384.0).contains(&bookkeeping), "{bookkeeping}");
}

/// A plan chooser as `choose_plan` is written.
type Choose = fn(
    &StepShape,
    u64,
    &mut dyn FnMut(StepPlan) -> anyhow::Result<u64>,
) -> anyhow::Result<StepPlan>;

/// The plan with the smallest measured peak: it fits whenever any plan
/// does, but recomputes more than it needs to.
fn lowest_peak(
    shape: &StepShape,
    _: u64,
    measure: &mut dyn FnMut(StepPlan) -> anyhow::Result<u64>,
) -> anyhow::Result<StepPlan> {
    let mut best: Option<(u64, StepPlan)> = None;
    for plan in shape.plans() {
        let peak = measure(plan)?;
        if best.is_none_or(|(b, _)| peak < b) {
            best = Some((peak, plan));
        }
    }
    Ok(best.unwrap().1)
}

#[test]
fn the_fit_exercise_is_graded_by_measuring_every_plan() {
    let (wb, _one) = chapter2();
    let p: FitParams = wb.try_params("exercise-fit").unwrap();
    let shape = StepShape {
        depth: p.depth,
        batch: p.batch,
        min_micro_batch: p.min_micro_batch,
    };
    let grade = |choose: Choose| {
        wb.try_run(
            "exercise-fit",
            FitExercise,
            p.clone(),
            move |ctx, p: FitParams| grade_plan(ctx, &p, choose),
        )
        .unwrap()
    };

    let view = grade(|_, _, _| todo!("exercise: replace this line with your code"));
    let failure = view.failure().unwrap();
    assert!(
        failure.starts_with("cell `exercise-fit` errored: ")
            && failure.contains("not yet implemented: exercise: replace this line with your code"),
        "{failure}"
    );

    // Accumulation alone, as many micro-batches as allowed, unmeasured:
    // over budget.
    let view = grade(|shape, _, _| {
        Ok(StepPlan {
            micro_batches: shape.batch / shape.min_micro_batch,
            segments: 1,
        })
    });
    let failure = view.failure().unwrap();
    assert!(
        failure.starts_with("cell `exercise-fit` failed 3 of 5 assertions")
            && failure.contains("`chosen_peak <= budget_bytes`")
            && failure.contains("`measurements >= 1`"),
        "{failure}"
    );
    // Fits, but recomputes more than the cheapest plan that fits.
    let view = grade(lowest_peak);
    let failure = view.failure().unwrap();
    assert!(
        failure.starts_with("cell `exercise-fit` failed 1 of 5 assertions")
            && failure.contains("`chosen_recomputed_layers == cheapest_recomputed_layers"),
        "{failure}"
    );
    assert_eq!(
        view.cell().metrics["measurements"],
        shape.plans().len() as f64
    );
    // Plans the step does not allow, chosen or measured.
    let not_a_plan = "StepPlan { micro_batches: 3, segments: 1 } is not a plan of this step: \
                      micro_batches must be one of 1, 2, 4, 8 (equal parts of 1024 rows, each \
                      at least 128), segments one of 1, 2, 4, 8 (equal parts of 8 layers)";
    let view = grade(|_, _, _| {
        Ok(StepPlan {
            micro_batches: 3,
            segments: 1,
        })
    });
    assert!(view.failure().unwrap().contains(not_a_plan), "{view:?}");
    let view = grade(|_, _, measure| {
        measure(StepPlan {
            micro_batches: 3,
            segments: 1,
        })?;
        unreachable!("the measurement fails")
    });
    assert!(view.failure().unwrap().contains(not_a_plan), "{view:?}");

    // A budget no plan reaches: the error says how low a plan gets.
    let view = wb
        .try_run(
            "exercise-fit",
            FitExercise,
            FitParams {
                budget_fraction: 0.01,
                ..p.clone()
            },
            |ctx, p: FitParams| {
                grade_plan(ctx, &p, |_, _, _| {
                    Ok(StepPlan {
                        micro_batches: 1,
                        segments: 1,
                    })
                })
            },
        )
        .unwrap();
    let failure = view.failure().unwrap();
    assert!(
        failure.contains("no plan fits ")
            && failure.contains("raise budget_fraction or lower min_micro_batch"),
        "{failure}"
    );

    // The reference solution passes: the cheapest plan that fits, found by
    // measuring plans in the order of their cost.
    let view = wb
        .try_run("exercise-fit", FitExercise, p.clone(), fit_exercise)
        .unwrap();
    assert_eq!(view.failure(), None);
    let m = &view.cell().metrics;
    assert!(m["chosen_peak"] <= m["budget_bytes"]);
    // It measured each plan cheaper than its own, and its own.
    let chosen = (
        m["chosen_recomputed_layers"] as usize,
        m["chosen_micro_batches"] as usize,
    );
    let cheaper = shape
        .plans()
        .into_iter()
        .filter(|&q| (recomputed_layers(&shape, q).unwrap(), q.micro_batches) < chosen)
        .count();
    assert_eq!(m["measurements"], (cheaper + 1) as f64);
    assert!(m["grad_max_abs_diff"] < 1e-5);
}

#[test]
fn a_panic_in_a_cell_is_its_error_and_is_not_printed_again() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static PRINTED: AtomicUsize = AtomicUsize::new(0);
    let (wb, _one) = chapter2();
    let p = p_of(&wb);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {
        PRINTED.fetch_add(1, Ordering::SeqCst);
    }));
    let view = wb.try_run("footprint", Footprint, p, |_, _: Params| {
        panic!("the learner's bug")
    });
    let in_the_cell = PRINTED.load(Ordering::SeqCst);
    // The hook is back for panics outside a cell.
    let outside = std::panic::catch_unwind(|| panic!("outside a cell"));
    let after = PRINTED.load(Ordering::SeqCst);
    std::panic::set_hook(previous);
    assert!(outside.is_err());
    assert_eq!((in_the_cell, after), (0, 1));
    let failure = view.unwrap().failure().unwrap();
    assert!(
        failure.starts_with("cell `footprint` errored: ")
            && failure.contains("panicked: the learner's bug"),
        "{failure}"
    );
}
