//! Assertions: boolean expressions over a cell's metrics, such as
//! `peak_checkpointed < 0.6 * peak_plain`.
//!
//! Expressions are parsed and evaluated by the `evalexpr` crate. Every number
//! is a float (integer literals are read as floats too, so
//! `micro_batches == 4` compares as expected), and three functions are added
//! to evalexpr's built-ins: `abs(x)`, `sqrt(x)` and `is_finite(x)`.
//!
//! An assertion fails, with a message, when it reads a metric the cell did
//! not produce (the message lists those it did), when a metric it reads is
//! NaN or infinite (assertions are over finite measurements), or when it does
//! not evaluate to true.

use evalexpr::{
    build_operator_tree, ContextWithMutableFunctions, ContextWithMutableVariables,
    DefaultNumericTypes, EvalexprError, Function, HashMapContext, Node, Operator, Value,
};
use indexmap::IndexMap;
use serde::{Deserialize, Serialize};

/// A parsed assertion.
#[derive(Debug, Clone)]
pub struct Assertion {
    source: String,
    tree: Node<DefaultNumericTypes>,
    reads: Vec<String>,
    device: Option<OnDevice>,
}

/// The kind of device an assertion states a fact of (`device = "cpu"` in a
/// chapter): how that device's kernels treat bf16, what its timings favour.
/// Such an assertion is checked where its cell ran on that kind of device,
/// and reported as skipped elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDevice {
    /// The CPU.
    Cpu,
    /// A CUDA GPU.
    Cuda,
}

impl OnDevice {
    /// Every kind, as a chapter names them.
    pub const ALL: [OnDevice; 2] = [OnDevice::Cpu, OnDevice::Cuda];

    /// The name a chapter uses.
    pub fn name(self) -> &'static str {
        match self {
            OnDevice::Cpu => "cpu",
            OnDevice::Cuda => "cuda",
        }
    }

    /// The kind of that name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Whether `device`, as a report names it (`cpu`, `cuda:0 (NVIDIA
    /// H200)`), is of this kind.
    pub fn covers(self, device: &str) -> bool {
        match self {
            OnDevice::Cpu => device == "cpu",
            OnDevice::Cuda => device == "cuda" || device.starts_with("cuda:"),
        }
    }

    fn phrase(self) -> &'static str {
        match self {
            OnDevice::Cpu => "the CPU",
            OnDevice::Cuda => "a CUDA GPU",
        }
    }
}

/// The outcome of one assertion.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AssertionResult {
    /// The expression as written.
    pub expr: String,
    /// Whether it held (false when skipped).
    pub passed: bool,
    /// Whether it was not checked (its cell did not run, or it is checked at
    /// full size only and this was a check-size run).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// The metrics it read, with their values (`null` for missing or non-finite).
    pub values: IndexMap<String, Option<f64>>,
    /// Why it failed, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

fn floats_only(node: &mut Node<DefaultNumericTypes>) {
    if let Operator::Const {
        value: Value::Int(i),
    } = node.operator()
    {
        let f = *i as f64;
        *node.operator_mut() = Operator::Const {
            value: Value::Float(f),
        };
    }
    for child in node.children_mut() {
        floats_only(child);
    }
}

fn one_float(v: &Value<DefaultNumericTypes>) -> Result<f64, EvalexprError<DefaultNumericTypes>> {
    v.as_number()
}

fn functions(
    ctx: &mut HashMapContext<DefaultNumericTypes>,
) -> Result<(), EvalexprError<DefaultNumericTypes>> {
    ctx.set_function(
        "abs".into(),
        Function::new(|v| Ok(Value::Float(one_float(v)?.abs()))),
    )?;
    ctx.set_function(
        "sqrt".into(),
        Function::new(|v| Ok(Value::Float(one_float(v)?.sqrt()))),
    )?;
    ctx.set_function(
        "is_finite".into(),
        Function::new(|v| Ok(Value::Boolean(one_float(v)?.is_finite()))),
    )?;
    Ok(())
}

/// The longest assertion, in characters. evalexpr parses and evaluates
/// recursively: an expression of tens of thousands of terms or parentheses
/// overflows the stack, which aborts the process. A claim longer than this is
/// better split into several.
pub const MAX_LENGTH: usize = 1_000;

/// The deepest nesting of parentheses in an assertion.
pub const MAX_DEPTH: usize = 32;

