//! A custom CUDA kernel's parameters, declared once in Rust with
//! [`kernel_params!`].
//!
//! A launch through cudarc's `LaunchArgs` is a list of untyped pointers:
//! an `i32` pushed where the kernel takes a `size_t`, or a buffer of f32
//! where it reads `__half`, launches all the same and reads the wrong
//! bytes. Declared here, a kernel's parameters become a struct whose fields
//! a launch fills by name, so the compiler holds each argument to its
//! parameter's type, and which pushes them in the declaration's order
//! (with the `cuda` feature). In every build the struct also gives the C
//! declaration it stands for ([`Params::c_params`]: `const __half *`,
//! `int`, ...), which a test compares with the kernel's own declaration
//! after the C preprocessor, on a machine without a GPU.
//!
//! ```
//! use candle_kernel_params::{kernel_params, In, Out, Params};
//!
//! kernel_params! {
//!     /// `scale_<T>(const T *x, T *y, size_t n, float factor)`.
//!     pub struct Scale<T> {
//!         x: In<T>,
//!         y: Out<T>,
//!         n: usize,
//!         factor: f32,
//!     }
//! }
//!
//! assert_eq!(
//!     Scale::<half::f16>::c_params(),
//!     ["const __half *", "__half *", "size_t", "float"]
//! );
//! ```
//!
//! The crate also holds what the kernels themselves share,
//! `include/candle_kernel_params/elements.cuh`: an element widened to the
//! type it is computed in and rounded back once, and the products, sums and
//! differences rounded each on their own. A dependent's build script finds
//! the folder in `DEP_CANDLE_KERNEL_PARAMS_INCLUDE` and passes it to nvcc
//! as `-I`; a test that compiles the kernels on a CPU takes
//! [`include_dir`].
#![warn(missing_docs)]

use std::marker::PhantomData;
use std::path::PathBuf;

/// The folder holding `candle_kernel_params/elements.cuh`, for a kernel's
/// `#include "candle_kernel_params/elements.cuh"` (the path a dependent's
/// build script reads in `DEP_CANDLE_KERNEL_PARAMS_INCLUDE`).
pub fn include_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/include"))
}

#[cfg(feature = "cuda")]
#[doc(hidden)]
pub use candle_core::cuda_backend::cudarc::driver::LaunchArgs;

/// An element type of device memory, by the name a kernel gives it.
pub trait Elem: 'static + Repr {
    /// Its C name (CUDA's for the half types).
    const C: &'static str;
}

/// What a launch needs of an element passed by value ([`Val`]): cudarc's
/// `DeviceRepr` with the `cuda` feature, nothing without it.
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub trait Repr: candle_core::cuda_backend::cudarc::driver::DeviceRepr {}
#[cfg(feature = "cuda")]
impl<T: candle_core::cuda_backend::cudarc::driver::DeviceRepr> Repr for T {}

/// What a launch needs of an element passed by value ([`Val`]): cudarc's
/// `DeviceRepr` with the `cuda` feature, nothing without it.
#[cfg(not(feature = "cuda"))]
#[doc(hidden)]
pub trait Repr {}
#[cfg(not(feature = "cuda"))]
impl<T> Repr for T {}

impl Elem for f32 {
    const C: &'static str = "float";
}
impl Elem for f64 {
    const C: &'static str = "double";
}
impl Elem for half::f16 {
    const C: &'static str = "__half";
}
impl Elem for half::bf16 {
    const C: &'static str = "__nv_bfloat16";
}
/// A class index or other count a kernel reads (`const unsigned int *`).
impl Elem for u32 {
    const C: &'static str = "unsigned int";
}
/// The element of a kernel's shape and stride arrays (`const size_t *`).
impl Elem for usize {
    const C: &'static str = "size_t";
}

/// One parameter of a kernel: what a launch passes for it, and how the
/// kernel declares it.
pub trait Param {
    /// What a launch passes: a view of device memory, a device address or
    /// a value. (In a build without the `cuda` feature there is no device
    /// memory, and a view's field holds nothing.)
    type Arg<'a>;

    /// The parameter's C type as a declaration spells it after the
    /// preprocessor, without its name, one space between words and none
    /// before or after `*`'s run: `const float *`, `size_t`.
    fn c_type() -> String;

