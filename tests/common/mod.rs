//! What the tests of the binary share.

// Each test crate compiles this module and uses part of it.
#![allow(dead_code)]

use std::process::Output;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Chapter 2's cells, in order: the techniques, then the exercises.
pub const CELLS: [&str; 8] = [
    "footprint",
    "accumulation",
    "checkpointing",
    "precision",
    "offload",
    "attention",
    "exercise-policy",
    "exercise-fit",
];

/// Chapter 2 times its techniques against each other: a test that runs it
/// whole has the machine to itself (`heavy`), the others share it (`light`).
static MACHINE: RwLock<()> = RwLock::new(());

/// The machine to this test alone.
pub fn heavy() -> RwLockWriteGuard<'static, ()> {
    MACHINE.write().unwrap_or_else(|e| e.into_inner())
}

/// The machine shared with other light tests.
pub fn light() -> RwLockReadGuard<'static, ()> {
    MACHINE.read().unwrap_or_else(|e| e.into_inner())
}

/// A finished process's stdout and stderr, as text.
pub fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}
