"""Build step for the one compiled module, protocol/_kernels (everything else is in pyproject.toml).

The module is optional: where it does not build (no compiler), protocol/contexts.py
and protocol/ricecode.py use their numpy versions of the same calls, with the same results.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("patchswarm.protocol._kernels", ["protocol/_kernels.c"],
                             extra_compile_args=["-O3", "-std=c11"], optional=True)])
