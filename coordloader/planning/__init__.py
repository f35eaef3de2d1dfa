"""Stage 2, the plan: metadata + layout + rules -> `Plan` (`model`). Pure: no file I/O, no
torch.distributed, no engine. `planner` drives the passes, `placement` places each tensor
by its strategy (`strategies`: each one's params, check and placement), `rules/` holds
the presets and rule files, `rankgroups` finds the ranks of each class and the rank
classes, `runs` turns boxes into byte runs, `cover` proves exact cover."""
