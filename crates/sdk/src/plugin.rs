//! The [`Plugin`] trait a cell kind implements, and the [`Context`] it runs in.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::meter::{ByCategory, Category, MemorySnapshot, Meter};
use crate::metric::MetricSpec;
use crate::output::{CellOutput, Figure, Mark, PoolUse, RegionReport, Table};
use crate::protocol::{Message, ParamError, PluginInfo, Verdict};

/// A cell kind: an experiment that runs with typed parameters and records what
/// it measured into its [`Context`].
///
/// `Params` is deserialised from the cell's `params` table in the chapter
/// file (with the `check` table laid over it in check mode). Give it
/// `#[serde(deny_unknown_fields)]` so a misspelt parameter is an error, and
/// `#[serde(default)]` fields for what a chapter may leave out.
///
/// `Params` also derives [`JsonSchema`] (re-exported as
/// `workbook_sdk::schemars`): `workbook describe` prints the parameters from
/// it, with their doc comments as their meaning, and editors complete them.
///
/// `run` records into the context instead of returning a value, so what a
/// plugin printed and measured before it failed or panicked is kept.
pub trait Plugin: Send + Sync + 'static {
    /// The parameters, read from the chapter.
    type Params: DeserializeOwned + Serialize + JsonSchema;

    /// The name chapters use in `plugin = "..."`.
    fn name(&self) -> &str;

    /// One line on what the plugin measures, for `workbook list`.
    fn description(&self) -> &str {
        ""
    }

    /// Checks the parameters' values (their types are serde's to check):
    /// every value the experiment cannot run with, with what is allowed. A
    /// chapter is refused before anything runs while any remains. Write it
    /// with [`Rules`](crate::Rules); the default allows every value.
    fn validate(&self, params: &Self::Params) -> Vec<crate::Violation> {
        let _ = params;
        Vec::new()
    }

    /// A lower bound of the memory the experiment must hold at once with
    /// these parameters, and what it is (`4 × 500000² f32 scores`), where
    /// the plugin can tell. A cell whose floor is above what a cell may hold
    /// (`--max-memory`, by default the machine's memory on the CPU; on a
    /// GPU, also what the card has free) is refused before it runs, and the
    /// run goes on. A floor, not an estimate: it must never
    /// exceed what the cell really needs, so a refusal is always right.
    fn memory_floor(&self, params: &Self::Params) -> Option<(u64, String)> {
        let _ = params;
        None
    }

    /// Why this build cannot run the experiment with these parameters (a
    /// feature it was built without, a program that is not installed),
    /// with what would let it, where it cannot; `None`, the default, when
    /// it can. A runner reports such a cell as not run, with this reason,
    /// rather than as failed: nothing it would measure is wrong, it is
    /// missing (`workbook run --require-all` makes it a failure, for CI).
    fn unavailable(&self, params: &Self::Params) -> Option<String> {
        let _ = params;
        None
    }

    /// Every metric `run` may record, with its unit and meaning. The runner
    /// holds the plugin to it (a metric recorded but not declared is the
    /// cell's error), and `workbook validate` checks each assertion's
    /// metrics against it.
    fn metrics(&self) -> Vec<MetricSpec>;

    /// The experiment's source, for a plugin whose notebook cell shows and
    /// runs its code (see [`crate::notebook`]); `None`, the default, shows
    /// the cell's results alone.
    fn notebook(&self) -> Option<crate::notebook::NotebookSource> {
        None
    }

    /// Runs the experiment.
    fn run(&self, ctx: &mut Context, params: Self::Params) -> anyhow::Result<()>;
}

/// Why a cell is refused before it runs: its plugin's floor (see
/// [`Plugin::memory_floor`]) is above `room`, the bytes it may hold, which
/// `room_is` names ("a cell may hold here (`--max-memory`)", "free on
/// cuda:0 (NVIDIA H200)"). `None` when the floor fits.
pub fn refusal(floor: &(u64, String), room: u64, room_is: &str) -> Option<String> {
    let (bytes, what) = floor;
    (*bytes > room).then(|| {
        let size = |b: u64| bytesize::ByteSize::b(b).display().iec().to_string();
        format!(
            "refused before running: it needs at least {} ({what}), more than the {} {room_is}",
            size(*bytes),
            size(room)
        )
    })
}

