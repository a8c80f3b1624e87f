//! `workbook-kernel`: evcxr's Jupyter kernel (the `evcxr_jupyter` crate),
//! built with the `evcxr` feature so that it shares that feature's build of
//! evcxr. `workbook kernel install` names it in the "Rust (workbook)"
//! kernel spec, with the allocation interposer preloaded.

fn main() -> anyhow::Result<()> {
    evcxr_jupyter::main()
}
