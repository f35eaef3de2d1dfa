"""`python -m coordloader.consolidate SRC OUT: a coordloader sharded checkpoint to plain HF.`"""
from __future__ import annotations

from coordloader.cli.common import run_command
from coordloader.handoff.consolidate import DEFAULT_BLOCK_BYTES, consolidate
from coordloader.text import ArgumentParser, positive_number


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m coordloader.consolidate",
                                 description="Write a plain HF safetensors checkpoint (one tensor per "
                                             "name, standard index) from a coordloader sharded one.")
    ap.add_argument("sharded", help="source checkpoint directory (coordloader sharded, torch DCP "
                                    "HF sharded output, or HF)")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--max-shard-size", type=positive_number("GiB", 2.0**20), default=5.0,
                    help="GiB per output file (default 5)")
    ap.add_argument("--block-mib", type=positive_number("MiB", 2.0**20), default=DEFAULT_BLOCK_BYTES / 2**20,
                    help="memory bound: MiB assembled at a time (default 64)")
    ap.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in OUT")
    ap.add_argument("--config", default=None, metavar="PATH",
                    help="config.json to write in place of the source's (or a checkpoint "
                         "directory: its tokenizer files, chat templates and generation config "
                         "come too, replacing the source's); torch DCP's sharded output has "
                         "none")
    a = ap.parse_args(argv)
    return run_command("consolidate", lambda: _run(a))


def _run(a) -> int:
    r = consolidate(a.sharded, a.out, max_shard_bytes=max(1, int(a.max_shard_size * 2**30)),
                    block_bytes=max(1, int(a.block_mib * 2**20)), overwrite=a.overwrite,
                    config=a.config)
    print(f"wrote {r.tensors} tensors, {r.bytes / 2**20:.1f} MiB in {len(r.files)} file(s) to "
          f"{r.out_dir} in {r.seconds:.2f} s")
    return 0

