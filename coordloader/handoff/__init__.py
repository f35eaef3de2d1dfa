"""Training -> serving handoff: `save` (a sharded state to coordloader's sharded format),
`consolidate` (sharded -> plain HF checkpoint), `dump` (each rank's tensors as loaded)."""
