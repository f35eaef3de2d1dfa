"""Training -> serving handoff: `save` (what training ranks hold, `pieces.py`: a plan's
slices, DTensors, boxes given by hand -> coordloader's sharded format), `consolidate` (any
readable checkpoint -> plain HF), `dump` (each rank's tensors as loaded), `publish`
(staged, marker-guarded publication shared by save and consolidate; `recover_save`)."""
