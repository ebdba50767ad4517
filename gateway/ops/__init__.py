"""The operator's tools: doctor, status, the runner's metrics endpoint, traces, the demo, the settings' docs."""
