use super::*;

fn calibration(sum_bytes: u64) -> Calibration {
    Calibration {
        recipe: Recipe::Tiled,
        checkpointed: false,
        dtype: "f32",
        stage: None,
        // Fixed 100, 10 a sequence from batch 2 on; 115 for one.
        batches: vec![1, 2, 4],
        peaks: vec![115, 120, 140],
        seconds: vec![1.0, 2.0, 4.0],
        phase_peaks: Vec::new(),
        phase_grads: Vec::new(),
        param_bytes: 50,
        sum_bytes,
        batch_bytes_per_sequence: 1,
    }
}

#[test]
fn a_step_peaks_in_its_first_micro_batch_or_a_later_one_with_the_sum() {
    let c = calibration(50);
    assert_eq!(c.peak(8, 8), 180);
    // 2 x 4: the second holds the sum: 140 + 50, and 4 tokens.
    assert_eq!(c.peak(8, 4), 140 + 50 + 4);
    // 5 then 3: 150 for the first, 130 + 50 for the second.
    assert_eq!(c.peak(8, 5), 180 + 3);
    // 7 then 1: 170 for the first, 115 + 50 for the second.
    assert_eq!(c.peak(8, 7), 170 + 1);
    // One at a time: the measured one-sequence peak and the sum.
    assert_eq!(c.peak(8, 1), 115 + 50 + 7);
    // A sum that outweighs the micro-batches' difference.
    assert_eq!(calibration(500).peak(8, 7), 115 + 500 + 1);
}

#[test]
fn a_later_micro_batch_holds_the_sum_instead_of_the_gradients_made_so_far() {
    // Two stretches, the forward and the backward; the backward's
    // starts with 30 bytes of gradients collected.
    let c = Calibration {
        phase_peaks: vec![vec![70, 112], vec![80, 118], vec![96, 130]],
        phase_grads: vec![0, 30],
        ..calibration(50)
    };
    // One at a time: the backward holds the sum, not its 30 bytes:
    // 112 - 30 + 50, and 7 sequences' tokens.
    assert_eq!(c.peak(8, 1), 112 - 30 + 50 + 7);
    // 2 x 4: each stretch on its own line at 4.
    assert_eq!(c.peak(8, 4), 130 - 30 + 50 + 4);
    // The forward, which holds no gradients, where it is the higher.
    let forward = Calibration {
        phase_grads: vec![0, 60],
        ..c.clone()
    };
    assert_eq!(forward.peak(8, 1), 70 + 50 + 7);
    // Unknown gradients (a step that did not collect them): the whole
    // sum beside the micro-batch's peak.
    let unknown = Calibration {
        phase_grads: Vec::new(),
        ..c.clone()
    };
    assert_eq!(unknown.peak(8, 1), 115 + 50 + 7);
    assert_eq!(unknown.peak(8, 4), 140 + 50 + 4);
    // Gradients noted for a different number of stretches: the same.
    let uneven = Calibration {
        phase_grads: vec![0],
        ..c
    };
    assert_eq!(uneven.peak(8, 1), 115 + 50 + 7);
}

#[test]
fn the_micro_batch_search_finds_what_trying_every_size_finds() {
    // Calibrations as steps give them: the peak grows by more per
    // sequence than a sequence's tokens, one sequence at most the line
    // through batch 2 and 4.
    let mut seed = 7u64;
    let mut next = |n: u64| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) % n
    };
    for _ in 0..2000 {
        let fixed = 1000 + next(5000);
        let per = 20 + next(400);
        let token = 1 + next(per / 2);
        let mut c = calibration(next(4000));
        c.peaks = vec![
            fixed + per - next(per / 2 + 1),
            fixed + 2 * per,
            fixed + 4 * per,
        ];
        if next(2) == 1 {
            // Calibrated on (bf16's products): the slope falls past 4
            // and rises again, still growing.
            let at8 = fixed + 4 * per + 4 * (per / 2 + next(per / 2 + 1));
            c.batches = vec![1, 2, 4, 8, 16];
            c.peaks.extend([at8, at8 + 8 * (per / 2 + next(per))]);
            c.seconds = vec![1.0, 2.0, 4.0, 8.0, 16.0];
        }
        c.batch_bytes_per_sequence = token;
        let batch = 1 + next(120) as usize;
        let budget = fixed + next(per * batch as u64 + 6000);
        let fits = |peak: u64| peak <= budget;
        let scan = (1..batch).rev().find(|&m| fits(c.peak(batch, m)));
        assert_eq!(
            largest_micro(&c, batch, fits),
            scan,
            "{c:?} batch {batch} budget {budget}"
        );
    }
    // A batch of 10^11 sequences is weighed at once.
    let c = calibration(50);
    // Up to half the batch: 10^11 + 150 + 9m, so m = 1094 is the last.
    assert_eq!(
        largest_micro(&c, 100_000_000_000, |p| p <= 100_000_000_000 + 10_000),
        Some(1094)
    );
    assert_eq!(
        largest_micro(&c, 100_000_000_000, |p| p <= 1 << 62),
        Some(99_999_999_999)
    );
}