/// The object-safe face of [`Plugin`], used by registries. Every `Plugin`
/// implements it.
pub trait DynPlugin: Send + Sync {
    /// See [`Plugin::name`].
    fn name(&self) -> &str;
    /// See [`Plugin::description`].
    fn description(&self) -> &str;
    /// The plugin as `workbook describe` shows it: its parameters' JSON
    /// Schema and its metrics.
    fn info(&self) -> PluginInfo;
    /// See [`Plugin::metrics`]: what a runner holds a cell to, without the
    /// parameters' schema that [`DynPlugin::info`] builds.
    fn declared_metrics(&self) -> Vec<MetricSpec>;
    /// Checks a parameter table and returns it with defaults filled in, as JSON.
    fn check_params(&self, params: &toml::Table) -> Result<serde_json::Value, ParamError>;
    /// The values of a well-typed parameter table that are not allowed; see
    /// [`Plugin::validate`].
    fn validate_params(&self, params: &toml::Table) -> Result<Vec<crate::Violation>, ParamError>;
    /// See [`Plugin::memory_floor`]; `None` for a table that does not parse.
    fn memory_floor_of(&self, params: &toml::Table) -> Option<(u64, String)>;
    /// See [`Plugin::unavailable`]; `None` for a table that does not parse
    /// (its error is the cell's).
    fn unavailable_with(&self, params: &toml::Table) -> Option<String>;
    /// See [`Plugin::notebook`]; `None` for a plugin whose experiment a
    /// notebook cannot compile (an external program's).
    fn notebook_source(&self) -> Option<crate::notebook::NotebookSource> {
        None
    }
    /// Deserialises the parameters and runs.
    fn run_with(&self, ctx: &mut Context, params: &toml::Table) -> anyhow::Result<()>;

    /// Everything a runner checks of a table before it runs, at once: what
    /// the protocol's [`Check`](crate::protocol::Body::Check) answers.
    fn verdict(&self, params: &toml::Table) -> Verdict {
        match self.check_params(params) {
            Ok(filled) => Verdict {
                params: Ok(filled),
                violations: self.validate_params(params).unwrap_or_default(),
                memory_floor: self.memory_floor_of(params),
                unavailable: self.unavailable_with(params),
            },
            Err(e) => Verdict {
                params: Err(e),
                violations: Vec::new(),
                memory_floor: None,
                unavailable: None,
            },
        }
    }
}

fn parse<P: DeserializeOwned>(params: &toml::Table) -> Result<P, ParamError> {
    // A plugin without parameters (`type Params = ()`) takes an empty table.
    if params.is_empty() {
        let unit = serde::de::value::UnitDeserializer::<serde::de::value::Error>::new();
        if let Ok(p) = P::deserialize(unit) {
            return Ok(p);
        }
    }
    serde_path_to_error::deserialize(toml::Value::Table(params.clone())).map_err(|e| {
        let field = e.path().to_string();
        ParamError {
            field: if field == "." { String::new() } else { field },
            message: e.into_inner().to_string().trim().to_string(),
        }
    })
}

impl<T: Plugin> DynPlugin for T {
    fn name(&self) -> &str {
        Plugin::name(self)
    }

    fn description(&self) -> &str {
        Plugin::description(self)
    }

    fn info(&self) -> PluginInfo {
        PluginInfo {
            name: Plugin::name(self).to_string(),
            description: Plugin::description(self).to_string(),
            params: schemars::schema_for!(T::Params).to_value(),
            metrics: self.metrics(),
        }
    }

    fn declared_metrics(&self) -> Vec<MetricSpec> {
        self.metrics()
    }

    fn check_params(&self, params: &toml::Table) -> Result<serde_json::Value, ParamError> {
        let typed: T::Params = parse(params)?;
        serde_json::to_value(&typed).map_err(|e| ParamError {
            field: String::new(),
            message: e.to_string(),
        })
    }

    fn validate_params(&self, params: &toml::Table) -> Result<Vec<crate::Violation>, ParamError> {
        let typed: T::Params = parse(params)?;
        Ok(self.validate(&typed))
    }

    fn memory_floor_of(&self, params: &toml::Table) -> Option<(u64, String)> {
        let typed: T::Params = parse(params).ok()?;
        self.memory_floor(&typed)
    }

    fn unavailable_with(&self, params: &toml::Table) -> Option<String> {
        let typed: T::Params = parse(params).ok()?;
        self.unavailable(&typed)
    }

    fn notebook_source(&self) -> Option<crate::notebook::NotebookSource> {
        self.notebook()
    }

    fn run_with(&self, ctx: &mut Context, params: &toml::Table) -> anyhow::Result<()> {
        let typed: T::Params =
            parse(params).map_err(|e| anyhow::anyhow!("parameter `{}`: {e}", e.field))?;
        // A caller that did not load a chapter (the library, a worker) gets
        // the same refusal as `workbook validate`.
        let violations = self.validate(&typed);
        if !violations.is_empty() {
            let said: Vec<String> = violations
                .iter()
                .map(|v| format!("parameter `{}` {v}", v.field))
                .collect();
            anyhow::bail!("{}", said.join("; "));
        }
        self.run(ctx, typed)
    }
}

