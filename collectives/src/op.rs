//! Reduction operations: the built-in [`Op`]s over the primitive element types ([`Reducible`]),
//! and user-defined ones ([`UserOp`]), commutative or not.
//!
//! An operation combines two equally long vectors element by element. The order is MPI's:
//! [`ReduceOp::combine`]`(lower, higher)` leaves `lower ∘ higher` in `higher`, where `lower`
//! holds the contributions of lower ranks. The algorithms keep that order for operations that
//! are not commutative, so a reduction over ranks `0..n` computes `x₀ ∘ x₁ ∘ … ∘ xₙ₋₁` exactly
//! (associativity is assumed, as in MPI); commutative operations may be combined in any order.

use std::fmt;
use std::sync::Arc;

use rankweave_core::Error;

/// The built-in reduction operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Sum (wrapping for integers).
    Sum,
    /// Product (wrapping for integers).
    Product,
    /// Minimum (for floats, NaN-ignoring as `f64::min`).
    Min,
    /// Maximum (for floats, NaN-ignoring as `f64::max`).
    Max,
    /// Bitwise and (integers only).
    BitAnd,
    /// Bitwise or (integers only).
    BitOr,
    /// Bitwise exclusive or (integers only).
    BitXor,
    /// Logical and: nonzero is true; the result is 1 or 0 (integers only).
    LogicalAnd,
    /// Logical or: nonzero is true; the result is 1 or 0 (integers only).
    LogicalOr,
}

impl Op {
    /// The operation's name, as in error messages.
    pub fn name(self) -> &'static str {
        match self {
            Op::Sum => "sum",
            Op::Product => "product",
            Op::Min => "min",
            Op::Max => "max",
            Op::BitAnd => "bitwise and",
            Op::BitOr => "bitwise or",
            Op::BitXor => "bitwise xor",
            Op::LogicalAnd => "logical and",
            Op::LogicalOr => "logical or",
        }
    }
}

/// Element types the built-in operations apply to.
pub trait Reducible: bytemuck::Pod + Send + Sync + 'static {
    /// Whether `op` is defined for this type (bitwise and logical operations are not, for
    /// floats).
    fn supports(op: Op) -> bool;
    /// `inout[i] = lower[i] op inout[i]` for every `i`. Called only with a supported `op` and
    /// slices of equal length.
    fn apply(op: Op, lower: &[Self], inout: &mut [Self]);
}

/// `inout[i] = f(lower[i], inout[i])`. Generic over `f` (not a function pointer), so each
/// operation's loop is compiled on its own and vectorizes.
#[inline(always)]
fn zip_apply<T: Copy>(lower: &[T], inout: &mut [T], f: impl Fn(T, T) -> T) {
    for (o, l) in inout.iter_mut().zip(lower) {
        *o = f(*l, *o);
    }
}

macro_rules! reducible_int {
    ($($t:ty),*) => {$(
        impl Reducible for $t {
            fn supports(_: Op) -> bool {
                true
            }
            fn apply(op: Op, lower: &[Self], inout: &mut [Self]) {
                match op {
                    Op::Sum => zip_apply(lower, inout, <$t>::wrapping_add),
                    Op::Product => zip_apply(lower, inout, <$t>::wrapping_mul),
                    Op::Min => zip_apply(lower, inout, |a, b| a.min(b)),
                    Op::Max => zip_apply(lower, inout, |a, b| a.max(b)),
                    Op::BitAnd => zip_apply(lower, inout, |a, b| a & b),
                    Op::BitOr => zip_apply(lower, inout, |a, b| a | b),
                    Op::BitXor => zip_apply(lower, inout, |a, b| a ^ b),
                    Op::LogicalAnd => zip_apply(lower, inout, |a, b| (a != 0 && b != 0) as $t),
                    Op::LogicalOr => zip_apply(lower, inout, |a, b| (a != 0 || b != 0) as $t),
                }
            }
        }
    )*};
}

reducible_int!(
    u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize
);

macro_rules! reducible_float {
    ($($t:ty),*) => {$(
        impl Reducible for $t {
            fn supports(op: Op) -> bool {
                matches!(op, Op::Sum | Op::Product | Op::Min | Op::Max)
            }
            fn apply(op: Op, lower: &[Self], inout: &mut [Self]) {
                match op {
                    Op::Sum => zip_apply(lower, inout, |a, b| a + b),
                    Op::Product => zip_apply(lower, inout, |a, b| a * b),
                    Op::Min => zip_apply(lower, inout, <$t>::min),
                    Op::Max => zip_apply(lower, inout, <$t>::max),
                    _ => {}
                }
            }
        }
    )*};
}

reducible_float!(f32, f64);

type CombineFn<T> = dyn Fn(&[T], &mut [T]) + Send + Sync;

/// A user-defined reduction: a function `f(lower, inout)` that leaves `lower ∘ inout` in
/// `inout`, and whether `∘` is commutative.
pub struct UserOp<T> {
    f: Arc<CombineFn<T>>,
    commutative: bool,
}

impl<T> Clone for UserOp<T> {
    fn clone(&self) -> Self {
        UserOp {
            f: Arc::clone(&self.f),
            commutative: self.commutative,
        }
    }
}

impl<T> fmt::Debug for UserOp<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UserOp")
            .field("commutative", &self.commutative)
            .finish_non_exhaustive()
    }
}

