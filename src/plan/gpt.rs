//! A GPT's plan in words and as a figure: the calibrations, every option
//! with its predicted peak and time, the choice, and its verification.

use workbook_planner::plan::{Candidate, Plan, Verification};
use workbook_planner::Stage;
use workbook_sdk::output::{Axis, Series};
use workbook_sdk::{Figure, Unit};

use crate::render::text::bytes;

fn option(c: &Candidate) -> String {
    let micro = if c.micro_steps > 1 {
        format!(
            "{} micro-batches of {} (gradients accumulated)",
            c.micro_steps, c.micro_batch
        )
    } else {
        format!("the whole batch of {}", c.micro_batch)
    };
    let checkpointed = if c.checkpointed {
        ", every layer checkpointed"
    } else {
        ""
    };
    format!(
        "{}{} layers in {}, {micro}{checkpointed}",
        c.stage.map(sharing).unwrap_or_default(),
        c.recipe.name(),
        c.dtype
    )
}

/// How the ranks share the training, in words.
fn sharing(stage: Stage) -> String {
    match stage {
        Stage::Ddp => "DDP (everything replicated), ",
        Stage::Zero1 => "ZeRO stage 1 (optimizer state partitioned), ",
        Stage::Zero2 => "ZeRO stage 2 (optimizer state and gradients partitioned), ",
        Stage::Zero3 => "ZeRO stage 3 (parameters, gradients and optimizer state partitioned), ",
    }
    .to_string()
}

/// The plan as text: the calibrations, every option with its predicted
/// peak and time, the choice (or why there is none).
pub fn text(plan: &Plan, batch: usize) -> String {
    let mut out = String::new();
    if plan.ranks > 1 {
        out.push_str(&format!(
            "Budget {} per rank for a step of {batch} sequences on {} ranks, {} each.\n\n\
             Calibration (one rank's measured steps at batch 1, 2 and 4, its {} peers rehearsed \
             in this process; then the line through its last two batches):\n",
            bytes(plan.budget),
            plan.ranks,
            plan.batch_per_rank,
            plan.ranks - 1
        ));
    } else {
        out.push_str(&format!(
            "Budget {} for a step of {batch} sequences.\n\nCalibration (measured steps at batch 1, \
             2 and 4; then the line through its last two batches):\n",
            bytes(plan.budget)
        ));
    }
    // The recipes' column as wide as its longest name (`direct_tiled`).
    let width = plan
        .calibrations
        .iter()
        .map(|c| c.recipe.name().len())
        .max()
        .unwrap_or(0)
        .max(6);
    for c in &plan.calibrations {
        // Batches past 4 (bf16 on the CPU) are named with their peaks.
        let more: String = c
            .batches
            .iter()
            .zip(&c.peaks)
            .skip(3)
            .map(|(b, p)| format!(", at {b} {}", bytes(*p)))
            .collect();
        let (from, to) = c.last_line();
        let line = if (from, to) == (2, 4) {
            String::new()
        } else {
            format!(" (through {from} and {to})")
        };
        out.push_str(&format!(
            "  {}{:<width$} {:<4} {:<12}  peaks {:>9} {:>9} {:>9}{more}: fixed {:>9}, per \
             sequence {:>9}{line}\n",
            c.stage
                .map(|s| format!("{:<6}", s.name()))
                .unwrap_or_default(),
            c.recipe.name(),
            c.dtype,
            if c.checkpointed { "checkpointed" } else { "" },
            bytes(c.peaks[0]),
            bytes(c.peaks[1]),
            bytes(c.peaks[2]),
            bytes(c.fixed()),
            bytes(c.per_sequence())
        ));
    }
    out.push_str("\nOptions (predicted):\n");
    let mut sorted: Vec<&Candidate> = plan.candidates.iter().collect();
    sorted.sort_by(|a, b| a.seconds.total_cmp(&b.seconds).then(a.peak.cmp(&b.peak)));
    for c in sorted {
        let verdict = if plan.chosen.as_ref() == Some(c) {
            "chosen"
        } else if !c.fits {
            "over budget"
        } else if c.on_frontier {
            "fits, slower"
        } else {
            "fits, dominated"
        };
        out.push_str(&format!(
            "  {:>10}  {:>7.3} s  {:<15} {}\n",
            bytes(c.peak),
            c.seconds,
            verdict,
            option(c)
        ));
    }
    match &plan.chosen {
        Some(c) => out.push_str(&format!(
            "\nPlan: {}; predicted peak {} ({:.0}% of the budget: an option fits when its \
             prediction plus {:.0}% is within it), step {:.3} s.\n",
            option(c),
            bytes(c.peak),
            100.0 * c.peak as f64 / plan.budget as f64,
            100.0 * plan.margin,
            c.seconds
        )),
        None => out.push_str(&format!("\n{}\n", nothing_fits(plan, batch))),
    }
    out
}

