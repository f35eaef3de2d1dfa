"""Stage 2, the plan: metadata + layout + rules -> `Plan` (`model`). Pure: no file I/O, no
torch.distributed, no engine. `planner` places every tensor, `strategies` declares each
strategy (params, check, placement), `rules/` holds the presets and rule files,
`rankgroups` finds the ranks of each class and the rank classes, `runs` turns boxes into
byte runs, `cover` proves exact cover."""