impl Assertion {
    /// Parses `source`; the error says why it does not parse.
    pub fn parse(source: &str) -> Result<Self, String> {
        if source.trim().is_empty() {
            return Err("the expression is empty".to_string());
        }
        let length = source.chars().count();
        if length > MAX_LENGTH {
            return Err(format!(
                "the expression is {length} characters long; an assertion is at most \
                 {MAX_LENGTH} (split a longer claim into several assertions)"
            ));
        }
        let mut depth = 0usize;
        let mut deepest = 0usize;
        for c in source.chars() {
            match c {
                '(' => {
                    depth += 1;
                    deepest = deepest.max(depth);
                }
                ')' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        if deepest > MAX_DEPTH {
            return Err(format!(
                "parentheses nest {deepest} deep; an assertion nests them at most {MAX_DEPTH} deep"
            ));
        }
        let mut tree =
            build_operator_tree::<DefaultNumericTypes>(source).map_err(|e| e.to_string())?;
        floats_only(&mut tree);
        let mut reads: Vec<String> = Vec::new();
        for name in tree.iter_read_variable_identifiers() {
            if !reads.iter().any(|r| r == name) {
                reads.push(name.to_string());
            }
        }
        if tree.iter_write_variable_identifiers().next().is_some() {
            return Err("assertions read metrics; they cannot assign to them".to_string());
        }
        // evalexpr accepts some incomplete expressions (`a >`) until it
        // evaluates them: a dry run with every metric at 1 catches those, and
        // expressions that are not true-or-false, before anything runs.
        let mut ctx = HashMapContext::<DefaultNumericTypes>::new();
        functions(&mut ctx).map_err(|e| e.to_string())?;
        for name in &reads {
            ctx.set_value(name.clone(), Value::Float(1.0))
                .map_err(|e| e.to_string())?;
        }
        match tree.eval_with_context(&ctx) {
            Ok(Value::Boolean(_)) => {}
            Ok(other) => return Err(format!("it gives {other}, not true or false")),
            Err(e) => return Err(e.to_string()),
        }
        Ok(Self {
            source: source.to_string(),
            tree,
            reads,
            device: None,
        })
    }

    /// The same assertion, checked only where its cell ran on `device`.
    pub fn on(self, device: OnDevice) -> Self {
        Self {
            device: Some(device),
            ..self
        }
    }

    /// The kind of device it is checked on, if only one.
    pub fn device(&self) -> Option<OnDevice> {
        self.device
    }

    /// The expression as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The metrics the expression reads.
    pub fn reads(&self) -> &[String] {
        &self.reads
    }

    /// The result of not checking it, and why.
    pub fn skip(&self, why: &str) -> AssertionResult {
        AssertionResult {
            expr: self.source.clone(),
            passed: false,
            skipped: true,
            values: IndexMap::new(),
            message: Some(why.to_string()),
        }
    }

    /// Evaluates against `metrics` from a cell that ran on `ran_on` (as a
    /// report names the device; `None` where it is not known): skipped, and
    /// why, when it holds on another kind of device.
    pub fn evaluate_on(
        &self,
        ran_on: Option<&str>,
        metrics: &IndexMap<String, f64>,
    ) -> AssertionResult {
        match (self.device, ran_on) {
            (Some(kind), Some(ran_on)) if !kind.covers(ran_on) => self.skip(&format!(
                "checked on {} only; this cell ran on {ran_on}",
                kind.phrase()
            )),
            _ => self.evaluate(metrics),
        }
    }

    /// Evaluates against `metrics`.
    pub fn evaluate(&self, metrics: &IndexMap<String, f64>) -> AssertionResult {
        let mut values = IndexMap::new();
        let mut problems = Vec::new();
        for name in &self.reads {
            match metrics.get(name) {
                None => {
                    values.insert(name.clone(), None);
                    let produced: Vec<&str> = metrics.keys().map(String::as_str).collect();
                    problems.push(format!(
                        "metric `{name}` was not produced; the cell produced: {}",
                        if produced.is_empty() {
                            "nothing".to_string()
                        } else {
                            produced.join(", ")
                        }
                    ));
                }
                Some(v) if !v.is_finite() => {
                    values.insert(name.clone(), None);
                    problems.push(format!(
                        "metric `{name}` is {v}, where a finite value was asserted"
                    ));
                }
                Some(v) => {
                    values.insert(name.clone(), Some(*v));
                }
            }
        }
        let fail = |message: String, values| AssertionResult {
            expr: self.source.clone(),
            passed: false,
            skipped: false,
            values,
            message: Some(message),
        };
        if !problems.is_empty() {
            return fail(problems.join("; "), values);
        }
        let mut ctx = HashMapContext::<DefaultNumericTypes>::new();
        let setup = functions(&mut ctx).and_then(|_| {
            values.iter().try_for_each(|(name, v)| {
                ctx.set_value(name.clone(), Value::Float(v.unwrap_or(f64::NAN)))
            })
        });
        if let Err(e) = setup {
            return fail(format!("cannot set up the evaluation: {e}"), values);
        }
        match self.tree.eval_boolean_with_context(&ctx) {
            Ok(true) => AssertionResult {
                expr: self.source.clone(),
                passed: true,
                skipped: false,
                values,
                message: None,
            },
            Ok(false) => fail("the expression is false".to_string(), values),
            Err(e) => fail(
                format!("the expression does not evaluate to true or false: {e}"),
                values,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overlong_or_overdeep_assertion_is_refused_without_a_crash() {
        let long = vec!["a"; 50_000].join(" + ") + " > 0";
        assert_eq!(
            Assertion::parse(&long).unwrap_err(),
            "the expression is 200001 characters long; an assertion is at most 1000 (split a \
             longer claim into several assertions)"
        );
        let deep = format!("{}a{} > 0", "(".repeat(50_000), ")".repeat(50_000));
        assert!(Assertion::parse(&deep)
            .unwrap_err()
            .contains("at most 1000"));
        let deep = format!("{}a{} > 0", "(".repeat(33), ")".repeat(33));
        assert_eq!(
            Assertion::parse(&deep).unwrap_err(),
            "parentheses nest 33 deep; an assertion nests them at most 32 deep"
        );
        let ok = format!("{}a{} > 0", "(".repeat(32), ")".repeat(32));
        assert!(Assertion::parse(&ok).is_ok());
        // The longest allowed chain of terms parses and evaluates.
        let terms = vec!["a"; 249].join(" + ") + " > 0";
        assert!(terms.len() <= MAX_LENGTH);
        let a = Assertion::parse(&terms).unwrap();
        let metrics = indexmap::IndexMap::from([("a".to_string(), 1.0)]);
        assert!(a.evaluate(&metrics).passed);
    }

    #[test]
    fn an_assertion_for_one_device_is_checked_there_and_skipped_elsewhere() {
        let metrics = indexmap::IndexMap::from([("a".to_string(), 2.0)]);
        let cpu = Assertion::parse("a > 1").unwrap().on(OnDevice::Cpu);
        let cuda = Assertion::parse("a < 1").unwrap().on(OnDevice::Cuda);
        assert!(cpu.evaluate_on(Some("cpu"), &metrics).passed);
        let skipped = cpu.evaluate_on(Some("cuda:0 (NVIDIA H200)"), &metrics);
        assert!(skipped.skipped && !skipped.passed);
        assert_eq!(
            skipped.message.as_deref(),
            Some("checked on the CPU only; this cell ran on cuda:0 (NVIDIA H200)")
        );
        // On its own device it is checked, and this one fails.
        let failed = cuda.evaluate_on(Some("cuda:1"), &metrics);
        assert!(!failed.passed && !failed.skipped);
        assert_eq!(
            cuda.evaluate_on(Some("cpu"), &metrics).message.as_deref(),
            Some("checked on a CUDA GPU only; this cell ran on cpu")
        );
        // Where the device is not known (the cell did not start), it is
        // checked, and fails with the rest.
        assert!(!cuda.evaluate_on(None, &metrics).skipped);
        // An assertion for every device is checked on each.
        let any = Assertion::parse("a > 1").unwrap();
        assert_eq!(any.device(), None);
        assert!(any.evaluate_on(Some("cuda:0"), &metrics).passed);
        assert!(!OnDevice::Cuda.covers("cudax") && !OnDevice::Cpu.covers("cpu0"));
        assert_eq!(OnDevice::from_name("cuda"), Some(OnDevice::Cuda));
        assert_eq!(OnDevice::from_name("auto"), None);
    }
}
