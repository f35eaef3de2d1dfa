"""Stage 1, checkpoint metadata: discover the files of a checkpoint, read and strictly
validate every safetensors header and index (`reader`), and describe the result as frozen
`metadata`; `dtypes` maps safetensors dtype names; `fileio` is the atomic safetensors
writer and the positioned reads the other stages share. Knows nothing of plans."""
