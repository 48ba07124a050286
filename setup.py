"""The relay's per-chunk path in C (router/chunkpath.py says what it does), the one part of
the build pyproject.toml cannot declare without setuptools' experimental ``ext-modules``
table. Optional: without a C compiler the install goes on and the router runs the same path
in Python.

pip builds in the checkout (README: ``pip wheel --no-deps . -w dist``), and setuptools packs
whatever ``build/lib`` holds: a module deleted or renamed since an earlier build would ride
along in every later wheel. Each build starts that folder afresh."""

import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


class FreshBuildPy(build_py):
    """``build_py`` into an emptied ``build/lib``: only the checkout's modules are packed."""

    def run(self) -> None:
        build_base = Path(self.get_finalized_command("build").build_base).resolve()
        build_lib = Path(self.build_lib).resolve()
        # Only a folder under build/ (an editable install builds elsewhere: left alone).
        if not getattr(self, "editable_mode", False) and build_base in build_lib.parents:
            shutil.rmtree(build_lib, ignore_errors=True)
        super().run()


setup(
    cmdclass={"build_py": FreshBuildPy},
    ext_modules=[
        Extension(
            "firstbyte.router._chunkpath",
            # Through the symlink: the sdist holds firstbyte/ only.
            sources=["firstbyte/router/_chunkpath.c"],
            libraries=["m"],  # fmod (elapsed_ms)
            optional=True,
        )
    ],
)
