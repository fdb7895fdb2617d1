"""Build hook for the optional native optimizer kernel; package metadata lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lightning_ratel._C",
            ["csrc/adamw.c"],
            depends=["csrc/checksum.h"],
            # No -march=native: the kernel picks AVX-512, AVX2 or scalar code at run time. Contraction stays off
            # so that only the explicit FMAs (where torch uses one) fuse; no errno lets sqrtf be one instruction.
            extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
