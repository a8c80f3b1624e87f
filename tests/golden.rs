//! The JSON report is a contract: plots, the HTML report and notebooks read
//! it. This pins its shape against a golden file. A change that fails here
//! changes the contract: add fields freely, but rename or remove one only
//! with a new `format_version`. Regenerate with `WORKBOOK_BLESS=1`.

use indexmap::IndexMap;
use workbook::assertion::AssertionResult;
use workbook::render::memory_table;
use workbook::report::{CellMemory, CellReport, ChapterInfo, ChapterReport, Mode, Status, Summary};
use workbook_sdk::meter::ByCategory;
use workbook_sdk::output::{
    Axis, Column, Figure, Guide, Mark, Marker, PoolUse, RegionReport, Series, Table, Unit,
};

fn sample() -> ChapterReport {
    let region = RegionReport {
        name: "plain".into(),
        baseline: ByCategory([100, 0, 0, 0, 10, 0, 5]),
        peak_bytes: 4_000,
        peak_by_category: ByCategory([100, 1_000, 0, 2_750, 10, 0, 140]),
        peak_each: ByCategory([100, 1_200, 0, 2_750, 10, 0, 140]),
        baseline_host: ByCategory::default(),
        device_peak_each: ByCategory([100, 1_200, 0, 2_750, 10, 0, 140]),
        host_peak_each: ByCategory::default(),
        device_peak_bytes: 4_000,
        end: ByCategory([100, 1_000, 0, 0, 10, 0, 5]),
        end_host: ByCategory::default(),
        baseline_blocks: 12,
        peak_blocks: 40,
        seconds: 0.25,
        marks: vec![Mark {
            label: "after forward".into(),
            seconds: 0.125,
            current: ByCategory([100, 0, 0, 2_750, 10, 0, 5]),
            peak_so_far: 2_865,
        }],
        analytic: Some(3_000),
        pool: None,
    };
    let mut metrics = IndexMap::new();
    metrics.insert("peak_plain".to_string(), 3_885.0);
    metrics.insert("not_a_number".to_string(), f64::NAN);
    let mut values = IndexMap::new();
    values.insert("peak_plain".to_string(), Some(3_885.0));
    let cell = CellReport {
        id: "checkpointing".into(),
        title: "2.3 Activation checkpointing".into(),
        prose: "Recompute instead of keep.".into(),
        plugin: "checkpointing".into(),
        status: Status::Passed,
        error: None,
        seconds: 0.5,
        params: serde_json::json!({ "segments": [1, 2, 4] }),
        printed: vec!["0.6892".into()],
        metrics,
        assertions: vec![
            AssertionResult {
                expr: "peak_plain > 0".into(),
                passed: true,
                skipped: false,
                values,
                message: None,
            },
            AssertionResult {
                expr: "time_overhead < 1.4".into(),
                passed: false,
                skipped: true,
                values: IndexMap::new(),
                message: Some("checked at full size only".into()),
            },
        ],
        memory: CellMemory {
            baseline_bytes: 115,
            baseline_by_category: ByCategory([100, 0, 0, 0, 10, 0, 5]),
            peak_bytes: 4_000,
            current_bytes: 1_115,
            peak_by_category: ByCategory([100, 1_000, 0, 2_750, 10, 0, 140]),
            current_by_category: ByCategory([100, 1_000, 0, 0, 10, 0, 5]),
            pool: None,
            regions: vec![region],
        },
        tables: vec![Table {
            title: "Sweep".into(),
            columns: vec![Column {
                name: "peak".into(),
                unit: Unit::Bytes,
            }],
            rows: vec![vec![serde_json::json!(4_000)]],
        }],
        figures: vec![Figure {
            id: "segments".into(),
            title: "Peak against segments".into(),
            x: Axis {
                label: "segments".into(),
                unit: Unit::Count,
                log: true,
            },
            y: Axis {
                label: "peak".into(),
                unit: Unit::Bytes,
                log: false,
            },
            series: vec![Series {
                name: "checkpointed".into(),
                // A diverging loss: NaN and infinities are carried, not lost.
                points: vec![
                    (1.0, 4_000.0),
                    (4.0, 2_000.0),
                    (8.0, f64::NAN),
                    (16.0, f64::INFINITY),
                    (32.0, f64::NEG_INFINITY),
                ],
            }],
            markers: vec![Marker {
                x: 4.0,
                label: "sqrt(n)".into(),
            }],
            guides: vec![Guide {
                power: 2.0,
                label: "grows as N^2".into(),
            }],
        }],
        not_run: None,
    };
    let failed = CellReport {
        id: "precision".into(),
        title: "2.4 Precision".into(),
        status: Status::Failed,
        seconds: f64::INFINITY,
        assertions: vec![AssertionResult {
            expr: "loss_gap < 0.05".into(),
            passed: false,
            skipped: false,
            values: IndexMap::from([("loss_gap".to_string(), None)]),
            message: Some("metric `loss_gap` is NaN, where a finite value was asserted".into()),
        }],
        metrics: IndexMap::from([("loss_gap".to_string(), f64::NAN)]),
        tables: Vec::new(),
        figures: Vec::new(),
        ..cell.clone()
    };
    let errored = CellReport {
        id: "offload".into(),
        title: "2.5 Offload".into(),
        status: Status::Error,
        error: Some("panicked: out of patience".into()),
        assertions: vec![AssertionResult {
            expr: "<the cell runs to completion>".into(),
            passed: false,
            skipped: false,
            values: IndexMap::new(),
            message: Some("panicked: out of patience".into()),
        }],
        metrics: IndexMap::new(),
        tables: Vec::new(),
        figures: Vec::new(),
        memory: CellMemory::default(),
        ..cell.clone()
    };
    // A cell this build cannot run: skipped, and why.
    let why = "rank count 2: this runs MPI ranks, and this workbook was built without the `mpi` \
               feature";
    let not_run = CellReport {
        id: "zero".into(),
        title: "4.1 Ranks".into(),
        plugin: "zero_stages".into(),
        status: Status::Skipped,
        seconds: 0.0,
        printed: Vec::new(),
        assertions: vec![AssertionResult {
            expr: "ddp_n2_state > 0".into(),
            passed: false,
            skipped: true,
            values: IndexMap::new(),
            message: Some(format!("not run: {why}")),
        }],
        metrics: IndexMap::new(),
        tables: Vec::new(),
        figures: Vec::new(),
        memory: CellMemory::default(),
        not_run: Some(why.into()),
        ..cell.clone()
    };
    let cells = vec![cell, failed, errored, not_run];
    ChapterReport {
        format_version: workbook::report::FORMAT_VERSION,
        workbook_version: "0.0.0-golden".into(),
        chapter: ChapterInfo {
            id: "chapter2".into(),
            title: "2. Memory Optimization".into(),
            path: "chapters/chapter2.toml".into(),
            intro: "Memory first.".into(),
        },
        mode: Mode::Check,
        device: "cpu".into(),
        meter: "cpu-allocator".into(),
        summary: ChapterReport::summarize(&cells),
        cells,
        incomplete: false,
    }
}

