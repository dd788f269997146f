"""Layer 5: the web dashboard over steps, jobs and telemetry. Not built yet."""
