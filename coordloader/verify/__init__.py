"""Stage 4, verification: `checks` (shapes / digest / full, one gather, one verdict),
`digest` (linearly combinable content digests), `manifest` (per-tensor digests of a
checkpoint on disk)."""
