"""Build hook for the one compiled piece, the CPU digest kernel. Everything else is in
pyproject.toml. The extension is optional: without a C compiler the install still
succeeds and coordloader.verify.digest uses its pure-torch route (slower, same digests)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "coordloader.verify._digestkernel", ["coordloader/verify/_digestkernel.c"],
    extra_compile_args=["-O3", "-std=c99"], optional=True)])