    /// Pushes `arg` onto `launch`.
    #[cfg(feature = "cuda")]
    fn push<'a: 'b, 'b>(arg: &'b mut Self::Arg<'a>, launch: &mut LaunchArgs<'b>);
}

/// A pointer to elements the kernel only reads: `const T *`, passed as a
/// `CudaView`.
pub struct In<T>(PhantomData<T>);

/// A pointer to elements the kernel writes (and may read): `T *`, passed
/// as a `CudaViewMut`.
pub struct Out<T>(PhantomData<T>);

impl<T: Elem> Param for In<T> {
    #[cfg(feature = "cuda")]
    type Arg<'a> = candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>;
    #[cfg(not(feature = "cuda"))]
    type Arg<'a> = PhantomData<&'a T>;

    fn c_type() -> String {
        format!("const {} *", T::C)
    }

    #[cfg(feature = "cuda")]
    fn push<'a: 'b, 'b>(arg: &'b mut Self::Arg<'a>, launch: &mut LaunchArgs<'b>) {
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        launch.arg(&*arg);
    }
}

impl<T: Elem> Param for Out<T> {
    #[cfg(feature = "cuda")]
    type Arg<'a> = candle_core::cuda_backend::cudarc::driver::CudaViewMut<'a, T>;
    #[cfg(not(feature = "cuda"))]
    type Arg<'a> = PhantomData<&'a mut T>;

    fn c_type() -> String {
        format!("{} *", T::C)
    }

    #[cfg(feature = "cuda")]
    fn push<'a: 'b, 'b>(arg: &'b mut Self::Arg<'a>, launch: &mut LaunchArgs<'b>) {
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        launch.arg(arg);
    }
}

/// A pointer to elements the kernel only reads, `const T *`, passed as a
/// device address (a `CUdeviceptr`) where a view cannot be: where the
/// kernel takes the same buffer as an input and its output ([`PtrMut`]), or
/// where it takes a null pointer (0) for "none". An address is a bare
/// `u64`: unlike a view's, its element type and its buffer's lifetime are
/// the launch's to keep (the guard of `device_ptr` held until the launch
/// is queued).
pub struct Ptr<T>(PhantomData<T>);

/// A pointer to elements the kernel writes, `T *`, passed as a device
/// address (see [`Ptr`]).
pub struct PtrMut<T>(PhantomData<T>);

/// An element passed by value, by the kernel's name for it: `T` where
/// the kernel is generic over the element type (`__half mul`).
pub struct Val<T>(PhantomData<T>);

/// Pointers passed as addresses: a `u64` in every build.
macro_rules! address {
    ($($kind:ident => $c:literal),* $(,)?) => {$(
        impl<T: Elem> Param for $kind<T> {
            type Arg<'a> = u64;

            fn c_type() -> String {
                format!($c, T::C)
            }

            #[cfg(feature = "cuda")]
            fn push<'a: 'b, 'b>(arg: &'b mut Self::Arg<'a>, launch: &mut LaunchArgs<'b>) {
                use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
                launch.arg(&*arg);
            }
        }
    )*};
}

address! {
    Ptr => "const {} *",
    PtrMut => "{} *",
}

impl<T: Elem> Param for Val<T> {
    type Arg<'a> = T;

    fn c_type() -> String {
        T::C.to_string()
    }

    #[cfg(feature = "cuda")]
    fn push<'a: 'b, 'b>(arg: &'b mut Self::Arg<'a>, launch: &mut LaunchArgs<'b>) {
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        launch.arg(&*arg);
    }
}

/// Scalars, passed by value, by their C names.
macro_rules! scalar {
    ($($t:ty => $c:literal),* $(,)?) => {$(
        impl Param for $t {
            type Arg<'a> = $t;

            fn c_type() -> String {
                $c.to_string()
            }

            #[cfg(feature = "cuda")]
            fn push<'a: 'b, 'b>(arg: &'b mut Self::Arg<'a>, launch: &mut LaunchArgs<'b>) {
                use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
                launch.arg(&*arg);
            }
        }
    )*};
}

