fn main() { let _ = tasker_worker::WorkerBootstrap::bootstrap; }
