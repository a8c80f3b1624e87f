//! Choosing the device and the meter that measures it.

use std::sync::Arc;

use workbook_sdk::candle::Device;
use workbook_sdk::meter::CpuMeter;
use workbook_sdk::Meter;

use super::RunError;

/// Where tensors go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
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
        [DeviceChoice::Auto, DeviceChoice::Cpu, DeviceChoice::Cuda]
            .into_iter()
            .find(|d| d.name() == name)
    }
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn select_device(choice: DeviceChoice) -> Result<Device, RunError> {
    match choice {
        DeviceChoice::Cpu | DeviceChoice::Auto => Ok(Device::Cpu),
        DeviceChoice::Cuda => Err(RunError::Device(
            "this workbook was built without CUDA support; rebuild it with `--features cuda` \
             (scripts/build-cuda.sh builds it without a CUDA toolkit) to use `--device cuda`"
                .to_string(),
        )),
    }
}

#[cfg(feature = "cuda")]
pub(crate) fn select_device(choice: DeviceChoice) -> Result<Device, RunError> {
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
            RunError::Device(format!(
                "no CUDA GPU answered ({}); use `--device cpu`, or check the driver and \
                 that LD_LIBRARY_PATH holds the CUDA libraries",
                first_line(e)
            ))
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
/// allocator on the CPU.
pub(crate) fn select_meter(device: &Device) -> Result<Arc<dyn Meter>, RunError> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        let meter = workbook_sdk::meter::cuda::CudaMeter::new(d.cuda_stream())?;
        return Ok(Arc::new(meter));
    }
    let _ = device;
    Ok(Arc::new(CpuMeter::new()?))
}

/// How a report names `device`.
pub(crate) fn device_name(device: &Device) -> String {
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
