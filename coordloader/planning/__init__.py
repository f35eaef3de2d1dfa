"""Stage 2, the plan: metadata + layout + rules -> `Plan` (`model`). Pure: no file I/O, no
torch.distributed, no engine. `planner` places every tensor, `rules/` holds the strategy
vocabulary and presets, `runs` turns boxes into byte runs, `cover` proves exact cover."""