#[test]
fn the_json_report_matches_the_golden_file() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/report.json");
    let report = sample();
    assert_eq!(
        report.summary,
        Summary {
            passed: 1,
            failed: 2,
            skipped: 2,
            cells_passed: 1,
            cells_failed: 1,
            cells_errored: 1
        }
    );
    let mut json = Vec::new();
    workbook::render::json(&mut json, &report).unwrap();
    let json = String::from_utf8(json).unwrap();
    if std::env::var_os("WORKBOOK_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &json).unwrap();
    }
    let golden = std::fs::read_to_string(&path)
        .expect("tests/golden/report.json (WORKBOOK_BLESS=1 writes it)");
    assert_eq!(json, golden, "the JSON contract changed");
    // And it reads back, every float to the bit: NaN and the infinities
    // included.
    let back: ChapterReport = serde_json::from_str(&golden).unwrap();
    assert!(back.cells[0].metrics["not_a_number"].is_nan());
    assert!(back.cells[1].metrics["loss_gap"].is_nan());
    assert_eq!(back.cells[1].seconds, f64::INFINITY);
    let bits = |r: &ChapterReport| -> Vec<(u64, u64)> {
        r.cells[0].figures[0].series[0]
            .points
            .iter()
            .map(|(x, y)| (x.to_bits(), y.to_bits()))
            .collect()
    };
    assert_eq!(bits(&back), bits(&report));
    assert_eq!(back.cells[0].memory, report.cells[0].memory);
    assert_eq!(back.cells[2], report.cells[2]);
    assert_eq!(back.cells[3], report.cells[3]);
    assert!(back.cells[3]
        .not_run
        .as_deref()
        .unwrap()
        .contains("`mpi` feature"));
    // A cell that ran carries no `not_run` at all.
    assert!(!golden.contains("\"not_run\": null"));
    assert_eq!(back.summary, report.summary);
}

#[test]
fn reports_written_before_non_finite_floats_were_named_still_read() {
    // Metrics were once written with NaN as null.
    let mut old = serde_json::to_value(sample()).unwrap();
    old["cells"][0]["metrics"]["not_a_number"] = serde_json::Value::Null;
    let back: ChapterReport = serde_json::from_value(old).unwrap();
    assert!(back.cells[0].metrics["not_a_number"].is_nan());
}

#[test]
fn a_gpu_report_carries_the_pools_own_figures_and_a_cpu_report_does_not() {
    let mut report = sample();
    let cpu = serde_json::to_value(&report).unwrap();
    assert!(cpu["cells"][0]["memory"].get("pool").is_none());
    assert!(cpu["cells"][0]["memory"]["regions"][0]
        .get("pool")
        .is_none());
    assert_eq!(
        memory_table(&report.cells[0]).columns.last().unwrap().name,
        "after"
    );

    report.device = "cuda:0 (NVIDIA H100 80GB HBM3)".into();
    report.meter = "cuda-pool".into();
    let region_pool = PoolUse {
        baseline: 2_097_152,
        peak: 6_291_456,
        end: 4_194_304,
        reserved: 33_554_432,
    };
    report.cells[0].memory.regions[0].pool = Some(region_pool);
    report.cells[0].memory.pool = Some(PoolUse {
        baseline: 1_048_576,
        ..region_pool
    });
    let gpu = serde_json::to_value(&report).unwrap();
    assert_eq!(
        gpu["cells"][0]["memory"]["pool"],
        serde_json::json!({
            "baseline": 1_048_576, "peak": 6_291_456, "end": 4_194_304, "reserved": 33_554_432
        })
    );
    assert_eq!(
        gpu["cells"][0]["memory"]["regions"][0]["pool"]["peak"],
        6_291_456
    );
    let back: ChapterReport = serde_json::from_value(gpu).unwrap();
    assert_eq!(back.cells[0].memory, report.cells[0].memory);

    // The memory table sets the pool's peak above each start beside the
    // counted one.
    let table = memory_table(&report.cells[0]);
    assert_eq!(table.columns.last().unwrap().name, "pool peak");
    let last = |row: &Vec<serde_json::Value>| row.last().unwrap().as_u64().unwrap();
    assert_eq!(table.rows.len(), 2);
    assert_eq!(last(&table.rows[0]), 4_194_304, "region: 6 MiB - 2 MiB");
    assert_eq!(last(&table.rows[1]), 5_242_880, "cell: 6 MiB - 1 MiB");
}
