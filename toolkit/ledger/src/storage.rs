//! Which storage a tensor is on, and its size.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Storage, Tensor};

/// A key equal for tensors on the same storage, and that storage's bytes:
/// the whole buffer on the CPU (a view of part of it still holds it all);
/// on other devices, whose buffers candle does not size, as much of it as
/// the view reaches (its extent), so that the largest over a storage's
/// nodes is the buffer.
pub(crate) fn identity_and_bytes(t: &Tensor) -> (usize, u64) {
    let (storage, layout) = t.storage_and_layout();
    let key = std::ptr::from_ref::<Storage>(&storage).addr();
    let reached = (extent(layout) * t.dtype().size_in_bytes()) as u64;
    let bytes = match &*storage {
        Storage::Cpu(cpu) => cpu_bytes(cpu).unwrap_or(reached),
        _ => reached,
    };
    (key, bytes)
}

/// Elements of its storage a view reaches: from the storage's start to one
/// past the view's last element. A broadcast (a stride of 0) reaches its
/// source's elements once, however many times it shows them: counting the
/// view's elements instead counted a weight broadcast over a batch once
/// per sequence.
fn extent(layout: &Layout) -> usize {
    let dims = layout.shape().dims();
    if dims.contains(&0) {
        return 0;
    }
    let last = dims
        .iter()
        .zip(layout.stride())
        .map(|(&d, &s)| (d - 1) * s)
        .sum::<usize>();
    layout.start_offset() + last + 1
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn reached(t: &Tensor) -> usize {
        extent(t.layout())
    }

    #[test]
    fn a_view_reaches_what_it_can_read_of_its_storage() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::zeros((6, 4), DType::F32, &dev)?;
        assert_eq!(reached(&w), 24);
        // Transposed: the same 24 elements.
        assert_eq!(reached(&w.t()?), 24);
        // Broadcast over a batch of 8: still the weight's 24, not 192.
        let b = w.broadcast_left(8)?;
        assert_eq!(b.elem_count(), 192);
        assert_eq!(reached(&b), 24);
        assert_eq!(reached(&b.t()?), 24);
        // The first third of a fused projection's columns reaches up to
        // its last row's end; the last third reaches the buffer's end.
        let qkv = Tensor::zeros((5, 9), DType::F32, &dev)?;
        assert_eq!(reached(&qkv.narrow(1, 0, 3)?), 4 * 9 + 3);
        assert_eq!(reached(&qkv.narrow(1, 6, 3)?), 45);
        assert_eq!(reached(&qkv.narrow(0, 1, 2)?), 27);
        assert_eq!(reached(&qkv.narrow(0, 1, 0)?), 0);
        Ok(())
    }
}
