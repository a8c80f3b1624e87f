//! The plugin registry: names to plugins, in the order they were added.

use indexmap::IndexMap;
use workbook_sdk::DynPlugin;

/// Two plugins under one name.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("a plugin named `{0}` is already registered")]
pub struct DuplicatePlugin(pub String);

/// Plugins by name, in insertion order.
#[derive(Default)]
pub struct Registry {
    plugins: IndexMap<String, Box<dyn DynPlugin>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.plugins.keys()).finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The registry of the built-in cell kinds.
    pub fn builtin() -> Self {
        let mut r = Self::new();
        for p in builtin_plugins() {
            r.add(p).expect("built-in plugin names are distinct");
        }
        r
    }

    /// Adds a plugin; a name already taken is an error.
    pub fn add(&mut self, plugin: Box<dyn DynPlugin>) -> Result<&mut Self, DuplicatePlugin> {
        let name = plugin.name().to_string();
        if self.plugins.contains_key(&name) {
            return Err(DuplicatePlugin(name));
        }
        self.plugins.insert(name, plugin);
        Ok(self)
    }

    /// The plugin of that name.
    pub fn get(&self, name: &str) -> Option<&dyn DynPlugin> {
        self.plugins.get(name).map(|p| p.as_ref())
    }

    /// The registered names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.plugins.keys().map(String::as_str).collect()
    }

    /// The plugins, in order.
    pub fn iter(&self) -> impl Iterator<Item = &dyn DynPlugin> {
        self.plugins.values().map(|p| p.as_ref())
    }
}

fn builtin_plugins() -> Vec<Box<dyn DynPlugin>> {
    vec![
        Box::new(workbook_footprint::Footprint),
        Box::new(workbook_accumulation::Accumulation),
        Box::new(workbook_checkpointing::Checkpointing),
        Box::new(workbook_precision::Precision),
        Box::new(workbook_offload::Offload),
        Box::new(workbook_attention::AttentionCell),
    ]
}
