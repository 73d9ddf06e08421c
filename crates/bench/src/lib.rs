//! Benchmarks and the machine's own ceilings; owns measurement code only,
//! touches no product state.

pub mod ceilings;
