//! What an experiment's source must satisfy to be shown as notebook cells:
//! no cell names an item only a later cell defines (the kernel runs them in
//! order), and no two experiments of a chapter define one name (a notebook
//! keeps the last).

use std::collections::HashMap;

use workbook_sdk::NotebookSource;

/// The names a `use` tree imports, each with the path it imports
/// (`prefix` is the path above `tree`).
fn flatten(tree: &syn::UseTree, prefix: String, out: &mut Vec<(String, String)>) {
    let join = |name: String| {
        if prefix.is_empty() {
            name
        } else {
            format!("{prefix}::{name}")
        }
    };
    match tree {
        syn::UseTree::Path(p) => flatten(&p.tree, join(p.ident.to_string()), out),
        // `use a::{self}` names `a` itself.
        syn::UseTree::Name(n) if n.ident == "self" => {
            let last = prefix.rsplit("::").next().unwrap_or_default();
            out.push((last.to_string(), prefix.clone()))
        }
        syn::UseTree::Name(n) => out.push((n.ident.to_string(), join(n.ident.to_string()))),
        syn::UseTree::Rename(r) if r.ident == "self" => {
            out.push((r.rename.to_string(), prefix.clone()))
        }
        syn::UseTree::Rename(r) => out.push((r.rename.to_string(), join(r.ident.to_string()))),
        syn::UseTree::Glob(_) => out.push((join("*".into()), join("*".into()))),
        syn::UseTree::Group(g) => g.items.iter().for_each(|t| flatten(t, prefix.clone(), out)),
    }
}

/// The experiment's whole text ([`NotebookSource::text`]) and its items.
fn parse(source: &NotebookSource) -> anyhow::Result<(String, syn::File)> {
    let text = source.text()?;
    let file = syn::parse_file(&text).map_err(|e| {
        let (file, line) = source.place(e.span().start().line);
        anyhow::anyhow!(
            "the experiment of {} does not parse: {e} ({}line {line}, column {})",
            source.package,
            file.map(|f| format!("{f} ")).unwrap_or_default(),
            e.span().start().column + 1
        )
    })?;
    Ok((text, file))
}

/// The name a top-level item other than a `use` defines, if it names one.
fn item_name(item: &syn::Item) -> Option<(&syn::Ident, &'static str)> {
    Some(match item {
        syn::Item::Fn(f) => (&f.sig.ident, "fn"),
        syn::Item::Struct(i) => (&i.ident, "struct"),
        syn::Item::Enum(i) => (&i.ident, "enum"),
        syn::Item::Const(i) => (&i.ident, "const"),
        syn::Item::Static(i) => (&i.ident, "static"),
        syn::Item::Type(i) => (&i.ident, "type"),
        syn::Item::Trait(i) => (&i.ident, "trait"),
        syn::Item::Mod(i) => (&i.ident, "mod"),
        syn::Item::Union(i) => (&i.ident, "union"),
        _ => return None,
    })
}

/// Refuses an experiment one of whose notebook cells names an item that
/// only a later cell defines. The crate sees the whole file and builds; the
/// kernel runs the cells in order, and there the earlier cell does not
/// compile ("cannot find function"). Within a cell, order is free.
///
/// Names are read from the tokens, leaving out those that cannot name an
/// item: after a `.` (a method or field), before a lone `:` (a field or a
/// binding's type) and after `let` or `mut`.
pub(super) fn check_cell_order(source: &NotebookSource) -> anyhow::Result<()> {
    use proc_macro2::{Spacing, TokenStream, TokenTree};
    use workbook_sdk::notebook::{CELL_BREAK, EXERCISE_BREAK};

    fn named(stream: TokenStream, out: &mut Vec<(String, usize)>) {
        let tokens: Vec<TokenTree> = stream.into_iter().collect();
        let punct = |t: Option<&TokenTree>, c: char, alone: bool| {
            matches!(t, Some(TokenTree::Punct(p))
                if p.as_char() == c && (!alone || p.spacing() == Spacing::Alone))
        };
        for (k, token) in tokens.iter().enumerate() {
            match token {
                TokenTree::Group(g) => named(g.stream(), out),
                TokenTree::Ident(ident) => {
                    let before = k.checked_sub(1).and_then(|b| tokens.get(b));
                    let binding =
                        matches!(before, Some(TokenTree::Ident(b)) if b == "let" || b == "mut");
                    let colon = punct(tokens.get(k + 1), ':', true) && !punct(before, ':', false);
                    if !binding && !colon && !punct(before, '.', false) {
                        out.push((ident.to_string(), ident.span().start().line));
                    }
                }
                _ => {}
            }
        }
    }

    let (text, file) = parse(source)?;
    // The lines of the breaks: the cell of a line is how many come before it.
    let breaks: Vec<usize> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| matches!(l.trim(), CELL_BREAK | EXERCISE_BREAK))
        .map(|(i, _)| i + 1)
        .collect();
    let cell_of = |line: usize| breaks.partition_point(|&b| b < line);
    let mut defined: HashMap<String, usize> = HashMap::new();
    for item in &file.items {
        let (names, line) = match item {
            syn::Item::Use(u) => {
                let mut imported = Vec::new();
                flatten(&u.tree, String::new(), &mut imported);
                let names = imported.into_iter().map(|(name, _)| name).collect();
                (names, u.use_token.span.start().line)
            }
            other => match item_name(other) {
                Some((ident, _)) => (vec![ident.to_string()], ident.span().start().line),
                None => continue,
            },
        };
        for name in names {
            defined.entry(name).or_insert(line);
        }
    }
    let tokens: TokenStream = text
        .parse()
        .map_err(|e| anyhow::anyhow!("the experiment of {} does not parse: {e}", source.package))?;
    let mut uses = Vec::new();
    named(tokens, &mut uses);
    for (name, line) in uses {
        if let Some(&at) = defined.get(&name) {
            if cell_of(at) > cell_of(line) {
                let (file, at) = source.place(at);
                let why = format!(
                    "`{name}` is defined in a later notebook cell ({}line {at}): the kernel runs \
                     the cells in order, so move it into this cell or an earlier one, or move \
                     this use after it",
                    file.map(|f| format!("{f} ")).unwrap_or_default()
                );
                return Err(source.error_at(line, &why).into());
            }
        }
    }
    Ok(())
}

