//! `workbook new-plugin NAME`: a crate that builds against the SDK and works
//! as it is: a plugin that runs with its default parameters and records
//! metrics, its test, and a chapter that runs it.

use std::path::{Path, PathBuf};

const CARGO_TOML: &str = include_str!("Cargo.toml.in");
const LIB_RS: &str = include_str!("lib.rs.in");
const MAIN_RS: &str = include_str!("main.rs.in");
const TEST_RS: &str = include_str!("test.rs.in");
const CHAPTER: &str = include_str!("chapter.toml.in");

/// The SDK's source in the tree this binary was built from, if it is still
/// there.
pub fn built_sdk() -> Option<PathBuf> {
    let sdk = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/sdk");
    sdk.join("Cargo.toml").is_file().then_some(sdk)
}

/// Whether `name` can name a plugin and its executable.
pub fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
        && name.len() <= 48
}

/// `buffer-size` -> `BufferSizePlugin` (the suffix keeps it clear of the
/// names the crate imports, and of `Params`).
fn type_name(name: &str) -> String {
    let camel: String = name
        .split(['-', '_'])
        .filter(|w| !w.is_empty())
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect();
    camel + "Plugin"
}

/// Writes the crate for plugin `name` into `dir` (which must not exist or
/// be empty), depending on the SDK at `sdk`; `taken` are the names of the
/// plugins already registered. Returns the files written.
pub fn write(name: &str, dir: &Path, sdk: &Path, taken: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    if taken.contains(&name) {
        anyhow::bail!(
            "a plugin named `{name}` exists already (`workbook list` shows the plugins); \
             choose another name"
        );
    }
    if !valid_name(name) {
        anyhow::bail!(
            "plugin name `{}` must be lowercase letters, digits, `-` or `_`, starting with a \
             letter, at most 48 characters (it names the executable workbook-plugin-NAME)",
            crate::excerpt::quote(name)
        );
    }
    if dir.exists()
        && std::fs::read_dir(dir)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        anyhow::bail!(
            "{} exists and is not an empty folder; choose another with --path DIR",
            dir.display()
        );
    }
    let sdk = sdk
        .canonicalize()
        .map_err(|e| anyhow::anyhow!("the SDK folder {}: {e}", sdk.display()))?;
    if !sdk.join("Cargo.toml").is_file() {
        anyhow::bail!(
            "{} holds no Cargo.toml: not the SDK's folder",
            sdk.display()
        );
    }
    let sdk_dep = format!(
        "{{ path = {} }}",
        toml::Value::String(sdk.display().to_string())
    );
    let crate_name = format!("workbook_plugin_{}", name.replace('-', "_"));
    let fill = |t: &str| {
        t.replace("@NAME@", name)
            .replace("@TYPE@", &type_name(name))
            .replace("@CRATE@", &crate_name)
            .replace("@SDK@", &sdk_dep)
    };
    let files = [
        ("Cargo.toml", fill(CARGO_TOML)),
        ("src/lib.rs", fill(LIB_RS)),
        ("src/main.rs", fill(MAIN_RS)),
        ("tests/plugin.rs", fill(TEST_RS)),
        (&format!("chapters/{name}.toml") as &str, fill(CHAPTER)),
    ];
    let mut written = Vec::new();
    for (rel, text) in files {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", parent.display()))?;
        }
        std::fs::write(&path, text)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        written.push(path);
    }
    // The workspace's lock file, where there is one: the plugin builds with
    // the versions of candle the SDK was tested with.
    if let Some(lock) = sdk
        .parent()
        .and_then(Path::parent)
        .map(|r| r.join("Cargo.lock"))
    {
        if lock.is_file() {
            let path = dir.join("Cargo.lock");
            std::fs::copy(&lock, &path)
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
            written.push(path);
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_types_and_bad_names_are_refused() {
        assert_eq!(type_name("buffer-size"), "BufferSizePlugin");
        assert_eq!(type_name("kv_cache2"), "KvCache2Plugin");
        assert_eq!(type_name("params"), "ParamsPlugin");
        assert!(valid_name("kv-cache"));
        for bad in ["", "Kv", "2kv", "kv cache", "kv/cache", &"k".repeat(49)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