/// Why no option fits, with the smallest there is.
pub fn nothing_fits(plan: &Plan, batch: usize) -> String {
    // On N ranks, each holds its share of the batch.
    let batch = plan.batch_per_rank.min(batch);
    // The least each calibration can need: one sequence at a time.
    let smallest = plan.calibrations.iter().min_by_key(|c| c.peak(batch, 1));
    match smallest {
        Some(c) => {
            let sum = if batch > 1 {
                format!(
                    " and {} for the gradients accumulated over the batch",
                    bytes(c.sum_bytes)
                )
            } else {
                String::new()
            };
            format!(
                "Nothing fits in {}{}: the smallest option, {}{} layers in {}{} one sequence at a \
                 time, needs {} (measured for one sequence: {}, parameters, gradients and \
                 optimizer state included{sum}), and {:.0}% more as a margin for the \
                 prediction. A smaller model, a shorter sequence or more memory would fit.{}",
                bytes(plan.budget),
                if plan.ranks > 1 { " per rank" } else { "" },
                c.stage.map(sharing).unwrap_or_default(),
                c.recipe.name(),
                c.dtype,
                if c.checkpointed {
                    ", checkpointed,"
                } else {
                    ""
                },
                bytes(c.peak(batch, 1)),
                bytes(c.peaks[0]),
                100.0 * plan.margin,
                if plan.ranks > 1 {
                    " So would more ranks (`--ranks`) with ZeRO, each then holding a smaller \
                     share of the model's states."
                } else {
                    ""
                },
            )
        }
        None => format!(
            "Nothing fits in {}: no option was weighed.",
            bytes(plan.budget)
        ),
    }
}

/// The verification as text.
pub fn verified(v: &Verification, tolerance: f64) -> String {
    format!(
        "Verified{}: measured peak {} against {} predicted ({:+.1}%) and a budget of {}; \
         step {:.3} s (median{}). {}\n",
        if v.ranks > 1 {
            format!(" on {} MPI ranks (the rank that held the most)", v.ranks)
        } else {
            String::new()
        },
        bytes(v.peak),
        bytes(v.predicted),
        100.0 * v.error(),
        bytes(v.budget),
        v.seconds,
        if v.ranks > 1 { ", slowest rank" } else { "" },
        if v.kept(tolerance) {
            format!(
                "The plan kept its promise (within the budget and {:.0}% of the prediction).",
                100.0 * tolerance
            )
        } else {
            format!(
                "The plan did NOT keep its promise (it must stay within the budget and {:.0}% of \
                 the prediction).",
                100.0 * tolerance
            )
        }
    )
}

/// The options on the memory-time plane: the Pareto frontier (no other
/// option both smaller and faster), the chosen option, and the budget.
pub fn figure(plan: &Plan) -> Figure {
    let mut frontier: Vec<(f64, f64)> = plan
        .candidates
        .iter()
        .filter(|c| c.on_frontier)
        .map(|c| (c.seconds, c.peak as f64))
        .collect();
    frontier.sort_by(|a, b| a.0.total_cmp(&b.0));
    let xs = plan.candidates.iter().map(|c| c.seconds);
    let lo = xs.clone().fold(f64::INFINITY, f64::min);
    let hi = xs.fold(0f64, f64::max);
    let mut series = vec![Series {
        name: "Pareto frontier of the options".into(),
        points: frontier,
    }];
    if let Some(c) = &plan.chosen {
        series.push(Series {
            name: "chosen".into(),
            points: vec![(c.seconds, c.peak as f64)],
        });
    }
    series.push(Series {
        name: "budget".into(),
        points: vec![(lo, plan.budget as f64), (hi, plan.budget as f64)],
    });
    Figure {
        id: "plan".into(),
        title: "The planner's options: their Pareto frontier, the choice and the budget".into(),
        x: Axis {
            label: "predicted step time".into(),
            unit: Unit::Seconds,
            log: false,
        },
        y: Axis {
            label: "predicted peak".into(),
            unit: Unit::Bytes,
            log: false,
        },
        series,
        ..Figure::default()
    }
}
