//! The plugin registry: names to plugins, in the order they were added,
//! built-in and external ([`crate::external`]) alike.

use std::path::{Path, PathBuf};

use indexmap::IndexMap;
use workbook_sdk::DynPlugin;

use crate::external::{ExternalError, ExternalPlugin};

/// Two plugins under one name.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DuplicatePlugin {
    /// Two plugins registered in a program under one name.
    #[error("a plugin named `{0}` is already registered")]
    Registered(String),
    /// An external plugin with a built-in plugin's name.
    #[error(
        "plugin `{name}` is both built in and an external program ({program}); rename or \
         remove the external one"
    )]
    External {
        /// The name.
        name: String,
        /// The external program.
        program: PathBuf,
    },
}

struct Entry {
    plugin: Box<dyn DynPlugin>,
    /// The program that runs its cells, for an external plugin.
    program: Option<PathBuf>,
}

/// Plugins by name, in insertion order.
#[derive(Default)]
pub struct Registry {
    plugins: IndexMap<String, Entry>,
    /// External plugins found but unusable, by name.
    broken: IndexMap<String, ExternalError>,
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
            return Err(DuplicatePlugin::Registered(name));
        }
        self.plugins.insert(
            name,
            Entry {
                plugin,
                program: None,
            },
        );
        Ok(self)
    }

    /// Adds the external plugins found in `dirs` (see
    /// [`crate::external::discover`]). One that cannot describe itself is
    /// kept aside, to be named when a chapter uses it; one with the name of
    /// a plugin already here is an error naming both.
    pub fn add_external(&mut self, dirs: &[PathBuf]) -> Result<&mut Self, DuplicatePlugin> {
        for (name, program) in crate::external::discover(dirs) {
            if self.plugins.contains_key(&name) {
                return Err(DuplicatePlugin::External { name, program });
            }
            match ExternalPlugin::load(&name, &program) {
                Ok(plugin) => {
                    self.plugins.insert(
                        name,
                        Entry {
                            plugin: Box::new(plugin),
                            program: Some(program),
                        },
                    );
                }
                Err(e) => {
                    self.broken.insert(name, e);
                }
            }
        }
        Ok(self)
    }

    /// The plugin of that name.
    pub fn get(&self, name: &str) -> Option<&dyn DynPlugin> {
        self.plugins.get(name).map(|e| e.plugin.as_ref())
    }

    /// The program that runs the plugin's cells, for an external plugin.
    pub fn program(&self, name: &str) -> Option<&Path> {
        self.plugins.get(name).and_then(|e| e.program.as_deref())
    }

    /// Why the external plugin of that name cannot be used, if one was found
    /// and cannot.
    pub fn broken(&self, name: &str) -> Option<&ExternalError> {
        self.broken.get(name)
    }

    /// The external plugins found that cannot be used.
    pub fn broken_plugins(&self) -> impl Iterator<Item = (&str, &ExternalError)> {
        self.broken.iter().map(|(n, e)| (n.as_str(), e))
    }

    /// The registered names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.plugins.keys().map(String::as_str).collect()
    }

    /// The plugins, in order.
    pub fn iter(&self) -> impl Iterator<Item = &dyn DynPlugin> {
        self.plugins.values().map(|e| e.plugin.as_ref())
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
