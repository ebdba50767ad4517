"""The operator's tools, on top of the runner: doctor, status, the demo, the settings' docs."""
