"""The relay's per-chunk path in C (router/chunkpath.py says what it does), the one part of
the build pyproject.toml cannot declare without setuptools' experimental ``ext-modules``
table. Optional: without a C compiler the install goes on and the router runs the same path
in Python."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "firstbyte.router._chunkpath",
            # Through the symlink: the sdist holds firstbyte/ only.
            sources=["firstbyte/router/_chunkpath.c"],
            optional=True,
        )
    ]
)
