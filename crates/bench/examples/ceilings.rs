//! Prints the machine's ceilings at full size.
//!
//! Usage: `cargo run --release -p embarcadero-bench --example ceilings [DIR] [--quick]`
//! DIR is where the fdatasync file goes (default: the system temp directory).

use embarcadero_bench::ceilings::{format_table, measure_all, CeilingPlan};
use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let dir = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map_or_else(std::env::temp_dir, PathBuf::from);
    println!("fdatasync dir: {}", dir.display());
    let ceilings = measure_all(&CeilingPlan::new(&dir, quick))?;
    print!("{}", format_table(&ceilings));
    Ok(())
}
