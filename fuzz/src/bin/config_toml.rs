//! Server configuration files (`ServerConfig::load_with_env`, then the region layout
//! its capacities give). Input: TOML text, optionally a NUL byte and environment lines
//! `NAME=value`. A configuration that loads survives `to_toml` -> load unchanged.
use embarcadero_fuzz::{scratch_dir, ScratchFile};
use embarcadero_server::fuzzing::config_file;

fn main() {
    let dir = scratch_dir("config");
    // Two files opened once and rewritten per input (cheaper than `fs::write`); the
    // loader under test opens and reads them by path as `serve --config` does.
    let mut file = ScratchFile::create(dir.join("embarcadero.toml"));
    let mut again_file = ScratchFile::create(dir.join("again.toml"));
    afl::fuzz!(|data: &[u8]| {
        let (text, env) = match data.iter().position(|&b| b == 0) {
            Some(i) => (&data[..i], &data[i + 1..]),
            None => (data, &[][..]),
        };
        let env: Vec<(String, String)> = String::from_utf8_lossy(env)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        file.set(text);
        let Ok(config) = config_file(file.path(), env) else {
            return;
        };
        again_file.set(config.to_toml().as_bytes());
        let again = config_file(again_file.path(), Vec::new()).expect("to_toml output loads");
        assert_eq!(again, config);
    });
    let _ = std::fs::remove_dir_all(&dir);
}
