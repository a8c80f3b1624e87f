//! A plan of micro-batches of one sequence: a later micro-batch adds each
//! gradient into the sum as its backward makes it, so at each moment it
//! holds the sum instead of the gradients made so far.

use workbook_models::GptConfig;
use workbook_planner::plan::{plan, verify, Candidate, VerifyRequest};

mod common;

#[test]
fn one_sequence_at_a_time_is_predicted_within_one_percent() {
    let mut ctx = common::context();
    // Chapter 3's base model on 64 tokens, where the gradients weigh more
    // beside the activations. Counting both the gradients made before the
    // peak's moment and the sum, this prediction was 12% over the measured
    // peak (and 5.1% on 256 tokens with 512 wide layers).
    let req = common::direct_tiled(
        GptConfig {
            seq: 64,
            ..GptConfig::default()
        },
        8,
        true,
    );
    let planned = plan(&mut ctx, &req).unwrap();
    assert_eq!(
        planned.calibrations.len(),
        2,
        "with and without checkpointing"
    );
    for calibration in &planned.calibrations {
        // The backward hands gradients over layer by layer: more are held
        // at each stretch's start than at the one before.
        let grads = &calibration.phase_grads;
        assert!(
            grads.windows(2).all(|w| w[0] <= w[1]) && grads.last() > grads.first(),
            "{grads:?}"
        );
        // The whole batch fits the budget; its option, one sequence at a
        // time.
        let single = Candidate {
            checkpointed: calibration.checkpointed,
            micro_batch: 1,
            micro_steps: req.batch,
            peak: calibration.peak(req.batch, 1),
            ..planned
                .chosen
                .clone()
                .expect("the whole batch, within 1 TiB")
        };
        let measured = verify(
            &mut ctx,
            &VerifyRequest::new(&req, &single, 2).unwrap(),
            None,
        )
        .unwrap();
        let error = measured.error();
        assert!(
            error.abs() <= 0.01,
            "checkpointed: {}: predicted {}, measured {}: {:+.2}%",
            calibration.checkpointed,
            measured.predicted,
            measured.peak,
            100.0 * error
        );
    }
}
