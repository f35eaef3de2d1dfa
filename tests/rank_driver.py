"""One rank of `python -m coordloader.load`, with the fault tests' hooks injected.

    python tests/rank_driver.py [--start-file F] [--hang-phase P --hang-file H]
        [--rename-phase P --rename-from A --rename-to B] -- LOAD ARGS

--start-file: written (with the time) once this rank is past its imports, before any group
forms. --hang-phase: as that phase of load() starts, write --hang-file and sleep, so the
test can kill a rank that is provably inside the phase. --rename-phase: as that phase
starts, rename --rename-from to --rename-to (a file gone from this rank's copy).
"""
import os
import sys
import time

# what `python -m coordloader.<tool>` does before torch is imported (coordloader/__init__.py)
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def main(argv):
    sep = argv.index("--")
    opts = dict(zip(argv[:sep:2], argv[1:sep:2]))
    from coordloader import loader
    from coordloader.cli.load import main as load_main
    if "--hang-phase" in opts:
        def hang(name):
            if name == opts["--hang-phase"]:
                with open(opts["--hang-file"], "w") as f:
                    f.write(repr(time.time()))
                time.sleep(3600)
        loader.PHASE_HOOKS.append(hang)
    if "--rename-phase" in opts:
        def rename(name):
            if name == opts["--rename-phase"]:
                os.rename(opts["--rename-from"], opts["--rename-to"])
        loader.PHASE_HOOKS.append(rename)
    if "--start-file" in opts:
        with open(opts["--start-file"], "w") as f:
            f.write(repr(time.time()))
    return load_main(argv[sep + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
