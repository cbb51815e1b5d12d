"""Build of asyncrl's one compiled module (the rest of the project is in pyproject.toml).

asyncrl/protocol/_hotpath.c is the end of the group fast path (checks after msgspec, value scan, the
Group). It is optional: without a C compiler the install goes on and asyncrl/protocol/group_codec.py
runs its Python reference instead (same answers, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "asyncrl.protocol._hotpath",
            sources=["asyncrl/protocol/_hotpath.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall"],
            optional=True,
        )
    ]
)
