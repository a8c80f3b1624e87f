//! "Did you mean": the closest of a set of names to one that is not there.

/// The names of `candidates` closest to `given`, most alike first, at most
/// three. Close is as rustc has it: at most one edit (an insertion, a
/// deletion, a substitution or a swap of neighbours) per three characters.
pub fn closest<'a>(given: &str, candidates: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let most = (given.chars().count() / 3).max(1);
    let mut scored: Vec<(usize, &str)> = candidates
        .into_iter()
        .filter(|c| *c != given)
        .map(|c| (strsim::damerau_levenshtein(given, c), c))
        .filter(|(edits, _)| *edits <= most)
        .collect();
    scored.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(b.1)));
    scored.dedup_by(|a, b| a.1 == b.1);
    scored.into_iter().take(3).map(|(_, c)| c).collect()
}

/// `; did you mean `a`?` (or `` `a` or `b` ``), or nothing when no
/// candidate is close.
pub fn did_you_mean<'a>(given: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    offer(&closest(given, candidates))
}

/// `; did you mean `a`?` (or `` `a` or `b` ``) for names chosen by the
/// caller, or nothing for none.
pub fn offer(near: &[&str]) -> String {
    if near.is_empty() {
        return String::new();
    }
    let quoted: Vec<String> = near.iter().map(|n| format!("`{n}`")).collect();
    format!("; did you mean {}?", quoted.join(" or "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_misspelling_finds_its_name_and_nothing_else_is_offered() {
        let names = ["peak_plain", "peak_checkpointed", "time_plain"];
        assert_eq!(closest("peak_plian", names), vec!["peak_plain"]);
        assert_eq!(
            did_you_mean("peak_plian", names),
            "; did you mean `peak_plain`?"
        );
        assert_eq!(did_you_mean("throughput", names), "");
        assert_eq!(did_you_mean("peak_plain", ["peak_plain"]), "");
    }

    #[test]
    fn several_close_names_are_offered_most_alike_first() {
        assert_eq!(
            closest("chapter", ["chapter2", "chapter3", "appendix"]),
            vec!["chapter2", "chapter3"]
        );
    }
}
