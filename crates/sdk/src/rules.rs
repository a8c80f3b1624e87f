//! What a plugin's parameters may be, checked before anything runs.
//!
//! Types are checked by serde when the chapter is read; values are checked
//! by [`Plugin::validate`](crate::Plugin::validate), which a plugin writes
//! with [`Rules`]: ranges, non-empty lists, relations between parameters,
//! allowed names, and sizes whose products must stay within what a machine
//! could hold. `workbook validate` (and `workbook run`, before the first
//! cell) reports every violation in a chapter, each with where it is.

use std::fmt;

/// One parameter value that is not allowed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Violation {
    /// The parameter (`batch`), or an element of one (`steps[2]`), or a
    /// relation named by its first parameter.
    pub field: String,
    /// What was given.
    pub given: String,
    /// What is allowed.
    pub allowed: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "is {}; {}", self.given, self.allowed)
    }
}

/// The most elements one tensor of a cell may have: 2^40, four TiB of f32.
/// Far above any machine's memory, so only sizes that could never run (and
/// whose products would overflow) are refused here; what does not fit the
/// machine at hand is the memory cap's to refuse.
pub const MAX_ELEMENTS: u64 = 1 << 40;

/// Collects the violations of a parameter set.
#[derive(Debug, Default)]
pub struct Rules {
    violations: Vec<Violation>,
}

impl Rules {
    /// No violations yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a violation.
    pub fn violation(
        &mut self,
        field: impl Into<String>,
        given: impl Into<String>,
        allowed: impl Into<String>,
    ) -> &mut Self {
        self.violations.push(Violation {
            field: field.into(),
            given: given.into(),
            allowed: allowed.into(),
        });
        self
    }

    /// `value >= min`.
    pub fn at_least(&mut self, field: &str, value: usize, min: usize) -> &mut Self {
        if value < min {
            self.violation(field, value.to_string(), format!("allowed: at least {min}"));
        }
        self
    }

    /// `min <= value <= max`.
    pub fn between(&mut self, field: &str, value: usize, min: usize, max: usize) -> &mut Self {
        if value < min || value > max {
            self.violation(
                field,
                value.to_string(),
                format!("allowed: from {min} to {max}"),
            );
        }
        self
    }

    /// A list with at least `min` entries, each at least `each_min`.
    pub fn list(
        &mut self,
        field: &str,
        values: &[usize],
        min: usize,
        each_min: usize,
    ) -> &mut Self {
        if values.len() < min {
            self.violation(
                field,
                format!("{values:?}"),
                format!(
                    "allowed: a list of at least {min} {}",
                    if min == 1 { "entry" } else { "entries" }
                ),
            );
        }
        for (i, &v) in values.iter().enumerate() {
            self.at_least(&format!("{field}[{i}]"), v, each_min);
        }
        self
    }

    /// A finite number above zero.
    pub fn positive(&mut self, field: &str, value: f64) -> &mut Self {
        if !(value.is_finite() && value > 0.0) {
            self.violation(field, value.to_string(), "allowed: a finite number above 0");
        }
        self
    }

    /// A finite number in `[min, max]`.
    pub fn within(&mut self, field: &str, value: f64, min: f64, max: f64) -> &mut Self {
        if !(value.is_finite() && value >= min && value <= max) {
            self.violation(
                field,
                value.to_string(),
                format!("allowed: a finite number from {min} to {max}"),
            );
        }
        self
    }

    /// One of `allowed`.
    pub fn one_of(&mut self, field: &str, value: &str, allowed: &[&str]) -> &mut Self {
        if !allowed.contains(&value) {
            self.violation(
                field,
                format!("{value:?}"),
                format!("allowed: one of {}", allowed.join(", ")),
            );
        }
        self
    }

    /// The product of `sizes` (the elements of one tensor, say) is at most
    /// [`MAX_ELEMENTS`]; `what` names the product, as `batch × width`.
    pub fn elements(&mut self, field: &str, what: &str, sizes: &[u64]) -> &mut Self {
        let product = sizes
            .iter()
            .try_fold(1u64, |acc, &s| acc.checked_mul(s))
            .filter(|&p| p <= MAX_ELEMENTS);
        if product.is_none() {
            let given = sizes
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(" × ");
            self.violation(
                field,
                format!("{what} = {given}"),
                format!("allowed: a product of at most {MAX_ELEMENTS} elements (2^40)"),
            );
        }
        self
    }

    /// The widths of a multilayer perceptron run on `batch` rows: at least
    /// two, each at least 1, and each layer's weight and activations within
    /// [`MAX_ELEMENTS`].
    pub fn widths(&mut self, field: &str, widths: &[usize], batch: usize) -> &mut Self {
        self.list(field, widths, 2, 1);
        for pair in widths.windows(2) {
            self.elements(field, "a layer's weight", &[pair[0] as u64, pair[1] as u64]);
        }
        for &w in widths {
            self.elements(field, "batch × width", &[batch as u64, w as u64]);
        }
        self
    }

    /// Records `allowed` against `field` when `ok` is false.
    pub fn require(&mut self, ok: bool, field: &str, given: String, allowed: &str) -> &mut Self {
        if !ok {
            self.violation(field, given, allowed.to_string());
        }
        self
    }

    /// The violations found.
    pub fn into_violations(self) -> Vec<Violation> {
        self.violations
    }
}

/// A memory floor (see `Plugin::memory_floor`): the f32 outputs of `depth`
/// layers of `batch` × `width`, which a forward keeps for the backward;
/// `kept` says by what, as `the plain stack keeps`.
pub fn f32_outputs_floor(
    kept: &str,
    depth: usize,
    batch: usize,
    width: usize,
) -> Option<(u64, String)> {
    let bytes = (depth as u64)
        .checked_mul(batch as u64)?
        .checked_mul(width as u64)?
        .checked_mul(4)?;
    Some((
        bytes,
        format!("the f32 outputs {kept}, {depth} × {batch} × {width}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rule_says_what_was_given_and_what_is_allowed() {
        let mut r = Rules::new();
        r.at_least("batch", 0, 1)
            .between("k", 9, 1, 8)
            .list("steps", &[2, 0], 1, 1)
            .list("widths", &[], 2, 1)
            .positive("lr", f64::NAN)
            .within("noise", 1.5, 0.0, 1.0)
            .one_of("dtypes[0]", "fp16", &["f32", "f16", "bf16"])
            .elements("batch", "batch × width", &[u64::MAX, 2])
            .elements("fine", "a × b", &[1 << 20, 1 << 20]);
        let said: Vec<String> = r
            .into_violations()
            .iter()
            .map(|v| format!("{}: {v}", v.field))
            .collect();
        assert_eq!(
            said,
            [
                "batch: is 0; allowed: at least 1",
                "k: is 9; allowed: from 1 to 8",
                "steps[1]: is 0; allowed: at least 1",
                "widths: is []; allowed: a list of at least 2 entries",
                "lr: is NaN; allowed: a finite number above 0",
                "noise: is 1.5; allowed: a finite number from 0 to 1",
                "dtypes[0]: is \"fp16\"; allowed: one of f32, f16, bf16",
                "batch: is batch × width = 18446744073709551615 × 2; allowed: a product of at \
                 most 1099511627776 elements (2^40)",
            ]
        );
    }
}
