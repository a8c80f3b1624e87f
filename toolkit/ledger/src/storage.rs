//! Which storage a tensor is on, and its size.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Storage, Tensor};

/// A key equal for tensors on the same storage, and that storage's bytes:
/// the whole buffer on the CPU (a view of part of it still holds it all),
/// the viewed elements on other devices.
pub(crate) fn identity_and_bytes(t: &Tensor) -> (usize, u64) {
    let (storage, layout) = t.storage_and_layout();
    let key = std::ptr::from_ref::<Storage>(&storage).addr();
    let viewed = (layout.shape().elem_count() * t.dtype().size_in_bytes()) as u64;
    let bytes = match &*storage {
        Storage::Cpu(cpu) => cpu_bytes(cpu).unwrap_or(viewed),
        _ => viewed,
    };
    (key, bytes)
}

fn cpu_bytes(cpu: &CpuStorage) -> Option<u64> {
    let dtype = cpu.dtype();
    let len = match dtype {
        DType::U8 => cpu.as_slice::<u8>().ok()?.len(),
        DType::U32 => cpu.as_slice::<u32>().ok()?.len(),
        DType::I64 => cpu.as_slice::<i64>().ok()?.len(),
        DType::BF16 => cpu.as_slice::<half::bf16>().ok()?.len(),
        DType::F16 => cpu.as_slice::<half::f16>().ok()?.len(),
        DType::F32 => cpu.as_slice::<f32>().ok()?.len(),
        DType::F64 => cpu.as_slice::<f64>().ok()?.len(),
        _ => return None,
    };
    Some((len * dtype.size_in_bytes()) as u64)
}