#[test]
fn bf16_on_the_cpu_is_calibrated_past_the_products_slice() {
    // 64 tokens: batch 4 is 256 rows, the slice; then 8 and 16, up to
    // the batch, until the last line starts past it.
    assert_eq!(calibration_batches(64, true, 8), [1, 2, 4, 8]);
    assert_eq!(calibration_batches(64, true, 5), [1, 2, 4, 8]);
    assert_eq!(calibration_batches(64, true, 16), [1, 2, 4, 8, 16]);
    assert_eq!(calibration_batches(64, true, 1000), [1, 2, 4, 8, 16]);
    assert_eq!(calibration_batches(64, true, 4), [1, 2, 4]);
    assert_eq!(calibration_batches(128, true, 1000), [1, 2, 4, 8]);
    // 16 tokens: batch 16 is the slice, so the line starts at 32.
    assert_eq!(
        calibration_batches(16, true, 1000),
        [1, 2, 4, 8, 16, 32, 64]
    );
    // Past the slice at batch 2 already, or not sliced.
    assert_eq!(calibration_batches(256, true, 1000), [1, 2, 4]);
    assert_eq!(calibration_batches(64, false, 1000), [1, 2, 4]);
}

#[test]
fn a_micro_batch_is_predicted_on_the_line_through_the_batches_around_it() {
    let c = Calibration {
        batches: vec![1, 2, 4, 8, 16],
        // 10 a sequence from 2 to 4, then 5.
        peaks: vec![115, 120, 140, 160, 200],
        seconds: vec![1.0, 2.0, 4.0, 6.0, 10.0],
        ..calibration(0)
    };
    let at = |m: usize| c.peak(m, m);
    assert_eq!([at(1), at(2), at(3), at(4)], [115, 120, 130, 140]);
    assert_eq!([at(6), at(8), at(12), at(16)], [150, 160, 180, 200]);
    // Past the last, on the line through the last two.
    assert_eq!(at(32), 120 + 32 * 5);
    assert_eq!(
        (c.fixed(), c.per_sequence(), c.last_line()),
        (120, 5, (8, 16))
    );
    assert_eq!(c.seconds(6, 6), 5.0);
    assert_eq!(c.seconds(32, 32), 18.0);
    // Three batches: the line through 2 and 4 throughout.
    let three = calibration(0);
    assert_eq!(
        (three.fixed(), three.per_sequence(), three.last_line()),
        (100, 10, (2, 4))
    );
    assert_eq!(three.peak(64, 64), 100 + 640);
}

#[test]
fn a_moment_whose_line_is_steeper_sets_the_larger_batches_peak() {
    // Two stretches: the first holds 100 + 10 a sequence, the second
    // 90 + 12. At batch 2 and 4 the first is the step's peak (120,
    // 140); past 5 the second overtakes it.
    let c = Calibration {
        peaks: vec![115, 120, 140],
        phase_peaks: vec![vec![110, 102], vec![120, 114], vec![140, 138]],
        ..calibration(0)
    };
    assert_eq!(c.peak(4, 4), 140);
    assert_eq!(c.peak(16, 16), 90 + 16 * 12);
    // Stretches that differ in number from batch to batch are not read.
    let uneven = Calibration {
        phase_peaks: vec![vec![110, 102], vec![120], vec![140, 138]],
        ..c.clone()
    };
    assert_eq!(uneven.peak(16, 16), 100 + 16 * 10);
}

#[test]
fn a_batch_must_split_evenly_over_the_ranks() {
    let req = PlanRequest {
        model: GptConfig::default(),
        batch: 16,
        budget: 1 << 30,
        margin: 0.05,
        dtypes: vec![DType::F32],
        recipes: vec![Recipe::Tiled],
        checkpointing: false,
        seed: 1,
        ranks: 4,
        stages: vec![Stage::Ddp],
    };
    assert_eq!(req.batch_per_rank().unwrap(), 4);
    let three = PlanRequest {
        ranks: 3,
        ..req.clone()
    };
    assert!(three
        .batch_per_rank()
        .unwrap_err()
        .to_string()
        .contains("a batch of 16 sequences does not split evenly over 3 ranks"));
    assert_eq!(PlanRequest { ranks: 1, ..req }.sharings(), vec![None]);
}
