fn main() { let _ = tasker_orchestration::orchestration::bootstrap::OrchestrationBootstrap::bootstrap; }
