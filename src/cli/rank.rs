//! `workbook rank`: one MPI rank of a data-parallel cell's job or of a
//! plan's verification, as `mpirun` starts it.

use std::process::ExitCode;

use clap::Args;

/// The arguments of `workbook rank`.
#[derive(Args, Debug)]
pub struct RankArgs {
    /// The cell's job, as JSON.
    #[arg(long, required_unless_present = "verify", conflicts_with = "verify")]
    pub request: Option<String>,
    /// A plan's verification on this rank, as JSON.
    #[arg(long)]
    pub verify: Option<String>,
}

/// Serves as the rank `args` describe; the process's exit code.
pub fn serve(args: &RankArgs) -> ExitCode {
    // Before MPI starts: a launcher killed while the ranks initialise takes
    // them with it.
    workbook_distributed::rank::die_with_launcher();
    let served = match (&args.request, &args.verify) {
        (Some(request), _) => rank(request),
        (None, Some(verify)) => verify_rank(verify),
        (None, None) => Err(anyhow::anyhow!("a rank needs --request or --verify")),
    };
    served.unwrap_or_else(|e| {
        eprintln!(
            "error: {}",
            workbook::terminal::printable(&format!("{e:#}"))
        );
        ExitCode::FAILURE
    })
}

/// One rank of a plan's verification: a warm-up step, then the steps,
/// measured by this rank's counting allocator, written to `verify-R.json`.
fn verify_rank(request: &str) -> anyhow::Result<ExitCode> {
    use anyhow::Context as _;
    let request: workbook_planner::plan::VerifyRequest =
        serde_json::from_str(request).context("reading the rank's request")?;
    let Some(out) = request.out.clone() else {
        anyhow::bail!("a rank's verification needs the folder to report in");
    };
    #[cfg(feature = "mpi")]
    {
        use std::sync::Arc;
        use workbook_planner::plan::verify;
        use workbook_planner::step::Parallel;
        // Held to the cell's cap, as the cell's own process is.
        workbook_sdk::meter::set_limit(request.max_memory);
        let comm = candle_distributed::Comm::mpi()?;
        workbook_distributed::rank::serve(comm, &out, |comm| {
            let stage = request
                .stage
                .context("a rank's verification names how the ranks share the training")?;
            if let Some(fault) = workbook_distributed::rank::Fault::from_env()? {
                fault.strike(comm.rank(), stage);
            }
            let parallel = Parallel::new(Arc::clone(comm), stage);
            let meter = Arc::new(workbook_sdk::meter::CpuMeter::new()?);
            let mut ctx =
                workbook_sdk::Context::new(workbook_sdk::candle::Device::Cpu, meter, false);
            // What a process sets up once (the products' per-thread
            // buffers) is not a step's, as in the calibration.
            verify(
                &mut ctx,
                &workbook_planner::plan::VerifyRequest {
                    steps: 1,
                    ..request.clone()
                },
                Some(&parallel),
            )?;
            let measured = verify(&mut ctx, &request, Some(&parallel))?;
            let path = out.join(format!("verify-{}.json", comm.rank()));
            std::fs::write(&path, serde_json::to_vec(&measured)?)
                .with_context(|| format!("writing {}", path.display()))?;
            Ok(())
        })
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = out;
        Err(without_mpi())
    }
}

/// One rank of a data-parallel cell's job.
fn rank(request: &str) -> anyhow::Result<ExitCode> {
    use anyhow::Context as _;
    let request: workbook_distributed::rank::RankRequest =
        serde_json::from_str(request).context("reading the rank's request")?;
    #[cfg(feature = "mpi")]
    {
        let comm = candle_distributed::Comm::mpi()?;
        workbook_distributed::rank::rank_main(comm, &request)
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = request;
        Err(without_mpi())
    }
}

/// Why a rank cannot run in this build, naming `WORKBOOK_BIN` where it
/// chose this executable.
#[cfg(not(feature = "mpi"))]
fn without_mpi() -> anyhow::Error {
    let exe = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "this workbook".into());
    let chosen = match std::env::var_os("WORKBOOK_BIN") {
        Some(bin) => format!(
            " (WORKBOOK_BIN={} chose it as the ranks' executable: point WORKBOOK_BIN at a \
             build with `--features mpi`, or unset it)",
            bin.to_string_lossy()
        ),
        None => String::new(),
    };
    anyhow::anyhow!(
        "{exe} was built without the `mpi` feature{chosen}: {}",
        workbook_distributed::launch::INSTALL
    )
}