scalar! {
    i32 => "int",
    u32 => "unsigned int",
    i64 => "long long",
    usize => "size_t",
    f32 => "float",
    f64 => "double",
}

/// A kernel's parameter list: what [`kernel_params!`] implements.
pub trait Params {
    /// Each parameter's C type, in order (see [`Param::c_type`]).
    fn c_params() -> Vec<String>;
}

/// Declares a kernel's parameters as a struct, generic over the element
/// type `T` (an [`Elem`]), one field per parameter in the kernel's order,
/// each of a [`Param`] type: [`In<T>`] (`const T *`), [`Out<T>`] (`T *`),
/// an element type fixed as `In<f32>`, [`Ptr<T>`] and [`PtrMut<T>`] (the
/// same pointers as addresses), [`Val<T>`] (a `T` by value), or a scalar
/// (`i32`, `u32`, `i64`, `usize`, `f32`, `f64`).
///
/// The struct `Name<'a, T>` has those fields (a `CudaView<'a, _>` for an
/// `In`, a `CudaViewMut<'a, _>` for an `Out`, a `u64` address for a `Ptr`
/// or a `PtrMut`, a value for a `Val` or a scalar) and
/// implements [`Params`]; with this crate's `cuda` feature, its `push`
/// pushes them onto a `LaunchArgs` in order.
#[macro_export]
macro_rules! kernel_params {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident<$t:ident> {
            $($(#[$fmeta:meta])* $field:ident: $param:ty),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        // Built only where a crate's tests read its declaration.
        #[allow(dead_code)]
        $vis struct $name<'a, $t: $crate::Elem> {
            $($(#[$fmeta])* $vis $field: <$param as $crate::Param>::Arg<'a>,)+
        }

        impl<$t: $crate::Elem> $crate::Params for $name<'_, $t> {
            fn c_params() -> Vec<String> {
                vec![$(<$param as $crate::Param>::c_type()),+]
            }
        }

        $crate::__with_cuda! {
            impl<'a, $t: $crate::Elem> $name<'a, $t> {
                /// Pushes every field onto `launch`, in the kernel's order.
                #[allow(dead_code)]
                $vis fn push<'b>(&'b mut self, launch: &mut $crate::LaunchArgs<'b>) {
                    $(<$param as $crate::Param>::push(&mut self.$field, launch);)+
                }
            }
        }
    };
}

/// Its input where this crate has the `cuda` feature, nothing elsewhere.
#[cfg(feature = "cuda")]
#[doc(hidden)]
#[macro_export]
macro_rules! __with_cuda {
    ($($item:tt)*) => { $($item)* };
}

/// Its input where this crate has the `cuda` feature, nothing elsewhere.
#[cfg(not(feature = "cuda"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __with_cuda {
    ($($item:tt)*) => {};
}

#[cfg(test)]
mod tests {
    use super::*;

    kernel_params! {
        /// Every kind of parameter.
        struct Every<T> {
            read: In<T>,
            write: Out<T>,
            lse: In<f32>,
            out: Out<f64>,
            alias: Ptr<T>,
            alias_out: PtrMut<T>,
            info: Ptr<usize>,
            value: Val<T>,
            a: i32,
            b: u32,
            c: i64,
            n: usize,
            x: f32,
            y: f64,
        }
    }

    #[test]
    fn each_parameter_is_declared_as_c_spells_it_for_each_element_type() {
        let tail = [
            "const float *",
            "double *",
            "int",
            "unsigned int",
            "long long",
            "size_t",
            "float",
            "double",
        ];
        for (elem, got) in [
            ("float", Every::<f32>::c_params()),
            ("double", Every::<f64>::c_params()),
            ("__half", Every::<half::f16>::c_params()),
            ("__nv_bfloat16", Every::<half::bf16>::c_params()),
        ] {
            let mut want = vec![format!("const {elem} *"), format!("{elem} *")];
            want.extend(tail[..2].iter().map(|s| s.to_string()));
            want.extend([
                format!("const {elem} *"),
                format!("{elem} *"),
                "const size_t *".into(),
                elem.into(),
            ]);
            want.extend(tail[2..].iter().map(|s| s.to_string()));
            assert_eq!(got, want);
        }
    }
}
