//! The rank counts a cell runs: the chapter's list, checked once for both
//! of chapter 4's plugins, and the count `workbook run --ranks N` adds.

use workbook_sdk::{anyhow, Rules};

/// The most ranks a cell may ask for (`--ranks` included).
pub const MAX_RANKS: usize = 64;

/// `n` ranks, as a message says it: "1 rank", "2 ranks".
pub fn ranks(n: usize) -> String {
    if n == 1 {
        "1 rank".to_owned()
    } else {
        format!("{n} ranks")
    }
}

/// How a cell splits its batch over the ranks, which sets the counts it
/// can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Rows, as evenly as they go, each rank's loss weighted by its rows:
    /// any count up to the batch's rows.
    Rows(usize),
    /// Whole sequences, as many on every rank: a count that divides them.
    Sequences(usize),
}

impl Split {
    /// What the chapter's list allows in place of `n`, where `n` ranks
    /// cannot split the batch.
    fn refusal(self, n: usize) -> Option<String> {
        match self {
            Split::Rows(b) if n > b => Some(format!(
                "allowed: at most the batch, {b} rows (each rank trains on one row at least)"
            )),
            Split::Sequences(b) if n > 0 && !b.is_multiple_of(n) => Some(format!(
                "allowed: a count that divides the batch of {b} sequences (each rank trains on \
                 as many)"
            )),
            _ => None,
        }
    }

    /// Why `--ranks n` cannot split this cell's batch, if it cannot.
    fn flag_refusal(self, n: usize) -> Option<String> {
        self.refusal(n)?;
        Some(match self {
            Split::Rows(b) => format!(
                "--ranks is {n}, more than this cell's batch of {b} rows; allowed: at most {b} \
                 (each rank trains on one row at least)"
            ),
            Split::Sequences(b) => format!(
                "--ranks is {n}, which does not divide this cell's batch of {b} sequences; \
                 allowed: a count that divides it (each rank trains on as many)"
            ),
        })
    }
}

/// Checks a cell's `field` list of rank counts: one at least, each from 1
/// to [`MAX_RANKS`], each splitting the batch as `split` does, none twice.
pub fn check(r: &mut Rules, field: &str, ranks: &[usize], split: Split) {
    r.list(field, ranks, 1, 1);
    for (i, &n) in ranks.iter().enumerate() {
        let at = format!("{field}[{i}]");
        if n > MAX_RANKS {
            r.violation(at, n.to_string(), format!("allowed: at most {MAX_RANKS}"));
        } else if let Some(allowed) = split.refusal(n) {
            r.violation(at, n.to_string(), allowed);
        } else if let Some(j) = ranks[..i].iter().position(|&m| m == n) {
            r.violation(
                at,
                n.to_string(),
                format!("allowed: a count not listed before ({field}[{j}] is {n})"),
            );
        }
    }
}

/// The counts a cell runs, in increasing order: its own `ranks`, and the
/// one `workbook run --ranks N` adds (passed on as `WORKBOOK_RANKS`) where
/// it splits the batch. Where it does not, the second value says why: the
/// cell's error once its own counts have run.
pub fn with_flag(ranks: &[usize], split: Split) -> anyhow::Result<(Vec<usize>, Option<String>)> {
    let mut counts = ranks.to_vec();
    let mut refused = None;
    if let Ok(text) = std::env::var("WORKBOOK_RANKS") {
        let n: usize = text.trim().parse().map_err(|_| {
            anyhow::anyhow!("--ranks is `{text}`; expected a whole number of ranks")
        })?;
        if n == 0 || n > MAX_RANKS {
            anyhow::bail!("--ranks is {n}; allowed: 1 to {MAX_RANKS}");
        }
        match split.flag_refusal(n) {
            Some(why) => refused = Some(why),
            None => counts.push(n),
        }
    }
    counts.sort_unstable();
    counts.dedup();
    Ok((counts, refused))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusals(ranks: &[usize], split: Split) -> Vec<String> {
        let mut r = Rules::new();
        check(&mut r, "ranks", ranks, split);
        r.into_violations()
            .iter()
            .map(|v| format!("{}: {} ({})", v.field, v.given, v.allowed))
            .collect()
    }

    #[test]
    fn a_count_listed_twice_is_refused_with_where_it_was_first() {
        assert_eq!(
            refusals(&[2, 4, 2], Split::Sequences(8)),
            ["ranks[2]: 2 (allowed: a count not listed before (ranks[0] is 2))"]
        );
        assert_eq!(
            refusals(&[3, 3], Split::Rows(8)),
            ["ranks[1]: 3 (allowed: a count not listed before (ranks[0] is 3))"]
        );
    }

    #[test]
    fn rows_take_any_count_up_to_the_batch_and_sequences_a_divisor() {
        assert_eq!(refusals(&[1, 3, 8], Split::Rows(8)), Vec::<String>::new());
        assert_eq!(
            refusals(&[9], Split::Rows(8)),
            [
                "ranks[0]: 9 (allowed: at most the batch, 8 rows (each rank trains on one row at \
              least))"
            ]
        );
        assert_eq!(
            refusals(&[1, 2, 4, 8], Split::Sequences(8)),
            Vec::<String>::new()
        );
        assert_eq!(
            refusals(&[16], Split::Sequences(8)),
            [
                "ranks[0]: 16 (allowed: a count that divides the batch of 8 sequences (each rank \
              trains on as many))"
            ]
        );
    }

    #[test]
    fn the_flags_refusal_names_the_flag_and_the_batch() {
        assert_eq!(Split::Rows(8).flag_refusal(8), None);
        assert_eq!(
            Split::Rows(8).flag_refusal(9).unwrap(),
            "--ranks is 9, more than this cell's batch of 8 rows; allowed: at most 8 (each \
             rank trains on one row at least)"
        );
        assert_eq!(Split::Sequences(8).flag_refusal(4), None);
        assert_eq!(
            Split::Sequences(8).flag_refusal(16).unwrap(),
            "--ranks is 16, which does not divide this cell's batch of 8 sequences; allowed: \
             a count that divides it (each rank trains on as many)"
        );
    }
}