type ProgressFn = Arc<dyn Fn(&str) + Send + Sync>;
type SinkFn = Arc<dyn Fn(&Message) + Send + Sync>;

/// Marks a region holds without allocating inside it.
const MARKS: usize = 64;

/// What a plugin runs with: the device, the memory meter, the mode, and the
/// output it records into.
pub struct Context {
    device: Device,
    meter: Arc<dyn Meter>,
    check_mode: bool,
    progress: ProgressFn,
    sink: Option<SinkFn>,
    output: CellOutput,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.device)
            .field("meter", &self.meter.name())
            .field("check_mode", &self.check_mode)
            .field("output", &self.output)
            .finish()
    }
}

impl Context {
    /// A context on `device`, measured by `meter`.
    pub fn new(device: Device, meter: Arc<dyn Meter>, check_mode: bool) -> Self {
        Self {
            device,
            meter,
            check_mode,
            progress: Arc::new(|_| {}),
            sink: None,
            output: CellOutput::default(),
        }
    }

    /// Sends everything the cell records to `f` as it is recorded, as well
    /// as keeping it: a worker process streams it to the runner this way, so
    /// what a cell recorded survives the cell's process.
    pub fn with_sink(mut self, f: impl Fn(&Message) + Send + Sync + 'static) -> Self {
        self.sink = Some(Arc::new(f));
        self
    }

    fn emit(&self, message: &Message) {
        if let Some(sink) = &self.sink {
            sink(message);
        }
    }

    /// Sends progress messages to `f` (the runner shows them on a spinner).
    pub fn with_progress(mut self, f: impl Fn(&str) + Send + Sync + 'static) -> Self {
        self.progress = Arc::new(f);
        self
    }

    /// The device tensors go on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The memory meter.
    pub fn meter(&self) -> &dyn Meter {
        self.meter.as_ref()
    }

    /// Whether the chapter runs at check sizes.
    pub fn is_check(&self) -> bool {
        self.check_mode
    }

    /// Reports progress of a long cell.
    pub fn progress(&self, message: &str) {
        (self.progress)(message);
        if self.sink.is_some() {
            self.emit(&Message::Progress {
                message: message.to_string(),
            });
        }
    }

    /// Records a printed line.
    pub fn print(&mut self, line: impl Into<String>) {
        let message = Message::Printed { line: line.into() };
        self.emit(&message);
        if let Message::Printed { line } = message {
            self.output.printed.push(line);
        }
    }

    /// Records a named metric. Names are identifiers (`peak_plain`) so that
    /// assertions can read them; a second value under a name replaces the first.
    pub fn metric(&mut self, name: impl Into<String>, value: f64) {
        let message = Message::Metric {
            name: name.into(),
            value,
        };
        self.emit(&message);
        if let Message::Metric { name, value } = message {
            self.output.metrics.insert(name, value);
        }
    }

    /// Records a table.
    pub fn table(&mut self, table: Table) {
        let message = Message::Table(table);
        self.emit(&message);
        if let Message::Table(table) = message {
            self.output.tables.push(table);
        }
    }

    /// Records a figure.
    pub fn figure(&mut self, figure: Figure) {
        let message = Message::Figure(figure);
        self.emit(&message);
        if let Message::Figure(figure) = message {
            self.output.figures.push(figure);
        }
    }

    /// Starts measuring a variant: opens a peak frame and records the
    /// baseline. Finish it with [`Context::end_region`]. Regions nest: an
    /// outer region's peak includes everything its inner regions reached.
    pub fn region(&self, name: impl Into<String>) -> Region {
        Region::start(name.into(), self.meter.clone())
    }

    /// Ends a region, records its report and returns a copy.
    pub fn end_region(&mut self, region: Region) -> RegionReport {
        let report = region.finish();
        let message = Message::Region(report.clone());
        self.emit(&message);
        if let Message::Region(report) = message {
            self.output.regions.push(report);
        }
        report
    }

    /// Measures `f` as one region named `name`.
    pub fn measure<R>(
        &mut self,
        name: impl Into<String>,
        f: impl FnOnce(&mut Region) -> anyhow::Result<R>,
    ) -> anyhow::Result<(R, RegionReport)> {
        let mut region = self.region(name);
        let value = f(&mut region)?;
        Ok((value, self.end_region(region)))
    }

    /// What has been recorded so far.
    pub fn output(&self) -> &CellOutput {
        &self.output
    }

