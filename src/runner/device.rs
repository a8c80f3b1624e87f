//! Choosing the device and the meter that measures it, for cells run in
//! this process.

use std::sync::Arc;

use workbook_sdk::candle::Device;
pub use workbook_sdk::device::DeviceChoice;
use workbook_sdk::Meter;

use super::RunError;

pub(crate) fn select_device(choice: DeviceChoice) -> Result<Device, RunError> {
    workbook_sdk::device::select(choice).map_err(RunError::Device)
}

pub(crate) fn select_meter(device: &Device) -> Result<Arc<dyn Meter>, RunError> {
    Ok(workbook_sdk::device::meter_for(device)?)
}

pub(crate) use workbook_sdk::device::name as device_name;
