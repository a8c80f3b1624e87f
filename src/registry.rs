//! The plugin registry: names to plugins, in the order they were added,
//! built-in and external ([`crate::external`]) alike. An external plugin is
//! started to describe itself only when it is first needed.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use indexmap::IndexMap;
use workbook_sdk::DynPlugin;

use crate::external::{ExternalError, ExternalPlugin};

/// Two plugins under one name.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DuplicatePlugin {
    /// Two plugins registered in a program under one name.
    #[error("a plugin named `{0}` is already registered")]
    Registered(String),
    /// An external plugin with the name of a plugin already registered.
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

/// Why [`Registry::resolve`] gives no plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unusable {
    /// No plugin of that name.
    Unknown,
    /// One was found but cannot be used, for this reason.
    Refused(String),
}

enum Entry {
    BuiltIn(Box<dyn DynPlugin>),
    External {
        program: PathBuf,
        /// What it said of itself, asked on first use (boxed: a
        /// description is far larger than a built-in entry).
        loaded: Box<OnceLock<Result<ExternalPlugin, ExternalError>>>,
    },
}

impl Entry {
    fn plugin(&self, name: &str) -> Result<&dyn DynPlugin, &ExternalError> {
        match self {
            Entry::BuiltIn(p) => Ok(p.as_ref()),
            Entry::External { program, loaded } => loaded
                .get_or_init(|| ExternalPlugin::load(name, program))
                .as_ref()
                .map(|p| p as &dyn DynPlugin),
        }
    }
}

/// Plugins by name, in insertion order.
#[derive(Default)]
pub struct Registry {
    plugins: IndexMap<String, Entry>,
    /// External programs with the name of a registered plugin: a chapter
    /// that names it is refused, with both named.
    clashes: IndexMap<String, DuplicatePlugin>,
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
        self.plugins.insert(name, Entry::BuiltIn(plugin));
        Ok(self)
    }

    /// Adds the external plugins found in `dirs` (see
    /// [`crate::external::discover`]). Each is asked to describe itself when
    /// first used; one that cannot is named, with why, where a chapter uses
    /// it. One with the name of a plugin already here is set aside: a
    /// chapter that names it is refused, with both named.
    pub fn add_external(&mut self, dirs: &[PathBuf]) -> &mut Self {
        for (name, program) in crate::external::discover(dirs) {
            if self.plugins.contains_key(&name) {
                let clash = DuplicatePlugin::External {
                    name: name.clone(),
                    program,
                };
                self.clashes.insert(name, clash);
                continue;
            }
            self.plugins.insert(
                name,
                Entry::External {
                    program,
                    loaded: Box::default(),
                },
            );
        }
        self
    }

    /// The plugin of that name (an external one is asked to describe itself
    /// the first time).
    pub fn get(&self, name: &str) -> Option<&dyn DynPlugin> {
        self.plugins.get(name)?.plugin(name).ok()
    }

    /// The program that runs the plugin's cells, for an external plugin.
    pub fn program(&self, name: &str) -> Option<&Path> {
        match self.plugins.get(name)? {
            Entry::External { program, .. } => Some(program),
            Entry::BuiltIn(_) => None,
        }
    }

    /// The plugin a chapter may use under that name, or why there is none:
    /// an external program of a registered plugin's name, or an external
    /// plugin that cannot describe itself, is refused with why.
    pub fn resolve(&self, name: &str) -> Result<&dyn DynPlugin, Unusable> {
        if let Some(clash) = self.clashes.get(name) {
            return Err(Unusable::Refused(clash.to_string()));
        }
        self.plugins
            .get(name)
            .ok_or(Unusable::Unknown)?
            .plugin(name)
            .map_err(|e| Unusable::Refused(e.to_string()))
    }

    /// Asks every external plugin not yet asked to describe itself, all at
    /// once: a listing waits for the slowest program, not for the sum of
    /// their time limits.
    pub fn load_all(&self) {
        std::thread::scope(|scope| {
            for (name, entry) in &self.plugins {
                if let Entry::External { loaded, .. } = entry {
                    if loaded.get().is_none() {
                        scope.spawn(move || {
                            let _ = entry.plugin(name);
                        });
                    }
                }
            }
        });
    }

    /// The plugins that cannot be used (external ones are asked first), and
    /// why.
    pub fn refused(&self) -> Vec<(&str, String)> {
        self.load_all();
        let mut out: Vec<(&str, String)> = self
            .plugins
            .iter()
            .filter_map(|(n, e)| e.plugin(n).err().map(|why| (n.as_str(), why.to_string())))
            .collect();
        out.extend(
            self.clashes
                .iter()
                .map(|(n, c)| (n.as_str(), c.to_string())),
        );
        out
    }

    /// The registered names, in order (external plugins are not started).
    pub fn names(&self) -> Vec<&str> {
        self.plugins.keys().map(String::as_str).collect()
    }

    /// The plugins that can be used, in order (external ones are asked to
    /// describe themselves).
    pub fn iter(&self) -> impl Iterator<Item = &dyn DynPlugin> {
        self.load_all();
        self.plugins.iter().filter_map(|(n, e)| e.plugin(n).ok())
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
        Box::new(workbook_transformer::GptTraining),
        Box::new(workbook_transformer::SavedTensors),
        Box::new(workbook_transformer::LayerProfile),
        Box::new(workbook_transformer::GptCheckpointing),
        Box::new(workbook_transformer::Predictors),
        Box::new(workbook_distributed::ZeroStages),
        Box::new(workbook_distributed::GptRanks),
        Box::new(workbook_exercises::PolicyExercise),
        Box::new(workbook_exercises::FitExercise),
        Box::new(workbook_decoder::DecoderShapes),
        Box::new(workbook_decoder::DecoderStep),
    ]
}
