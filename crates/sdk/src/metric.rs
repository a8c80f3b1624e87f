//! The metrics a plugin declares: what `workbook describe` prints, what
//! `workbook validate` checks assertions against, and what the runner holds
//! a plugin's records to.

use serde::{Deserialize, Serialize};

use crate::output::Unit;

/// A metric a plugin records.
///
/// A name may hold placeholders in braces for the parts that vary with the
/// parameters: `peak_{method}` stands for `peak_naive`, `peak_tiled`, ... A
/// placeholder matches one or more letters, digits or underscores.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricSpec {
    /// The name, or a pattern of names (`peak_{method}`).
    pub name: String,
    /// What it measures.
    pub unit: Unit,
    /// One line on what it is.
    pub meaning: String,
}

impl MetricSpec {
    /// A metric in `unit`.
    pub fn new(name: impl Into<String>, unit: Unit, meaning: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            unit,
            meaning: meaning.into(),
        }
    }

    /// A number of bytes.
    pub fn bytes(name: impl Into<String>, meaning: impl Into<String>) -> Self {
        Self::new(name, Unit::Bytes, meaning)
    }

    /// A duration in seconds.
    pub fn seconds(name: impl Into<String>, meaning: impl Into<String>) -> Self {
        Self::new(name, Unit::Seconds, meaning)
    }

    /// A ratio (1.0 = equal).
    pub fn ratio(name: impl Into<String>, meaning: impl Into<String>) -> Self {
        Self::new(name, Unit::Ratio, meaning)
    }

    /// A count of things.
    pub fn count(name: impl Into<String>, meaning: impl Into<String>) -> Self {
        Self::new(name, Unit::Count, meaning)
    }

    /// A plain number (a difference, an exponent, a loss).
    pub fn number(name: impl Into<String>, meaning: impl Into<String>) -> Self {
        Self::new(name, Unit::None, meaning)
    }

    /// Whether `metric` is this metric, or one of the names its pattern
    /// stands for.
    pub fn matches(&self, metric: &str) -> bool {
        matches_pattern(self.name.as_bytes(), metric.as_bytes())
    }
}

fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Matches `name` against `pattern`, where `{...}` stands for one or more
/// word characters. Backtracking over a placeholder's length: patterns and
/// names are short.
fn matches_pattern(pattern: &[u8], name: &[u8]) -> bool {
    match pattern.first() {
        None => name.is_empty(),
        Some(b'{') => {
            let Some(close) = pattern.iter().position(|&b| b == b'}') else {
                return pattern == name;
            };
            let rest = &pattern[close + 1..];
            (1..=name.len())
                .take_while(|&n| is_word(name[n - 1]))
                .any(|n| matches_pattern(rest, &name[n..]))
        }
        Some(&c) => name.first() == Some(&c) && matches_pattern(&pattern[1..], &name[1..]),
    }
}

/// The metrics of `recorded` that none of `declared` matches.
pub fn undeclared<'a>(
    declared: &[MetricSpec],
    recorded: impl IntoIterator<Item = &'a str>,
) -> Vec<&'a str> {
    recorded
        .into_iter()
        .filter(|m| !declared.iter().any(|d| d.matches(m)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_match_themselves_only() {
        let m = MetricSpec::bytes("peak_plain", "");
        assert!(m.matches("peak_plain"));
        assert!(!m.matches("peak_plain2"));
        assert!(!m.matches("peak_plai"));
        assert!(!m.matches(""));
    }

    #[test]
    fn a_placeholder_stands_for_one_or_more_word_characters() {
        let m = MetricSpec::bytes("peak_{method}", "");
        assert!(m.matches("peak_tiled"));
        assert!(m.matches("peak_tiled_causal"));
        assert!(!m.matches("peak_"));
        assert!(!m.matches("time_tiled"));
        let mid = MetricSpec::ratio("step_ratio_{key}_vs_{other}", "");
        assert!(mid.matches("step_ratio_a_b_vs_c"));
        assert!(!mid.matches("step_ratio_a_vs_"));
        assert!(!mid.matches("step_ratio_a vs_c"));
    }

    #[test]
    fn undeclared_lists_what_no_pattern_covers() {
        let declared = [
            MetricSpec::bytes("peak_{method}", ""),
            MetricSpec::number("loss", ""),
        ];
        assert_eq!(
            undeclared(&declared, ["peak_naive", "loss", "lost", "time_naive"]),
            vec!["lost", "time_naive"]
        );
    }
}