impl<T> UserOp<T> {
    /// A commutative operation (the algorithms may combine in any order).
    pub fn commutative(f: impl Fn(&[T], &mut [T]) + Send + Sync + 'static) -> Self {
        UserOp {
            f: Arc::new(f),
            commutative: true,
        }
    }

    /// An operation that is associative but not commutative: results are combined in rank
    /// order, `x₀ ∘ x₁ ∘ … ∘ xₙ₋₁`.
    pub fn non_commutative(f: impl Fn(&[T], &mut [T]) + Send + Sync + 'static) -> Self {
        UserOp {
            f: Arc::new(f),
            commutative: false,
        }
    }
}

/// A reduction operation: built in or user-defined. Every collective that reduces takes
/// `impl Into<ReduceOp<T>>`, so both [`Op::Sum`] (for a [`Reducible`] `T`) and a [`UserOp`] (for
/// any `Pod` `T`) can be passed.
#[derive(Clone, Debug)]
pub struct ReduceOp<T> {
    kind: Kind<T>,
}

#[derive(Clone)]
enum Kind<T> {
    Builtin {
        op: Op,
        apply: fn(Op, &[T], &mut [T]),
        supported: bool,
    },
    User(UserOp<T>),
}

impl<T> fmt::Debug for Kind<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Kind::Builtin { op, .. } => write!(f, "{op:?}"),
            Kind::User(u) => u.fmt(f),
        }
    }
}

impl<T: Reducible> From<Op> for ReduceOp<T> {
    fn from(op: Op) -> Self {
        ReduceOp {
            kind: Kind::Builtin {
                op,
                apply: T::apply,
                supported: T::supports(op),
            },
        }
    }
}

impl<T> From<UserOp<T>> for ReduceOp<T> {
    fn from(op: UserOp<T>) -> Self {
        ReduceOp {
            kind: Kind::User(op),
        }
    }
}

impl<T: Copy> ReduceOp<T> {
    /// Checks that the operation applies to `T` (bitwise and logical operations do not apply to
    /// floats), before anything is sent.
    pub fn check(&self) -> Result<(), Error> {
        match &self.kind {
            Kind::Builtin {
                op,
                supported: false,
                ..
            } => Err(Error::InvalidArgument(format!(
                "the {} reduction is not defined for {}",
                op.name(),
                std::any::type_name::<T>()
            ))),
            _ => Ok(()),
        }
    }

    /// Whether operands may be combined in any order.
    pub fn is_commutative(&self) -> bool {
        match &self.kind {
            Kind::Builtin { .. } => true,
            Kind::User(u) => u.commutative,
        }
    }

    /// `inout = lower ∘ inout`. A length mismatch (ranks that passed vectors of different
    /// lengths) is an error, not a panic.
    pub fn combine(&self, lower: &[T], inout: &mut [T]) -> Result<(), Error> {
        if lower.len() != inout.len() {
            return Err(Error::InvalidArgument(format!(
                "reduction operands differ in length ({} and {} elements): every rank must \
                 contribute the same number of elements",
                lower.len(),
                inout.len()
            )));
        }
        match &self.kind {
            Kind::Builtin { op, apply, .. } => apply(*op, lower, inout),
            Kind::User(u) => (u.f)(lower, inout),
        }
        Ok(())
    }

    /// `lower = lower ∘ higher` (the result kept in the lower operand's buffer).
    pub fn combine_into_lower(&self, lower: &mut [T], higher: &[T]) -> Result<(), Error> {
        if self.is_commutative() {
            return self.combine(higher, lower);
        }
        let mut out = higher.to_vec();
        self.combine(lower, &mut out)?;
        lower.copy_from_slice(&out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_on_integers_and_floats() {
        let mut v = [1u32, 5, 0];
        u32::apply(Op::Sum, &[2, 3, 4], &mut v);
        assert_eq!(v, [3, 8, 4]);
        u32::apply(Op::LogicalAnd, &[1, 0, 7], &mut v);
        assert_eq!(v, [1, 0, 1]);
        let mut f = [1.5f64, -2.0];
        f64::apply(Op::Max, &[0.5, 3.0], &mut f);
        assert_eq!(f, [1.5, 3.0]);
        assert!(!f32::supports(Op::BitXor));
        let op: ReduceOp<f32> = Op::BitXor.into();
        assert!(matches!(op.check(), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn order_of_a_non_commutative_op() {
        // 2×2 matrix product, row-major: not commutative.
        let op: ReduceOp<i64> = UserOp::non_commutative(|a: &[i64], b: &mut [i64]| {
            let r = [
                a[0] * b[0] + a[1] * b[2],
                a[0] * b[1] + a[1] * b[3],
                a[2] * b[0] + a[3] * b[2],
                a[2] * b[1] + a[3] * b[3],
            ];
            b.copy_from_slice(&r);
        })
        .into();
        let x = [1, 1, 0, 1];
        let y = [1, 0, 1, 1];
        let mut inout = y;
        op.combine(&x, &mut inout).unwrap();
        assert_eq!(inout, [2, 1, 1, 1]); // x·y
        let mut lower = x;
        op.combine_into_lower(&mut lower, &y).unwrap();
        assert_eq!(lower, [2, 1, 1, 1]); // still x·y
        assert!(op.combine(&[1, 2], &mut [1, 2, 3]).is_err());
    }
}