/// What a source's top-level items define, by name: each `use` name with
/// the path it imports, each other item with its text. A notebook keeps
/// items by name, so two experiments may share a name only for the same
/// import.
///
/// A `use` must start at a crate a notebook cell can name: `std`, `core`,
/// `alloc`, or one of `crates` (the crates of this source tree the plugin
/// depends on, its own included), never at `crate`, `self` or `super`.
fn names(source: &NotebookSource, crates: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    let (_, file) = parse(source)?;
    let mut out = Vec::new();
    for item in &file.items {
        let (ident, text) = match item {
            syn::Item::Use(u) => {
                let first = out.len();
                flatten(&u.tree, String::new(), &mut out);
                for (_, path) in &out[first..] {
                    let root = path.split("::").next().unwrap_or_default();
                    if matches!(root, "crate" | "self" | "super") {
                        anyhow::bail!(
                            "the experiment of {} uses `{path}`: a notebook cell has no crate of \
                             its own, so name the plugin's crate by its name instead of `{root}`",
                            source.package
                        );
                    }
                    let known = matches!(root, "std" | "core" | "alloc")
                        || crates.iter().any(|c| c.replace('-', "_") == root);
                    if !known {
                        anyhow::bail!(
                            "the experiment of {} uses `{path}`, but `{root}` is not a crate of \
                             this source tree that it depends on, which is what a notebook can \
                             add; use it through one of those ({})",
                            source.package,
                            crates.join(", ")
                        );
                    }
                }
                continue;
            }
            other => match item_name(other) {
                Some(named) => named,
                None => continue,
            },
        };
        // Defined by this experiment: equal to no other's.
        out.push((
            ident.to_string(),
            format!("{text} of {} ({})", source.package, source.entry),
        ));
    }
    Ok(out)
}