    /// Takes the recorded output.
    pub fn into_output(self) -> CellOutput {
        self.output
    }
}

/// A variant being measured; see [`Context::region`].
pub struct Region {
    name: String,
    meter: Arc<dyn Meter>,
    start: Instant,
    baseline: MemorySnapshot,
    marks: Vec<Mark>,
    analytic: Option<u64>,
    /// Whether the peak frame is still open (closed by `finish` or on drop).
    open: bool,
}

impl Drop for Region {
    fn drop(&mut self) {
        // A region abandoned by an error still closes its frame, so the
        // enclosing measurement keeps its peak.
        if self.open {
            self.meter.pop_peak();
        }
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("name", &self.name)
            .field("baseline", &self.baseline)
            .field("marks", &self.marks)
            .finish()
    }
}

impl Region {
    fn start(name: String, meter: Arc<dyn Meter>) -> Self {
        // The timeline's own storage is allocated before the baseline is
        // read, so that it is not counted as the experiment's memory.
        let marks = Category::Other.scope(|| Vec::with_capacity(MARKS));
        meter.push_peak();
        let baseline = meter.snapshot();
        let mut region = Self {
            name,
            meter,
            start: Instant::now(),
            baseline,
            marks,
            analytic: None,
            open: true,
        };
        region.mark("start");
        region
    }

    /// Peaks stretch by stretch from now on, between the marks of a
    /// technique given it as its observer ([`Phases`](crate::observe::Phases)).
    pub fn phases(&self) -> crate::observe::Phases {
        crate::observe::Phases::start(Arc::clone(&self.meter))
    }

    /// Records a point of the timeline, such as `after forward`. A literal
    /// label allocates nothing; past the first 64 marks the timeline's own
    /// growth is counted (as `other`).
    pub fn mark(&mut self, label: impl Into<Cow<'static, str>>) {
        let _other = Category::Other.enter();
        let snap = self.meter.snapshot();
        self.marks.push(Mark {
            label: label.into(),
            seconds: self.start.elapsed().as_secs_f64(),
            current: snap.current,
            peak_so_far: snap.peak,
        });
    }

    /// Records the analytic figure for this variant, to be shown beside
    /// what was measured.
    pub fn set_analytic(&mut self, bytes: u64) {
        self.analytic = Some(bytes);
    }

    /// Bytes live now minus those live when the region began, by category.
    pub fn current_above_baseline(&self) -> ByCategory {
        self.meter
            .snapshot()
            .current
            .saturating_sub(&self.baseline.current)
    }

    /// The most blocks live at once so far, above those live at the start.
    pub fn blocks_above_baseline(&self) -> u64 {
        self.meter
            .snapshot()
            .peak_blocks
            .saturating_sub(self.baseline.live_blocks)
    }

    /// The peak so far above the baseline, in bytes.
    pub fn peak_above_baseline(&self) -> u64 {
        self.meter
            .snapshot()
            .peak
            .saturating_sub(self.baseline.current_total())
    }

    fn finish(mut self) -> RegionReport {
        self.mark("end");
        let seconds = self.start.elapsed().as_secs_f64();
        let snap = self.meter.snapshot();
        self.open = false;
        self.meter.pop_peak();
        RegionReport {
            name: std::mem::take(&mut self.name),
            baseline: self.baseline.current,
            peak_bytes: snap.peak,
            peak_by_category: snap.peak_by_category,
            peak_each: snap.peak_each,
            baseline_host: self.baseline.host,
            device_peak_each: snap.device_peak_each,
            host_peak_each: snap.host_peak_each,
            device_peak_bytes: snap.device_peak,
            end: snap.current,
            end_host: snap.host,
            baseline_blocks: self.baseline.live_blocks,
            peak_blocks: snap.peak_blocks,
            seconds,
            marks: std::mem::take(&mut self.marks),
            analytic: self.analytic,
            pool: PoolUse::between(&self.baseline, &snap),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::refusal;

    #[test]
    fn a_floor_above_the_room_is_refused_naming_both_and_one_within_it_is_not() {
        let floor = (3 << 30, "the f32 scores, 4 × 16384²".to_string());
        assert_eq!(
            refusal(&floor, 2 << 30, "free on cuda:0 (NVIDIA H200)").as_deref(),
            Some(
                "refused before running: it needs at least 3.0 GiB (the f32 scores, 4 × \
                 16384²), more than the 2.0 GiB free on cuda:0 (NVIDIA H200)"
            )
        );
        assert_eq!(
            refusal(&floor, 3 << 30, "free"),
            None,
            "a floor equal to the room fits"
        );
    }
}
