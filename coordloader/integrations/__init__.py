"""Serving engines' ends of the handoff.

``globaltensor``: a tensor that reports a checkpoint tensor's global shape but holds only
this rank's planned boxes, so a serving engine's own per-layer weight loaders can narrow
it as if it were whole (pure torch). ``vllm``: the ``coordloader`` vLLM load format
(imports vLLM only when its loader is used). Nothing in the package imports this folder.
"""
