"""PEP 517 build backend: setuptools, plus the pybind11 VMM extension from ``csrc/``.

pyproject.toml cannot name pybind11's header directory (it lives in the build environment),
so this thin in-tree backend declares the extension and hands everything else to setuptools.
The extension links against nothing but libc: the CUDA driver is opened at run time.
"""

from __future__ import annotations

import os

from setuptools import Extension
from setuptools import build_meta as _setuptools

_SOURCES = ["arena.cpp", "host_driver.cpp", "cuda_driver.cpp", "bindings.cpp"]
_WARNINGS = ["-Wall", "-Wextra", "-Werror", "-Wno-missing-field-initializers"]


def _extension() -> Extension:
    import pybind11

    here = os.path.relpath(os.path.dirname(os.path.abspath(__file__)))
    return Extension(
        "dynoff.allocator._vmm",
        sources=[os.path.join(here, src) for src in _SOURCES],
        include_dirs=[pybind11.get_include(), here],
        language="c++",
        extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", *_WARNINGS],
        extra_link_args=["-ldl"],
    )


class _Backend(_setuptools._BuildMetaBackend):  # HACK(setuptools-private): run_setup is the
    # one hook setuptools offers for adding ext_modules without a setup.py (setuptools>=77).
    def run_setup(self, setup_script: str = "setup.py") -> None:
        from setuptools import setup

        setup(ext_modules=[_extension()])


_backend = _Backend()
get_requires_for_build_wheel = _backend.get_requires_for_build_wheel
get_requires_for_build_sdist = _backend.get_requires_for_build_sdist
get_requires_for_build_editable = _backend.get_requires_for_build_editable
prepare_metadata_for_build_wheel = _backend.prepare_metadata_for_build_wheel
prepare_metadata_for_build_editable = _backend.prepare_metadata_for_build_editable
build_wheel = _backend.build_wheel
build_sdist = _backend.build_sdist
build_editable = _backend.build_editable
