//! Adding one f32 slice into another, on one thread or on rayon's pool.

use rayon::prelude::*;

/// Elements a task of [`par_add_assign`] adds: 256 KiB of each operand.
const SPAN: usize = 1 << 16;

crate::dispatch! {
    /// `acc[i] += x[i]`, over the shorter of the two.
    pub fn add_assign(acc: &mut [f32], x: &[f32]) -> () {
        for (a, &v) in acc.iter_mut().zip(x) {
            *a += v;
        }
    }
}

/// [`add_assign`] shared among rayon's workers, 65,536 elements a task
/// (a shorter slice on the calling thread, handed to no one): the same
/// bits, each element being one addition.
pub fn par_add_assign(acc: &mut [f32], x: &[f32]) {
    if acc.len().min(x.len()) <= SPAN {
        return add_assign(acc, x);
    }
    acc.par_chunks_mut(SPAN)
        .zip(x.par_chunks(SPAN))
        .for_each(|(a, x)| add_assign(a, x));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_add_each_element_once() {
        // Past two tasks' spans and not a multiple of one, with values
        // whose sums round.
        let n = 2 * SPAN + 17;
        let x: Vec<f32> = (0..n).map(|i| (i as f32).sin() * 1e3).collect();
        let acc: Vec<f32> = (0..n).map(|i| 1.0 / (i as f32 + 1.0)).collect();
        let plain: Vec<u32> = acc.iter().zip(&x).map(|(a, b)| (a + b).to_bits()).collect();
        let (mut one, mut pool) = (acc.clone(), acc);
        add_assign(&mut one, &x);
        par_add_assign(&mut pool, &x);
        assert_eq!(one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), plain);
        assert_eq!(pool.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), plain);
        // The shorter operand bounds the sum.
        let mut short = vec![1f32; 3];
        add_assign(&mut short, &[1.0, 2.0]);
        assert_eq!(short, [2.0, 3.0, 1.0]);
    }
}