/// Refuses experiments that define one name twice, which a notebook would
/// keep only the last of.
pub(super) fn check_names(
    sources: &[NotebookSource],
    crates_of: impl Fn(&NotebookSource) -> anyhow::Result<Vec<String>>,
) -> anyhow::Result<()> {
    let mut seen: HashMap<String, (String, &NotebookSource)> = HashMap::new();
    for source in sources {
        for (name, what) in names(source, &crates_of(source)?)? {
            match seen.get(&name) {
                Some((other, first)) if *other != what && *first != source => {
                    anyhow::bail!(
                        "the experiments of {} ({}) and {} ({}) both define `{name}` ({other}; \
                         {what}): a notebook keeps one item per name, so give one of them \
                         another name",
                        first.package,
                        first.entry,
                        source.package,
                        source.entry
                    )
                }
                Some(_) => {}
                None => {
                    seen.insert(name, (what, source));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(package: &'static str, text: &'static str) -> NotebookSource {
        NotebookSource {
            package,
            dir: "/nowhere",
            plugin: "x::X",
            entry: "run",
            params: "Params",
            source: text,
            parts: &[],
        }
    }

    #[test]
    fn a_cell_may_not_name_what_only_a_later_cell_defines() {
        // Within a cell any order; a method, a field or a binding of the
        // same name is not the item.
        let fine = source(
            "a",
            "//! Docs.\nuse std::time::Instant;\n// notebook cell\n\
             pub fn run(p: Params) { helper(); p.figure(); let s = S { figure: 1 }; \
             let mut figure = 2; }\nfn helper() { let _ = Instant::now(); }\n\
             // notebook cell\npub fn figure() {}\n",
        );
        check_cell_order(&fine).unwrap();

        let early = source(
            "a",
            "// notebook cell\npub fn sweep() {\n    segments_figure();\n}\n\
             // notebook cell\nfn segments_figure() {}\n",
        );
        let err = check_cell_order(&early).unwrap_err().to_string();
        assert_eq!(
            err,
            "a's experiment, line 3: `segments_figure` is defined in a later notebook cell \
             (line 6): the kernel runs the cells in order, so move it into this cell or an \
             earlier one, or move this use after it"
        );
        // A type and an import count as well, and a part is named.
        let typed = source(
            "a",
            "// notebook cell\nfn run(r: Report) {}\n// notebook cell\nstruct Report;\n",
        );
        assert!(check_cell_order(&typed)
            .unwrap_err()
            .to_string()
            .starts_with(
                "a's experiment, line 2: `Report` is defined in a later notebook cell (line 4)"
            ));
        let imported = NotebookSource {
            parts: &[(
                "experiment/late.rs",
                "// notebook cell\nuse std::time::Instant;\n",
            )],
            ..source(
                "a",
                "fn run() { Instant::now(); }\ninclude!(\"experiment/late.rs\");\n",
            )
        };
        assert!(check_cell_order(&imported)
            .unwrap_err()
            .to_string()
            .starts_with(
                "a's experiment, line 1: `Instant` is defined in a later notebook cell \
                 (experiment/late.rs line 2)"
            ));
    }

    #[test]
    fn experiments_share_imports_but_no_other_name() {
        let a = source(
            "a",
            "use std::time::{Duration, Instant};\nuse a::Params as AParams;\n\
             pub fn median() {}\npub fn a_experiment() {}\n",
        );
        let b = source(
            "b",
            "use std::time::Instant;\nuse b::Params as BParams;\npub fn b_experiment() {}\n",
        );
        let crates = |_: &NotebookSource| Ok(vec!["a".into(), "b".into(), "c".into(), "d".into()]);
        check_names(&[a, b], crates).unwrap();

        let same_fn = source("c", "pub fn median() {}\n");
        assert_eq!(
            check_names(&[a, same_fn], crates).unwrap_err().to_string(),
            "the experiments of a (run) and c (run) both define `median` (fn of a (run); fn of \
             c (run)): a notebook keeps one item per name, so give one of them another name"
        );
        // Two experiments of one package are two experiments.
        let sibling = NotebookSource {
            entry: "other",
            ..source("a", "pub fn median() {}\n")
        };
        assert_eq!(
            check_names(&[a, sibling], crates).unwrap_err().to_string(),
            "the experiments of a (run) and a (other) both define `median` (fn of a (run); fn \
             of a (other)): a notebook keeps one item per name, so give one of them another name"
        );
        let other_import = source("d", "use d::Params as AParams;\n");
        assert_eq!(
            check_names(&[a, other_import], crates)
                .unwrap_err()
                .to_string(),
            "the experiments of a (run) and d (run) both define `AParams` (a::Params; \
             d::Params): a notebook keeps one item per name, so give one of them another name"
        );
        let broken = source("e", "pub fn (\n");
        let err = check_names(&[broken], crates).unwrap_err().to_string();
        assert!(
            err.starts_with("the experiment of e does not parse: ") && err.contains("line 1"),
            "{err}"
        );
        // `use a::{self}` names `a`; two experiments may both import it.
        let whole = source("a", "use c::{self, Thing};\n");
        let again = source("b", "use c;\n");
        check_names(&[whole, again], crates).unwrap();
        let clash = source("b", "use d as c;\n");
        assert!(check_names(&[whole, clash], crates)
            .unwrap_err()
            .to_string()
            .contains("both define `c` (c; d)"));
        // Only crates a notebook can add.
        let relative = source("a", "use crate::Params;\n");
        assert_eq!(
            check_names(&[relative], crates).unwrap_err().to_string(),
            "the experiment of a uses `crate::Params`: a notebook cell has no crate of its own, \
             so name the plugin's crate by its name instead of `crate`"
        );
        let foreign = source("a", "use serde::Serialize;\n");
        assert_eq!(
            check_names(&[foreign], crates).unwrap_err().to_string(),
            "the experiment of a uses `serde::Serialize`, but `serde` is not a crate of this \
             source tree that it depends on, which is what a notebook can add; use it through \
             one of those (a, b, c, d)"
        );
    }
}
