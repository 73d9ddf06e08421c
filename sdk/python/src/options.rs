//! Keyword options from Python, checked and converted by name: a bad value is a
//! `ConfigError` that names the option, never a bare OverflowError or a wrapped number.

use crate::errors::config;
use pyo3::PyResult;
use std::time::Duration;

/// `ms` milliseconds of option `name` as a duration (finite, 0 or more).
pub(crate) fn millis(name: &str, ms: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(ms / 1000.0).map_err(|_| {
        config(format!(
            "{name}={ms}: expected milliseconds, a finite number 0 or more"
        ))
    })
}

/// `value` seconds of a timeout `name` as a duration (finite, 0 or more).
pub(crate) fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        config(format!(
            "{name} {value}: give seconds, a finite number 0 or more"
        ))
    })
}

/// An unsigned integer type a keyword option converts to, with its largest value.
pub(crate) trait Unsigned: TryFrom<i128> {
    const MAX: u128;
}

impl Unsigned for u8 {
    const MAX: u128 = u8::MAX as u128;
}

impl Unsigned for u64 {
    const MAX: u128 = u64::MAX as u128;
}

impl Unsigned for u32 {
    const MAX: u128 = u32::MAX as u128;
}

impl Unsigned for usize {
    const MAX: u128 = usize::MAX as u128;
}

/// Option `name`'s `value` as a `T`: taken from Python as an `i128` so that a negative
/// or oversized number is a ConfigError naming the option, not PyO3's bare
/// OverflowError.
pub(crate) fn whole<T: Unsigned>(name: &str, value: i128) -> PyResult<T> {
    T::try_from(value).map_err(|_| {
        config(format!(
            "{name}={value}: want a whole number from 0 to {}",
            T::MAX
        ))
    })
}
