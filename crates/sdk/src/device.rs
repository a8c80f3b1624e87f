//! Getting a device ready before anything is measured.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{DType, Device, Result, Tensor};

use crate::meter::Category;

/// Runs a few matrix products of each float dtype so that one-time
/// allocations (gemm's per-thread packing buffers, thread pools) happen
/// before anything is measured. On the CPU every thread of the pool runs
/// its own: gemm keeps a packing buffer per thread (the size of the L2
/// cache, 1 MiB on a recent core), made the first time that thread
/// multiplies, and a pool thread the warm-up missed would otherwise make
/// it inside the first measured step (seen: a step's peak 1 MiB above its
/// prediction, when a loaded machine left one thread idle until then).
///
/// The pool's threads live as long as the process, so their part runs
/// once per process; the calling thread's small products run at every
/// call, since the caller may be a thread the first call never saw.
pub fn warm_up(device: &Device) -> Result<()> {
    let _other = Category::Other.enter();
    if !device.is_cpu() {
        return products(device, &[8, 64, 512]);
    }
    products(device, &[8, 64])?;
    if !POOL_WARMED.load(Ordering::Acquire) {
        // Wide enough for gemm to split the work over the pool.
        products(device, &[512])?;
        // Below gemm's threading threshold, each thread's own products
        // run on that thread.
        rayon::broadcast(|_| {
            let _other = Category::Other.enter();
            products(device, &[8, 64])
        })
        .into_iter()
        .collect::<Result<Vec<()>>>()?;
        POOL_WARMED.store(true, Ordering::Release);
    }
    Ok(())
}

/// Set once every thread of the CPU pool has made its packing buffers.
static POOL_WARMED: AtomicBool = AtomicBool::new(false);

/// `n x n` products of ones in each float dtype, for each `n` of `sizes`.
fn products(device: &Device, sizes: &[usize]) -> Result<()> {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for &n in sizes {
            let a = Tensor::ones((n, n), dtype, device)?;
            let _ = a
                .matmul(&a)?
                .sum_all()?
                .to_dtype(DType::F32)?
                .to_scalar::<f32>()?;
        }
    }
    Ok(())
}

/// Where tensors go, as a runner asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// A CUDA GPU when this build has CUDA and one answers, else the CPU.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// A CUDA GPU (builds with the `cuda` feature).
    Cuda,
}

impl DeviceChoice {
    /// Every choice, in the order the command line lists them.
    pub const ALL: [DeviceChoice; 3] = [DeviceChoice::Auto, DeviceChoice::Cpu, DeviceChoice::Cuda];

    /// The name the command line and the worker protocol use.
    pub fn name(self) -> &'static str {
        match self {
            DeviceChoice::Auto => "auto",
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Cuda => "cuda",
        }
    }

    /// The choice of that name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Whether this choice gives the CPU in this build, without asking a
    /// driver: `cpu`, or `auto` in a build without CUDA.
    pub fn is_cpu_here(self) -> bool {
        match self {
            DeviceChoice::Cpu => true,
            DeviceChoice::Auto => !cfg!(feature = "cuda"),
            DeviceChoice::Cuda => false,
        }
    }
}

/// The device for `choice`, or why it cannot be had.
#[cfg(not(feature = "cuda"))]
pub fn select(choice: DeviceChoice) -> std::result::Result<Device, String> {
    match choice {
        DeviceChoice::Cpu | DeviceChoice::Auto => Ok(Device::Cpu),
        DeviceChoice::Cuda => {
            let program = std::env::current_exe()
                .ok()
                .and_then(|p| Some(p.file_name()?.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "this program".to_string());
            Err(if program.starts_with("workbook-plugin-") {
                format!(
                    "{program} was built without CUDA support; rebuild the plugin with \
                     `cargo build --features cuda` to use `--device cuda`"
                )
            } else {
                format!(
                    "{program} was built without CUDA support; rebuild it with `--features \
                     cuda` (scripts/build-cuda.sh builds the workbook without a CUDA toolkit) \
                     to use `--device cuda`"
                )
            })
        }
    }
}

/// The device for `choice`, or why it cannot be had.
#[cfg(feature = "cuda")]
pub fn select(choice: DeviceChoice) -> std::result::Result<Device, String> {
    // candle's errors carry a backtrace when RUST_BACKTRACE is set: keep the
    // first line, the driver's answer.
    let first_line = |e: candle_core::Error| {
        e.to_string()
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Cuda => Device::new_cuda(0).map_err(|e| {
            format!(
                "no CUDA GPU answered ({}); use `--device cpu`, or check the driver and \
                 that LD_LIBRARY_PATH holds the CUDA libraries",
                first_line(e)
            )
        }),
        DeviceChoice::Auto => Device::new_cuda(0).or_else(|e| {
            // The one line a user of `--device auto` needs to read the numbers.
            eprintln!(
                "notice: no CUDA GPU answered ({}); running on the CPU",
                first_line(e)
            );
            Ok(Device::Cpu)
        }),
    }
}

/// The meter for `device`: the CUDA memory pool on a GPU, the counting
/// allocator on the CPU (or, in a Jupyter kernel, the interposer that
/// counts in its place).
pub fn meter_for(
    device: &Device,
) -> std::result::Result<std::sync::Arc<dyn crate::Meter>, crate::meter::MeterError> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        let meter = crate::meter::cuda::CudaMeter::new(d.cuda_stream())?;
        return Ok(std::sync::Arc::new(meter));
    }
    let _ = device;
    match crate::meter::CpuMeter::new() {
        Ok(meter) => Ok(std::sync::Arc::new(meter)),
        // A process counted by the interposer (a Jupyter kernel).
        Err(e) => match crate::meter::KernelMeter::new() {
            Ok(meter) => Ok(std::sync::Arc::new(meter)),
            Err(_) => Err(e),
        },
    }
}

/// How a report names `device`: `cpu`, `cuda:0 (NVIDIA H100 80GB HBM3)`.
pub fn name(device: &Device) -> String {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            let stream = d.cuda_stream();
            let ctx = stream.context();
            match ctx.name() {
                Ok(name) => format!("cuda:{} ({name})", ctx.ordinal()),
                Err(_) => format!("cuda:{}", ctx.ordinal()),
            }
        }
        other => format!("{other:?}").to_lowercase(),
    }
}

/// The memory a GPU has free now (`cuMemGetInfo`), or `None` for the CPU
/// and where the driver does not answer: a planner checks a model against
/// the card it will train on, not against the host's memory.
pub fn gpu_free_memory(device: &Device) -> Option<u64> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => d
            .cuda_stream()
            .context()
            .mem_get_info()
            .ok()
            .map(|(free, _total)| free as u64),
        _ => None,
    }
}

/// A field of `/proc/meminfo` (`MemTotal:`, `MemAvailable:`), in bytes;
/// `None` where it cannot be read.
pub fn meminfo(field: &str) -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_the_cpu_before_asking_and_cuda_is_not() {
        assert!(DeviceChoice::Cpu.is_cpu_here());
        assert!(!DeviceChoice::Cuda.is_cpu_here());
    }

    #[test]
    fn meminfo_reads_this_machines_memory_in_bytes() {
        let total = meminfo("MemTotal:").expect("Linux has /proc/meminfo");
        let free = meminfo("MemFree:").expect("and a MemFree line");
        // Whole KiB, and no more free than there is.
        assert_eq!(total % 1024, 0);
        assert!(free <= total, "{free} free of {total}");
        assert_eq!(meminfo("NoSuchField:"), None);
    }
}
